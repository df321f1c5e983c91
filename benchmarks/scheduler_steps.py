"""Greedy decode tok/s by --num-scheduler-steps (steps per native call), engines alternating round by
round in one process: what the Python between bursts costs where a step is short (the demo at B=1).

    python benchmarks/scheduler_steps.py [--model demo] [--dtypes bfloat16,float32] [--steps 1,16,32,64]
                                         [--batch 1] [--threads 1] [-r 15] [--out results/scheduler_steps.json]
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from vs_llamacpp import ab_parser, engines_ab, paired_ratio  # noqa: E402  (beside this script)


def main() -> None:
    ap = ab_parser(__doc__)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--steps", default="1,16,32,64")
    ap.add_argument("-n", type=int, default=64, help="decode tokens per round")
    ap.set_defaults(batch="1", rounds=15)
    a = ap.parse_args()
    from lynx_edge import Engine
    from lynx_edge.bench import cpu_isa, synthetic_prompts
    from lynx_edge.threads import set_threads

    set_threads(a.threads, explicit=True)
    steps = [int(s) for s in a.steps.split(",")]
    rows = []
    for dt in a.dtypes.split(","):
        for B in (int(b) for b in a.batch.split(",")):
            engines = {n: Engine.from_pretrained(a.model, device="cpu", dtype=dt, max_num_seqs=B, num_scheduler_steps=n)
                       for n in steps}
            prompts = synthetic_prompts(engines[steps[0]], B, 8)
            tok_s = engines_ab(engines, prompts, a.rounds, a.n)
            row = {"dtype": dt, "batch": B, "tok_s": {n: round(statistics.median(v), 1) for n, v in tok_s.items()}}
            for base in steps[:2]:  # paired ratios against one step per call and the next setting (16: the old default)
                row[f"vs_{base}"] = {n: paired_ratio(tok_s[n], tok_s[base]) for n in steps}
            rows.append(row)
            print(json.dumps(row), flush=True)
            del engines
    run = {"benchmark": "greedy decode tok/s by num_scheduler_steps, engines alternating", "model": a.model,
           "isa": cpu_isa(), "threads": a.threads, "rounds": a.rounds, "tokens": a.n,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}
    if a.out:
        a.out.write_text(json.dumps(run, indent=1) + "\n")


if __name__ == "__main__":
    main()
