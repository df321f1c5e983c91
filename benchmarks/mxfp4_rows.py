"""gpt-oss's MXFP4 experts on the CPU by activation mode, side by side in one process: fp32 rows
(exact) against int16 activations (q16, the default on AVX2 without AVX-512) and int8 ones (q8,
llama.cpp's MXFP4 x Q8_0 scheme, approximate).

One MoE layer of gpt-oss-20b's shapes (32 experts of hidden 2880 and intermediate 2880, top-4,
biases, the clamped SwiGLU; gpt-oss-120b has the same expert shape, 128 of them): 12.4 MB of codes
and scales an expert, 400 MB a layer, far past the caches, so every call reads its experts from
DRAM. Random codes and scales around 2^-5..2^0 (as published checkpoints have them), each round
fresh random routing for T tokens; the modes alternate within every round, so the paired ratios
(f32 time / mode time) see the same background load. GB/s: the unique experts' bytes a call reads
over its time; `rel_diff`: each mode's largest difference to the fp32 rows over the output scale.

    python benchmarks/mxfp4_rows.py [--tokens 1,2,4,16] [--threads 1] [-r 9]
Appends a run to benchmarks/results/mxfp4_rows.json.
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

from native_ab import append_run  # noqa: E402  (beside this script)

ACTS = ("f32", "q16", "q8")
E, D, I, K = 32, 2880, 2880, 4  # gpt-oss-20b: num_local_experts, hidden_size, intermediate_size, experts_per_token
LIMIT, ALPHA = 7.0, 1.702  # its swiglu_limit and the SwiGLU's alpha


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,2,4,16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("-r", "--rounds", type=int, default=9)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/mxfp4_rows.json"))
    a = ap.parse_args()
    from lynx_edge.bench import cpu_isa
    from lynx_edge.kernels import native

    if native.lib() is None:
        sys.exit("mxfp4_rows.py: the native kernels did not build")
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    gu = torch.randint(0, 256, (E, 2 * I, D // 2), dtype=torch.uint8, generator=g)
    dn = torch.randint(0, 256, (E, D, I // 2), dtype=torch.uint8, generator=g)
    gus = torch.randint(122, 128, (E, 2 * I, D // 32), dtype=torch.uint8, generator=g)
    dns = torch.randint(122, 128, (E, D, I // 32), dtype=torch.uint8, generator=g)
    gb, db = torch.randn(E, 2 * I, generator=g) * 0.1, torch.randn(E, D, generator=g) * 0.1
    per_expert = sum(t[0].numel() for t in (gu, dn, gus, dns))
    rows = []
    for T in (int(t) for t in a.tokens.split(",")):
        x = torch.randn(T, D, generator=g)
        ms, gbs, diff = {act: [] for act in ACTS}, {act: [] for act in ACTS}, {act: [] for act in ACTS[1:]}
        for r in range(a.rounds + 1):  # round 0: warm-up
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
            w = torch.softmax(torch.randn(T, K, generator=g), -1)
            nbytes = len(set(ids.flatten().tolist())) * per_expert
            out = {}
            for act in (ACTS if r % 2 else ACTS[::-1]):
                t0 = time.perf_counter()
                out[act] = native.moe_oss(x, ids, w, gu, dn, gb, db, LIMIT, ALPHA, gus, dns, act=act)
                dt = time.perf_counter() - t0
                if r:
                    ms[act].append(dt * 1e3)
                    gbs[act].append(nbytes / dt / 1e9)
            ref = out["f32"]
            for act in ACTS[1:]:
                diff[act].append(((out[act] - ref).abs().max() / ref.abs().max().clamp(min=1.0)).item())
        row = {"shape": f"gpt-oss-20b layer E={E} D={D} I={I} top-{K}", "tokens": T, "threads": a.threads,
               "ms": {act: round(statistics.median(v), 2) for act, v in ms.items()},
               "gb_s": {act: round(statistics.median(v), 2) for act, v in gbs.items()},
               "vs_f32": {act: round(statistics.median(f / q for f, q in zip(ms["f32"], ms[act])), 3) for act in ACTS[1:]},
               "vs_f32_range": {act: [round(min(f / q for f, q in zip(ms["f32"], ms[act])), 3),
                                      round(max(f / q for f, q in zip(ms["f32"], ms[act])), 3)] for act in ACTS[1:]},
               "q8_vs_q16": round(statistics.median(a / b for a, b in zip(ms["q16"], ms["q8"])), 3),
               "rel_diff": {act: float(f"{max(v):.2e}") for act, v in diff.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    append_run(Path(a.out), {"benchmark": "native MXFP4 experts (gpt-oss) from DRAM by activation mode "
                                          "(same build, modes alternating)",
                             "isa": cpu_isa(), "march": native.FLAGS[1], "rounds": a.rounds, "torch": torch.__version__,
                             "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows})


if __name__ == "__main__":
    main()
