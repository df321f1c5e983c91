"""Qwen3-Next and Qwen3.5/3.6-MoE (issue 13): Gated DeltaNet + gated attention hybrids.

References: transformers 5.x (config classes for the defaults; Qwen3NextForCausalLM and
Qwen3_5MoeForConditionalGeneration for logits and greedy ids; its torch fallbacks of the chunked and
recurrent gated delta rule), and recomputation from scratch for every cached path (decode, chunked
prefill, batched rows at mixed lengths, chat-turn reuse). Tiny random checkpoints are written by
transformers with the published shapes shrunk (the published ratios kept: 2 value heads per key
head, 3 linear layers per full one, partial rotary 0.25);
Qwen3.5 keeps the nested text_config and a (tiny) vision tower, whose weights are never loaded.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import TEXT, RouteSpy, write_tokenizer

from lynx_edge import Engine
from lynx_edge.config import ConfigError, ModelConfig
from lynx_edge.kv_cache import KVCache
from lynx_edge.lynx import LynxConfig
from lynx_edge.models import FAMILIES
from lynx_edge.models import delta_rule
from lynx_edge.modelinfo import param_counts
from lynx_edge.step import decode_step, prefill

FIXTURE = Path(__file__).parent / "fixtures" / "qwen3-next-80b-a3b"
V = 320
# published Qwen3-Next-80B-A3B shapes, shrunk: D 2048 → 64, heads 16/2 → 4/2 (head_dim 256 → 16),
# linear heads 16 qk / 32 v → 2 / 4 (dims 128 → 8 / 12: k ≠ v dims catch a swapped transpose),
# experts 512 top-10 → 16 top-4 (I 512 → 32: INT4 groups of 32), shared expert 512 → 40
TEXT_SHAPE = dict(vocab_size=V, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                  linear_value_head_dim=12, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                  shared_expert_intermediate_size=40, max_position_embeddings=512, eos_token_id=2, pad_token_id=0)


def _sharpen(model) -> None:
    """Non-trivial norms, decays and clear-cut routers (the random init leaves norms at 0 / 1)."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
            elif n.endswith("linear_attn.norm.weight"):
                p.uniform_(0.5, 1.5)
            elif n.endswith("norm.weight"):  # zero-centred: the weight is an offset from 1
                p.uniform_(-0.5, 0.5)
            elif n.endswith("dt_bias"):
                p.uniform_(-1, 1)
            elif n.endswith("lm_head.weight"):
                p.normal_(0, 0.3)  # logits of a few units, so 1e-4 is a real bound


def _add_mtp(path: Path) -> None:
    """Multi-token-prediction tensors as the published checkpoints carry them (per expert and fused)."""
    from safetensors.torch import load_file, save_file

    f = path / "model.safetensors"
    t = load_file(f)
    t["mtp.fc.weight"] = torch.randn(64, 128)
    t["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = torch.randn(32, 64)
    t["mtp.layers.0.mlp.experts.gate_up_proj"] = torch.randn(16, 64, 64)
    save_file(t, str(f), metadata={"format": "pt"})


def build_next(path: Path, seed: int = 0, **over) -> Path:
    import transformers

    cfg = transformers.Qwen3NextConfig(**{**TEXT_SHAPE, "mlp_only_layers": [1], "intermediate_size": 48,
                                          "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                                                              "partial_rotary_factor": 0.25}, **over})
    torch.manual_seed(seed)
    model = transformers.Qwen3NextForCausalLM(cfg)
    _sharpen(model)
    model.save_pretrained(path)
    _add_mtp(path)
    write_tokenizer(path)
    return path


def build_q35(path: Path, seed: int = 1) -> Path:
    import transformers

    text = {**TEXT_SHAPE, "head_dim": 32,  # rotary 8 dims = 4 frequencies over the three M-RoPE sections
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                "mrope_section": [2, 1, 1], "mrope_interleaved": True}}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  num_position_embeddings=16)
    cfg = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision)
    torch.manual_seed(seed)
    model = transformers.Qwen3_5MoeForConditionalGeneration(cfg)
    _sharpen(model)
    model.save_pretrained(path)
    _add_mtp(path)
    write_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("q3next")
    return {"next": build_next(root / "next"), "q35": build_q35(root / "q35")}


def hf(path: Path):
    import transformers

    cls = transformers.Qwen3_5MoeForConditionalGeneration if "q35" in path.name else transformers.Qwen3NextForCausalLM
    return cls.from_pretrained(path, dtype=torch.float32).eval()


def eng_of(path: Path, **kw) -> Engine:
    return Engine.from_pretrained(path, device="cpu", dtype=kw.pop("dtype", torch.float32), **kw)


def all_logits(eng, ids, row: int = 0) -> torch.Tensor:
    return prefill(eng.model, eng._cache(row + 1), row, ids, 0, logits_for="all")[0]


def ids_of(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, V, (n,), generator=g).tolist()


# config --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family,cls", [("qwen3_next", "Qwen3NextConfig"), ("qwen3_5_moe", "Qwen3_5MoeTextConfig")])
def test_defaults_table_matches_transformers(family, cls):
    import transformers

    C = getattr(transformers, cls)
    declared = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(C)}
    ref = C()
    kwarg_defaults = {"partial_rotary_factor": ref.rope_parameters["partial_rotary_factor"],
                      "full_attention_interval": 4 if ref.layer_types[3] == "full_attention" else None}
    for name, value in FAMILIES[family].DEFAULTS.items():
        want = C.default_theta if name == "rope_theta" else kwarg_defaults.get(name, declared.get(name, "<none>"))
        assert want == value and type(want) is type(value), f"{family}.{name}: table {value!r}, transformers {want!r}"
    ours = ModelConfig.from_dict({"model_type": family})
    assert ours.head_dim == ref.head_dim and ours.rope.dim == int(ref.head_dim * 0.25)
    assert ours.arch.layer_types == tuple(ref.layer_types)
    assert (ours.num_experts, ours.top_k, ours.vocab_size) == (ref.num_experts, ref.num_experts_per_tok, ref.vocab_size)
    assert ours.norm_topk_prob is True and ours.shared_expert_intermediate_size == ref.shared_expert_intermediate_size


def test_nested_text_config_and_refusals():
    cfg = ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": {"num_hidden_layers": 8, "num_experts": 32},
                                 "vision_config": {"depth": 2}})
    assert cfg.num_layers == 8 and cfg.num_experts == 32 and cfg.moe_layers == (True,) * 8
    assert cfg.arch.split_proj and cfg.arch.layer_types[3] == "full_attention"
    with pytest.raises(ConfigError, match="layer_types"):
        ModelConfig.from_dict({"model_type": "qwen3_next", "num_hidden_layers": 2, "layer_types": ["mamba", "x"]})
    with pytest.raises(ConfigError, match="multiple of linear_num_key_heads"):
        ModelConfig.from_dict({"model_type": "qwen3_next", "linear_num_value_heads": 24})


# the gated delta rule --------------------------------------------------------------------------------
def _rule_inputs(B=2, T=150, Hk=2, Hv=4, dk=8, dv=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, Hk, dk, generator=g) for _ in range(2))
    v = torch.randn(B, T, Hv, dv, generator=g)
    a = -torch.rand(B, T, Hv, generator=g) * 0.5  # log decays ≤ 0
    beta = torch.rand(B, T, Hv, generator=g)
    s0 = torch.randn(B, Hv, dk, dv, generator=g) * 0.1
    return q, k, v, a, beta, s0


@pytest.mark.parametrize("T,chunk", [(1, 64), (37, 16), (150, 64), (128, 64)])
def test_chunked_equals_recurrent_and_transformers(T, chunk):
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    q, k, v, g, beta, s0 = _rule_inputs(T=T)
    args = delta_rule.prepare(q, k, v, g, beta)
    o_r, s_r = delta_rule.recurrent(*args, s0)
    o_c, s_c = delta_rule.chunked(*args, s0, chunk=chunk)
    torch.testing.assert_close(o_c, o_r, rtol=0, atol=2e-6)
    torch.testing.assert_close(s_c, s_r, rtol=0, atol=2e-6)
    ref_o, ref_s = m.torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk, initial_state=s0,
                                                  output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o_c.transpose(1, 2), ref_o, rtol=0, atol=2e-6)
    torch.testing.assert_close(s_c, ref_s, rtol=0, atol=2e-6)
    ref_o, ref_s = m.torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                                      use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o_r.transpose(1, 2), ref_o, rtol=0, atol=2e-6)


# against transformers ----------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["next", "q35"])
def test_prefill_logits_and_greedy_match_transformers(models, case):
    path = models[case]
    eng, ref = eng_of(path), hf(path)
    ids = ids_of(150)  # > one 64-token chunk of the delta rule, not a multiple of it
    ours = all_logits(eng, ids)
    with torch.no_grad():
        want = ref(input_ids=torch.tensor([ids])).logits[0].float()
    assert want.abs().max() > 1  # logits of a few units: the 1e-4 bound is not trivially met
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)
    prompt = ids[:24]
    out = [t for c in eng.stream(prompt, max_new_tokens=32, do_sample=False, ignore_eos=True) for t in c.token_ids]
    gen = ref.generate(input_ids=torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                       eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert out == gen


def test_parity_is_sensitive(models, monkeypatch):
    """The comparison above fails for a plain RMSNorm instead of the zero-centred one."""
    from lynx_edge.models import qwen3_next as qn
    from lynx_edge.models.layers import RMSNorm

    path = models["next"]
    ids = ids_of(40)
    with torch.no_grad():
        want = hf(path)(input_ids=torch.tensor([ids])).logits[0].float()
    monkeypatch.setattr(qn, "norm", RMSNorm)
    assert (all_logits(eng_of(path), ids) - want).abs().max() > 1e-2


def test_checkpoint_names_map_and_extras_are_skipped(models):
    from lynx_edge.checkpoint import Checkpoint

    for case, skipped in (("next", ("mtp.",)), ("q35", ("mtp.", "model.visual."))):
        names = Checkpoint(models[case]).names()
        assert all(any(n.startswith(s) for n in names) for s in skipped)  # they are there, and not loaded
        eng = eng_of(models[case])
        assert sum(isinstance(layer.self_attn, FAMILIES["qwen3_next"].GatedDeltaNet) for layer in eng.model.layers) == 3


# caches ---------------------------------------------------------------------------------------------------
def _states(kv, row):
    return [t[row].clone() for layer in kv.layers for t in layer]


def test_cached_decode_equals_recomputation(models):
    eng = eng_of(models["next"])
    ids = ids_of(90, seed=3)
    full = all_logits(eng, ids)  # [T, V] from one prefill
    kv = eng._cache(1)
    logits = prefill(eng.model, kv, 0, ids[:20])
    torch.testing.assert_close(logits[0], full[19], rtol=0, atol=1.5e-5)
    for t in range(20, len(ids)):
        logits = decode_step(eng.model, kv, [0], torch.tensor([ids[t]]))
        torch.testing.assert_close(logits[0], full[t], rtol=0, atol=1.5e-5)


def test_chunked_prefill_state_equals_token_by_token(models):
    """Row 0: one prefill; row 1: chunks of 5, 64, 61 (the core's chunked prefill); row 2: one token
    at a time through decode steps. Conv and recurrent states, K/V and the last logits agree."""
    eng = eng_of(models["next"])
    ids = ids_of(130, seed=4)
    kv = eng._cache(3)
    kv.layers[0][1].normal_()  # stale state from an earlier sequence: must not leak into a new one
    whole = prefill(eng.model, kv, 0, ids)
    at = 0
    for n in (5, 64, 61):
        chunked = prefill(eng.model, kv, 1, ids[at:at + n], at)
        at += n
    prefill(eng.model, kv, 2, ids[:1])
    for t in ids[1:]:
        step = decode_step(eng.model, kv, [2], torch.tensor([t]))
    for a, b, c in zip(_states(kv, 0), _states(kv, 1), _states(kv, 2)):
        torch.testing.assert_close(b, a, rtol=0, atol=1.5e-5)
        torch.testing.assert_close(c, a, rtol=0, atol=1.5e-5)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1.5e-5)
    torch.testing.assert_close(step, whole, rtol=0, atol=1.5e-5)


@pytest.mark.parametrize("case", ["next", "q35"])
def test_batched_equals_single_at_mixed_lengths(models, case):
    eng = eng_of(models[case])
    prompts = [ids_of(n, seed=n) for n in (5, 37, 90, 12)]
    batched = [[] for _ in prompts]
    for c in eng.stream_batch(prompts, max_new_tokens=10, ignore_eos=True):
        batched[c.index] += c.token_ids
    for p, got in zip(prompts, batched):  # each alone, in a row an earlier sequence has used
        alone = [t for c in eng.stream(p, max_new_tokens=10, ignore_eos=True) for t in c.token_ids]
        eng.reset()
        assert got == alone


def test_chat_turns_continue_the_state_or_recompute(models):
    eng, fresh = eng_of(models["next"]), eng_of(models["next"])

    def run(e, ids):
        return [t for c in e.stream(ids, max_new_tokens=6, ignore_eos=True) for t in c.token_ids]

    turn1 = ids_of(30, seed=5)
    out1 = run(eng, turn1)
    turn2 = turn1 + out1 + ids_of(9, seed=6)  # extends the whole session: the state is continued
    got = run(eng, turn2)
    assert eng.last_stats["cached_prompt_tokens"] == len(turn1) + len(out1) - 1
    fresh.reset()
    assert got == run(fresh, turn2)
    turn3 = turn2[:20] + ids_of(7, seed=7)  # diverges inside the session: a state cannot be cut back
    got = run(eng, turn3)
    assert eng.last_stats["cached_prompt_tokens"] == 0
    fresh.reset()
    assert got == run(fresh, turn3)


def test_bf16_keeps_an_fp32_recurrent_state(models):
    """The device default dtype: conv state in bf16 (exact copies of bf16 inputs), the recurrent
    state accumulated in fp32; close to the fp32 model (obs.: 98% argmax agreement, |Δ| 0.08)."""
    f, b = eng_of(models["next"]), eng_of(models["next"], dtype=torch.bfloat16)
    assert [t.dtype for t in b._cache(1).layers[0]] == [torch.bfloat16, torch.float32]
    ids = ids_of(150)
    lf, lb = all_logits(f, ids), all_logits(b, ids)
    assert (lf.argmax(-1) == lb.argmax(-1)).float().mean() > 0.9 and (lf - lb).abs().max() < 0.3


def test_mixed_step_packing_is_off_for_state(models):
    """A packed mixed step runs a prompt chunk as one token per row, side by side: a state must see
    them in order, so the core keeps prefill chunks in their own forwards for this model."""
    from lynx_edge.core import EngineCore

    eng = eng_of(models["next"])
    assert EngineCore(eng, max_num_seqs=2, mixed_steps=True).mixed_steps is False


def test_state_bytes_per_sequence_on_the_published_config():
    cfg = ModelConfig.from_file(FIXTURE / "config.json")
    linear, full = 36, 12  # every 4th layer full attention
    C = 2 * 16 * 128 + 32 * 128  # conv channels: q, k (16 heads × 128), v (32 × 128)
    state = linear * (C * 3 * 2 + 32 * 128 * 128 * 4)  # conv: last 3 inputs, bf16; recurrent: fp32
    assert KVCache.state_bytes(cfg, torch.bfloat16) == state == 77_266_944  # 73.7 MiB per sequence
    per_tok = full * 2 * 2 * 256 * 2  # K and V, 2 KV heads × 256, bf16: 24 KiB per token
    for B, ctx in ((1, 4096), (4, 32768)):
        assert KVCache.bytes_needed(cfg, B, ctx, torch.bfloat16) == B * (state + ctx * per_tok)


# LYNX, offload, INT4 ----------------------------------------------------------------------------------------
class _Watch(RouteSpy):
    def record(self, scores, is_decode, ids, w, exact_ids):
        dec = is_decode if torch.is_tensor(is_decode) else torch.full((len(ids),), bool(is_decode))
        return ids, exact_ids, dec.reshape(-1).bool()


def test_lynx_invariants(models):
    eng = eng_of(models["next"], lynx=LynxConfig(mode="lynx", j=0))
    assert eng.model.routing.spec.num_shared_experts == 1  # the gated shared expert always runs
    watch = _Watch(eng.model.routing.route, eng.model.routing.spec)
    eng.model.routing.route = watch
    eng.generate_batch([ids_of(n, seed=n) for n in (6, 20, 33, 9, 14, 27, 3, 40)], max_new_tokens=6, ignore_eos=True)
    K, remapped, shrunk = eng.cfg.top_k, 0, 0
    for ids, ids0, dec in watch.calls:
        assert all(len(set(r)) == K for r in ids.tolist())  # k distinct
        assert torch.equal(ids[:, 0], ids0[:, 0])  # top-1 kept
        assert ids.unique().numel() <= ids0.unique().numel()  # the union never grows
        assert torch.equal(ids[~dec], ids0[~dec])  # prefill exact
        remapped += int((ids != ids0).any(1).sum())
        shrunk += ids.unique().numel() < ids0.unique().numel()
    assert remapped > 0 and shrunk > 0


def test_offload_equals_resident(models):
    ref = eng_of(models["next"])
    prompts = [ids_of(n, seed=n) for n in (7, 19, 33)]
    want = ref.generate_batch(prompts, max_new_tokens=8, ignore_eos=True)
    eng = eng_of(models["next"], offload=True, expert_slots=12, policy="lru")
    ids = ids_of(70)
    torch.testing.assert_close(all_logits(eng, ids), all_logits(ref, ids), atol=1e-5, rtol=1e-5)
    chunks = list(eng.stream_batch(prompts, max_new_tokens=8, ignore_eos=True))
    texts = [""] * len(prompts)
    for c in chunks:
        texts[c.index] += c.text
    assert texts == want
    assert chunks[-1].stats["offload"]["misses"] > 0


def test_int4_runs_and_stays_close(models):
    from lynx_edge.quant.experts import Int4MoEExperts

    ref = eng_of(models["q35"])
    q = Engine.from_pretrained(models["q35"], device="cpu", int4=True, int4_group=32)
    assert all(isinstance(q.model.layers[i].mlp.experts, Int4MoEExperts) for i in q.cfg.moe_layer_ids)
    ids = ref.tokenizer.encode(TEXT[:400])

    def ppl(eng):
        lg = all_logits(eng, ids)
        return math.exp(torch.nn.functional.cross_entropy(lg[:-1], torch.tensor(ids[1:])).item())

    assert abs(ppl(q) / ppl(ref) - 1) < 0.05
    assert len(q.generate("def", max_new_tokens=4, ignore_eos=True)) > 0


@pytest.mark.parametrize("case", ["next", "q35"])
def test_quantize_calibrates_through_the_hybrid_layers(models, case, tmp_path):
    """`lynx-edge quantize` (GPTQ): calibration runs layer by layer through DeltaNet and gated
    attention (their state caches made per window); the 4-bit checkpoint loads and stays close."""
    from typer.testing import CliRunner

    from lynx_edge.cli.main import app
    from lynx_edge.quant.experts import Int4MoEExperts

    calib = tmp_path / "calib.txt"
    calib.write_text(TEXT)
    r = CliRunner().invoke(app, ["quantize", str(models[case]), "-o", str(tmp_path / "q"), "-g", "32",
                                 "--calib", str(calib)])
    assert r.exit_code == 0, r.output
    q, ref = eng_of(tmp_path / "q"), eng_of(models[case])
    assert all(isinstance(q.model.layers[i].mlp.experts, Int4MoEExperts) for i in q.cfg.moe_layer_ids)
    ids = ref.tokenizer.encode(TEXT[:400])
    nll = [torch.nn.functional.cross_entropy(all_logits(e, ids)[:-1], torch.tensor(ids[1:])).item() for e in (q, ref)]
    assert abs(math.exp(nll[0] - nll[1]) - 1) < 0.05


# parameter counts -----------------------------------------------------------------------------------------
def _hand_count(c: dict, V: int, dense: set[int] = frozenset()) -> tuple[int, int]:
    """(total, active) from the config's arithmetic alone."""
    D, L, E, K, I, Is = (c[k] for k in ("hidden_size", "num_hidden_layers", "num_experts", "num_experts_per_tok",
                                        "moe_intermediate_size", "shared_expert_intermediate_size"))
    H, Hkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    Hk, Hv, dk, dv, Kc = (c[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                         "linear_value_head_dim", "linear_conv_kernel_dim"))
    Cc = 2 * Hk * dk + Hv * dv
    linear = (Cc + Hv * dv) * D + 2 * Hv * D + Cc * Kc + 2 * Hv + dv + Hv * dv * D  # projections, conv, dt, A, norm, out
    full = 2 * H * hd * D + 2 * Hkv * hd * D + H * hd * D + 2 * hd  # q+gate, k, v, o, q/k norms
    shared = E * D + 3 * D * Is + D  # router, shared expert, its gate
    total = active = 2 * V * D + D
    for i in range(L):
        mix = full if (i + 1) % 4 == 0 else linear
        if i in dense:
            mlp = mlp_active = 3 * D * c["intermediate_size"]
        else:
            mlp, mlp_active = shared + E * 3 * D * I, shared + K * 3 * D * I
        total += 2 * D + mix + mlp
        active += 2 * D + mix + mlp_active
    return total, active


def test_info_counts_match_the_arithmetic_and_the_published_totals(models):
    from typer.testing import CliRunner

    from lynx_edge.cli.main import app

    raw = json.loads((FIXTURE / "config.json").read_text())
    r = CliRunner().invoke(app, ["info", str(FIXTURE), "-o", "json"])
    assert r.exit_code == 0, r.output
    p = json.loads(r.stdout)["params"]
    total, active = _hand_count(raw, 151936)
    assert (p["total"], p["active"]) == (total, active)
    assert p["total"] == pytest.approx(80e9, rel=0.01)  # "80B in total"
    # "3B activated": 3.25B without the input embedding and the output head (3.87B with them)
    assert round((p["active"] - 2 * 151936 * 2048) / 1e9) == 3
    # the tiny checkpoints: the same arithmetic, and transformers' own count of its text model
    for case in ("next", "q35"):
        cfg = ModelConfig.from_file(models[case] / "config.json")
        c = {**TEXT_SHAPE, "head_dim": cfg.head_dim, "linear_conv_kernel_dim": 4, "intermediate_size": 48}
        dense = {1} if case == "next" else set()
        assert (param_counts(cfg)["total"], param_counts(cfg)["active"]) == _hand_count(c, V, dense)
        ref = hf(models[case])
        text_params = sum(t.numel() for n, t in ref.named_parameters() if "visual" not in n)
        assert param_counts(cfg)["total"] == text_params


def test_family_is_registered():
    assert FAMILIES["qwen3_next"].MODEL_TYPE == "qwen3_next" and FAMILIES["qwen3_5_moe"].MODEL_TYPE == "qwen3_5_moe"
