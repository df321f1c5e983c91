"""The gated delta rule (Gated DeltaNet, arXiv 2412.06464) in two equal forms, fp32 throughout.

Per value head, a state S [dk, dv] is decayed, corrected towards the new value, then read:
    S ← exp(g_t)·S;   S ← S + k_t ⊗ β_t·(v_t − Sᵀk_t);   o_t = Sᵀq_t
(q, k L2-normalised, q scaled by dk^-½). `recurrent` runs it token by token (decode: T = 1);
`chunked` runs C tokens at once (prefill): inside a chunk, with G the cumulative log decay and
A[i, j] = β_i (k_i·k_j) e^{G_i−G_j} for j < i, the corrected values are u = (I + A)⁻¹(β v) −
(I + A)⁻¹(β e^G k) S₀, the outputs e^G q S₀ + (q kᵀ ⊙ e^{G_i−G_j})_{j≤i} u, and the chunk's final
state e^{G_C} S₀ + (e^{G_C−G} k)ᵀ u — only a scan over chunks remains sequential.
Glossary: B rows, T tokens, Hk key heads, Hv value heads (each key head serves Hv/Hk of them).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def prepare(q, k, v, g, beta):
    """q, k [B, T, Hk, dk], v [B, T, Hv, dv], g, beta [B, T, Hv] → fp32 [B, Hv, T, ·] (q, k
    normalised and repeated to the value heads, q scaled)."""
    Hv = v.shape[2]
    q, k = (_l2(x.float()) for x in (q, k))
    if q.shape[2] != Hv:  # grouped: value head j reads key head j // (Hv / Hk)
        q, k = (x.repeat_interleave(Hv // x.shape[2], dim=2) for x in (q, k))
    q = q * q.shape[-1] ** -0.5
    return [x.transpose(1, 2).float() for x in (q, k, v, g, beta)]


def _l2(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)  # eps inside the root, as FLA


def recurrent(q, k, v, g, beta, state):
    """Token by token. q, k [B, H, T, dk], v [B, H, T, dv], g, beta [B, H, T], state [B, H, dk, dv]
    → (out [B, H, T, dv], final state)."""
    S, outs = state, []
    for t in range(q.shape[2]):
        S = S * g[:, :, t].exp()[..., None, None]
        kt = k[:, :, t]  # [B, H, dk]
        err = v[:, :, t] - torch.einsum("bhk,bhkv->bhv", kt, S)  # what S does not yet predict
        S = S + kt[..., :, None] * (beta[:, :, t, None] * err)[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))
    return torch.stack(outs, 2), S


def chunked(q, k, v, g, beta, state, chunk: int = 64):
    """C tokens at a time (see the module doc); same arguments and result as `recurrent`."""
    B, H, T, dk = k.shape
    dv = v.shape[-1]
    pad = (-T) % chunk  # padded tokens: k = 0, β = 0, g = 0 leave the state and earlier outputs alone
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (T + pad) // chunk
    q, k, v = (x.reshape(B, H, n, chunk, -1) for x in (q, k, v))  # [B, H, n, C, ·]
    g, beta = (x.reshape(B, H, n, chunk) for x in (g, beta))
    G = g.cumsum(-1)  # [B, H, n, C] log decay from the chunk's start
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # e^{G_i−G_j}, j ≤ i
    kb = k * beta[..., None]
    A = (kb @ k.transpose(-1, -2)) * decay  # its strictly lower part is A; the solve ignores the rest
    solve = lambda rhs: torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)  # noqa: E731
    U = solve(v * beta[..., None])  # [B, H, n, C, dv]
    W = solve(kb * G.exp()[..., None])  # [B, H, n, C, dk]
    attn = (q @ k.transpose(-1, -2)) * decay  # [B, H, n, C, C]
    qG = q * G.exp()[..., None]
    k_end = k * (G[..., -1:] - G).exp()[..., None]  # each key decayed to the chunk's end
    g_end = G[..., -1].exp()[..., None, None]  # [B, H, n, 1, 1]
    S, out = state, torch.empty(B, H, n, chunk, dv, dtype=q.dtype, device=q.device)
    for i in range(n):
        u = U[:, :, i] - W[:, :, i] @ S  # corrected values [B, H, C, dv]
        out[:, :, i] = qG[:, :, i] @ S + attn[:, :, i] @ u
        S = S * g_end[:, :, i] + k_end[:, :, i].transpose(-1, -2) @ u
    return out.reshape(B, H, n * chunk, dv)[:, :, :T], S


__all__ = ["chunked", "prepare", "recurrent"]
