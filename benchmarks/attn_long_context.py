"""Native decode attention at long contexts: how fast a step reads its KV cache.

At a long context a decode step's attention reads the whole cache of every layer (Qwen3-30B-A3B's 4
KV heads of 128 in bf16: 2 KB a position a layer, 16.8 MB a layer at 8192 positions) and, with
grouped-query heads, does G = H / Hkv multiply-adds per cached value: 8 for Qwen3-30B-A3B and
gpt-oss-20b, so the pass is bound by its multiply-adds on a CPU, not by the bytes. This times
lynx_attn_decode (kernels/cpu_native.c: scores, softmax, values) over caches of 12 layers in turn
(~200 MB: each call reads its cache from DRAM) and reports ms a layer, GB/s of cache read and
GFLOP/s (2 · G · positions · head_dim · 2 per kv head: scores and values).

    python benchmarks/attn_long_context.py [--threads 1,2] [-r 5]   # → benchmarks/results/attn_long_context.json
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
sys.path.insert(0, str(ROOT / "benchmarks"))

LAYERS = 12


def measure(B, H, Hkv, hd, S, rounds: int) -> float:
    from lynx_edge.kernels import native

    g = torch.Generator().manual_seed(0)
    kc = [torch.randn(B, Hkv, S + 1, hd, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]
    vc = [torch.randn(B, Hkv, S + 1, hd, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]
    qkv = torch.randn(B, (H + 2 * Hkv) * hd, generator=g)
    cos, sin = torch.ones(B, hd), torch.zeros(B, hd)
    pos, rows = torch.full((B,), S, dtype=torch.int64), torch.arange(B)
    times = []
    for r in range(rounds + 1):  # the first round warms up
        t = time.perf_counter()
        for k, v in zip(kc, vc):
            native.attn_decode(qkv, H, Hkv, hd, None, None, 0.0, cos, sin, pos, rows, k, v, None)
        if r:
            times.append((time.perf_counter() - t) / LAYERS)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("-r", "--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/attn_long_context.json"))
    args = ap.parse_args()
    from attn_decode import LONG_SHAPES

    from lynx_edge.bench import cpu_isa
    from lynx_edge.kernels import native

    if native.lib() is None:
        raise SystemExit("the native CPU kernels are not built (no C compiler)")
    rows = []
    for th in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(th)
        for name, B, H, Hkv, hd, S, _dt, _cold in LONG_SHAPES:  # attn_decode.py --long's
            s = measure(B, H, Hkv, hd, S, args.rounds)
            kv_bytes = 2 * B * Hkv * (S + 1) * hd * 2
            flops = 2 * 2 * B * H * (S + 1) * hd
            row = {"shape": name, "threads": th, "ms_per_layer": round(s * 1e3, 3),
                   "kv_gb_s": round(kv_bytes / s / 1e9, 2), "gflop_s": round(flops / s / 1e9, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps({"benchmark": "native decode attention at long contexts (lynx_attn_decode)",
                                          "isa": cpu_isa(), "torch": torch.__version__, "layers_rotated": LAYERS,
                                          "rounds": args.rounds, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
