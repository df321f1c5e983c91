"""Preallocated per-layer cache for a batch of sequences of different lengths.

Each layer holds the tensors its family's `cache_spec` names, each [Bmax, *shape]: for GQA
attention K and V, [Bmax, Hkv, S, hd] each. Row b holds sequence b, and `lengths[b]` says how
many positions of it are filled. Positions are per sequence, so rows of different lengths
decode together without padding the prompts.
"""
from __future__ import annotations

import math
import warnings

import torch

from .config import ModelConfig


def layer_specs(cfg: ModelConfig, ctx: int) -> list[tuple[tuple[int, ...], ...]]:
    """Per layer, the shapes (per batch row) of its cache tensors, as its family says."""
    from .models.transformer import family_of

    family = family_of(cfg)
    return [family.cache_spec(cfg, i, ctx) for i in range(cfg.num_layers)]


class KVCache:
    def __init__(self, cfg: ModelConfig, batch: int, ctx: int, dtype: torch.dtype, device: torch.device):
        self.batch, self.dtype, self.device = batch, dtype, device
        self.ctx = ctx
        while True:
            try:
                self.layers = [
                    tuple(torch.zeros((batch, *shape), dtype=dtype, device=device) for shape in spec)
                    for spec in layer_specs(cfg, self.ctx)
                ]
                break
            except torch.OutOfMemoryError:
                if self.ctx <= 256:
                    raise
                self.layers = []
                self.ctx //= 2  # fall back to a shorter context rather than dying
                warnings.warn(f"KV cache did not fit; context reduced to {self.ctx} tokens")
        self.lengths = [0] * batch

    @staticmethod
    def bytes_needed(cfg: ModelConfig, batch: int, ctx: int, dtype: torch.dtype) -> int:
        el = torch.empty((), dtype=dtype).element_size()
        return batch * el * sum(math.prod(shape) for spec in layer_specs(cfg, ctx) for shape in spec)

    def reset(self, rows: range | None = None) -> None:
        for b in rows if rows is not None else range(self.batch):
            self.lengths[b] = 0
