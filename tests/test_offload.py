"""Offload: offloaded generation against the fully resident model (the reference), cache policies
on scripted routing, plans against budgets, pin-failure fallback, profiles, projection."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lynx_edge import Engine
from lynx_edge.config import ModelConfig
from lynx_edge.offload import (
    OffloadOptions, PlanError, ProfileError, attach_offload, calibrate, list_profiles, load_profile, make_plan,
)
from lynx_edge.offload import store as store_mod
from lynx_edge.offload.cache import ExpertCache
from lynx_edge.offload.cost import CostModel
from lynx_edge.offload.plan import non_expert_bytes
from lynx_edge.offload.profile import profile_from_dict, to_toml
from lynx_edge.offload.projection import MODEL_SHAPES, project, slots_for, trace_from_stats
from lynx_edge.offload.store import DenseFormat, HostExpertStore, expert_format
from conftest import greedy_logits

PROMPTS = ["def add(a, b):", "import os\nimport", "The quick brown fox", "class Point:\n    def"]




def _reference(path, ids):
    eng = Engine.from_pretrained(path, device="cpu")
    return greedy_logits(eng, ids, 6), eng.generate_batch(PROMPTS, max_new_tokens=10, ignore_eos=True)


@pytest.mark.parametrize("family,opts", [
    ("mixtral", dict(expert_slots=5, cpu_compute="never", prefetch=True)),
    ("qwen2_moe", dict(expert_slots=4, cpu_compute="never", policy="lynx")),
    ("olmoe", dict(expert_slots=3, cpu_compute="always")),
])
def test_offloaded_equals_resident(tiny_models, family, opts):
    eng = Engine.from_pretrained(tiny_models[family], device="cpu")
    ids = eng.tokenizer.encode(PROMPTS[0])
    (ref_toks, ref_logits), ref_batch = _reference(tiny_models[family], ids)
    rt = attach_offload(eng.model, OffloadOptions(profile="cpu-only", **opts))
    toks, logits = greedy_logits(eng, ids, 6)
    assert toks == ref_toks
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    assert eng.generate_batch(PROMPTS, max_new_tokens=10, ignore_eos=True) == ref_batch
    s = rt.stats()
    assert s["misses"] > 0
    if opts["cpu_compute"] == "never":
        assert s["hits"] > 0
        assert s["evictions"] > 0 and s["cpu_expert_calls"] == 0
        assert s["bytes_h2d"] == s["copies"] * rt.store.nbytes > 0
    else:
        assert s["cpu_expert_calls"] == s["misses"] and s["bytes_h2d"] == 0 and s["hits"] == 0  # never admitted
    assert s["remapped_slots"] == 0  # LYNX off: routing is exact
    if opts.get("prefetch"):
        assert s["prefetch_bytes"] > 0


def test_detach_restores_model(tiny_models):
    eng = Engine.from_pretrained(tiny_models["mixtral"], device="cpu")
    ref = eng.generate(PROMPTS[1], max_new_tokens=8, ignore_eos=True)
    rt = attach_offload(eng.model, OffloadOptions(expert_slots=2, cpu_compute="never"))
    with pytest.raises(RuntimeError):
        attach_offload(eng.model, OffloadOptions(expert_slots=2))
    rt.detach()
    assert eng.generate(PROMPTS[1], max_new_tokens=8, ignore_eos=True) == ref


# --------------------------------------------------------------------------- cache, scripted


def test_cache_lru_counters_exact():
    c = ExpertCache(3, "lru")
    script = [[0, 1], [2], [0, 3], [1], [3, 2]]
    expect = [(0, 2, 0), (0, 1, 0), (1, 1, 1), (0, 1, 1), (1, 1, 1)]  # (hits, misses, evictions) per step
    for used, (h, m, ev) in zip(script, expect):
        c.tick()
        before = (c.hits, c.misses, c.evictions)
        hits, misses = c.access(0, used)
        for e in misses:
            assert c.admit(0, e) is not None
        c.release()
        assert (c.hits - before[0], c.misses - before[1], c.evictions - before[2]) == (h, m, ev)
    # LRU order: step 3 evicted 1 (oldest), step 4 evicted 2, step 5 evicted 0
    assert sorted(e for e, r in enumerate(c.resident(0, 4)) if r) == [1, 2, 3]
    assert (c.hits, c.misses, c.evictions, c.admissions) == (2, 6, 3, 6)


def test_cache_never_evicts_locked_and_bypasses_when_full():
    c = ExpertCache(2, "lru")
    c.access(0, [0, 1, 2])
    assert c.admit(0, 0) == 0 and c.admit(0, 1) == 1
    assert c.admit(0, 2) is None and c.bypasses == 1  # both slots hold experts of this step
    c.release()
    assert c.admit(0, 2) is not None and c.evictions == 1


def test_cache_layers_are_separate_keys():
    c = ExpertCache(4, "lru")
    for layer in (0, 1):
        _, m = c.access(layer, [5])
        c.admit(layer, m[0])
        c.release()
    assert c.slot(0, 5) != c.slot(1, 5) and c.resident_count() == 2


def test_lru_vs_lynx_policy_scan_resistance():
    """Hot critical expert 0 every step plus a stream of one-off low-affinity experts: LRU lets
    the one-offs push expert 0 out; lynx keeps it (their demand 0.25 < its demand) and bypasses."""
    res = {}
    for policy in ("lru", "lynx"):
        c = ExpertCache(2, policy)
        for step in range(12):
            c.tick()
            used = [0] if step % 3 == 0 else [100 + 2 * step, 101 + 2 * step]  # 0 every 3rd step
            _, misses = c.access(0, used, critical=[0])
            for e in misses:
                c.admit(0, e)
            c.release()
        res[policy] = c
    assert res["lru"].hits == 0 and res["lru"].bypasses == 0
    assert res["lynx"].hits == 3 and res["lynx"].slot(0, 0) >= 0 and res["lynx"].bypasses > 0


def test_lynx_policy_admission_rule_exact():
    c = ExpertCache(1, "lynx", decay=0.5, minor=0.25)
    c.access(0, [7], critical=[7])  # d(7) = 1
    assert c.admit(0, 7) == 0
    c.release()
    c.tick()  # d(7) → 0.5
    c.access(0, [3])  # d(3) = 0.25 < 0.5: bypassed
    assert c.admit(0, 3) is None
    c.release()
    c.access(0, [3])  # d(3) = 0.5 = d(7): a tie keeps the resident
    assert c.admit(0, 3) is None and c.bypasses == 2
    c.release()
    c.access(0, [3])  # d(3) = 0.75 > 0.5: admitted, 7 evicted
    assert c.admit(0, 3) == 0 and c.slot(0, 7) == -1 and c.evictions == 1
    assert math.isclose(c.demand_of(0, 3), 0.75) and math.isclose(c.demand_of(0, 7), 0.5)


class _BruteCache:
    """The policies of cache.py's docstring by linear scan (the reference for the heap version)."""

    def __init__(self, n, policy, decay=0.95, minor=0.25):
        self.n, self.policy, self.g, self.m = n, policy, decay, minor
        self.res, self.dem, self.locked, self.step, self.seq = {}, {}, set(), 0, 0
        self.hits = self.misses = self.evictions = self.bypasses = 0

    def d(self, k):
        d, t = self.dem.get(k, (0.0, self.step))
        return d * self.g ** (self.step - t)

    def access(self, layer, used, critical):
        misses = []
        for e in used:
            k = (layer, e)
            self.dem[k] = (self.d(k) + (1.0 if e in critical else self.m), self.step)
            if k in self.res:
                self.seq += 1
                self.res[k] = self.seq
                self.locked.add(k)
                self.hits += 1
            else:
                misses.append(e)
        self.misses += len(misses)
        return misses

    def admit(self, layer, e):
        k = (layer, e)
        if len(self.res) >= self.n:
            cands = [x for x in self.res if x not in self.locked]
            key = (lambda x: self.res[x]) if self.policy == "lru" else (lambda x: (self.d(x), self.res[x]))
            v = min(cands, key=key) if cands else None
            if v is None or (self.policy == "lynx" and self.d(k) <= self.d(v) * (1 + 1e-12)):
                self.bypasses += 1
                return None
            del self.res[v]
            self.evictions += 1
        self.seq += 1
        self.res[k] = self.seq
        self.locked.add(k)
        return k


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["lru", "lynx"]), st.integers(1, 6),
       st.lists(st.tuples(st.integers(0, 2), st.sets(st.integers(0, 7), min_size=1, max_size=5),
                          st.integers(0, 7), st.booleans()), min_size=1, max_size=60))
def test_cache_matches_brute_force_reference(policy, slots, script):
    """Random scripted routing: counters and residency equal the linear-scan reference exactly."""
    fast, ref = ExpertCache(slots, policy), _BruteCache(slots, policy)
    for layer, used, crit, tick in script:
        if tick:
            fast.tick()
            ref.step += 1
        used = sorted(used)
        _, misses = fast.access(layer, used, {crit})
        assert misses == ref.access(layer, used, {crit})
        for e in misses:
            assert (fast.admit(layer, e) is None) == (ref.admit(layer, e) is None)
        fast.release()
        ref.locked.clear()
        assert set(fast.slot_of) == set(ref.res)
    assert (fast.hits, fast.misses, fast.evictions, fast.bypasses) == (ref.hits, ref.misses, ref.evictions, ref.bypasses)


def test_scripted_routing_through_offloaded_experts(tiny_models):
    """Counters and bytes exact when ids are scripted, and the output equals moe_ref."""
    from lynx_edge.kernels.moe_gemm import moe_ref

    eng = Engine.from_pretrained(tiny_models["mixtral"], device="cpu")
    block = eng.model.layers[0].mlp
    gu, dn = block.experts.gate_up.clone(), block.experts.down.clone()
    rt = attach_offload(eng.model, OffloadOptions(expert_slots=2, scratch_slots=1, cpu_compute="never"))
    x = torch.randn(3, 64)
    w = torch.tensor([[0.7, 0.3]] * 3)
    nb = rt.store.nbytes
    for ids, hits, misses, copies in [([[0, 1], [0, 1], [1, 0]], 0, 2, 2),
                                      ([[0, 2], [0, 1], [2, 0]], 2, 1, 1),   # 0, 1 hit; 2 has no free slot → scratch
                                      ([[3, 4], [3, 5], [4, 5]], 0, 3, 3)]:
        before = rt.stats()
        ids_t = torch.tensor(ids)
        y = block.experts(x, ids_t, w)
        torch.testing.assert_close(y, moe_ref(x, ids_t, w, gu, dn), atol=1e-6, rtol=1e-6)
        s = rt.stats()
        assert (s["hits"] - before["hits"], s["misses"] - before["misses"]) == (hits, misses)
        assert s["bytes_h2d"] - before["bytes_h2d"] == copies * nb


# --------------------------------------------------------------------------- residency-aware LYNX


def test_residency_lynx_remaps_onto_resident_at_b1(tiny_models):
    pytest.importorskip("lynx_edge.lynx")
    eng = Engine.from_pretrained(tiny_models["qwen3_moe"], device="cpu")
    rt = attach_offload(eng.model, OffloadOptions(expert_slots=6, cpu_compute="never", policy="lynx"))
    eng.generate(PROMPTS[2], max_new_tokens=12, ignore_eos=True)
    base = rt.stats()
    rt.cache.clear()
    rt.reset_stats()
    rt.set_lynx("lynx")
    seen = []
    route = eng.model.routing.route
    orig = route.__call__

    def spy(logits, is_decode, layer):  # fetch list must be used \ resident at routing time
        res = rt.resident_mask(layer).clone()
        ids, wts = orig(logits, is_decode, layer)
        seen.append((ids.clone(), res))
        return ids, wts

    eng.model.routing.route = spy
    eng.generate(PROMPTS[2], max_new_tokens=12, ignore_eos=True)
    s = rt.stats()
    assert s["remapped_to_resident"] > 0 and s["remapped_to_resident"] <= s["remapped_slots"]
    assert s["decode_bytes_h2d"] < base["decode_bytes_h2d"]
    assert all(ids.numel() and res.shape == (8,) for ids, res in seen)


def test_attach_makes_an_installed_lynx_router_residency_aware(tiny_models):
    pytest.importorskip("lynx_edge.lynx")
    from lynx_edge.offload.runtime import ResidencyRoute

    eng = Engine.from_pretrained(tiny_models["mixtral"], device="cpu", lynx="lynx")
    rt = attach_offload(eng.model, OffloadOptions(expert_slots=4, cpu_compute="never"))
    route = eng.model.routing.route
    assert isinstance(route, ResidencyRoute) and route.telemetry is eng.lynx.telemetry
    eng.generate_batch(PROMPTS, max_new_tokens=6, ignore_eos=True)
    assert eng.last_stats["lynx"]["decode_layer_steps"] > 0 and rt.stats()["decode_steps"] == 5
    rt.set_lynx("off")
    assert not isinstance(eng.model.routing.route, ResidencyRoute)


# --------------------------------------------------------------------------- plans


def _cfg(path) -> ModelConfig:
    return ModelConfig.from_file(path / "config.json")


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_plan_non_expert_bytes_match_model(tiny_models, family):
    eng = Engine.from_pretrained(tiny_models[family], device="cpu")
    total = sum(p.numel() * 4 for n, p in eng.model.named_parameters() if ".experts." not in n)
    assert non_expert_bytes(eng.cfg, 4) == total


def test_plan_respects_budget(tiny_models):
    cfg = _cfg(tiny_models["mixtral"])
    prof = load_profile("rtx3060-12gb")
    base = make_plan(cfg, OffloadOptions(gpu_budget_gib=0.0, reserve_gib=0, ctx=64, scratch_slots=0,
                                         expert_slots=0), torch.float32, "cpu", prof)
    fixed = base.non_expert_bytes + base.kv_bytes
    eb = base.expert_bytes
    for n in (0, 1, 5, 16, 40):
        budget = fixed + 2 * eb + n * eb + 100
        plan = make_plan(cfg, OffloadOptions(gpu_budget_gib=budget / 2**30, reserve_gib=0, ctx=64),
                         torch.float32, "cpu", prof)
        assert plan.device_bytes <= budget
        assert plan.expert_slots == min(n, plan.total_experts)
    with pytest.raises(PlanError, match="does not hold"):
        make_plan(cfg, OffloadOptions(gpu_budget_gib=fixed / 2**30 / 2, reserve_gib=0, ctx=64), torch.float32,
                  "cpu", prof)
    # host memory is the memory plan's verdict (plan_memory, tests/test_info_plan.py): only a warning here
    short = make_plan(cfg, OffloadOptions(expert_slots=1), torch.float32, "cpu", prof, host_available=1000)
    assert any("host memory" in w for w in short.warnings)
    rep = base.report()
    assert {r["what"].split(" (")[0] for r in rep["rows"]} >= {"non-expert weights", "expert slots", "all experts"}
    assert "expected" in base.to_text()


def test_plan_dry_run_mixtral_on_laptop():
    """Mixtral-8x7B shapes on an 8 GB laptop profile: no weights loaded, a sane plan."""
    cfg = ModelConfig.from_dict({
        "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
        "intermediate_size": 14336, "max_position_embeddings": 32768})
    plan = make_plan(cfg, OffloadOptions(profile="laptop-rtx4060-8gb", ctx=2048, expert_format="int4"),
                     torch.bfloat16, "cpu", host_available=64 * 2**30)
    assert plan.budget_bytes == 8 * 2**30 and plan.device_bytes <= plan.budget_bytes
    assert 0 < plan.expert_slots < plan.total_experts and plan.expert_format == "int4"
    assert 80e6 < plan.expert_bytes < 100e6  # ≈ 91 MB per INT4 expert (peers.md)


# --------------------------------------------------------------------------- pinning


def test_pin_failure_falls_back_to_pageable_with_staging(tiny_models, monkeypatch):
    eng = Engine.from_pretrained(tiny_models["mixtral"], device="cpu")
    ref = eng.generate_batch(PROMPTS[:2], max_new_tokens=8, ignore_eos=True)

    def fake_pin(shape):  # the big per-layer buffers are refused, the small ring is granted
        if shape[0] == 8:
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
        return torch.empty(shape, dtype=torch.uint8)

    monkeypatch.setattr(store_mod, "_alloc_pinned", fake_pin)
    with pytest.warns(RuntimeWarning, match="pinning host memory failed"):
        rt = attach_offload(eng.model, OffloadOptions(expert_slots=3, pin="on", cpu_compute="never"))
    assert rt.store.pin_failed and rt.store.staging_pinned and rt.store.pinned_bytes == 0
    assert eng.generate_batch(PROMPTS[:2], max_new_tokens=8, ignore_eos=True) == ref
    s = rt.stats()
    assert s["staged_copies"] == s["copies"] > 0


def test_pin_limit_pins_some_layers(tiny_models, monkeypatch):
    eng = Engine.from_pretrained(tiny_models["mixtral"], device="cpu")
    ref = eng.generate(PROMPTS[0], max_new_tokens=8, ignore_eos=True)
    monkeypatch.setattr(store_mod, "_alloc_pinned", lambda shape: torch.empty(shape, dtype=torch.uint8))
    nb = DenseFormat("fp32", 64, 48).nbytes
    with pytest.warns(RuntimeWarning, match="limit"):
        rt = attach_offload(eng.model, OffloadOptions(expert_slots=3, pin="on", pin_limit_gib=8 * nb / 2**30,
                                                      cpu_compute="never"))
    assert rt.store.pinned == {0: True, 1: False} and rt.store.staging is not None
    assert eng.generate(PROMPTS[0], max_new_tokens=8, ignore_eos=True) == ref
    s = rt.stats()
    assert 0 < s["staged_copies"] < s["copies"]


def test_both_pins_fail_still_correct(monkeypatch):
    def refuse(shape):
        raise RuntimeError("no")

    monkeypatch.setattr(store_mod, "_alloc_pinned", refuse)
    fmt = expert_format("fp32", torch.float32, 16, 8)
    st = HostExpertStore(fmt, 4, want_pin=True)
    gu, dn = torch.randn(4, 16, 16), torch.randn(4, 16, 8)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        st.put(0, gu, dn)
    assert len(w) == 2 and st.staging is not None and not st.staging_pinned
    g, d = st.weights(0, 2, torch.float32)
    assert torch.equal(g, gu[2]) and torch.equal(d, dn[2])


# --------------------------------------------------------------------------- store formats


def test_dense_store_views_are_zero_copy_and_bf16_roundtrips():
    fmt = expert_format("bf16", torch.float32, 32, 16)
    st = HostExpertStore(fmt, 3, want_pin=False)
    gu, dn = torch.randn(3, 32, 32), torch.randn(3, 32, 16)
    st.put(4, gu, dn)
    g, d = st.weights(4, 1, torch.bfloat16)
    assert g.data_ptr() == st.block(4, 1).data_ptr() and fmt.nbytes % 128 == 0
    assert torch.equal(g, gu[1].bfloat16()) and torch.equal(d, dn[1].bfloat16())


def test_int4_store_matches_quant_reference():
    int4 = pytest.importorskip("lynx_edge.quant.int4")
    gu, dn = torch.randn(2, 128, 64) * 0.1, torch.randn(2, 64, 64) * 0.1
    fmt = expert_format("int4", torch.float32, 64, 64, group=32)
    st = HostExpertStore(fmt, 2, want_pin=False)
    st.put(0, gu, dn)
    ref = int4.quantize_experts(gu, dn, 32)
    for e in range(2):
        g, d = st.weights(0, e, torch.float32)
        rg, rd = ref.dequant_expert(e)
        assert torch.equal(g, rg) and torch.equal(d, rd)


# --------------------------------------------------------------------------- cost model


def test_cost_model_splits_misses_between_link_and_cpu():
    prof = load_profile("rtx4090-24gb")
    cm = CostModel(prof, expert_bytes=352_321_536, flops_per_token=6 * 4096 * 14336)
    fetch, cpu = cm.split([1, 3, 5, 6], [0, 1, 0, 9, 0, 1, 2, 0])
    assert sorted(fetch + cpu) == [1, 3, 5, 6] and fetch and cpu
    assert cm.split([1], [0, 5])[0] == [1] or cm.cpu_s(5) < cm.fetch_s() + cm.gpu_s(5)
    assert CostModel(prof, 1000, 1.0, cpu_mode="never").split([2, 4], [0] * 5) == ([2, 4], [])
    assert CostModel(prof, 1000, 1.0, cpu_mode="always").split([2, 4], [0] * 5) == ([], [2, 4])


def test_cost_model_times_int4_cpu_experts_at_their_own_rate():
    """An INT4 store's CPU experts cost their bytes at the INT4 kernel's measured rate (compute-bound:
    fewer bytes/s than a 16-bit stream), not the 16-bit rate; without the figure, the 16-bit one."""
    import dataclasses

    prof = dataclasses.replace(load_profile("rtx4090-24gb"), cpu_int4_expert_gbps=5.0)
    b, lat = 10_000_000, prof.cpu_latency_us * 1e-6
    assert math.isclose(CostModel(prof, b, 1.0, fmt="int4").cpu_s(1), lat + b / 5e9)
    assert math.isclose(CostModel(prof, b, 1.0).cpu_s(1), lat + b / (prof.cpu_expert_gbps * 1e9))
    bare = dataclasses.replace(prof, cpu_int4_expert_gbps=None)
    assert math.isclose(CostModel(bare, b, 1.0, fmt="int4").cpu_s(1), lat + b / (prof.cpu_expert_gbps * 1e9))
    for name in list_profiles():  # the shipped ones carry the INT4 rate, below their 16-bit one (compute-bound)
        p = load_profile(name)
        assert p.cpu_int4_expert_gbps and p.cpu_int4_expert_gbps < p.cpu_expert_gbps, name


# --------------------------------------------------------------------------- profiles


def test_bundled_profiles_load():
    names = list_profiles()
    assert {"rtx4090-24gb", "rtx3060-12gb", "laptop-rtx4060-8gb", "jetson-orin-64gb", "h200", "cpu-only"} <= set(names)
    for n in names:
        p = load_profile(n)
        assert profile_from_dict(__import__("tomllib").loads(to_toml(p))) == p


@pytest.mark.parametrize("patch,msg", [
    ({"gpu": {"memry_gib": 8}}, r"unknown key \[gpu\] memry_gib"),
    ({"network": {"x": 1}}, r"unknown table \[network\]"),
    ({"link": {"h2d_pinned_gbps": -3}}, r"h2d_pinned_gbps = -3 is impossible"),
    ({"link": {"h2d_pinned_gbps": 0}}, "impossible"),
    ({"cpu": {"gflops": "fast"}}, "must be a number"),
    ({"gpu": {"unified_memory": 1}}, "true or false"),
    ({"offload": {"policy": "fifo"}}, "policy 'fifo' is unknown"),
    ({"offload": {"reserve_gib": 30}}, "reserve_gib must be smaller"),
    ({"colour": "red"}, "unknown key 'colour'"),
])
def test_profile_validation_errors(patch, msg):
    import tomllib

    data = tomllib.loads(to_toml(load_profile("rtx4090-24gb")))
    for k, v in patch.items():
        if isinstance(v, dict) and k in data:
            data[k].update(v)
        else:
            data[k] = v
    with pytest.raises(ProfileError, match=msg) as ei:
        profile_from_dict(data, "x.toml")
    assert "\n" not in str(ei.value) and str(ei.value).startswith("x.toml: ")


def test_profile_missing_key_and_unknown_name(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text('name = "bad"\n[gpu]\nmemory_gib = 8\nhbm_gbps = 100\ntflops = 10\n')
    with pytest.raises(ProfileError, match="missing key"):
        load_profile(p)
    with pytest.raises(ProfileError, match="unknown profile 'nope'"):
        load_profile("nope")
    p.write_text("name = [")
    with pytest.raises(ProfileError, match="not valid TOML"):
        load_profile(p)


def test_calibrate_writes_a_loadable_profile(tmp_path):
    prof = calibrate("here", device="cpu", size_mb=8, save_to=tmp_path / "here.toml")
    again = load_profile(tmp_path / "here.toml")
    assert again.name == "here" and again.unified_memory and again.cpu_expert_gbps > 0
    from lynx_edge.quant import cpu_kernels

    assert (again.cpu_int4_expert_gbps or 0) > 0 if cpu_kernels.available() else again.cpu_int4_expert_gbps is None
    assert again.cpu_int4_expert_gbps == prof.cpu_int4_expert_gbps


# --------------------------------------------------------------------------- projection


def test_projection_replays_recorded_routing(tiny_models):
    eng = Engine.from_pretrained(tiny_models["mixtral"], device="cpu", record_routing=True)
    eng.generate_batch(PROMPTS, max_new_tokens=6, ignore_eos=True)
    trace = trace_from_stats(eng.model.routing.stats)
    assert len(trace) == 5 and all(len(s[0]) == 4 for s in trace)
    shape = MODEL_SHAPES["mixtral-8x7b"]
    r = project(trace, shape, "rtx4090-24gb", cpu_compute="never", slots=0)
    assert r["label"] == "projected" and r["mode"] == "direct" and r["hit_rate"] == 0.0
    uniq = r["unique_experts_per_layer_step"]
    assert math.isclose(r["bytes_per_step"], uniq * shape.layers * shape.expert_bytes())
    full = project(trace, shape, "rtx4090-24gb", slots=shape.layers * 8)
    assert full["bytes_per_step"] < r["bytes_per_step"] and full["tok_s"] > r["tok_s"]
    scaled = project(trace, "qwen3-30b-a3b", "laptop-rtx4060-8gb")
    assert scaled["mode"].startswith("scaled") and scaled["tok_s"] > 0
    assert slots_for(shape, load_profile("laptop-rtx4060-8gb"), 1) < slots_for(shape, load_profile("h200"), 1)


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_offloaded_equals_resident_cuda(tiny_models):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    eng = Engine.from_pretrained(tiny_models["mixtral"], device="cuda", dtype="float32")
    ref = eng.generate_batch(PROMPTS, max_new_tokens=10, ignore_eos=True)
    rt = attach_offload(eng.model, OffloadOptions(expert_slots=4, cpu_compute="never", prefetch=True))
    assert eng.generate_batch(PROMPTS, max_new_tokens=10, ignore_eos=True) == ref
    assert rt.store.pinned_bytes > 0 and rt.stats()["misses"] > 0


@pytest.mark.slow
def test_gpu_offload_check_dry_run(tmp_path):
    """The device check script's CPU smoke mode runs end to end and writes its report."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "gpu_offload_check.py"
    spec = importlib.util.spec_from_file_location("gpu_offload_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--dry-run", "--layers", "2", "--steps", "2", "--prompt", "4", "--out", str(tmp_path)]) == 0
    rep = json.loads((tmp_path / "gpu_offload_check.json").read_text())
    assert {(r["batch"], r["variant"]) for r in rep["rows"]} >= {(1, "lru"), (1, "lynx"), (16, "lru"), (16, "lynx")}


@pytest.mark.gpu
def test_store_pins_exactly_its_bytes_cuda(tiny_models):
    """On a real GPU the one-pass load pins each layer's store buffer itself (cudaHostRegister):
    every buffer is page-locked and the pinned total is the experts' exact size, not the
    power-of-two blocks of pin_memory=True (pytorch issue 150517)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    eng = Engine.from_pretrained(tiny_models["mixtral"], device="cuda", dtype="bfloat16", offload=True)
    st = eng.model.offload.store
    assert st.layers and all(buf.is_pinned() for buf in st.layers.values())
    exact = len(eng.cfg.moe_layer_ids) * eng.cfg.num_experts * st.nbytes
    assert st.pinned_bytes == exact == sum(buf.numel() for buf in st.layers.values())
    assert not st.pin_failed and st.staging is None  # pinned buffers copy straight to the device
