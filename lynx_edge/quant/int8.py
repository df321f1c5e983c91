"""An 8-bit output head for CPU decode (`int8_head`): per-row symmetric int8 weights.

At B=1 the head is read whole every token: Qwen3-30B-A3B's is 151936 x 2048, 622 MB in bf16, about
a third of what a token reads once experts and attention are 4-bit. llama.cpp's Q4_0 files keep it
in Q6_K (~6.6 bits) for the same reason, not in 4 bits: the logits are sensitive. Here it is int8
with one fp32 scale per vocabulary row (torchao's int8 weight-only scheme):

    q [V, D] int8 = round(W / s), s [V] fp32 = max|W_row| / 127      logits = s * (q @ x)

Half of bf16's bytes, and the rounding error is ~s/sqrt(12) per weight (~0.2% of a row's largest
weight). Approximate, so opt-in; its effect on the logits and on greedy tokens is measured in
benchmarks/results/int8_head.json. The native kernel (kernels/native.linear_int8) reads the int8
rows directly with fp32 products and sums; without it, torch runs on row chunks widened to fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import hugepages

CHUNK_ROWS = 2048  # rows quantised / widened at a time: ~4 fp32 temporaries of 2048 x D (32 MiB each at D = 2048)


def quantize_rows(w: torch.Tensor, huge_pages: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], s fp32 [N]) of w [N, K] (any float dtype), one row chunk at a time;
    huge_pages: q marked for 2 MiB pages before it is written (it is read whole every decode step)."""
    N, K = w.shape
    q = torch.empty(N, K, dtype=torch.int8, device=w.device)
    s = torch.empty(N, dtype=torch.float32, device=w.device)
    if huge_pages:
        hugepages.advise([q])
    for lo in range(0, N, CHUNK_ROWS):
        c = w[lo:lo + CHUNK_ROWS].float()
        amax = c.abs().amax(1)
        sc = amax / 127.0
        q[lo:lo + CHUNK_ROWS] = torch.round(c / torch.where(amax > 0, sc, 1.0)[:, None]).clamp_(-127, 127).to(torch.int8)
        s[lo:lo + CHUNK_ROWS] = sc
    return q, s


def dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [N, K] the int8 rows stand for (the reference of the kernel)."""
    return q.float() * s[:, None]


def linear_int8_torch(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ (q * s)ᵀ → [..., N] fp32, row chunks widened at a time (no native kernel)."""
    x32 = x.float()
    return torch.cat([F.linear(x32, q[lo:lo + CHUNK_ROWS].float()) * s[lo:lo + CHUNK_ROWS]
                      for lo in range(0, q.shape[0], CHUNK_ROWS)], -1)


__all__ = ["CHUNK_ROWS", "dequant", "linear_int8_torch", "quantize_rows"]
