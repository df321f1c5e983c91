"""The native router (kernels/native.route, lynx_route in cpu_native.c) against the references.

- Given torch's softmax, its choice, weights and stats are bit-identical to lynx.lynx_select (LYNX
  rules) and routing.exact_route (exact): the same integer decisions and fp32 roundings.
- Its own softmax (expf, left-to-right sum) stays within a few ulp of torch.softmax: the same experts,
  weights within a stated bound.
- The fused decode layer (lynx_layer: attention, route, experts in one call) gives the module
  path's logits and LYNX telemetry bit for bit.
"""
from __future__ import annotations

import pytest
import torch
from conftest import make_tiny

from lynx_edge import lynx
from lynx_edge.kernels import native
from lynx_edge.routing import ExactRouter, RouterSpec, exact_route

pytestmark = pytest.mark.skipif(native.lib() is None, reason="native kernels not built (no C compiler)")

CASES = ["lynx", "on", "lynx-mass:0.5", "lynx-mass:0", "budget:6", "budget:1", "lynx,j=2", "lynx,j=0,beta=2",
         "lynx,protect_top1=false", "lynx-mass:1,alpha=0.5", "lynx,min_batch=8"]


def _logits(T: int, E: int, ties: bool, seed: int) -> torch.Tensor:
    z = torch.randn(T, E, generator=torch.Generator().manual_seed(seed)) * 2
    return (z * 2).round() / 2 if ties else z  # coarse: many exact ties and equal gaps


def _plan(spec: RouterSpec, mode: str, T: int) -> native.Route:
    return lynx.native_plan(spec, lynx.host_params(spec, lynx.LynxConfig.parse(mode), 0, T))


@pytest.mark.parametrize("mode", CASES)
@pytest.mark.parametrize("E,K,norm,scale", [(32, 4, True, 1.0), (8, 2, False, 1.0), (64, 8, True, 2.5),
                                            (16, 1, False, 1.0)])
def test_lynx_rules_bit_identical_given_torch_softmax(mode, E, K, norm, scale):
    spec = RouterSpec(E, K, norm, routed_scaling_factor=scale)
    for T in (1, 2, 3, 9, 16, 33):
        for ties in (False, True):
            z = _logits(T, E, ties, E * 31 + K + T)
            ref = lynx.lynx_select(z, torch.ones(T, dtype=torch.bool), spec, lynx.LynxConfig.parse(mode))
            ids, w, vec = native.route(z, _plan(spec, mode, T), torch.softmax(z, -1))
            assert torch.equal(ids, ref.ids), (mode, T, ties)
            assert torch.equal(w, ref.weights), (mode, T, ties)
            assert torch.equal(vec[:6], ref.vec[:6]), (mode, T, ties, vec, ref.vec)
            torch.testing.assert_close(vec[6], ref.vec[6], rtol=2e-6, atol=1e-7)  # torch sums the mass in fp32


@pytest.mark.parametrize("E,K,norm", [(32, 4, True), (60, 4, False), (128, 8, True), (8, 2, True)])
def test_exact_plan_equals_exact_route(E, K, norm):
    spec = RouterSpec(E, K, norm)
    plan = native.exact_plan(K, norm)
    worst = 0.0
    for T in (1, 5, 64):
        for ties in (False, True):
            z = _logits(T, E, ties, E + T)
            ref_ids, ref_w = exact_route(z, spec)
            ids, w, _ = native.route(z, plan, torch.softmax(z, -1))  # torch's softmax: bit-identical
            assert torch.equal(ids, ref_ids) and torch.equal(w, ref_w), (T, ties)
            ids, w, _ = native.route(z, plan)  # its own softmax: the same experts, weights within a few ulp
            assert torch.equal(ids, ref_ids), (T, ties)
            ulp = (w - ref_w).abs() / torch.finfo(torch.float32).eps / ref_w.abs().clamp_min(1e-30)
            worst = max(worst, float(ulp.max()))
    assert worst <= 6.0, worst  # relative error in units of 2^-23; observed ≤ 4.6 over random draws


def test_own_softmax_close_to_torch():
    """Probabilities as weights (no renorm, K = E): the softmax itself against torch's."""
    z = torch.randn(40, 32, generator=torch.Generator().manual_seed(3)) * 4
    _, w, _ = native.route(z, native.exact_plan(32, False))
    ids, ref = exact_route(z, RouterSpec(32, 32, False))
    # torch's vectorised exp is itself a ~2 ulp approximation: observed 3.9e-7 (3.2 ulp) relative
    torch.testing.assert_close(w, ref, rtol=5e-7, atol=1e-12)


def test_a_wrong_rule_or_weight_is_caught():
    """Bug injection: a threshold one step looser, and a missing renormalisation, both show."""
    spec = RouterSpec(32, 4, True)
    z = _logits(16, 32, False, 1)
    ref = lynx.lynx_select(z, torch.ones(16, dtype=torch.bool), spec, lynx.LynxConfig.parse("lynx"))
    plan = _plan(spec, "lynx", 16)
    plan.j += 1
    assert not torch.equal(native.route(z, plan, torch.softmax(z, -1))[0], ref.ids)
    _, w, _ = native.route(z, native.exact_plan(4, False), torch.softmax(z, -1))
    assert not torch.equal(w, exact_route(z, spec)[1])


def test_bad_shapes_are_one_line():
    with pytest.raises(ValueError, match="top-8"):
        native.route(torch.zeros(2, 4), native.exact_plan(8, True))


def test_exact_router_routes_natively_on_cpu():
    """ExactRouter on CPU fp32 logits: the native call (no torch ops but its outputs), and the
    torch path for family probs."""
    spec = RouterSpec(32, 4, True)
    r = ExactRouter(spec)
    z = _logits(6, 32, False, 9)
    ids, w = r(z, torch.ones(6, dtype=torch.bool), 0)
    assert torch.equal(ids, exact_route(z, spec)[0])
    p = torch.softmax(z, -1)
    assert torch.equal(r(z, None, 0, probs=p)[1], exact_route(z, spec, p)[1])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fused_layer_with_lynx_equals_module_path(tmp_path, monkeypatch, dtype):
    """LYNX `on` at B=5: the fused native layer (route inside the call) against the module path
    (router __call__ between torch-side projections): logits and per-layer telemetry bit-equal,
    and the fused call did run (the router's last result came from native_done)."""
    from lynx_edge import Engine
    from lynx_edge.models import native_layer
    from lynx_edge.step import decode_step, prefill

    path = make_tiny(tmp_path / "q3", "qwen3_moe", hidden_size=128, moe_intermediate_size=128, head_dim=32)
    calls = []
    one, stack = native.layer, native.Stack.__call__
    monkeypatch.setattr(native, "layer", lambda *a: calls.append(1) or one(*a))
    monkeypatch.setattr(native.Stack, "__call__", lambda self, *a: calls.append(self.n) or stack(self, *a))

    def run():
        eng = Engine.from_pretrained(path, device="cpu", dtype=dtype, max_num_seqs=5, lynx="on")
        kv = eng._cache(5)
        for b in range(5):
            prefill(eng.model, kv, b, [5 + b, 6, 7 + 2 * b, 8][: 2 + b % 3], 0)
        out = torch.stack([decode_step(eng.model, kv, list(range(5)), torch.tensor([20 + 3 * t + b for b in range(5)]))
                           for t in range(4)])
        return out, eng.lynx.telemetry.summary()

    got, tel = run()
    assert calls, "the fused layer did not run"
    n = len(calls)
    monkeypatch.setattr(native_layer, "NATIVE_LAYERS", False)
    ref, ref_tel = run()
    assert len(calls) == n
    assert torch.equal(got, ref)
    assert tel == ref_tel and tel["unique_after"] < tel["unique_before"], tel


def test_stack_call_stops_where_a_layer_cannot_join(tmp_path, monkeypatch):
    """The one-call stack (lynx_layers) runs the leading layers that qualify; a layer that does not
    (here: told so) and every layer after it run their own calls; logits stay bit-equal."""
    from lynx_edge import Engine
    from lynx_edge.models import native_layer
    from lynx_edge.step import decode_step, prefill

    path = make_tiny(tmp_path / "q3", "qwen3_moe", hidden_size=128, moe_intermediate_size=128, head_dim=32,
                     num_hidden_layers=4)

    stack = native.Stack.__call__

    def run(stop_at):
        eng = Engine.from_pretrained(path, device="cpu", dtype="bfloat16", max_num_seqs=3)
        sizes = []
        monkeypatch.setattr(native.Stack, "__call__", lambda self, *a: sizes.append(self.n) or stack(self, *a))
        if stop_at is not None:
            nl = native_layer.native_of(eng.model.layers[stop_at])
            monkeypatch.setattr(nl, "route_plan", lambda B: None)
        kv = eng._cache(3)
        for b in range(3):
            prefill(eng.model, kv, b, [5 + b, 6, 7][: 1 + b], 0)
        sizes.clear()  # a one-token prompt runs the stack too (exact routing)
        out = torch.stack([decode_step(eng.model, kv, [0, 1, 2], torch.tensor([20 + t, 21, 22 + t])) for t in range(3)])
        return out, sizes

    full, sizes = run(None)
    assert sizes == [4, 4, 4]
    part, sizes = run(2)
    assert sizes == [2, 2, 2]
    assert torch.equal(full, part)
    _, sizes = run(1)
    assert sizes == []  # one leading layer: its own call


def test_discard_plan_returns_the_exact_choice_with_lynx_stats():
    """route_t.discard (benchmarks/lynx_overhead.py): the exact ids and weights, LYNX's stats."""
    spec = RouterSpec(32, 4, True)
    z = _logits(16, 32, False, 5)
    plan = _plan(spec, "on", 16)
    ids, w, vec = native.route(z, plan)
    plan.discard = 1
    ids_d, w_d, vec_d = native.route(z, plan)
    ref_ids, ref_w, _ = native.route(z, native.exact_plan(4, True))
    assert not torch.equal(ids, ref_ids)  # LYNX moved something here
    assert torch.equal(ids_d, ref_ids) and torch.equal(w_d, ref_w) and torch.equal(vec_d, vec)


def test_block_telemetry_equals_per_layer_records():
    """LynxTelemetry.record_block (the native stack's, summed every 256 calls) against record()
    per layer: the same summary over 300 steps, prefill-tainted calls excluded alike."""
    g = torch.Generator().manual_seed(4)
    one, block = lynx.LynxTelemetry(), lynx.LynxTelemetry()
    layers = (0, 2, 3)
    for s in range(300):
        vec = torch.rand(3, 7, generator=g, dtype=torch.float64) * 10
        vec[:, 0] = 4.0
        vec[:, 1] = 4.0 if s % 7 else 3.0  # every 7th: a call with a prefill token (not pure decode)
        one.begin_step()
        block.begin_step()
        for i, layer in enumerate(layers):
            one.record(layer, lynx.LynxResult(None, None, vec[i].clone(), None))
        block.record_block(layers, vec)
    a, b = one.summary(), block.summary()
    assert a["decode_layer_steps"] == b["decode_layer_steps"] == 3 * (300 - 43)
    for k in ("unique_before", "unique_after", "remap_rate_pct", "displaced_mass_per_token"):
        assert b[k] == pytest.approx(a[k], rel=1e-12), k
    assert b["per_layer"].keys() == a["per_layer"].keys() and len(block.steps) == len(one.steps)
    assert torch.equal(block.steps[-1][2], one.steps[-1][2])
