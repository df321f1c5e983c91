#!/usr/bin/env python
"""LYNX on the Gated DeltaNet hybrids (qwen3_next / qwen3_5_moe): unique experts and bytes per step.

A tiny random Qwen3-Next checkpoint written by transformers (4 layers: 3 DeltaNet + 1 gated
attention; E=128 routed experts top-8 + 1 gated shared expert — the Qwen3.5-35B-A3B ratio 256/8
halved; D=64, I=32), B sequences of 32-token prompts decoded 32 greedy steps, for B in {1, 4, 16}:
  - resident: unique experts per MoE layer per decode step, exact routing vs LYNX (the union the
    decode step reads: LYNX telemetry over the same tokens), and the expert bytes one decode step
    reads at the published expert size (3 × 2048 × 512 bf16 = 6 MiB per expert);
  - offload (CPU standing in for the device; bytes are the same): an LRU cache of 25% of the
    experts, host→device bytes per decode step, exact vs LYNX (residency-aware), and the time per
    step of the slot bookkeeping + copies on this machine.
A random router says little about a trained one (its scores are flatter): the figures show the
mechanics on many small experts, not the quality trade-off. Writes benchmarks/results/hybrid_lynx.{json,md}.

    python benchmarks/hybrid_lynx.py [--steps 32] [--experts 128] [--top-k 8]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from lynx_edge import Engine  # noqa: E402
from lynx_edge.kv_cache import KVCache  # noqa: E402

PUBLISHED_EXPERT_BYTES = 3 * 2048 * 512 * 2  # Qwen3-Next / Qwen3.5-35B-A3B expert, bf16


def build(E: int, K: int) -> Path:
    from test_qwen3_next import build_next  # the tests' tiny checkpoint builder (transformers)

    path = Path(tempfile.gettempdir()) / f"lynx_edge_bench_qwen3_next_e{E}k{K}"
    if not (path / "config.json").is_file():
        path.mkdir(parents=True, exist_ok=True)
        build_next(path, num_experts=E, num_experts_per_tok=K, mlp_only_layers=[])
    return path


def prompts(B: int, n: int = 32) -> list[list[int]]:
    g = torch.Generator().manual_seed(B)
    return torch.randint(3, 320, (B, n), generator=g).tolist()


def run(eng: Engine, B: int, steps: int) -> tuple[dict, float]:
    t0, stats = time.perf_counter(), None
    for c in eng.stream_batch(prompts(B), max_new_tokens=steps + 1, ignore_eos=True):
        stats = c.stats or stats
    return stats, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--batches", default="1,4,16")
    args = ap.parse_args()
    torch.manual_seed(0)
    path = build(args.experts, args.top_k)
    rows = []
    for B in [int(b) for b in args.batches.split(",")]:
        eng = Engine.from_pretrained(path, device="cpu", dtype=torch.float32, lynx="lynx", max_num_seqs=B)
        st, _ = run(eng, B, args.steps)
        lx = st["lynx"]
        row = {"batch": B, "unique_exact": lx["unique_before"], "unique_lynx": lx["unique_after"],
               "reduction_pct": lx["reduction_pct"], "remap_rate_pct": lx["remap_rate_pct"],
               "published_expert_MiB_per_step_exact": lx["unique_before"] * 4 * PUBLISHED_EXPERT_BYTES / 2**20,
               "published_expert_MiB_per_step_lynx": lx["unique_after"] * 4 * PUBLISHED_EXPERT_BYTES / 2**20}
        slots = max(args.top_k, 4 * args.experts // 4)  # 25% of the 4 layers' experts
        for mode in ("off", "lynx"):
            eng = Engine.from_pretrained(path, device="cpu", dtype=torch.float32, lynx=mode, max_num_seqs=B,
                                         offload=True, expert_slots=slots, policy="lru")
            st, dt = run(eng, B, args.steps)
            off = st["offload"]
            row[f"offload_{mode}"] = {"KiB_per_decode_step": off["bytes_per_decode_step"] / 2**10,
                                      "hit_rate": off["hit_rate"], "decode_ms_per_step": st["tpot_ms"],
                                      "copies": off["copies"]}
        row["offload_bytes_reduction_pct"] = 100 * (1 - row["offload_lynx"]["KiB_per_decode_step"]
                                                    / max(row["offload_off"]["KiB_per_decode_step"], 1e-9))
        rows.append(row)
        print(json.dumps(row))
    eng_cfg = eng.cfg
    out = {"model": f"tiny random qwen3_next (E={args.experts}, K={args.top_k}, 4 layers: 3 DeltaNet + 1 attention, "
                    "D=64, I=32, 1 gated shared expert)",
           "steps": args.steps, "prompt_tokens": 32, "expert_slots": slots, "threads": torch.get_num_threads(),
           "machine": platform.processor() or platform.machine(),
           "state_bytes_per_sequence": KVCache.state_bytes(eng_cfg, torch.float32), "rows": rows}
    res = ROOT / "benchmarks" / "results"
    (res / "hybrid_lynx.json").write_text(json.dumps(out, indent=2) + "\n")
    lines = [f"# LYNX on a Gated DeltaNet hybrid: unique experts and bytes per decode step\n",
             f"Model: {out['model']}; {args.steps} greedy decode steps after 32-token prompts; CPU, "
             f"{out['threads']} threads. Random router weights: flatter scores than a trained router's.\n",
             "| B | unique/layer exact | LYNX | reduction | remap rate | published-size MiB/step exact → LYNX | "
             "offload KiB/step lru → lru+LYNX | bytes Δ | hit rate | ms/step lru → LYNX |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a, b = r["offload_off"], r["offload_lynx"]
        lines.append(f"| {r['batch']} | {r['unique_exact']:.2f} | {r['unique_lynx']:.2f} | -{r['reduction_pct']:.1f}% | "
                     f"{r['remap_rate_pct']:.1f}% | {r['published_expert_MiB_per_step_exact']:.0f} → "
                     f"{r['published_expert_MiB_per_step_lynx']:.0f} | {a['KiB_per_decode_step']:.1f} → "
                     f"{b['KiB_per_decode_step']:.1f} | {-r['offload_bytes_reduction_pct']:+.1f}% | "
                     f"{a['hit_rate']:.2f} → {b['hit_rate']:.2f} | {a['decode_ms_per_step']:.1f} → "
                     f"{b['decode_ms_per_step']:.1f} |")
    lines += ["", f"Expert slots: {slots} of {4 * args.experts} (25%, LRU). Published-size MiB/step: unique experts "
              "× 4 MoE layers × 6 MiB (one bf16 Qwen3-Next expert) — what a memory-bound decode step reads. "
              f"Sequence state per row (fp32 model): {out['state_bytes_per_sequence'] / 2**10:.1f} KiB here; "
              "73.7 MiB on Qwen3-Next-80B-A3B (tests/test_qwen3_next.py).",
              "", "Reproduce: `python benchmarks/hybrid_lynx.py`"]
    (res / "hybrid_lynx.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
