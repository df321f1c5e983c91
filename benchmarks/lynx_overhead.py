"""What LYNX costs on the CPU decode step, apart from what it saves (issue 16, item 2).

Three routers on the same model, same batch, alternated run by run so machine drift hits all
three alike: `off` (exact routing), `discarded` (LYNX computed in full — telemetry included — and
its result thrown away: the step then runs the exact experts, so the difference to `off` is pure
selection cost) and `on`. Reports median TPOT per router and overhead = discarded / off − 1.

    python benchmarks/lynx_overhead.py [--model demo] [--batch 4,16] [--steps 32] [--reps 7]
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


class Discarded:
    """LynxRouter's full work, then the exact result."""

    def __init__(self, lynx, exact):
        self.lynx, self.exact = lynx, exact

    def begin_step(self, is_decode=None):
        self.lynx.begin_step(is_decode)

    def __call__(self, logits, is_decode, layer, probs=None):
        self.lynx(logits, is_decode, layer, probs=probs)
        return self.exact(logits, is_decode, layer, probs=probs)


def tpot(engine, route, B: int, steps: int) -> float:
    """Median ms per decode step of B rows (prefilled with 16 different prompt tokens each)."""
    from lynx_edge.step import decode_step, prefill

    model = engine.model
    kv = engine._cache(B)
    kv.reset()
    model.routing.route = route
    for r in range(B):  # a different prompt per row, so rows route differently (as real batches do)
        prefill(model, kv, r, [(37 * r + 11 * i) % 200 + 10 for i in range(16)])
    tok = torch.arange(B, dtype=torch.long) * 13 + 20
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        logits = decode_step(model, kv, list(range(B)), tok)
        tok = logits.argmax(-1)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("--batch", default="4,16")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/lynx_overhead.json"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from lynx_edge import Engine
    from lynx_edge.lynx import LynxRouter
    from lynx_edge.routing import ExactRouter

    eng = Engine.from_pretrained(a.model, device="cpu", threads=a.threads)
    spec = eng.model.routing.spec
    rows = []
    for B in [int(b) for b in a.batch.split(",")]:
        runs: dict[str, list[float]] = {"off": [], "discarded": [], "on": []}
        for _ in range(a.reps):
            for name in runs:
                exact = ExactRouter(spec)
                route = {"off": exact, "discarded": Discarded(LynxRouter(spec, "lynx"), exact),
                         "on": LynxRouter(spec, "lynx")}[name]
                runs[name].append(tpot(eng, route, B, a.steps))
        med = {k: statistics.median(v) for k, v in runs.items()}
        rows.append({"batch": B, **{f"{k}_ms": round(v, 3) for k, v in med.items()},
                     "overhead": round(med["discarded"] / med["off"] - 1, 4),
                     "speedup_on": round(med["off"] / med["on"], 4),
                     "spread_off_ms": [round(min(runs["off"]), 3), round(max(runs["off"]), 3)]})
        print(json.dumps(rows[-1]))
    out = {"model": a.model, "threads": a.threads, "reps": a.reps, "steps": a.steps,
           "torch": torch.__version__, "isa": torch.backends.cpu.get_cpu_capability(), "rows": rows}
    Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
