"""Grouped expert GEMM for MoE decode: torch reference (the CPU path).

Experts are stacked as gate_up [E, 2I, D] (rows [:I] gate, [I:] up, as transformers fuses them)
and down [E, D, I]. Each active expert's weights are read once per call however many tokens
share it. Glossary: T tokens, D hidden, E experts, K top-k, I expert intermediate.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def expert_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert. x [n, D], gate_up [2I, D], down [D, I] → [n, D]."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def moe_ref(
    x: torch.Tensor,  # [T, D]
    ids: torch.Tensor,  # [T, K] int64
    weights: torch.Tensor,  # [T, K] fp32
    gate_up: torch.Tensor,  # [E, 2I, D]
    down: torch.Tensor,  # [E, D, I]
) -> torch.Tensor:
    """Σ_k weights[t,k] · expert_{ids[t,k]}(x[t]) → [T, D] in x's dtype.

    Loops over the experts that are actually used (one host sync for the list); the per-expert
    products are summed in fp32 in a fixed order (expert id ascending) so results are
    deterministic.
    """
    T, K = ids.shape
    out = torch.zeros(T, x.shape[-1], dtype=torch.float32, device=x.device)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # token-slots grouped by expert
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    tok = order // K
    w = weights.reshape(-1)[order]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        t_e = tok[start : start + n]
        y = expert_mlp(x[t_e], gate_up[e], down[e])
        out.index_add_(0, t_e, y.float() * w[start : start + n, None])
        start += n
    return out.to(x.dtype)
