"""INT4 experts on the CPU in one compiled call per MoE layer (numba), straight from the packed block.

The torch reference (fused_moe_int4's CPU path) dequantises every active expert to a dense
[2I, D] + [D, I] copy per step and runs a Python loop over experts: ~9× slower than fp32 experts.
Here one compiled call does the whole layer: expert-major slot lists, then gate/up rows in pairs
(silu(gate)·up written straight away, no [T·K, 2I] buffer), then down rows, then the weighted sum
over each token's K slots. Weights are read where they lie in the int4 layout (lynx_edge.quant.int4:
packed q [N, Kin/2], fp16 scales [Kin/G, N], uint8 zeros), dequantised one group at a time into
registers or an L1 scratch row; nothing the size of an expert is ever widened. Work runs in
(active expert, block of rows) items, each weight byte read once per step however many tokens
share the expert; one token unpacks and multiplies in one pass, several reuse each dequantised
group for four tokens at a time.

Threads: the call runs on the calling thread. numba's own pools (omp, workqueue) next to torch's
OpenMP pool on a 2-core box made both collapse (spinning pools fight for the cores: 4-30 ms per
call instead of 1.3 ms, and torch's own ops slowed too; benchmarks/results/cpu_lowbit.md).

Numerics: products are summed in fp32 with a different order than the reference's dense fp32 GEMM
(s·Σ(q−z)·x per group, vector lanes reassociated): equal within a few fp32 ulps of the output
scale (tests/test_cpu_lowbit.py states the bound). The K slots of a token are weighted and summed
in fp32 in slot order, as moe_ref does. Glossary: T tokens, D hidden, E experts, K top-k,
I expert intermediate, G group size, A active experts, S = T·K slots.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from ..kernels import native

try:  # numba is a dependency on the platforms it ships wheels for; elsewhere the torch reference runs
    import numba
    from numba import njit
except ImportError:  # pragma: no cover
    numba = njit = None

ROW_BLOCK = 16  # output rows per work item: enough items to balance threads, few enough to stay cheap

# 2^(e − 25) for an fp16 exponent field e: (m + 1024·[e > 0]) · 2^(max(e, 1) − 25) is the value of
# fp16 bits with exponent e and mantissa m, exactly (normal and subnormal; scales are never inf/NaN)
_POW2 = np.array([2.0 ** (max(e, 1) - 25) for e in range(32)], dtype=np.float32)


def _h2f(h):
    """fp16 bits (an int16 read as such) → its fp32 value, exactly."""
    b = np.int32(h) & 0xFFFF
    e = (b >> 10) & 0x1F
    m = (b & 0x3FF) + (1024 if e > 0 else 0)
    v = np.float32(m) * _POW2[e]
    return -v if b & 0x8000 else v


def _dot_rows(data, e, qo, so, zo, N, Kin, sym, row, xe, xo, slot0, n, G, acc, we, wo):
    """acc[:n] = Σ_g s_g · Σ_j (q − z_g) · x over one packed row of expert e's block data[e]
    (uint8 [E, nbytes]): codes [N, Kin/2] at byte qo, fp16 scales [Kin/G, N] at so, uint8 zeros
    [Kin/G, N] at zo (sym: 8). xe/xo [S, Kin/2] are the even/odd input columns (the low/high
    nibbles of a byte) of sorted slots slot0 .. slot0 + n. Inner loops index 1-D row slices with
    int32 arithmetic so LLVM vectorises them (2-D indexing and int64 lanes did not)."""
    H = G // 2
    m15, s4 = np.int32(15), np.int32(4)
    qr = data[e, qo + row * (Kin // 2) : qo + (row + 1) * (Kin // 2)]
    for t in range(n):
        acc[t] = 0.0
    for g in range(Kin // G):
        sb = so + 2 * (g * N + row)
        s = _h2f(np.int32(data[e, sb]) | (np.int32(data[e, sb + 1]) << 8))
        zz = np.int32(8) if sym else np.int32(data[e, zo + g * N + row])
        base = g * H
        if n == 1:  # one token: unpack and multiply in one pass
            x0e, x0o = xe[slot0], xo[slot0]
            pe = np.float32(0.0)
            po = np.float32(0.0)
            for j in range(H):
                b = np.int32(qr[base + j])
                pe += np.float32((b & m15) - zz) * x0e[base + j]
                po += np.float32((b >> s4) - zz) * x0o[base + j]
            acc[0] += s * (pe + po)
            continue
        for j in range(H):  # several tokens: the group dequantised once into L1 ...
            b = np.int32(qr[base + j])
            we[j] = np.float32((b & m15) - zz)
            wo[j] = np.float32((b >> s4) - zz)
        t = 0
        while t + 4 <= n:  # ... then four tokens per pass over it (one load of w per 4 FMAs)
            r = slot0 + t
            x0e, x1e, x2e, x3e = xe[r, base:base + H], xe[r + 1, base:base + H], xe[r + 2, base:base + H], xe[r + 3, base:base + H]
            x0o, x1o, x2o, x3o = xo[r, base:base + H], xo[r + 1, base:base + H], xo[r + 2, base:base + H], xo[r + 3, base:base + H]
            p0 = np.float32(0.0)
            p1 = np.float32(0.0)
            p2 = np.float32(0.0)
            p3 = np.float32(0.0)
            for j in range(H):
                a, c = we[j], wo[j]
                p0 += a * x0e[j] + c * x0o[j]
                p1 += a * x1e[j] + c * x1o[j]
                p2 += a * x2e[j] + c * x2o[j]
                p3 += a * x3e[j] + c * x3o[j]
            acc[t] += s * p0
            acc[t + 1] += s * p1
            acc[t + 2] += s * p2
            acc[t + 3] += s * p3
            t += 4
        while t < n:
            x0e, x0o = xe[slot0 + t, base:base + H], xo[slot0 + t, base:base + H]
            p0 = np.float32(0.0)
            for j in range(H):
                p0 += we[j] * x0e[j] + wo[j] * x0o[j]
            acc[t] += s * p0
            t += 1


def _plan(ids, E):
    """ids [T, K] → (cnt [E + 1] expert-major row starts, order [S] sorted position → slot
    (stable: slot order within an expert), act [A] active experts ascending)."""
    T, K = ids.shape
    S = T * K
    cnt = np.zeros(E + 1, np.int64)
    for i in range(S):
        cnt[ids[i // K, i % K] + 1] += 1
    for e in range(E):
        cnt[e + 1] += cnt[e]
    fill = cnt[:E].copy()
    order = np.empty(S, np.int64)
    for i in range(S):
        e = ids[i // K, i % K]
        order[fill[e]] = i
        fill[e] += 1
    A = 0
    for e in range(E):
        A += cnt[e + 1] > cnt[e]
    act = np.empty(A, np.int64)
    A = 0
    for e in range(E):
        if cnt[e + 1] > cnt[e]:
            act[A] = e
            A += 1
    return cnt, order, act


def _gather(x, ids, order, perm):
    """Each sorted slot's input row, columns split even/odd → xe, xo [S, D/2] fp32; through the
    expert's act-order permutation when perm [E, D] is given (perm [0, 0]: none)."""
    K = ids.shape[1]
    S, D = order.shape[0], x.shape[1]
    xe = np.empty((S, D // 2), np.float32)
    xo = np.empty((S, D // 2), np.float32)
    for r in range(S):
        t = order[r] // K
        if perm.shape[0] > 0:
            p = perm[ids[t, order[r] % K]]
            for j in range(D // 2):
                xe[r, j] = x[t, p[2 * j]]
                xo[r, j] = x[t, p[2 * j + 1]]
        else:
            for j in range(D // 2):
                xe[r, j] = x[t, 2 * j]
                xo[r, j] = x[t, 2 * j + 1]
    return xe, xo


def _item(item, rows, act, cnt):
    """Work item → (expert, its first sorted slot, its slot count, first row of the item's block
    of ROW_BLOCK among `rows`)."""
    e = act[item // ((rows + ROW_BLOCK - 1) // ROW_BLOCK)]
    return e, cnt[e], cnt[e + 1] - cnt[e], (item % ((rows + ROW_BLOCK - 1) // ROW_BLOCK)) * ROW_BLOCK


def _gate_up(data, offs, sym, G, D, I, act, cnt, xe, xo, he, ho, lo, hi):
    """Work items [lo, hi) of (active expert, block of ROW_BLOCK rows i): he/ho [S, I/2] (even /
    odd i) ← silu(gate_i)·up_i of every slot of the expert; gate and up rows i, I + i together."""
    gate = np.empty(xe.shape[0], np.float32)
    up = np.empty(xe.shape[0], np.float32)
    we = np.empty(G // 2, np.float32)
    wo = np.empty(G // 2, np.float32)
    for item in range(lo, hi):
        e, r0, n, i0 = _item(item, I, act, cnt)
        for i in range(i0, min(I, i0 + ROW_BLOCK)):
            _dot_rows(data, e, offs[0], offs[1], offs[2], 2 * I, D, sym, i, xe, xo, r0, n, G, gate, we, wo)
            _dot_rows(data, e, offs[0], offs[1], offs[2], 2 * I, D, sym, I + i, xe, xo, r0, n, G, up, we, wo)
            for t in range(n):
                v = gate[t] / (np.float32(1.0) + np.exp(-gate[t])) * up[t]
                if i % 2 == 0:
                    he[r0 + t, i // 2] = v
                else:
                    ho[r0 + t, i // 2] = v


def _down(data, offs, sym, G, D, I, act, cnt, he, ho, order, w, y, lo, hi):
    """Work items [lo, hi) of (active expert, block of ROW_BLOCK output rows d): y[r, d] = routing
    weight of sorted slot r · (down · h_r)[d], fp32."""
    K = w.shape[1]
    acc = np.empty(he.shape[0], np.float32)
    we = np.empty(G // 2, np.float32)
    wo = np.empty(G // 2, np.float32)
    for item in range(lo, hi):
        e, r0, n, d0 = _item(item, D, act, cnt)
        for d in range(d0, min(D, d0 + ROW_BLOCK)):
            _dot_rows(data, e, offs[3], offs[4], offs[5], D, I, sym, d, he, ho, r0, n, G, acc, we, wo)
            for t in range(n):
                s = order[r0 + t]
                y[r0 + t, d] = acc[t] * w[s // K, s % K]


def _combine(y, order, T, K):
    """y [S, D] fp32 by sorted position → out [T, D]: Σ_k in slot order (k = 0 first), as moe_ref."""
    S, D = y.shape
    pos = np.empty(S, np.int64)
    for r in range(S):
        pos[order[r]] = r
    out = np.empty((T, D), np.float32)
    for t in range(T):
        out[t] = y[pos[t * K]]
        for k in range(1, K):
            out[t] += y[pos[t * K + k]]
    return out


def _moe(x, ids, w, perm, data, offs, sym, G, D, I):
    """The whole layer in one call: x [T, D] fp32, ids [T, K] int64, w [T, K] fp32, perm [E, D]
    int32 or [0, 0], data [E, nbytes] uint8, offs int64 [6] byte offsets of gu_q, gu_s, gu_z,
    dn_q, dn_s, dn_z → out [T, D] fp32."""
    T, K = ids.shape
    cnt, order, act = _plan(ids, data.shape[0])
    xe, xo = _gather(x, ids, order, perm)
    S = T * K
    he = np.empty((S, I // 2), np.float32)
    ho = np.empty((S, I // 2), np.float32)
    _gate_up(data, offs, sym, G, D, I, act, cnt, xe, xo, he, ho, 0, act.shape[0] * ((I + ROW_BLOCK - 1) // ROW_BLOCK))
    y = np.empty((S, D), np.float32)
    _down(data, offs, sym, G, D, I, act, cnt, he, ho, order, w, y, 0, act.shape[0] * ((D + ROW_BLOCK - 1) // ROW_BLOCK))
    return _combine(y, order, T, K)


if njit is not None:
    _FM = {"reassoc", "contract"}  # lets LLVM vectorise the fp32 reductions (lane order: see top)
    _h2f = njit(cache=True, nogil=True, inline="always")(_h2f)
    _dot_rows = njit(cache=True, nogil=True, fastmath=_FM, inline="always")(_dot_rows)
    _item = njit(cache=True, nogil=True, inline="always")(_item)
    _plan = njit(cache=True, nogil=True)(_plan)
    _gather = njit(cache=True, nogil=True)(_gather)
    _gate_up = njit(cache=True, nogil=True, fastmath=_FM)(_gate_up)
    _down = njit(cache=True, nogil=True, fastmath=_FM)(_down)
    _combine = njit(cache=True, nogil=True)(_combine)
    _moe_nb = njit(cache=True, nogil=True)(_moe)
else:  # pragma: no cover
    _moe_nb = None


def available() -> bool:
    """Whether a compiled kernel exists (the native one built here, or numba installed)."""
    return native.lib() is not None or _moe_nb is not None


_NO_PERM = np.zeros((0, 0), np.int32)


def moe_int4_blocks(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, data: torch.Tensor, layout,
                    x_perm: torch.Tensor | None = None, kernel: str | None = None, act: str | None = None
                    ) -> torch.Tensor:
    """Σ_k weights[t, k] · expert_{ids[t, k]}(x[t]) over INT4 expert blocks data uint8 [E, nbytes]
    (CPU, rows in lynx_edge.quant.int4's Int4Layout `layout`) → [T, D] in x's dtype, computed in
    fp32 whatever x's dtype. x_perm [E, D] int32: expert e's gate/up read x[:, x_perm[e]]
    (act-order GPTQ). kernel: "native" (kernels/cpu_native.c, on torch's thread count), "numba" (the
    calling thread), None: native when it built, else numba. act: the native kernel's activations,
    "f32", "q16" or "q8" (None: kernels.native.default_int4_act(); numba is always f32)."""
    use_native = kernel in (None, "native") and native.lib() is not None
    if kernel == "native" and not use_native:
        raise RuntimeError("the native CPU kernels are not available (no C compiler, or LYNX_EDGE_NATIVE=0)")
    if use_native:
        return native.moe_int4(x, ids, weights, data, layout.part_offsets, layout.sym, layout.group_size,
                               layout.hidden, layout.inter, x_perm, act).to(x.dtype)
    x32 = x.detach().to(torch.float32).contiguous()
    ids64 = ids.to(torch.int64).contiguous()
    w32 = weights.detach().to(torch.float32).contiguous()
    perm = _NO_PERM if x_perm is None else x_perm.to(torch.int32).contiguous().numpy()
    out = _moe_nb(x32.numpy(), ids64.numpy(), w32.numpy(), perm, data.numpy(), layout.part_offsets,
                  layout.sym, layout.group_size, layout.hidden, layout.inter)
    return torch.from_numpy(out).to(x.dtype)


def moe_int4_cpu(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, packed,
                 x_perm: torch.Tensor | None = None, act: str | None = None) -> torch.Tensor:
    """moe_int4_blocks over an Int4Experts (x [T, D], ids/weights [T, K]) → [T, D]."""
    return moe_int4_blocks(x, ids, weights, packed.data, packed.layout, x_perm, act=act)


def experts_rows(x: torch.Tensor, experts: list[int], counts: list[int], data: torch.Tensor, layout,
                 act: str | None = None) -> torch.Tensor:
    """Fiddler-style: rows of x [Σn, D] go through one expert each (the first counts[0] rows through
    experts[0], …) → y [Σn, D] in x's dtype; one compiled call for all of them. act: as
    moe_int4_blocks'."""
    ids = torch.repeat_interleave(torch.tensor(experts, dtype=torch.int64), torch.tensor(counts))[:, None]
    return moe_int4_blocks(x, ids, torch.ones(ids.shape), data, layout, act=act)


__all__ = ["available", "experts_rows", "moe_int4_blocks", "moe_int4_cpu"]
