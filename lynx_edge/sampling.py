"""Token selection with transformers' argument names and order of processing:
repetition_penalty → temperature → top_k → top_p → sample (seeded) or greedy (argmax).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    do_sample: bool = False  # False: greedy (argmax), as transformers' default
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    repetition_penalty: float = 1.0  # 1.0 = off
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)  # besides the model's eos ids
    stop_strings: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
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

    @classmethod
    def from_kwargs(cls, **kw) -> "SamplingParams":
        names = {f.name for f in fields(cls)}
        unknown = set(kw) - names
        if unknown:
            raise TypeError(f"unknown sampling argument(s): {', '.join(sorted(unknown))}")
        if "eos_token_id" in kw:  # transformers' spelling
            kw["stop_token_ids"] = list(kw.pop("eos_token_id"))
        return cls(**kw)


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
    logits: torch.Tensor, sp: SamplingParams, seen: torch.Tensor | None, generator: torch.Generator | None
) -> torch.Tensor:
    """logits [B, V] fp32 → next token ids [B]."""
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, sp.repetition_penalty)
    if not sp.do_sample:
        return logits.argmax(dim=-1)
    logits = logits / sp.temperature
    logits = logits.masked_fill(top_k_mask(logits, sp.top_k), float("-inf"))
    logits = logits.masked_fill(top_p_mask(logits, sp.top_p), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
