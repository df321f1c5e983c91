"""Decode TPOT with 1 vs 2 vs all threads, on a quiet machine and beside a busy-loop process.

Why lynx_edge.threads' default is the idle physical cores: torch's per-op parallel regions wait
for their slowest thread, so one busy core stalls every small op. Runs alternate thread counts
so drifting background load hits them alike; the busy loop is one pure-Python process.

    python benchmarks/threads.py [--model demo] [-b 1,16] [-n 24] [-r 3]
Writes benchmarks/results/threads.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _spin() -> None:  # a CPU-bound neighbour
    while True:
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("-b", "--batch", default="1,16")
    ap.add_argument("-n", "--tokens", type=int, default=24)
    ap.add_argument("-r", "--reps", type=int, default=3)
    args = ap.parse_args()
    import torch

    from lynx_edge import Engine
    from lynx_edge.bench import cpu_isa

    load0 = os.getloadavg()[0]  # before we add any
    cores = len(os.sched_getaffinity(0))
    counts = sorted({1, 2, cores})
    eng = Engine.from_pretrained(args.model, device="cpu", threads=1)
    rows = []
    for load in ("quiet", "busy-loop"):
        spin = mp.Process(target=_spin, daemon=True) if load == "busy-loop" else None
        if spin:
            spin.start()
        try:
            for B in (int(b) for b in args.batch.split(",")):
                tpot: dict[int, list[float]] = {n: [] for n in counts}
                for _ in range(args.reps):
                    for n in counts:
                        torch.set_num_threads(n)
                        eng.generate_batch(["import os"] * B, max_new_tokens=args.tokens, ignore_eos=True)
                        tpot[n].append(eng.last_stats["tpot_ms"])
                med = {n: statistics.median(v) for n, v in tpot.items()}
                rows.append({"load": load, "batch": B, "tpot_ms": med, "tpot_all": tpot})
                print(load, B, {n: round(v, 2) for n, v in med.items()}, flush=True)
        finally:
            if spin:
                spin.terminate()
    out = {"benchmark": "decode TPOT by thread count, quiet vs a busy-loop neighbour", "model": args.model,
           "cores": cores, "isa": cpu_isa(), "load_avg_at_start": load0, "tokens": args.tokens,
           "reps": args.reps, "rows": rows}
    res = ROOT / "benchmarks" / "results"
    (res / "threads.json").write_text(json.dumps(out, indent=1) + "\n")
    lines = [f"# Threads: decode TPOT (ms, median of {args.reps}) on `{args.model}`, {cores} cores, {cpu_isa()}", "",
             "Shared machine: 'quiet' still has other users' load (1-min load average "
             f"{out['load_avg_at_start']:.1f} at start); 'busy-loop' adds one spinning process.", "",
             "| load | B | " + " | ".join(f"{n} thread{'s' if n > 1 else ''}" for n in counts) + " |",
             "|---|---|" + "---|" * len(counts)]
    for r in rows:
        lines.append(f"| {r['load']} | {r['batch']} | " + " | ".join(f"{r['tpot_ms'][n]:.2f}" for n in counts) + " |")
    (res / "threads.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
