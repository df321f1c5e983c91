"""INT4 experts vs the 16-bit model: held-out perplexity of RTN and GPTQ on the demo model.

GPTQ is calibrated on the first quarter of heldout.txt; perplexity is measured on the other
three quarters (non-overlapping 256-token windows, teacher-forced), so calibration and
evaluation text never overlap. Non-expert weights stay 16-bit in every variant.

    python benchmarks/int4_quality.py [--model demo] [--groups 128,32]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def perplexity(engine, windows: list[list[int]]) -> float:
    from lynx_edge.step import prefill

    nll, n = 0.0, 0
    for ids in windows:
        logits = prefill(engine.model, engine._cache(1), 0, ids, 0, logits_for="all")[0]
        nll += torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="sum").item()
        n += len(ids) - 1
    return math.exp(nll / n)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("--groups", default="128,32")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/int4_quality"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    from lynx_edge import Engine
    from lynx_edge.quantize import quantize_model

    base = Engine.from_pretrained(args.model, device="cpu", dtype="float32")
    text = (base.model_dir / "heldout.txt").read_text(encoding="utf-8")
    ids = base.tokenizer.encode(text[len(text) // 4 :], add_special_tokens=False)
    W = args.window
    windows = [ids[i : i + W] for i in range(0, len(ids) - W + 1, W)]
    rows = [{"variant": "16-bit weights (reference)", "ppl": perplexity(base, windows)}]
    ref = rows[0]["ppl"]
    for G in [int(g) for g in args.groups.split(",")]:
        for method in ("rtn", "gptq"):
            t = time.time()
            with tempfile.TemporaryDirectory() as tmp:
                out = quantize_model(args.model, Path(tmp) / "q", method=method, group_size=G)
                eng = Engine.from_pretrained(out, device="cpu", dtype="float32")
                ppl = perplexity(eng, windows)
            rows.append({"variant": f"INT4 {method.upper()} G={G} sym", "ppl": ppl,
                         "change_pct": 100 * (ppl / ref - 1), "quantize_s": time.time() - t})
            print(json.dumps(rows[-1]), flush=True)
    res = {"model": args.model, "eval_tokens": sum(len(w) - 1 for w in windows), "window": W,
           "calibration": "first quarter of heldout.txt; evaluation on the remaining three quarters", "rows": rows}
    Path(args.out + ".json").write_text(json.dumps(res, indent=1))
    md = ["# INT4 experts on the demo model: held-out perplexity", "",
          f"{res['eval_tokens']} evaluated tokens; {res['calibration']}.", "",
          "| variant | perplexity | change % |", "|---|---|---|"]
    md += [f"| {r['variant']} | {r['ppl']:.3f} | {r.get('change_pct', 0.0):+.2f} |" for r in rows]
    Path(args.out + ".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
