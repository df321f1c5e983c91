"""LYNX batch-aware expert selection (torch reference; also the CPU runtime path).

Per MoE layer and decode step: bin each token's top-k choices by their logit gap to its top-1
(AffinityBinning), score experts over the batch S(e) = Σ B^bin, keep the critical set
C = {S ≥ B^-j} ∪ rank-0s ∪ prefill experts, and remap the other slots to each token's next-best
expert in C (∪ GPU-resident experts when offloading). Gate weights keep the token's top-k mass.
Modes: off | lynx | budget:m | lynx-mass:τ. Glossary: T tokens, E experts, K top-k, B decode tokens.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, fields
from typing import Callable, Optional

import torch

from .routing import RouterSpec, exact_route

_MODES = ("off", "lynx", "budget", "lynx-mass")
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
    over decode tokens, the original softmax prob of the experts remapped away."""

    ids: torch.Tensor
    weights: torch.Tensor
    vec: torch.Tensor
    fetch: Optional[torch.Tensor] = None

    def stats(self) -> dict[str, float]:
        return dict(zip(_STATS, self.vec.tolist()))  # one host sync


for _i, _name in enumerate(_STATS):  # LynxResult.unique_after etc.: views into vec
    setattr(LynxResult, _name, property(lambda self, i=_i: self.vec[i]))


def _any_vote(ids: torch.Tensor, mask: torch.Tensor, num_experts: int) -> torch.Tensor:
    """bool [E]: experts e with some (t, s) where ids[t, s] == e and mask[t, s] (no host sync)."""
    cnt = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    return cnt.scatter_add_(0, ids.reshape(-1), mask.reshape(-1).long()) > 0


def _levels(z: torch.Tensor, ids: torch.Tensor, alpha: float, beta: int) -> torch.Tensor:
    """z [B, E] logits, ids [B, K] → ⌊α·gap⌋ clamped to [0, β] (bin = −level), int64 [B, K]."""
    zk = z.gather(1, ids)
    gap = (zk[:, :1] - zk).clamp_min(0)  # ≥ 0 even if softmax rounding reordered near-ties
    return torch.floor(gap * alpha).clamp(0, beta).long()


def _scores(lv: torch.Tensor, ids: torch.Tensor, num_experts: int, base: int, beta: int):
    """S(e)·base^β = Σ base^(β − level): integer-valued, so sums, thresholds and ties are exact."""
    exact = base ** (beta + 1) < 2**62  # else float64: rounding only near ties
    dt = torch.int64 if exact else torch.float64
    votes = torch.pow(base if exact else float(base), (beta - lv).to(dt))  # no H2D copy
    s = torch.zeros(num_experts, dtype=dt, device=lv.device)
    return s.scatter_add_(0, ids.reshape(-1), votes.reshape(-1))


def _rank(score: torch.Tensor) -> torch.Tensor:
    """Expert ids by score, highest first; ties → lower id (stable sort)."""
    return torch.sort(score, descending=True, stable=True).indices


def _critical(score, lv, ids_d, needed, base, cfg: LynxConfig, pooled: bool) -> torch.Tensor:
    """bool [E]: critical set C. lv, ids_d [B, K] of decode tokens; needed [E]: prefill experts."""
    E = score.numel()
    if not pooled:  # lone votes: a choice is critical iff its bin ≥ −j (as one vote is, for any B)
        crit = _any_vote(ids_d, lv <= cfg.j, E)
    elif cfg.kind == "budget":  # keep the m best-scoring experts (that anyone chose)
        crit = torch.zeros(E, dtype=torch.bool, device=score.device)
        crit[_rank(score)[: cfg.arg]] = True
        crit &= score > 0
    else:  # S(e) ≥ B^−j, in units of B^−β; j ≥ β admits every vote
        thr = base ** max(cfg.beta - cfg.j, 0)  # python int: exact, may exceed int64
        crit = score >= (thr if score.dtype == torch.int64 else float(thr))
    crit |= needed
    if cfg.protect_top1:
        crit[ids_d[:, 0]] = True
    return crit


def _mass_keep(p: torch.Tensor, ids_d: torch.Tensor, allowed: torch.Tensor, tau: float):
    """lynx-mass:τ. p, ids_d [B, K] (p = original probs, sorted desc). Each token drops its
    lowest-affinity non-allowed slots only while their summed prob ≤ τ·(its top-k prob mass);
    the other slots are kept, and their experts join the allowed set. Returns bool [E]."""
    drop = ~allowed[ids_d]
    tail = (p * drop).flip(1).cumsum(1).flip(1)  # mass of droppable slots at this rank and below
    budget = tau * p.sum(1, keepdim=True) * (1 + 1e-6)  # slack: τ = 1 is exactly `lynx`
    return _any_vote(ids_d, drop & (tail > budget), allowed.numel())


def _pad(allowed: torch.Tensor, score: torch.Tensor, k: int) -> torch.Tensor:
    """If |allowed| < k, add the best-scoring experts outside it until |allowed| = k."""
    order = _rank(score)
    out = ~allowed[order]
    add = out & (out.long().cumsum(0) <= k - allowed.sum())
    return allowed | torch.zeros_like(allowed).scatter_(0, order, add)


def _remap(z: torch.Tensor, ids: torch.Tensor, drop: torch.Tensor, allowed: torch.Tensor):
    """z [B, E], ids/drop [B, K], allowed [E] → new ids [B, K]. Survivors keep their slot; the
    i-th dropped slot (in slot order) gets the token's i-th best allowed expert it did not choose,
    by logit, ties → lower id. Needs |allowed| ≥ K so every token has enough candidates."""
    B, K = ids.shape
    chosen = torch.zeros_like(z, dtype=torch.bool).scatter_(1, ids, True)
    order = torch.sort(z, dim=1, descending=True, stable=True).indices  # [B, E]
    cand = (allowed.unsqueeze(0) & ~chosen).gather(1, order)  # candidates in affinity order
    rank = cand.long().cumsum(1) - 1
    rank = torch.where(cand & (rank < K), rank, K)  # non-candidates → spare column K
    fill = torch.zeros(B, K + 1, dtype=ids.dtype, device=ids.device).scatter_(1, rank, order)
    gap_no = (drop.long().cumsum(1) - 1).clamp_min(0)  # which gap of its token this slot is
    return torch.where(drop, fill.gather(1, gap_no), ids)


def _reweight(probs_d, new, w0_d, changed, norm: bool) -> torch.Tensor:
    """Original softmax probs of the new experts, rescaled to the original top-k mass M(t)."""
    p = probs_d.gather(1, new)
    denom = p.sum(1, keepdim=True)
    w = torch.where(denom > 0, p / denom.clamp_min(torch.finfo(p.dtype).tiny), 1.0 / new.shape[1])
    if not norm:
        w = w * w0_d.sum(1, keepdim=True)  # M(t) = Σ original top-k probs; 1 when renormalised
    return torch.where(changed.unsqueeze(1), w, w0_d)  # untouched tokens stay bit-exact


def _result(E, ids0, ids, weights, isd, drop_mass, n_drop, resident) -> LynxResult:
    u0 = _any_vote(ids0, torch.ones_like(ids0, dtype=torch.bool), E).sum()
    used = _any_vote(ids, torch.ones_like(ids, dtype=torch.bool), E)
    n_dec = isd.sum()
    vec = torch.stack([torch.full((), ids.shape[0], device=ids.device), n_dec,
                       n_dec * ids.shape[1], u0, used.sum(), n_drop, drop_mass]).double()
    fetch = None if resident is None else torch.nonzero(used & ~resident).squeeze(1)
    return LynxResult(ids, weights, vec, fetch)


def lynx_select(logits: torch.Tensor, is_decode: torch.Tensor, spec: RouterSpec,
                cfg: Optional[LynxConfig] = None, layer: int = 0,
                resident: Optional[torch.Tensor] = None) -> LynxResult:
    """logits [T, E] fp32, is_decode [T] bool, resident [E] bool (on GPU / fetched this step).

    Only decode tokens are remapped; prefill tokens keep exact routing and their experts count
    as needed. Residency (offload): resident experts are free remap targets (C ∪ resident) and
    `fetch` = experts used \\ resident. Below min_batch (e.g. B = 1) there is no batch vote, so
    with `resident` each choice is judged alone: it is critical iff its bin ≥ −j (what one
    vote scores in any batch); a non-critical, non-resident slot (rank-0 excepted if protected)
    moves to the token's best unchosen expert in C ∪ resident. Without `resident` such small
    batches stay exact. Host syncs: nonzero(is_decode) (free if it is on the CPU) and `fetch`.
    """
    cfg = cfg or LynxConfig()
    E, K = spec.num_experts, spec.top_k
    ids0, w0 = exact_route(logits, spec)
    dev = logits.device
    if logits.shape[0] == 1 and resident is None:
        # One token, no residency: nothing to pool, stats are constants (the chat hot path;
        # skips ~20 small ops per layer).
        d = float(bool(is_decode.reshape(-1)[0]))
        vec = torch.tensor([1.0, d, d * K, K, K, 0.0, 0.0], dtype=torch.float64, device=dev)
        return LynxResult(ids0, w0, vec, None)
    # non_blocking: a blocking H2D copy would synchronise the stream (masks usually live on CPU)
    isd = is_decode.reshape(-1).to(dev, torch.bool, non_blocking=True)
    res = None if resident is None else resident.to(dev, torch.bool, non_blocking=True)
    zero = torch.zeros((), device=dev)
    if cfg.kind == "off" or layer in cfg.skip_layers or E <= K or logits.shape[0] == 0:
        return _result(E, ids0, ids0, w0, isd, zero, zero, res)
    # The one host sync per call (free if is_decode lives on the CPU, as the scheduler has it).
    dec = torch.nonzero(is_decode.reshape(-1)).squeeze(1).to(dev, non_blocking=True)
    B = dec.numel()
    pooled = B >= max(cfg.min_batch, 2)  # B = 1 pooled would make every S(e) = 1
    if B == 0 or not (pooled or res is not None):
        return _result(E, ids0, ids0, w0, isd, zero, zero, res)
    pure = B == logits.shape[0]  # all decode (the common case): skip the row gathers
    rows = (lambda x: x) if pure else (lambda x: x.index_select(0, dec))  # noqa: E731
    z, ids_d = rows(logits).float(), rows(ids0)  # [B, E], [B, K]
    probs_d = torch.softmax(z, dim=-1, dtype=torch.float32)
    lv = _levels(z, ids_d, cfg.alpha_for(E, K), cfg.beta)
    base = B if pooled else 2  # unpooled: order (for padding) by Σ 2^bin
    score = _scores(lv, ids_d, E, base, cfg.beta)
    needed = _any_vote(ids0, ~isd.unsqueeze(1).expand_as(ids0), E)  # prefill experts are needed
    allowed = _critical(score, lv, ids_d, needed, base, cfg, pooled)
    if res is not None:
        allowed = allowed | res  # resident experts are free remap targets
    if cfg.kind == "lynx-mass":
        allowed = allowed | _mass_keep(probs_d.gather(1, ids_d), ids_d, allowed, cfg.arg)
    allowed = _pad(allowed, score, K)
    drop = ~allowed[ids_d]  # [B, K]
    new = _remap(z, ids_d, drop, allowed)
    w_d = _reweight(probs_d, new, rows(w0), drop.any(1), spec.norm_topk_prob)
    ids = new if pure else ids0.index_copy(0, dec, new)
    weights = w_d if pure else w0.index_copy(0, dec, w_d)
    drop_mass = (probs_d.gather(1, ids_d) * drop).sum()
    return _result(E, ids0, ids, weights, isd, drop_mass, drop.sum(), res)


class LynxTelemetry:
    """Per-layer running sums of LynxResult stats over pure decode calls (every token decode),
    plus the last `history` steps' per-layer stat vectors. No host sync until summary()."""

    def __init__(self, history: int = 256):
        self.steps: deque[dict[int, torch.Tensor]] = deque(maxlen=history)
        self.num_steps = 0
        self._acc: dict[int, torch.Tensor] = {}  # layer → [1 + len(_STATS)] float64

    def begin_step(self) -> None:
        self.steps.append({})
        self.num_steps += 1

    def record(self, layer: int, result: LynxResult) -> None:
        v = result.vec
        pure = (v[1] == v[0]) & (v[0] > 0)  # a decode step: no prefill token in it
        row = torch.cat([pure.double().reshape(1), v * pure])
        if not self.steps:
            self.begin_step()
        self.steps[-1][layer] = v
        self._acc[layer] = self._acc[layer] + row if layer in self._acc else row

    def summary(self) -> dict:
        """Means per MoE layer per decode step; per_layer: layer → (unique before, after)."""
        layers = sorted(self._acc)
        acc = [self._acc[ly].cpu().tolist() for ly in layers]
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


class LynxRouter:
    """Routing hook: route(logits [T, E], is_decode [T], layer) → (ids [T, K], weights [T, K]).

    resident: optional layer → bool [E] (or None) callback from the offload cache; the result of
    the latest call (with its fetch list) is kept in `last` for the MoE block that asked.
    """

    def __init__(self, spec: RouterSpec, cfg: "LynxConfig | str" = "lynx",
                 telemetry: Optional[LynxTelemetry] = None,
                 resident: Optional[Callable[[int], Optional[torch.Tensor]]] = None):
        self.spec, self.cfg = spec, LynxConfig.parse(cfg)
        self.telemetry = telemetry if telemetry is not None else LynxTelemetry()
        self.resident = resident
        self.last: Optional[LynxResult] = None

    def begin_step(self) -> None:
        self.telemetry.begin_step()

    def __call__(self, logits: torch.Tensor, is_decode: torch.Tensor, layer: int):
        res = self.resident(layer) if self.resident is not None else None
        self.last = r = lynx_select(logits, is_decode, self.spec, self.cfg, layer, res)
        self.telemetry.record(layer, r)
        return r.ids, r.weights
