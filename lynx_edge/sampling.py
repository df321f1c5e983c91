"""Token selection with transformers' argument names and order of processing:
repetition_penalty → temperature → top_k → top_p → sample (seeded) or greedy (argmax).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch


@dataclass
class SamplingParams:
    max_new_tokens: int | None = 128  # None: until the context is full
    do_sample: bool = False  # False: greedy (argmax), as transformers' default
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    repetition_penalty: float = 1.0  # 1.0 = off
    # One torch.Generator per sequence, seeded with this (vLLM's per-request seed): a sequence's
    # draws never depend on the batch it runs in. An int seeds every sequence of a batch alike (the
    # same prompt gives the same text at any row); a list gives one seed per sequence.
    seed: int | list[int] | None = None
    stop_token_ids: list[int] = field(default_factory=list)  # besides the model's eos ids
    stop_strings: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    eos_token_id: list[int] | None = None  # transformers' name: replaces the model's eos ids

    def __post_init__(self):
        n = self.max_new_tokens
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ValueError(f"max_new_tokens must be an int >= 0 or None, got {n!r}")
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if isinstance(self.stop_strings, str):
            self.stop_strings = [self.stop_strings]
        self.stop_strings = list(self.stop_strings)
        if any(not isinstance(x, str) or x == "" for x in self.stop_strings):
            raise ValueError(f"stop_strings must be non-empty strings, got {self.stop_strings!r}")
        self.stop_token_ids = _ids("stop_token_ids", self.stop_token_ids)
        if self.eos_token_id is not None:
            self.eos_token_id = _ids("eos_token_id", self.eos_token_id)

    @classmethod
    def from_kwargs(cls, defaults: dict | None = None, **kw) -> "SamplingParams":
        """Caller's keywords over `defaults` (the model's generation_config.json) over ours."""
        names = {f.name for f in fields(cls)}
        unknown = set(kw) - names
        if unknown:
            raise TypeError(f"unknown sampling argument(s): {', '.join(sorted(unknown))}")
        return cls(**{**(defaults or {}), **kw})


def _ids(name: str, value) -> list[int]:
    ids = [value] if isinstance(value, int) else list(value)
    if any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise ValueError(f"{name} must be an int or a list of ints, got {value!r}")
    return ids


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits [B, V]; seen [B, V] bool (tokens in prompt or output). As transformers: divide
    positive scores, multiply negative ones."""
    if penalty == 1.0:
        return logits
    pen = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, pen, logits)


def top_k_mask(logits: torch.Tensor, k: int) -> torch.Tensor:
    """True where a logit is filtered out (below the k-th largest)."""
    if k <= 0 or k >= logits.shape[-1]:
        return torch.zeros_like(logits, dtype=torch.bool)
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits < kth


def top_p_mask(logits: torch.Tensor, p: float) -> torch.Tensor:
    """True where a logit is filtered out: outside the smallest set whose probability ≥ p
    (transformers' rule: drop the low tail whose cumulative mass ≤ 1 − p; keep ≥ 1 token)."""
    if p >= 1.0:
        return torch.zeros_like(logits, dtype=torch.bool)
    sorted_logits, idx = torch.sort(logits, descending=False, dim=-1)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cum <= (1 - p)
    remove_sorted[..., -1:] = False
    return remove_sorted.scatter(-1, idx, remove_sorted)


def select_tokens(
    logits: torch.Tensor, sp: SamplingParams, seen: torch.Tensor | None,
    generator: torch.Generator | list[torch.Generator] | None,
) -> torch.Tensor:
    """logits [B, V] fp32 → next token ids [B]. A list of generators: row b draws from generator[b]
    only, so its tokens do not depend on the other rows of the batch."""
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, sp.repetition_penalty)
    if not sp.do_sample:
        return logits.argmax(dim=-1)
    logits = logits / sp.temperature
    logits = logits.masked_fill(top_k_mask(logits, sp.top_k), float("-inf"))
    logits = logits.masked_fill(top_p_mask(logits, sp.top_p), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if isinstance(generator, (list, tuple)):
        if len(generator) != probs.shape[0]:
            raise ValueError(f"{len(generator)} generators for {probs.shape[0]} rows")
        return torch.cat([torch.multinomial(probs[b : b + 1], 1, generator=g) for b, g in enumerate(generator)]).view(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
