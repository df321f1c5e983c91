"""Per-sequence state of non-attention token mixers (linear attention, short convolutions).

A family's `cache_spec` names such a tensor with `State(shape, dtype)`: one fixed-size tensor
per batch row, independent of the context length (KVCache allocates [Bmax, *shape] and counts it
once per row). A state cannot be truncated the way a K/V cache can: it always summarises exactly
the tokens its row has run, so the rules a state layer follows are
  - a row whose first token in this forward is at position 0 starts a new sequence: its old
    state (an earlier request's, or a cached chat turn's) is ignored, read as zeros;
  - otherwise the state continues from what the row's previous forward left (chunked prefill,
    decode), so every forward of a row must hold its tokens in order, none twice.
Glossary: B rows in the forward, T tokens per row, C channels, K conv kernel.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class State(tuple):
    """A per-row cache shape that is sequence state (fixed size), not per-token K/V.
    dtype: the state's own dtype (e.g. fp32 for a recurrent state accumulated over thousands of
    tokens) or None for the model's."""

    dtype: torch.dtype | None

    def __new__(cls, shape, dtype: torch.dtype | None = None):
        obj = super().__new__(cls, shape)
        obj.dtype = dtype
        return obj

    def __reduce__(self):  # keep the dtype through copy/pickle
        return State, (tuple(self), self.dtype)


def read_state(cache: torch.Tensor, ab) -> torch.Tensor:
    """The state of the forward's rows before it runs, [B, *S]: zeros for a row that starts a new
    sequence here (its first token at position 0). A view of the cache when the rows are a
    slice: compute the new state out of place, then write_state it."""
    s = cache[ab.rows]
    if ab.start is not None:  # every row at the same positions: a host decision, no mask
        return s if ab.start > 0 else torch.zeros_like(s)
    fresh = (ab.positions[:, 0] == 0).view(-1, *([1] * (s.dim() - 1)))  # [B, 1, …]
    return s.masked_fill(fresh, 0)


def write_state(cache: torch.Tensor, ab, value: torch.Tensor) -> None:
    cache[ab.rows] = value.to(cache.dtype)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, conv_cache: torch.Tensor, ab,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal conv1d over each row's tokens, continuing from its conv state.

    x [B, C, T]; weight [C, 1, K]; conv_cache [Bmax, C, K-1]: the row's last K-1 inputs (zeros
    before a sequence's first token, as the zero left padding of a plain causal conv).
    → [B, C, T] (no activation), and the rows' conv state updated in place."""
    K = weight.shape[-1]
    past = read_state(conv_cache, ab).to(x.dtype)  # [B, C, K-1]
    full = torch.cat([past, x], dim=-1)  # [B, C, K-1+T]
    write_state(conv_cache, ab, full[..., full.shape[-1] - (K - 1):])
    if x.device.type == "cpu" and weight.dtype != torch.float32:
        # fp32 on a CPU, rounded once: its 16-bit depthwise conv1d took 6.3 ms for one token of a
        # 2048-channel layer (fp32: 0.1 ms) on AVX2 without native bf16 (benchmarks/results/README.md)
        return F.conv1d(full.float(), weight.float(), None if bias is None else bias.float(),
                        groups=x.shape[1]).to(weight.dtype)
    return F.conv1d(full.to(weight.dtype), weight, bias, groups=x.shape[1])


__all__ = ["State", "causal_conv", "read_state", "write_state"]
