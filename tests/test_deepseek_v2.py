"""DeepSeek-V2 (multi-head latent attention, shared + group-limited experts) against transformers.

Tiny random checkpoints written by transformers from the real DeepSeek-V2-Lite-Chat config.json
(tests/fixtures/real/deepseek-v2-lite-chat/, sizes shrunk, every other field kept), and a V2-shaped
variant (q_lora_rank set, group_limited_greedy, routed_scaling_factor ≠ 1). The real repo has no
tokenizer here: the models use the small BPE of conftest (vocab 320).
References: transformers' DeepseekV2Config (defaults) and DeepseekV2ForCausalLM (logits, greedy
ids), exact routing (LYNX invariants), the resident model (offload, INT4), hand counts (params,
cache bytes).
"""
from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path

import pytest
import torch
from conftest import TEXT, RouteSpy, write_tokenizer
from typer.testing import CliRunner

from lynx_edge import Engine
from lynx_edge.config import ConfigError, ModelConfig
from lynx_edge.kv_cache import KVCache
from lynx_edge.lynx import LynxConfig
from lynx_edge.models import FAMILIES
from lynx_edge.models import deepseek_v2 as ds
from lynx_edge.modelinfo import param_counts
from lynx_edge.routing import RouterSpec, exact_route
from lynx_edge.step import decode_step, prefill

REAL = Path(__file__).parent / "fixtures" / "real" / "deepseek-v2-lite-chat"
SIZES = {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
         "intermediate_size": 48, "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2,
         "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12, "vocab_size": 320,
         "bos_token_id": 0, "eos_token_id": 2}
# DeepSeek-V2 (not Lite)'s shape of the same family: low-rank q, 8 groups top-3, scaled gate weights
V2 = {"q_lora_rank": 24, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
      "num_experts_per_tok": 3, "routed_scaling_factor": 2.5}
# YaRN whose original context the prompts pass; mscale ≠ mscale_all_dim, so both the cos/sin
# attention factor and the softmax-scale correction are ≠ 1
YARN = {"rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 0.707,
                         "original_max_position_embeddings": 8, "beta_fast": 32, "beta_slow": 1}}
PROMPT = "def add(a, b):\n    return a + b\nclass Point:"
PROMPTS = ["def", "import os\nimport sys", "class Point:\n    def", "for i in range(10):", "The quick", "print(",
           "return a + b", "x = 1"]
runner = CliRunner()


def build(dst: Path, seed: int = 0, **changes) -> Path:
    """A tiny random checkpoint; config.json = the real file with sizes shrunk (+ changes), written
    back after save_pretrained so absent fields stay absent."""
    import transformers

    dst.mkdir(parents=True)
    cfg = {**json.loads((REAL / "config.json").read_text()), **SIZES, **changes}
    cfg.pop("auto_map")  # remote code is never run
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(dst),
                                                          dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("mlp.gate.weight"):  # sharper routers: clear-cut top-k choices
                p.normal_(0, 0.5)
            elif n.endswith("norm.weight"):  # non-trivial norms (incl. the latent ones)
                p.uniform_(0.5, 1.5)
    model.save_pretrained(dst)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    write_tokenizer(dst)
    return dst


def variant(src: Path, dst: Path, **changes) -> Path:
    """The same weights (linked) under a config.json with fields changed."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    (dst / "config.json").write_text(json.dumps({**json.loads((src / "config.json").read_text()), **changes}))
    return dst


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ds")
    out = {"lite": build(root / "lite"), "v2": build(root / "v2", seed=1, **V2)}
    out["lite:yarn"] = variant(out["lite"], root / "lite-yarn", **YARN)
    out["v2:yarn"] = variant(out["v2"], root / "v2-yarn", **YARN)
    return out


def hf_model(path: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def set_mode(eng, mode: str) -> None:
    for m in eng.model.modules():
        if isinstance(m, ds.MLAttention):
            m.mode = mode


def all_logits(eng, ids) -> torch.Tensor:
    return prefill(eng.model, eng._cache(1), 0, ids, 0, logits_for="all")[0]


# config ------------------------------------------------------------------------------------------
def test_defaults_table_matches_transformers():
    import transformers

    cls = transformers.DeepseekV2Config
    declared = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(cls)}
    for name, value in ds.DEFAULTS.items():
        ref = cls.default_theta if name == "rope_theta" else declared.get(name, "<not a field>")
        assert ref == value and type(ref) is type(value), f"{name}: table {value!r}, transformers {ref!r}"
    assert not set(ds.REMOTE_DEFAULTS) & set(declared)  # those are DeepSeek's own code's, not the class's
    ours, ref = ModelConfig.from_dict({"model_type": "deepseek_v2", "num_experts_per_tok": 6}), cls(num_experts_per_tok=6)
    a = ours.arch
    assert (ours.num_layers, ours.hidden_size, ours.num_heads, ours.num_kv_heads, ours.vocab_size) == \
        (ref.num_hidden_layers, ref.hidden_size, ref.num_attention_heads, ref.num_key_value_heads, ref.vocab_size)
    assert (a.kv_lora_rank, a.q_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim) == \
        (ref.kv_lora_rank, ref.q_lora_rank, ref.qk_nope_head_dim, ref.qk_rope_head_dim, ref.v_head_dim)
    assert ours.num_experts == ref.num_experts and ours.moe_intermediate_size == ref.moe_intermediate_size
    assert ours.shared_expert_intermediate_size == ref.n_shared_experts * ref.moe_intermediate_size
    assert ours.moe_layers == tuple(i >= ref.first_k_dense_replace for i in range(ref.num_hidden_layers))
    assert ours.rms_norm_eps == ref.rms_norm_eps and ours.rope.theta == ref.rope_parameters["rope_theta"]


def test_real_config_parses_and_layer_kinds():
    cfg = ModelConfig.from_file(REAL / "config.json")
    a = cfg.arch
    assert (a.kv_lora_rank, a.q_lora_rank, a.qk_rope_head_dim, a.topk_method) == (512, None, 64, "greedy")
    assert cfg.moe_layers == (False,) + (True,) * 26 and cfg.shared_expert_intermediate_size == 2 * 1408
    assert cfg.rope.kind == "yarn" and cfg.rope.factor == 40 and cfg.rope.attention_factor == 1.0  # mscale = all_dim
    m = 0.1 * 0.707 * math.log(40) + 1
    assert ds.softmax_scale(cfg) == pytest.approx(192 ** -0.5 * m * m, rel=1e-12)
    # moe_layer_freq, as DeepSeek's code reads it (transformers' class ignores it; published configs say 1)
    two = ModelConfig.from_dict({**json.loads((REAL / "config.json").read_text()), "moe_layer_freq": 2,
                                 "num_hidden_layers": 6})
    assert two.moe_layers == (False, False, True, False, True, False)


@pytest.mark.parametrize("change,match", [
    ({"topk_method": "noaux_tc"}, "topk_method"),
    ({"scoring_func": "sigmoid"}, "scoring_func"),
    ({"topk_method": "group_limited_greedy", "n_group": 3}, "n_group"),
    ({"topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 1, "num_experts_per_tok": 9}, "exceeds"),
    ({"num_experts_per_tok": None}, "num_experts_per_tok"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_config_refusals_are_one_line(change, match):
    c = {**json.loads((REAL / "config.json").read_text()), **change}
    with pytest.raises(ConfigError, match=match) as e:
        ModelConfig.from_dict(c)
    assert "\n" not in str(e.value)


# parity with transformers ------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["lite", "v2", "lite:yarn", "v2:yarn"])
def test_prefill_logits_and_greedy_match_transformers(models, case):
    path = models[case]
    eng = Engine.from_pretrained(path, device="cpu", dtype=torch.float32)
    ids = eng.tokenizer.encode(PROMPT)
    if case.endswith("yarn"):
        assert len(ids) > 8  # past YaRN's original context
    ref = hf_model(path)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].float()
    for mode in ("expanded", "absorbed"):  # observed max |Δ| ≈ 2e-7 in both forms
        set_mode(eng, mode)
        torch.testing.assert_close(all_logits(eng, ids), want, atol=1e-4, rtol=1e-4, msg=mode)
    set_mode(eng, "auto")
    out = [t for c in eng.stream(ids, max_new_tokens=32, do_sample=False, ignore_eos=True) for t in c.token_ids]
    gen = ref.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                       eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert out == gen


def test_parity_is_sensitive(models):
    """The things this family gets right by construction move the logits well past the tolerance
    when got wrong: the interleaved RoPE layout, YaRN's softmax-scale correction, the group limit."""
    path = models["v2:yarn"]
    eng = Engine.from_pretrained(path, device="cpu", dtype=torch.float32)
    ids = eng.tokenizer.encode(PROMPT)
    right = all_logits(eng, ids)
    attn = [m for m in eng.model.modules() if isinstance(m, ds.MLAttention)]

    def rotate_half(x, cos, sin):  # the other RoPE layout (first half / second half)
        c, s = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
        x1, x2 = x.float().chunk(2, -1)
        return (x.float() * c + torch.cat((-x2, x1), -1) * s).to(x.dtype)

    real_rotate = ds._rotate_pairs
    ds._rotate_pairs = rotate_half
    try:
        assert (all_logits(eng, ids) - right).abs().max() > 1e-3
    finally:
        ds._rotate_pairs = real_rotate
    scale = attn[0].scale
    for m in attn:
        m.scale = (16 + 8) ** -0.5  # without the mscale_all_dim correction
    assert (all_logits(eng, ids) - right).abs().max() > 1e-3
    for m in attn:
        m.scale = scale
    for i in eng.cfg.moe_layer_ids:
        eng.model.layers[i].mlp.scorer = None  # greedy over all experts instead of the best 2 of 4 groups
    assert (all_logits(eng, ids) - right).abs().max() > 1e-3


# cache and decode --------------------------------------------------------------------------------
def test_cache_holds_the_latent_only(models):
    for cfg in (ModelConfig.from_file(REAL / "config.json"), ModelConfig.from_file(models["v2"] / "config.json")):
        a, L = cfg.arch, cfg.num_layers
        for dtype, size in ((torch.bfloat16, 2), (torch.float32, 4)):
            per_token = (a.kv_lora_rank + a.qk_rope_head_dim) * L * size
            assert KVCache.bytes_needed(cfg, 1, 1, dtype) == per_token
            assert KVCache.bytes_needed(cfg, 3, 100, dtype) == 3 * 100 * per_token
    assert KVCache.bytes_needed(ModelConfig.from_file(REAL / "config.json"), 1, 1, torch.bfloat16) == 576 * 27 * 2
    kv = KVCache(ModelConfig.from_file(models["lite"] / "config.json"), 2, 64, torch.float32, torch.device("cpu"))
    assert [tuple(t.shape) for layer in kv.layers for t in layer] == [(2, 64, 32 + 8)] * 3


@pytest.mark.parametrize("mode", ["auto", "absorbed", "expanded"])
def test_cached_decode_equals_recomputation(models, mode):
    eng = Engine.from_pretrained(models["v2:yarn"], device="cpu", dtype=torch.float32)
    set_mode(eng, mode)
    ids = eng.tokenizer.encode(PROMPT)
    kv = eng._cache(1)
    steps = [prefill(eng.model, kv, 0, ids[:5])]
    steps.append(prefill(eng.model, kv, 0, ids[5:], start=5))  # a chunk after a cached prefix
    seq = list(ids)
    for _ in range(12):
        seq.append(int(steps[-1].argmax(-1)))
        steps.append(decode_step(eng.model, kv, [0], torch.tensor([seq[-1]])))
    full = all_logits(eng, seq)  # recomputed from scratch
    got = torch.cat([steps[0], steps[1], *steps[2:-1]])
    want = torch.cat([full[4:5], full[len(ids) - 1 : len(ids)], full[len(ids) : -1]])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)  # observed ≤ 2.5e-7


def test_absorbed_equals_expanded_decode(models):
    """Same logits from both forms at every step of a batched decode of unequal rows (masked)."""
    runs = {}
    for mode in ("absorbed", "expanded"):
        eng = Engine.from_pretrained(models["v2"], device="cpu", dtype=torch.float32)
        set_mode(eng, mode)
        kv = eng._cache(3)
        for r, p in enumerate(PROMPTS[:3]):
            prefill(eng.model, kv, r, eng.tokenizer.encode(p))
        tok, out = torch.tensor([5, 6, 7]), []
        for _ in range(6):
            logits = decode_step(eng.model, kv, [0, 1, 2], tok)
            out.append(logits)
            tok = logits.argmax(-1)
        runs[mode] = torch.stack(out)
    torch.testing.assert_close(runs["absorbed"], runs["expanded"], atol=1e-6, rtol=0)  # observed 2.1e-7


@pytest.mark.parametrize("mode", ["absorbed", "expanded"])
def test_absorbed_bf16_on_a_cpu_keeps_fp32_products(mode):
    """A bf16 MLA layer's absorbed decode (the fp32 copy of kv_b per head, the flash kernel over whole
    latent rows) or expanded attention (values zero-padded to the keys' width for the flash kernel, in
    fp32) against the same layer in fp32: within a few bf16 roundings of the output (observed 4.7e-3 of
    its scale absorbed, 5.6e-3 expanded: bf16 roundings of the projections, q_lat and the output), three
    rows at unequal positions (a mask). The fp32 copy follows the weight when it is written in place."""
    from lynx_edge.models.deepseek_v2 import MLAttention
    from lynx_edge.models.layers import AttnBatch

    cfg = ModelConfig.from_file(REAL / "config.json")
    width = cfg.arch.kv_lora_rank + cfg.arch.qk_rope_head_dim
    g = torch.Generator().manual_seed(0)
    layers = {}
    for dt in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        m = MLAttention(cfg, 1, dt, torch.device("cpu"))
        m.mode = mode
        layers[dt] = m
    with torch.no_grad():
        for (n, p32), (_, p16) in zip(layers[torch.float32].named_parameters(), layers[torch.bfloat16].named_parameters()):
            w = torch.rand(p32.shape, generator=g) * 0.5 + 0.75 if "norm" in n else \
                torch.randn(p32.shape, generator=g) * p32.shape[-1] ** -0.5
            p16.copy_(w)
            p32.copy_(p16.float())  # the same (bf16-representable) weights
    cache = torch.randn(3, 40, width, generator=g)
    x = torch.randn(3, 1, cfg.hidden_size, generator=g)
    pos = torch.tensor([[39], [20], [7]])
    outs = {}
    for dt, m in layers.items():
        ab = AttnBatch(positions=pos, rows=slice(0, 3), kv_len=40)
        with torch.inference_mode():
            outs[dt] = m(x.to(dt), ab, (cache.to(dt).clone(),)).float()
    ref = outs[torch.float32]
    err = ((outs[torch.bfloat16] - ref).abs().max() / ref.abs().max()).item()
    assert err < 8e-3, err
    m = layers[torch.bfloat16]
    with torch.no_grad():
        m.kv_b_proj.weight.mul_(2)
    assert torch.equal(m._kv_b_heads(), m.kv_b_proj.weight.float().view(m.H, m.dn + m.dv, m.r))


def test_auto_mode_absorbs_decode_and_expands_prefill():
    cfg = ModelConfig.from_file(REAL / "config.json")
    attn = ds.MLAttention(cfg, 0, torch.bfloat16, torch.device("meta"))
    assert attn._absorbed_is_cheaper(1, 2) and attn._absorbed_is_cheaper(1, 4096)  # decode
    assert not attn._absorbed_is_cheaper(512, 512)  # prefill from scratch
    assert attn._absorbed_is_cheaper(16, 4096)  # a short chunk after a long cached prefix


def test_batched_equals_single(models):
    eng = Engine.from_pretrained(models["v2"], device="cpu", dtype=torch.float32)
    single = [eng.generate(p, max_new_tokens=10, ignore_eos=True) for p in PROMPTS]
    assert eng.generate_batch(PROMPTS, max_new_tokens=10, ignore_eos=True) == single


# routing, LYNX, offload, INT4 --------------------------------------------------------------------
def test_router_spec_weights():
    """greedy: softmax probs × routed_scaling_factor, unnormalised; norm_topk_prob: renormalised and
    not scaled (DeepSeek-V2's gate), written out with plain torch."""
    base = {**json.loads((REAL / "config.json").read_text()), "routed_scaling_factor": 3.0}
    torch.manual_seed(0)
    logits = torch.randn(7, 64)
    p = logits.softmax(-1)
    top = p.topk(6, -1)
    ids, w = exact_route(logits, ds.router_spec(ModelConfig.from_dict(base)))
    assert torch.equal(ids, top.indices)
    torch.testing.assert_close(w, top.values * 3.0)
    ids, w = exact_route(logits, ds.router_spec(ModelConfig.from_dict({**base, "norm_topk_prob": True})))
    torch.testing.assert_close(w, top.values / top.values.sum(-1, keepdim=True))
    assert ds.router_spec(ModelConfig.from_dict(base)).num_shared_experts == 2


class _Watch(RouteSpy):
    """Every routing call's result next to exact routing's."""

    def record(self, scores, is_decode, ids, w, exact_ids):
        return scores, is_decode.reshape(-1).bool() if torch.is_tensor(is_decode) else is_decode, ids, exact_ids


def test_lynx_invariants_on_group_limited_model(models):
    eng = Engine.from_pretrained(models["v2"], device="cpu", dtype=torch.float32, lynx=LynxConfig(mode="lynx", j=0))
    watch = _Watch(eng.model.routing.route, eng.model.routing.spec)
    eng.model.routing.route = watch
    eng.generate_batch(PROMPTS, max_new_tokens=6, ignore_eos=True)
    K, excluded, remapped, shrunk = eng.cfg.top_k, 0, 0, 0
    for scores, dec, ids, ids0 in watch.calls:
        excluded += int((~torch.isfinite(scores)).sum())
        assert torch.isfinite(scores.gather(1, ids)).all()  # never an expert the group rule excludes
        assert all(len(set(r)) == K for r in ids.tolist())  # k distinct
        assert torch.equal(ids[:, 0], ids0[:, 0])  # top-1 kept
        assert ids.unique().numel() <= ids0.unique().numel()  # the union never grows
        shrunk += ids.unique().numel() < ids0.unique().numel()
        dec = torch.full((len(ids),), dec) if isinstance(dec, bool) else dec
        assert torch.equal(ids[~dec], ids0[~dec])  # prefill exact
        remapped += int((ids != ids0).any(1).sum())
    assert excluded > 0 and remapped > 0 and shrunk > 0  # the rule and LYNX both had work to do


def test_offload_equals_resident(models):
    ref = Engine.from_pretrained(models["v2"], device="cpu")
    want = ref.generate_batch(PROMPTS[:4], max_new_tokens=8, ignore_eos=True)
    ids = ref.tokenizer.encode(PROMPT)
    eng = Engine.from_pretrained(models["v2"], device="cpu", offload=True, expert_slots=3, policy="lru")
    torch.testing.assert_close(all_logits(eng, ids), all_logits(ref, ids), atol=1e-5, rtol=1e-5)
    chunks = list(eng.stream_batch(PROMPTS[:4], max_new_tokens=8, ignore_eos=True))
    texts = [""] * 4
    for c in chunks:
        texts[c.index] += c.text
    assert texts == want
    off = chunks[-1].stats["offload"]
    assert off["misses"] > 0 and off["bytes_h2d"] > 0


def test_int4_runs_and_stays_close(models):
    from lynx_edge.quant.experts import Int4MoEExperts

    ref = Engine.from_pretrained(models["lite"], device="cpu")
    q = Engine.from_pretrained(models["lite"], device="cpu", int4=True, int4_group=32)
    assert all(isinstance(q.model.layers[i].mlp.experts, Int4MoEExperts) for i in q.cfg.moe_layer_ids)
    ids = ref.tokenizer.encode(TEXT[:300])

    def ppl(eng):
        lg = all_logits(eng, ids)
        return math.exp(torch.nn.functional.cross_entropy(lg[:-1], torch.tensor(ids[1:])).item())

    assert abs(ppl(q) / ppl(ref) - 1) < 0.05
    assert isinstance(q.generate("def", max_new_tokens=4, ignore_eos=True), str)


# CLI ---------------------------------------------------------------------------------------------
def invoke(*args):
    from lynx_edge.cli.main import app

    return runner.invoke(app, [str(a) for a in args])


def test_info_on_the_real_config(tmp_path):
    """15.7B total (published), and active: 2.45B without the input embedding — the convention
    under which DeepSeek-V2 (236B / 21B) matches too; the published 2.4B is rounded down."""
    r = invoke("info", REAL, "-o", "json")
    assert r.exit_code == 0, r.output
    p = json.loads(r.stdout)["params"]
    cfg = ModelConfig.from_file(REAL / "config.json")
    D, V, L, H, E, K, I = 2048, 102400, 27, 16, 64, 6, 1408
    attn = D * H * 192 + D * 576 + 512 * H * 256 + H * 128 * D + 512  # q, kv_a, kv_b, o, kv_a_layernorm
    moe = E * 3 * D * I + 3 * D * 2 * I + E * D  # routed, shared, router
    assert p["total"] == 2 * V * D + D + L * (attn + 2 * D) + 3 * D * 10944 + 26 * moe  # exact hand count
    assert p["total"] == pytest.approx(15.7e9, rel=0.01)
    assert p["active"] - V * D == pytest.approx(2.4e9, rel=0.025)
    full = ModelConfig.from_dict({**json.loads((REAL / "config.json").read_text()), "hidden_size": 5120,
                                  "num_hidden_layers": 60, "num_attention_heads": 128, "num_key_value_heads": 128,
                                  "q_lora_rank": 1536, "n_routed_experts": 160, "moe_intermediate_size": 1536,
                                  "intermediate_size": 12288, "topk_method": "group_limited_greedy", "n_group": 8,
                                  "topk_group": 3, "routed_scaling_factor": 16.0})
    pf = param_counts(full)
    assert pf["total"] == pytest.approx(236e9, rel=0.01)
    assert pf["active"] - V * 5120 == pytest.approx(21e9, rel=0.01)
    assert cfg.num_experts == E and cfg.top_k == K


def test_eval_bench_offload_and_quantize_run(models, tmp_path):
    path = models["v2"]
    words, rng = TEXT.split(" "), random.Random(0)
    text = tmp_path / "heldout.txt"
    text.write_text(" ".join(rng.choice(words) for _ in range(400)))
    r = invoke("eval", path, "--file", text, "-b", "1,4", "--seqs", "4", "--seq-len", "24", "--prefill-len", "8",
               "-o", "json")
    assert r.exit_code == 0, r.output
    rows = {row["batch"]: row for row in json.loads(r.stdout)["rows"]}
    assert rows[1]["greedy_agreement_pct"] == 100.0 and rows[4]["unique_lynx"] <= rows[4]["unique_exact"]
    r = invoke("bench", path, "-p", "8", "-n", "4", "-r", "1", "-b", "1,2", "--offload", "-o", "json")
    assert r.exit_code == 0, r.output
    assert {row["batch"] for row in json.loads(r.stdout.strip().splitlines()[-1])["rows"]} == {1, 2}
    r = invoke("quantize", path, "-o", tmp_path / "q", "-g", "32", "--calib", text)  # GPTQ: runs the MLA layers
    assert r.exit_code == 0, r.output
    from lynx_edge.quant.experts import Int4MoEExperts

    eng = Engine.from_pretrained(tmp_path / "q", device="cpu")
    assert all(isinstance(eng.model.layers[i].mlp.experts, Int4MoEExperts) for i in eng.cfg.moe_layer_ids)
    assert isinstance(eng.generate("def", max_new_tokens=4, ignore_eos=True), str)


def test_family_is_registered():
    assert FAMILIES["deepseek_v2"] is ds
