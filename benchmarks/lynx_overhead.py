"""What LYNX costs on the CPU decode step, apart from what it saves (issue 16, item 2).

Three routers on the same model, same batch, alternated run by run so machine drift hits all
three alike: `off` (exact routing), `discarded` (LYNX computed in full — telemetry included — and
its result thrown away: the step then runs the exact experts, so the difference to `off` is pure
selection cost; with the native kernels inside the same one-call layer as `off`, route_t.discard)
and `on`. Reports median TPOT per router and overhead = discarded / off − 1, and
the same cost measured directly (overhead_direct = MoE layers × one LYNX router call, timed on the
batch's recorded decode logits, / the exact step), which run-to-run noise of the steps cannot hide,
and both routers' mean call time inside real decode steps (between the layer kernels, caches colder:
2-3x the hot-loop time).

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
        self._plans = {}  # (layer, T) → LYNX's native plan with discard set

    def begin_step(self, is_decode=None):
        for r in (self.lynx, self.exact):
            if hasattr(r, "begin_step"):
                r.begin_step(is_decode)

    def __call__(self, logits, is_decode, layer, probs=None):
        self.lynx(logits, is_decode, layer, probs=probs)
        return self.exact(logits, is_decode, layer, probs=probs)

    def native_plan(self, layer, T):
        """Inside the native layer call: LYNX's plan with `discard` set (its whole selection and
        stats computed, the exact choice used), so `discarded` runs the same one-call step as `off`."""
        plan = self.lynx.native_plan(layer, T) if hasattr(self.lynx, "native_plan") else None
        if plan is None:
            return None
        got = self._plans.get((layer, T))
        if got is None:
            got = self._plans[(layer, T)] = type(plan).from_buffer_copy(plan)
            got.discard = 1
        return got

    def native_done(self, layers, ids, weights, vec):
        self.lynx.native_done(layers, ids, weights, vec)


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


class Spy:
    """Exact routing that keeps each layer's router logits (to time the routers on real inputs)."""

    def __init__(self, exact):
        self.exact, self.logits = exact, {}

    def begin_step(self, is_decode=None):
        pass

    def __call__(self, logits, is_decode, layer, probs=None):
        self.logits[layer] = logits.clone()
        return self.exact(logits, is_decode, layer, probs=probs)


class Timed:
    """A router wrapper that sums the time of its calls (in the running step: caches as they are)."""

    def __init__(self, route):
        self.route, self.s, self.n, self.decode = route, 0.0, 0, False

    def begin_step(self, is_decode=None):
        self.decode = is_decode is True  # decode steps only: the prompts' prefill is not timed
        if hasattr(self.route, "begin_step"):
            self.route.begin_step(is_decode)

    def __call__(self, logits, is_decode, layer, probs=None):
        t = time.perf_counter()
        out = self.route(logits, is_decode, layer, probs=probs)
        if self.decode:
            self.s, self.n = self.s + time.perf_counter() - t, self.n + 1
        return out


def router_us(route, logits: dict, n: int = 2000) -> float:
    """Median µs of one router call per layer on recorded decode logits (timed in blocks of n/10)."""
    if hasattr(route, "begin_step"):
        route.begin_step(True)
    dec = torch.ones(next(iter(logits.values())).shape[0], dtype=torch.bool)
    blocks = []
    for _ in range(10):
        t = time.perf_counter()
        for _ in range(n // 10):
            for layer, z in logits.items():
                route(z, dec, layer)
        blocks.append((time.perf_counter() - t) / (n // 10) / len(logits))
    return statistics.median(blocks) * 1e6


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
        # the same cost measured directly: each router timed on this batch's real decode logits
        spy = Spy(ExactRouter(spec))
        tpot(eng, spy, B, 2)
        lynx_us, exact_us = router_us(LynxRouter(spec, "lynx"), spy.logits), router_us(ExactRouter(spec), spy.logits)
        L = len(spy.logits)
        lynx_t, exact_t = Timed(LynxRouter(spec, "lynx")), Timed(ExactRouter(spec))
        tpot(eng, Discarded(lynx_t, exact_t), B, a.steps)  # both routers inside real decode steps
        rows.append({"batch": B, **{f"{k}_ms": round(v, 3) for k, v in med.items()},
                     "overhead": round(med["discarded"] / med["off"] - 1, 4),
                     "speedup_on": round(med["off"] / med["on"], 4),
                     "spread_off_ms": [round(min(runs["off"]), 3), round(max(runs["off"]), 3)],
                     "lynx_router_us": round(lynx_us, 2), "exact_router_us": round(exact_us, 2), "moe_layers": L,
                     # the same calls inside real decode steps, between the layer kernels (colder caches)
                     "lynx_router_in_step_us": round(lynx_t.s / lynx_t.n * 1e6, 2),
                     "exact_router_in_step_us": round(exact_t.s / exact_t.n * 1e6, 2),
                     # LYNX computed per step on top of exact routing, over the exact step (the quantity
                     # `overhead` estimates end to end, without its run-to-run noise)
                     "overhead_direct": round(L * lynx_us / 1e3 / med["off"], 4),
                     # what `on` adds: LYNX's router in place of the exact one
                     "net_router_cost_on": round(L * (lynx_us - exact_us) / 1e3 / med["off"], 4)})
        print(json.dumps(rows[-1]))
    out = {"model": a.model, "threads": a.threads, "reps": a.reps, "steps": a.steps,
           "torch": torch.__version__, "isa": torch.backends.cpu.get_cpu_capability(), "rows": rows}
    Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
