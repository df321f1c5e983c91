"""Fiddler-style CPU experts: compute an expert on the host for the few tokens routed to it.

Moving a token's activation (D values) is far cheaper than moving the expert (3·D·I weights),
so for experts with few tokens the host computes them from the host store with torch on the
machine's threads, and only the activations cross the link: one gather + copy of the rows in,
one copy of the results back. Glossary: N tokens, D hidden, I expert intermediate.
"""
from __future__ import annotations

import time

import torch


class CpuExperts:
    def __init__(self, store):
        self.store = store
        self.calls = self.tokens = 0
        self.seconds = 0.0

    def gather(self, x: torch.Tensor, jobs: list[tuple[int, torch.Tensor]]) -> torch.Tensor | None:
        """x [N, D] on the device, jobs [(expert, token rows [n_e])] → their rows on the host [Σn, D]
        (the one device→host copy of the layer; issue it before launching other device work)."""
        if not jobs:
            return None
        return x.index_select(0, torch.cat([t for _, t in jobs])).to("cpu")

    def compute(self, layer: int, xh: torch.Tensor | None, jobs: list[tuple[int, torch.Tensor]],
                device: torch.device) -> dict[int, torch.Tensor]:
        """→ {expert: y [n_e, D]} on `device`, computed on the host in xh's dtype."""
        if not jobs:
            return {}
        t0 = time.perf_counter()
        ys, at = [], 0
        for e, t in jobs:
            n = t.numel()
            ys.append(self.store.compute(layer, e, xh[at : at + n]))  # the store format's own math
            at += n
        y = torch.cat(ys).to(device, non_blocking=device.type == "cuda")  # one copy back
        out, at = {}, 0
        for (e, t), yy in zip(jobs, ys):
            out[e] = y[at : at + yy.shape[0]]
            at += yy.shape[0]
        self.calls += len(jobs)
        self.tokens += xh.shape[0]
        self.seconds += time.perf_counter() - t0
        return out

    def run(self, layer: int, x: torch.Tensor, jobs: list[tuple[int, torch.Tensor]]) -> dict[int, torch.Tensor]:
        return self.compute(layer, self.gather(x, jobs), jobs, x.device)

__all__ = ["CpuExperts"]
