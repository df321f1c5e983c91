"""Native 16/32-bit experts read from DRAM (lynx_moe over stacked gate_up / down: the CPU MoE block
of a bf16 or fp32 checkpoint): this tree's build against another revision's, in one process,
alternating rounds.

Each shape stacks enough experts (~256 MiB) that a call's experts come from DRAM, as on a real MoE
whose experts outgrow the L3; every call picks the next `--experts` of them and gives each `--tokens`
tokens (a B=16 top-4 step over 32 experts puts 2-3 on each, LYNX 3-4). Shapes: the zero-padded
demo of lynx_cpu.py (hidden 256, expert intermediate 8192: short gate/up rows), Qwen3-Next /
Qwen3.5 (2048, 512: short down rows), Qwen3-30B-A3B (2048, 768) and OLMoE (2048, 1024). Reports GB/s
of expert weights per build, the paired speed-up and whether the outputs are bit-equal.

    python benchmarks/expert_rows.py --base HEAD~1 [-r 9] [--tokens 1,2,3,4] [--dtypes bfloat16,float32]
    python benchmarks/expert_rows.py --base HEAD --packed   # this tree's packed rows vs row-major
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from native_ab import Builds, append_run, gb_row, parser  # noqa: E402  (beside this script)

SHAPES = [("demo padded", 256, 8192), ("Qwen3-Next", 2048, 512), ("Qwen3-30B-A3B", 2048, 768),
          ("OLMoE", 2048, 1024)]  # name, hidden D, expert intermediate I
STACK_BYTES = 256 << 20


def rows(builds, rounds: int, dtype: torch.dtype, tokens: tuple, experts: int, shapes: list,
         packed: bool = False) -> list:
    """packed: this tree's calls read the experts in packed rows where native.packable says (the
    base's row-major), each matrix on its own."""
    from lynx_edge.kernels import native

    torch.set_num_threads(1)
    out = []
    for name, D, I in shapes:
        g = torch.Generator().manual_seed(0)
        per = 3 * D * I * torch.finfo(dtype).bits // 8  # bytes of one expert
        E = max(2 * experts, STACK_BYTES // per // experts * experts)
        gate_up = (torch.randn(E, 2 * I, D, generator=g) / D**0.5).to(dtype)
        down = (torch.randn(E, D, I, generator=g) / I**0.5).to(dtype)
        builds.use("tree")  # the base build may predate packed rows
        lay = (packed and native.packable(I, D), packed and native.packable(D, I))
        builds.use("base")
        gu_t, dn_t = (native.pack_rows(gate_up) if lay[0] else gate_up), (native.pack_rows(down) if lay[1] else down)
        for m in tokens:
            T = experts * m  # one route per token (top-1), m tokens on each of `experts` experts
            x = torch.randn(T, D, generator=g)
            w = torch.ones(T, 1)
            nxt = [0]

            def call():
                first = nxt[0]
                nxt[0] = (first + experts) % E
                ids = (torch.arange(T) // m + first).view(T, 1)
                if builds.current == "tree":
                    return native.moe_dense(x, ids, w, gu_t, dn_t, packed=lay)
                return native.moe_dense(x, ids, w, gate_up, down)

            def start():  # each build's checked call reads the same experts
                nxt[0] = 0

            row = {"shape": f"{name} D={D} I={I} {str(dtype)[6:]} {m} tok x {experts} experts",
                   **({"tree_packed": {"gate_up": lay[0], "down": lay[1]}} if packed else {}),
                   **gb_row(builds, rounds, call, experts * per / 1e9, reps=max(1, E // experts), start=start)}
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def main() -> None:
    ap = parser("expert_rows.json", rounds=9)
    ap.add_argument("--tokens", default="1,2,3,4", help="tokens on each expert per call")
    ap.add_argument("--experts", type=int, default=8, help="experts per call")
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("--shapes", default=None, help="comma-separated name prefixes (default: all)")
    ap.add_argument("--packed", action="store_true", help="this tree reads the experts in packed rows")
    a = ap.parse_args()
    shapes = [s for s in SHAPES if a.shapes is None or any(s[0].startswith(p) for p in a.shapes.split(","))]
    builds = Builds(a.base, "expert_rows")
    run = builds.header("native dense experts from DRAM, this tree vs --base (same process, alternating rounds)",
                        a.rounds)
    run["rows"] = [row for d in a.dtypes.split(",") for row in
                   rows(builds, a.rounds, getattr(torch, d), tuple(int(t) for t in a.tokens.split(",")), a.experts,
                        shapes, a.packed)]
    append_run(Path(a.out), run)


if __name__ == "__main__":
    main()
