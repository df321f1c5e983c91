"""The LYNX trade-off curve on held-out text: unique experts vs perplexity vs greedy agreement.

For B in {4, 8, 16, 32}: the paper's rule over a grid of α (×0.5, ×1, ×2 the k/N-derived value)
and j ∈ {0, 1, 2}; the `budget:m` baseline; and the mass-capped variant `lynx-mass:τ`.
One exact pass per batch size is shared by every mode.

    python benchmarks/lynx_sweep.py [--model demo] [--batch 4,8,16,32] [--seqs 32]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def modes_for(cfg) -> list[str]:
    a0 = 4 / math.log(cfg.num_experts / cfg.top_k)
    modes = []
    for scale in (0.5, 1.0, 2.0):
        for j in (0, 1, 2):
            modes.append(f"lynx,alpha={a0 * scale:.4f},j={j}")
    E = cfg.num_experts
    modes += [f"budget:{m}" for m in sorted({max(cfg.top_k, round(E * f)) for f in (0.375, 0.5, 0.625, 0.75, 0.875)})]
    modes += [f"lynx-mass:{t}" for t in (0.05, 0.1, 0.2, 0.3, 0.5)]
    return modes


def to_markdown(res: dict) -> str:
    lines = [f"# LYNX trade-off on {res['model']} (held-out, {res['sequences']} × {res['seq_len']} tokens, "
             f"prefill {res['prefill_len']})", "",
             "| B | mode | unique exact | unique LYNX | reduction % | ppl exact | ppl LYNX | Δppl % | agreement % |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in res["results"]:
        lines.append(f"| {r['batch']} | `{r['mode']}` | {r['unique_exact']:.2f} | {r['unique_lynx']:.2f} | "
                     f"{r['reduction_pct']:.1f} | {r['ppl_exact']:.3f} | {r['ppl_lynx']:.3f} | "
                     f"{r['ppl_change_pct']:+.2f} | {r['agreement_pct']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("--batch", default="4,8,16,32")
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=64)
    ap.add_argument("--modes", default=None, help="comma-free list separated by ';' (default: the grid)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/lynx_sweep"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    from lynx_edge import Engine
    from lynx_edge.eval import evaluate, load_sequences

    eng = Engine.from_pretrained(args.model)
    seqs = load_sequences(eng, num_seqs=args.seqs, seq_len=args.seq_len)
    modes = args.modes.split(";") if args.modes else modes_for(eng.cfg)
    t = time.time()
    res = evaluate(eng, [int(b) for b in args.batch.split(",")], lynx=modes, seqs=seqs, prefill_len=args.prefill)
    res["model"] = str(args.model)
    res["minutes"] = (time.time() - t) / 60
    Path(args.out + ".json").write_text(json.dumps(res, indent=1))
    Path(args.out + ".md").write_text(to_markdown(res))
    print(to_markdown(res))


if __name__ == "__main__":
    main()
