"""Native INT4 rows (lynx_linear_int4: a GPTQ / AWQ projection read packed, the tiles of the INT4
experts too) and int8 rows (lynx_linear_int8: the `--int8-head` kernel) read from DRAM: this tree's
build against another revision's, in one process, alternating rounds. Each shape holds 64 MiB of
codes (INT4: group 128, symmetric), far past the caches, so one token is a stream of weights; T = 1
(B=1 decode) and 4 (--tokens), fp32 activations (exact) and int8 ones (`--int4-act q8`); GB/s of codes and the
paired speed-up.

    python benchmarks/int4_rows.py --base HEAD~1 [-r 11] [--threads 1,2] [--kinds int4,int8]   # → results/int4_prefetch.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from native_ab import Builds, append_run, gb_row, parser  # noqa: E402  (beside this script)

SHAPES = [(768, 131072), (2048, 65536), (4096, 32768)]  # K (inputs; rows of K/2 bytes), N (rows)


def rows(builds, rounds: int, threads: int, kind: str, tokens: tuple = (1, 4), acts: tuple = ("f32", "q16", "q8")) -> list:
    from lynx_edge.kernels import native

    torch.set_num_threads(threads)
    out = []
    for K, N in SHAPES:
        g = torch.Generator().manual_seed(0)
        if kind == "int4":
            packed = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g)
            scales = (torch.rand(K // 128, N, generator=g) * 0.01).half()
        else:  # int8 rows (the int8 head's kernel) of the same bytes: half the rows
            N //= 2
            codes = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
            scales = torch.rand(N, generator=g) * 0.01
        for act in acts:
            for T in tokens:
                x = torch.randn(T, K, generator=g)

                def call():
                    return (native.linear_int4(x, packed, scales, None, act=act) if kind == "int4" else
                            native.linear_int8(x, codes, scales, act=act))

                gb = N * K / (2 if kind == "int4" else 1) / 1e9
                row = {"shape": f"{kind} K={K} N={N} T={T} {act}", "threads": threads,
                       **gb_row(builds, rounds, call, gb)}
                out.append(row)
                print(json.dumps(row), flush=True)
    return out


def main() -> None:
    ap = parser("int4_prefetch.json", rounds=11)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--kinds", default="int4,int8", help="int4 rows, int8 rows (the int8 head's kernel)")
    ap.add_argument("--tokens", default="1,4", help="tokens per call (B=1 decode: 1; a batch: 4, 16)")
    ap.add_argument("--acts", default="f32,q16,q8", help="activation modes (int4_act_rows.py's)")
    a = ap.parse_args()
    builds = Builds(a.base, "int4_rows")
    run = builds.header("native INT4 rows from DRAM, this tree vs --base (same process, alternating rounds)", a.rounds)
    run["rows"] = [row for k in a.kinds.split(",") for t in a.threads.split(",") for row in rows(builds, a.rounds, int(t), k,
                                                                                 tuple(int(n) for n in a.tokens.split(",")),
                                                                                 tuple(a.acts.split(",")))]
    append_run(Path(a.out), run)


if __name__ == "__main__":
    main()
