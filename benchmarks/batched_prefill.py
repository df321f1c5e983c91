"""Prefill throughput of a batch of prompts: one forward for all of them (EngineCore's batched
prefill, step.prefill_rows) vs one forward per prompt (the previous behaviour, kept by the core
for stateful families; selected here by making every chunk its own group).

What is timed: the core's first step for B requests of P tokens (all prompts fit its budget, as in
Engine.generate_batch), i.e. the prompts' forwards + the one sampling of their first tokens.
Both modes alternate in one process (ABAB…), after a warm-up of each; medians and the ratio.

    .venv/bin/python benchmarks/batched_prefill.py --batch 16 --prompt 64 --rounds 9 --threads 1
    (--spread 32: lengths 32..64, padded groups; results: benchmarks/results/batched_prefill.md)
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import lynx_edge.core as core_mod
from lynx_edge import Engine
from lynx_edge.core import EngineCore
from lynx_edge.threads import set_threads

_GROUPS = core_mod._pad_groups


def _one_step(eng: Engine, prompts: list[list[int]], batched: bool) -> float:
    core_mod._pad_groups = _GROUPS if batched else (lambda plan: [[c] for c in plan])
    try:
        core = EngineCore(eng, max_num_seqs=len(prompts), prefill_budget=sum(map(len, prompts)), session=True)
        for i, p in enumerate(prompts):
            core.add_request(p, eng.sampling_params(max_new_tokens=1, ignore_eos=True), f"r{i}")
        t = time.perf_counter()
        outs = core.step()
        dt = time.perf_counter() - t
        assert len(outs) == len(prompts) and core.last_step["prefill_tokens"] == sum(map(len, prompts))
        return dt
    finally:
        core_mod._pad_groups = _GROUPS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--spread", type=int, default=0, help="prompt lengths drawn from prompt-spread..prompt")
    a = ap.parse_args()
    set_threads(a.threads, explicit=True)
    eng = Engine.from_pretrained(a.model, device="cpu", dtype=a.dtype)
    g = torch.Generator().manual_seed(0)
    V = eng.cfg.vocab_size
    lens = torch.randint(a.prompt - a.spread, a.prompt + 1, (a.batch,), generator=g).tolist()
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in lens]
    for mode in (False, True):  # warm-up
        _one_step(eng, prompts, mode)
    times = {False: [], True: []}
    for i in range(a.rounds):
        for mode in ((False, True) if i % 2 == 0 else (True, False)):
            times[mode].append(_one_step(eng, prompts, mode))
    n = sum(lens)
    med = {m: statistics.median(t) for m, t in times.items()}
    res = {"model": a.model, "batch": a.batch, "prompt_tokens": a.prompt, "spread": a.spread,
           "forwards": len(_GROUPS([(None, n) for n in lens])), "threads": torch.get_num_threads(),
           "dtype": a.dtype, "rounds": a.rounds, "cpu": platform.processor() or platform.machine(),
           "per_prompt_tok_s": n / med[False], "batched_tok_s": n / med[True], "speedup": med[False] / med[True],
           "per_prompt_s": sorted(times[False]), "batched_s": sorted(times[True])}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
