"""DeepSeek-V2's expanded (prefill) attention on a CPU: SDPA with values narrower than the keys (V2-Lite:
dv 128 < dn + dr 192) as torch runs it (its math path: [B, H, T, S] scores materialised) against the
values zero-padded to the keys' width in fp32 (torch's flash kernel; models/deepseek_v2.py), one causal
prompt of T tokens, 16 heads, bf16 inputs, alternating, min of rounds; max |error| of each against fp64.

    python benchmarks/mla_prefill.py [--tokens 512,2048] [-r 3] [--threads 1]   # → results/mla_prefill_s32.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
H, DQK, DV = 16, 192, 128  # V2-Lite's heads, dn + dr, dv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="512,2048")
    ap.add_argument("-r", "--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/mla_prefill_s32.json"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows = []
    for T in (int(t) for t in a.tokens.split(",")):
        g = torch.Generator().manual_seed(T)
        q, k = (torch.randn(1, H, T, DQK, generator=g).bfloat16() for _ in range(2))
        v = torch.randn(1, H, T, DV, generator=g).bfloat16()
        math = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=DQK ** -0.5)  # noqa: E731

        def padded():
            vp = F.pad(v.float(), (0, DQK - DV))
            out = F.scaled_dot_product_attention(q.float(), k.float(), vp, is_causal=True, scale=DQK ** -0.5)
            return out[..., :DV].bfloat16()

        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True, scale=DQK ** -0.5)
        times = {"math": [], "padded_fp32_flash": []}
        for _ in range(a.rounds):
            for name, f in (("math", math), ("padded_fp32_flash", padded)):
                t0 = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - t0)
        row = {"tokens": T, **{f"{n}_ms": 1e3 * min(v) for n, v in times.items()},
               "speedup": min(times["math"]) / min(times["padded_fp32_flash"]),
               "err_math": float((math().double() - ref).abs().max()),
               "err_padded": float((padded().double() - ref).abs().max()),
               "math_scores_bytes": H * T * T * 4}
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(a.out).write_text(json.dumps({"threads": a.threads, "torch": torch.__version__, "heads": H, "dqk": DQK,
                                       "dv": DV, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
