"""LYNX inside the engine: batched decode runs; telemetry agrees with the ids actually used;
mode off is bit-identical to the runtime without LYNX."""
import torch

from lynx_edge import Engine
from lynx_edge.lynx import LynxConfig

PROMPTS = ["def", "import os", "class Point:", "for i in range(10):", "The quick", "print(", "return a", "x = 1"]


def _ids_per_decode_step(eng):
    rs = eng.model.routing.stats
    return [step for step, dec in zip(rs.steps, rs.decode) if dec]


def test_lynx_off_is_bit_identical(tiny_models):
    a = Engine.from_pretrained(tiny_models["olmoe"], record_routing=True)
    b = Engine.from_pretrained(tiny_models["olmoe"], record_routing=True, lynx="off")
    ta = a.generate_batch(PROMPTS, max_new_tokens=8, ignore_eos=True)
    tb = b.generate_batch(PROMPTS, max_new_tokens=8, ignore_eos=True)
    assert ta == tb
    for sa, sb in zip(a.model.routing.stats.steps, b.model.routing.stats.steps):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_lynx_telemetry_matches_used_experts(tmp_path):
    from conftest import make_tiny

    # 32 experts top-4: enough experts that the batch's union can shrink
    path = make_tiny(tmp_path / "m", "olmoe", num_experts=32, num_experts_per_tok=4, intermediate_size=16)
    eng = Engine.from_pretrained(path, record_routing=True, lynx=LynxConfig(mode="lynx", j=0))
    chunks = list(eng.stream_batch(PROMPTS, max_new_tokens=6, ignore_eos=True))
    stats = chunks[-1].stats
    lynx = stats["lynx"]
    steps = _ids_per_decode_step(eng)
    assert steps and lynx["decode_layer_steps"] == sum(len(s) for s in steps)
    used = [int(ids.unique().numel()) for s in steps for ids in s.values()]
    assert abs(lynx["unique_after"] - sum(used) / len(used)) < 1e-9
    assert stats["unique_experts_per_layer"] == sum(used) / len(used)
    assert lynx["unique_after"] <= lynx["unique_before"]
    assert lynx["reduction_pct"] > 0  # j=0 keeps only decisive experts: the union must shrink
    for s in steps:  # every token still uses k distinct experts
        for ids in s.values():
            assert ids.shape[1] == 4 and all(len(set(r)) == 4 for r in ids.tolist())


def test_engine_offload_option_matches_resident(tiny_models):
    """Engine(offload=True) with few expert slots: same greedy text as fully resident, and the
    per-generation offload counters reach the last chunk."""
    prompts = PROMPTS[:4]
    ref = Engine.from_pretrained(tiny_models["qwen2_moe"]).generate_batch(prompts, max_new_tokens=6, ignore_eos=True)
    eng = Engine.from_pretrained(tiny_models["qwen2_moe"], offload=True, expert_slots=4, policy="lru")
    chunks = list(eng.stream_batch(prompts, max_new_tokens=6, ignore_eos=True))
    texts = [""] * len(prompts)
    for c in chunks:
        texts[c.index] += c.text
    assert texts == ref
    off = chunks[-1].stats["offload"]
    assert off["misses"] > 0 and off["bytes_h2d"] > 0
    eng.set_lynx("lynx")  # residency-aware LYNX on top of the offload runtime
    last = list(eng.stream_batch(prompts, max_new_tokens=6, ignore_eos=True))[-1]
    assert "lynx" in last.stats and last.stats["lynx"]["decode_layer_steps"] > 0


def test_a_stopped_stream_keeps_its_stats():
    """Closing a stream mid-answer (chat's Ctrl-C) leaves the engine's summary of what it did."""
    from lynx_edge import Engine

    eng = Engine.from_pretrained("demo", threads=1)
    stream = eng.stream("def main():", max_new_tokens=20, do_sample=False, ignore_eos=True)
    got = []
    while sum(len(c.token_ids) for c in got) < 5:  # a chunk carries one greedy burst's tokens
        got.append(next(stream))
    stream.close()
    st, n = eng.last_stats, sum(len(c.token_ids) for c in got)
    assert st["stopped"] and 5 <= st["completion_tokens"] == n < 20
    assert st["prompt_tokens"] == len(eng.encode_prompt("def main():")) and st["decode_steps"] == n - 1
    full = list(eng.stream("def main():", max_new_tokens=20, do_sample=False, ignore_eos=True))
    assert "stopped" not in eng.last_stats and eng.last_stats["completion_tokens"] == 20
    assert sum(len(c.token_ids) for c in full) == 20 and eng.last_stats["decode_steps"] == 19


def test_lynx_on_prefill_routes_as_exact(tiny_models, monkeypatch):
    """Prefill stays exact under LYNX, to the bit: each prefill forward's ids and gate weights with
    LYNX on equal those with it off (the exact router's own call, not lynx_select's torch ops)."""
    import lynx_edge.lynx as lynx_mod
    from lynx_edge.models import native_layer
    from lynx_edge.routing import ExactRouter

    # the routers' own calls only: a one-token prompt's forward would otherwise take the native
    # layer call, whose exact plan runs inside the kernel (tests/test_native_layer.py covers it)
    monkeypatch.setattr(native_layer, "NATIVE_LAYERS", False)
    got, engine_router = {ExactRouter: [], lynx_mod.LynxRouter: []}, []
    for cls in got:
        def call(self, logits, is_decode, layer, *a, _real=cls.__call__, **k):
            ids, w = _real(self, logits, is_decode, layer, *a, **k)
            if self is engine_router[-1] and not bool(torch.as_tensor(is_decode).any()):
                got[type(self)].append((layer, ids.clone(), w.clone()))
            return ids, w

        monkeypatch.setattr(cls, "__call__", call)
    called = []
    real_select = lynx_mod.lynx_select
    monkeypatch.setattr(lynx_mod, "lynx_select", lambda *a, **k: called.append(1) or real_select(*a, **k))
    for mode in ("off", "lynx"):
        eng = Engine.from_pretrained(tiny_models["olmoe"], lynx=mode)
        engine_router.append(eng.model.routing.route)
        eng.generate_batch(PROMPTS[:3], max_new_tokens=1, ignore_eos=True)
    off, on = got[ExactRouter], got[lynx_mod.LynxRouter]
    assert off and len(off) == len(on) and not called
    for (la, ia, wa), (lb, ib, wb) in zip(off, on):
        assert la == lb and torch.equal(ia, ib) and torch.equal(wa, wb)
