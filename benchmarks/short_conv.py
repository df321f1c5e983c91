"""LFM2's short convolution on a CPU: the depthwise causal conv1d (real LFM2-8B-A1B shape: 2048 channels,
kernel 3) as lynx-edge ran it before session 31 (F.conv1d in bf16) and now (state.causal_conv: fp32 on a
CPU, rounded once to bf16), one token per row (decode) and a 512-token prompt, one thread, alternating;
medians of 9.

    python benchmarks/short_conv.py [--threads 1] [--out benchmarks/results/short_conv_s31.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    from lynx_edge.models.layers import AttnBatch
    from lynx_edge.models.state import causal_conv

    torch.set_num_threads(a.threads)
    C, K = 2048, 3
    g = torch.Generator().manual_seed(0)
    w = torch.randn(C, 1, K, generator=g).bfloat16()
    rows = []
    for T, B in ((1, 1), (1, 16), (512, 1)):
        x = torch.randn(B, C, T, generator=g).bfloat16()
        cache = torch.zeros(B, C, K - 1, dtype=torch.bfloat16)
        ab = AttnBatch(positions=torch.arange(T)[None].expand(B, T), rows=slice(0, B), kv_len=T, start=0)
        full = torch.cat([cache, x], -1)
        runs = {"bf16 conv1d (before)": lambda: F.conv1d(full, w, None, groups=C),
                "causal_conv (now)": lambda: causal_conv(x, w, cache, ab)}
        ts = {k: [] for k in runs}
        for r in range(10):
            for k, f in (runs.items() if r % 2 else reversed(runs.items())):
                t0 = time.perf_counter()
                f()
                if r:
                    ts[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) * 1e3 for k, v in ts.items()}
        row = {"tokens": T, "rows": B, "ms": {k: round(v, 3) for k, v in med.items()},
               "speedup": round(med["bf16 conv1d (before)"] / med["causal_conv (now)"], 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.out:
        a.out.write_text(json.dumps({"shape": f"depthwise conv1d C={C} K={K} bf16", "threads": a.threads,
                                     "torch": torch.__version__, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
