"""Fused router + LYNX for one MoE layer at decode sizes: one Triton launch, one program.

logits [T, E] → softmax → top-k (ties → lower id) → LYNX (bins, batch scores, critical set,
remap, renormalised weights) → ids [T, K] int64, weights [T, K] fp32, and the expert-major table
the grouped GEMM (kernels/moe_gemm.py) consumes. Output sizes depend on T, E, K only and the
launch path has no host sync (CUDA-graph friendly). The torch reference is lynx.lynx_select (+
moe_gemm.expert_table); the kernel matches it: same ids, weights within ~1e-6. Glossary:
T tokens, E experts, K top-k, B decode tokens, A = min(T·K, E) active-expert slots.

Outputs of lynx_route / lynx_route_ref:
  ids [T, K] int64, weights [T, K] fp32 (as lynx_select),
  active [A] int32: experts used, ascending, padded with -1,
  counts [A + 2] int32: [n_active, start_0, …, start_A]: start_i = first row of active slot i in
      token_table (rows of slots ≥ n_active start at T·K, so their ranges are empty),
  token_table [T·K] int32: flat token-slots t·K + k, expert-major, ascending within an expert.
gemm_table() turns these into moe_gemm's `table` dict (views, plus tok = slot // K).

The kernel holds the whole [T, E] tile in registers (T ≤ 64, E ≤ 256; ≤ 8 elements per thread,
so no spills up to T·E = 4096, a little beyond). Top-k runs on the logits (softmax is monotone:
the same ids as exact_route's torch.topk on probabilities unless two probabilities tie exactly)
as K passes of row max + lowest-id argmax; the remap is ≤ K more. B is counted on the device.
Scores are exact integers S(e)·B^β = Σ B^(β − level) (as lynx._scores), int32 when
T^(β+1) < 2^31, else int64. Modes off, lynx, budget:m and lynx-mass:τ are fused (lynx-mass
compares slot masses computed from the kernel's own probabilities, equal to torch's within an
ulp or two). Larger shapes, CPU tensors without TRITON_INTERPRET=1, or scores beyond 2^62 fall
back to the torch reference (which syncs once on is_decode).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..lynx import LynxConfig, lynx_select
from ..routing import RouterSpec
from .moe_gemm import expert_table, triton, use_triton

if triton is not None:
    import triton.language as tl

MAX_T, MAX_E, MAX_K = 64, 256, 16  # one program, whole tile in registers; K bits fit an int32 mask
_MODE = {"off": 0, "lynx": 1, "budget": 2, "lynx-mass": 3}
_MASS_SLACK = 1 + 1e-6  # lynx._mass_keep's slack: τ = 1 is exactly `lynx`


def _pow2(n: int) -> int:
    return 1 << max(1, n - 1).bit_length()  # ≥ 2: avoids size-1 tensor dims


if triton is not None:

    @triton.jit
    def _argmax_low(x, e, BE: tl.constexpr):
        """Row max of x [BT, BE] and its lowest column index (ties → lower expert id)."""
        mx = tl.max(x, 1)
        return mx, tl.min(tl.where(x == mx[:, None], e[None, :], BE), 1)

    @triton.jit
    def _ipow(base, n):
        """base^n for a scalar int32 n ≥ 0 (base: int tensor/scalar, exact)."""
        r = base * 0 + 1
        for _ in range(0, n):
            r = r * base
        return r

    @triton.jit
    def _lynx_route_kernel(
        z_ptr, dec_ptr, ids_ptr, w_ptr, act_ptr, cnt_ptr, tab_ptr,
        T, E, A, stride_zt, alpha, tau, slack, min_b, beta, thr_exp, budget_m,
        K: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, BA: tl.constexpr,
        MODE: tl.constexpr, NORM: tl.constexpr, PROTECT: tl.constexpr, WIDE: tl.constexpr,
    ):
        t = tl.arange(0, BT)
        e = tl.arange(0, BE)
        kc = tl.arange(0, BK)
        tv = t < T
        ev = e < E
        kv = kc < K
        NEG = float("-inf")
        # z [BT, BE] fp32: absent experts -inf (never chosen); padded rows 0 (finite: no NaN)
        z = tl.load(z_ptr + t[:, None] * stride_zt + e[None, :], mask=tv[:, None] & ev[None, :],
                    other=NEG).to(tl.float32)
        z = tl.where(tv[:, None], z, tl.where(ev[None, :], 0.0, NEG))
        dec = (tl.load(dec_ptr + t, mask=tv, other=0) != 0) & tv  # [BT] decode tokens
        m0 = tl.max(z, 1)  # [BT] top-1 logit
        s = tl.sum(tl.exp(z - m0[:, None]), 1)  # softmax denominator; p = exp(z − m0) / s

        # ---- exact top-k on logits (softmax is monotone; = torch.topk on probs without ties).
        # SL [BT, BE]: slot k of each chosen expert, -1 elsewhere; ids0/p0 [BT, BK] slot order.
        SL = tl.full((BT, BE), -1, tl.int32)
        ids0 = tl.zeros((BT, BK), tl.int32)
        p0 = tl.zeros((BT, BK), tl.float32)
        zw = z
        for k in tl.static_range(K):
            mk, ik = _argmax_low(zw, e, BE)
            hit = e[None, :] == ik[:, None]
            zw = tl.where(hit, NEG, zw)
            SL = tl.where(hit, k, SL)
            ids0 = tl.where(kc[None, :] == k, ik[:, None], ids0)
            p0 = tl.where(kc[None, :] == k, (tl.exp(mk - m0) / s)[:, None], p0)
        msum = tl.sum(p0, 1)  # [BT] original top-k mass M(t)
        if NORM:
            w0 = p0 / msum[:, None]
        else:
            w0 = p0
        chosen = SL >= 0
        new, w, FS = ids0, w0, SL  # FS [BT, BE]: slot of each final choice, -1 elsewhere

        if MODE != 0:
            nb = tl.sum(dec.to(tl.int32), 0)  # B, counted on device: no host sync
            decl = dec & (nb >= min_b)  # rows LYNX may remap (B ≥ max(min_batch, 2))
            if WIDE:
                bb = nb.to(tl.int64)
            else:
                bb = nb
            # levels ⌊α·gap⌋ ∈ [0, β] (gap to the top-1 logit); vote B^(β − level), exact ints
            lv = tl.floor(tl.maximum(m0[:, None] - z, 0.0) * alpha)
            lv = tl.minimum(tl.maximum(lv, 0.0), beta.to(tl.float32)).to(tl.int32)
            vote = tl.full((BT, BE), 1, bb.dtype)
            for i in range(0, beta):
                vote = tl.where(lv + i < beta, vote * bb, vote)
            score = tl.sum(tl.where(chosen & decl[:, None], vote, 0), 0)  # [BE] S(e)·B^β
            # prefill tokens' experts are needed anyway; rank-0 experts of decode tokens
            needed = tl.max(tl.where(chosen & (tv & ~dec)[:, None], 1, 0), 0) > 0
            top1 = tl.max(tl.where((SL == 0) & dec[:, None], 1, 0), 0) > 0
            if MODE == 2:  # budget:m: the m best scores that anyone voted for
                crit = e < 0
                rest = tl.where(ev & (score > 0), score, -1)
                for _ in range(0, tl.minimum(budget_m, tl.sum((rest > 0).to(tl.int32), 0))):
                    mx = tl.max(rest, 0)
                    ix = tl.min(tl.where(rest == mx, e, BE), 0)
                    crit = crit | (e == ix)
                    rest = tl.where(e == ix, -1, rest)
            else:  # S(e) ≥ B^−j, in units of B^−β
                crit = score >= _ipow(bb, thr_exp)
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
            # pad: if |allowed| < K add the best-scoring others (ties → lower id) up to K
            for _ in range(0, K - tl.sum(allowed.to(tl.int32), 0)):
                rest = tl.where(ev & ~allowed, score, -1)
                mx = tl.max(rest, 0)
                allowed = allowed | (e == tl.min(tl.where(rest == mx, e, BE), 0))
            # drops: bit k of bits[t] = slot k of decode token t leaves; gap_no = its rank
            drop = chosen & ~allowed[None, :] & decl[:, None]
            bits = tl.sum(tl.where(drop, 1 << tl.maximum(SL, 0), 0), 1)  # [BT]
            dk = ((bits[:, None] >> kc[None, :]) & 1) != 0  # [BT, BK]
            dki = dk.to(tl.int32)
            gap_no = tl.cumsum(dki, 1) - dki
            n_drop = tl.sum(dki, 1)
            FS = tl.where(drop, -1, SL)
            pn = p0
            # i-th gap of each token ← its i-th best allowed, unchosen expert by logit
            zc = tl.where(allowed[None, :] & ~chosen, z, NEG)
            for i in range(0, tl.max(n_drop, 0)):
                mc, ic = _argmax_low(zc, e, BE)
                hit = e[None, :] == ic[:, None]
                zc = tl.where(hit, NEG, zc)
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


def _mode(spec: RouterSpec, cfg: LynxConfig, layer: int) -> int:
    if cfg.kind == "off" or layer in cfg.skip_layers or spec.num_experts <= spec.top_k:
        return 0
    return _MODE[cfg.kind]


def _num_warps(BT: int, BE: int) -> int:
    # ≤ 8 tile elements per thread: ~110 registers, no spills on sm_90 up to BT·BE = 4096
    # (e.g. T=16 × E=256); bigger tiles spill a little even at 32 warps (see the AOT tests).
    return max(1, min(32, BT * BE // 256))


def kernel_supported(logits: torch.Tensor, spec: RouterSpec, cfg: LynxConfig, layer: int = 0) -> bool:
    """Whether lynx_route runs the Triton kernel for these inputs (else the torch reference)."""
    return use_triton(logits) and logits.dim() == 2 and _fits(*logits.shape, spec, cfg, layer)


def _fits(T: int, E: int, spec: RouterSpec, cfg: LynxConfig, layer: int = 0) -> bool:
    K = spec.top_k
    if not (1 <= T <= MAX_T and E == spec.num_experts and 1 <= K <= min(E, MAX_K) and E <= MAX_E):
        return False
    return _mode(spec, cfg, layer) == 0 or T ** (cfg.beta + 1) < 2**62  # int64 scores exact


class RoutePlan(NamedTuple):
    kernel: object
    grid: tuple
    args: tuple
    meta: dict  # constexprs
    num_warps: int
    outputs: tuple  # (ids, weights, active, counts, token_table), filled by the launch


def plan_route(logits, is_decode, spec: RouterSpec, cfg: LynxConfig, layer: int = 0,
               num_warps: Optional[int] = None) -> RoutePlan:
    """The one launch of lynx_route, separate so tests can compile exactly it for a GPU target.
    Allocation and argument set-up only: no host sync."""
    T, E = logits.shape
    K = spec.top_k
    dev = logits.device
    A = min(T * K, E)
    isd = is_decode.reshape(-1).to(dev, non_blocking=True)  # a no-op when already on the device
    isd = isd.view(torch.uint8) if isd.dtype == torch.bool else (isd != 0).to(torch.uint8)
    z = logits if logits.stride(1) == 1 else logits.contiguous()
    outs = (torch.empty(T, K, dtype=torch.int64, device=dev),  # ids
            torch.empty(T, K, dtype=torch.float32, device=dev),  # weights
            torch.empty(A, dtype=torch.int32, device=dev),  # active
            torch.empty(A + 2, dtype=torch.int32, device=dev),  # counts
            torch.empty(T * K, dtype=torch.int32, device=dev))  # token_table
    mode = _mode(spec, cfg, layer)
    alpha = cfg.alpha_for(E, K) if mode else 1.0
    tau = float(cfg.arg) if cfg.kind == "lynx-mass" else 1.0
    m = int(cfg.arg) if cfg.kind == "budget" else 0
    BT, BE = _pow2(T), _pow2(E)
    args = (z, isd, *outs, T, E, A, z.stride(0), float(alpha), tau, _MASS_SLACK,
            max(cfg.min_batch, 2), cfg.beta, max(cfg.beta - cfg.j, 0), m)
    meta = dict(K=K, BT=BT, BE=BE, BK=_pow2(K), BA=_pow2(A + 2), MODE=mode, NORM=spec.norm_topk_prob,
                PROTECT=cfg.protect_top1, WIDE=T ** (cfg.beta + 1) >= 2**31)
    return RoutePlan(_lynx_route_kernel, (1,), args, meta, num_warps or _num_warps(BT, BE), outs)


def lynx_route(logits: torch.Tensor, is_decode: torch.Tensor, spec: RouterSpec,
               cfg: "LynxConfig | str | None" = None, layer: int = 0, num_warps: Optional[int] = None):
    """logits [T, E], is_decode [T] bool → (ids, weights, active, counts, token_table), see the
    module docstring. One Triton launch when kernel_supported(), else lynx_route_ref.
    For CUDA-graph capture keep is_decode on the logits' device (a CPU mask means an H2D copy)."""
    cfg = LynxConfig.parse(cfg) if cfg is not None else LynxConfig()
    if not kernel_supported(logits, spec, cfg, layer):
        return lynx_route_ref(logits, is_decode, spec, cfg, layer)
    p = plan_route(logits, is_decode, spec, cfg, layer, num_warps)
    p.kernel[p.grid](*p.args, **p.meta, num_warps=p.num_warps)
    return p.outputs


def lynx_route_ref(logits: torch.Tensor, is_decode: torch.Tensor, spec: RouterSpec,
                   cfg: "LynxConfig | str | None" = None, layer: int = 0):
    """Torch reference: lynx_select + moe_gemm.expert_table, in lynx_route's output format."""
    cfg = LynxConfig.parse(cfg) if cfg is not None else LynxConfig()
    r = lynx_select(logits, is_decode, spec, cfg, layer)
    T, K = r.ids.shape
    A = min(T * K, spec.num_experts)
    i32 = dict(dtype=torch.int32, device=logits.device)
    if T == 0:
        return r.ids, r.weights, torch.empty(0, **i32), torch.zeros(2, **i32), torch.empty(0, **i32)
    tab = expert_table(r.ids, spec.num_experts)
    active = torch.where(torch.arange(A, device=logits.device) < tab["num_act"], tab["act_e"], -1)
    counts = torch.cat([tab["num_act"], tab["act_start"]])
    return r.ids, r.weights, active.to(torch.int32), counts, tab["slot"]


def gemm_table(active: torch.Tensor, counts: torch.Tensor, token_table: torch.Tensor, top_k: int):
    """lynx_route outputs → moe_gemm's `table` dict (fused_moe(..., table=...)). Views except
    tok (one elementwise op). act_e past n_active is -1: the GEMM programs there exit first."""
    return {"tok": token_table // top_k, "slot": token_table, "act_e": active,
            "act_start": counts[1:], "num_act": counts[:1]}


def bench_route(T: int, E: int, K: int, mode: str = "lynx", norm: bool = True, graph: bool = False,
                seed: int = 0) -> float:
    """µs per lynx_route call on CUDA (all tokens decode), by triton.testing.do_bench; graph=True
    times a CUDA-graph replay of it instead (kernel time without Python launch overhead)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(T, E, device="cuda", generator=g) * 2
    isd = torch.ones(T, dtype=torch.bool, device="cuda")
    spec, cfg = RouterSpec(E, K, norm), LynxConfig.parse(mode)
    fn = lambda: lynx_route(logits, isd, spec, cfg)  # noqa: E731
    fn()
    if graph:
        torch.cuda.synchronize()
        cg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cg):
            fn()
        fn = cg.replay
    return triton.testing.do_bench(fn) * 1e3
