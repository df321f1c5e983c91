"""Preallocated per-layer cache for a batch of sequences of different lengths.

Each layer holds the tensors its family's `cache_spec` names, each [Bmax, *shape]: for GQA
attention K and V, [Bmax, Hkv, S, hd] each (S = ctx: bytes grow with the context); for a
linear-attention or convolution layer its sequence state, `State(shape)` (models/state.py):
fixed size per row, whatever the context, in its own dtype when it names one. Row b holds
sequence b, and `lengths[b]` says how many positions of it are filled. Positions are per
sequence, so rows of different lengths decode together without padding the prompts.

A state cannot be truncated: a row's state always summarises every token the row has run. A state
layer reads a row whose forward starts at position 0 as zeros (a new sequence), and `reset`
zeroes state rows too. What reuses a cached prefix (Engine's chat turns) checks `stateful`.
"""
from __future__ import annotations

import math
import warnings

import torch

from .config import ModelConfig
from .models.state import State


def layer_specs(cfg: ModelConfig, ctx: int) -> list[tuple[tuple[int, ...], ...]]:
    """Per layer, the shapes (per batch row) of its cache tensors, as its family says."""
    from .models.transformer import family_of

    family = family_of(cfg)
    return [family.cache_spec(cfg, i, ctx) for i in range(cfg.num_layers)]


def _dtype(shape, dtype: torch.dtype) -> torch.dtype:
    return getattr(shape, "dtype", None) or dtype  # a State may name its own dtype


class KVCache:
    def __init__(self, cfg: ModelConfig, batch: int, ctx: int, dtype: torch.dtype, device: torch.device):
        self.batch, self.dtype, self.device = batch, dtype, device
        self.ctx = ctx
        while True:
            try:
                specs = layer_specs(cfg, self.ctx)
                self.layers = [
                    tuple(torch.zeros((batch, *shape), dtype=_dtype(shape, dtype), device=device) for shape in spec)
                    for spec in specs
                ]
                break
            except torch.OutOfMemoryError:
                if self.ctx <= 256:
                    raise
                self.layers = []
                self.ctx //= 2  # fall back to a shorter context rather than dying
                warnings.warn(f"KV cache did not fit; context reduced to {self.ctx} tokens")
        # the state tensors (fixed size per row), zeroed when their row is reset
        self._states = [t for layer, spec in zip(self.layers, specs) for t, s in zip(layer, spec)
                        if isinstance(s, State)]
        self.lengths = [0] * batch

    @property
    def stateful(self) -> bool:
        """Some layer keeps a sequence state: a cached prefix can be continued, never truncated."""
        return bool(self._states)

    @staticmethod
    def bytes_needed(cfg: ModelConfig, batch: int, ctx: int, dtype: torch.dtype) -> int:
        """Bytes of the cache for `batch` rows × `ctx` positions: K/V grow with ctx, states are
        counted once per row (bytes_needed(…, ctx=0) is the state alone)."""
        total = 0
        for spec in layer_specs(cfg, ctx):
            for shape in spec:
                total += math.prod(shape) * torch.empty((), dtype=_dtype(shape, dtype)).element_size()
        return batch * total

    @staticmethod
    def state_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
        """Bytes of sequence state per row (0 for a pure-attention model)."""
        return KVCache.bytes_needed(cfg, 1, 0, dtype)

    def reset(self, rows: range | None = None) -> None:
        rows = rows if rows is not None else range(self.batch)
        for b in rows:
            self.lengths[b] = 0
            for t in self._states:
                t[b].zero_()
