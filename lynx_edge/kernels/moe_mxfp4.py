"""gpt-oss experts: biased projections, the clamped SwiGLU, 16-bit or MXFP4 weights.

Torch reference (the CPU path) and a Triton kernel pair beside the INT4 one of moe_gemm.py.
An expert here is gate_up [2I, D] (rows [:I] gate, [I:] up) + bias [2I], down [D, I] + bias [D];
h = act(x·gate_upᵀ + b) with act(gate, up) = (clamp(up, ±limit) + 1) · g·σ(alpha·g),
g = min(gate, limit) — gpt-oss's SwiGLU as transformers computes it.
MXFP4 (OCP microscaling, as gpt-oss publishes it): a row of `in` values is in/32 blocks of 16
bytes, two e2m1 codes per byte (low nibble = even element), and one e8m0 scale byte per block
(value = code · 2^(scale − 127)). Glossary: T tokens, D hidden, E experts, K top-k, I expert
intermediate, A active experts.
"""
from __future__ import annotations

from typing import Callable

import torch

from .moe_gemm import _cdiv, _interpreting, _pow2, expert_table, triton, use_triton

if triton is not None:  # without the triton extra only the torch reference (the CPU path) exists
    import triton.language as tl

    from .moe_gemm import _finalize_kernel

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per e8m0 scale


def mxfp4_dequant(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] → [..., G·32] in dtype (exact: every
    e2m1 value times a power of two is representable unless it under/overflows the dtype)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    b = blocks.to(torch.int64)
    v = torch.stack((lut[b & 0xF], lut[b >> 4]), dim=-1).flatten(-2)  # [..., G, 32]
    v = torch.ldexp(v, scales.to(torch.int32)[..., None] - 127)
    return v.flatten(-2).to(dtype)


def oss_act(h: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """h [n, 2I] (gate columns then up columns) → [n, I]."""
    gate, up = h.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


Fetch = Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


def oss_moe_ref(
    x: torch.Tensor,  # [T, D]
    ids: torch.Tensor,  # [T, K] int64
    weights: torch.Tensor,  # [T, K] fp32
    num_experts: int,
    fetch: Fetch,  # e → (gate_up [2I, D], gate_up_bias [2I], down [D, I], down_bias [D]) in x's dtype
    limit: float,
    alpha: float,
) -> torch.Tensor:
    """Σ_k weights[t,k]·expert_{ids[t,k]}(x[t]) → [T, D]: each active expert fetched once (views
    for 16-bit, one expert dequantised at a time for MXFP4), in ascending id (one host read),
    then the fp32 sum over k in slot order, like moe_gemm.moe_ref_lazy."""
    T, K = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # slots grouped by expert
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    xs = x[order // K]  # [T·K, D]
    y = torch.empty(T * K, x.shape[-1], dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        gu, gu_b, dn, dn_b = fetch(e)
        h = oss_act(torch.nn.functional.linear(xs[start : start + n], gu, gu_b), limit, alpha)
        y[start : start + n] = torch.nn.functional.linear(h, dn, dn_b)
        start += n
    y = y.float() * weights.reshape(-1)[order, None].float()
    slots = torch.empty_like(y).index_copy_(0, order, y).view(T, K, -1)  # back to slot order
    out = slots[:, 0]
    for k in range(1, K):
        out = out + slots[:, k]
    return out.to(x.dtype)


# ----------------------------------------------------------------------------- Triton path

if triton is not None:

    @triton.jit
    def _e2m1(v):
        """e2m1 code (int, 0..15) → fp32: sign bit 3, exponent bits 2..1, mantissa bit 0."""
        e = (v >> 1) & 3
        m = (v & 1).to(tl.float32)
        mag = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * tl.exp2((e - 1).to(tl.float32)))
        return tl.where(v >= 8, -mag, mag)

    @triton.jit
    def _wx(acc, x_ptr, x_rows, x_mask, stride_x, w_base, s_base, offs_n, n_mask, stride_wn, stride_sn,
            KIN: tl.constexpr, MX: tl.constexpr, USE_DOT: tl.constexpr, PREC: tl.constexpr):
        """acc [BN, BM] += W[offs_n, :KIN] @ X[x_rows, :KIN]ᵀ, 32 input columns per step (one
        MXFP4 scale per row and step). MX: rows are KIN/2 bytes + KIN/32 scales; else dense."""
        xcol = x_ptr + x_rows[None, :] * stride_x  # [1, BM]
        for k0 in range(0, KIN, 32):
            if MX:
                offs_b = k0 // 2 + tl.arange(0, 16)  # byte columns  [16]
                b = tl.load(w_base + offs_n[:, None] * stride_wn + offs_b[None, :], mask=n_mask[:, None], other=0)
                b = b.to(tl.int32)
                s = tl.load(s_base + offs_n * stride_sn + k0 // 32, mask=n_mask, other=127).to(tl.float32)
                scale = tl.exp2(s - 127.0)[:, None]
                lo = _e2m1(b & 0xF) * scale  # even columns  [BN, 16]
                hi = _e2m1(b >> 4) * scale  # odd columns
                xe = tl.load(xcol + 2 * offs_b[:, None], mask=x_mask[None, :], other=0.0)  # [16, BM]
                xo = tl.load(xcol + 2 * offs_b[:, None] + 1, mask=x_mask[None, :], other=0.0)
                if USE_DOT:
                    acc = tl.dot(lo.to(xe.dtype), xe, acc, input_precision=PREC)
                    acc = tl.dot(hi.to(xo.dtype), xo, acc, input_precision=PREC)
                else:
                    acc += tl.sum(lo[:, :, None] * xe.to(tl.float32)[None, :, :], axis=1)
                    acc += tl.sum(hi[:, :, None] * xo.to(tl.float32)[None, :, :], axis=1)
            else:
                offs_k = k0 + tl.arange(0, 32)
                w = tl.load(w_base + offs_n[:, None] * stride_wn + offs_k[None, :], mask=n_mask[:, None], other=0.0)
                xt = tl.load(xcol + offs_k[:, None], mask=x_mask[None, :], other=0.0)  # [32, BM]
                if USE_DOT:
                    acc = tl.dot(w.to(xt.dtype), xt, acc, input_precision=PREC)
                else:
                    acc += tl.sum(w.to(tl.float32)[:, :, None] * xt.to(tl.float32)[None, :, :], axis=1)
        return acc

    @triton.jit
    def _oss_gate_up_kernel(
        x_ptr, h_ptr, w_ptr, s_ptr, b_ptr, tok_ptr, act_e_ptr, act_start_ptr, num_act_ptr,
        stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_be, limit, alpha,
        D: tl.constexpr, I: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        MX: tl.constexpr, USE_DOT: tl.constexpr, PREC: tl.constexpr,
    ):
        """h[row, n] = act(x[tok]·gateₙ + bg, x[tok]·upₙ + bu) for one (active expert, I-tile)."""
        pid_a = tl.program_id(0)
        if pid_a >= tl.load(num_act_ptr):
            return
        e = tl.load(act_e_ptr + pid_a).to(tl.int64)
        start = tl.load(act_start_ptr + pid_a)
        end = tl.load(act_start_ptr + pid_a + 1)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < I
        w_base = w_ptr + e * stride_we
        s_base = s_ptr + e * stride_se
        bg = tl.load(b_ptr + e * stride_be + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        bu = tl.load(b_ptr + e * stride_be + I + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        m0 = start
        while m0 < end:
            rows = m0 + tl.arange(0, BLOCK_M)
            r_mask = rows < end
            tok = tl.load(tok_ptr + rows, mask=r_mask, other=0)
            g = _wx(tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), x_ptr, tok, r_mask, stride_x, w_base, s_base,
                    offs_n, n_mask, stride_wn, stride_sn, D, MX, USE_DOT, PREC)
            u = _wx(tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), x_ptr, tok, r_mask, stride_x,
                    w_base + I * stride_wn, s_base + I * stride_sn, offs_n, n_mask, stride_wn, stride_sn,
                    D, MX, USE_DOT, PREC)
            g = tl.minimum(g + bg[:, None], limit)
            u = tl.minimum(tl.maximum(u + bu[:, None], -limit), limit)
            h = (u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))
            tl.store(h_ptr + rows[None, :] * I + offs_n[:, None], h.to(h_ptr.dtype.element_ty),
                     mask=n_mask[:, None] & r_mask[None, :])
            m0 += BLOCK_M

    @triton.jit
    def _oss_down_kernel(
        h_ptr, out_ptr, w_ptr, s_ptr, b_ptr, slot_ptr, rw_ptr, act_e_ptr, act_start_ptr, num_act_ptr,
        stride_we, stride_wn, stride_se, stride_sn, stride_be,
        D: tl.constexpr, I: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        MX: tl.constexpr, USE_DOT: tl.constexpr, PREC: tl.constexpr,
    ):
        """out[slot, n] = rw[slot]·(h[row]·downₙ + bₙ) for one (active expert, D-tile)."""
        pid_a = tl.program_id(0)
        if pid_a >= tl.load(num_act_ptr):
            return
        e = tl.load(act_e_ptr + pid_a).to(tl.int64)
        start = tl.load(act_start_ptr + pid_a)
        end = tl.load(act_start_ptr + pid_a + 1)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < D
        bias = tl.load(b_ptr + e * stride_be + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        m0 = start
        while m0 < end:
            rows = m0 + tl.arange(0, BLOCK_M)
            r_mask = rows < end
            acc = _wx(tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), h_ptr, rows, r_mask, I,
                      w_ptr + e * stride_we, s_ptr + e * stride_se, offs_n, n_mask, stride_wn, stride_sn,
                      I, MX, USE_DOT, PREC)
            slot = tl.load(slot_ptr + rows, mask=r_mask, other=0)
            rw = tl.load(rw_ptr + slot, mask=r_mask, other=0.0)
            tl.store(out_ptr + slot[None, :] * D + offs_n[:, None], (acc + bias[:, None]) * rw[None, :],
                     mask=n_mask[:, None] & r_mask[None, :])
            m0 += BLOCK_M


def fused_moe_oss(
    x: torch.Tensor,  # [T, D] fp16/bf16/fp32
    ids: torch.Tensor,  # [T, K] int64
    weights: torch.Tensor,  # [T, K] fp32
    gate_up: torch.Tensor,  # [E, 2I, D] x's dtype, or MXFP4 bytes [E, 2I, D/2] (with gu_scales)
    gate_up_bias: torch.Tensor,  # [E, 2I]
    down: torch.Tensor,  # [E, D, I] or MXFP4 bytes [E, D, I/2]
    down_bias: torch.Tensor,  # [E, D]
    limit: float,
    alpha: float,
    *,
    gu_scales: torch.Tensor | None = None,  # [E, 2I, D/32] uint8 e8m0: MXFP4 weights
    dn_scales: torch.Tensor | None = None,  # [E, D, I/32]
    table: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The Triton pair (gate-up + act, down + bias × routing weight) and moe_gemm's fixed-order
    sum over k. Needs use_triton(x) and D, I multiples of 32; callers fall back to oss_moe_ref."""
    T, K = ids.shape
    E, two_i = gate_up.shape[:2]
    I, D = two_i // 2, down.shape[1]
    mx = gu_scales is not None
    tab = table if table is not None else expert_table(ids, E)
    A = tab["act_e"].numel()
    use_dot = T > 4 and not (_interpreting() and x.dtype == torch.bfloat16)
    bm = max(16, min(64, _pow2(T))) if use_dot else min(16, _pow2(T))
    bn = 32 if use_dot else 16
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    x = x.contiguous()
    h = torch.empty(T * K, I, dtype=x.dtype, device=x.device)  # expert-major rows
    part = torch.empty(1, T * K, D, dtype=torch.float32, device=x.device)
    y = torch.empty(T, D, dtype=x.dtype, device=x.device)
    rw = weights.reshape(-1).float().contiguous()
    gs = gu_scales if mx else gate_up  # dummy pointers when dense
    ds = dn_scales if mx else down
    meta = dict(D=D, I=I, BLOCK_M=bm, BLOCK_N=bn, MX=mx, USE_DOT=use_dot, PREC=prec)
    tabs = (tab["act_e"], tab["act_start"], tab["num_act"])
    _oss_gate_up_kernel[(A, _cdiv(I, bn))](
        x, h, gate_up, gs, gate_up_bias, tab["tok"], *tabs, x.stride(0), gate_up.stride(0), gate_up.stride(1),
        gs.stride(0), gs.stride(1), gate_up_bias.stride(0), float(limit), float(alpha), **meta)
    _oss_down_kernel[(A, _cdiv(D, bn))](
        h, part, down, ds, down_bias, tab["slot"], rw, *tabs, down.stride(0), down.stride(1),
        ds.stride(0), ds.stride(1), down_bias.stride(0), **meta)
    _finalize_kernel[(T, _cdiv(D, 1024))](part, y, T * K, D=D, K=K, SPLIT=1, BLOCK_D=1024)
    return y


def triton_ok(x: torch.Tensor, D: int, I: int) -> bool:
    return use_triton(x) and D % 32 == 0 and I % 32 == 0


__all__ = ["BLOCK", "FP4_VALUES", "fused_moe_oss", "mxfp4_dequant", "oss_act", "oss_moe_ref", "triton_ok"]


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., n] (n a multiple of 32) → (blocks uint8 [..., n/32, 16], scales uint8 [..., n/32]):
    round-to-nearest MXFP4, the scale 2^⌈log2(amax/6)⌉ per 32 values (so no code saturates), each
    value to its nearest e2m1 code (ties to the lower magnitude). mxfp4_dequant inverts it."""
    *lead, n = w.shape
    v = w.float().reshape(*lead, n // BLOCK, BLOCK)
    amax = v.abs().amax(-1)  # [..., G]
    exp = torch.ceil(torch.log2(amax.clamp_min(2.0 ** -126) / 6.0)).clamp(-127, 127)
    q = v / torch.exp2(exp)[..., None]  # within ±6
    mids = torch.tensor((0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0), device=w.device)  # between magnitudes
    code = torch.bucketize(q.abs().contiguous(), mids)  # [..., G, 32] nearest magnitude 0..7 (ties: the lower)
    code = code | ((q < 0) & (code > 0)).to(code.dtype) << 3
    blocks = (code[..., 0::2] | code[..., 1::2] << 4).to(torch.uint8)
    return blocks, (exp + 127).to(torch.uint8)


__all__ += ["mxfp4_quantize"]
