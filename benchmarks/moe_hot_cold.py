"""Why LYNX saves less when the experts sit in cache: one native MoE layer call (the demo's shapes:
32 experts, D=256, I=128, 16 tokens top-4) with the 64 token→expert slots spread over the 28
experts exact routing uses at B=16 vs the 20 LYNX leaves, the experts of one layer read again and
again (in L2/L3, as the bf16 demo's 28 MB are on a 32 MB L3) vs 16 layers' worth cycled (from DRAM).
Same multiply-adds either way; what differs is how many expert rows are read, and how often.

    python benchmarks/moe_hot_cold.py [--dtype bfloat16] [--threads 1] [-r 7]   # → results/moe_hot_cold.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

E, D, I, T, K = 32, 256, 128, 16, 4


def layer_us(native, layers: int, used: int, dtype, rounds: int, reps: int) -> float:
    """Median µs per layer call, `layers` distinct expert sets cycled, slots on experts [0, used)."""
    g = torch.Generator().manual_seed(0)
    gus = [torch.randn(E, 2 * I, D, generator=g).to(dtype) for _ in range(layers)]
    dns = [torch.randn(E, D, I, generator=g).to(dtype) for _ in range(layers)]
    ids = torch.stack([torch.randperm(used, generator=g)[:K] for _ in range(T)])  # each token K distinct experts
    w, x = torch.full((T, K), 1.0 / K), torch.randn(T, D, generator=g)
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            for lay in range(layers):
                native.moe_dense(x, ids, w, gus[lay], dns[lay])
        out.append((time.perf_counter() - t0) / (reps * layers) * 1e6)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("-r", "--rounds", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/moe_hot_cold.json"))
    a = ap.parse_args()
    from lynx_edge.kernels import native

    if native.lib() is None:
        sys.exit("the native CPU kernels did not build here")
    torch.set_num_threads(a.threads)
    dt = getattr(torch, a.dtype)
    rows = []
    for name, layers, reps in (("hot: one layer's experts (L2/L3)", 1, 200), ("cold: 16 layers cycled (DRAM)", 16, 20)):
        us = {used: layer_us(native, layers, used, dt, a.rounds, reps) for used in (28, 20)}
        row = {"case": name, "exact_28_experts_us": round(us[28], 1), "lynx_20_experts_us": round(us[20], 1),
               "speedup": round(us[28] / us[20], 3)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(a.out).write_text(json.dumps({"dtype": a.dtype, "threads": a.threads, "rounds": a.rounds,
                                       "isa": torch.backends.cpu.get_cpu_capability(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
