"""The whole-layer native decode step (models/native_layer.py) against the module path it replaces.

Same kernels, same rounding points: logits must be bit-equal over several decode steps, bf16 and
fp32, at one row and at several, and a row's logits must not depend on the batch it decodes in.
Layers of other shapes must keep the module path."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import make_tiny

from lynx_edge import Engine
from lynx_edge.build import _decode_bytes
from lynx_edge.kernels import native
from lynx_edge.models import native_layer
from lynx_edge.models.native_layer import NativeLayer
from lynx_edge.step import decode_step, prefill

pytestmark = pytest.mark.skipif(native.lib() is None, reason="native kernels not built (no C compiler)")
FIX = Path(__file__).parent / "fixtures"


def _decode(eng: Engine, B: int, steps: int = 5) -> torch.Tensor:
    """Logits [steps, B, V] of `steps` decode steps after B prompts of different lengths."""
    kv = eng._cache(B)
    for b in range(B):
        prefill(eng.model, kv, b, [5 + b, 6, 7, 8, 9 + b][: 3 + b % 3], 0)
    return torch.stack([decode_step(eng.model, kv, list(range(B)), torch.tensor([20 + t + b for b in range(B)]))
                        for t in range(steps)])


def _both(path, B: int, monkeypatch, **kw) -> tuple[torch.Tensor, torch.Tensor, Engine]:
    """(native-layer logits, module-path logits, the native engine)."""
    eng = Engine.from_pretrained(path, device="cpu", max_num_seqs=max(B, 1), **kw)
    got = _decode(eng, B)
    assert all(isinstance(layer._native, NativeLayer) for layer in eng.model.layers), "the native layer did not run"
    monkeypatch.setattr(native_layer, "NATIVE_LAYERS", False)
    ref_eng = Engine.from_pretrained(path, device="cpu", max_num_seqs=max(B, 1), **kw)
    ref = _decode(ref_eng, B)
    assert all(layer._native is None for layer in ref_eng.model.layers)
    monkeypatch.setattr(native_layer, "NATIVE_LAYERS", True)
    return got, ref, eng


@pytest.fixture(scope="module")
def q3(tmp_path_factory):
    root = tmp_path_factory.mktemp("nl")
    # D=128: the int8-activation (q8) kernels take it (width a multiple of 128)
    return make_tiny(root / "q3", "qwen3_moe", hidden_size=128, moe_intermediate_size=128, head_dim=32)


@pytest.mark.parametrize("act", ["f32", "bf16"])
@pytest.mark.parametrize("B", [1, 3])
def test_bf16_bit_equal_to_module_path(q3, B, act, monkeypatch):
    """bf16 on fp32 activations, and on bf16 ones (--bf16-act bf16: every projection, expert and the
    head, not the router; fp32 rows where the build has no AVX512-BF16, so the same logits there)."""
    got, ref, eng = _both(q3, B, monkeypatch, dtype="bfloat16", bf16_act=act)
    assert torch.equal(got, ref)
    m, runs = eng.model, "bf16" if act == "bf16" and native.bf16_dp() else "f32"
    assert m.placement.bf16_act == runs
    on = runs == "bf16"
    lin = ("bf16-stream" if native.streamed(_decode_bytes(m)) else "bf16") if on else None  # a tiny model: bf16
    assert m.head_act == lin and m.layers[0].mlp.experts.act == ("bf16" if on else None) and m.layers[0].mlp.gate.act is None
    nl = m.layers[0]._native
    code, moe = native.bf16_code(lin, torch.bfloat16), native.bf16_code("bf16" if on else None, torch.bfloat16)
    assert (nl.attn_plan.qkv.act, nl.attn_plan.o.act, nl.moe_plan.act, nl.attn_plan.gate.act) == (code, code, moe, 0)


@pytest.mark.parametrize("kw", [dict(int4=True, int4_group=32), dict(int4=True, int4_group=32, int4_act="q8"),
                                dict(int4=True, int4_group=32, int4_act="f32"), dict(int4=True, int4_group=32, int4_act="q16")],
                         ids=["int4", "int4-q8", "int4-f32", "int4-q16"])
def test_int4_experts_bit_equal(q3, kw, monkeypatch):
    got, ref, eng = _both(q3, 2, monkeypatch, dtype="bfloat16", **kw)
    assert eng.model.layers[0]._native.moe_plan.act == native.act_code(kw.get("int4_act"))
    assert torch.equal(got, ref)


def test_packed_4bit_attention_bit_equal(monkeypatch):
    """A GPTQ act-order checkpoint: q/k/v/o kept packed (Int4Linear), experts INT4."""
    got, ref, eng = _both(FIX / "gptq_actorder_tiny", 2, monkeypatch, dtype="bfloat16")
    assert type(eng.model.layers[0].self_attn.q_proj).__name__ == "Int4Linear"
    assert torch.equal(got, ref)


def test_fp8_experts_bit_equal(q3, tmp_path, monkeypatch):
    """An FP8 checkpoint's experts (Fp8MoEExperts) through the native layer's MoE call."""
    from lynx_edge.quant.fp8 import Fp8MoEExperts, write_checkpoint

    path = write_checkpoint(q3, tmp_path / "fp8", (64, 32))
    got, ref, eng = _both(path, 2, monkeypatch, dtype="bfloat16")
    assert type(eng.model.layers[0].mlp.experts) is Fp8MoEExperts
    assert eng.model.layers[0]._native.moe_plan.fmt == native.FMT_FP8
    assert torch.equal(got, ref)


@pytest.mark.parametrize("B", [1, 2])
def test_fp32_bit_equal(q3, B, monkeypatch):
    got, ref, _ = _both(q3, B, monkeypatch, dtype="float32")
    assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype,act", [("float32", None), ("bfloat16", "f32"), ("bfloat16", "bf16")])
def test_decode_is_batch_invariant(q3, dtype, act):
    """A row's decode logits alone equal its logits inside a batch: every kernel sums a row the
    same way whichever rows share the call (what `seed` per sequence promises for sampling)."""
    eng = Engine.from_pretrained(q3, device="cpu", dtype=dtype, max_num_seqs=5, bf16_act=act)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [4], [8, 8, 3, 2], [30, 31]]
    kv = eng._cache(5)
    for b, p in enumerate(prompts):
        prefill(eng.model, kv, b, p, 0)
    batch = [decode_step(eng.model, kv, list(range(5)), torch.tensor([20 + t] * 5)) for t in range(3)]
    for b, p in enumerate(prompts):
        kv1 = eng._cache(1)
        prefill(eng.model, kv1, 0, p, 0)
        for t in range(3):
            assert torch.equal(decode_step(eng.model, kv1, [0], torch.tensor([20 + t]))[0], batch[t][b]), (b, t)


def test_bug_is_caught_and_replaced_weights_rebuild_the_plan(q3, monkeypatch):
    got, ref, eng = _both(q3, 1, monkeypatch, dtype="bfloat16")
    plan = eng.model.layers[1]._native.attn_plan
    plan.eps2 = 0.5  # a wrong epsilon in the second norm: the comparison must notice
    assert not torch.equal(_decode(eng, 1), ref)
    layer = eng.model.layers[1]
    layer.post_attention_layernorm.weight.data = layer.post_attention_layernorm.weight.data.clone()  # new storage
    assert torch.equal(_decode(eng, 1), ref)  # the stale plan was dropped, a new one built


@pytest.fixture(scope="module")
def q2(tmp_path_factory):
    """Qwen2-MoE: routed experts plus a sigmoid-gated shared expert, q/k/v biases, top-k not renormalised."""
    return make_tiny(tmp_path_factory.mktemp("q2") / "m", "qwen2_moe", hidden_size=128, moe_intermediate_size=128,
                     shared_expert_intermediate_size=256)  # widths INT4's group size divides


@pytest.mark.parametrize("dtype,B", [("bfloat16", 1), ("bfloat16", 3), ("float32", 2)])
def test_shared_expert_inside_the_layer_call(q2, dtype, B, monkeypatch):
    """Qwen2-MoE's shared expert runs inside the layer call (lynx_shared_expert after the routed
    experts), bit-equal to the module path, which calls the same kernel; its gate's sigmoid is read
    (a flipped gate row must change the logits)."""
    got, ref, eng = _both(q2, B, monkeypatch, dtype=dtype)
    assert torch.equal(got, ref)
    mlp = eng.model.layers[0].mlp
    assert eng.model.layers[0]._native.moe_plan.shared and mlp.native_shared()[0].sg.N == 1
    with torch.no_grad():
        mlp.shared_expert_gate.weight.neg_()  # sigmoid(-z) for sigmoid(z): in place, the plan points into it
    assert not torch.equal(_decode(eng, B), ref)


def test_biases_written_in_place_are_read(q2, monkeypatch):
    """Qwen2-MoE's q/k/v biases (copied to fp32 for the layer call) written in place after the plan
    was made: the next step reads the new values, as the module path does."""
    def changed_after_decoding() -> torch.Tensor:
        eng = Engine.from_pretrained(q2, device="cpu", dtype="bfloat16", max_num_seqs=2)
        _decode(eng, 2)
        with torch.no_grad():
            for layer in eng.model.layers:
                layer.self_attn.k_proj.bias.add_(0.5)  # a view of the fused q/k/v bias
        return _decode(eng, 2)

    got = changed_after_decoding()
    monkeypatch.setattr(native_layer, "NATIVE_LAYERS", False)
    ref = changed_after_decoding()
    assert torch.equal(got, ref)


@pytest.mark.parametrize("int4_attn", [False, True])
def test_shared_expert_beside_int4_experts(q2, int4_attn, monkeypatch):
    """4-bit routed experts (--int4) and the shared expert in one layer call: 16-bit, or 4-bit packed
    (--int4-attn quantises it at load, as published GPTQ checkpoints hold it)."""
    got, ref, eng = _both(q2, 2, monkeypatch, dtype="bfloat16", int4=True, int4_group=32, int4_attn=int4_attn)
    layer = eng.model.layers[0]
    assert layer._native.moe_plan.fmt == native.FMT_INT4 and layer._native.moe_plan.shared
    assert (type(layer.mlp.shared_expert.gate_proj).__name__ == "Int4Linear") == int4_attn
    assert (layer.mlp.native_shared()[0].gate.kind == native.FMT_INT4) == int4_attn
    assert torch.equal(got, ref)


def test_fp8_shared_expert_bit_equal(q2, tmp_path, monkeypatch):
    """An FP8 checkpoint of Qwen2-MoE: FP8 routed experts and an FP8 shared expert (its one-row gate
    16-bit), all inside the layer call."""
    from lynx_edge.quant.fp8 import Fp8Linear, write_checkpoint

    path = write_checkpoint(q2, tmp_path / "fp8", (64, 32))
    got, ref, eng = _both(path, 2, monkeypatch, dtype="bfloat16")
    layer = eng.model.layers[0]
    assert type(layer.mlp.shared_expert.gate_proj) is Fp8Linear and layer._native.moe_plan.fmt == native.FMT_FP8
    assert layer._native.moe_plan.shared
    assert torch.equal(got, ref)


def test_shared_expert_with_an_offloaded_backend(q2, monkeypatch):
    """Experts offloaded (their own call after the attention half): the shared expert is added as the
    module path adds it."""
    got, ref, eng = _both(q2, 2, monkeypatch, dtype="float32", offload=True, expert_slots=4)
    assert eng.model.layers[0]._native.moe_plan is None
    assert torch.equal(got, ref)


def test_other_shapes_keep_the_module_path(tmp_path, monkeypatch):
    """An offloaded expert backend runs the attention half natively and its own expert call."""
    path = make_tiny(tmp_path / "mx", "mixtral")
    got, ref, eng = _both(path, 2, monkeypatch, dtype="float32", offload=True, expert_slots=4)
    assert eng.model.layers[0]._native.moe_plan is None
    assert torch.equal(got, ref)


@pytest.fixture(scope="module")
def olmoe_clip(tmp_path_factory):
    """OLMoE with clip_qkv small enough that the clip bites on q, k (after their norms) and v."""
    return make_tiny(tmp_path_factory.mktemp("ol") / "m", "olmoe", clip_qkv=0.3)


@pytest.mark.parametrize("dtype,B", [("bfloat16", 1), ("bfloat16", 3), ("float32", 2)])
def test_olmoe_full_qk_norm_bit_equal(olmoe_clip, dtype, B, monkeypatch):
    """OLMoE's q/k norm over all heads and its clip run inside the layer call (lynx_qk_full) with
    the module path's roundings; the module path itself runs them natively too (qk_full)."""
    got, ref, eng = _both(olmoe_clip, B, monkeypatch, dtype=dtype)
    assert torch.equal(got, ref)
    plan = eng.model.layers[0]._native.attn_plan
    assert plan.qfw and plan.clip == pytest.approx(0.3)
    plan.clip = 0.0  # the clip left out: the comparison must notice
    assert not torch.equal(_decode(eng, B), ref)


def test_olmoe_native_decode_matches_transformers(olmoe_clip):
    """The native OLMoE decode (norm over all heads, clip_qkv, RoPE, attention) against
    transformers' own decode with its KV cache, fp32, step by step."""
    import transformers

    eng = Engine.from_pretrained(olmoe_clip, device="cpu", dtype="float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(olmoe_clip, dtype=torch.float32).eval()
    ids = [5, 9, 14, 3, 27]
    kv = eng._cache(1)
    ours = [prefill(eng.model, kv, 0, ids, 0)[0]]
    with torch.no_grad():
        out = hf(torch.tensor([ids]), use_cache=True)
        refs, past = [out.logits[0, -1]], out.past_key_values
        for t in range(6):
            tok = 40 + 3 * t
            ours.append(decode_step(eng.model, kv, [0], torch.tensor([tok]))[0])
            out = hf(torch.tensor([[tok]]), cache=past, use_cache=True)
            refs.append(out.logits[0, -1])
            past = out.past_key_values
    assert all(isinstance(layer._native, NativeLayer) for layer in eng.model.layers)
    torch.testing.assert_close(torch.stack(ours), torch.stack(refs), atol=1e-6, rtol=1e-5)  # seen 1.6e-7 of 0.63


def test_lynx_routing_runs_through_the_native_layer(q3, monkeypatch):
    """The router between the two calls is the engine's: LYNX on gives the module path's tokens."""
    prompts = ["def f(x):", "import os", "class A:", "x = 1"]
    outs = []
    for flag in (True, False):
        monkeypatch.setattr(native_layer, "NATIVE_LAYERS", flag)
        eng = Engine.from_pretrained(q3, device="cpu", dtype="bfloat16", max_num_seqs=4, lynx="on")
        outs.append(eng.generate_batch(prompts, max_new_tokens=6, ignore_eos=True))
    assert outs[0] == outs[1]


def test_equal_length_one_token_chunks(q3, monkeypatch):
    """One-token prompt chunks of equal start run through the native layer with positions that are
    an expanded (stride-0) view: the call must read each row's own position (it read past the one
    element, so row 1's attention depended on stray memory)."""
    from lynx_edge.step import prefill_rows

    outs = []
    for flag in (True, False):
        monkeypatch.setattr(native_layer, "NATIVE_LAYERS", flag)
        eng = Engine.from_pretrained(q3, device="cpu", dtype="float32", max_num_seqs=3)
        kv = eng._cache(3)
        prefill_rows(eng.model, kv, [0, 1, 2], [[5, 6, 7], [8, 9, 10], [11, 12, 13]], [0, 0, 0])
        outs.append(prefill_rows(eng.model, kv, [0, 1, 2], [[20], [21], [22]], [3, 3, 3])[0])
    assert torch.equal(outs[0], outs[1])
    from lynx_edge.models.layers import AttnBatch

    ab = AttnBatch(positions=torch.arange(3, 4)[None].expand(3, 1), rows=slice(0, 3), kv_len=4, start=3)
    ab.cos = ab.sin = torch.zeros(3, 1, 1, 8)
    step = ab.native_step()
    assert all(t.is_contiguous() for t in step) and step[1].tolist() == [3, 3, 3]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_final_norm_and_head_inside_the_stack_call(q3, dtype, monkeypatch):
    """The model's last RMSNorm and head run inside the stack call (lynx_layers) with the module
    path's roundings: bit-equal logits; a wrong epsilon there is caught; a replaced head weight
    rebuilds the head plan."""
    got, ref, eng = _both(q3, 2, monkeypatch, dtype=dtype)
    assert torch.equal(got, ref)
    model = eng.model
    key, (w, eps, lin) = model._native_head
    model._native_head = (key, (w, 0.5, lin))  # a wrong epsilon in the head's norm
    assert not torch.equal(_decode(eng, 2), ref)
    model.lm_head.weight.data = model.lm_head.weight.data.clone()  # new storage: the plan is rebuilt
    assert torch.equal(_decode(eng, 2), ref)


def test_kept_stack_call_follows_a_new_cache_and_router(q3, monkeypatch):
    """decode_stack keeps the call's pointer arrays per batch size across steps (native_layer._Stack):
    a new KV cache of the same batch, LYNX switched on, or a replaced expert matrix (gate/up, down) must each
    rebuild them — a stale array would write into a freed cache or read the old weights. Logits
    stay bit-equal to the module path, and each change made exactly one new stack."""
    from lynx_edge.kv_cache import KVCache

    def run(native_on: bool) -> tuple[list, int]:
        monkeypatch.setattr(native_layer, "NATIVE_LAYERS", native_on)
        eng = Engine.from_pretrained(q3, device="cpu", dtype="bfloat16", max_num_seqs=2)
        outs, built = [_decode(eng, 2, steps=2)], []
        real = native_layer._Stack.__init__
        monkeypatch.setattr(native_layer._Stack, "__init__", lambda self, *a: built.append(1) or real(self, *a))
        eng.kv = KVCache(eng.cfg, 2, eng.ctx, eng.model.dtype, eng.model.device)  # a new cache, same batch
        outs.append(_decode(eng, 2, steps=2))
        eng.set_lynx("on")  # another router: other route plans
        outs.append(_decode(eng, 2, steps=2))
        ex = eng.model.layers[1].mlp.experts
        ex.gate_up = torch.nn.Parameter(ex.gate_up.data * 1.5, requires_grad=False)  # a replaced weight
        outs.append(_decode(eng, 2, steps=2))
        ex.down = torch.nn.Parameter(ex.down.data * 1.5, requires_grad=False)  # and the other expert matrix
        outs.append(_decode(eng, 2, steps=2))
        monkeypatch.undo()
        return outs, len(built)

    got, built = run(True)
    ref, none = run(False)
    assert built == 4 and none == 0
    for g, r in zip(got, ref):
        assert torch.equal(g, r)
    assert not torch.equal(got[2], got[3]) and not torch.equal(got[3], got[4])  # the replaced weights were read


def test_int4_activations_default_to_q16_where_vectorised(q3, monkeypatch):
    """No int4_act named: $LYNX_EDGE_INT4_ACT, else q16 where it was measured faster than the f32 rows
    (AVX2 without AVX-512), else f32; the engine records what it runs."""
    import platform

    monkeypatch.setattr(native, "INT4_ACT", None)
    vec = bool(native.lib().lynx_q16_pays())
    assert native.default_int4_act() == ("q16" if vec else "f32")
    flags = open("/proc/cpuinfo").read() if platform.system() == "Linux" else ""
    if platform.machine() == "x86_64" and " avx2" in flags and " fma" in flags and " avx512f" not in flags:
        assert vec  # built for this host (-march=native): an AVX2 build without AVX-512
    eng = Engine.from_pretrained(q3, device="cpu", int4=True, int4_group=32)
    assert eng.model.placement.int4_act == native.default_int4_act()
    assert eng.model.layers[0]._native is None or eng.model.layers[0]._native.moe_plan.act == native.act_code(None)
    monkeypatch.setattr(native, "INT4_ACT", "q8")
    assert native.default_int4_act() == "q8"


@pytest.mark.parametrize("llc", [1 << 10, 1 << 40])
def test_expert_read_order_follows_the_cache_rule(q3, llc, monkeypatch):
    """The builder marks 16-bit experts streamed when all layers' experts outgrow the last-level
    cache (native.streamed), and keeps streamed bf16 experts of short rows in packed rows
    (native.pack_choice); the flag and the layout reach the layer's native plan and the module path,
    and the logits are the same bits either way (the read order changes, not the sums; on fp32
    activations: bf16 ones are read by other kernels streamed or not, test_bf16_act_streamed_or_not)."""
    monkeypatch.setattr(native, "llc_bytes", lambda: llc)
    eng = Engine.from_pretrained(q3, device="cpu", dtype="bfloat16", max_num_seqs=3, bf16_act="f32")
    moe = [layer.mlp.experts for layer in eng.model.layers]
    streamed = llc == 1 << 10
    rows = [ex.weights() for ex in moe]
    assert all(ex.streamed is streamed for ex in moe)
    packs = native.pack_group() > 0 and streamed  # the q3 test model's I and D are multiples of 8
    assert all(ex.packed_rows == (packs, packs) for ex in moe)
    if packs:
        assert not torch.equal(moe[0].gate_up.data, rows[0][0])  # the parameters hold the packed layout
    got = _decode(eng, 3)
    bits = int(streamed) | (native.MOE_GU_PACKED | native.MOE_DN_PACKED if packs else 0)
    assert all(nl.moe_plan.stream == bits for nl in (layer._native for layer in eng.model.layers))
    for ex, (gu, dn) in zip(moe, rows):
        ex.streamed = not ex.streamed  # re-laid out in place
        assert ex.packed_rows == (not packs and native.pack_group() > 0,) * 2
        assert torch.equal(ex.weights()[0], gu) and torch.equal(ex.weights()[1], dn)
    monkeypatch.setattr(native_layer, "NATIVE_LAYERS", False)  # the module path, the other order
    assert torch.equal(_decode(eng, 3), got)


def test_no_repack_keeps_streamed_experts_row_major(q3, monkeypatch):
    """repack=False (the CLI's --no-repack, llama.cpp's flag) keeps streamed bf16 experts row-major:
    the same logits as packed (the same sums)."""
    from lynx_edge.cli.common import engine_options

    assert engine_options(no_repack=True)["repack"] is False and "repack" not in engine_options()
    monkeypatch.setattr(native, "llc_bytes", lambda: 1 << 10)
    got = {}
    for repack in (True, False):
        eng = Engine.from_pretrained(q3, device="cpu", dtype="bfloat16", max_num_seqs=2, repack=repack)
        ex = eng.model.layers[0].mlp.experts
        assert ex.streamed and ex.packed_rows == ((native.pack_group() > 0 and repack),) * 2
        got[repack] = _decode(eng, 2, 3)
    assert torch.equal(got[True], got[False])


def test_offload_of_packed_experts_moves_them_row_major(q3, monkeypatch):
    """attach_offload on a model whose streamed bf16 experts sit in packed rows moves them into the
    host store row-major (StackedExperts.weights): the same store bytes and logits as from a model
    built row-major."""
    from lynx_edge.offload import OffloadOptions, attach_offload

    if native.pack_group() == 0:
        pytest.skip("this build reads no packed rows (the AVX-512 path)")
    got = {}
    for llc in (1 << 10, 1 << 40):  # streamed (packed) / from cache (row-major)
        monkeypatch.setattr(native, "llc_bytes", lambda llc=llc: llc)
        eng = Engine.from_pretrained(q3, device="cpu", dtype="bfloat16", max_num_seqs=2)
        assert eng.model.layers[0].mlp.experts.packed_rows == ((True, True) if llc == 1 << 10 else (False, False))
        rt = attach_offload(eng.model, OffloadOptions(profile="cpu-only", expert_slots=4, cpu_compute="never"))
        got[llc] = (rt.store.layers[0].clone(), _decode(eng, 2, 3))
    assert torch.equal(got[1 << 10][0], got[1 << 40][0])  # the store's bytes of layer 0's experts
    assert torch.equal(got[1 << 10][1], got[1 << 40][1])


def test_last_level_cache_is_read_from_sysfs(tmp_path):
    for index, size in ((2, "512K"), (3, "32768K")):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    assert native.llc_bytes.__wrapped__(str(tmp_path)) == 32 << 20
    (tmp_path / "index3" / "size").unlink()
    assert native.llc_bytes.__wrapped__(str(tmp_path)) == 512 << 10  # no L3: the L2
    (tmp_path / "index2" / "size").write_text("lots\n")
    assert native.llc_bytes.__wrapped__(str(tmp_path / "none")) is None
    assert native.llc_bytes.__wrapped__(str(tmp_path)) is None
    assert native.streamed(1) is False or native.llc_bytes() is None  # 1 byte fits any cache


def _scale_qk_norms(eng: Engine, how: str) -> None:
    """Every layer's q and k norm weights × 1.5: written in place, or replaced by new storage."""
    with torch.no_grad():
        for layer in eng.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                if how == "in place":
                    norm.weight.mul_(1.5)
                else:  # a new Parameter: new storage, and not the object any plan holds
                    norm.weight = torch.nn.Parameter(norm.weight.data * 1.5, requires_grad=False)


@pytest.mark.parametrize("how", ["in place", "replaced"])
@pytest.mark.parametrize("model", ["q3", "olmoe_clip"])
def test_changed_qk_norm_weights_are_read(model, how, request, monkeypatch):
    """A q/k norm weight written in place or replaced after the plans were made (a reload, an
    adapter swap) is what the next decode step reads, on the layer call and the module path alike
    (before: the layer call read a stale fp32 copy of Qwen3's, and OLMoE's through a dangling pointer;
    the module path OLMoE's replaced Parameter through native_form's cached answer)."""
    path = request.getfixturevalue(model)

    def changed_after_decoding() -> torch.Tensor:
        eng = Engine.from_pretrained(path, device="cpu", dtype="bfloat16", max_num_seqs=2)
        _decode(eng, 2)  # plans and decisions made and kept
        _scale_qk_norms(eng, how)
        return _decode(eng, 2)

    got_layer = changed_after_decoding()
    monkeypatch.setattr(native_layer, "NATIVE_LAYERS", False)
    got_module = changed_after_decoding()
    ref_eng = Engine.from_pretrained(path, device="cpu", dtype="bfloat16", max_num_seqs=2)
    _scale_qk_norms(ref_eng, how)  # changed before anything was decided
    ref = _decode(ref_eng, 2)
    assert torch.equal(got_layer, ref)
    assert torch.equal(got_module, ref)
    untouched = _decode(Engine.from_pretrained(path, device="cpu", dtype="bfloat16", max_num_seqs=2), 2)
    assert not torch.equal(ref, untouched)  # the change reaches the logits at all


@pytest.fixture(scope="module")
def oss(tmp_path_factory):
    """gpt-oss (test_gpt_oss's tiny checkpoint, 16-bit, and the same packed as published MXFP4): sinks,
    q/k/v/o biases, window-8 layers on a ring between full ones, a biased router, biased experts with
    the clamped SwiGLU."""
    import test_gpt_oss

    root = tmp_path_factory.mktemp("oss")
    ckpt = test_gpt_oss.build(root / "bf16")
    return ckpt, test_gpt_oss.pack_mxfp4(ckpt, root / "mxfp4")


@pytest.mark.parametrize("case", [
    ("bf16", "bfloat16", 1, {}), ("bf16", "bfloat16", 3, {}), ("bf16", "float32", 2, {}), ("mxfp4", "bfloat16", 2, {}),
    ("mxfp4", "float32", 3, dict(int4_act="f32")), ("mxfp4", "bfloat16", 2, dict(int4_act="q8")),
    ("bf16", "bfloat16", 2, dict(int4=True)), ("mxfp4", "bfloat16", 4, dict(lynx="on"))],
    ids=["bf16-B1", "bf16-B3", "fp32-B2", "mxfp4", "mxfp4-f32", "mxfp4-q8", "int4-as-mxfp4", "lynx"])
def test_gpt_oss_layer_call_bit_equal(oss, case, monkeypatch):
    """gpt-oss's layers run the layer call (sinks and ring inside the attention half, the biased router,
    the MXFP4 or 16-bit experts with their biases and clamped SwiGLU in the MoE half; the stack call
    over ring and full caches alike) bit-equal to the module path, over 12 steps that run past the
    window and rows of different lengths."""
    ckpt, kw = oss[case[0] == "mxfp4"], dict(dtype=case[1], **case[3])
    B = case[2]
    eng = Engine.from_pretrained(ckpt, device="cpu", max_num_seqs=B, **kw)
    assert eng._cache(B).rings == [72, 0, 72, 0]  # window layers on a ring (kv_cache.ring_period)
    got = _decode(eng, B, steps=12)
    nls = [layer._native for layer in eng.model.layers]
    assert all(isinstance(nl, NativeLayer) and nl.moe_plan is not None for nl in nls)
    assert [nl.attn_plan.ring for nl in nls] == [72, 0, 72, 0] and all(nl.attn_plan.sinks for nl in nls)
    mx = case[0] == "mxfp4" or kw.get("int4")
    assert nls[0].moe_plan.fmt == (native.FMT_MXFP4 if mx else native._FMT[getattr(torch, case[1])])
    assert nls[0].moe_plan.act_kind == 1
    monkeypatch.setattr(native_layer, "NATIVE_LAYERS", False)
    ref = _decode(Engine.from_pretrained(ckpt, device="cpu", max_num_seqs=B, **kw), B, steps=12)
    monkeypatch.setattr(native_layer, "NATIVE_LAYERS", True)
    assert torch.equal(got, ref)


def test_gpt_oss_sinks_biases_and_ring_are_read(oss, monkeypatch):
    """The layer call reads what the module path reads: sinks, the router's and the experts' biases
    written in place after the plan was made (copied to fp32 for it: the plan is rebuilt); a plan
    without its sinks gives other logits."""
    def changed_after_decoding(eng) -> torch.Tensor:
        _decode(eng, 2)
        with torch.no_grad():
            for layer in eng.model.layers:
                layer.self_attn.sinks.add_(1.0)
                layer.mlp.gate.bias.mul_(-1.0)
                layer.mlp.experts.gate_up_b.add_(0.25)
        return _decode(eng, 2, steps=12)

    eng = Engine.from_pretrained(oss[0], device="cpu", dtype="bfloat16", max_num_seqs=2)
    got = changed_after_decoding(eng)
    monkeypatch.setattr(native_layer, "NATIVE_LAYERS", False)
    ref = changed_after_decoding(Engine.from_pretrained(oss[0], device="cpu", dtype="bfloat16", max_num_seqs=2))
    monkeypatch.setattr(native_layer, "NATIVE_LAYERS", True)
    assert torch.equal(got, ref)
    plan = eng.model.layers[0]._native.attn_plan
    plan.sinks = None  # the softmax without its sinks: the comparison must notice
    assert not torch.equal(_decode(eng, 2, steps=12), ref)


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    from lfm2_tiny import make_lfm2_moe

    # conv and projection biases, a state of 3 (kernel 4), the published first layers' types (conv and
    # attention), the first 2 layers dense (module path), sigmoid-scored router with expert bias
    return make_lfm2_moe(tmp_path_factory.mktemp("nl") / "lfm2", seed=1, conv_bias=True, conv_L_cache=4,
                         num_dense_layers=2)


@pytest.mark.parametrize("dtype,B,four_bit", [("bfloat16", 1, False), ("bfloat16", 3, False), ("float32", 2, False),
                                              ("bfloat16", 3, True)])
def test_lfm2_layer_call_equals_the_module_path(lfm2, dtype, B, four_bit, monkeypatch):
    """LFM2's MoE layers in the layer call — a short convolution (in_proj, the conv over the row's
    state, out_proj: lynx_layer_attn's conv branch) or attention in the first half, its sigmoid scorer
    with expert bias between the calls, the experts in the second — against the module path with the
    torch convolution (state.causal_conv, not the native call the layer call shares its code with):
    bit-equal in bf16 (and with --int4 --int4-attn), fp32 to rounding. Every MoE layer takes the call."""
    from lynx_edge.models.lfm2_moe import ShortConv

    kw = dict(dtype=dtype, int4=four_bit, int4_attn=four_bit, int4_group=32)
    eng = Engine.from_pretrained(lfm2, device="cpu", max_num_seqs=B, **kw)
    calls = []
    real = native.layer_attn
    monkeypatch.setattr(native, "layer_attn", lambda plan, *a: calls.append(bool(plan.conv_w)) or real(plan, *a))
    got = _decode(eng, B)
    layers = eng.model.layers
    moe = [layer for layer in layers if layer.is_moe]
    assert all(isinstance(layer._native, NativeLayer) for layer in moe) and not any(layer._native for layer in layers
                                                                                   if not layer.is_moe)
    n_conv = sum(isinstance(layer.self_attn, ShortConv) for layer in moe)
    assert 0 < n_conv < len(moe) and calls.count(True) == 5 * n_conv and calls.count(False) == 5 * (len(moe) - n_conv)
    monkeypatch.setattr(native_layer, "NATIVE_LAYERS", False)
    monkeypatch.setattr(ShortConv, "_native_ok", lambda self, x, state: False)
    ref = _decode(Engine.from_pretrained(lfm2, device="cpu", max_num_seqs=B, **kw), B)
    if dtype == "bfloat16":
        assert torch.equal(got, ref)
    else:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_lfm2_layer_call_follows_a_rewritten_conv(lfm2):
    """The plan points into the conv's weight: a weight written in place is read at the next step, a
    replaced one rebuilds the plan (its key follows both)."""
    eng = Engine.from_pretrained(lfm2, device="cpu", dtype="bfloat16")
    layer = next(layer for layer in eng.model.layers if layer.is_moe and hasattr(layer.self_attn, "native_conv"))
    before = _decode(eng, 1)
    plan = layer._native
    with torch.no_grad():
        layer.self_attn.conv.weight.mul_(0.5)
    after = _decode(eng, 1)
    assert not torch.equal(before, after) and layer._native is not plan  # the key saw the in-place write


def test_bf16_act_streamed_or_not(q3, monkeypatch):
    """--bf16-act bf16 rounds every expert's inputs whether its experts are streamed (the fp32 rows on
    the rounded inputs) or read from cache (vdpbf16ps tiles): logits within a bf16 rounding of each
    other, and both away from the fp32-activation logits by more than that."""
    if not native.bf16_dp():
        pytest.skip("this build has no bf16 rows on bf16 inputs (AVX512-BF16)")
    got = {}
    for llc, act in ((1 << 40, "bf16"), (1 << 10, "bf16"), (1 << 40, "f32")):
        monkeypatch.setattr(native, "llc_bytes", lambda llc=llc: llc)
        eng = Engine.from_pretrained(q3, device="cpu", dtype="bfloat16", max_num_seqs=3, bf16_act=act)
        assert eng.model.layers[0].mlp.experts.streamed is (llc == 1 << 10)
        got[llc, act] = _decode(eng, 3).float()
    cached, streamed, exact = got[1 << 40, "bf16"], got[1 << 10, "bf16"], got[1 << 40, "f32"]
    scale = cached.abs().max().item()
    assert (cached - streamed).abs().max().item() <= 2**-8 * scale  # seen: equal
    assert (cached - exact).abs().max().item() > (cached - streamed).abs().max().item()


def test_bf16_act_switched_after_build_rebuilds_the_plans(q3):
    """The activations are part of a plan's key: switching them on a built engine (as benchmarks/bf16_act.py
    does) reaches the fused q/k/v, o_proj, the experts and the head, and switching back gives the first
    logits again, bit for bit."""
    from lynx_edge.build import _bf16_activations

    if not native.bf16_dp():
        pytest.skip("this build has no bf16 rows on bf16 inputs (AVX512-BF16)")
    eng = Engine.from_pretrained(q3, device="cpu", dtype="bfloat16", max_num_seqs=2, bf16_act="f32")
    first = _decode(eng, 2)
    for act, code in (("bf16", native.ACT_BF16), ("f32", 0)):
        _bf16_activations(eng.model, act)
        got = _decode(eng, 2)
        nl = eng.model.layers[0]._native
        assert (nl.attn_plan.qkv.act, nl.attn_plan.o.act, nl.moe_plan.act) == (code, code, code)
        assert eng.model.__dict__["_native_head"][1][2].act == code
        assert torch.equal(got, first) is (act == "f32")
