"""Where a CPU decode token goes: the native step call vs everything around it (issue 16).

For each batch size, four numbers from one process, medians over rounds:
- `token_ms`: time per decode token through the engine's streaming call (TPOT of bench.measure),
  greedy bursts on (num_scheduler_steps 16: several steps per native call); `token_ms_one_step_per_call`
  the same with 1, alternating with it;
- `step_ms`: step.decode_step alone in a steady loop (cache length fixed, no sampling, no engine);
- `native_ms`: the native calls per decode step (kernels/native.Stack: every decoder layer, the
  router inside each, the final norm and the head; with bursts the embedding and argmax too),
  timed around the ctypes calls.
token − native is the Python and torch around the kernels (embedding, per-step tensors, plan checks,
sampling, the engine's bookkeeping); step − native the part of it inside decode_step.

    python benchmarks/decode_step.py [--model demo] [--dtype bfloat16] [--batch 1,16] [--threads 1]
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens per engine round")
    ap.add_argument("--out", default=None, help="JSON file for the rows (default: print only)")
    ap.add_argument("--int4-act", default=None, choices=("f32", "q16", "q8"), help="a 4-bit checkpoint's activations")
    a = ap.parse_args()
    from lynx_edge import Engine, step
    from lynx_edge.bench import measure, synthetic_prompts
    from lynx_edge.kernels import native
    from lynx_edge.threads import set_threads

    set_threads(a.threads, explicit=True)
    sizes = [int(b) for b in a.batch.split(",")]
    eng = Engine.from_pretrained(a.model, device="cpu", dtype=a.dtype, max_num_seqs=max(sizes), int4_act=a.int4_act)
    spent = [0.0, 0]  # seconds in the native calls, decode steps they ran
    real, real_greedy = native.Stack.__call__, native.Stack.greedy

    def timed(*args):
        t = time.perf_counter()
        out = real(*args)
        spent[0] += time.perf_counter() - t
        spent[1] += 1
        return out

    def timed_greedy(*args):
        t = time.perf_counter()
        out = real_greedy(*args)
        spent[0] += time.perf_counter() - t
        spent[1] += out[0]
        return out

    native.Stack.__call__, native.Stack.greedy = timed, timed_greedy
    rows = []
    for B in sizes:
        prompts = synthetic_prompts(eng, B, 8)
        measure(eng, prompts, 8)  # warm-up: kernels built, plans made
        tok, tok1, nat = [], [], []
        for _ in range(a.rounds):  # greedy bursts (the default) and one call per step, alternating
            eng.config.num_scheduler_steps = 1
            tok1.append(measure(eng, prompts, a.tokens + 1)["tpot_ms"])
            eng.config.num_scheduler_steps = 16
            spent[:] = [0.0, 0]
            tok.append(measure(eng, prompts, a.tokens + 1)["tpot_ms"])
            nat.append(spent[0] / max(spent[1], 1) * 1e3)
        model, kv = eng.model, eng._cache(B)
        for r in range(B):
            step.prefill(model, kv, r, prompts[r])
        ids, rws, n0 = torch.tensor([p[-1] for p in prompts]), list(range(B)), len(prompts[0])
        steps = []
        for _ in range(a.rounds):
            t = time.perf_counter()
            for _ in range(100):
                step.decode_step(model, kv, rws, ids)
                for r in rws:
                    kv.lengths[r] = n0
            steps.append((time.perf_counter() - t) / 100 * 1e3)
        row = {"batch": B, "token_ms": round(statistics.median(tok), 4),
               "token_ms_one_step_per_call": round(statistics.median(tok1), 4),
               "step_ms": round(statistics.median(steps), 4),
               "native_ms": round(statistics.median(nat), 4)}
        row["python_share_of_token"] = round(1 - row["native_ms"] / row["token_ms"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    native.Stack.__call__, native.Stack.greedy = real, real_greedy
    if a.out:
        Path(a.out).write_text(json.dumps({"model": a.model, "dtype": a.dtype, "threads": a.threads,
                                           "rounds": a.rounds, "torch": torch.__version__,
                                           "isa": torch.backends.cpu.get_cpu_capability(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
