"""The routing hook: every MoE block asks one replaceable function for its top-k decision.

A routing function has the signature

    route(logits [T, E] fp32, is_decode [T] bool, layer: int, probs=None)
        -> (ids [T, K] int64, weights [T, K] fp32)

`logits` are the scores the family selects its top-k on; `probs` [T, E] (optional) the
probabilities its gate weights come from when they are not softmax(logits) — e.g. DeepSeek
selects among the experts of its best groups (the others at −inf in `logits`) but weighs by the
softmax over all experts. A router never picks an expert whose score is −inf while the token has
a finite one left. `exact_route` reproduces each HF family's own router (top-k → weights from
probs → optional renorm → × routed_scaling_factor), bit-for-bit with transformers whenever the
top-k scores are distinct. LYNX (lynx.py) and
offload plug in by replacing the function on the Engine, never by touching model files.

Tie rule (one rule for exact_route, lynx_select and the Triton kernel kernels/lynx_route.py):
experts rank by router logit, highest first, and equal logits rank by expert id, lowest first;
so a row with fewer than K finite logits (−inf masked) takes the lowest ids among its −inf
ones, each once. torch.topk promises no order among equal values (on CPU it returned [4, 7, 1]
for four tied experts 1, 2, 4, 7), so exact_route ranks with a stable sort of the logits.
Glossary: T tokens, E experts, K top-k.
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
    routed_scaling_factor: float = 1.0  # gate weights × this (DeepSeek)


class RouteFn(Protocol):
    def __call__(
        self, logits: torch.Tensor, is_decode: torch.Tensor, layer: int, probs: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def rank_experts(logits: torch.Tensor) -> torch.Tensor:
    """logits [T, E] → expert ids [T, E] by the tie rule: logit descending, then id ascending."""
    return torch.sort(logits, dim=-1, descending=True, stable=True).indices


def exact_route(logits: torch.Tensor, spec: RouterSpec,
                probs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k routing as transformers does it. logits [T, E] → ids [T, K], weights [T, K] fp32.
    Softmax is monotone, so the top-k by logit are the top-k by probability (ties: module doc)."""
    if probs is None:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    ids = rank_experts(logits)[..., : spec.top_k]
    weights = probs.gather(-1, ids)
    if spec.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, scale_weights(weights, spec)


def scale_weights(weights: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    return weights if spec.routed_scaling_factor == 1.0 else weights * spec.routed_scaling_factor


@dataclass
class RoutingStats:
    """Expert ids used per layer per step, filled by the MoE blocks when `record` is on.

    steps[i] = {layer: ids [T, K]} of forward i, kept on the model's device (no host sync on the
    hot path); decode[i] says whether that forward was a decode step.
    """

    record: bool = False
    steps: list[dict[int, torch.Tensor]] = field(default_factory=list)
    decode: list[bool] = field(default_factory=list)

    def begin_step(self, is_decode: bool) -> None:
        if self.record:
            self.steps.append({})
            self.decode.append(is_decode)

    def add(self, layer: int, ids: torch.Tensor) -> None:
        if self.record and self.steps:
            self.steps[-1][layer] = ids.detach()

    def clear(self) -> None:
        self.steps.clear()
        self.decode.clear()

    def unique_per_layer(self, decode_only: bool = True) -> float:
        """Mean number of distinct experts per MoE layer per step (decode steps by default)."""
        counts = [
            int(ids.unique().numel())
            for step, dec in zip(self.steps, self.decode)
            if dec or not decode_only
            for ids in step.values()
        ]
        return sum(counts) / len(counts) if counts else 0.0


class ExactRouter:
    """The default routing function: exact routing for every token, whatever its phase.

    On a CPU with the native kernels, softmax-routed logits (no family probs) take one native call
    (kernels/native.route): the same choice, weights within a few ulp of torch's softmax (≤ 5
    observed). The native decode layer routes inside its own call with the same plan
    (native_plan), so a token's routing does not depend on which path ran it."""

    def __init__(self, spec: RouterSpec):
        self.spec = spec
        self._plan = False  # the native plan: False until first asked, None where there is none
        self._native_route = None  # kernels/native.route, once the plan exists

    def native_plan(self, layer: int, T: int):
        """kernels/native.Route for this router's rule (any layer, any T), or None (no native kernels)."""
        if self._plan is False:
            from .kernels import native  # kernels import nothing of this module: resolved once, here

            self._plan = None if native.lib() is None else native.exact_plan(
                self.spec.top_k, self.spec.norm_topk_prob, self.spec.routed_scaling_factor)
            self._native_route = native.route
        return self._plan

    native_done = None  # the native layer routed with native_plan: nothing to tell exact routing

    def __call__(self, logits, is_decode, layer, probs=None):
        return self.route_with_stats(logits, layer, probs)[:2]

    def route_with_stats(self, logits, layer: int, probs=None):
        """→ (ids, weights, the native router's stats [7] fp64 — LynxResult.vec, every token counted
        as decode — or None where torch routed)"""
        if probs is None and logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
            plan = self.native_plan(layer, logits.shape[0])
            if plan is not None and logits.shape[0] > 0 and logits.shape[1] >= self.spec.top_k:
                return self._native_route(logits.contiguous(), plan)
        return (*exact_route(logits, self.spec, probs), None)


RouteFactory = Callable[[RouterSpec], RouteFn]
