"""The CPU default dtype, measured: prefill and decode speed of fp32 vs bf16 on the same
checkpoint, side by side.

build.default_dtype keeps a bf16 checkpoint bf16 on a CPU with native bf16 math (AVX512_BF16 or
AMX: cpuflags.cpu_bf16) or lynx-edge's native kernels; without both it widens to fp32 while the
checkpoint is ≤ 2 GiB (torch's fp32 matmuls are fast on CPUs without native bf16, and a small
model's doubling costs little memory), and a bigger 16-bit checkpoint stays 16-bit so it is not
doubled in RAM. This records what the choice is worth: median prefill tok/s and TPOT per dtype at
each batch (prompts of --prompt tokens, bench's synthetic_prompts), runs interleaved (fp32, bf16,
fp32, …) so background load hits both alike; then each dtype's teacher-forced perplexity on the
model's held-out text and how often their greedy tokens agree.

    python benchmarks/cpu_dtype.py [--model demo] [-b 1,16] [-n 32] [-r 5] [--threads 2] [--out F]
Writes benchmarks/results/cpu_dtype.{json,md} (or F and F with .md).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("-b", "--batch", default="1,16")
    ap.add_argument("-n", "--tokens", type=int, default=32)
    ap.add_argument("-p", "--prompt", type=int, default=128)
    ap.add_argument("-r", "--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--quality-windows", type=int, default=32,
                    help="held-out windows of 128 tokens for the quality part (0: skip; needs heldout.txt)")
    args = ap.parse_args()
    import torch

    from lynx_edge import Engine
    from lynx_edge.bench import measure, synthetic_prompts
    from lynx_edge.cpuflags import cpu_bf16, cpu_flags
    from lynx_edge.threads import set_threads

    set_threads(args.threads, explicit=True)

    engines = {d: Engine.from_pretrained(args.model, device="cpu", dtype=d) for d in ("float32", "bfloat16")}
    weights = {d: sum(p.numel() * p.element_size() for p in e.model.parameters()) for d, e in engines.items()}
    rows = []
    for B in (int(b) for b in args.batch.split(",")):
        batch = synthetic_prompts(engines["float32"], B, args.prompt)
        tpot: dict[str, list[float]] = {d: [] for d in engines}
        pre: dict[str, list[float]] = {d: [] for d in engines}
        for d, eng in engines.items():
            measure(eng, batch, 4)  # warm-up
        for _ in range(args.reps):
            for d, eng in engines.items():
                st = measure(eng, batch, args.tokens)
                tpot[d].append(st["tpot_ms"])
                pre[d].append(st["prefill_tok_s"])
        med = {d: statistics.median(v) for d, v in tpot.items()}
        pmed = {d: statistics.median(v) for d, v in pre.items()}
        rows.append(dict(batch=B, tpot_ms=med, tpot_all=tpot, prefill_tok_s=pmed, prefill_all=pre,
                         bf16_over_fp32=med["bfloat16"] / med["float32"],
                         prefill_bf16_over_fp32=pmed["bfloat16"] / pmed["float32"]))
        print(f"B={B:3d}  fp32 {med['float32']:7.2f} ms  bf16 {med['bfloat16']:7.2f} ms  "
              f"bf16/fp32 time {rows[-1]['bf16_over_fp32']:.2f}x  prefill bf16/fp32 speed "
              f"{rows[-1]['prefill_bf16_over_fp32']:.2f}x", flush=True)
    quality = _quality(engines, args.quality_windows) if args.quality_windows else None
    flags = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "fma") if f in cpu_flags())
    res = dict(model=args.model, threads=args.threads, tokens=args.tokens, reps=args.reps, cpu_flags=flags,
               machine=platform.machine(), cores=os.cpu_count(), torch=torch.__version__,
               prompt=args.prompt, cpu_bf16=cpu_bf16(), weight_bytes=weights, rows=rows, quality=quality)
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / "cpu_dtype.json"
    out.write_text(json.dumps(res, indent=1) + "\n")
    md = [f"# CPU dtype: fp32 vs bf16 on `{args.model}` ({args.threads} threads, CPU flags: {flags or '?'})", "",
          f"Weights: fp32 {weights['float32'] / 2**20:.1f} MiB, bf16 {weights['bfloat16'] / 2**20:.1f} MiB. "
          f"Medians of {args.reps} interleaved runs: prompts of {args.prompt} tokens, {args.tokens} decoded. "
          f"Native bf16 here (cpuflags.cpu_bf16): {cpu_bf16()}.", "",
          "| B | fp32 TPOT ms | bf16 TPOT ms | bf16 time / fp32 time | fp32 prefill tok/s | bf16 prefill tok/s | bf16 / fp32 prefill speed |",
          "|---|---|---|---|---|---|---|"]
    md += [f"| {r['batch']} | {r['tpot_ms']['float32']:.2f} | {r['tpot_ms']['bfloat16']:.2f} | {r['bf16_over_fp32']:.2f}x | "
           f"{r['prefill_tok_s']['float32']:.0f} | {r['prefill_tok_s']['bfloat16']:.0f} | {r['prefill_bf16_over_fp32']:.2f}x |"
           for r in rows]
    if quality:
        md += ["", f"Quality ({quality['windows']} held-out windows of 128 tokens, 64 prefilled, 64 teacher-forced "
               f"decode steps at B=16): perplexity fp32 {quality['ppl']['float32']:.4f}, bf16 "
               f"{quality['ppl']['bfloat16']:.4f} ({quality['ppl_delta_pct']:+.3f}%); greedy top-1 agreement "
               f"{quality['top1_agree_pct']:.2f}%."]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")


def _quality(engines: dict, windows: int) -> dict | None:
    """Teacher-forced perplexity of each dtype on the model's held-out text, and how often bf16's
    greedy token equals fp32's (eval's exact pass: prefill 64, then decode steps on the true tokens)."""
    import math

    from lynx_edge.eval import load_sequences, run_windows

    try:
        seqs = load_sequences(engines["float32"], num_seqs=windows, seq_len=128)
    except (FileNotFoundError, ValueError) as e:
        print(f"quality skipped: {e}")
        return None
    runs = {d: run_windows(e, seqs, min(16, len(seqs)), 64) for d, e in engines.items()}
    ppl = {d: math.exp(r.nll.mean().item()) for d, r in runs.items()}
    agree = (runs["float32"].argmax == runs["bfloat16"].argmax).float().mean().item() * 100
    print(f"quality: ppl fp32 {ppl['float32']:.4f} bf16 {ppl['bfloat16']:.4f}, top-1 agreement {agree:.2f}%")
    return {"windows": len(seqs), "ppl": ppl, "ppl_delta_pct": (ppl["bfloat16"] / ppl["float32"] - 1) * 100,
            "top1_agree_pct": agree}


if __name__ == "__main__":
    main()
