"""gpt-oss offloaded (issue 12): experts in the host store as the family holds them — MXFP4 codes +
e8m0 scales + biases (or 16-bit + biases) per expert — computed by the store format's own math
(the clamped SwiGLU with biases of kernels/moe_mxfp4's reference), never plain SwiGLU.
References: the resident model (OssExperts, itself checked against transformers in test_gpt_oss.py)
— offloaded logits, greedy ids and batches equal it with few slots (evicted, refetched); the
resident model replaying the routing residency-aware LYNX chose; the published MXFP4 bytes; the
memory plan's bytes per expert = the store's.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lynx_edge import Engine
from lynx_edge.build import LoadOptions, load_model
from lynx_edge.config import ModelConfig
from lynx_edge.engine import EngineConfig
from lynx_edge.offload import store as store_mod
from lynx_edge.tokenizer import Tokenizer
from test_gpt_oss import REAL, build, pack_mxfp4, prompt_ids
from conftest import RouteSpy, greedy_logits

E, D, I, L, K = 8, 64, 32, 4, 4  # the tiny checkpoint (test_gpt_oss.SIZES)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpt-oss-offload")
    bf16 = build(root / "bf16")
    return {"16bit": bf16, "mxfp4": pack_mxfp4(bf16, root / "mxfp4")}


def offloaded(path: Path, int4: bool = False, lynx: str = "off", int4_act: str | None = None, **oo) -> Engine:
    """Engine.from_pretrained(offload=True) with every OffloadOptions field reachable (cpu_compute, pin…)."""
    cfg = ModelConfig.from_file(path / "config.json")
    opts = LoadOptions(device="cpu", dtype="float32", offload=True, int4=int4, ctx=256, int4_act=int4_act,
                       offload_options=dict(profile="cpu-only", **oo))
    return Engine(load_model(path, cfg, opts), Tokenizer(path), EngineConfig(dtype="float32", device="cpu", lynx=lynx),
                  path)


def resident(path: Path, int4: bool = False, **kw) -> Engine:
    return Engine.from_pretrained(path, device="cpu", dtype=torch.float32, int4=int4, **kw)




PROMPTS = [prompt_ids(n, seed=n) for n in (3, 11, 29)]
CASES = [  # checkpoint, int4 at load, store format, offload options
    ("16bit", False, "fp32", dict(expert_slots=20, cpu_compute="never")),  # in place on the CPU device
    ("16bit", True, "mxfp4", dict(expert_slots=20, cpu_compute="never", pin="on", prefetch=True)),  # RTN at load; copies
    ("mxfp4", False, "mxfp4", dict(expert_slots=12, cpu_compute="never", pin="on", policy="lynx")),  # through slots
    ("mxfp4", False, "mxfp4", dict(expert_slots=3, cpu_compute="always")),  # Fiddler-style CPU experts
]


@pytest.mark.parametrize("case", CASES, ids=["16bit-inplace", "rtn-mxfp4-slots", "mxfp4-slots-lynxpolicy", "mxfp4-cpu"])
def test_offloaded_equals_resident(ckpts, case, monkeypatch, exact_int4):
    src, int4, fmt, oo = case
    monkeypatch.setattr(store_mod, "_alloc_pinned", lambda shape: torch.empty(shape, dtype=torch.uint8))
    path = ckpts[src]
    ref, eng = resident(path, int4), offloaded(path, int4, **oo)
    rt = eng.model.offload
    assert rt.store.fmt.name == fmt and rt.in_place == (oo.get("pin") != "on")
    ids = prompt_ids()
    want_toks, want = greedy_logits(ref, ids)
    toks, got = greedy_logits(eng, ids)
    assert toks == want_toks
    # observed ≤ 1e-6 where both sides run torch (sum order over k: ids vs slots); 6.4e-6 where the
    # resident MXFP4 experts run the native CPU kernel (fp32 sums in another order) and the slots torch
    torch.testing.assert_close(got, want, atol=2e-5, rtol=3e-6)
    kw = dict(max_new_tokens=10, do_sample=False, ignore_eos=True)
    assert eng.generate_batch(PROMPTS, **kw) == ref.generate_batch(PROMPTS, **kw)
    s = eng.last_stats["offload"]
    assert s["misses"] > 0 and s["remapped_slots"] == 0  # LYNX off: exact routing
    if oo["cpu_compute"] == "always":  # never admitted: every miss computed on the host from the store
        assert s["cpu_expert_calls"] == s["misses"] and s["hits"] == s["evictions"] == s["bytes_h2d"] == 0
    else:
        assert s["cpu_expert_calls"] == 0 and s["hits"] > 0 and s["evictions"] > 0
        assert s["admissions"] > oo["expert_slots"]  # evicted experts come back: refetched
        assert s["bytes_h2d"] == s["copies"] * rt.store.nbytes > 0
        if not rt.in_place:
            assert rt.pool.shape == (oo["expert_slots"] + K, rt.store.nbytes)  # slots + scratch, block layout


def test_mxfp4_checkpoint_lands_as_published_bytes(ckpts, monkeypatch):
    """The published *_blocks / *_scales bytes go straight into the store (gate/up rows de-interleaved,
    nothing dequantised at load), biases beside them; bytes per expert = MXFP4 + biases."""
    from safetensors.torch import load_file

    from lynx_edge.offload import biased

    def no_dequant(*a, **k):
        raise AssertionError("an MXFP4 expert was dequantised at load")

    monkeypatch.setattr(biased, "mxfp4_dequant", no_dequant)
    eng = offloaded(ckpts["mxfp4"], expert_slots=4)
    monkeypatch.undo()
    st, fmt = eng.model.offload.store, eng.model.offload.store.fmt
    sd = load_file(ckpts["mxfp4"] / "model.safetensors")
    for layer in (0, 3):
        p = f"model.layers.{layer}.mlp.experts."
        for e in (0, 5):
            blk = st.block(layer, e)
            gu_b, gu_s = sd[p + "gate_up_proj_blocks"][e], sd[p + "gate_up_proj_scales"][e]  # [2I, D/32, 16]
            gu = fmt._t(blk, "gu").unflatten(-1, (-1, 16))
            assert torch.equal(gu[:I], gu_b[0::2]) and torch.equal(gu[I:], gu_b[1::2])
            assert torch.equal(fmt._t(blk, "gu_s")[:I], gu_s[0::2]) and torch.equal(fmt._t(blk, "gu_s")[I:], gu_s[1::2])
            assert torch.equal(fmt._t(blk, "dn").unflatten(-1, (-1, 16)), sd[p + "down_proj_blocks"][e])
            assert torch.equal(fmt._t(blk, "dn_s"), sd[p + "down_proj_scales"][e])
            b = sd[p + "gate_up_proj_bias"][e]
            assert torch.equal(fmt._t(blk, "gu_b"), torch.cat([b[0::2], b[1::2]]).float())
            assert torch.equal(fmt._t(blk, "dn_b"), sd[p + "down_proj_bias"][e].float())
    # bytes per expert: codes 3·D·I/2 + scales 3·D·I/32 + fp32 biases (2I + D), each part 128-byte aligned
    parts = [2 * I * D // 2, 2 * I * D // 32, D * I // 2, D * I // 32, 2 * I * 4, D * 4]
    assert st.nbytes == sum(-(-n // 128) * 128 for n in parts) == 3840
    assert st.host_bytes() == L * E * st.nbytes


def test_memory_plan_bytes_per_expert_are_the_stores(ckpts):
    """Offload plans count each expert as the store holds it: MXFP4 + biases (bf16 on the real
    20B config, where every part is already 128-byte aligned: exactly the resident figure)."""
    from lynx_edge.offload.memory import plan_memory
    from lynx_edge.quant.formats import read_quant_config

    real = ModelConfig.from_file(REAL / "config.json")
    qc = read_quant_config(REAL, real.raw)
    plan = plan_memory(real, device="cuda", dtype=torch.bfloat16, offload=True, int4=False, quant=qc, ctx=4096,
                       profile="rtx4090-24gb")
    Dr = Ir = 2880
    assert plan.expert_format == "mxfp4" and plan.expert_bytes == 3 * Dr * Ir * 17 // 32 + (2 * Ir + Dr) * 2
    assert plan.total_experts == 24 * 32
    host = plan.resource("host").parts
    assert host[next(k for k in host if k.startswith("expert store"))] == 24 * 32 * plan.expert_bytes
    # the tiny checkpoint: what the plan counted is what the load allocated
    for src in ("16bit", "mxfp4"):
        cfg = ModelConfig.from_file(ckpts[src] / "config.json")
        q = read_quant_config(ckpts[src], cfg.raw)
        p = plan_memory(cfg, device="cpu", dtype=torch.float32, offload=True, int4=False, quant=q, ctx=256)
        st = offloaded(ckpts[src], expert_slots=4).model.offload.store
        assert (p.expert_format, p.expert_bytes) == (st.fmt.name, st.nbytes)
        assert p.resource("host").parts["expert store"] == st.host_bytes()


class _Record(RouteSpy):
    """Records (ids, weights, exact ids, is_decode) per call."""

    def record(self, scores, is_decode, ids, w, exact_ids):
        return ids.clone(), w.clone(), exact_ids, is_decode


class _Replay:
    """Returns the recorded (ids, weights) in call order: the resident model under the same routing."""

    def __init__(self, calls):
        self.calls = list(calls)

    def __call__(self, scores, is_decode, layer, probs=None):
        ids, w, ids0, _ = self.calls.pop(0)
        assert torch.equal(torch.topk(scores, K, dim=-1).indices.sort(-1).values, ids0.sort(-1).values)
        return ids, w


def test_lynx_with_offload_equals_resident_under_the_same_routing(ckpts):
    """Residency-aware LYNX on the offloaded MXFP4 model: LYNX invariants hold, some slots are
    remapped (onto resident experts too), and the resident model replaying those routing
    decisions generates the same ids."""
    from lynx_edge.offload.runtime import ResidencyRoute

    path = ckpts["mxfp4"]
    eng = offloaded(path, lynx="lynx", expert_slots=10, cpu_compute="never", policy="lynx")
    route = eng.model.routing.route
    assert isinstance(route, ResidencyRoute)
    rec = eng.model.routing.route = _Record(route, eng.model.routing.spec)
    prompts = [prompt_ids(n, seed=n) for n in (5, 9, 13, 17, 21, 25)]
    kw = dict(max_new_tokens=8, do_sample=False, ignore_eos=True)
    got = eng.generate_batch(prompts, **kw)
    remapped = 0
    for ids, w, ids0, dec in rec.calls:
        assert all(len(set(r)) == K for r in ids.tolist())  # k distinct
        assert torch.equal(ids[:, 0], ids0[:, 0])  # top-1 kept
        assert ids.unique().numel() <= ids0.unique().numel()  # the union never grows
        dec = torch.full((len(ids),), dec) if isinstance(dec, bool) else dec.reshape(-1).bool()
        assert torch.equal(ids[~dec], ids0[~dec])  # prefill exact
        remapped += int((ids != ids0).any(1).sum())
    s = eng.last_stats["offload"]
    assert remapped > 0 and 0 < s["remapped_to_resident"] <= s["remapped_slots"] and s["evictions"] > 0
    ref = resident(path)
    ref.model.routing.route = _Replay(rec.calls)
    assert ref.generate_batch(prompts, **kw) == got


def test_attach_and_detach_keep_mxfp4(ckpts):
    """attach_offload on a loaded MXFP4 model moves its experts into an MXFP4 store as held (bytes
    equal); detach puts OssExperts back with the same bytes; outputs unchanged throughout."""
    from lynx_edge.models.gpt_oss import OssExperts
    from lynx_edge.offload import OffloadOptions, attach_offload

    eng = resident(ckpts["mxfp4"])
    held = [(x.gate_up.clone(), x.down_scales.clone(), x.gate_up_b.clone())
            for x in (eng.model.layers[i].mlp.experts for i in range(L))]
    kw = dict(max_new_tokens=8, do_sample=False, ignore_eos=True)
    want = eng.generate_batch(PROMPTS, **kw)
    rt = attach_offload(eng.model, OffloadOptions(expert_slots=5, cpu_compute="never", profile="cpu-only"))
    assert rt.store.fmt.name == "mxfp4" and rt.store.nbytes == 3840
    assert torch.equal(rt.store.fmt._t(rt.store.block(2, 3), "gu"), held[2][0][3])
    assert eng.generate_batch(PROMPTS, **kw) == want and rt.stats()["evictions"] > 0
    rt.detach()
    for i in range(L):
        x = eng.model.layers[i].mlp.experts
        assert isinstance(x, OssExperts) and x.mxfp4
        assert torch.equal(x.gate_up, held[i][0]) and torch.equal(x.down_scales, held[i][1])
        assert torch.equal(x.gate_up_b, held[i][2])
    assert eng.generate_batch(PROMPTS, **kw) == want


def test_store_format_compute_is_the_reference(ckpts, exact_int4):
    """One expert from the store = kernels/moe_mxfp4.oss_moe_ref with that expert alone (weight 1),
    to fp32 rounding (the store's CPU experts run the native kernel on the block's bytes: observed
    ≤ 2e-7 of the output scale), and bit-equal to the resident experts' own CPU call."""
    from lynx_edge.kernels.moe_mxfp4 import oss_moe_ref

    eng = offloaded(ckpts["mxfp4"], expert_slots=4)
    st, ref = eng.model.offload.store, resident(ckpts["mxfp4"]).model.layers[1].mlp.experts
    x = torch.randn(5, D, generator=torch.Generator().manual_seed(0)) * 3
    for e in range(E):
        ids, w = torch.full((5, 1), e), torch.ones(5, 1)
        want = oss_moe_ref(x, ids, w, E, lambda j: ref.expert(j, x.dtype), ref.limit, ref.alpha)
        got = st.compute(1, e, x)
        assert (got - want).abs().max() <= 1e-6 * want.abs().max(), (got - want).abs().max()
        assert torch.equal(got, ref(x, ids, w))
    # the engine's int4_act reaches the host experts' MXFP4 rows, as the resident ones'
    eng16 = offloaded(ckpts["mxfp4"], expert_slots=4, int4_act="q16")
    st16 = eng16.model.offload.store
    assert st16.fmt.int4_act == "q16" and st.fmt.int4_act == ref.act == "f32"
    res16 = resident(ckpts["mxfp4"], int4_act="q16").model.layers[1].mlp.experts
    assert res16.act == "q16"
    ids, w = torch.full((5, 1), 2), torch.ones(5, 1)
    assert torch.equal(st16.compute(1, 2, x), res16(x, ids, w)) and not torch.equal(st16.compute(1, 2, x), ref(x, ids, w))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offloaded_equals_resident_cuda(ckpts):
    """On a GPU: pinned MXFP4 store, slots filled by async copies, the store format's math on the
    device vs the resident model's Triton kernel (fp32: ieee dots)."""
    path = ckpts["mxfp4"]
    ref = Engine.from_pretrained(path, device="cuda", dtype=torch.float32)
    eng = Engine.from_pretrained(path, device="cuda", dtype=torch.float32, offload=True, expert_slots=12,
                                 profile="rtx4090-24gb")
    rt = eng.model.offload
    assert rt.store.fmt.name == "mxfp4" and rt.store.pinned_bytes == L * E * rt.store.nbytes
    ids = prompt_ids()
    want_toks, want = greedy_logits(ref, ids)
    toks, got = greedy_logits(eng, ids)
    assert toks == want_toks
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    kw = dict(max_new_tokens=10, do_sample=False, ignore_eos=True)
    assert eng.generate_batch(PROMPTS, **kw) == ref.generate_batch(PROMPTS, **kw)
    assert eng.last_stats["offload"]["evictions"] > 0
