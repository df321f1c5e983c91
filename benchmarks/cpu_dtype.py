"""The CPU default dtype, measured: decode speed of fp32 vs bf16 on the same checkpoint, side by side.

build.default_dtype widens a checkpoint to fp32 on a CPU only while it is ≤ 2 GiB (fp32 matmuls
are fast on CPUs without native bf16, and a small model's doubling costs little memory); a bigger
16-bit checkpoint stays 16-bit so it is not doubled in RAM. This records what that choice costs:
median TPOT per dtype at each batch, runs interleaved (fp32, bf16, fp32, …) so background load
hits both alike, plus the resident memory of each.

    python benchmarks/cpu_dtype.py [--model demo] [-b 1,16] [-n 32] [-r 5] [--threads 2]
Writes benchmarks/results/cpu_dtype.{json,md}.
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
    ap.add_argument("-r", "--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from lynx_edge import Engine

    engines = {d: Engine.from_pretrained(args.model, device="cpu", dtype=d) for d in ("float32", "bfloat16")}
    weights = {d: sum(p.numel() * p.element_size() for p in e.model.parameters()) for d, e in engines.items()}
    prompts = ["def main():\n    ", "import os\n", "class Config:\n", "for i in range(", "# utilities\n",
               "with open(path) as f:", "try:\n    ", "return [x for x in"]
    rows = []
    for B in (int(b) for b in args.batch.split(",")):
        batch = [prompts[i % len(prompts)] for i in range(B)]
        tpot: dict[str, list[float]] = {d: [] for d in engines}
        for _ in range(args.reps):
            for d, eng in engines.items():
                eng.generate_batch(batch, max_new_tokens=args.tokens, ignore_eos=True)
                tpot[d].append(eng.last_stats["tpot_ms"])
        med = {d: statistics.median(v) for d, v in tpot.items()}
        rows.append(dict(batch=B, tpot_ms=med, tpot_all=tpot, bf16_over_fp32=med["bfloat16"] / med["float32"]))
        print(f"B={B:3d}  fp32 {med['float32']:7.2f} ms  bf16 {med['bfloat16']:7.2f} ms  "
              f"bf16/fp32 time {rows[-1]['bf16_over_fp32']:.2f}x", flush=True)
    flags = ""
    try:
        flags = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "fma")
                         if f in Path("/proc/cpuinfo").read_text().split())
    except OSError:
        pass
    res = dict(model=args.model, threads=args.threads, tokens=args.tokens, reps=args.reps, cpu_flags=flags,
               machine=platform.machine(), cores=os.cpu_count(), torch=torch.__version__,
               weight_bytes=weights, rows=rows)
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / "cpu_dtype.json"
    out.write_text(json.dumps(res, indent=1) + "\n")
    md = [f"# CPU dtype: fp32 vs bf16 decode on `{args.model}` ({args.threads} threads, CPU flags: {flags or '?'})", "",
          f"Weights: fp32 {weights['float32'] / 2**20:.1f} MiB, bf16 {weights['bfloat16'] / 2**20:.1f} MiB. "
          f"Median TPOT of {args.reps} interleaved runs of {args.tokens} tokens.", "",
          "| B | fp32 TPOT ms | bf16 TPOT ms | bf16 time / fp32 time |", "|---|---|---|---|"]
    md += [f"| {r['batch']} | {r['tpot_ms']['float32']:.2f} | {r['tpot_ms']['bfloat16']:.2f} | {r['bf16_over_fp32']:.2f}x |"
           for r in rows]
    if not args.out:
        out.with_suffix(".md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
