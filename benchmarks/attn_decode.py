"""Native decode attention (lynx_attn_decode in kernels/cpu_native.c): this tree's build against
another revision's, in one process, alternating rounds; outputs compared (bit-equal, or their
largest difference relative to the output scale).

Shapes: the demo at B = 16 over 144 cached positions (the main job's batch-16 step, four layers'
caches, each call after 48 MB of other reads as a decode step's weights would evict them), and
Qwen3-30B-A3B's heads (32 q heads of 128 on 4 kv heads) at long context: B = 1 over 4000
positions and B = 4 over 1000, fp32 and bf16 caches.

    python benchmarks/attn_decode.py --base HEAD~1 [-r 15] [--threads N] [--long]   # → benchmarks/results/attn_decode.json
    LYNX_EDGE_NATIVE_ARCH=haswell python benchmarks/attn_decode.py ...   # the AVX2 build
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = [  # name, B, H, Hkv, hd, cached positions, cache dtype, evict between calls
    ("demo B=16 L=144 (cold)", 16, 4, 2, 64, 144, torch.float32, True),
    ("demo B=16 L=144 (hot)", 16, 4, 2, 64, 144, torch.float32, False),
    ("demo B=16 L=144 bf16 (hot)", 16, 4, 2, 64, 144, torch.bfloat16, False),  # the demo's CPU default since s25
    ("Qwen3-30B-A3B heads B=1 L=4000", 1, 32, 4, 128, 4000, torch.float32, False),
    ("Qwen3-30B-A3B heads B=1 L=4000 bf16", 1, 32, 4, 128, 4000, torch.bfloat16, False),
    ("Qwen3-30B-A3B heads B=4 L=1000", 4, 32, 4, 128, 1000, torch.float32, False),
]
# --long: contexts past ATTN_CHUNK, where a row's window attends in chunks (one work item each), each
# call's cache from DRAM (four layers' caches in turn, 34-67 MB, after 48 MB of other reads) as a
# long decode step reads it; benchmarks/attn_long_context.py times the same shapes alone
LONG_SHAPES = [
    ("Qwen3-30B-A3B heads B=1 L=8192 bf16", 1, 32, 4, 128, 8192, torch.bfloat16, True),
    ("gpt-oss-20b heads B=1 L=8192 bf16", 1, 64, 8, 64, 8192, torch.bfloat16, True),
    ("one kv head (16 q heads of 128) B=1 L=8192 bf16", 1, 16, 1, 128, 8192, torch.bfloat16, True),
    ("Qwen3-30B-A3B heads B=4 L=4096 bf16", 4, 32, 4, 128, 4096, torch.bfloat16, True),
]


def main() -> None:
    from native_ab import Builds, append_run, paired, parser

    from lynx_edge.kernels import native

    ap = parser("attn_decode.json", rounds=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--long", action="store_true", help="the long-context shapes (LONG_SHAPES) instead")
    a = ap.parse_args()
    builds = Builds(a.base, "attn_decode")
    torch.set_num_threads(a.threads)
    junk = torch.randn(12 << 20)
    rows_out = []
    for name, B, H, Hkv, hd, L, dt, cold in (LONG_SHAPES if a.long else SHAPES):
        g = torch.Generator().manual_seed(0)
        layers = 4 if cold else 1
        caches = [(torch.randn(B, Hkv, L + 8, hd, generator=g).to(dt), torch.randn(B, Hkv, L + 8, hd, generator=g).to(dt))
                  for _ in range(layers)]
        qkv = torch.randn(B, (H + 2 * Hkv) * hd, generator=g)
        cos, sin = torch.ones(B, hd), torch.zeros(B, hd)
        pos, rows = torch.full((B,), L - 1, dtype=torch.int64), torch.arange(B)

        def call(kc, vc):
            return native.attn_decode(qkv, H, Hkv, hd, None, None, 1e-6, cos, sin, pos, rows, kc, vc, None)

        outs = {}
        for tag in ("base", "tree"):
            builds.use(tag)
            outs[tag] = call(*caches[0])
        reps = max(1, int(2e-2 / max(1e-6, _once(call, caches))))
        ms = {"base": [], "tree": []}
        for r in range(a.rounds):
            for tag in (("base", "tree") if r % 2 == 0 else ("tree", "base")):
                builds.use(tag)
                tot = 0.0
                for _ in range(reps):
                    if cold:
                        junk.sum()
                    t = time.perf_counter()
                    for kc, vc in caches:
                        call(kc, vc)
                    tot += time.perf_counter() - t
                ms[tag].append(tot / reps / layers * 1e3)
        sp = paired(ms["base"], ms["tree"])
        row = {"shape": name, "base_ms_per_call": statistics.median(ms["base"]),
               "tree_ms_per_call": statistics.median(ms["tree"]), "speedup_median": sp["median"],
               "speedup_min": sp["min"], "speedup_max": sp["max"],
               "bit_equal": bool(torch.equal(outs["base"], outs["tree"])),
               "max_rel_diff": float((outs["tree"] - outs["base"]).abs().max() / outs["base"].abs().max())}
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    append_run(Path(a.out), builds.header(f"native decode attention, this tree vs --base ({a.threads} thread(s), same "
                                          "process)", a.rounds) | {"threads": a.threads, "rows": rows_out})


def _once(call, caches) -> float:
    t = time.perf_counter()
    for kc, vc in caches:
        call(kc, vc)
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
