"""LFM2-MoE (lfm2_moe, LiquidAI LFM2-8B-A1B) against transformers 5.x, the reference.

Tiny random checkpoints are written by transformers from the published config shrunk
(tests/lfm2_tiny.py); checks: the config mapping and its defaults, fp32 prefill logits and 32
greedy tokens, batched = single at mixed lengths, cached decode = recomputation, chunked prefill
state = token-by-token state, the conv state's bytes, the sigmoid + expert-bias router (and LYNX on
its biased scores), offload = resident, INT4, and `lynx-edge info` counts.
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from lfm2_tiny import PUBLISHED, make_lfm2_moe, tiny_config

from lynx_edge import Engine
from lynx_edge.config import ConfigError, ModelConfig
from lynx_edge.kv_cache import KVCache
from lynx_edge.models import FAMILIES
from lynx_edge.step import decode_step, prefill
from conftest import greedy_logits

PROMPT = "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):"


@pytest.fixture(scope="module")
def lfm(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lfm2")
    base = make_lfm2_moe(root / "base")
    out = {"base": base,
           # conv and projection biases, a longer conv kernel (state of 3), untied head (older alias)
           "conv4": make_lfm2_moe(root / "conv4", seed=1, conv_bias=True, conv_L_cache=4, tie_embedding=False)}
    for name, changes in {"scaled": dict(routed_scaling_factor=2.5, norm_topk_prob=False),
                          "nobias": dict(use_expert_bias=False)}.items():
        out[name] = _variant(base, root / name, **changes)
    return out


def _variant(src: Path, dst: Path, **changes) -> Path:
    """The same weights (linked) under a config.json with fields changed."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **changes}))
    return dst


def _hf(path: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _eng(path: Path, **kw) -> Engine:
    return Engine.from_pretrained(path, device="cpu", dtype=torch.float32, **kw)


def _greedy(eng: Engine, ids: list[int], n: int = 32) -> list[int]:
    return [t for c in eng.stream(ids, max_new_tokens=n, do_sample=False, ignore_eos=True) for t in c.token_ids]


# the config mapping ------------------------------------------------------------------------------
def test_defaults_table_matches_transformers():
    import transformers

    cls = transformers.Lfm2MoeConfig
    declared = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(cls)}
    fam = FAMILIES["lfm2_moe"]
    for name, value in fam.DEFAULTS.items():
        if name in fam.READ_BUT_OVERRIDDEN:
            continue
        ref = cls.default_theta if name == "rope_theta" else declared.get(name, "<not a field>")
        assert ref == value and type(ref) is type(value), f"lfm2_moe.{name}: table {value!r}, transformers {ref!r}"
    # a config.json with nothing but model_type and the layer layout, against the class instance
    types = ["conv", "full_attention"] * 16
    ours, ref = ModelConfig.from_dict({"model_type": "lfm2_moe", "layer_types": types}), cls(layer_types=types)
    assert ours.rms_norm_eps == ref.norm_eps and ours.vocab_size == ref.vocab_size
    assert ours.num_kv_heads == ref.num_key_value_heads and ours.num_heads == ref.num_attention_heads
    assert ours.head_dim == ref.hidden_size // ref.num_attention_heads
    assert ours.rope.theta == ref.rope_parameters["rope_theta"] and ours.rope.kind == "default"
    assert (ours.num_experts, ours.top_k, ours.norm_topk_prob) == (ref.num_experts, ref.num_experts_per_tok, True)
    assert ours.tie_word_embeddings is ref.tie_word_embeddings is True
    assert ours.moe_layers == tuple(i >= ref.num_dense_layers for i in range(ref.num_hidden_layers))
    a = ours.arch
    assert (a.conv_L_cache, a.conv_bias, a.use_expert_bias, a.routed_scaling_factor) == \
        (ref.conv_L_cache, ref.conv_bias, ref.use_expert_bias, ref.routed_scaling_factor)


def test_config_spellings_follow_transformers():
    import transformers

    base = {"model_type": "lfm2_moe", "num_hidden_layers": 4, "layer_types": ["conv", "conv", "full_attention", "conv"]}
    for extra in ({"norm_eps": 1e-3}, {"tie_embedding": False}, {"tie_embedding": False, "tie_word_embeddings": True},
                  {"rms_norm_eps": 1e-2}):  # rms_norm_eps is not LFM2's field: transformers ignores it
        ours = ModelConfig.from_dict({**base, **extra})
        ref = transformers.Lfm2MoeConfig(**{k: v for k, v in {**base, **extra}.items() if k != "model_type"})
        assert ours.rms_norm_eps == ref.norm_eps and ours.tie_word_embeddings == ref.tie_word_embeddings, extra
    # LFM2's full_attn_idxs spells the layout when layer_types is absent
    cfg = ModelConfig.from_dict({"model_type": "lfm2_moe", "num_hidden_layers": 4, "full_attn_idxs": [1, 3]})
    assert cfg.arch.layer_types == ("conv", "full_attention", "conv", "full_attention")
    for bad, msg in (({"num_hidden_layers": 4}, "needs layer_types"),
                     ({"num_hidden_layers": 2, "layer_types": ["conv"]}, "1 entries for 2 layers"),
                     ({"num_hidden_layers": 1, "layer_types": ["sliding_attention"]}, "not supported")):
        with pytest.raises(ConfigError, match=msg):
            ModelConfig.from_dict({"model_type": "lfm2_moe", **bad})


def test_checkpoint_names_map_onto_the_model(lfm):
    """Every tensor transformers wrote is used (none skipped as unknown) and every parameter filled."""
    from lynx_edge.checkpoint import Checkpoint
    from lynx_edge.loader import internal_name

    for case in ("base", "conv4"):
        eng = _eng(lfm[case])
        fam = FAMILIES["lfm2_moe"]
        params = dict(eng.model.named_parameters())
        names = [internal_name(n, fam.RENAMES) for n in Checkpoint(lfm[case]).names()]
        unused = [n for n in names if n not in params and ".mlp.experts." not in n]
        assert not unused, unused
        assert isinstance(eng.model.layers[0].self_attn, FAMILIES["lfm2_moe"].ShortConv)
        assert eng.model.layers[1].is_moe is False and eng.model.layers[2].is_moe is True


# parity with transformers ------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["base", "conv4", "scaled", "nobias"])
def test_prefill_logits_and_greedy_match_transformers(lfm, case):
    eng, ref = _eng(lfm[case]), _hf(lfm[case])
    ids = eng.tokenizer.encode(PROMPT)
    ours = prefill(eng.model, eng._cache(1), 0, ids, 0, logits_for="all")[0]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)  # observed ≤ 3e-6
    out = _greedy(eng, ids)
    gen = ref.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                       eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert out == gen
    assert len(set(out)) > 4  # the random model's text varies: decode is really exercised


def test_router_is_checked_by_the_parity_case(lfm):
    """Selecting on the unbiased scores, or weighing by the biased ones, moves the logits well past
    the parity tolerance: the cases above would catch either."""
    from lynx_edge.models.lfm2_moe import Lfm2MoEBlock

    eng = _eng(lfm["base"])
    ids = eng.tokenizer.encode(PROMPT)
    run = lambda: prefill(eng.model, eng._cache(1), 0, ids, 0, logits_for="all")[0]  # noqa: E731
    right = run()
    blocks = [m for m in eng.model.modules() if isinstance(m, Lfm2MoEBlock)]
    for wrong in (lambda b: lambda z: (z.sigmoid(), z.sigmoid()),  # bias ignored
                  lambda b: lambda z: (z.sigmoid() + b.expert_bias, z.sigmoid() + b.expert_bias)):  # biased weights
        for b in blocks:
            b.scorer = wrong(b)
        assert (run() - right).abs().max() > 1e-2
    for b in blocks:
        b.scorer = b._score
    torch.testing.assert_close(run(), right, rtol=0, atol=0)


# cache: batched, cached, chunked ------------------------------------------------------------------
def _prompts(eng: Engine) -> list[list[int]]:
    ids = eng.tokenizer.encode(PROMPT + " " + PROMPT)
    return [ids[:1], ids[3:5], ids[:17], ids[5:40], ids[2:9]]  # 1 token: the decode starts inside the kernel


def test_batched_equals_single_at_mixed_lengths(lfm):
    eng = _eng(lfm["conv4"])  # conv state of 3: the 1- and 2-token prompts decode across its zero padding
    prompts = _prompts(eng)
    batch = [[] for _ in prompts]
    for c in eng.stream_batch(prompts, max_new_tokens=12, do_sample=False, ignore_eos=True):
        batch[c.index] += c.token_ids
    ref = _hf(lfm["conv4"])
    for p, got in zip(prompts, batch):
        assert got == _greedy(eng, p, 12)
        want = ref.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert got == want


def test_reused_rows_start_from_a_clean_state(lfm):
    """Two cache rows serve five requests: each request's row held another sequence's state."""
    from lynx_edge.core import EngineCore

    eng = _eng(lfm["base"])
    prompts = _prompts(eng)
    want = [_greedy(eng, p, 6) for p in prompts]
    core = EngineCore(eng, max_num_seqs=2, prefill_budget=16)
    sp = eng.sampling_params(max_new_tokens=6, do_sample=False, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(p, sp, str(i))
    got = defaultdict(list)
    while core.has_work():
        for o in core.step():
            got[int(o.request_id)] += o.token_ids
    assert [got[i] for i in range(len(prompts))] == want


def test_chat_turns_continue_the_state_or_recompute(lfm):
    """A turn that extends the whole session continues its state; one that diverges inside it is
    prefilled from scratch (a state cannot be cut back); both equal a fresh engine."""
    eng = _eng(lfm["base"])
    ids = eng.tokenizer.encode(PROMPT + PROMPT)
    first = _greedy(eng, ids[:10], 6)
    turn2 = ids[:10] + first + ids[10:20]
    assert _greedy(eng, turn2, 6) == _greedy(_eng(lfm["base"]), turn2, 6)
    assert eng.last_stats["cached_prompt_tokens"] == 10 + 5  # the session: prompt + answer less its last token
    turn3 = ids[:12] + ids[30:40]  # shares 10 tokens with the session, then diverges
    assert _greedy(eng, turn3, 6) == _greedy(_eng(lfm["base"]), turn3, 6)
    assert eng.last_stats["cached_prompt_tokens"] == 0


def test_mixed_steps_are_off_for_the_conv_state(lfm):
    """Packing a prompt chunk as one token per row would run a row's tokens side by side."""
    from lynx_edge.core import EngineCore

    eng = _eng(lfm["base"])
    assert eng._cache(2).stateful
    core = EngineCore(eng, max_num_seqs=2, prefill_budget=4, mixed_steps=True)
    assert core.mixed_steps is False
    prompts = _prompts(eng)[2:4]
    sp = eng.sampling_params(max_new_tokens=5, do_sample=False, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(p, sp, str(i))
    got = defaultdict(list)
    while core.has_work():
        for o in core.step():
            got[int(o.request_id)] += o.token_ids
    assert [got[0], got[1]] == [_greedy(eng, p, 5) for p in prompts]


def test_cached_decode_equals_recomputation(lfm):
    eng = _eng(lfm["conv4"])
    m = eng.model
    seq = eng.tokenizer.encode(PROMPT)[:6]
    kv = KVCache(eng.cfg, 2, 64, torch.float32, torch.device("cpu"))
    logits = prefill(m, kv, 1, seq)  # row 1: not the first row
    for _ in range(10):
        tok = int(logits.argmax(-1))
        seq.append(tok)
        logits = decode_step(m, kv, [1], torch.tensor([tok]))
        full = prefill(m, KVCache(eng.cfg, 1, 64, torch.float32, torch.device("cpu")), 0, seq, 0, "all")[0, -1]
        # decode runs the native CPU kernels, the recomputation torch's GEMMs: fp32 sums in other
        # orders; observed max |Δ| 1.3e-5 on logits up to 3.1
        torch.testing.assert_close(logits[0], full, atol=3e-5, rtol=1e-5)


def test_chunked_prefill_state_equals_token_by_token(lfm):
    eng = _eng(lfm["conv4"])
    m, cfg = eng.model, eng.cfg
    ids = eng.tokenizer.encode(PROMPT)[:23]
    runs = {"whole": [ids], "chunks": [ids[:1], ids[1:3], ids[3:10], ids[10:]], "tokens": [[t] for t in ids]}
    caches, last = {}, {}
    for name, chunks in runs.items():
        kv = KVCache(cfg, 1, 32, torch.float32, torch.device("cpu"))
        kv.layers = [tuple(t.normal_() for t in layer) for layer in kv.layers]  # a used row: stale everywhere
        at = 0
        for c in chunks:
            last[name] = prefill(m, kv, 0, c, at)
            at += len(c)
        caches[name] = kv
    conv = [i for i, t in enumerate(cfg.arch.layer_types) if t == "conv"]
    for name in ("chunks", "tokens"):
        torch.testing.assert_close(last[name], last["whole"], atol=1e-5, rtol=1e-5)
        for i in conv:
            torch.testing.assert_close(caches[name].layers[i][0], caches["whole"].layers[i][0], atol=1e-5, rtol=1e-4)  # observed 3e-6
    # the state is the last L − 1 = 3 conv inputs B·x of the sequence
    i = conv[0]
    h = m.layers[i].input_layernorm(m.embed_tokens[torch.tensor([ids])])
    b, _, x = m.layers[i].self_attn.in_proj(h).transpose(1, 2).chunk(3, dim=1)
    torch.testing.assert_close(caches["whole"].layers[i][0][0], (b * x)[0, :, -3:], atol=1e-6, rtol=1e-6)


# state bytes --------------------------------------------------------------------------------------
def test_state_bytes_per_sequence():
    cfg = ModelConfig.from_file(PUBLISHED)
    n_conv, n_attn = cfg.arch.layer_types.count("conv"), cfg.arch.layer_types.count("full_attention")
    assert (n_conv, n_attn) == (18, 6)
    D, L, Hkv, hd = cfg.hidden_size, cfg.arch.conv_L_cache, cfg.num_kv_heads, cfg.head_dim
    state = n_conv * D * (L - 1) * 2  # bf16: 18 layers × 2048 × 2 inputs × 2 bytes
    assert state == 147456  # 144 KiB per sequence, whatever the context
    for ctx in (0, 1, 4096, 32768):
        kv = n_attn * 2 * Hkv * ctx * hd * 2
        for batch in (1, 16):
            assert KVCache.bytes_needed(cfg, batch, ctx, torch.bfloat16) == batch * (state + kv)
    assert KVCache.state_bytes(cfg, torch.bfloat16) == state
    tiny = ModelConfig.from_dict(tiny_config(conv_L_cache=4))
    kv = KVCache(tiny, 3, 16, torch.float32, torch.device("cpu"))
    shapes = [tuple(t.shape) for t in kv.layers[0]]
    assert shapes == [(3, tiny.hidden_size, 3)]  # [Bmax, D, L − 1]
    assert sum(t.numel() * 4 for layer in kv.layers for t in layer) == KVCache.bytes_needed(tiny, 3, 16, torch.float32)


# LYNX ---------------------------------------------------------------------------------------------
def test_lynx_selects_on_the_biased_scores_with_its_invariants(lfm):
    from lynx_edge.models.lfm2_moe import SCORE_SCALE, Lfm2MoEBlock
    from lynx_edge.routing import exact_route

    eng = _eng(lfm["base"])
    eng.set_lynx("lynx")
    spec, lynx = eng.model.routing.spec, eng.model.routing.route
    bias = {m.layer: m.expert_bias for m in eng.model.modules() if isinstance(m, Lfm2MoEBlock)}
    calls = []

    def spy(scores, is_decode, layer, probs=None):
        ids, w = lynx(scores, is_decode, layer, probs=probs)
        calls.append((scores, is_decode, layer, probs, ids, w))
        return ids, w

    eng.model.routing.route = spy
    ids = eng.tokenizer.encode(PROMPT * 3)
    prompts = [ids[i:i + 5 + i % 7] for i in range(16)]
    eng.generate_batch(prompts, max_new_tokens=6, ignore_eos=True)
    remapped = 0
    for scores, is_decode, layer, probs, got, w in calls:
        torch.testing.assert_close(scores / SCORE_SCALE - probs, bias[layer].expand_as(scores), rtol=0, atol=1e-6)
        torch.testing.assert_close(probs, probs.clamp(0, 1))  # sigmoid probabilities
        exact, w0 = exact_route(scores, spec, probs)
        assert all(len(set(r.tolist())) == spec.top_k for r in got)  # k distinct
        assert torch.equal(got[:, 0], exact[:, 0])  # top-1 kept
        assert len(got.unique()) <= len(exact.unique())  # the union never grows
        decode = is_decode if isinstance(is_decode, bool) else bool(is_decode.all())
        if not decode:  # prefill is exact
            assert torch.equal(got, exact) and torch.equal(w, w0)
        remapped += int((got != exact).sum())
    assert remapped > 0  # LYNX did act at B = 16


# offload, INT4 -------------------------------------------------------------------------------------


def test_offload_equals_resident(lfm):
    from lynx_edge.offload import OffloadOptions, attach_offload

    ref = _eng(lfm["base"])
    ids = ref.tokenizer.encode(PROMPT)
    ref_toks, ref_logits = greedy_logits(ref, ids)
    prompts = _prompts(ref)
    ref_batch = ref.generate_batch(prompts, max_new_tokens=8, ignore_eos=True)
    # streamed into the host store at load (CPU: computed in place) ...
    eng = _eng(lfm["base"], offload=True, expert_slots=12, profile="cpu-only")
    toks, logits = greedy_logits(eng, ids)
    assert toks == ref_toks
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    assert eng.generate_batch(prompts, max_new_tokens=8, ignore_eos=True) == ref_batch
    # ... and attached to a loaded model with device slots, evictions and prefetch
    eng = _eng(lfm["base"])
    rt = attach_offload(eng.model, OffloadOptions(profile="cpu-only", expert_slots=12, cpu_compute="never",
                                                  prefetch=True))
    toks, logits = greedy_logits(eng, ids)
    assert toks == ref_toks
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    assert eng.generate_batch(prompts, max_new_tokens=8, ignore_eos=True) == ref_batch
    s = rt.stats()
    assert s["misses"] > 0 and s["evictions"] > 0 and s["bytes_h2d"] == s["copies"] * rt.store.nbytes > 0


def _ppl(eng, ids):
    logits = prefill(eng.model, eng._cache(1), 0, ids, 0, logits_for="all")[0]
    return math.exp(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item())


def test_int4_runs_close_to_float_and_quantize_roundtrips(lfm, tmp_path):
    from lynx_edge.quant.experts import Int4MoEExperts
    from lynx_edge.quantize import quantize_model

    path = lfm["base"]
    ref = _eng(path)
    q = _eng(path, int4=True, int4_group=32)
    assert all(isinstance(q.model.layers[i].mlp.experts, Int4MoEExperts) for i in q.cfg.moe_layer_ids)
    ids = ref.tokenizer.encode(PROMPT * 2)
    p_ref, p_q = _ppl(ref, ids), _ppl(q, ids)
    assert abs(p_q / p_ref - 1) < 0.03, (p_q, p_ref)  # observed 0.9%
    assert len(_greedy(q, ids[:8], 8)) == 8
    # lynx-edge quantize (RTN) writes a GPTQ checkpoint that loads as the same INT4 experts
    out = quantize_model(path, tmp_path / "q", method="rtn", group_size=32)
    g = _eng(out)
    for i in q.cfg.moe_layer_ids:
        assert torch.equal(g.model.layers[i].mlp.experts.packed.data, q.model.layers[i].mlp.experts.packed.data)
    assert abs(_ppl(g, ids) / p_ref - 1) < 0.05  # its other weights were written 16-bit


# lynx-edge info -------------------------------------------------------------------------------------
def _info(path) -> dict:
    from typer.testing import CliRunner

    from lynx_edge.cli.main import app

    r = CliRunner().invoke(app, ["info", str(path), "-o", "json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_info_counts_match_the_checkpoint_and_the_published_totals(lfm):
    from safetensors import safe_open

    for case in ("base", "conv4"):
        p = _info(lfm[case])["params"]
        numel = 0
        for f in lfm[case].glob("*.safetensors"):
            with safe_open(str(f), "pt") as st:
                numel += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
        assert p["total"] == numel  # every tensor transformers wrote, expert_bias included
        assert p["active"] == p["non_expert"] + p["expert"] * 4 // 32
    data = _info(PUBLISHED.parent)
    p, cfg = data["params"], ModelConfig.from_file(PUBLISHED)
    D, I, E, V = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.vocab_size
    conv = D * 3 * D + D * D + D * 3  # in_proj, out_proj, conv kernel
    attn = D * D * 2 + D * 512 * 2 + 2 * 64  # q, o, k, v (8 kv heads × 64), q/k norms
    dense = 3 * D * cfg.intermediate_size
    moe_fixed = D * E + E  # router + expert bias
    non_expert = V * D + 18 * conv + 6 * attn + 2 * dense + 22 * moe_fixed + 24 * 2 * D + D
    assert p["non_expert"] == non_expert and p["expert"] == 22 * E * 3 * D * I
    assert p["total"] == pytest.approx(8.3e9, rel=0.01)  # model card: 8.3B total (8.34B here)
    # model card: 1.5B active; counted as built (embeddings, all non-expert weights, 4 of 32 experts)
    # it is 1.56B, which the card's one-decimal figure truncates
    assert 1.5e9 <= p["active"] < 1.6e9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("L,bias", [(3, False), (4, True), (2, True)])
def test_native_short_conv_matches_the_torch_path(dtype, L, bias):
    """native.short_conv (a decode step's gated short conv, one call) against the torch path it
    replaces (state.causal_conv and the gating muls): rows out of order, one at position 0 over a
    stale state (read as zeros), the rows' states updated identically; fp32 to fp32 rounding, bf16
    within one bf16 step of the conv's rounding (observed: equal)."""
    from lynx_edge.kernels import native
    from lynx_edge.models.layers import AttnBatch
    from lynx_edge.models.state import causal_conv

    if native.lib() is None:
        pytest.skip("native kernels not built")
    g = torch.Generator().manual_seed(L)
    B, D, Bmax = 3, 40, 5
    bcx = torch.randn(B, 3 * D, generator=g).to(dtype)
    w = torch.randn(D, 1, L, generator=g).to(dtype)
    b = torch.randn(D, generator=g).to(dtype) if bias else None
    state = torch.randn(Bmax, D, L - 1, generator=g).to(dtype)
    rows, pos = torch.tensor([3, 0, 4]), torch.tensor([7, 0, 2])  # row 0 starts a new sequence
    ref_state = state.clone()
    ab = AttnBatch(positions=pos[:, None], rows=rows, kv_len=8)
    bb, c, h = bcx[:, :, None].split(D, dim=1)  # [B, D, 1] each
    want = (c * causal_conv(bb * h, w, ref_state, ab, b))[:, :, 0]
    got = native.short_conv(bcx, w, b, state, rows, pos)
    assert torch.equal(state, ref_state)  # the last L - 1 inputs B·x, fresh rows from zeros
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        step = want.float().abs().clamp_min(1e-3) * 2 ** -7
        assert ((got.float() - want.float()).abs() <= step).all()
    with pytest.raises(IndexError):
        native.short_conv(bcx, w, b, state, torch.tensor([0, 1, 5]), pos)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_runs_the_native_short_conv(lfm, dtype, monkeypatch):
    """On the module path (the MoE layers' layer call runs its own conv: test_native_layer.py), a CPU
    decode step's conv layers make one native.short_conv call each; the greedy tokens and logits are
    the torch path's (bf16: equal; fp32: to fp32 rounding)."""
    from lynx_edge.kernels import native
    from lynx_edge.models import native_layer

    monkeypatch.setattr(native_layer, "NATIVE_LAYERS", False)

    if native.lib() is None:
        pytest.skip("native kernels not built")
    short = FAMILIES["lfm2_moe"].ShortConv
    eng = Engine.from_pretrained(lfm["conv4"], device="cpu", dtype=dtype)
    n_conv = sum(isinstance(layer.self_attn, short) for layer in eng.model.layers)
    real, calls = native.short_conv, []
    monkeypatch.setattr(native, "short_conv", lambda *a: calls.append(1) or real(*a))
    ids = [5, 9, 2, 33, 7]
    toks, got = greedy_logits(eng, ids, n=6)
    assert len(calls) == 6 * n_conv > 0
    monkeypatch.setattr(short, "_native_ok", lambda self, x, state: False)  # the torch path
    want_toks, want = greedy_logits(eng, ids, n=6)
    assert toks == want_toks
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
