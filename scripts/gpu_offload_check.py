#!/usr/bin/env python
"""Device check: offloaded decode of a Mixtral-8x7B-shaped model (random weights, a few layers).

Measures pinned host→device bandwidth (the PCIe roofline), then decodes with the experts in
pinned host memory and a quarter of them cached on the GPU, at B = 1 and 16, LRU + exact
routing vs lynx policy + residency-aware LYNX. Reports per-layer figures and extrapolates to
Mixtral's 32 layers; the transfer efficiency is (bytes moved / roofline) / decode time, target
≥ 85% where decode is transfer-bound. Writes gpu_offload_check.{json,md} under $OUT (or --out).

    PYTHONPATH=. python scripts/gpu_offload_check.py                 # H200, torch 2.11, ≤ 8 min
    PYTHONPATH=. python scripts/gpu_offload_check.py --dry-run       # tiny shapes on the CPU
Installs nothing; runs from the checkout.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lynx_edge.config import ModelConfig  # noqa: E402
from lynx_edge.kv_cache import KVCache  # noqa: E402
from lynx_edge.models import MoEForCausalLM  # noqa: E402
from lynx_edge.offload import OffloadOptions, attach_offload  # noqa: E402
from lynx_edge.step import decode_step, prefill  # noqa: E402

MIXTRAL = dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
               num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
               max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=1e6)
TINY = dict(MIXTRAL, vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2)
FULL_LAYERS = 32


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def pinned_bandwidth(dev, nbytes: int, reps: int = 5) -> float:
    """Best host→device GB/s of one pinned copy of nbytes (the roofline the offload path should hit)."""
    if dev.type != "cuda":
        src = torch.empty(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
    else:
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    best = float("inf")
    for _ in range(reps + 1):
        sync(dev)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(dev)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def build(layers: int, dev, dtype, tiny: bool) -> MoEForCausalLM:
    cfg = ModelConfig.from_dict(dict(TINY if tiny else MIXTRAL, num_hidden_layers=layers))
    torch.manual_seed(0)
    model = MoEForCausalLM(cfg, dtype, dev)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0, 1.0 / cfg.hidden_size**0.5 * 4)  # sharp, varied routing
            elif ".experts." in name:  # one random expert repeated: fast to make, same bytes to move
                p.copy_((torch.randn(p.shape[1:], device=dev) * 0.02).to(dtype).expand_as(p))
            else:
                p.normal_(0, 0.02)
    return model


def decode_run(model, batch: int, steps: int, prompt: int) -> dict:
    dev, rt = model.device, model.offload
    kv = KVCache(model.cfg, batch, prompt + steps + 2, model.dtype, dev)
    g = torch.Generator().manual_seed(1)
    logits = torch.cat([prefill(model, kv, b, torch.randint(0, model.cfg.vocab_size, (prompt,), generator=g).tolist())
                        for b in range(batch)])
    rows = list(range(batch))
    tok = logits.argmax(-1)
    decode_step(model, kv, rows, tok)  # one warm step, not timed
    rt.reset_stats()
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = decode_step(model, kv, rows, tok).argmax(-1)
    tok.tolist()
    sync(dev)
    dt = time.perf_counter() - t0
    s = rt.stats()
    return {"decode_s": dt, "steps": steps, **{k: s[k] for k in (
        "hit_rate", "bytes_per_decode_step", "decode_bytes_h2d", "remapped_to_resident", "remapped_slots",
        "bypasses", "cpu_expert_calls", "prefetch_bytes")}}


def transfer_microbench(rt, n: int) -> float:
    """GB/s of n back-to-back fetches through the offload Transfer (into distinct slots)."""
    dev = rt.pool.device
    slots = list(range(min(n, rt.pool.shape[0])))
    layer = rt.moe_layers[0]
    sync(dev)
    t0 = time.perf_counter()
    for i, s in enumerate(slots):
        rt.transfer.fetch(layer, i % rt.num_experts, s)
    rt.transfer.synchronize()
    dt = time.perf_counter() - t0
    rt.cache.clear()  # the slots now hold other experts than the table says
    return len(slots) * rt.store.nbytes / dt / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (smoke test)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--cache-frac", type=float, default=0.25)
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu_offload_out")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    dev = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    tiny = args.dry_run or dev.type != "cuda"
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, meta = [], {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (dry run)",
                      "torch": torch.__version__, "layers": args.layers, "steps": args.steps, "tiny": tiny}
    for B in (1, 16):
        for name, policy, lynx, prefetch in [("lru", "lru", "off", False), ("lynx", "lynx", "lynx", False),
                                             ("lru+prefetch", "lru", "off", True)]:
            if prefetch and B != 1:
                continue
            model = build(args.layers, dev, dtype, tiny)
            slots = max(1, round(args.cache_frac * args.layers * model.cfg.num_experts))
            rt = attach_offload(model, OffloadOptions(expert_slots=slots, policy=policy, lynx=lynx, prefetch=prefetch,
                                                      cpu_compute="never", batch=B, ctx=64))
            if "roofline_gbps" not in meta:
                meta["expert_bytes"] = rt.store.nbytes
                meta["roofline_gbps"] = pinned_bandwidth(dev, rt.store.nbytes)
                meta["transfer_path_gbps"] = transfer_microbench(rt, 8)
                meta["pinned_host_bytes"] = rt.store.pinned_bytes
                meta["profile"] = rt.profile.name
            r = decode_run(model, B, args.steps, args.prompt)
            step_s = r["decode_s"] / r["steps"]
            moved_s = r["bytes_per_decode_step"] / (meta["roofline_gbps"] * 1e9)
            rows.append({"batch": B, "variant": name, "expert_slots": slots, **r,
                         "step_ms": 1e3 * step_s, "tok_s": B / step_s,
                         "per_layer_ms": 1e3 * step_s / args.layers,
                         "bytes_per_layer_step": r["bytes_per_decode_step"] / args.layers,
                         "achieved_gbps": r["bytes_per_decode_step"] / step_s / 1e9,
                         "transfer_efficiency": moved_s / step_s,
                         "projected_tok_s_32_layers": B / (step_s * FULL_LAYERS / args.layers)})
            print(json.dumps(rows[-1]), flush=True)
            del rt, model
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    meta["wall_s"] = time.perf_counter() - t_start
    (out / "gpu_offload_check.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    (out / "gpu_offload_check.md").write_text(_markdown(meta, rows))
    print(_markdown(meta, rows))
    return 0


def _markdown(meta, rows) -> str:
    lines = [f"# Offloaded decode, Mixtral-8x7B shapes{' (TINY dry run)' if meta['tiny'] else ''}", "",
             f"{meta['device']}, torch {meta['torch']}, {meta['layers']} of {FULL_LAYERS} layers, random weights, "
             f"expert {meta['expert_bytes'] / 2**20:.1f} MiB. Pinned host→device roofline "
             f"{meta['roofline_gbps']:.1f} GB/s; through the offload Transfer {meta['transfer_path_gbps']:.1f} GB/s.",
             "", "| B | variant | slots | hit | MiB/step | step ms | per-layer ms | achieved GB/s | transfer eff. | "
             "tok/s (layers run) | tok/s projected 32 layers |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['variant']} | {r['expert_slots']} | {r['hit_rate']:.2f} | "
                     f"{r['bytes_per_decode_step'] / 2**20:.1f} | {r['step_ms']:.1f} | {r['per_layer_ms']:.2f} | "
                     f"{r['achieved_gbps']:.1f} | {100 * r['transfer_efficiency']:.0f}% | {r['tok_s']:.2f} | "
                     f"{r['projected_tok_s_32_layers']:.2f} |")
    lines += ["", "transfer eff. = (bytes moved / roofline) / decode time; target ≥ 85% where decode is "
              "transfer-bound (B=16, lru). 32-layer figures are projected from the layers run.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
