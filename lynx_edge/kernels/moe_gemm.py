"""Grouped expert GEMM for MoE decode: torch reference (the CPU path) and Triton kernels.

Experts are stacked as gate_up [E, 2I, D] (rows [:I] gate, [I:] up, as transformers fuses them)
and down [E, D, I]. Each active expert's weights are read once per call however many tokens
share it. Glossary: T tokens, D hidden, E experts, K top-k, I expert intermediate, A active
experts, G INT4 group size.

Triton path (fused_moe / fused_moe_int4): torch ops on device sort the T·K (token, expert) slots
expert-major (no host sync); kernel 1 computes silu(gate)·up per active expert and I-tile,
kernel 2 the down projection times the routing weight into a per-slot buffer [S, T·K, D]
(S = split-K), kernel 3 sums each token's S·K rows in a fixed order (deterministic, no atomics).
Grids are sized for A = min(T·K, E); programs past the active count exit at once. INT4 weights
(lynx_edge.quant.int4 layout) are dequantised in registers; `x_perm` reads x through a per-expert
column permutation (act-order GPTQ). The routing kernel may pass its own expert-major table
(`table=`, format of expert_table); `expert_slots` maps expert ids to rows of an offload slot
buffer. Loop bounds are constexprs (D, I, K, split sizes: fixed per model and block config) or a
`while` over an expert's rows, never arguments or loaded values (Triton 3.6's interpreter). Block sizes come from shapes only (_config); plan_launches exposes the
exact launches so tests compile them for sm_80/89/90 without a GPU. Set LYNX_TRITON_INTERPRET=1
(or TRITON_INTERPRET=1) before importing this module to run the kernels on CPU tensors.
"""
from __future__ import annotations

import os
from typing import Callable

import torch
import torch.nn.functional as F

if os.environ.get("LYNX_TRITON_INTERPRET") == "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede @triton.jit below
try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference is the only path
    triton = None


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
    """Σ_k weights[t,k] · expert_{ids[t,k]}(x[t]) → [T, D] in x's dtype: the CPU path.

    No Python per expert: the T·K slots are sorted expert-major, their rows gathered, and each
    projection is one grouped GEMM over the stacked weights of the expert range in use (torch's
    `_grouped_mm`: the weights are read in place, never gathered or copied; unused experts
    inside the range cost an empty group). Two host reads (the range bounds; CPU tensors, so
    no device sync). The same ~20 ops whatever the number of active experts. Each slot's
    product is weighted in fp32 and the K slots of a token summed in slot order (k = 0..K-1), a
    fixed order, so results are deterministic. Falls back to moe_ref_loop where torch has no CPU
    grouped GEMM or the strides are not 16-byte multiples (its requirement)."""
    if not _grouped_ok(x, gate_up, down):
        return moe_ref_loop(x, ids, weights, gate_up, down)
    T, K = ids.shape
    flat = ids.reshape(-1)  # [T·K]
    sorted_e, order = torch.sort(flat, stable=True)  # slots grouped by expert, slot order within one
    # only the expert range in use becomes groups (a view: lo..hi of the stacked weights); on a
    # CPU reading the two bounds is a host read, not a device sync. Saves the fixed cost of
    # empty groups at small batches.
    lo, hi = int(sorted_e[0]), int(sorted_e[-1])
    ends = torch.cumsum(torch.bincount(sorted_e - lo, minlength=hi - lo + 1), 0).to(torch.int32)  # [hi-lo+1]
    xs = x[order // K]  # [T·K, D] the token row of each sorted slot
    h = torch._grouped_mm(xs, gate_up[lo : hi + 1].transpose(1, 2), offs=ends)  # [T·K, 2I]
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, down[lo : hi + 1].transpose(1, 2), offs=ends)  # [T·K, D]
    y = y.float() * weights.reshape(-1)[order, None].float()
    return _sum_slots(y, order, T, K).to(x.dtype)


def _sum_slots(y: torch.Tensor, order: torch.Tensor, T: int, K: int) -> torch.Tensor:
    """y [T·K, D] fp32 in expert-major order → [T, D]: back to slot order, then Σ over k in order."""
    slots = torch.empty_like(y).index_copy_(0, order, y).view(T, K, -1)  # [T, K, D]
    out = slots[:, 0]
    for k in range(1, K):  # K is the model's top-k (a constant), not the number of active experts
        out = out + slots[:, k]
    return out


_GROUPED: bool | None = None  # whether this torch runs _grouped_mm on CPU tensors (probed once)


def _grouped_ok(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    global _GROUPED
    if _GROUPED is None:
        try:
            a, b = torch.ones(2, 4), torch.ones(1, 4, 4)
            _GROUPED = bool(torch._grouped_mm(a, b, offs=torch.tensor([2], dtype=torch.int32)).sum() == 32)
        except (AttributeError, RuntimeError, NotImplementedError):
            _GROUPED = False
    if not _GROUPED or x.device.type != "cpu" or not (x.dtype == gate_up.dtype == down.dtype):
        return False
    es = x.element_size()
    two_i, D = gate_up.shape[1:]
    # _grouped_mm wants 16-byte multiples for every non-unit stride and 16-byte aligned bases
    strides = (D, two_i // 2, *gate_up.stride(), *down.stride())
    return (all(v * es % 16 == 0 for v in strides if v != 1) and gate_up.data_ptr() % 16 == 0
            and down.data_ptr() % 16 == 0 and gate_up.stride(-1) == 1 and down.stride(-1) == 1)


def moe_ref_loop(
    x: torch.Tensor,  # [T, D]
    ids: torch.Tensor,  # [T, K] int64
    weights: torch.Tensor,  # [T, K] fp32
    gate_up: torch.Tensor,  # [E, 2I, D]
    down: torch.Tensor,  # [E, D, I]
) -> torch.Tensor:
    """The plain reference: a Python loop over the experts in use (one host sync for the list),
    per-expert products summed in fp32 in ascending expert id. moe_ref must agree with it."""
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
        # index_put_(accumulate) rather than index_add_: same sum, no parallel region per expert
        out.index_put_((t_e,), y.float() * w[start : start + n, None], accumulate=True)
        start += n
    return out.to(x.dtype)


def moe_ref_lazy(
    x: torch.Tensor,  # [T, D]
    ids: torch.Tensor,  # [T, K] int64
    weights: torch.Tensor,  # [T, K] fp32
    num_experts: int,
    fetch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],  # e → (gate_up [2I, D], down [D, I])
) -> torch.Tensor:
    """moe_ref with expert weights made on demand (e.g. dequantised): only experts in ids are
    fetched, once each, in ascending id order (one host sync for the list). Each expert's rows
    land in an expert-major [T·K, D] buffer, then the same fp32 slot-order sum as moe_ref, so the
    two agree bit for bit on the same weights."""
    T, K = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # token-slots grouped by expert
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    xs = x[order // K]  # [T·K, D]
    y = torch.empty(T * K, x.shape[-1], dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        gate_up, down = fetch(e)
        y[start : start + n] = expert_mlp(xs[start : start + n], gate_up, down)
        start += n
    y = y.float() * weights.reshape(-1)[order, None].float()
    return _sum_slots(y, order, T, K).to(x.dtype)


# ----------------------------------------------------------------------------- Triton path


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_usable(device: torch.device) -> bool:
    """Whether Triton kernels run on `device`: CUDA, or any device under the interpreter."""
    return triton is not None and (device.type == "cuda" or _interpreting())


def use_triton(x: torch.Tensor) -> bool:
    """Triton on CUDA tensors, or on CPU tensors under the interpreter; torch otherwise."""
    return triton_usable(x.device)


def expert_table(ids: torch.Tensor, num_experts: int) -> dict[str, torch.Tensor]:
    """Expert-major token table from ids [T, K], built with device ops only (no host sync).

    rows: the T·K slots sorted by expert (stable). tok [T·K] token of each row, slot [T·K] its
    flat index t·K + k; act_e [A] expert of each active slot (A = min(T·K, E), valid below
    num_act [1]); act_start [A + 1] row ranges, act_start[i] = T·K for i ≥ num_act.
    """
    TK, K = ids.numel(), ids.shape[1]
    A = min(TK, num_experts)
    sorted_e, order = torch.sort(ids.reshape(-1), stable=True)
    first = torch.ones(1, dtype=torch.bool, device=ids.device)
    is_start = torch.cat([first, sorted_e[1:] != sorted_e[:-1]])  # [T·K] a new expert's first row
    rank = torch.cumsum(is_start, 0) - 1  # active index of each row's expert
    row = torch.arange(TK, device=ids.device)
    # scatter every run's first row to its rank; other rows to distinct scratch slots (≥ A + 1)
    dst = torch.where(is_start, rank, A + 1 + row)
    i32 = torch.int32
    act_e = torch.zeros(A + 1 + TK, dtype=i32, device=ids.device).scatter_(0, dst, sorted_e.to(i32))
    act_start = torch.full((A + 1 + TK,), TK, dtype=i32, device=ids.device).scatter_(0, dst, row.to(i32))
    return {
        "tok": (order // K).to(i32), "slot": order.to(i32), "act_e": act_e[:A],
        "act_start": act_start[: A + 1], "num_act": (rank[-1:] + 1).to(i32),
    }


if triton is not None:

    @triton.jit
    def _x_cols(xcol, perm_base, cols, x_mask, PERM: tl.constexpr):
        """X[rows, cols] as [len(cols), BM]; with PERM the columns go through perm (act-order)."""
        if PERM:
            cols = tl.load(perm_base + cols)  # gate-up only: cols < D always
        return tl.load(xcol + cols[:, None], mask=x_mask[None, :], other=0.0)

    @triton.jit
    def _tile_matmul(
        acc, x_ptr, x_rows, x_mask, stride_x,  # acc [BN, BM] fp32; x rows [BM] of a row-major matrix
        w_base, s_base, z_base, offs_n, n_mask, k_lo, k_end, stride_wn, stride_sg, perm_base,
        N_K: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, INT4: tl.constexpr,
        SYM: tl.constexpr, USE_DOT: tl.constexpr, PREC: tl.constexpr, PERM: tl.constexpr,
    ):
        """acc += W[offs_n, k] @ X[x_rows, perm(k)]ᵀ over k ∈ [k_lo, min(k_lo + N_K, k_end)).
        Tokens sit on the small (column) side; dense W rows are [.., Kin] elements, INT4 rows
        [.., Kin/2] bytes (low nibble = even k) with one scale (and zero) row per K step: BLOCK_K
        divides GROUP, N_K and k_end, so a step is wholly in or out. N_K is a constexpr: Triton
        3.6's interpreter rejects loop bounds that are arguments or loaded values."""
        xcol = x_ptr + x_rows[None, :] * stride_x  # [1, BM]
        for kk in range(0, N_K, BLOCK_K):
            k0 = k_lo + kk
            kin = k0 < k_end  # scalar: the last split-K range may be short
            wm = n_mask[:, None] & kin
            xm = x_mask & kin
            if INT4:
                offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # byte columns of this step  [HALF]
                b = tl.load(w_base + offs_n[:, None] * stride_wn + offs_b[None, :], mask=wm, other=0)
                g = k0 // GROUP  # [BN, HALF] uint8 above; one scale (zero) row per step
                s = tl.load(s_base + g * stride_sg + offs_n, mask=n_mask & kin, other=0.0).to(tl.float32)
                if SYM:
                    zs = -8.0 * s
                else:
                    zs = -tl.load(z_base + g * stride_sg + offs_n, mask=n_mask & kin, other=0).to(tl.float32) * s
                # s·(q − z) as one FMA per weight: q·s + (−z·s)
                lo = (b & 0xF).to(tl.float32) * s[:, None] + zs[:, None]  # even k  [BN, HALF]
                hi = (b >> 4).to(tl.float32) * s[:, None] + zs[:, None]  # odd k
                xe = _x_cols(xcol, perm_base, 2 * offs_b, xm, PERM)  # [HALF, BM]
                xo = _x_cols(xcol, perm_base, 2 * offs_b + 1, xm, PERM)
                if USE_DOT:
                    acc = tl.dot(lo.to(xe.dtype), xe, acc, input_precision=PREC)
                    acc = tl.dot(hi.to(xo.dtype), xo, acc, input_precision=PREC)
                else:
                    acc += tl.sum(lo[:, :, None] * xe.to(tl.float32)[None, :, :], axis=1)
                    acc += tl.sum(hi[:, :, None] * xo.to(tl.float32)[None, :, :], axis=1)
            else:
                offs_k = k0 + tl.arange(0, BLOCK_K)
                w = tl.load(w_base + offs_n[:, None] * stride_wn + offs_k[None, :], mask=wm, other=0.0)
                xt = _x_cols(xcol, perm_base, offs_k, xm, PERM)  # [BK, BM]
                if USE_DOT:
                    acc = tl.dot(w, xt, acc, input_precision=PREC)
                else:
                    acc += tl.sum(w.to(tl.float32)[:, :, None] * xt.to(tl.float32)[None, :, :], axis=1)
        return acc

    @triton.jit
    def _gate_up_kernel(
        x_ptr, h_ptr, w_ptr, s_ptr, z_ptr, tok_ptr, act_e_ptr, act_start_ptr, num_act_ptr, perm_ptr,
        stride_x, stride_we, stride_wn, stride_se, stride_ze, stride_sg, stride_pe,
        D: tl.constexpr, I: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
        INT4: tl.constexpr, SYM: tl.constexpr, USE_DOT: tl.constexpr, PREC: tl.constexpr,
        PERM: tl.constexpr,
    ):
        """h[row, n] = silu(x[tok]·gateₙ)·(x[tok]·upₙ) for one (active expert, I-tile). Gate and
        up rows form one [2·BN, D] tile (one K loop, twice the bytes in flight per step). PERM:
        x's columns are read through perm[e] (act-order GPTQ: the expert computes W·x[perm[e]]).
        D and I are constexprs (fixed per model): loop bounds the 3.6 interpreter accepts."""
        pid_a = tl.program_id(0)
        if pid_a >= tl.load(num_act_ptr):
            return  # grid is sized for the worst case; inactive experts' bytes are never read
        e = tl.load(act_e_ptr + pid_a).to(tl.int64)
        start = tl.load(act_start_ptr + pid_a)
        end = tl.load(act_start_ptr + pid_a + 1)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] columns of h
        n_mask = offs_n < I
        r2 = tl.arange(0, 2 * BLOCK_N)
        n2 = tl.program_id(1) * BLOCK_N + r2 % BLOCK_N
        rows_w = n2 + tl.where(r2 >= BLOCK_N, I, 0)  # [2BN] gate rows, then the same up rows
        w_base = w_ptr + e * stride_we
        s_base = s_ptr + e * stride_se
        z_base = z_ptr + e * stride_ze
        m0 = start
        while m0 < end:  # row blocks of this expert; one pass when BLOCK_M ≥ its tokens
            rows = m0 + tl.arange(0, BLOCK_M)
            r_mask = rows < end
            tok = tl.load(tok_ptr + rows, mask=r_mask, other=0)
            acc = tl.zeros((2 * BLOCK_N, BLOCK_M), dtype=tl.float32)
            acc = _tile_matmul(acc, x_ptr, tok, r_mask, stride_x, w_base, s_base, z_base, rows_w,
                               n2 < I, 0, D, stride_wn, stride_sg, perm_ptr + e * stride_pe,
                               D, BLOCK_K, GROUP, INT4, SYM, USE_DOT, PREC, PERM)
            # [2BN, BM] → [BN, BM, 2] → gate, up
            g, u = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N, BLOCK_M)), (1, 2, 0)))
            h = g / (1.0 + tl.exp(-g)) * u  # [BN, BM]
            tl.store(h_ptr + rows[None, :] * I + offs_n[:, None], h.to(h_ptr.dtype.element_ty),
                     mask=n_mask[:, None] & r_mask[None, :])
            m0 += BLOCK_M

    @triton.jit
    def _down_kernel(
        h_ptr, out_ptr, w_ptr, s_ptr, z_ptr, slot_ptr, rw_ptr, act_e_ptr, act_start_ptr, num_act_ptr,
        TK, stride_we, stride_wn, stride_se, stride_ze, stride_sg,
        D: tl.constexpr, I: tl.constexpr, SPLIT_LEN: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
        INT4: tl.constexpr, SYM: tl.constexpr, USE_DOT: tl.constexpr, PREC: tl.constexpr,
    ):
        """out[split, slot, n] = rw[row]·(h[row, k-range]·downₙ) for one (active expert, D-tile,
        split); each (split, slot, n) is written by exactly one program."""
        pid_a = tl.program_id(0)
        if pid_a >= tl.load(num_act_ptr):
            return
        e = tl.load(act_e_ptr + pid_a).to(tl.int64)
        start = tl.load(act_start_ptr + pid_a)
        end = tl.load(act_start_ptr + pid_a + 1)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < D
        pid_k = tl.program_id(2)
        w_base = w_ptr + e * stride_we
        s_base = s_ptr + e * stride_se
        z_base = z_ptr + e * stride_ze
        out_base = out_ptr + pid_k.to(tl.int64) * TK * D
        m0 = start
        while m0 < end:
            rows = m0 + tl.arange(0, BLOCK_M)
            r_mask = rows < end
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            acc = _tile_matmul(acc, h_ptr, rows, r_mask, I, w_base, s_base, z_base, offs_n, n_mask,
                               pid_k * SPLIT_LEN, I, stride_wn, stride_sg, slot_ptr,
                               SPLIT_LEN, BLOCK_K, GROUP, INT4, SYM, USE_DOT, PREC, False)
            slot = tl.load(slot_ptr + rows, mask=r_mask, other=0)
            rw = tl.load(rw_ptr + slot, mask=r_mask, other=0.0)
            tl.store(out_base + slot[None, :] * D + offs_n[:, None], acc * rw[None, :],
                     mask=n_mask[:, None] & r_mask[None, :])
            m0 += BLOCK_M

    @triton.jit
    def _finalize_kernel(part_ptr, y_ptr, TK, D: tl.constexpr, K: tl.constexpr, SPLIT: tl.constexpr,
                         BLOCK_D: tl.constexpr):
        """y[t] = Σ_split Σ_k part[split, t·K + k] in that fixed order, cast to y's dtype."""
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask = offs < D
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            for k in tl.static_range(K):
                acc += tl.load(part_ptr + (s * TK + t * K + k) * D + offs, mask=mask, other=0.0)
        tl.store(y_ptr + t * D + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _config(T: int, A: int, D: int, I: int, dtype, group: int | None, split_k: int | None, sms: int) -> dict:
    """Block sizes from shapes only (no sync). ≤ 4 tokens per expert: broadcast-multiply GEMV;
    more: tl.dot with tokens padded to ≥ 16 on the small side. Small grids get narrower N tiles
    and split-K on the down projection so all `sms` SMs get work."""
    use_dot = T > 4 and not (_interpreting() and dtype == torch.bfloat16)  # bf16 dot: wrong in interp
    bm = min(64, _pow2(T))
    bm = max(16, bm) if use_dot else bm
    # INT4 keeps two dequantised fp32 halves live: narrower tiles (64 rows × BM 64 spill, AOT test)
    bn_gu = bn_dn = 64 if use_dot and not group else 32
    if group and bm > 32:
        bn_gu = 16  # gate-up tiles have 2·BN rows
    while bn_gu > 16 and A * _cdiv(I, bn_gu) < 2 * sms:
        bn_gu //= 2
    while bn_dn > 16 and A * _cdiv(D, bn_dn) < 2 * sms:
        bn_dn //= 2

    def block_k(rows: int) -> int:
        """Largest K step dividing D, I (and G) whose GEMV product [rows, BK, BM] stays ≤ 8K
        fp32 registers per program; tl.dot: 64 dense (smem fits sm_89), G for INT4."""
        top = (group or 64) if use_dot else max(16, 8192 // (rows * bm) * (2 if group else 1))
        return next(b for b in (128, 64, 32, 16) if b <= top and (group or D) % b == 0 and I % b == 0)

    bk_gu, bk_dn = block_k(2 * bn_gu), block_k(bn_dn)
    s = 1
    while split_k is None and s < 8 and A * _cdiv(D, bn_dn) * s < 2 * sms and I // (2 * s) >= 4 * bk_dn:
        s *= 2
    split_len = _cdiv(_cdiv(I, split_k or s), bk_dn) * bk_dn
    prec = "ieee" if dtype == torch.float32 else "tf32"
    common = dict(BLOCK_M=bm, GROUP=group or 1, INT4=group is not None, USE_DOT=use_dot, PREC=prec)
    return dict(gu=dict(common, BLOCK_N=bn_gu, BLOCK_K=bk_gu), dn=dict(common, BLOCK_N=bn_dn, BLOCK_K=bk_dn),
                SPLIT_LEN=split_len, SPLIT=_cdiv(I, split_len))


def plan_launches(x, ids, weights, num_experts, D, I, gu, dn, group, sym, split_k=None, table=None,
                  sms=None, x_perm=None) -> tuple[list, torch.Tensor]:
    """The three launches of one MoE call, [(kernel, grid, args, constexprs)], and the output
    [T, D] they fill: gate-up+SiLU·mul → down·routing weight → fixed-order sum over (split, k).
    gu/dn = (w, s, z): dense w [E, N, Kin] (s, z unused) or the INT4 views of Int4Experts;
    x_perm [E, D] int32 or None (gate-up reads x through it). Separate from running them so tests
    can compile exactly these for a GPU target."""
    T, K = ids.shape
    TK = T * K
    tab = table if table is not None else expert_table(ids, num_experts)
    A = tab["act_e"].numel()
    if sms is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 0
    cfg = _config(T, A, D, I, x.dtype, group, split_k, sms)
    h = torch.empty(TK, I, dtype=x.dtype, device=x.device)  # [T·K, I] rows in expert-major order
    part = torch.empty(cfg["SPLIT"], TK, D, dtype=torch.float32, device=x.device)  # each cell written once
    y = torch.empty(T, D, dtype=x.dtype, device=x.device)
    rw = weights.reshape(-1).float().contiguous()  # [T·K], indexed by slot
    table_args = (tab["act_e"], tab["act_start"], tab["num_act"])
    (w1, s1, z1), (w2, s2, z2) = gu, dn
    perm = x_perm if x_perm is not None else tab["tok"]  # a dummy pointer when PERM is off
    return [
        (_gate_up_kernel, (A, _cdiv(I, cfg["gu"]["BLOCK_N"])),
         (x, h, w1, s1, z1, tab["tok"], *table_args, perm, x.stride(0),
          w1.stride(0), w1.stride(1), s1.stride(0), z1.stride(0), s1.stride(1),
          perm.stride(0) if x_perm is not None else 0),
         dict(cfg["gu"], D=D, I=I, SYM=sym, PERM=x_perm is not None)),
        (_down_kernel, (A, _cdiv(D, cfg["dn"]["BLOCK_N"]), cfg["SPLIT"]),
         (h, part, w2, s2, z2, tab["slot"], rw, *table_args, TK,
          w2.stride(0), w2.stride(1), s2.stride(0), z2.stride(0), s2.stride(1)),
         dict(cfg["dn"], D=D, I=I, SPLIT_LEN=cfg["SPLIT_LEN"], SYM=sym)),
        (_finalize_kernel, (T, _cdiv(D, 1024)), (part, y, TK),
         dict(D=D, K=K, SPLIT=cfg["SPLIT"], BLOCK_D=1024)),
    ], y


def _launch(*args) -> torch.Tensor:
    launches, y = plan_launches(*args)
    for kernel, grid, kargs, meta in launches:
        kernel[grid](*kargs, **meta)
    return y


def fused_moe(
    x: torch.Tensor,  # [T, D] fp16/bf16/fp32
    ids: torch.Tensor,  # [T, K] int64
    weights: torch.Tensor,  # [T, K] fp32
    gate_up: torch.Tensor,  # [E, 2I, D], x's dtype
    down: torch.Tensor,  # [E, D, I]
    *,
    expert_slots: torch.Tensor | None = None,  # [E_model] → row of gate_up/down (offload slots)
    table: dict[str, torch.Tensor] | None = None,  # expert_table(ids) made by the routing kernel
    split_k: int | None = None,  # force the down projection's split-K (tests/benchmarks)
) -> torch.Tensor:
    """Σ_k weights[t,k]·expert_{ids[t,k]}(x[t]) → [T, D]: Triton when use_triton(x), else moe_ref.
    With expert_slots, a given table must already be in slot ids."""
    if expert_slots is not None:
        ids = expert_slots[ids]
    E, two_i, D = gate_up.shape
    I = two_i // 2
    if not use_triton(x) or D % 16 or I % 16 or gate_up.dtype != x.dtype:
        return moe_ref(x, ids, weights, gate_up, down)  # one host sync (the active experts)
    gate_up, down, x = gate_up.contiguous(), down.contiguous(), x.contiguous()
    return _launch(x, ids, weights, E, D, I, (gate_up,) * 3, (down,) * 3, None, True, split_k, table)


def fused_moe_int4(
    x: torch.Tensor,  # [T, D] fp16/bf16/fp32
    ids: torch.Tensor,  # [T, K] int64
    weights: torch.Tensor,  # [T, K] fp32
    packed,  # lynx_edge.quant.int4.Int4Experts (duck-typed: kernels never import quant)
    *,
    expert_slots: torch.Tensor | None = None,
    table: dict[str, torch.Tensor] | None = None,
    split_k: int | None = None,
    x_perm: torch.Tensor | None = None,  # [E, D] int32: act-order input permutation per expert
) -> torch.Tensor:
    """fused_moe on INT4 experts, dequantised in registers; reference: dequantise active experts.
    x_perm (act-order GPTQ with the permutation kept): expert e's gate-up reads x[:, x_perm[e]],
    i.e. its packed columns are in quantisation order. Indexed like the packed experts (slot
    rows when expert_slots is given)."""
    if expert_slots is not None:
        ids = expert_slots[ids]
    if not use_triton(x):
        def fetch(e: int):
            gu, dn = packed.dequant_expert(e, x.dtype)
            if x_perm is not None:  # W_q · x[perm] = (W_q scattered back to x's column order) · x
                gu = torch.empty_like(gu).index_copy_(1, x_perm[e].long(), gu)
            return gu, dn
        return moe_ref_lazy(x, ids, weights, packed.num_experts, fetch)
    sym = packed.sym
    gu = (packed.gu_q, packed.gu_s, packed.gu_q if sym else packed.gu_z)  # z unused when sym
    dn = (packed.dn_q, packed.dn_s, packed.dn_q if sym else packed.dn_z)
    perm = None if x_perm is None else x_perm.to(device=x.device, dtype=torch.int32).contiguous()
    return _launch(x.contiguous(), ids, weights, packed.num_experts, packed.hidden, packed.inter,
                   gu, dn, packed.group_size, sym, split_k, table, None, perm)
