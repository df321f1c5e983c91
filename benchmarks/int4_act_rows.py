"""The native INT4 rows on their three activation modes, side by side in one process: fp32 (exact),
int16 (q16, the default on AVX2) and int8 (q8). Each shape holds 64 MiB of codes (group 128,
symmetric), far past the caches, as int4_rows.py's; the modes alternate within every round, so the
paired ratios (f32 time / mode time) see the same background load. GB/s of codes per mode, medians.

    python benchmarks/int4_act_rows.py [--tokens 1,2,4,16] [--threads 1] [-r 7]
Appends a run to benchmarks/results/int4_act_rows.json.
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

from int4_rows import SHAPES  # noqa: E402  (beside this script)
from native_ab import append_run  # noqa: E402

ACTS = ("f32", "q16", "q8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,2,4,16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("-r", "--rounds", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/int4_act_rows.json"))
    a = ap.parse_args()
    from lynx_edge.bench import cpu_isa
    from lynx_edge.kernels import native

    torch.set_num_threads(a.threads)
    rows = []
    for K, N in SHAPES:
        g = torch.Generator().manual_seed(0)
        packed = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g)
        scales = (torch.rand(K // 128, N, generator=g) * 0.01).half()
        for T in (int(t) for t in a.tokens.split(",")):
            x = torch.randn(T, K, generator=g)
            reps = max(1, 4 // T)  # calls per timing: a few at one token, where one call is ~5 ms
            ms = {act: [] for act in ACTS}
            for act in ACTS:  # warm-up
                native.linear_int4(x, packed, scales, None, act=act)
            for _ in range(a.rounds):
                for act in ACTS:
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        native.linear_int4(x, packed, scales, None, act=act)
                    ms[act].append((time.perf_counter() - t0) / reps * 1e3)
            gb = N * K / 2 / 1e9
            row = {"shape": f"K={K} N={N} T={T}", "threads": a.threads,
                   "gb_s": {act: round(gb / statistics.median(v) * 1e3, 2) for act, v in ms.items()},
                   "vs_f32": {act: round(statistics.median(f / m for f, m in zip(ms["f32"], ms[act])), 3)
                              for act in ACTS[1:]}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    append_run(Path(a.out), {"benchmark": "native INT4 rows from DRAM by activation mode (same build, modes alternating)",
                             "isa": cpu_isa(), "march": native.FLAGS[1], "rounds": a.rounds, "torch": torch.__version__,
                             "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows})


if __name__ == "__main__":
    main()
