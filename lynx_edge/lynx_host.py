"""LYNX's all-decode selection on the CPU as one compiled call (numba), for the decode hot path.

lynx.lynx_select in torch issues ~120 tiny ops per MoE layer; on a CPU each costs ~5 µs, so a
demo decode step spent a quarter of its time choosing experts. `decide` makes every integer and
boolean decision of the pooled path (exact top-k, levels, batch scores, critical set, mass cap,
padding, remap, counts) in compiled loops over the [T, K] choices, with the same arithmetic as
the torch reference: levels from fp32 gaps, integer scores, float64 mass tails rounded to fp32,
ties by higher score then lower id; `reweight` rescales the gate weights with fp32 row sums left to right,
torch's CPU order for rows of K < one vector. Ids and weights are bit-identical to lynx_select
(tests/test_cpu_path.py); the displaced-mass statistic is summed in float64.
`decide` is None when numba is not installed; lynx_select then takes its torch path.
"""
from __future__ import annotations

import numpy as np

try:  # numba is a dependency on the platforms it ships wheels for; elsewhere: the torch path
    from numba import njit
except ImportError:  # pragma: no cover
    njit = None

KIND_LYNX, KIND_BUDGET, KIND_MASS = 0, 1, 2


def _best(key, skip, allowed):
    """The position of the highest key among allowed, unskipped positions; equal keys → lower
    position (the tie rule of routing.rank_experts); −1 when none. allowed None: all."""
    best = -1
    for e in range(key.shape[0]):
        if skip[e] or (allowed is not None and not allowed[e]):
            continue
        if best < 0 or key[e] > key[best]:  # strictly greater: a tie keeps the lower position
            best = e
    return best


def _topk(z, K, ids):
    """ids [T, K] = each row's top-K by the tie rule, best first (K passes of a max: for K ≪ E
    cheaper than sorting the row, and a trivial compile)."""
    T, E = z.shape
    skip = np.zeros(E, np.bool_)
    for t in range(T):
        for s in range(K):
            e = _best(z[t], skip, None)
            ids[t, s] = e
            skip[e] = True
        for s in range(K):
            skip[ids[t, s]] = False


def _ranked(score, m, allowed, out):
    """Mark in `out` the m best-scoring positions not yet in `allowed` (ties → lower position)."""
    skip = allowed.copy()
    for _ in range(m):
        e = _best(score, skip, None)
        if e < 0:
            return
        out[e] = True
        skip[e] = True


def _decide(z, ids0, p0, s0, alpha, beta, j, kind, arg, protect, slack):
    """z [T, E] fp32 scores, ids0 [T, K] int64 the exact top-k (best first), p0 [T, K] fp32 their
    probs, s0 [T] fp32 the probs' row sums; alpha, arg, slack fp32 scalars.
    → new ids [T, K] int64, drop [T, K] bool, (changed rows, unique before, unique after, drops)."""
    T, E = z.shape
    K = ids0.shape[1]
    score = np.zeros(E, np.int64)  # S(e)·T^β: integer votes T^(β − level)
    zero = np.float32(0.0)
    for t in range(T):
        top = z[t, ids0[t, 0]]
        for s in range(K):
            gap = top - z[t, ids0[t, s]]
            if gap < zero:
                gap = zero
            lv = min(max(int(np.floor(gap * alpha)), 0), beta)
            score[ids0[t, s]] += T ** (beta - lv)
    allowed = np.zeros(E, np.bool_)
    if kind == KIND_BUDGET:  # the m best-scoring experts that anyone chose
        _ranked(score, min(int(arg), E), allowed, allowed)
        for e in range(E):
            allowed[e] = allowed[e] and score[e] > 0
    else:
        thr = T ** max(beta - j, 0)
        for e in range(E):
            allowed[e] = score[e] >= thr
    if protect:
        for t in range(T):
            allowed[ids0[t, 0]] = True
    if kind == KIND_MASS:  # keep slots while the droppable tail outweighs τ·(top-k mass)
        keep = np.zeros(E, np.bool_)
        for t in range(T):
            budget = arg * s0[t] * slack
            acc = 0.0  # float64, as torch's CPU cumsum accumulates
            for s in range(K - 1, -1, -1):
                e = ids0[t, s]
                if not allowed[e]:
                    acc += np.float64(p0[t, s])
                    if np.float32(acc) > budget:
                        keep[e] = True
        for e in range(E):
            allowed[e] = allowed[e] or keep[e]
    need = K - allowed.sum()
    if need > 0:  # pad with the best-scoring experts outside, until |allowed| = K
        _ranked(score, need, allowed, allowed)
    new = ids0.copy()
    drop = np.zeros((T, K), np.bool_)
    taken = np.zeros(E, np.bool_)
    changed = n_drop = 0
    for t in range(T):
        gaps = 0
        for s in range(K):
            taken[ids0[t, s]] = True
        for s in range(K):  # the i-th dropped slot takes the token's i-th best allowed unchosen expert
            if not allowed[ids0[t, s]]:
                e = _best(z[t], taken, allowed)
                if e < 0 or z[t, e] == -np.inf:  # no allowed expert the family's rule admits: stays
                    continue
                drop[t, s] = True
                new[t, s] = e
                taken[e] = True
                gaps += 1
        for s in range(K):
            taken[ids0[t, s]] = False
            taken[new[t, s]] = False
        if gaps:
            changed += 1
            n_drop += gaps
    seen0 = np.zeros(E, np.bool_)
    seen1 = np.zeros(E, np.bool_)
    for t in range(T):
        for s in range(K):
            seen0[ids0[t, s]] = True
            seen1[new[t, s]] = True
    return new, drop, (changed, seen0.sum(), seen1.sum(), n_drop)


def _reweight(probs, p0, w0, new, drop, norm):
    """Gate weights after the remap: a changed token's new experts get their original probs,
    rescaled to its original top-k mass (1 when renormalised); untouched tokens keep w0.
    Row sums run left to right in fp32 — torch's CPU order for rows shorter than a vector.
    → weights [T, K] fp32, displaced mass (sum of the dropped slots' original probs)."""
    T, K = new.shape
    w = w0.copy()
    mass = 0.0  # float64: a telemetry sum, more exact than any fp32 order
    for t in range(T):
        moved = False
        for s in range(K):
            if drop[t, s]:
                moved = True
                mass += p0[t, s]
        if not moved:
            continue
        denom = np.float32(0.0)
        for s in range(K):
            denom += probs[t, new[t, s]]
        m = np.float32(0.0)
        for s in range(K):
            m += w0[t, s]
        for s in range(K):
            x = probs[t, new[t, s]] / denom if denom > 0 else np.float32(1.0 / K)
            w[t, s] = x if norm else x * m
    return w, mass


def _route(z, probs, K, norm, alpha, beta, j, kind, arg, protect, slack, pooled):
    """The whole pooled all-decode selection from scores and probs [T, E] fp32 (torch's softmax):
    the exact top-k (routing.exact_route's choice and weights; renormalised with a left-to-right
    fp32 sum when norm), then — when `pooled` (the batch is at least min_batch) — decide + reweight.
    → ids [T, K] int64, weights [T, K] fp32, stats (T, T, T·K, unique before, after, drops, mass)."""
    T, E = z.shape
    ids0 = np.empty((T, K), np.int64)
    _topk(z, K, ids0)
    p0 = np.empty((T, K), np.float32)
    w0 = np.empty((T, K), np.float32)
    s0 = np.empty(T, np.float32)
    for t in range(T):
        acc = np.float32(0.0)
        for s in range(K):
            p0[t, s] = probs[t, ids0[t, s]]
            acc += p0[t, s]
        s0[t] = acc
        for s in range(K):
            w0[t, s] = p0[t, s] / acc if norm else p0[t, s]
    if not pooled:  # below min_batch there is no batch vote: exact routing
        seen = np.zeros(E, np.bool_)
        for t in range(T):
            for s in range(K):
                seen[ids0[t, s]] = True
        u = seen.sum()
        return ids0, w0, np.array([T, T, T * K, u, u, 0.0, 0.0])
    new, drop, (changed, u0, u1, n_drop) = _decide(z, ids0, p0, s0, alpha, beta, j, kind, arg, protect, slack)
    if changed == 0:
        return new, w0, np.array([T, T, T * K, u0, u0, 0.0, 0.0])
    w, mass = _reweight(probs, p0, w0, new, drop, norm)
    return new, w, np.array([T, T, T * K, u0, u1, n_drop, mass])


if njit is not None:
    _best = njit(cache=True, nogil=True)(_best)
    _topk = njit(cache=True, nogil=True)(_topk)
    _ranked = njit(cache=True, nogil=True)(_ranked)
    _decide = njit(cache=True, nogil=True)(_decide)
    _reweight = njit(cache=True, nogil=True)(_reweight)
    route = njit(cache=True, nogil=True)(_route)
else:  # pragma: no cover
    route = None
