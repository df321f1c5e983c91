"""LYNX expert selection: hand-computed spec examples, a slow pure-Python reference compared on
random router logits (hypothesis), invariants, config parsing and telemetry."""
from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lynx_edge.lynx import (
    LynxConfig, LynxRouter, LynxTelemetry, _levels, _pooled_critical, _scores, lynx_select,
)
from lynx_edge.routing import ExactRouter, RouterSpec, exact_route

# Hand example: 4 decode tokens, 6 experts, top-2. α = 4/ln(3) ≈ 3.641, so level = ⌊3.641·gap⌋.
Z = torch.tensor([
    [2.0, 1.9, 0.0, -0.5, -1.0, -2.0],  # top (0, 1), gap 0.1 → level 0
    [2.0, 0.5, 1.6, 0.0, -1.0, -1.5],  # top (0, 2), gap 0.4 → level 1
    [0.5, 2.0, 0.5, 1.3, 0.0, -1.0],  # top (1, 3), gap 0.7 → level 2; e0 and e2 tie below
    [-2.0, 1.0, -1.5, -1.8, -1.0, -3.0],  # top (1, 4), gap 2.0 → level 4 (= β, saturated)
])
DEC = torch.ones(4, dtype=torch.bool)


def _p(t: int) -> list[float]:
    """Softmax of Z[t] in float64, by hand."""
    ex = [math.exp(float(v)) for v in Z[t]]
    return [e / sum(ex) for e in ex]


def _expect_w(t, new, old, norm):
    p = _p(t)
    mass = 1.0 if norm else sum(p[e] for e in old)
    return [p[e] / sum(p[e] for e in new) * mass for e in new]


def test_hand_bins_scores_critical():
    spec = RouterSpec(6, 2, norm_topk_prob=False)
    cfg = LynxConfig("lynx")
    ids0, _ = exact_route(Z, spec)
    assert ids0.tolist() == [[0, 1], [0, 2], [1, 3], [1, 4]]
    assert cfg.alpha_for(6, 2) == pytest.approx(4 / math.log(3))
    lv = _levels(Z, ids0, cfg.alpha_for(6, 2), 4)
    assert lv.tolist() == [[0, 0], [0, 1], [0, 2], [0, 4]]  # bins = −levels
    s = _scores(lv, ids0, 6, 4, 4, exact=True)  # S·4^4: e0 = 1+1, e1 = 1+1+1, e2 = 4^-1, e3 = 4^-2, e4 = 4^-4
    assert s.tolist() == [512, 768, 64, 16, 1, 0]
    crit = _pooled_critical(s, 4, cfg)  # S ≥ 4^-1
    assert crit.tolist() == [True, True, True, False, False, False]
    # the same with B counted on the device (mixed-phase path): a 0-dim base, one voter masked out
    s_dev = _scores(lv, ids0, 6, torch.tensor(4), 4, exact=True, voters=torch.tensor([[1], [1], [1], [0]]).bool())
    assert s_dev.tolist() == [512, 512, 64, 16, 0, 0]  # t3 (e1 at level 0, e4) no longer votes
    assert _pooled_critical(s_dev, torch.tensor(4), cfg).tolist() == crit.tolist()


@pytest.mark.parametrize("norm", [False, True])
def test_hand_lynx_remap_and_weights(norm):
    spec = RouterSpec(6, 2, norm_topk_prob=norm, num_shared_experts=1)
    r = lynx_select(Z, DEC, spec, LynxConfig("lynx"))
    # t2: e3 dropped → best of {e0, e2} (tie 0.5 → lower id e0); t3: e4 → e2 (−1.5 > −2.0).
    assert r.ids.tolist() == [[0, 1], [0, 2], [1, 0], [1, 2]]
    ids0, w0 = exact_route(Z, spec)
    assert torch.equal(r.weights[:2], w0[:2])  # untouched tokens: bit-exact
    for t, new, old in [(2, [1, 0], [1, 3]), (3, [1, 2], [1, 4])]:
        assert r.weights[t].tolist() == pytest.approx(_expect_w(t, new, old, norm), rel=1e-6)
    st_ = r.stats()
    assert (st_["unique_before"], st_["unique_after"], st_["remapped_slots"]) == (5, 3, 2)
    assert st_["decode_slots"] == 8
    assert st_["displaced_mass"] == pytest.approx(_p(2)[3] + _p(3)[4], rel=1e-6)
    assert r.fetch is None


def test_hand_budget_and_mass():
    spec = RouterSpec(6, 2, norm_topk_prob=True)
    # budget:2 keeps {e1 (S=3), e0 (S=2)}: every secondary choice moves to the other one.
    r = lynx_select(Z, DEC, spec, LynxConfig("budget:2"))
    assert r.ids.tolist() == [[0, 1], [0, 1], [1, 0], [1, 0]]
    # lynx-mass:0.2: t2 would displace p3/(p1+p3) = 1/(1+e^0.7) ≈ 0.33 > 0.2 → keeps e3;
    # t3 displaces 1/(1+e^2) ≈ 0.12 ≤ 0.2 → e4 still moves (to e2, its best of C ∪ {e3}).
    r = lynx_select(Z, DEC, spec, LynxConfig("lynx-mass:0.2"))
    assert r.ids.tolist() == [[0, 1], [0, 2], [1, 3], [1, 2]]
    r = lynx_select(Z, DEC, spec, LynxConfig("lynx-mass:0.1"))  # both tokens refuse
    assert torch.equal(r.ids, exact_route(Z, spec)[0])


def test_hand_mixed_batch_prefill_experts_are_free():
    spec = RouterSpec(6, 2, norm_topk_prob=True)
    z = torch.cat([Z, torch.tensor([[0.0, 0.0, 0.0, 3.0, 2.9, 0.0]])])  # a prefill token: (3, 4)
    dec = torch.tensor([True, True, True, True, False])
    r = lynx_select(z, dec, spec, LynxConfig("lynx"))
    # e3, e4 are needed by the prefill token, so nothing is remapped.
    assert torch.equal(r.ids, exact_route(z, spec)[0])
    assert torch.equal(r.weights, exact_route(z, spec)[1])
    dec = torch.tensor([True, True, False, True, False])  # now t2 is prefill too: B = 3
    z[4] = torch.tensor([3.0, 2.9, 0.0, 0.0, 0.0, 0.0])  # prefill (0, 1)
    r = lynx_select(z, dec, spec, LynxConfig("lynx"))
    # B = 3: e2 gets 3^-1 ≥ 3^-1 (kept); e4 gets 3^-4 → t3 moves to its best in C ∪ {e1, e3}: e2.
    assert r.ids.tolist() == [[0, 1], [0, 2], [1, 3], [1, 2], [0, 1]]


def test_hand_residency_b1():
    spec = RouterSpec(6, 3, norm_topk_prob=False)
    z = torch.tensor([[2.0, 1.9, 1.3, 0.0, -1.0, -0.5]])  # top (0, 1, 2); e2 gap 0.7
    cfg = LynxConfig("lynx")  # α = 4/ln 2 ≈ 5.77: levels (0, 0, 4); j = 1 → e2 is droppable
    res = torch.tensor([True, False, False, False, False, True])
    r = lynx_select(z, torch.tensor([True]), spec, cfg, resident=res)
    assert r.ids.tolist() == [[0, 1, 5]]  # e2 (not resident) → best resident not chosen: e5
    assert r.fetch.tolist() == [1]
    assert r.weights.sum().item() == pytest.approx(exact_route(z, spec)[1].sum().item(), rel=1e-6)
    # Without residency a lone token is never remapped; a resident e2 stays.
    assert torch.equal(lynx_select(z, torch.tensor([True]), spec, cfg).ids, exact_route(z, spec)[0])
    res[2] = True
    assert lynx_select(z, torch.tensor([True]), spec, cfg, resident=res).ids.tolist() == [[0, 1, 2]]


# ---- slow reference, straight from the spec (Fractions for scores, Python loops) ----

def _ref(logits, is_decode, spec, cfg, resident=None):
    ids0, w0 = exact_route(logits, spec)
    T, E = logits.shape
    K = spec.top_k
    dec = [t for t in range(T) if is_decode[t]]
    B = len(dec)
    pooled = B >= max(cfg.min_batch, 2)
    if cfg.kind == "off" or E <= K or B == 0 or not (pooled or resident is not None):
        return ids0, w0
    alpha, beta, j = cfg.alpha_for(E, K), cfg.beta, cfg.j
    i0 = ids0.tolist()
    lv = {(t, s): int(torch.floor((logits[t, i0[t][0]] - logits[t, i0[t][s]]).clamp_min(0) * alpha)
                      .clamp(0, beta)) for t in dec for s in range(K)}
    base = B if pooled else 2
    S = [Fraction(0)] * E
    for (t, s), v in lv.items():
        S[i0[t][s]] += Fraction(1, base**v)
    order = sorted(range(E), key=lambda e: (-S[e], e))
    if not pooled:
        C = {i0[t][s] for (t, s), v in lv.items() if v <= j}
    elif cfg.kind == "budget":
        C = {e for e in order[: cfg.arg] if S[e] > 0}
    else:
        C = {e for e in range(E) if S[e] >= Fraction(1, base**j)}
    C |= {e for t in range(T) if not is_decode[t] for e in i0[t]}
    C |= {i0[t][0] for t in dec} if cfg.protect_top1 else set()
    A = C | ({e for e in range(E) if resident[e]} if resident is not None else set())
    for e in order:
        if len(A) < K and e not in A:
            A.add(e)
    ids, w = ids0.clone(), w0.clone()
    probs = torch.softmax(logits.double(), -1)
    for t in dec:
        by_affinity = lambda e: (-float(logits[t, e]), e)  # noqa: E731
        cands = iter(sorted((e for e in A if e not in i0[t]), key=by_affinity))
        new = [e if e in A else next(cands) for e in i0[t]]
        if new != i0[t]:
            p = probs[t, new]
            mass = 1.0 if spec.norm_topk_prob else float(probs[t, i0[t]].sum())
            ids[t], w[t] = torch.tensor(new), (p / p.sum() * mass).float()
    return ids, w


@st.composite
def cases(draw):
    E = draw(st.sampled_from([4, 8, 16, 32, 64]))
    K = draw(st.sampled_from([k for k in (1, 2, 4, 8) if k <= E]))
    T = draw(st.integers(1, 32))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    z = torch.randn(T, E, generator=g) * draw(st.sampled_from([0.3, 3.0, 6.0, 10.0]))
    if draw(st.booleans()):
        z = z + 2 * torch.randn(E, generator=g)  # popular experts: shared choices, bigger gaps
    if draw(st.booleans()):
        z = torch.round(z * 2) / 2  # many exact ties
    z = z.clamp(-20, 20)
    style = draw(st.sampled_from(["decode", "decode", "mixed", "mixed", "one", "prefill"]))
    dec = {"decode": torch.ones(T), "prefill": torch.zeros(T), "one": torch.arange(T) == 0,
           "mixed": torch.rand(T, generator=g) < 0.7}[style].bool()
    mode = draw(st.sampled_from(["off", "lynx", "lynx", "budget", "lynx-mass", "lynx-mass"]))
    if mode == "budget":
        mode = f"budget:{draw(st.integers(1, E))}"
    elif mode == "lynx-mass":
        mode = f"lynx-mass:{draw(st.sampled_from([0.0, 0.1, 0.3, 0.6, 1.0]))}"
    cfg = LynxConfig(mode, j=draw(st.sampled_from([0, 1, 1, 2, 5])),
                     protect_top1=draw(st.booleans()), min_batch=draw(st.sampled_from([1, 2, 4])))
    density = draw(st.sampled_from([0.0, 0.1, 0.5]))
    res = torch.rand(E, generator=g) < density if density else None
    spec = RouterSpec(E, K, norm_topk_prob=draw(st.booleans()),
                      num_shared_experts=draw(st.sampled_from([0, 1])))
    return z, dec, spec, cfg, res


def _union(ids):
    return set(ids.reshape(-1).tolist())


@settings(max_examples=100, deadline=None)
@given(cases())
def test_random_invariants(case):
    z, dec, spec, cfg, res = case
    T, K = z.shape[0], spec.top_k
    r = lynx_select(z, dec, spec, cfg, resident=res)
    ids0, w0 = exact_route(z, spec)
    ids, w = r.ids, r.weights
    assert ids.shape == (T, K) and ids.dtype == torch.int64 and w.dtype == torch.float32
    assert all(len(set(row)) == K for row in ids.tolist())  # k distinct experts each
    kept = (ids == ids0).all(1)
    assert torch.equal(ids[kept], ids0[kept]) and torch.equal(w[kept], w0[kept])  # bit-exact
    assert kept[~dec].all()  # prefill tokens never change
    if cfg.kind == "off" or (res is None and int(dec.sum()) < max(cfg.min_batch, 2)):
        assert kept.all()
    if cfg.protect_top1 or cfg.kind == "off":
        assert torch.equal(ids[:, 0], ids0[:, 0])
    before, after = _union(ids0), _union(ids)
    free = set(torch.nonzero(res).reshape(-1).tolist()) if res is not None else set()
    assert after <= before | free
    moved = {e for row0, row in zip(ids0.tolist(), ids.tolist()) for e in row0 if e not in row}
    assert not moved & after  # a remapped-away expert is used by nobody
    for row0, row in zip(ids0.tolist(), ids.tolist()):  # survivors keep their slot
        assert all(row[s] == e for s, e in enumerate(row0) if e in row)
    mass = torch.ones(T) if spec.norm_topk_prob else w0.sum(1)
    torch.testing.assert_close(w.sum(1), mass, rtol=1e-5, atol=1e-6)
    if cfg.kind == "budget" and res is None and dec.all() and T >= max(cfg.min_batch, 2):
        rank0 = _union(ids0[:, 0]) if cfg.protect_top1 else set()
        assert len(after) <= max(cfg.arg + len(rank0), K)
        if not cfg.protect_top1:
            assert len(after) <= max(cfg.arg, K)
    probs = torch.softmax(z.double(), -1)
    gone = ~(ids0.unsqueeze(2) == ids.unsqueeze(1)).any(2)  # [T, K] slot's expert left the token
    disp = (probs.gather(1, ids0) * gone).sum(1)  # displaced prob mass per token
    if cfg.kind == "lynx-mass":
        assert (disp <= cfg.arg * probs.gather(1, ids0).sum(1) + 1e-5).all()
    s = r.stats()  # stats agree with the returned ids
    assert (s["unique_before"], s["unique_after"]) == (len(before), len(after))
    assert s["remapped_slots"] == int((ids != ids0).sum())
    assert s["decode_slots"] == int(dec.sum()) * K and s["tokens"] == T
    assert s["displaced_mass"] == pytest.approx(float(disp.sum()), abs=1e-5)
    if res is not None:
        assert r.fetch.tolist() == sorted(after - free)


@settings(max_examples=100, deadline=None)
@given(cases())
def test_random_matches_reference(case):
    z, dec, spec, cfg, res = case
    if cfg.kind == "lynx-mass":  # τ = 1 must be exactly lynx; other τ are checked above
        if cfg.arg < 1:
            return
        cfg = LynxConfig("lynx", j=cfg.j, protect_top1=cfg.protect_top1, min_batch=cfg.min_batch)
        mass1 = LynxConfig("lynx-mass:1", j=cfg.j, protect_top1=cfg.protect_top1,
                           min_batch=cfg.min_batch)
        a = lynx_select(z, dec, spec, mass1, resident=res)
        assert torch.equal(a.ids, lynx_select(z, dec, spec, cfg, resident=res).ids)
    r = lynx_select(z, dec, spec, cfg, resident=res)
    ids, w = _ref(z, dec, spec, cfg, res)
    assert torch.equal(r.ids, ids)
    torch.testing.assert_close(r.weights, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["lynx", "budget:6", "lynx-mass:1.0"])
def test_seeded_sweep_matches_reference(mode):
    """Realistic batches (popular experts, B = 16, mixed phases) where remaps are common."""
    n_changed = 0
    for seed, (E, K) in enumerate([(8, 2), (16, 2), (32, 4), (64, 4), (64, 8)] * 4):
        g = torch.Generator().manual_seed(seed)
        z = torch.randn(20, E, generator=g) * 2 + torch.randn(E, generator=g) * 2
        dec = torch.arange(20) % 5 != 0 if seed % 2 else torch.ones(20, dtype=torch.bool)
        res = torch.rand(E, generator=g) < 0.3 if seed % 3 == 0 else None
        spec, cfg = RouterSpec(E, K, seed % 4 < 2), LynxConfig(mode, j=seed % 3)
        r = lynx_select(z, dec, spec, cfg, resident=res)
        ids, w = _ref(z, dec, spec, cfg, res)
        assert torch.equal(r.ids, ids)
        torch.testing.assert_close(r.weights, w, rtol=1e-5, atol=1e-6)
        n_changed += not torch.equal(ids, exact_route(z, spec)[0])
    assert n_changed >= 10  # the sweep does exercise the remap


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from([(8, 2), (16, 4), (64, 8)]),
       st.sampled_from([1, 2, 3]), st.booleans(), st.integers(0, 2))
def test_residency_few_tokens_matches_reference(seed, ek, T, norm, j):
    """B < min_batch with resident experts: non-critical (bin < −j) slots move to resident ones."""
    (E, K), g = ek, torch.Generator().manual_seed(seed)
    z = torch.randn(T, E, generator=g) * 4
    res = torch.rand(E, generator=g) < 0.4
    spec, cfg = RouterSpec(E, K, norm), LynxConfig("lynx", j=j, min_batch=4)
    dec = torch.ones(T, dtype=torch.bool)
    r = lynx_select(z, dec, spec, cfg, resident=res)
    ids, w = _ref(z, dec, spec, cfg, res)
    assert torch.equal(r.ids, ids)
    torch.testing.assert_close(r.weights, w, rtol=1e-5, atol=1e-6)
    assert set(r.fetch.tolist()) <= _union(exact_route(z, spec)[0])


def test_off_skip_and_single_token_are_exact():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(16, 64, generator=g)
    spec = RouterSpec(64, 8, norm_topk_prob=False)
    ids0, w0 = exact_route(z, spec)
    dec = torch.ones(16, dtype=torch.bool)
    for cfg, d, layer in [(LynxConfig(), dec, 0), (LynxConfig("lynx", skip_layers=(3,)), dec, 3),
                          (LynxConfig("lynx"), dec[:1], 0), (LynxConfig("lynx"), ~dec, 0)]:
        r = lynx_select(z[: d.numel()], d, spec, cfg, layer=layer)
        assert torch.equal(r.ids, ids0[: d.numel()]) and torch.equal(r.weights, w0[: d.numel()])
    assert not torch.equal(lynx_select(z, dec, spec, LynxConfig("lynx")).ids, ids0)  # it does act


def test_parse():
    on = LynxConfig.parse("on")  # the measured recommendation
    assert (on.mode, on.j) == ("lynx-mass:0.2", 0) and LynxConfig(mode="on").j == 0
    assert LynxConfig.parse("on,j=1").j == 1  # knobs after "on" override the recommended ones
    assert LynxConfig.parse(" LYNX ").kind == "lynx"
    c = LynxConfig.parse("budget:8")
    assert (c.kind, c.arg) == ("budget", 8)
    c = LynxConfig.parse(
        "lynx-mass:0.25,j=2,beta=3,alpha=1.5,protect_top1=false,skip_layers=0+5,min_batch=4")
    assert (c.kind, c.arg, c.j, c.beta, c.alpha, c.protect_top1, c.skip_layers, c.min_batch) == (
        "lynx-mass", 0.25, 2, 3, 1.5, False, (0, 5), 4)
    assert LynxConfig.parse(c) is c
    assert LynxConfig("lynx", beta=4).alpha_for(64, 8) == pytest.approx(4 / math.log(8))
    for bad in ["", "lynxx", "budget", "budget:0", "budget:x", "lynx:3", "lynx-mass:2", "off:1",
                "lynx,j", "lynx,gamma=1", "lynx,j=x", "lynx,protect_top1=maybe", "lynx,beta=0",
                "lynx,alpha=-1"]:
        with pytest.raises(ValueError):
            LynxConfig.parse(bad)


def test_router_and_telemetry():
    g = torch.Generator().manual_seed(1)
    spec = RouterSpec(16, 2, norm_topk_prob=True)
    res = torch.zeros(16, dtype=torch.bool)
    res[:4] = True
    router = LynxRouter(spec, "lynx", resident=lambda layer: res if layer == 1 else None)
    assert isinstance(router.telemetry, LynxTelemetry)
    uniq, remapped, disp, steps = [], 0, 0.0, 3
    for step in range(steps + 1):
        router.begin_step()
        prefill = step == 0  # a prefill forward: not in the summary means
        T = 12 if prefill else 8
        dec = torch.full((T,), not prefill)
        for layer in range(3):
            z = torch.randn(T, 16, generator=g) * 2
            ids, w = router(z, dec, layer)
            assert ids is router.last.ids and w is router.last.weights
            assert (router.last.fetch is not None) == (layer == 1)
            if not prefill:
                ids0 = exact_route(z, spec)[0]
                uniq.append((len(_union(ids0)), len(_union(ids))))
                remapped += int((ids != ids0).sum())
                disp += router.last.stats()["displaced_mass"]
    s = router.telemetry.summary()
    n = steps * 3
    assert s["steps"] == steps + 1 and s["decode_layer_steps"] == n
    assert s["unique_before"] == pytest.approx(sum(b for b, _ in uniq) / n)
    assert s["unique_after"] == pytest.approx(sum(a for _, a in uniq) / n)
    assert s["unique_after"] < s["unique_before"]
    assert s["reduction_pct"] == pytest.approx(100 * (1 - s["unique_after"] / s["unique_before"]))
    assert s["remap_rate_pct"] == pytest.approx(100 * remapped / (n * 8 * 2))
    assert s["displaced_mass_per_token"] == pytest.approx(disp / (n * 8), rel=1e-5)
    assert set(s["per_layer"]) == {0, 1, 2} and len(router.telemetry.steps) == steps + 1
    off = LynxRouter(spec, "off")
    z = torch.randn(8, 16, generator=g)
    ids, w = off(z, torch.ones(8, dtype=torch.bool), 0)
    assert torch.equal(ids, exact_route(z, spec)[0]) and torch.equal(w, exact_route(z, spec)[1])
    assert off.telemetry.summary()["reduction_pct"] == 0.0
    assert LynxTelemetry().summary()["decode_layer_steps"] == 0


# ------------------------------------------------------------ tie rule and host syncs


def test_tie_rule_exact_route_and_lynx():
    """One tie rule (routing.py): rank by logit, equal logits → lower id; a row with fewer than
    K finite logits takes the lowest −inf ids, each once. torch.topk has no such rule."""
    z = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0],
                      [-math.inf, 2.0, -math.inf, -math.inf, -math.inf, -math.inf, -math.inf, -math.inf]])
    ids, w = exact_route(z, RouterSpec(8, 3, norm_topk_prob=True))
    assert ids.tolist() == [[1, 2, 4], [1, 0, 2]]
    assert w[0].tolist() == [pytest.approx(1 / 3)] * 3 and w[1].tolist() == [1.0, 0.0, 0.0]
    g = torch.Generator().manual_seed(0)
    zt = torch.randint(-2, 3, (16, 16), generator=g).float()  # many exact ties, B = 16
    spec = RouterSpec(16, 4, norm_topk_prob=False)
    for mode in ("off", "lynx", "budget:5", "lynx-mass:0.5"):
        r = lynx_select(zt, True, spec, LynxConfig.parse(mode))
        ids, w = _ref(zt, torch.ones(16, dtype=torch.bool), spec, LynxConfig.parse(mode), None)
        assert torch.equal(r.ids, ids), mode  # the pure-Python reference breaks ties by id too
        assert all(len(set(row)) == 4 for row in r.ids.tolist())


def test_host_phase_equals_device_mask():
    """A Python-bool phase (host decisions) gives the same result as the mask on the device."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(12, 32, generator=g) * 2
    spec = RouterSpec(32, 4, norm_topk_prob=True)
    for mode in ("lynx", "budget:6", "lynx-mass:0.2,j=0", "lynx,min_batch=16"):
        cfg = LynxConfig.parse(mode)
        for phase in (True, False):
            a = lynx_select(z, phase, spec, cfg)
            b = lynx_select(z, torch.full((12,), phase), spec, cfg)
            assert torch.equal(a.ids, b.ids) and torch.equal(a.weights, b.weights), (mode, phase)
            torch.testing.assert_close(a.vec, b.vec, rtol=0, atol=1e-6)


_SYNC_OPS = {"_local_scalar_dense", "nonzero", "unique", "_unique", "_unique2", "unique_dim",
             "unique_consecutive", "masked_select", "item"}


class _SyncCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts ops that need a device → host read (on CUDA each one is a sync): .item(), bool(t),
    nonzero, unique, masked_select (+ tolist/numpy, patched: they bypass the dispatcher)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in _SYNC_OPS:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def _count_syncs(monkeypatch, fn):
    import lynx_edge.lynx as lynx_mod

    monkeypatch.setattr(lynx_mod, "CPU_HOST_PATH", False)  # CPU tensors stand in for CUDA here
    counter = _SyncCounter()
    for meth in ("tolist", "numpy"):
        orig = getattr(torch.Tensor, meth)

        def spy(self, *a, _orig=orig, _m=meth, **k):
            counter.ops.append(_m)
            return _orig(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, meth, spy)
    with counter:
        out = fn()
    monkeypatch.undo()
    return counter.ops, out


@pytest.mark.parametrize("mode", ["off", "lynx", "budget:4", "lynx-mass:0.2,j=0"])
def test_routing_has_no_host_sync(monkeypatch, mode):
    """Decode (host phase from begin_step), prefill, one-token and mixed-mask (phase unknown)
    routing calls read nothing back from the device."""
    g = torch.Generator().manual_seed(0)
    spec = RouterSpec(16, 4, norm_topk_prob=True)
    router = LynxRouter(spec, mode, device="cpu")
    mixed = torch.arange(8) % 3 != 0
    calls = [(True, torch.ones(8, dtype=torch.bool)), (False, torch.zeros(8, dtype=torch.bool)),
             (True, torch.ones(1, dtype=torch.bool)), (None, mixed), (None, mixed[:1])]
    for phase, mask in calls:
        z = torch.randn(mask.numel(), 16, generator=g)
        router.begin_step(phase)
        ops, (ids, w) = _count_syncs(monkeypatch, lambda: router(z, mask, 0))
        assert ops == [], (phase, mask.numel(), ops)
        if phase is False:  # all prefill: exact, bit-equal to the exact router (LYNX off)
            ref_ids, ref_w = ExactRouter(spec)(z, mask, 0)
        else:  # same result as the mask path
            ref = lynx_select(z, mask, spec, LynxConfig.parse(mode))
            ref_ids, ref_w = ref.ids, ref.weights
        assert torch.equal(ids, ref_ids) and torch.equal(w, ref_w)
    ops, _ = _count_syncs(monkeypatch, lambda: exact_route(torch.randn(8, 16), spec))
    assert ops == []
    ops, _ = _count_syncs(monkeypatch, lambda: torch.randn(3).nonzero().tolist())
    assert ops == ["nonzero", "tolist"]  # the counter does see syncs


def test_decode_step_routing_has_no_host_sync(monkeypatch):
    """Through the step code: a tiny MoEForCausalLM with a LynxRouter, prefill two rows then a
    decode step for both; no routing call reads back from the device."""
    from lynx_edge import step
    from lynx_edge.config import ModelConfig
    from lynx_edge.kv_cache import KVCache
    from lynx_edge.models import MoEForCausalLM

    cfg = ModelConfig.from_dict(dict(
        model_type="qwen3_moe", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True, tie_word_embeddings=False))
    torch.manual_seed(0)
    model = MoEForCausalLM(cfg, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    router = LynxRouter(model.routing.spec, "lynx", device="cpu")
    seen: list = []

    def counted(logits, is_decode, layer):
        ops, out = _count_syncs(monkeypatch, lambda: router(logits, is_decode, layer))
        seen.append((router.phase, ops))
        return out
    counted.begin_step = router.begin_step  # RoutingContext hands the host phase through
    model.routing.route = counted
    kv = KVCache(cfg, 2, 32, torch.float32, torch.device("cpu"))
    for row in (0, 1):
        step.prefill(model, kv, row, [1, 2, 3, 4 + row])
    step.decode_step(model, kv, [0, 1], torch.tensor([5, 6]))
    assert [ops for _, ops in seen] == [[]] * 6
    assert [ph for ph, _ in seen][-2:] == [True, True]  # the decode step's phase came from the host


def _tiny_model(device, dtype, E=8, K=2):
    """A random qwen3_moe-shaped MoEForCausalLM (2 layers, D 64) for step-level tests."""
    from lynx_edge.config import ModelConfig
    from lynx_edge.models import MoEForCausalLM

    cfg = ModelConfig.from_dict(dict(
        model_type="qwen3_moe", vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=64, rms_norm_eps=1e-6, num_experts=E,
        num_experts_per_tok=K, moe_intermediate_size=32, norm_topk_prob=True, tie_word_embeddings=False))
    torch.manual_seed(0)
    model = MoEForCausalLM(cfg, dtype, torch.device(device))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_decode_step_syncs_once_per_token():
    """torch.cuda.set_sync_debug_mode counts every synchronising CUDA call: a B=16 decode step
    with LYNX (the Triton route kernel) plus reading the next tokens back syncs exactly once,
    and the routing calls inside it never."""
    import warnings

    from lynx_edge import step
    from lynx_edge.kv_cache import KVCache

    dev = torch.device("cuda")
    model = _tiny_model(dev, torch.bfloat16, E=16, K=4)
    router = LynxRouter(model.routing.spec, "lynx", device=dev)
    assert router.use_triton
    model.routing.route = router
    B = 16
    kv = KVCache(model.cfg, B, 32, torch.bfloat16, dev)
    for row in range(B):
        step.prefill(model, kv, row, [1 + row % 7, 2, 3])
    tokens = torch.arange(B, device=dev) % 60
    tokens = step.decode_step(model, kv, list(range(B)), tokens).argmax(-1)  # warm-up: JIT compiles
    torch.cuda.synchronize()
    in_route: list[int] = []

    def route(logits, is_decode, layer, _r=router):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out = _r(logits, is_decode, layer)
        in_route.append(sum("synchroniz" in str(x.message) for x in w))
        return out
    route.begin_step = router.begin_step
    model.routing.route = route
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            nxt = step.decode_step(model, kv, list(range(B)), tokens).argmax(-1).tolist()  # the one read
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [str(x.message)[:200] for x in caught if "synchroniz" in str(x.message)]
    assert len(nxt) == B and router.last.table is not None  # the kernel routed
    assert in_route == [0, 0], in_route
    assert len(syncs) == 1, syncs
