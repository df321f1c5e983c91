#!/usr/bin/env python
"""LYNX on LFM2-MoE (lfm2_moe): unique experts and expert bytes per decode step at B = 1, 4, 16.

A tiny random LFM2-MoE written by transformers from the published LFM2-8B-A1B config with the
sizes shrunk (tests/lfm2_tiny.py: 8 layers as the published first 8, 6 MoE layers, E = 32, K = 4,
sigmoid router with expert bias) decodes B greedy sequences (synthetic code prompts of mixed
lengths). Per B:
  resident   unique experts per MoE layer per decode step, exact vs LYNX (`on` = the recommended
             lynx-mass:0.2,j=0, and the paper's `lynx`), i.e. the expert bytes a memory-bound decode
             step reads; greedy agreement with exact routing
  offload    experts in host memory, 25% of them in device slots (the CPU stands in for the GPU:
             the bytes are the same), LRU or the lynx cache policy, exact vs residency-aware LYNX:
             host→device bytes and wall time per decode step
Bytes are given for the tiny model (fp32) and, projected with the same unique counts per layer,
for the published shape (22 MoE layers, 22.0 MB per bf16 expert). A random router says little
about a trained one: rerun with --model on the real checkpoint.

    python benchmarks/lynx_lfm2_moe.py [--model DIR] [--batches 1,4,16] [--new-tokens 32]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from lynx_edge import Engine  # noqa: E402
from lynx_edge.config import ModelConfig  # noqa: E402
from lynx_edge.models.lfm2_moe import SCORE_SCALE  # noqa: E402
from lynx_edge.offload import OffloadOptions, attach_offload  # noqa: E402

PUBLISHED = ROOT / "tests" / "fixtures" / "lfm2-8b-a1b" / "config.json"
TEXT = ("def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"
        "The quick brown fox jumps over the lazy dog. import os\nfor i in range(10):\n    print(i)\n") * 8


def _model(arg: str | None) -> tuple[Path, bool]:
    if arg:
        return Path(arg), False
    from lfm2_tiny import make_lfm2_moe  # needs transformers (the dev extra)

    path = Path(tempfile.gettempdir()) / "lynx_edge_bench_tiny_lfm2_moe"
    if not (path / "config.json").is_file():
        make_lfm2_moe(path)
    return path, True


def _prompts(eng: Engine, B: int) -> list[list[int]]:
    ids = eng.tokenizer.encode(TEXT)
    return [ids[7 * b: 7 * b + 16 + (5 * b) % 17] for b in range(B)]  # 16..32 tokens


def _decode(eng: Engine, prompts, n: int) -> tuple[list[list[int]], dict, float]:
    toks = [[] for _ in prompts]
    t0 = time.perf_counter()
    for c in eng.stream_batch(prompts, max_new_tokens=n, do_sample=False, ignore_eos=True):
        toks[c.index] += c.token_ids
    return toks, dict(eng.last_stats), time.perf_counter() - t0


def _agree(a, b) -> float:
    pairs = [(x, y) for s, t in zip(a, b) for x, y in zip(s, t)]
    return sum(x == y for x, y in pairs) / len(pairs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="an lfm2_moe checkpoint (default: a tiny random one, generated)")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--cache-frac", type=float, default=0.25, help="offload: device slots / all experts")
    ap.add_argument("--repeats", type=int, default=3, help="offload timing: median of this many runs")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "lynx_lfm2_moe"))
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    path, generated = _model(args.model)
    eng = Engine.from_pretrained(path, device="cpu", record_routing=True)
    cfg, pub = eng.cfg, ModelConfig.from_file(PUBLISHED)
    n_moe = len(cfg.moe_layer_ids)
    el = eng.model.dtype.itemsize
    tiny_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * el
    pub_expert = 3 * pub.hidden_size * pub.moe_intermediate_size * 2  # bf16
    pub_moe = len(pub.moe_layer_ids)
    slots = max(cfg.top_k, round(args.cache_frac * n_moe * cfg.num_experts))
    rows = []
    for B in [int(b) for b in args.batches.split(",")]:
        prompts = _prompts(eng, B)
        eng.set_lynx("off")
        exact, st, _ = _decode(eng, prompts, args.new_tokens)
        u_exact = st["unique_experts_per_layer"]
        # `on`, the paper's rule, and the paper's rule at α / SCORE_SCALE: what LYNX would do on the
        # raw sigmoid + bias scores (why the family hands them over ×4)
        a0 = 4 / math.log(cfg.num_experts / cfg.top_k)
        for mode in ("on", "lynx", f"lynx,alpha={a0 / SCORE_SCALE:.4f}"):
            eng.set_lynx(mode)
            toks, st, _ = _decode(eng, prompts, args.new_tokens)
            lx = st["lynx"]
            u_lynx = st["unique_experts_per_layer"]
            rows.append({
                "batch": B, "setting": "resident", "lynx": mode, "unique_exact": u_exact, "unique_lynx": u_lynx,
                "reduction_pct": 100 * (1 - u_lynx / u_exact) if u_exact else 0.0,
                "remap_rate_pct": lx["remap_rate_pct"], "greedy_agreement": _agree(toks, exact),
                "tiny_expert_bytes_per_step_exact": u_exact * n_moe * tiny_expert,
                "tiny_expert_bytes_per_step_lynx": u_lynx * n_moe * tiny_expert,
                "published_expert_bytes_per_step_exact": u_exact * pub_moe * pub_expert,
                "published_expert_bytes_per_step_lynx": u_lynx * pub_moe * pub_expert,
            })
            r = rows[-1]
            print(f"B={B:2d} resident {mode:<5} unique/layer {u_exact:5.2f} → {u_lynx:5.2f} "
                  f"({r['reduction_pct']:5.1f}% fewer)  agree {r['greedy_agreement']:.2f}", flush=True)
        eng.set_lynx("off")
        for policy, lynx in [(p, m) for p in ("lru", "lynx") for m in (None, "on", "lynx")]:
            per_step, st = [], None
            for _ in range(args.repeats):
                rt = attach_offload(eng.model, OffloadOptions(expert_slots=slots, policy=policy, lynx=lynx,
                                                              cpu_compute="never", profile="cpu-only", batch=B))
                toks, _, dt = _decode(eng, prompts, args.new_tokens)
                st = rt.stats()
                rt.detach()
                per_step.append(dt / max(st["decode_steps"], 1))
            rows.append({
                "batch": B, "setting": "offload", "policy": policy, "lynx": lynx or "off",
                "h2d_bytes_per_decode_step": st["bytes_per_decode_step"], "copies": st["copies"],
                "hit_rate": st["hit_rate"], "remapped_to_resident": st["remapped_to_resident"],
                "ms_per_decode_step_median": 1e3 * statistics.median(per_step),
                "greedy_agreement": _agree(toks, exact),
            })
            r = rows[-1]
            print(f"B={B:2d} offload  {policy:<4} {r['lynx']:<5} {r['h2d_bytes_per_decode_step'] / 1024:8.1f} KiB/step  "
                  f"hit {r['hit_rate']:.2f}  {r['ms_per_decode_step_median']:.2f} ms/step", flush=True)
        eng.set_lynx("off")
    from lynx_edge.threads import set_threads

    meta = {"model": "tiny random lfm2_moe (tests/lfm2_tiny.py, generated)" if generated else str(path),
            "layers": cfg.num_layers, "moe_layers": n_moe, "num_experts": cfg.num_experts, "top_k": cfg.top_k,
            "hidden": cfg.hidden_size, "moe_intermediate": cfg.moe_intermediate_size, "dtype": str(eng.model.dtype),
            "tiny_bytes_per_expert": tiny_expert, "published_bytes_per_expert_bf16": pub_expert,
            "published_moe_layers": pub_moe, "expert_slots": slots, "new_tokens": args.new_tokens,
            "prompts": "16-32 tokens of synthetic code text, mixed lengths", "device": "cpu (stands in for the GPU)",
            "threads": set_threads(None), "torch": torch.__version__}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    out.with_suffix(".md").write_text(_markdown(meta, rows))
    print(f"wrote {out}.json and .md")
    return 0


def _markdown(meta: dict, rows: list[dict]) -> str:
    mib = 2**20
    lines = [f"# LYNX on LFM2-MoE: unique experts and bytes per decode step", "",
             f"Model: {meta['model']} — {meta['layers']} layers ({meta['moe_layers']} MoE), E={meta['num_experts']}, "
             f"K={meta['top_k']}, D={meta['hidden']}, I={meta['moe_intermediate']}, {meta['dtype']}; sigmoid router "
             f"with expert bias (LYNX sees the biased selection scores). {meta['new_tokens']} greedy decode steps "
             f"after {meta['prompts']}; {meta['device']}, {meta['threads']} threads.", "",
             "Random router weights: the figures show the mechanism working on this family, not what a trained "
             "router gives. 'published' projects the same unique counts per layer onto LFM2-8B-A1B's "
             f"{meta['published_moe_layers']} MoE layers × {meta['published_bytes_per_expert_bf16'] / 1e6:.1f} MB "
             "per bf16 expert. Greedy agreement on random weights says nothing of quality: one changed token "
             "changes the rest of a random model's continuation (quality: lynx_edge/eval.py on a trained model).", "",
             "## Resident: unique experts per MoE layer per decode step", "",
             "| B | LYNX | unique exact | unique LYNX | reduction % | remapped slots % | greedy agree | "
             "tiny KiB/step exact → LYNX | published MiB/step exact → LYNX |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["setting"] == "resident":
            lines.append(
                f"| {r['batch']} | `{r['lynx']}` | {r['unique_exact']:.2f} | {r['unique_lynx']:.2f} | "
                f"{r['reduction_pct']:.1f} | {r['remap_rate_pct']:.1f} | {r['greedy_agreement']:.2f} | "
                f"{r['tiny_expert_bytes_per_step_exact'] / 1024:.0f} → {r['tiny_expert_bytes_per_step_lynx'] / 1024:.0f} | "
                f"{r['published_expert_bytes_per_step_exact'] / mib:.0f} → "
                f"{r['published_expert_bytes_per_step_lynx'] / mib:.0f} |")
    lines += ["", f"## Offload: {meta['expert_slots']} device slots (25% of experts)", "",
              "| B | cache policy | LYNX | H2D KiB/step | copies | hit rate | remapped→resident | ms/step (median) | "
              "greedy agree |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["setting"] != "resident":
            lines.append(f"| {r['batch']} | {r['policy']} | `{r['lynx']}` | {r['h2d_bytes_per_decode_step'] / 1024:.1f} | "
                         f"{r['copies']} | "
                         f"{r['hit_rate']:.2f} | {r['remapped_to_resident']} | {r['ms_per_decode_step_median']:.2f} | "
                         f"{r['greedy_agreement']:.2f} |")
    lines += ["", "Reproduce: `python benchmarks/lynx_lfm2_moe.py` (`--model DIR` for a real checkpoint)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
