"""Preallocated per-layer cache for a batch of sequences of different lengths.

Each layer holds the tensors its family's `cache_spec` names, each [Bmax, *shape]: for GQA
attention K and V, [Bmax, Hkv, S, hd] each (S = ctx: bytes grow with the context); for a
linear-attention or convolution layer its sequence state, `State(shape)` (models/state.py):
fixed size per row, whatever the context, in its own dtype when it names one. Row b holds
sequence b, and `lengths[b]` says how many positions of it are filled. Positions are per
sequence, so rows of different lengths decode together without padding the prompts.

A sliding-window attention layer (gpt-oss's every other layer, Qwen2-MoE's with use_sliding_window)
only ever reads its last `window` positions, so by default its K/V is a ring of R = window + slack
positions instead of ctx (llama.cpp's SWA cache; `swa_full=True`, `--swa-full`, keeps the full one):
[Bmax, Hkv, 2R, hd], position p written at slots p mod R and p mod R + R. Then a token's window,
positions p - window + 1 .. p, is always the 2R buffer's contiguous slots from (p - window + 1) mod R
in position order, so every reader (the native decode kernel, SDPA) takes the same rows in the same
order as from the full cache: the same sums. The cost of the ring: a row can be cut back (a chat
turn's prefix reused) by at most slack + 1 positions, or to about where a snapshot was kept
(`rewind`), and at most slack + 1 tokens of one row may be written by one forward before they are
read (a mixed step's prompt chunk: core.py); a prefill of any length reads the window before it
and writes its own last R (layers.Attention). Its bytes: gpt-oss-20b's 12 sliding layers keep 384
slots (192 positions) per row instead of ctx.

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


RING_SLACK = 64  # ring positions past the window: how far a row can be cut back, how many tokens one forward writes


class RingKV(tuple):
    """A sliding-window layer's (K, V) kept as a ring of `period` positions (module docstring)."""

    period: int

    def __new__(cls, tensors, period: int):
        self = super().__new__(cls, tensors)
        self.period = period
        return self


def ring_period(window: int | None, ctx: int, swa_full: bool = False, slack: int = RING_SLACK) -> int:
    """Positions in a window layer's ring (0: the full ctx, when there is no window, the caller
    keeps the full cache, or the ring's 2R slots would not be fewer than ctx)."""
    if swa_full or not window:
        return 0
    R = window + slack
    return R if 2 * R < ctx else 0


def _windows(cfg: ModelConfig) -> tuple:
    """Each layer's sliding window (None: full attention)."""
    return cfg.sliding_windows or (None,) * cfg.num_layers


def layer_specs(cfg: ModelConfig, ctx: int, swa_full: bool = False, slack: int = RING_SLACK
                ) -> list[tuple[tuple[tuple[int, ...], ...], int]]:
    """Per layer, (the shapes per batch row of its cache tensors, as its family says; its ring
    period, 0 for none)."""
    from .models.transformer import family_of

    family = family_of(cfg)
    windows = _windows(cfg)
    out = []
    for i in range(cfg.num_layers):
        R = ring_period(windows[i], ctx, swa_full, slack)
        out.append((family.cache_spec(cfg, i, 2 * R if R else ctx), R))
    return out


def _dtype(shape, dtype: torch.dtype) -> torch.dtype:
    return getattr(shape, "dtype", None) or dtype  # a State may name its own dtype


class KVCache:
    def __init__(self, cfg: ModelConfig, batch: int, ctx: int, dtype: torch.dtype, device: torch.device,
                 swa_full: bool = False, slack: int = RING_SLACK):
        self.batch, self.dtype, self.device = batch, dtype, device
        self.ctx, self.swa_full, self.slack = ctx, swa_full, slack
        while True:
            try:
                got = layer_specs(cfg, self.ctx, swa_full, slack)
                specs = [spec for spec, _ in got]
                self.rings = [R for _, R in got]
                self.layers = []
                for spec, R in got:
                    ts = tuple(torch.zeros((batch, *shape), dtype=_dtype(shape, dtype), device=device) for shape in spec)
                    self.layers.append(RingKV(ts, R) if R else ts)
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
        self._windows = _windows(cfg)
        self._snap = None  # (row, length, per layer (K, V) of the row's ring or None): snapshot()

    @property
    def stateful(self) -> bool:
        """Some layer keeps a sequence state: a cached prefix can be continued, never truncated."""
        return bool(self._states)

    def _holds(self, length: int, to: int) -> bool:
        """Whether rings that hold a row's first `length` positions can continue it at `to`: a ring
        keeps only its last R positions, and position `to` needs the window before it."""
        return all(not R or length <= R or length - to <= R - (window or 0) + 1
                   for R, window in zip(self.rings, self._windows))

    def snapshot(self, row: int | None, length: int = 0) -> None:
        """Keep a copy of the row's rings as they are after its first `length` positions (a chat
        turn's prompt: Engine), so a later turn that cuts the conversation back to about there —
        Harmony drops an earlier answer's reasoning — continues from it rather than recomputing the
        whole conversation (llama.cpp's SWA checkpoints). None: forget it. Nothing without rings."""
        self._snap = None
        if row is not None and any(self.rings):
            self._snap = (row, length, [(kv[0][row].clone(), kv[1][row].clone()) if R else None
                                        for kv, R in zip(self.layers, self.rings)])

    def rewind(self, row: int, length: int, to: int) -> int:
        """A row holding `length` positions (a cached conversation) is to continue at `to` ≤ length:
        → where it can continue, `to` or less (its snapshot's length, its rings copied back), 0 when
        the rings no longer hold the window before any of them (then the row is recomputed)."""
        if self._holds(length, to):
            return to
        snap = self._snap
        if snap is None or snap[0] != row:
            return 0
        at = min(to, snap[1])
        if not self._holds(snap[1], at):
            return 0
        for kv, saved in zip(self.layers, snap[2]):
            if saved is not None:
                kv[0][row].copy_(saved[0])
                kv[1][row].copy_(saved[1])
        return at

    @property
    def max_chunk(self) -> int | None:
        """The most tokens of one row a forward may write before reading them (a mixed step's
        packed prompt chunk: all its K/V first): slack + 1 with a ring, else None (no limit)."""
        return self.slack + 1 if any(self.rings) else None

    @staticmethod
    def bytes_needed(cfg: ModelConfig, batch: int, ctx: int, dtype: torch.dtype, swa_full: bool = False) -> int:
        """Bytes of the cache for `batch` rows × `ctx` positions: K/V grow with ctx (a window
        layer's ring does not), states are counted once per row (bytes_needed(…, ctx=0) is the
        state alone)."""
        total = 0
        for spec, _ in layer_specs(cfg, ctx, swa_full):
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
