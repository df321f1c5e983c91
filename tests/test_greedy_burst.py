"""Greedy decode in one native call (step.decode_greedy → native_layer.greedy_burst → lynx_decode)
against decode_step and an argmax, step by step: the same tokens, the same K/V written, the same
LYNX telemetry and routing stats, and an early end after a stop id."""
from __future__ import annotations

import pytest
import torch
from conftest import make_tiny

from lynx_edge import Engine
from lynx_edge.kernels import native
from lynx_edge.models import native_layer
from lynx_edge.step import decode_greedy, decode_step, prefill

pytestmark = pytest.mark.skipif(native.lib() is None, reason="native kernels not built (no C compiler)")


@pytest.fixture(scope="module")
def q3(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("gb") / "q3", "qwen3_moe", hidden_size=128, moe_intermediate_size=128,
                     head_dim=32, vocab_size=512)


def _setup(path, B, dtype, lynx="off", record=False):
    eng = Engine.from_pretrained(path, device="cpu", dtype=dtype, max_num_seqs=B, lynx=lynx, record_routing=record)
    kv = eng._cache(B)
    for b in range(B):
        prefill(eng.model, kv, b, [5 + b, 6, 7, 8, 9 + b][: 2 + b % 3], 0)
    return eng, kv


def _stepwise(eng, kv, rows, toks, steps, stops=()):
    out = []
    for _ in range(steps):
        toks = decode_step(eng.model, kv, rows, torch.tensor(toks)).argmax(-1).tolist()
        out.append(toks)
        if any(t in stops for t in toks):
            break
    return out


@pytest.mark.parametrize("dtype,B,lynx", [("bfloat16", 1, "off"), ("float32", 3, "off"), ("bfloat16", 4, "on")])
def test_burst_equals_step_by_step(q3, dtype, B, lynx, monkeypatch):
    calls = []
    real = native.Stack.greedy
    monkeypatch.setattr(native.Stack, "greedy", lambda self, *a: calls.append(a[-2]) or real(self, *a))
    eng, kv = _setup(q3, B, dtype, lynx, record=True)
    rows, toks = list(range(B)), [20 + b for b in range(B)]
    got = decode_greedy(eng.model, kv, rows, toks, 6) + decode_greedy(eng.model, kv, rows, toks, 1)
    assert calls == [6], "the burst did not run in one native call"
    lengths, tel = list(kv.lengths[:B]), eng.lynx.telemetry.summary() if eng.lynx else None
    stats = eng.model.routing.stats
    unique, n_steps = stats.unique_per_layer(), len(stats.steps)
    k0 = kv.layers[0][0].clone()

    ref_eng, ref_kv = _setup(q3, B, dtype, lynx, record=True)
    ref = _stepwise(ref_eng, ref_kv, rows, toks, 6) + _stepwise(ref_eng, ref_kv, rows, toks, 1)
    assert got == ref
    assert lengths == list(ref_kv.lengths[:B])
    assert torch.equal(k0, ref_kv.layers[0][0])  # the same K written at the same positions
    rs = ref_eng.model.routing.stats
    assert (unique, n_steps) == (rs.unique_per_layer(), len(rs.steps))
    if lynx != "off":
        assert tel == ref_eng.lynx.telemetry.summary()


def test_burst_ends_after_a_stop_id(q3):
    eng, kv = _setup(q3, 2, "bfloat16")
    ref_eng, ref_kv = _setup(q3, 2, "bfloat16")
    free = _stepwise(ref_eng, ref_kv, [0, 1], [30, 31], 6)
    stop = free[2][1]  # the token row 1 chose at step 3
    before = list(kv.lengths[:2])
    got = decode_greedy(eng.model, kv, [0, 1], [30, 31], 6, {stop})
    assert got == free[: next(i for i, s in enumerate(free) if stop in s) + 1] and len(got) <= 3
    assert kv.lengths[:2] == [n + len(got) for n in before]


def test_burst_falls_back_to_one_step(q3, monkeypatch):
    """Where the stack call does not take the model (here: native layers off), one decode_step."""
    monkeypatch.setattr(native_layer, "NATIVE_LAYERS", False)
    eng, kv = _setup(q3, 1, "float32")
    got = decode_greedy(eng.model, kv, [0], [20], 5)
    assert len(got) == 1 and kv.lengths[0] == 3  # the prompt's 2 tokens and one step


def test_burst_rejects_a_token_outside_the_vocabulary(q3):
    eng, kv = _setup(q3, 1, "float32")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        decode_greedy(eng.model, kv, [0], [10_000], 3)


def test_burst_lynx_telemetry_in_one_report(q3, monkeypatch):
    """Without routing stats, a LYNX burst tells the router all its steps in one call
    (native_done_burst): the same telemetry as step by step — summary, step count and each step's
    per-layer stat vectors — and no per-step report."""
    from lynx_edge.lynx import LynxRouter

    eng, kv = _setup(q3, 4, "bfloat16", "on")
    per_step = []
    monkeypatch.setattr(LynxRouter, "native_done", lambda self, *a: per_step.append(1))
    rows, toks = list(range(4)), [20, 21, 22, 23]
    got = decode_greedy(eng.model, kv, rows, toks, 6)
    assert len(got) == 6 and not per_step
    tel = eng.lynx.telemetry
    monkeypatch.undo()
    ref_eng, ref_kv = _setup(q3, 4, "bfloat16", "on")
    assert got == _stepwise(ref_eng, ref_kv, rows, toks, 6)
    ref = ref_eng.lynx.telemetry
    assert tel.summary() == ref.summary() and tel.num_steps == ref.num_steps
    assert len(tel.steps) == len(ref.steps)
    for a, b in zip(tel.steps, ref.steps):
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in b)


def test_argmax_is_torchs_first_max():
    """lynx_argmax (the greedy burst's choice) against torch.argmax: ties go to the first index, a NaN
    counts as largest (the first NaN), at lengths around the vector width and the demo's vocabulary;
    a last-lane or tail maximum, all-equal rows and -inf rows."""
    so = native.lib()
    g = torch.Generator().manual_seed(0)
    rows = []
    for n in (1, 2, 7, 8, 9, 15, 16, 17, 23, 24, 31, 33, 4096, 4101):
        x = torch.randint(-3, 4, (n,), generator=g).float()  # many ties
        rows += [x, torch.randn(n, generator=g), torch.zeros(n), torch.full((n,), float("-inf"))]
        for at in {0, n // 2, n - 1}:
            y = torch.randn(n, generator=g)
            y[at] = 9.0
            rows.append(y)
            z = x.clone()
            z[at] = float("nan")
            rows.append(z)
            if n > 1:
                z = z.clone()
                z[(at + 1) % n] = float("nan")
                rows.append(z)
    for r in rows:
        r = r.contiguous()
        assert so.lynx_argmax(r.data_ptr(), r.numel()) == int(torch.argmax(r)), r
