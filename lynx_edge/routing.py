"""The routing hook: every MoE block asks one replaceable function for its top-k decision.

A routing function has the signature

    route(logits [T, E] fp32, is_decode [T] bool, layer: int) -> (ids [T, K] int64, weights [T, K] fp32)

`exact_route` reproduces each HF family's own router (softmax → top-k → optional renorm),
bit-for-bit with transformers. LYNX (lynx.py) and offload plug in by replacing the function
on the Engine, never by touching model files. Glossary: T tokens, E experts, K top-k.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch


@dataclass(frozen=True)
class RouterSpec:
    """What a family's router does, parsed once from config.json."""

    num_experts: int  # E routed experts
    top_k: int  # K experts per token
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to 1 (Mixtral, Qwen3-MoE)
    num_shared_experts: int = 0  # always-on experts outside the routed set (Qwen2-MoE: 1)


class RouteFn(Protocol):
    def __call__(
        self, logits: torch.Tensor, is_decode: torch.Tensor, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def exact_route(logits: torch.Tensor, spec: RouterSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k routing as transformers does it. logits [T, E] → ids [T, K], weights [T, K] fp32."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, spec.top_k, dim=-1)
    if spec.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


@dataclass
class RoutingStats:
    """Expert ids used per layer per step, filled by the MoE blocks when recording is on.

    steps[i][layer] = ids [T, K] (CPU int64) of step i. A step is one model forward.
    """

    record: bool = False
    steps: list[dict[int, torch.Tensor]] = field(default_factory=list)

    def begin_step(self) -> None:
        if self.record:
            self.steps.append({})

    def add(self, layer: int, ids: torch.Tensor) -> None:
        if self.record and self.steps:
            self.steps[-1][layer] = ids.detach().to("cpu")

    def clear(self) -> None:
        self.steps.clear()


class ExactRouter:
    """The default routing function: exact routing for every token, whatever its phase."""

    def __init__(self, spec: RouterSpec):
        self.spec = spec

    def __call__(self, logits, is_decode, layer):
        return exact_route(logits, self.spec)


RouteFactory = Callable[[RouterSpec], RouteFn]
