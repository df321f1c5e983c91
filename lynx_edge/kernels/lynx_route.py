"""Fused router + LYNX for one MoE layer at decode sizes: one Triton launch, one program.

logits [T, E] → softmax → top-k → LYNX (bins, batch scores, critical set, remap, renormalised
weights) → ids [T, K] int64, weights [T, K] fp32, the expert-major table the grouped GEMM
(kernels/moe_gemm.py) consumes and the routing stats. Plain tensors and scalars in: the glue
from a RouterSpec + LynxConfig (and the torch reference lynx_route_ref) lives in lynx.py.
Output sizes depend on T, E, K only and the launch path has no host sync (CUDA-graph friendly).
Glossary: T tokens, E experts, K top-k, B decode tokens, A = min(T·K, E) active-expert slots.

Outputs of lynx_route (and of lynx.lynx_route_ref):
  ids [T, K] int64, weights [T, K] fp32 (as lynx.lynx_select),
  active [A] int32: experts used, ascending, padded with -1,
  counts [A + 2] int32: [n_active, start_0, …, start_A]: start_i = first row of active slot i in
      token_table (rows of slots ≥ n_active start at T·K, so their ranges are empty),
  token_table [T·K] int32: flat token-slots t·K + k, expert-major, ascending within an expert,
  stats [7] fp64: tokens, decode tokens, decode slots, unique experts before / after, remapped
      slots, displaced prob mass (lynx._STATS order).
gemm_table() turns active/counts/token_table into moe_gemm's `table` dict.

Rules shared with the torch reference (routing.py): experts rank by logit (softmax is monotone),
ties → lower expert id; a row with fewer than K finite logits takes the lowest ids among its
−inf ones, never an id twice. The whole [T, E] tile sits in registers (T ≤ 64, E ≤ 256; ≤ 8
elements per thread, so no spills up to T·E = 4096). Scores are exact integers
S(e)·B^β = Σ B^(β − level), int32 when T^(β+1) < 2^31, else int64. Loops run over constexpr bounds
with masks (Triton 3.6's interpreter rejects loop bounds that are arguments or loaded values).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .moe_gemm import triton, triton_usable

if triton is not None:
    import triton.language as tl

MAX_T, MAX_E, MAX_K = 64, 256, 16  # one program, whole tile in registers; K bits fit an int32 mask
OFF, LYNX, BUDGET, MASS = 0, 1, 2, 3  # `mode`: exact top-k | lynx | budget:m | lynx-mass:τ
MASS_SLACK = 1 + 1e-6  # lynx._mass_keep's slack: τ = 1 is exactly `lynx`


def _pow2(n: int) -> int:
    return 1 << max(1, n - 1).bit_length()  # ≥ 2: avoids size-1 tensor dims


if triton is not None:

    @triton.jit
    def _argmax_low(x, avail, e, BE: tl.constexpr):
        """Row max of x [BT, BE] over the available columns and its lowest such column
        (ties → lower expert id; a row of −inf picks its lowest available id, never a taken one)."""
        xm = tl.where(avail, x, float("-inf"))
        mx = tl.max(xm, 1)
        return mx, tl.min(tl.where(avail & (xm == mx[:, None]), e[None, :], BE), 1)

    @triton.jit
    def _ipow(base, n, LIMIT: tl.constexpr):
        """base^n, exact, by squaring: base an int scalar, n ≥ 0 int (scalar or tile) with
        base^n < 2^62. Six constexpr steps cover n < 64 (a loop bound the 3.6 interpreter takes);
        a square is skipped once the power passes LIMIT = √(int max): no higher bit of n is set."""
        r = base * 0 + (n * 0 + 1)  # base's dtype, n's shape; n may be a specialised Python int (Triton 3.7)
        p = base
        for b in tl.static_range(6):
            r = tl.where(((n >> b) & 1) != 0, r * p, r)
            p = p * tl.where(p < LIMIT, p, 1)
        return r

    @triton.jit
    def _lynx_route_kernel(
        z_ptr, dec_ptr, ids_ptr, w_ptr, act_ptr, cnt_ptr, tab_ptr, st_ptr,
        T, E, A, stride_zt, alpha, tau, slack, min_b, beta, thr_exp, budget_m,
        K: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, BA: tl.constexpr,
        MODE: tl.constexpr, NORM: tl.constexpr, PROTECT: tl.constexpr, WIDE: tl.constexpr,
        NV: tl.constexpr, LIMIT: tl.constexpr,
    ):
        t = tl.arange(0, BT)
        e = tl.arange(0, BE)
        kc = tl.arange(0, BK)
        tv = t < T
        ev = e < E
        kv = kc < K
        NEG = float("-inf")
        # z [BT, BE] fp32: absent experts -inf (never available); padded rows 0 (finite: no NaN)
        z = tl.load(z_ptr + t[:, None] * stride_zt + e[None, :], mask=tv[:, None] & ev[None, :],
                    other=NEG).to(tl.float32)
        z = tl.where(tv[:, None], z, tl.where(ev[None, :], 0.0, NEG))
        dec = (tl.load(dec_ptr + t, mask=tv, other=0) != 0) & tv  # [BT] decode tokens
        nb = tl.sum(dec.to(tl.int32), 0)  # B, counted on device: no host sync
        m0 = tl.max(z, 1)  # [BT] top-1 logit
        s = tl.sum(tl.exp(z - m0[:, None]), 1)  # softmax denominator; p = exp(z − m0) / s

        # ---- exact top-k on logits, ties → lower id (= routing.exact_route).
        # SL [BT, BE]: slot k of each chosen expert, -1 elsewhere; ids0/p0 [BT, BK] slot order.
        SL = tl.full((BT, BE), -1, tl.int32)
        ids0 = tl.zeros((BT, BK), tl.int32)
        p0 = tl.zeros((BT, BK), tl.float32)
        avail = (SL < 0) & ev[None, :]
        for k in tl.static_range(K):
            mk, ik = _argmax_low(z, avail, e, BE)
            hit = e[None, :] == ik[:, None]
            avail = avail & ~hit
            SL = tl.where(hit, k, SL)
            ids0 = tl.where(kc[None, :] == k, ik[:, None], ids0)
            p0 = tl.where(kc[None, :] == k, (tl.exp(mk - m0) / s)[:, None], p0)
        msum = tl.sum(p0, 1)  # [BT] original top-k mass M(t)
        if NORM:
            w0 = p0 / msum[:, None]
        else:
            w0 = p0
        chosen = SL >= 0
        before = tl.sum((tl.max(tl.where(chosen & tv[:, None], 1, 0), 0) > 0).to(tl.int32), 0)
        new, w, FS = ids0, w0, SL  # FS [BT, BE]: slot of each final choice, -1 elsewhere
        n_rem = 0.0
        d_mass = 0.0

        if MODE != 0:
            decl = dec & (nb >= min_b)  # rows LYNX may remap (B ≥ max(min_batch, 2))
            if WIDE:
                bb = nb.to(tl.int64)
            else:
                bb = nb
            # levels ⌊α·gap⌋ ∈ [0, β] (gap to the top-1 logit); vote B^(β − level), exact ints.
            # beta * 1.0: the JIT turns an int argument equal to 1 into a constexpr (no .to()).
            lv = tl.floor(tl.maximum(m0[:, None] - z, 0.0) * alpha)
            lv = tl.minimum(tl.maximum(lv, 0.0), beta * 1.0).to(tl.int32)
            vote = _ipow(bb, beta - lv, LIMIT)  # [BT, BE]
            score = tl.sum(tl.where(chosen & decl[:, None], vote, 0), 0)  # [BE] S(e)·B^β
            # prefill tokens' experts are needed anyway; rank-0 experts of decode tokens
            needed = tl.max(tl.where(chosen & (tv & ~dec)[:, None], 1, 0), 0) > 0
            top1 = tl.max(tl.where((SL == 0) & dec[:, None], 1, 0), 0) > 0
            if MODE == 2:  # budget:m: the m best scores that anyone voted for (m ≤ E)
                crit = e < 0
                rest = tl.where(ev & (score > 0), score, -1)
                for i in range(0, NV):  # NV ≥ experts anyone voted for: a constexpr bound
                    mx = tl.max(rest, 0)
                    pick = (e == tl.min(tl.where(rest == mx, e, BE), 0)) & (mx > 0) & (i < budget_m)
                    crit = crit | pick
                    rest = tl.where(pick, -1, rest)
            else:  # S(e) ≥ B^−j, in units of B^−β
                crit = score >= _ipow(bb, thr_exp, LIMIT)
            crit = crit | needed
            if PROTECT:
                crit = crit | top1
            allowed = crit & ev
            if MODE == 3:  # lynx-mass:τ: keep the slots whose loss would exceed τ·M(t)
                bits = tl.sum(tl.where(chosen & ~allowed[None, :], 1 << tl.maximum(SL, 0), 0), 1)
                dk = (((bits[:, None] >> kc[None, :]) & 1) != 0) & decl[:, None] & kv[None, :]
                x = tl.where(dk, p0, 0.0)
                bud = tau * msum * slack
                tail = tl.zeros((BT,), tl.float32)
                keep = tl.zeros((BT,), tl.int32)
                for kk in tl.static_range(K):  # from the last slot: torch's flip-cumsum order
                    col = kc[None, :] == K - 1 - kk
                    tail = tail + tl.sum(tl.where(col, x, 0.0), 1)
                    dcol = tl.sum(tl.where(col & dk, 1, 0), 1) > 0
                    keep = keep | tl.where(dcol & (tail > bud), 1 << (K - 1 - kk), 0)
                kept = chosen & (((keep[:, None] >> tl.maximum(SL, 0)) & 1) != 0)
                allowed = allowed | (tl.max(kept.to(tl.int32), 0) > 0)
            # pad: while |allowed| < K add the best-scoring other expert (ties → lower id)
            for _ in range(0, K):
                short = tl.sum(allowed.to(tl.int32), 0) < K
                rest = tl.where(ev & ~allowed, score, -1)
                mx = tl.max(rest, 0)
                allowed = allowed | ((e == tl.min(tl.where(rest == mx, e, BE), 0)) & short)
            # drops: bit k of bits[t] = slot k of decode token t leaves; gap_no = its rank
            drop = chosen & ~allowed[None, :] & decl[:, None]
            bits = tl.sum(tl.where(drop, 1 << tl.maximum(SL, 0), 0), 1)  # [BT]
            dk = ((bits[:, None] >> kc[None, :]) & 1) != 0  # [BT, BK]
            dki = dk.to(tl.int32)
            gap_no = tl.cumsum(dki, 1) - dki
            n_drop = tl.sum(dki, 1)
            FS = tl.where(drop, -1, SL)
            pn = p0
            # i-th gap of each token ← its i-th best allowed, unchosen expert by logit (K passes:
            # a constexpr bound; passes past a token's last gap change nothing)
            cand = allowed[None, :] & ~chosen
            for i in range(0, K):
                mc, ic = _argmax_low(z, cand, e, BE)
                hit = e[None, :] == ic[:, None]
                cand = cand & ~hit
                gap = dk & (gap_no == i)
                ks = tl.min(tl.where(gap, kc[None, :], BK), 1)  # [BT] slot that gap is in
                new = tl.where(gap, ic[:, None], new)
                pn = tl.where(gap, (tl.exp(mc - m0) / s)[:, None], pn)
                FS = tl.where(hit & (ks < BK)[:, None], ks[:, None], FS)
            # original probs of the new experts, rescaled to M(t) (1 when renormalised)
            den = tl.sum(pn, 1)
            wl = tl.where(den[:, None] > 0, pn / tl.maximum(den, 1.1754943508222875e-38)[:, None],
                          1.0 / K)
            if not NORM:
                wl = wl * msum[:, None]
            w = tl.where((n_drop > 0)[:, None], wl, w0)  # untouched tokens keep exact weights
            n_rem = tl.sum(n_drop, 0).to(tl.float32)
            d_mass = tl.sum(tl.sum(tl.where(dk, p0, 0.0), 1), 0)

        out = tv[:, None] & kv[None, :]
        tl.store(ids_ptr + t[:, None] * K + kc[None, :], new.to(tl.int64), mask=out)
        tl.store(w_ptr + t[:, None] * K + kc[None, :], w, mask=out)
        # ---- active list and expert-major table (rows sorted by expert, then token)
        M = ((FS >= 0) & tv[:, None]).to(tl.int32)
        cnt = tl.sum(M, 0)  # [BE] token-slots per expert
        used = (cnt > 0).to(tl.int32)
        pos = tl.cumsum(used, 0) - used  # active slot of each used expert
        n_act = tl.sum(used, 0)
        start = tl.cumsum(cnt, 0) - cnt  # first row of each expert
        row = start[None, :] + tl.cumsum(M, 0) - M  # [BT, BE]
        tl.store(tab_ptr + row, t[:, None] * K + FS, mask=M > 0)
        tl.store(act_ptr + pos, e, mask=used > 0)
        tl.store(cnt_ptr + 1 + pos, start, mask=used > 0)
        a = tl.arange(0, BA)
        tl.store(act_ptr + a, tl.full((BA,), -1, tl.int32), mask=(a >= n_act) & (a < A))
        tl.store(cnt_ptr + 1 + a, tl.full((BA,), 0, tl.int32) + T * K, mask=(a >= n_act) & (a <= A))
        tl.store(cnt_ptr + a, tl.full((BA,), 0, tl.int32) + n_act, mask=a == 0)
        # ---- stats [7] (lynx._STATS order)
        si = tl.arange(0, 8)
        nbf = nb.to(tl.float32)
        sv = tl.where(si == 0, T * 1.0, tl.where(si == 1, nbf, tl.where(si == 2, nbf * K, 0.0)))
        sv = tl.where(si == 3, before.to(tl.float32), tl.where(si == 4, n_act.to(tl.float32), sv))
        sv = tl.where(si == 5, n_rem, tl.where(si == 6, d_mass, sv))
        tl.store(st_ptr + si, sv.to(tl.float64), mask=si < 7)


def _num_warps(BT: int, BE: int) -> int:
    # ≤ 8 tile elements per thread: ~110 registers, no spills on sm_90 up to BT·BE = 4096
    # (e.g. T=16 × E=256); bigger tiles spill a little even at 32 warps (see the AOT tests).
    return max(1, min(32, BT * BE // 256))


def available(device: "torch.device | str") -> bool:
    """Whether the kernel can run on tensors of `device` (CUDA with Triton, or the interpreter)."""
    return triton_usable(torch.device(device))


def fits(T: int, E: int, K: int, mode: int = OFF, beta: int = 4) -> bool:
    """Whether the one-program kernel takes this shape (else use the torch reference)."""
    if not (1 <= T <= MAX_T and 1 <= K <= min(E, MAX_K) and E <= MAX_E):
        return False
    return mode == OFF or T ** (beta + 1) < 2**62  # int64 scores stay exact


class RoutePlan(NamedTuple):
    kernel: object
    grid: tuple
    args: tuple
    meta: dict  # constexprs
    num_warps: int
    outputs: tuple  # (ids, weights, active, counts, token_table, stats), filled by the launch


def plan_route(logits: torch.Tensor, is_decode: torch.Tensor, top_k: int, *, norm: bool,
               mode: int = OFF, alpha: float = 1.0, beta: int = 4, j: int = 1, tau: float = 1.0,
               m: int = 0, protect: bool = True, min_batch: int = 2,
               num_warps: Optional[int] = None) -> RoutePlan:
    """The one launch of lynx_route, separate so tests can compile exactly it for a GPU target.
    Allocation and argument set-up only: no host sync. m: budget size (mode BUDGET, capped at E)."""
    T, E = logits.shape
    K, dev = top_k, logits.device
    A = min(T * K, E)
    isd = is_decode.reshape(-1).to(dev, non_blocking=True)  # a no-op when already on the device
    isd = isd.view(torch.uint8) if isd.dtype == torch.bool else (isd != 0).to(torch.uint8)
    z = logits if logits.stride(1) == 1 else logits.contiguous()
    outs = (torch.empty(T, K, dtype=torch.int64, device=dev),  # ids
            torch.empty(T, K, dtype=torch.float32, device=dev),  # weights
            torch.empty(A, dtype=torch.int32, device=dev),  # active
            torch.empty(A + 2, dtype=torch.int32, device=dev),  # counts
            torch.empty(T * K, dtype=torch.int32, device=dev),  # token_table
            torch.empty(7, dtype=torch.float64, device=dev))  # stats
    BT, BE = _pow2(T), _pow2(E)
    args = (z, isd, *outs, T, E, A, z.stride(0), float(alpha), float(tau), MASS_SLACK,
            max(int(min_batch), 2), int(beta), max(int(beta) - int(j), 0), min(int(m), E))
    meta = dict(K=K, BT=BT, BE=BE, BK=_pow2(K), BA=_pow2(A + 2), MODE=int(mode), NORM=bool(norm),
                PROTECT=bool(protect), WIDE=T ** (beta + 1) >= 2**31,
                NV=min(BE, BT * _pow2(K)) if mode == BUDGET else 1,
                LIMIT=3037000499 if T ** (beta + 1) >= 2**31 else 46340)  # ⌊√(int64 | int32 max)⌋
    return RoutePlan(_lynx_route_kernel, (1,), args, meta, num_warps or _num_warps(BT, BE), outs)


def lynx_route(logits: torch.Tensor, is_decode: torch.Tensor, top_k: int, *, norm: bool,
               mode: int = OFF, **knobs):
    """logits [T, E], is_decode [T] bool → (ids, weights, active, counts, token_table, stats), see
    the module docstring; knobs: alpha, beta, j, tau, m, protect, min_batch, num_warps. One launch.
    Needs available(logits.device) and fits(T, E, top_k, mode, beta): the caller decides (lynx.py).
    For CUDA-graph capture keep is_decode on the logits' device (a CPU mask means an H2D copy)."""
    T, E = logits.shape
    if not fits(T, E, top_k, mode, knobs.get("beta", 4)):
        raise ValueError(f"lynx_route: shape T={T}, E={E}, K={top_k} is outside the kernel's limits")
    p = plan_route(logits, is_decode, top_k, norm=norm, mode=mode, **knobs)
    p.kernel[p.grid](*p.args, **p.meta, num_warps=p.num_warps)
    return p.outputs


def gemm_table(active: torch.Tensor, counts: torch.Tensor, token_table: torch.Tensor, top_k: int):
    """lynx_route outputs → moe_gemm's `table` dict (fused_moe(..., table=...)). Views except
    tok (one elementwise op). act_e past n_active is -1: the GEMM programs there exit first."""
    return {"tok": token_table // top_k, "slot": token_table, "act_e": active,
            "act_start": counts[1:], "num_act": counts[:1]}


def bench_route(T: int, E: int, K: int, mode: int = LYNX, norm: bool = True, graph: bool = False,
                seed: int = 0, **knobs) -> float:
    """µs per lynx_route call on CUDA (all tokens decode), by triton.testing.do_bench; graph=True
    times a CUDA-graph replay of it instead (kernel time without Python launch overhead)."""
    import math

    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(T, E, device="cuda", generator=g) * 2
    isd = torch.ones(T, dtype=torch.bool, device="cuda")
    knobs.setdefault("alpha", knobs.get("beta", 4) / math.log(E / K))
    fn = lambda: lynx_route(logits, isd, K, norm=norm, mode=mode, **knobs)  # noqa: E731
    fn()
    if graph:
        torch.cuda.synchronize()
        cg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cg):
            fn()
        fn = cg.replay
    return triton.testing.do_bench(fn) * 1e3
