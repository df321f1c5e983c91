"""LYNX batch-aware expert selection (torch reference; also the CPU runtime path).

Per MoE layer and decode step: bin each token's top-k choices by their logit gap to its top-1
(AffinityBinning), score experts over the batch S(e) = Σ B^bin, keep the critical set
C = {S ≥ B^-j} ∪ rank-0s ∪ prefill experts, and remap the other slots to each token's next-best
expert in C (∪ GPU-resident experts when offloading). Gate weights keep the token's top-k mass.
Modes: off | lynx | budget:m | lynx-mass:τ. Host syncs: none while routing (the phase comes from
the host, mixed masks stay on the device); only the offload `fetch` list reads back.
LynxRouter runs the Triton kernel (kernels/lynx_route.py) on CUDA where the shape fits, this
reference elsewhere; kernel_args() is the glue from RouterSpec + LynxConfig to its scalars.
Glossary: T tokens, E experts, K top-k, B decode tokens.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Callable, Optional

import numpy as np
import torch

from . import lynx_host as _host
from .kernels import lynx_route as _kernel
from .kernels import native as _native
from .kernels.moe_gemm import expert_table
from .routing import ExactRouter, RouterSpec, rank_experts, scale_weights

_MODES = ("off", "lynx", "budget", "lynx-mass")
# CPU tensors take a host path (_select_host: lynx_host compiled; numpy telemetry) that reads them as numpy arrays:
# host memory, so no sync on a CPU. Tests that use CPU tensors as a stand-in for CUDA (counting
# device reads) turn it off to exercise the torch path the GPU runs.
CPU_HOST_PATH = True
# What "on" means: the best trade-off measured on the demo model (benchmarks/results/lynx_sweep.md):
# the mass-capped rule with the strictest critical set (j = 0); at B=16, 28.9% fewer unique experts
# per layer for +0.46% perplexity, 95.3% greedy agreement. The paper's rule with the spec's knobs
# stays available as "lynx" (30.0%, +1.08%, 93.9%).
RECOMMENDED = "lynx-mass:0.2,j=0"
# Order of LynxResult.vec; LynxTelemetry sums these per layer.
_STATS = ("tokens", "decode_tokens", "decode_slots", "unique_before", "unique_after",
          "remapped_slots", "displaced_mass")


@dataclass
class LynxConfig:
    """LYNX knobs. mode: off | on (= RECOMMENDED) | lynx | budget:m | lynx-mass:τ.

    lynx: the paper's rule. budget:m: C = the m best-scoring experts (+ rank-0s), a baseline.
    lynx-mass:τ (0 ≤ τ ≤ 1): lynx, but no token loses more than τ of its top-k prob mass: a token
    gives up its lowest-affinity non-critical slots only while their summed prob stays ≤ τ·mass;
    the slots it keeps join the allowed set (free targets for others). τ = 1 is lynx; τ = 0
    only moves zero-probability slots.
    alpha=None derives α = β / ln(E/K) (bin span ln(E/K)); j = allowed bins below bin 0;
    min_batch: fewer decode tokens (or B < 2) → no batch remap (the residency rule still applies).
    """

    mode: str = "off"
    alpha: Optional[float] = None
    beta: int = 4
    j: int = 1
    protect_top1: bool = True
    skip_layers: tuple[int, ...] = ()
    min_batch: int = 2

    def __post_init__(self) -> None:
        text = self.mode.strip().lower()
        if text == "on":  # the recommended mode and knobs (knobs still at their defaults only)
            text, *knobs = RECOMMENDED.split(",")
            for key, _, val in (k.partition("=") for k in knobs):
                if getattr(self, key) == _DEFAULTS[key]:
                    setattr(self, key, _knob(key, val))
        kind, _, arg = text.partition(":")
        if kind not in _MODES or (arg != "") != (kind in ("budget", "lynx-mass")):
            raise ValueError(f"bad LYNX mode {self.mode!r}: use off, lynx, budget:M, lynx-mass:TAU")
        try:
            val = int(arg) if kind == "budget" else float(arg) if arg else None
        except ValueError:
            raise ValueError(f"bad LYNX mode {self.mode!r}: {arg!r} is not a number") from None
        if (kind == "budget" and val < 1) or (kind == "lynx-mass" and not 0.0 <= val <= 1.0):
            raise ValueError(f"bad LYNX mode {self.mode!r}: need budget m ≥ 1, 0 ≤ τ ≤ 1")
        self.mode, self.kind, self.arg = f"{kind}:{arg}" if arg else kind, kind, val
        self.skip_layers = tuple(int(x) for x in self.skip_layers)
        if self.alpha is not None and not self.alpha > 0:
            raise ValueError(f"LYNX alpha must be > 0, got {self.alpha}")
        if self.beta < 1 or self.j < 0 or self.min_batch < 1:
            raise ValueError("LYNX needs beta ≥ 1, j ≥ 0, min_batch ≥ 1")

    @classmethod
    def parse(cls, text: "str | LynxConfig") -> "LynxConfig":
        """"off", "lynx"/"on", "budget:8", "lynx-mass:0.2", plus ",key=value" knobs, e.g.
        "lynx,j=2,beta=3,protect_top1=false,skip_layers=0+1,min_batch=4"."""
        if isinstance(text, LynxConfig):
            return text
        mode, *knobs = [p.strip() for p in str(text).split(",")]
        if mode.lower() == "on":  # expand, so that knobs given after "on" override the recommended ones
            mode, *rec = RECOMMENDED.split(",")
            knobs = rec + knobs
        names = [f.name for f in fields(cls) if f.name != "mode"]
        kw: dict = {}
        for knob in knobs:
            key, eq, val = (s.strip() for s in knob.partition("="))
            if not eq or key not in names:
                raise ValueError(f"bad LYNX knob {knob!r} in {text!r}; knobs: {', '.join(names)}")
            try:
                kw[key] = _knob(key, val)
            except ValueError:
                raise ValueError(f"bad value for LYNX knob {key}: {val!r}") from None
        return cls(mode=mode, **kw)

    def alpha_for(self, num_experts: int, top_k: int) -> float:
        # Bin span β/α = ln(E/K): the log-prob gap of a "uniform" expert below the top-1.
        return self.alpha if self.alpha is not None else self.beta / math.log(num_experts / top_k)


_DEFAULTS = {f.name: f.default for f in fields(LynxConfig)}


def _knob(key: str, val: str):
    if key == "alpha":
        return None if val.lower() == "none" else float(val)
    if key == "protect_top1":
        if val.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(val)
        return val.lower() in ("true", "1", "yes")
    if key == "skip_layers":
        return tuple(int(x) for x in val.split("+") if x)
    return int(val)


@dataclass
class LynxResult:
    """ids [T, K] int64, weights [T, K] fp32, vec [7] float64 stats (see _STATS; 0-dim views as
    properties, on the logits' device so no host sync), fetch: experts to bring over PCIe
    (used \\ resident, sorted int64) when `resident` was given, else None. displaced_mass sums,
    over decode tokens, the original softmax prob of the experts remapped away. table: the
    expert-major table for moe_gemm (fused_moe(..., table=...)) when the Triton kernel routed."""

    ids: torch.Tensor
    weights: torch.Tensor
    vec: torch.Tensor
    fetch: Optional[torch.Tensor] = None
    table: Optional[dict] = None

    def stats(self) -> dict[str, float]:
        return dict(zip(_STATS, self.vec.tolist()))  # one host sync


for _i, _name in enumerate(_STATS):  # LynxResult.unique_after etc.: views into vec
    setattr(LynxResult, _name, property(lambda self, i=_i: self.vec[i]))


def _any_vote(ids: torch.Tensor, mask: Optional[torch.Tensor], num_experts: int) -> torch.Tensor:
    """bool [E]: experts e with some (t, s) where ids[t, s] == e and mask[t, s] (None: all)."""
    cnt = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    src = torch.ones_like(ids) if mask is None else mask.expand_as(ids).long()
    return cnt.scatter_add_(0, ids.reshape(-1), src.reshape(-1)) > 0


def _levels(z: torch.Tensor, ids: torch.Tensor, alpha: float, beta: int) -> torch.Tensor:
    """z [T, E] logits, ids [T, K] → ⌊α·gap⌋ clamped to [0, β] (bin = −level), int64 [T, K]."""
    zk = z.gather(1, ids)
    gap = (zk[:, :1] - zk).clamp_min(0)  # ≥ 0 even if softmax rounding reordered near-ties
    return torch.floor(gap * alpha).clamp(0, beta).long()


def _exact_ints(rows: int, beta: int) -> bool:
    """Scores stay exact int64 while base^(β+1) < 2^62 for any base ≤ max(rows, 2)."""
    return max(rows, 2) ** (beta + 1) < 2**62


def _scores(lv, ids, num_experts: int, base, beta: int, exact: bool, voters=None):
    """S(e)·base^β = Σ base^(β − level): integer-valued, so sums, thresholds and ties are exact.
    base: int or 0-dim int64 tensor (B counted on the device); voters [T, 1] bool or None (all)."""
    if exact:
        votes = torch.pow(base, (beta - lv))  # int64, no H2D copy
    else:  # float64: rounding only near ties
        votes = torch.pow(base.double() if torch.is_tensor(base) else float(base), (beta - lv).double())
    if voters is not None:
        votes = votes * voters
    s = torch.zeros(num_experts, dtype=votes.dtype, device=lv.device)
    return s.scatter_add_(0, ids.reshape(-1), votes.reshape(-1))


def _rank(score: torch.Tensor) -> torch.Tensor:
    """Expert ids by score, highest first; ties → lower id (stable sort)."""
    return torch.sort(score, descending=True, stable=True).indices


def _pooled_critical(score, base, cfg: LynxConfig) -> torch.Tensor:
    """bool [E]: the batch vote's critical set, before needed/rank-0 experts are added."""
    if cfg.kind == "budget":  # keep the m best-scoring experts (that anyone chose)
        crit = torch.zeros(score.shape, dtype=torch.bool, device=score.device)
        crit[_rank(score)[: cfg.arg]] = True
        return crit & (score > 0)
    # S(e) ≥ B^−j, in units of B^−β; j ≥ β admits every vote
    e = max(cfg.beta - cfg.j, 0)
    thr = torch.pow(base, e) if torch.is_tensor(base) else base**e  # python int: exact
    if score.dtype != torch.int64:
        thr = thr.double() if torch.is_tensor(thr) else float(thr)
    return score >= thr


def _mass_keep(p: torch.Tensor, ids: torch.Tensor, allowed: torch.Tensor, tau: float):
    """lynx-mass:τ. p, ids [T, K] (p = original probs, sorted desc). Each token drops its
    lowest-affinity non-allowed slots only while their summed prob ≤ τ·(its top-k prob mass);
    the other slots are kept, and their experts join the allowed set. Returns bool [E]."""
    drop = ~allowed[ids]
    tail = (p * drop).flip(1).cumsum(1).flip(1)  # mass of droppable slots at this rank and below
    budget = tau * p.sum(1, keepdim=True) * _kernel.MASS_SLACK  # slack: τ = 1 is exactly `lynx`
    return _any_vote(ids, drop & (tail > budget), allowed.numel())


def _pad(allowed: torch.Tensor, score: torch.Tensor, k: int) -> torch.Tensor:
    """If |allowed| < k, add the best-scoring experts outside it until |allowed| = k."""
    order = _rank(score)
    out = ~allowed[order]
    add = out & (out.long().cumsum(0) <= k - allowed.sum())
    return allowed | torch.zeros_like(allowed).scatter_(0, order, add)


def _select_masked(logits, is_decode, spec, cfg, layer, resident, probs) -> LynxResult:
    """lynx_select for families whose rule excludes experts per token (−inf scores)."""
    return _select(logits, is_decode, spec, cfg, layer, resident, probs.float(), torch.isfinite(logits))


def _has_candidate(order, ids, drop, allowed, finite) -> torch.Tensor:
    """[T, K] bool: the token has at least as many allowed finite unchosen experts as the rank of
    this dropped slot among its dropped slots (else that slot must stay)."""
    chosen = torch.zeros(order.shape, dtype=torch.bool, device=ids.device).scatter_(1, ids, True)
    n = (allowed.unsqueeze(0) & finite & ~chosen).sum(1, keepdim=True)  # [T, 1]
    return drop.long().cumsum(1) <= n


def _remap(order: torch.Tensor, ids: torch.Tensor, drop: torch.Tensor, allowed: torch.Tensor):
    """order [T, E] (rank_experts), ids/drop [T, K], allowed [E] → new ids [T, K]. Survivors keep
    their slot; the i-th dropped slot (in slot order) gets the token's i-th best allowed expert
    it did not choose, by the tie rule. Needs |allowed| ≥ K so every token has enough candidates."""
    T, K = ids.shape
    chosen = torch.zeros(order.shape, dtype=torch.bool, device=ids.device).scatter_(1, ids, True)
    cand = (allowed.unsqueeze(0) & ~chosen).gather(1, order)  # candidates in affinity order
    rank = cand.long().cumsum(1) - 1
    rank = torch.where(cand & (rank < K), rank, K)  # non-candidates → spare column K
    fill = torch.zeros(T, K + 1, dtype=ids.dtype, device=ids.device).scatter_(1, rank, order)
    gap_no = (drop.long().cumsum(1) - 1).clamp_min(0)  # which gap of its token this slot is
    return torch.where(drop, fill.gather(1, gap_no), ids)


def _reweight(probs, new, w0, changed, norm: bool) -> torch.Tensor:
    """Original softmax probs of the new experts, rescaled to the original top-k mass M(t)."""
    p = probs.gather(1, new)
    denom = p.sum(1, keepdim=True)
    w = torch.where(denom > 0, p / denom.clamp_min(torch.finfo(p.dtype).tiny), 1.0 / new.shape[1])
    if not norm:
        w = w * w0.sum(1, keepdim=True)  # M(t) = Σ original top-k probs; 1 when renormalised
    return torch.where(changed.unsqueeze(1), w, w0)  # untouched tokens stay bit-exact


def _const(values: list, dev: torch.device) -> torch.Tensor:
    """A small fp64 constant on dev without a blocking H2D copy (which would sync a CUDA stream)."""
    if dev.type == "cpu":
        return torch.tensor(values, dtype=torch.float64)
    return torch.stack([torch.full((), float(v), dtype=torch.float64, device=dev) for v in values])


def _result(E, ids0, ids, weights, n_dec, drop_mass, n_drop, resident) -> LynxResult:
    """n_dec: python number (host phase) or 0-dim tensor; no host sync except `fetch`."""
    dev, (T, K) = ids.device, ids.shape
    u0 = _any_vote(ids0, None, E).sum()
    used = _any_vote(ids, None, E)
    if not torch.is_tensor(n_dec):
        n_dec = torch.full((), float(n_dec), dtype=torch.float64, device=dev)
    full = lambda v: torch.full((), float(v), device=dev)  # noqa: E731
    vec = torch.stack([full(T), n_dec.double(), n_dec.double() * K, u0.double(), used.sum().double(),
                       (n_drop if torch.is_tensor(n_drop) else full(n_drop)).double(),
                       (drop_mass if torch.is_tensor(drop_mass) else full(drop_mass)).double()])
    fetch = None if resident is None else torch.nonzero(used & ~resident).squeeze(1)  # host sync
    return LynxResult(ids, weights, vec, fetch)


def lynx_select(logits: torch.Tensor, is_decode: "bool | torch.Tensor", spec: RouterSpec,
                cfg: Optional[LynxConfig] = None, layer: int = 0,
                resident: Optional[torch.Tensor] = None, probs: Optional[torch.Tensor] = None) -> LynxResult:
    """logits [T, E] fp32; is_decode: a bool (every token has that phase: host decisions) or a
    [T] bool tensor (mixed or unknown: read on the device only); resident [E] bool (on GPU).

    Only decode tokens are remapped; prefill tokens keep exact routing and their experts count
    as needed. Residency (offload): resident experts are free remap targets (C ∪ resident) and
    `fetch` = experts used \\ resident. Below min_batch (e.g. B = 1) there is no batch vote, so
    with `resident` each choice is judged alone: it is critical iff its bin ≥ −j (what one
    vote scores in any batch); a non-critical, non-resident slot (rank-0 excepted if protected)
    moves to the token's best unchosen expert in C ∪ resident. Without `resident` such small
    batches stay exact. No host sync (no .item(), nonzero or Python branch on device values)
    except `fetch` when resident is given. probs [T, E]: where the gate weights come from when the
    family's are not softmax(logits) (routing.py); then a −inf logit (an expert the family's own
    rule excludes for that token) is never a remap target, and a slot with no finite candidate
    left stays where it is.
    """
    if probs is not None:
        return _scaled(_select_masked(logits, is_decode, spec, cfg, layer, resident, probs), spec)
    return _scaled(_select(logits, is_decode, spec, cfg, layer, resident), spec)


def _scaled(r: LynxResult, spec: RouterSpec) -> LynxResult:
    if spec.routed_scaling_factor != 1.0:
        r.weights = scale_weights(r.weights, spec)
    return r


def _select(logits, is_decode, spec: RouterSpec, cfg, layer, resident, probs=None, finite=None) -> LynxResult:
    """lynx_select without the weight scaling. finite [T, E] bool or None: remap targets allowed
    per token (None: all)."""
    cfg = cfg or LynxConfig()
    E, K = spec.num_experts, spec.top_k
    T, dev = logits.shape[0], logits.device
    host = isinstance(is_decode, bool)
    isd = None if host else is_decode.reshape(-1).to(dev, torch.bool, non_blocking=True)
    res = None if resident is None else resident.to(dev, torch.bool, non_blocking=True)
    z = logits.float()
    if probs is None:
        probs = torch.softmax(z, dim=-1, dtype=torch.float32)
    if CPU_HOST_PATH and host and is_decode and res is None and dev.type == "cpu":
        hp = host_params(spec, cfg, layer, T)
        if hp is not None:
            return _select_host(z, probs, hp)  # compiled, same results
    order = rank_experts(z)  # [T, E] the tie rule, shared by top-k and the remap
    ids0 = order[:, :K]
    p0 = probs.gather(1, ids0)  # [T, K] original top-k probs
    w0 = p0 / p0.sum(1, keepdim=True) if spec.norm_topk_prob else p0
    if T == 1 and res is None:
        # One token, no residency: nothing to pool, stats are constants (the chat hot path;
        # skips ~20 small ops per layer).
        if host:
            d = float(is_decode)
            return LynxResult(ids0, w0, _const([1.0, d, d * K, K, K, 0.0, 0.0], dev), None)
        vec = _const([1.0, 0, 0, K, K, 0, 0], dev) + isd.double() * _const([0, 1, K, 0, 0, 0, 0], dev)
        return LynxResult(ids0, w0, vec, None)
    n_dec = (T if is_decode else 0) if host else isd.sum()
    if cfg.kind == "off" or layer in cfg.skip_layers or E <= K or T == 0 or is_decode is False:
        return _result(E, ids0, ids0, w0, n_dec, 0.0, 0.0, res)
    mb = max(cfg.min_batch, 2)  # B = 1 pooled would make every S(e) = 1
    if host:  # all decode: B = T known here
        pooled = T >= mb
        if not (pooled or res is not None):
            return _result(E, ids0, ids0, w0, n_dec, 0.0, 0.0, res)
        base, voters, needed = (T if pooled else 2), None, None
    else:  # mixed: B, pooled and the base stay on the device
        pooled = n_dec >= mb
        base, voters = torch.where(pooled, n_dec, 2), isd.unsqueeze(1)
        needed = _any_vote(ids0, ~voters, E)  # prefill experts are needed
    lv = _levels(z, ids0, cfg.alpha_for(E, K), cfg.beta)
    score = _scores(lv, ids0, E, base, cfg.beta, _exact_ints(T, cfg.beta), voters)
    # a prefill row's own choices are all `needed`, so lone votes and rank-0s need no row mask
    lone = (lambda: _any_vote(ids0, lv <= cfg.j, E)) if res is not None else None  # noqa: E731
    if host:
        crit = _pooled_critical(score, base, cfg) if pooled else lone()
    else:
        crit = _pooled_critical(score, base, cfg)
        crit = crit if lone is None else torch.where(pooled, crit, lone())
    if needed is not None:
        crit = crit | needed
    if cfg.protect_top1:
        crit = crit | _any_vote(ids0[:, :1], None, E)
    allowed = crit if res is None else crit | res  # resident experts are free remap targets
    if cfg.kind == "lynx-mass":
        allowed = allowed | _mass_keep(p0, ids0, allowed, cfg.arg)
    allowed = _pad(allowed, score, K)
    drop = ~allowed[ids0]  # [T, K]; a prefill row never drops (its experts are needed)
    if not host and res is None:
        drop = drop & pooled  # below min_batch nothing moves (a device bool: no sync)
    if finite is not None:  # a slot with no allowed finite candidate left keeps its expert; the
        # others take finite ones, as −inf experts rank after every finite one in `order`
        drop = drop & _has_candidate(order, ids0, drop, allowed, finite)
    new = _remap(order, ids0, drop, allowed)
    weights = _reweight(probs, new, w0, drop.any(1), spec.norm_topk_prob)
    return _result(E, ids0, new, weights, n_dec, (p0 * drop).sum(), drop.sum(), res)


def host_params(spec: RouterSpec, cfg: LynxConfig, layer: int, T: int) -> Optional[tuple]:
    """lynx_host.route's scalar arguments for an all-decode CPU call of T tokens, or None where the
    compiled path does not apply (LYNX off for this layer, E ≤ K, no numba, scores past int64)."""
    E, K = spec.num_experts, spec.top_k
    if (_host.route is None or cfg.kind == "off" or E <= K or layer in cfg.skip_layers
            or T ** (cfg.beta + 1) * K >= 2**62):
        return None
    kind = {"lynx": _host.KIND_LYNX, "budget": _host.KIND_BUDGET, "lynx-mass": _host.KIND_MASS}[cfg.kind]
    return (K, spec.norm_topk_prob, np.float32(cfg.alpha_for(E, K)), cfg.beta, cfg.j, kind,
            np.float32(cfg.arg or 0), cfg.protect_top1, np.float32(_kernel.MASS_SLACK), T >= max(cfg.min_batch, 2))


def native_plan(spec: RouterSpec, hp: tuple):
    """host_params → the same rule as a kernels/native.Route (with the weight scaling), or None
    where the native kernels are not built."""
    if _native.lib() is None:
        return None
    K, norm, alpha, beta, j, kind, arg, protect, slack, pooled = hp
    return _native.Route(K, int(norm), kind, beta, j, int(protect), int(pooled), float(alpha), float(arg),
                         float(slack), float(spec.routed_scaling_factor))


def _select_host(z, probs, hp: tuple) -> LynxResult:
    """lynx_select's all-decode path on CPU tensors in one compiled call (lynx_host.route), after
    the softmax — fewer torch ops than the exact router. Ids and weights bit-identical.
    z, probs [T, E] fp32; hp: host_params(...)."""
    ids, w, vec = _host.route(z.numpy(), probs.numpy(), *hp)
    return LynxResult(torch.from_numpy(ids), torch.from_numpy(w), torch.from_numpy(vec), None)


_KERNEL_MODE = {"off": _kernel.OFF, "lynx": _kernel.LYNX, "budget": _kernel.BUDGET,
                "lynx-mass": _kernel.MASS}


def kernel_args(spec: RouterSpec, cfg: LynxConfig, layer: int = 0) -> dict:
    """RouterSpec + LynxConfig → lynx_route's plain arguments for one layer (the glue)."""
    E, K = spec.num_experts, spec.top_k
    off = cfg.kind == "off" or layer in cfg.skip_layers or E <= K
    return dict(top_k=K, norm=spec.norm_topk_prob, mode=_kernel.OFF if off else _KERNEL_MODE[cfg.kind],
                alpha=1.0 if off else cfg.alpha_for(E, K), beta=cfg.beta, j=cfg.j,
                tau=float(cfg.arg) if cfg.kind == "lynx-mass" else 1.0,
                m=min(int(cfg.arg), E) if cfg.kind == "budget" else 0,
                protect=cfg.protect_top1, min_batch=cfg.min_batch)


def lynx_route_ref(logits, is_decode, spec: RouterSpec, cfg: "LynxConfig | str | None" = None,
                   layer: int = 0):
    """Torch reference of kernels.lynx_route, in its output format: lynx_select +
    moe_gemm.expert_table → (ids, weights, active, counts, token_table, stats)."""
    cfg = LynxConfig.parse(cfg) if cfg is not None else LynxConfig()
    r = lynx_select(logits, is_decode, spec, cfg, layer)
    T, K = r.ids.shape
    A = min(T * K, spec.num_experts)
    i32 = dict(dtype=torch.int32, device=logits.device)
    if T == 0:
        return r.ids, r.weights, torch.empty(0, **i32), torch.zeros(2, **i32), torch.empty(0, **i32), r.vec
    tab = expert_table(r.ids, spec.num_experts)
    active = torch.where(torch.arange(A, device=logits.device) < tab["num_act"], tab["act_e"], -1)
    counts = torch.cat([tab["num_act"], tab["act_start"]])
    return r.ids, r.weights, active.to(torch.int32), counts, tab["slot"], r.vec


class _StepStats(Mapping):
    """One step of a burst in LynxTelemetry.steps: layer → its stat vector [7], read from the burst's
    vec [S, n, 7] when asked (a dict per step cost more than the rest of the step's Python)."""

    def __init__(self, layers: tuple, vec: torch.Tensor, s: int):
        self._layers, self._vec, self._s = layers, vec, s

    def __getitem__(self, layer: int) -> torch.Tensor:
        if layer not in self._layers:
            raise KeyError(layer)
        return self._vec[self._s, self._layers.index(layer)]

    def __iter__(self):
        return iter(self._layers)

    def __len__(self) -> int:
        return len(self._layers)


class LynxTelemetry:
    """Per-layer running sums of LynxResult stats over pure decode calls (every token decode),
    plus the last `history` steps' per-layer stat vectors. No host sync until summary()."""

    def __init__(self, history: int = 256):
        self.steps: deque[dict[int, torch.Tensor]] = deque(maxlen=history)
        self.num_steps = 0
        self._acc: dict[int, torch.Tensor] = {}  # layer → [1 + len(_STATS)] float64
        self._blocks: dict[tuple, np.ndarray] = {}  # layers of one native call → [n, 1 + len(_STATS)] float64
        self._pending: list[tuple[tuple, torch.Tensor]] = []  # record_block's (layers, vec), not summed yet

    def begin_step(self) -> None:
        self.steps.append({})
        self.num_steps += 1

    def record(self, layer: int, result: LynxResult) -> None:
        v = result.vec
        if CPU_HOST_PATH and v.device.type == "cpu":  # host values already: sum in numpy (no torch op per layer)
            vn = v.numpy()
            pure = float(vn[1] == vn[0] and vn[0] > 0)
            if not self.steps:
                self.begin_step()
            self.steps[-1][layer] = v
            acc = self._acc.get(layer)
            if acc is None:
                acc = self._acc[layer] = torch.zeros(1 + len(_STATS), dtype=torch.float64)
            a = acc.numpy()
            a[0] += pure
            a[1:] += vn * pure
            return
        pure = (v[1] == v[0]) & (v[0] > 0)  # a decode step: no prefill token in it
        row = torch.cat([pure.double().reshape(1), v * pure])
        if not self.steps:
            self.begin_step()
        self.steps[-1][layer] = v
        self._acc[layer] = self._acc[layer] + row if layer in self._acc else row

    def record_block(self, layers: tuple, vec: torch.Tensor) -> None:
        """record() for the n layers of one native call at once: vec [n, 7] float64 on the CPU.
        Kept as it is and summed every 256 calls (or at summary()): Python between the native
        calls of a step runs with caches the kernels just flushed, so each op there costs 2–3×."""
        if not self.steps:
            self.begin_step()
        self.steps[-1].update(zip(layers, vec.unbind(0)))
        self._pending.append((layers, vec))
        if len(self._pending) >= 256:
            self._fold()

    def record_burst(self, layers: tuple, vec: torch.Tensor) -> None:
        """record_block() for S decode steps of one native call: vec [S, n, 7] float64 on the CPU; the
        first step is the one in progress (begin_step ran), the other S - 1 are begun here. Their
        per-step views are built on access (_StepStats): per step, the Python of a record_block and a
        begin_step cost the demo 5% of a B = 1 token."""
        self.record_block(layers, vec[0])  # the step in progress
        S = vec.shape[0]
        if S == 1:
            return
        for s in range(max(1, S - (self.steps.maxlen or S)), S):
            self.steps.append(_StepStats(layers, vec, s))
        self.num_steps += S - 1
        self._pending.append((layers, vec[1:]))

    def _fold(self) -> None:
        """Sum the pending blocks into their layers' running sums (pure decode calls only)."""
        by_key: dict[tuple, list] = {}
        for layers, vec in self._pending:
            by_key.setdefault(layers, []).append(vec.view(-1, *vec.shape[-2:]))  # [n, 7] or a burst's [S, n, 7]
        self._pending.clear()
        for layers, vecs in by_key.items():
            vn = torch.cat(vecs).numpy()  # [steps, n, 7]
            pure = ((vn[..., 1] == vn[..., 0]) & (vn[..., 0] > 0)).astype(np.float64)  # [steps, n]
            blk = self._blocks.get(layers)
            if blk is None:
                blk = self._blocks[layers] = np.zeros((len(layers), 1 + len(_STATS)))
            blk[:, 0] += pure.sum(0)
            blk[:, 1:] += (vn * pure[..., None]).sum(0)

    def summary(self) -> dict:
        """Means per MoE layer per decode step; per_layer: layer → (unique before, after)."""
        self._fold()
        sums = {ly: a.cpu().numpy().copy() for ly, a in self._acc.items()}
        for key, blk in self._blocks.items():
            for layer, row in zip(key, blk):
                sums[layer] = sums[layer] + row if layer in sums else row.copy()
        layers = sorted(sums)
        acc = [sums[ly].tolist() for ly in layers]
        tot = [sum(col) for col in zip(*acc)] or [0.0] * (1 + len(_STATS))
        n, d = tot[0], dict(zip(_STATS, tot[1:]))
        ub, ua = 1 + _STATS.index("unique_before"), 1 + _STATS.index("unique_after")
        div = lambda a, b: a / b if b else 0.0  # noqa: E731
        before, after = div(d["unique_before"], n), div(d["unique_after"], n)
        return {
            "steps": self.num_steps,
            "decode_layer_steps": int(n),
            "unique_before": before,
            "unique_after": after,
            "reduction_pct": 100.0 * div(before - after, before),
            "remap_rate_pct": 100.0 * div(d["remapped_slots"], d["decode_slots"]),
            "displaced_mass_per_token": div(d["displaced_mass"], d["decode_tokens"]),
            "per_layer": {ly: (div(r[ub], r[0]), div(r[ua], r[0])) for ly, r in zip(layers, acc)},
        }

    def clear(self) -> None:
        self.steps.clear()
        self.num_steps = 0
        self._acc.clear()
        self._blocks.clear()
        self._pending.clear()


class LynxRouter:
    """Routing hook: route(logits [T, E], is_decode [T], layer) → (ids [T, K], weights [T, K]).

    Runs the Triton kernel (one launch, no host sync, plus the GEMM's expert-major table in
    `last.table`) when `use_triton` and the shape fits, lynx_select otherwise. use_triton is
    decided once: at construction from `device`, else at the first call from the logits' device.
    begin_step(is_decode) gives the phase of the next forward from the host (a Python bool);
    with it, all-prefill forwards skip LYNX and all-decode ones take their branches on the host.
    resident: optional layer → bool [E] (or None) callback from the offload cache (torch path);
    the result of the latest call (with its fetch list) is kept in `last` for the MoE block.
    """

    def __init__(self, spec: RouterSpec, cfg: "LynxConfig | str" = "lynx",
                 telemetry: Optional[LynxTelemetry] = None,
                 resident: Optional[Callable[[int], Optional[torch.Tensor]]] = None,
                 device: "torch.device | str | None" = None):
        self.spec, self.cfg = spec, LynxConfig.parse(cfg)
        self.telemetry = telemetry if telemetry is not None else LynxTelemetry()
        self.resident = resident
        self._last: Optional[LynxResult] = None
        self._last_block: Optional[tuple] = None
        self.phase: Optional[bool] = None  # of the forward in progress, from begin_step
        self.use_triton: Optional[bool] = None if device is None else _kernel.available(device)
        self._args: dict[int, dict] = {}  # layer → kernel_args
        self._host: dict[tuple, Optional[tuple]] = {}  # (layer, T) → host_params
        self._exact = ExactRouter(spec)  # all-prefill CPU forwards (exact by the spec)

    def begin_step(self, is_decode: Optional[bool] = None) -> None:
        self.phase = None if is_decode is None else bool(is_decode)
        self.telemetry.begin_step()

    def _host_plan(self, layer: int, T: int) -> tuple:
        """(host_params, kernels/native.Route or None) for an all-decode CPU call of T tokens, cached."""
        got = self._host.get((layer, T))
        if got is None:
            hp = host_params(self.spec, self.cfg, layer, T)
            got = self._host[(layer, T)] = (hp, None if hp is None else native_plan(self.spec, hp))
        return got

    def native_plan(self, layer: int, T: int):
        """The native decode layer asks before it runs: the Route that routes its T tokens here, or
        None (this call must come back through __call__: not an all-decode CPU step, offload, …)."""
        if self.use_triton is None:
            self.use_triton = _kernel.available(torch.device("cpu"))
        if self.phase is not True or self.resident is not None or self.use_triton or not CPU_HOST_PATH:
            return None
        return self._host_plan(layer, T)[1]

    def native_done(self, layers: tuple, ids: torch.Tensor, weights: torch.Tensor, vec: torch.Tensor) -> None:
        """What __call__ records, for the layers one native call routed with native_plan: ids,
        weights [n, B, K], vec [n, 7]. `last` is the last layer's result."""
        self._last, self._last_block = None, (ids, weights, vec)  # `last` built if asked for
        self.telemetry.record_block(layers, vec)

    def native_done_burst(self, layers: tuple, ids: torch.Tensor, weights: torch.Tensor, vec: torch.Tensor) -> None:
        """native_done for S decode steps of one greedy burst: ids, weights [S, n, B, K], vec [S, n, 7];
        the first step begun by the caller, the rest all decode (the phase stays True)."""
        self._last, self._last_block = None, (ids[-1], weights[-1], vec[-1])
        self.telemetry.record_burst(layers, vec)

    @property
    def last(self) -> Optional[LynxResult]:
        """The result of the latest call (of the last layer, after a native block)."""
        if self._last_block is not None:
            ids, w, vec = self._last_block
            self._last, self._last_block = LynxResult(ids[-1], w[-1], vec[-1], None), None
        return self._last

    @last.setter
    def last(self, r: Optional[LynxResult]) -> None:
        self._last, self._last_block = r, None

    def __call__(self, logits: torch.Tensor, is_decode: torch.Tensor, layer: int, probs=None):
        res = self.resident(layer) if self.resident is not None else None
        if self.use_triton is None:
            self.use_triton = _kernel.available(logits.device)
        phase = is_decode if self.phase is None else self.phase
        T, E = logits.shape
        a = self._args.get(layer)
        if a is None:
            a = self._args[layer] = kernel_args(self.spec, self.cfg, layer)
        # the kernel computes softmax weights itself: families with their own probs take the torch path
        if (self.use_triton and res is None and probs is None and phase is not False
                and _kernel.fits(T, E, a["top_k"], a["mode"], a["beta"])):
            mask = is_decode if torch.is_tensor(is_decode) else torch.full((T,), bool(phase), device=logits.device)
            ids, w, active, counts, table, vec = _kernel.lynx_route(logits, mask, **a)
            r = LynxResult(ids, scale_weights(w, self.spec), vec, None,
                           _kernel.gemm_table(active, counts, table, a["top_k"]))
        elif phase is True and res is None and not self.use_triton and CPU_HOST_PATH and logits.device.type == "cpu":
            # the CPU decode hot path: straight to the compiled call, its scalars cached per (layer, T)
            hp, plan = self._host_plan(layer, T)
            z = logits.float()
            if hp is None:
                r = lynx_select(z, True, self.spec, self.cfg, layer, None, probs)
            elif plan is not None and probs is None:  # one native call, the softmax inside
                r = LynxResult(*_native.route(z.contiguous(), plan), None)
            else:
                p = torch.softmax(z, dim=-1, dtype=torch.float32) if probs is None else probs.float()
                r = _scaled(_select_host(z, p, hp), self.spec)
        elif phase is False and res is None and probs is None and logits.device.type == "cpu":
            # an all-prefill CPU forward is exact: the exact router's own call (one native call),
            # so a prompt routes bit-identically with LYNX on and off and costs what it costs off
            # (lynx_select's torch ops made the demo's prefill 4-10% slower with LYNX on)
            ids, w, vec = self._exact.route_with_stats(logits.float(), layer)
            if vec is None:
                r = _result(E, ids, ids, w, 0, 0.0, 0.0, None)
            else:
                vec[1] = vec[2] = 0.0  # its stats count every token as decode: none is
                r = LynxResult(ids, w, vec, None)
        else:
            r = lynx_select(logits, phase, self.spec, self.cfg, layer, res, probs)
        self.last = r
        self.telemetry.record(layer, r)
        return r.ids, r.weights
