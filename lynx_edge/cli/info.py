"""`lynx-edge info [MODEL]`: the config, parameter counts (total / active per token) and the
memory plan — every resource with its steady and load-peak need, what the machine (this one, or
a --profile's) has, a verdict and a hint — from config.json alone, no weights loaded. Exits 0
with the plan even when it does not fit; only bad input is an error line."""
from __future__ import annotations

from typing import Annotated, Optional

import typer

from . import ui
from .options import Device, Dtype, Int4, Int4Attn, Int8Head, Model, Offload, Profile, SwaFull, TableJson


def info(
    model: Model = "demo",
    offload: Offload = False,
    int4: Int4 = False,
    int4_attn: Int4Attn = False,
    int8_head: Int8Head = False,
    profile: Profile = None,
    device: Device = None,
    dtype: Dtype = None,
    gpu_budget: Annotated[Optional[float], typer.Option("--gpu-budget", help="GPU memory for the plan, GiB")] = None,
    batch: Annotated[int, typer.Option("--batch-size", "-b", help="sequences the KV cache is planned for")] = 1,
    ctx_size: Annotated[Optional[int], typer.Option("--ctx-size", "-c", help="context the KV cache is planned for "
                                                    "(default: min(4096, max_position_embeddings))")] = None,
    swa_full: SwaFull = False,
    output: Annotated[TableJson, typer.Option("--output", "-o", help="table | json")] = TableJson.table,
) -> None:
    """Show a model's config, parameter counts and memory plan without loading weights."""
    from ..modelinfo import checkpoint_bytes, describe, load_config, param_counts, read_quant
    from ..offload.memory import choose_device, choose_dtype, plan_memory
    from ..offload.options import OffloadOptions
    from ..offload.profile import load_profile

    prof = load_profile(profile) if profile else None  # bad names fail before the model is looked up
    cfg, where = load_config(model)
    quant = read_quant(where, cfg)
    dev = choose_device(device, prof)
    file_bytes = checkpoint_bytes(where)
    dt = choose_dtype(dtype, dev, cfg, file_bytes)
    ctx = ctx_size if ctx_size is not None else min(4096, cfg.max_position_embeddings)
    opts = OffloadOptions(gpu_budget_gib=gpu_budget, batch=batch, ctx=ctx, swa_full=swa_full)
    plan = plan_memory(cfg, device=dev, dtype=dt, offload=offload, int4=int4, quant=quant, ctx=ctx, batch=batch,
                       opts=opts, profile=prof, file_bytes=file_bytes, int4_attn=int4_attn, int8_head=int8_head)
    expert_fmt = None if quant is None else "fp8" if quant.method == "fp8" else "int4"
    counts = param_counts(cfg, expert_fmt)
    config = describe(cfg)
    if expert_fmt == "fp8":
        config["quantization"] = f"fp8 e4m3, {quant.weight_block[0]}×{quant.weight_block[1]} blocks: experts FP8"
    elif quant and quant.method == "mxfp4":  # e2m1 values with a power-of-two (e8m0) scale per 32
        config["quantization"] = f"mxfp4 (fp4 e2m1, one e8m0 scale per {quant.group_size}): experts MXFP4"
    elif quant:
        config["quantization"] = f"{quant.method} {quant.bits}-bit, group {quant.group_size}, " \
                                 f"{'symmetric' if quant.sym else 'asymmetric'}: experts INT4"
    if output is TableJson.json:
        ui.json_line({"model": where, "config": config, "params": counts, "memory": plan.report()})
        return
    ui.kv_table(f"{where}", config)
    ui.kv_table("parameters", {
        "total": ui.fmt_count(counts["total"]),
        "active per token": f"{ui.fmt_count(counts['active'])} ({100 * counts['active'] / counts['total']:.1f}%)",
        "experts": f"{ui.fmt_count(counts['expert'])} in {counts['moe_layers']} MoE layers",
        "non-expert": ui.fmt_count(counts["non_expert"]),
        "one expert": f"{ui.fmt_count(counts['params_per_expert'])} params, "
                      f"{ui.fmt_bytes(counts['expert_bytes_per_expert'])} at "
                      f"{expert_fmt or cfg.torch_dtype or 'bfloat16'}",
    })
    ui.plan_table(plan.report())
