"""A bf16 model's prompt projections on a CPU without native bf16 (models/layers.linear past NATIVE_ROWS):
the weight widened to fp32 a chunk at a time, then torch's fp32 GEMM — chunks of 4096 rows (as before:
47 MB for gpt-oss-20b's q/k/v, mapped and faulted in afresh at every call) against chunks of WIDEN_BYTES
(8 MiB: heap pages reused, L3-resident). Six layers' q/k/v [5120, 2880] and o [2880, 4096] projections
of a 512-token prompt, alternating, min of 3 rounds.

    python benchmarks/widen_chunks.py [--threads 1,2]   # → results/widen_chunks_s32.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    from lynx_edge.models import layers

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("-r", "--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/widen_chunks_s32.json"))
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    ws = [(torch.randn(5120, 2880, generator=g) * 0.02).bfloat16(), (torch.randn(2880, 4096, generator=g) * 0.02).bfloat16()]
    xs = [torch.randn(512, 2880, generator=g).bfloat16(), torch.randn(512, 4096, generator=g).bfloat16()]
    default, rows = layers.WIDEN_BYTES, []
    for th in (int(t) for t in a.threads.split(",")):
        torch.set_num_threads(th)
        res = {}
        for _ in range(a.rounds):
            for name, b in (("rows4096", 4096 * 2880 * 4), ("widen_bytes", default)):
                layers.WIDEN_BYTES = b
                t0 = time.perf_counter()
                for _ in range(6):
                    for w, x in zip(ws, xs):
                        layers.linear(x, w)
                res.setdefault(name, []).append(time.perf_counter() - t0)
        row = {"threads": th, **{f"{k}_ms": 1e3 * min(v) for k, v in res.items()},
               "speedup": min(res["rows4096"]) / min(res["widen_bytes"])}
        rows.append(row)
        print(json.dumps(row), flush=True)
    layers.WIDEN_BYTES = default
    Path(a.out).write_text(json.dumps({"torch": torch.__version__, "widen_bytes": default, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
