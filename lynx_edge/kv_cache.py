"""Preallocated KV cache for a batch of sequences of different lengths.

One (k, v) pair per layer, each [Bmax, Hkv, S, hd]; row b holds sequence b, and `lengths[b]`
says how many positions of it are filled. Positions are per sequence, so rows of different
lengths decode together without padding the prompts.
"""
from __future__ import annotations

import warnings

import torch

from .config import ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, batch: int, ctx: int, dtype: torch.dtype, device: torch.device):
        self.batch, self.dtype, self.device = batch, dtype, device
        self.ctx = ctx
        while True:
            try:
                shape = (batch, cfg.num_kv_heads, self.ctx, cfg.head_dim)
                self.layers = [
                    (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                    for _ in range(cfg.num_layers)
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
        return 2 * cfg.num_layers * batch * cfg.num_kv_heads * ctx * cfg.head_dim * el

    def reset(self, rows: range | None = None) -> None:
        for b in rows if rows is not None else range(self.batch):
            self.lengths[b] = 0
