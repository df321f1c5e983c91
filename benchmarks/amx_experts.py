"""bf16 experts on AMX tiles (amx_rows in cpu_native.c, opt-in: LYNX_EDGE_AMX=1) against the
AVX-512 row kernels, one process, one thread, modes alternating: GB/s of expert weights per
lynx_moe call, `--experts` experts a call with `m` tokens each, experts from DRAM (256 MiB stacks)
or, with `--cached`, 32 experts that stay in the cache.

    python benchmarks/amx_experts.py --out benchmarks/results/amx_experts_s39.json
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lynx_edge.kernels import native  # noqa: E402

SHAPES = [("demo padded", 256, 8192), ("Qwen3-30B-A3B", 2048, 768), ("demo", 256, 128)]


def rate(so, D: int, I: int, m: int, experts: int, reps: int, cached: bool) -> dict:
    per = 3 * D * I * 2
    E = 32 if cached else max(2 * experts, (256 << 20) // per // experts * experts)
    gu = (torch.randn(E, 2 * I, D) / D**0.5).bfloat16()
    dn = (torch.randn(E, D, I) / I**0.5).bfloat16()
    T = experts * m
    x, w = torch.randn(T, D).bfloat16().float(), torch.ones(T, 1)
    out: dict = {}
    for amx in (0, 1) * 2:  # alternating; the best median of each
        so.lynx_amx_enable(amx)
        res = []
        for _ in range(reps):
            t0, n = time.perf_counter(), 0
            for _ in range(max(1, 32 // (E // experts))):
                for first in range(0, E - experts + 1, experts):
                    native.moe_dense(x, (torch.arange(T) // m + first).view(T, 1), w, gu, dn, stream=not cached)
                    n += 1
            res.append(n * experts * per / (time.perf_counter() - t0) / 1e9)
        out.setdefault(amx, []).append(sorted(res)[len(res) // 2])
    rows, tiles = max(out[0]), max(out[1])
    return {"tokens_per_expert": m, "rows_gb_s": round(rows, 2), "amx_gb_s": round(tiles, 2),
            "amx_vs_rows": round(tiles / rows, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,2,3,4,6,8,16,32")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("-r", "--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    so = native.lib()
    if so is None or not so.lynx_amx_enable(1):
        sys.exit("no AMX tiles here (this build or CPU has no AMX-BF16)")
    torch.set_num_threads(1)
    runs = []
    for name, D, I in SHAPES:
        for cached in (False, True) if name == "demo" else (False,):
            for m in (int(t) for t in a.tokens.split(",")):
                row = {"shape": f"{name} D={D} I={I}", "from": "cache" if cached else "DRAM",
                       **rate(so, D, I, m, a.experts, a.reps, cached)}
                print(json.dumps(row), flush=True)
                runs.append(row)
    so.lynx_amx_enable(0)
    if a.out:
        Path(a.out).write_text(json.dumps({"benchmark": __doc__.splitlines()[0], "cpu": platform.processor(),
                                           "threads": 1, "rows": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
