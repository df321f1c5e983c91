"""What would make a memory plan fit: for each resource that does not fit (or is tight), the
alternatives that do — --int4, --offload, a shorter --ctx-size, a bf16 model on a CPU, a bigger
GPU budget, more RAM — found by re-planning with the changed option (memory.build)."""
from __future__ import annotations

import math

import torch

from ..kv_cache import KVCache
from .memory import four_bit

GIB = 2**30


def _gib_up(n: int) -> str:
    return f"{math.ceil(n / GIB * 10) / 10:.1f} GiB"


def _alt(cfg, args: dict, **change):
    from .memory import build

    return build(cfg, **{**args, **change})


def _ok(plan, key: str) -> bool:
    r = plan.resource(key)
    return r is None or r.ok


def gpu_hint(plan, r, cfg, args: dict) -> str:
    four = args["int4"] or four_bit(args["quant"])
    tips: list[str] = []
    if not args["offload"]:
        alts = ([("--int4", dict(int4=True))] if not four else []) + [("--offload", dict(offload=True))] + \
               ([("--offload --int4", dict(offload=True, int4=True))] if not four else [])
        plans = [(flag, _alt(cfg, args, **ch)) for flag, ch in alts]
        best = next((f for f, p in plans if p.fits), None) or next((f for f, p in plans if _ok(p, "gpu")), None)
        if best:
            tips.append(best)
    else:
        per_tok = KVCache.bytes_needed(cfg, args["batch"], 1, args["dtype"]) - \
            KVCache.bytes_needed(cfg, args["batch"], 0, args["dtype"]) or 1  # sequence state is not per token
        kv = KVCache.bytes_needed(cfg, args["batch"], args["ctx"], args["dtype"])
        ctx_max = (r.available_bytes - (r.minimum_bytes - kv)) // per_tok
        if ctx_max >= 1:
            tips.append(f"--ctx-size {ctx_max // 256 * 256 if ctx_max >= 256 else ctx_max}")
        if not four and _ok(_alt(cfg, args, int4=True), "gpu"):
            tips.append("--int4")
    tips.append(f"a GPU budget of {_gib_up(r.need_bytes)}")
    return "try " + " or ".join(tips)


def host_hint(plan, r, cfg, args: dict) -> str:
    four = args["int4"] or four_bit(args["quant"])
    wide = plan.device == "cpu" and args["dtype"] == torch.float32  # a CPU model widened to fp32
    alts = ([("--int4", dict(int4=True))] if not four else []) + \
           ([("--dtype bfloat16", dict(dtype=torch.bfloat16))] if wide else []) + \
           ([("--int4 --dtype bfloat16", dict(int4=True, dtype=torch.bfloat16))] if wide and not four else [])
    tips = [flag for flag, ch in alts if _ok(_alt(cfg, args, **ch), r.key)][:1]
    tips.append(f"{math.ceil((r.need_bytes - r.available_bytes) / GIB)} GiB more RAM")
    return "try " + " or ".join(tips)


def add_hints(plan, cfg, args: dict) -> None:
    """Fill Resource.hint for what does not fit (and say so for what is tight)."""
    for r in plan.resources:
        if r.verdict == "tight" and not r.hint:
            r.hint = "within 10% of what the machine has: other programs may push it over"
        elif r.verdict == "does not fit":
            r.hint = gpu_hint(plan, r, cfg, args) if r.key == "gpu" else host_hint(plan, r, cfg, args)


__all__ = ["add_hints", "gpu_hint", "host_hint"]
