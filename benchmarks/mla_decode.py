"""DeepSeek-V2 multi-head latent attention: the absorbed form against the expanded one, side by side.

One MLA layer at the real DeepSeek-V2-Lite shape (tests/fixtures/real/deepseek-v2-lite-chat/
config.json: H 16, kv_lora_rank 512, qk_nope/rope/v 128/64/128, hidden 2048), random weights, a
latent cache filled to S positions. Timed: one forward of the layer (projections + attention +
o_proj) for
  decode   T = 1 new token per row after S cached ones, B rows
  prefill  T = S tokens from position 0, one row
in each form, runs interleaved (expanded, absorbed, expanded, …) so background load hits both
alike; medians, and which form `auto` picks. Both forms' outputs are compared once per shape.

    python benchmarks/mla_decode.py [--dtype float32,bfloat16] [-b 1,4] [-s 128,512,2048,8192]
        [--prefill 128,512,2048] [-r 15]
Writes benchmarks/results/mla_decode.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32,bfloat16")
    ap.add_argument("-b", "--batch", default="1,4")
    ap.add_argument("-s", "--seq", default="128,512,2048,8192")
    ap.add_argument("--prefill", default="128,512,2048")
    ap.add_argument("-r", "--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "mla_decode"))
    args = ap.parse_args()
    import torch

    from lynx_edge.config import ModelConfig
    from lynx_edge.models.deepseek_v2 import MLAttention
    from lynx_edge.models.layers import AttnBatch

    torch.set_num_threads(args.threads)
    cfg = ModelConfig.from_file(ROOT / "tests/fixtures/real/deepseek-v2-lite-chat/config.json")
    width = cfg.arch.kv_lora_rank + cfg.arch.qk_rope_head_dim

    def layer(dtype):
        torch.manual_seed(0)
        m = MLAttention(cfg, 1, dtype, torch.device("cpu"))
        with torch.no_grad():
            for name, p in m.named_parameters():
                p.copy_(torch.rand_like(p, dtype=torch.float32) * 0.5 + 0.75 if "norm" in name
                        else torch.randn_like(p, dtype=torch.float32) * p.shape[-1] ** -0.5)
        return m

    def timed(m, mode, x, ab, cache):
        m.mode = mode
        ab.__dict__.pop("_mla_cos_sin", None)  # per step, as in the model
        t = time.perf_counter()
        with torch.inference_mode():
            y = m(x, ab, cache)
        return time.perf_counter() - t, y

    rows, load = [], [os.getloadavg()[0]]
    for dname in args.dtype.split(","):
        dtype = getattr(torch, dname)
        m = layer(dtype)
        cases = [("decode", B, S) for B in map(int, args.batch.split(",")) for S in map(int, args.seq.split(","))]
        cases += [("prefill", 1, S) for S in map(int, args.prefill.split(","))]
        for phase, B, S in cases:
            T = 1 if phase == "decode" else S
            ctx = S + 1 if phase == "decode" else S
            cache = (torch.randn(B, ctx, width, dtype=dtype),)
            x = torch.randn(B, T, cfg.hidden_size, dtype=dtype)
            start = S if phase == "decode" else 0
            pos = torch.arange(start, start + T)[None].expand(B, T)
            ab = AttnBatch(positions=pos, rows=slice(0, B), kv_len=start + T, start=start)
            times = {"expanded": [], "absorbed": []}
            outs = {}
            for mode in times:  # warm-up
                _, outs[mode] = timed(m, mode, x, ab, cache)
            reps = args.reps if T * ctx <= 512 * 512 else max(3, args.reps // 3)
            for _ in range(reps):
                for mode in times:
                    times[mode].append(timed(m, mode, x, ab, cache)[0])
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            m.mode = "auto"
            auto = "absorbed" if m._absorbed_is_cheaper(T, ab.kv_len) else "expanded"
            diff = (outs["absorbed"].float() - outs["expanded"].float()).abs().max().item()
            scale = outs["expanded"].float().abs().max().item()
            rows.append(dict(dtype=dname, phase=phase, batch=B, cached=S if phase == "decode" else 0, tokens=T,
                             expanded_ms=med["expanded"], absorbed_ms=med["absorbed"],
                             expanded_over_absorbed=med["expanded"] / med["absorbed"], auto_picks=auto,
                             auto_is_faster=med[auto] <= min(med.values()) * 1.05, reps=reps,
                             max_abs_diff=diff, max_abs_out=scale))
            r = rows[-1]
            print(f"{dname:8s} {phase:7s} B={B} S={S:5d}  expanded {r['expanded_ms']:8.2f} ms  absorbed "
                  f"{r['absorbed_ms']:8.2f} ms  ratio {r['expanded_over_absorbed']:6.2f}x  auto={auto}"
                  f"  |Δ| {diff:.1e} of {scale:.1e}", flush=True)
    flags = ""
    try:
        flags = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "fma")
                         if f in Path("/proc/cpuinfo").read_text().split())
    except OSError:
        pass
    load.append(os.getloadavg()[0])
    res = dict(loadavg_1min_start_end=load, shape="DeepSeek-V2-Lite MLA layer (H 16, r 512, dn/dr/dv 128/64/128, D 2048)",
               cache_values_per_token_per_layer=width, threads=args.threads, cpu_flags=flags,
               machine=platform.machine(), cores=os.cpu_count(), torch=torch.__version__, rows=rows)
    Path(args.out + ".json").write_text(json.dumps(res, indent=1))
    md = ["# MLA: absorbed vs expanded (one DeepSeek-V2-Lite attention layer, CPU)", "",
          f"`python benchmarks/mla_decode.py {' '.join(sys.argv[1:])}` — {args.threads} threads, torch {torch.__version__}, "
          f"{os.cpu_count()} cores ({flags}), shared machine (1-min load {load[0]:.1f} → {load[1]:.1f}); medians, "
          "forms interleaved: absolute times carry the other jobs' load, the ratios are the result.", "",
          "| dtype | phase | B | cached S | T | expanded ms | absorbed ms | expanded/absorbed | auto picks | auto fastest (±5%) |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['dtype']} | {r['phase']} | {r['batch']} | {r['cached']} | {r['tokens']} | "
                  f"{r['expanded_ms']:.2f} | {r['absorbed_ms']:.2f} | {r['expanded_over_absorbed']:.2f}x | "
                  f"{r['auto_picks']} | {'yes' if r['auto_is_faster'] else 'no'} |")
    Path(args.out + ".md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
