"""gpt-oss (issue 12) against transformers: a tiny random checkpoint written by transformers from the
real openai/gpt-oss-20b config.json (tests/fixtures/real/gpt-oss-20b, sizes shrunk, every other
field kept), 16-bit and MXFP4 in the published tensor layout; the real Harmony chat template.
References: transformers' GptOssForCausalLM (logits, greedy ids, its MXFP4 dequantisation),
GptOssConfig (defaults), AutoTokenizer.apply_chat_template; kernels against their torch reference.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from lynx_edge import Engine
from lynx_edge.config import ModelConfig
from lynx_edge.models import FAMILIES

from conftest import RouteSpy

REAL = Path(__file__).parent / "fixtures" / "real" / "gpt-oss-20b"
DEMO_TOK = Path(__file__).parent.parent / "lynx_edge" / "demo" / "tokenizer.json"
# sizes only (the window and YaRN's original length shrunk too, so short prompts run past both)
SIZES = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 1,
         "head_dim": 16, "intermediate_size": 32, "num_local_experts": 8, "sliding_window": 8}
ORIG_CTX = 16  # rope_scaling.original_max_position_embeddings, shrunk
# o200k_harmony's special tokens at their real ids (ids between are reserved tokens)
HARMONY = {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200003: "<|constrain|>",
           200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>"}


def shrunk_config(mxfp4: bool = False) -> dict:
    cfg = json.loads((REAL / "config.json").read_text())
    cfg.update(SIZES)
    cfg["layer_types"] = cfg["layer_types"][: SIZES["num_hidden_layers"]]
    cfg["rope_scaling"] = dict(cfg["rope_scaling"], original_max_position_embeddings=ORIG_CTX)
    if not mxfp4:  # a dequantized (16-bit) checkpoint carries no quantization_config
        cfg.pop("quantization_config")
    return cfg


def write_tokenizer(dst: Path) -> None:
    """A small byte-level BPE (the demo's 4096 tokens) padded to o200k's size, with the Harmony
    specials at their real ids: the real vocabulary's ids without its 27 MB tokenizer.json."""
    tok = json.loads(DEMO_TOK.read_text())
    vocab = tok["model"]["vocab"]
    for t in HARMONY.values():  # the demo's own <|endoftext|> would take that string's id
        if t in vocab:
            vocab[t.replace("<|", "<|demo_")] = vocab.pop(t)
    for i in range(len(vocab), 199998):
        vocab[f"<|filler_{i}|>"] = i  # never produced: no merge makes them
    tok["added_tokens"] = [{"id": i, "content": HARMONY.get(i, f"<|reserved_{i}|>"), "single_word": False,
                            "lstrip": False, "rstrip": False, "normalized": False, "special": True}
                           for i in range(199998, 201088)]
    (dst / "tokenizer.json").write_text(json.dumps(tok))
    (dst / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>", "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>", "model_max_length": 131072, "clean_up_tokenization_spaces": False}))
    for f in ("chat_template.jinja", "generation_config.json", "special_tokens_map.json"):
        shutil.copy(REAL / f, dst / f)


def build(dst: Path, seed: int = 0) -> Path:
    """A tiny random 16-bit gpt-oss checkpoint written by transformers (config.json: the shrunk real one)."""
    import transformers

    dst.mkdir(parents=True, exist_ok=True)
    write_tokenizer(dst)
    cfg = shrunk_config()
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(dst),
                                                          dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("router.weight"):  # sharper routers: clear-cut top-k choices
                p.normal_(0, 0.5)
            elif n.endswith(("_bias", "router.bias", "sinks")):  # biases and sinks that matter
                p.normal_(0, 0.5)
            elif n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif n.endswith(("gate_up_proj", "down_proj")):  # big enough that the SwiGLU clamp cuts in
                p.normal_(0, 0.6)
    model.save_pretrained(dst)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    shutil.copy(REAL / "generation_config.json", dst / "generation_config.json")  # the real one, not transformers'
    return dst


def hf_model(path: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("gpt-oss") / "bf16")


def prompt_ids(n: int = 40, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 4096, (n,), generator=g).tolist()


# config ---------------------------------------------------------------------------------------------
def test_defaults_table_matches_transformers():
    import transformers

    cls = transformers.GptOssConfig
    declared = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(cls)}
    for name, value in FAMILIES["gpt_oss"].DEFAULTS.items():
        ref = cls.default_theta if name == "rope_theta" else declared.get(name, "<not a field>")
        assert ref == value and type(ref) is type(value), f"gpt_oss.{name}: table {value!r}, transformers {ref!r}"
    ours, ref = ModelConfig.from_dict({"model_type": "gpt_oss"}), cls()
    assert ours.num_experts == ref.num_local_experts and ours.top_k == ref.num_experts_per_tok
    assert ours.sliding_windows == tuple(ref.sliding_window if t == "sliding_attention" else None
                                         for t in ref.layer_types)
    rp = ref.rope_parameters  # the YaRN default of __post_init__
    assert (ours.rope.kind, ours.rope.factor, ours.rope.original_max_position_embeddings, ours.rope.truncate) == \
        (rp["rope_type"], rp["factor"], rp["original_max_position_embeddings"], rp["truncate"])
    assert ours.arch.swiglu_alpha == ref.swiglu_alpha and ours.arch.swiglu_limit == ref.swiglu_limit


def test_real_config_maps_like_transformers():
    import transformers

    c = json.loads((REAL / "config.json").read_text())
    ours, ref = ModelConfig.from_dict(c), transformers.GptOssConfig.from_dict(c)
    assert ours.num_experts == 32 == ref.num_local_experts and ours.top_k == 4 == ref.num_experts_per_tok
    assert ours.sliding_windows[:2] == (128, None) and ours.attention_bias and ours.arch.mxfp4
    assert ours.rope.kind == "yarn" and ours.rope.original_max_position_embeddings == 4096
    assert not ours.rope.truncate and ours.rope.factor == 32.0 and ours.rope.theta == 150000
    # the frequencies and attention factor transformers computes from the same file
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from lynx_edge.models.layers import Rope
    inv, scale = ROPE_INIT_FUNCTIONS["yarn"](ref, "cpu")
    rope = Rope(ours, "cpu")
    torch.testing.assert_close(rope.inv_freq, inv.float(), rtol=0, atol=0)
    assert rope.scale == pytest.approx(scale, rel=1e-12)


# parity ---------------------------------------------------------------------------------------------
def test_prefill_logits_and_greedy_match_transformers(ckpt):
    from lynx_edge.step import prefill

    eng = Engine.from_pretrained(ckpt, device="cpu", dtype=torch.float32)
    ids = prompt_ids()  # 40 tokens: past the window (8) and YaRN's original context (16)
    ref = hf_model(ckpt)
    ours = prefill(eng.model, eng._cache(1), 0, ids, 0, logits_for="all")[0]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].float()
    err = (ours - want).abs().max().item()
    assert err < 1e-5, err  # observed 1.3e-6 (the issue asks 1e-4)
    out = [t for c in eng.stream(ids, max_new_tokens=32, do_sample=False, ignore_eos=True) for t in c.token_ids]
    gen = ref.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                       eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert out == gen


def test_batched_equals_single_and_cached_decode_equals_recompute(ckpt):
    from lynx_edge.step import prefill

    eng = Engine.from_pretrained(ckpt, device="cpu", dtype=torch.float32)
    prompts = [prompt_ids(n, seed=n) for n in (3, 11, 29)]
    single = [eng.generate(p, max_new_tokens=20, do_sample=False, ignore_eos=True) for p in prompts]
    assert eng.generate_batch(prompts, max_new_tokens=20, do_sample=False, ignore_eos=True) == single
    # the last cached decode step's logits = a fresh prefill of the whole sequence
    ids = prompts[2]
    toks = [t for c in eng.stream(ids, max_new_tokens=12, do_sample=False, ignore_eos=True) for t in c.token_ids]
    full = ids + toks[:-1]
    fresh = prefill(eng.model, eng._cache(1), 0, full, 0, logits_for="all")[0]
    assert int(fresh[-1].argmax()) == toks[-1]
    cache = eng._cache(1)
    prefill(eng.model, cache, 0, full[:-1], 0)
    step = prefill(eng.model, cache, 0, full[-1:], len(full) - 1)[0]
    torch.testing.assert_close(step.reshape(-1), fresh[-1], atol=2e-5, rtol=2e-5)


def test_decode_attention_runs_native_with_sinks(ckpt, monkeypatch):
    """A CPU decode step's sink attention runs the native kernel with the sinks in its softmax (full
    and 8-token-window layers: the prompt runs past the window) and gives the torch path's logits;
    the kernel without the sinks does not. The module path's attention (the whole-layer call runs the
    same kernel, bit-equal to it: test_native_layer.py's gpt-oss cases)."""
    from conftest import greedy_logits
    from lynx_edge.kernels import native
    from lynx_edge.models import native_layer
    from lynx_edge.models.layers import Attention

    if native.lib() is None:
        pytest.skip("native kernels not built")
    monkeypatch.setattr(native_layer, "NATIVE_LAYERS", False)
    eng = Engine.from_pretrained(ckpt, device="cpu", dtype=torch.float32)
    ids = prompt_ids(20)
    real, sinks = native.attn_decode, []

    def spy(*a):
        sinks.append(a[14])
        return real(*a)

    monkeypatch.setattr(native, "attn_decode", spy)
    toks, got = greedy_logits(eng, ids, n=6)
    assert len(sinks) == 6 * len(eng.model.layers) and all(s is not None and s.dtype == torch.float32 for s in sinks)
    monkeypatch.setattr(native, "attn_decode", lambda *a: real(*a[:14], None, *a[15:]))
    assert (greedy_logits(eng, ids, n=6)[1] - got).abs().max() > 1e-3  # the sinks matter here
    monkeypatch.setattr(Attention, "_decode_native", lambda self, x, ab, kv: None)  # the torch path
    want_toks, want = greedy_logits(eng, ids, n=6)
    assert toks == want_toks
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sink_attention_flash_path_equals_the_chunked_softmax(ckpt, monkeypatch, dtype):
    """On a CPU the sink attention runs torch's flash kernel and scales each row by sigmoid(L - sink)
    (L: its scores' log-sum-exp): the same as the explicit softmax over [scores, sink] (the path a GPU
    runs) for a fresh causal prefill, a window mask, and rows at different positions; within 2e-6
    in fp32 (observed ~1e-6), one bf16 rounding in bf16. Bug case: the sink with the wrong sign."""
    from lynx_edge.models import gpt_oss
    from lynx_edge.models.layers import AttnBatch

    if gpt_oss._FLASH_CPU is None:
        pytest.skip("this torch has no CPU flash attention op")
    eng = Engine.from_pretrained(ckpt, device="cpu", dtype=dtype)
    attn = next(m for m in eng.model.modules() if isinstance(m, gpt_oss.SinkAttention))
    g = torch.Generator().manual_seed(3)
    H, Hkv, hd = attn.H, attn.Hkv, attn.hd
    B, T, S = 2, 12, 20
    q = torch.randn(B, H, T, hd, generator=g).to(dtype)
    k, v = (torch.randn(B, Hkv, S, hd, generator=g).to(dtype) for _ in range(2))
    fresh = AttnBatch(positions=torch.arange(S - T, S)[None].expand(B, T), rows=slice(0, B), kv_len=S, start=S - T)
    ragged = AttnBatch(positions=torch.stack([torch.arange(S - T, S), torch.arange(3, 3 + T)]), rows=slice(0, B),
                       kv_len=S)
    cases = [(q[..., :T, :], k[:, :, :T], v[:, :, :T], (None, True)), (q, k, v, (fresh.mask(5), False)),
             (q, k, v, (ragged.mask(None), False)), (q, k, v, (ragged.mask(5), False))]
    for qq, kk, vv, att in cases:
        got = attn.sdpa(qq, kk, vv, None, qq.shape[2], att)
        with monkeypatch.context() as m:
            m.setattr(gpt_oss, "_FLASH_CPU", None)
            want = attn.sdpa(qq.float(), kk.float(), vv.float(),
                             AttnBatch(positions=torch.arange(qq.shape[2])[None], rows=slice(0, 1),
                                       kv_len=qq.shape[2], start=0), qq.shape[2], att)
        tol = 2e-6 if dtype == torch.float32 else 8e-3
        assert got.dtype == dtype and (got.float() - want).abs().max() < tol * want.abs().max()
        if att[0] is not None:  # the mask a few query rows at a time (a long prompt's): the same rows
            for name, value in (("CHUNK_BYTES", 4 * B * kk.shape[2] * 5), ("BLOCK_Q", 4)):  # 5 or 4 rows a block
                with monkeypatch.context() as m:
                    m.setattr(attn, name, value)
                    part = attn.sdpa(qq, kk, vv, None, qq.shape[2], att).float()
                # the op's own blocking: fp32 sums in another order, so in bf16 an element may round one
                # ulp apart (an AVX-512 Xeon's flash kernel: 2.4e-4 on an element near 0.05; AVX2: equal)
                ulp = got.float().abs() * 2**-7 if dtype == torch.bfloat16 else 0
                assert ((part - got.float()).abs() <= ulp + 1e-6 * got.float().abs().max()).all()
    with monkeypatch.context() as m:
        m.setattr(attn, "native_sinks", lambda: -attn.sinks.float())
        bad = attn.sdpa(q, k, v, None, T, cases[1][3])
    assert (bad.float() - attn.sdpa(q, k, v, None, T, cases[1][3]).float()).abs().max() > 1e-2


# the sliding-window ring (kv_cache.py) ----------------------------------------------------------------
def _ids_of(eng, prompt, n, **kw) -> list[int]:
    return [t for c in eng.stream(prompt, max_new_tokens=n, do_sample=False, ignore_eos=True, **kw) for t in c.token_ids]


def test_sliding_layers_keep_a_ring_equal_to_the_full_cache(ckpt, monkeypatch):
    """At ctx 512 the window-8 layers keep a ring of 72 positions (144 slots, not 512): a 100-token
    prompt and 120 greedy steps (the ring wraps twice) give the full cache's (swa_full) tokens and
    logits bit for bit on the native decode path, and within 1e-5 on the torch path (SDPA over the
    window's keys rather than all keys under a mask: observed 3.9e-6); a prompt prefilled in chunks
    of 30 (each reads the window before it from the ring) gives the full cache's chunked logits."""
    from conftest import greedy_logits
    from lynx_edge.kv_cache import KVCache
    from lynx_edge.models.layers import Attention
    from lynx_edge.step import prefill

    ring = Engine.from_pretrained(ckpt, device="cpu", dtype=torch.float32, ctx_size=512)
    full = Engine.from_pretrained(ckpt, device="cpu", dtype=torch.float32, ctx_size=512, swa_full=True)
    kv = ring._cache(1)
    assert kv.rings == [72, 0, 72, 0] and kv.layers[0][0].shape[2] == 144 and full._cache(1).rings == [0] * 4
    need = [KVCache.bytes_needed(ring.cfg, 4, 512, torch.float32, swa_full=f) for f in (False, True)]
    assert need[0] == need[1] * (144 + 512) // (2 * 512)
    ids = prompt_ids(100)
    got, want = greedy_logits(ring, ids, n=120), greedy_logits(full, ids, n=120)
    assert got[0] == want[0] and torch.equal(got[1], want[1])
    monkeypatch.setattr(Attention, "_decode_native", lambda self, x, ab, kv: None)  # the torch path
    t_got, t_want = greedy_logits(ring, ids, n=120), greedy_logits(full, ids, n=120)
    assert t_got[0] == t_want[0] == want[0]
    torch.testing.assert_close(t_got[1], t_want[1], atol=1e-5, rtol=1e-5)
    chunked = []
    for eng in (ring, full):
        kv = eng._cache(1)
        chunked.append(torch.cat([prefill(eng.model, kv, 0, ids[s:s + 30], s, logits_for="all")[0]
                                  for s in range(0, 100, 30)]))
    torch.testing.assert_close(chunked[0], chunked[1], atol=1e-5, rtol=1e-5)
    assert int(chunked[0][-1].argmax()) == want[0][0]


def test_ring_batches_chat_turns_and_mixed_steps(ckpt):
    """With the ring: prompts of 300, 400 and 5 tokens (the first two prefilled together, 100 pads
    in the shorter row: more than the ring's slack, so a pad written would overwrite its window)
    and 100 steps each = each alone = the full cache; a chat turn that cuts the cached conversation
    back 3 tokens reuses the rest, one that cuts back to just after its prompt continues from the
    prompt's snapshot, one that cuts further recomputes it, all giving the full cache's tokens; a server's prompt chunks ride in decode steps (mixed)
    only up to the ring's slack + 1 tokens, and give the tokens of each prompt alone."""
    from lynx_edge.core import EngineCore

    ring = Engine.from_pretrained(ckpt, device="cpu", dtype=torch.float32, ctx_size=512)
    full = Engine.from_pretrained(ckpt, device="cpu", dtype=torch.float32, ctx_size=512, swa_full=True)
    prompts = [prompt_ids(n, seed=n) for n in (300, 400, 5)]
    alone = [_ids_of(full, p, 100) for p in prompts]
    batch = [[] for _ in prompts]
    for c in ring.stream_batch(prompts, max_new_tokens=100, do_sample=False, ignore_eos=True):
        batch[c.index] += c.token_ids
    assert batch == alone == [_ids_of(ring, p, 100) for p in prompts]
    prompts = [prompt_ids(n, seed=n) for n in (90, 150)]
    alone = [_ids_of(full, p, 60) for p in prompts]
    first = _ids_of(ring, prompts[1], 120)  # the session: 150 + 119 tokens in the cache
    session = prompts[1] + first[:-1]
    # kept: 3 tokens cut (the rings still hold the window), the answer after its first token cut (as
    # Harmony drops an earlier answer's reasoning: the prompt's snapshot, its last position rerun),
    # 20 tokens left (more than the slack before the snapshot: all recomputed)
    for keep, reused in ((len(session) - 3, len(session) - 3), (151, 150), (20, 0)):
        turn = session[:keep] + prompt_ids(20, seed=keep)
        _ids_of(ring, prompts[1], 120)
        got = _ids_of(ring, turn, 30)
        assert ring._reused == reused and got == _ids_of(full, turn, 30)
    # a stopped answer is not kept in the session, but the ring saw it: the next turn continues
    # from the prompt's snapshot, not from rings that moved on
    turn = prompts[1] + prompt_ids(20, seed=7)
    for eng in (ring, full):
        stream, n = eng.stream(prompts[1], max_new_tokens=200, do_sample=False, ignore_eos=True), 0
        for c in stream:
            n += len(c.token_ids)
            if n >= 120:
                stream.close()
                break
        assert n < 200 and eng.last_stats.get("stopped")
    got = _ids_of(ring, turn, 30)
    assert ring._reused == 150 and got == _ids_of(full, turn, 30)
    slots = torch.arange(143, 150) % 72  # the window before the turn's first new token, in both caches
    assert torch.equal(ring.kv.layers[0][0][0, :, slots], full.kv.layers[0][0][0, :, 143:150])
    for budget, chunks in ((16, {(True, 16), (True, 6)}), (100, {(False, 100), (True, 50)})):
        core = EngineCore(ring, max_num_seqs=2, prefill_budget=budget, mixed_steps=True)
        out, seen = {"a": [], "b": []}, set()
        core.add_request(prompts[0], ring.sampling_params(max_new_tokens=60, ignore_eos=True, do_sample=False), "a")
        for step in range(400):
            if step == 10:
                core.add_request(prompts[1], ring.sampling_params(max_new_tokens=30, ignore_eos=True, do_sample=False), "b")
            if step > 10 and not core.has_work():
                break
            for o in core.step():
                out[o.request_id] += o.token_ids
            if step >= 10 and core.last_step["prefill_tokens"]:
                seen.add((core.last_step["mixed"], core.last_step["prefill_tokens"]))
        assert seen == chunks  # 100 tokens of one row > the slack + 1 (65): a prefill forward of their own
        assert out == {"a": alone[0], "b": alone[1][:30]}


# MXFP4: the format, a published-layout checkpoint, the Triton kernel -----------------------------------
def pack_mxfp4(src: Path, dst: Path) -> Path:
    """src's 16-bit experts re-written as published: `*_blocks` / `*_scales` (gate/up rows interleaved,
    as the checkpoint's columns), config.json with quantization_config mxfp4."""
    from safetensors.torch import load_file, save_file

    from lynx_edge.quant.mxfp4 import pack_linear

    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    tensors = {}
    for f in src.glob("*.safetensors"):
        for name, t in load_file(f).items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                blocks, scales = pack_linear(t.transpose(1, 2))  # [E, out, in] rows → blocks
                tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            else:
                tensors[name] = t
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(shrunk_config(mxfp4=True), indent=2))
    return dst


@pytest.fixture(scope="module")
def mx_ckpt(ckpt, tmp_path_factory) -> Path:
    return pack_mxfp4(ckpt, tmp_path_factory.mktemp("gpt-oss-mx") / "mxfp4")


def hf_dequantized(path: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()


def test_mxfp4_dequant_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from lynx_edge.quant.mxfp4 import pack_linear, unpack_linear

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 140, (3, 8, 2), generator=g, dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)  # [E, out, in]
    assert torch.equal(unpack_linear(blocks, scales), want)
    # packing what it unpacked gives the same values back (−0 and +0 may swap codes)
    b2, s2 = pack_linear(want)
    assert torch.equal(unpack_linear(b2, s2), want)
    w = torch.randn(16, 64, generator=g)
    err = (unpack_linear(*pack_linear(w)) - w).abs() / w.abs().reshape(16, 2, 32).amax(-1).repeat_interleave(32, 1)
    assert err.max() < 1 / 3  # half the 4..6 gap (1 code unit) over amax ≥ 3 units (scale = 2^⌈log2(amax/6)⌉)


def test_mxfp4_checkpoint_matches_transformers_dequantized(mx_ckpt, exact_int4, monkeypatch):
    """The MXFP4 rows on fp32 activations give transformers' dequantised model to fp32 rounding; on
    the CPU default (int16 activations in blocks of 32 where native.default_int4_act() is q16) off
    by the activations' rounding only."""
    from lynx_edge.kernels import native
    from lynx_edge.step import prefill

    eng = Engine.from_pretrained(mx_ckpt, device="cpu", dtype=torch.float32)
    ex = eng.model.layers[0].mlp.experts
    assert ex.mxfp4 and ex.gate_up.dtype == torch.uint8  # kept 4-bit in memory
    E, D, I = 8, 64, 32
    assert ex.gate_up.numel() + ex.gate_up_scales.numel() + ex.down.numel() + ex.down_scales.numel() == \
        E * 3 * D * I * 17 // 32
    ids = prompt_ids()
    ref = hf_dequantized(mx_ckpt)
    ours = prefill(eng.model, eng._cache(1), 0, ids, 0, logits_for="all")[0]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].float()
    err = (ours - want).abs().max().item()
    assert err < 1e-5, err  # observed ~1e-6
    out = [t for c in eng.stream(ids, max_new_tokens=32, do_sample=False, ignore_eos=True) for t in c.token_ids]
    gen = ref.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                       eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert out == gen
    monkeypatch.setattr(native, "INT4_ACT", None)
    if native.lib() is None or native.default_int4_act() != "q16":
        return
    eng16 = Engine.from_pretrained(mx_ckpt, device="cpu", dtype=torch.float32)
    err16 = (prefill(eng16.model, eng16._cache(1), 0, ids, 0, logits_for="all")[0] - want).abs().max().item()
    # observed 4.7e-4 in logits of ~1 (gpt-oss's h reaches (limit + 1) * limit = 56 in a block of small
    # values; the same model in bf16 is 0.11 off): int16, and within its bound
    assert 1e-5 < err16 < 1e-3, err16
    out16 = [t for c in eng16.stream(ids, max_new_tokens=32, do_sample=False, ignore_eos=True) for t in c.token_ids]
    assert out16 == gen


def _oss_problem(T, K, E, D, I, dtype, mx: bool, seed=0):
    from lynx_edge.kernels.moe_mxfp4 import mxfp4_dequant, mxfp4_quantize

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g) * 2
    gu = torch.randn(E, 2 * I, D, generator=g) / D**0.5 * 3  # the clamp at ±7 cuts in
    dn = torch.randn(E, D, I, generator=g) / I**0.5
    gub, dnb = torch.randn(E, 2 * I, generator=g), torch.randn(E, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    if mx:
        (gq, gs), (dq, ds) = mxfp4_quantize(gu), mxfp4_quantize(dn)
        gu, dn = mxfp4_dequant(gq, gs, torch.float32), mxfp4_dequant(dq, ds, torch.float32)
        packed = dict(gate_up=gq.flatten(-2), down=dq.flatten(-2), gu_scales=gs, dn_scales=ds)
    else:
        packed = dict(gate_up=gu.to(dtype), down=dn.to(dtype))
    fetch = lambda e: (gu[e].to(dtype), gub[e].to(dtype), dn[e].to(dtype), dnb[e].to(dtype))  # noqa: E731
    return x.to(dtype), ids, w, packed, gub.to(dtype), dnb.to(dtype), fetch


OSS_CASES = [  # T, K, E, D, I, dtype, mxfp4 — T ≤ 4: the GEMV path, larger T: tl.dot
    (1, 2, 4, 64, 32, torch.float32, True), (3, 4, 8, 64, 64, torch.float16, True),
    (9, 2, 4, 64, 32, torch.float32, True), (5, 2, 4, 32, 64, torch.float16, False),
    (2, 2, 4, 64, 32, torch.float32, False)]


@pytest.mark.parametrize("case", OSS_CASES)
def test_interp_fused_moe_oss_matches_reference(case):
    from lynx_edge.kernels import moe_mxfp4

    if not moe_mxfp4.triton_ok(torch.empty(1), 32, 32):
        pytest.skip("runs in the TRITON_INTERPRET=1 subprocess of test_mxfp4_kernel_interpreter_suite")
    T, K, E, D, I, dtype, mx = case
    x, ids, w, packed, gub, dnb, fetch = _oss_problem(T, K, E, D, I, dtype, mx)
    want = moe_mxfp4.oss_moe_ref(x.float(), ids, w, E, lambda e: tuple(t.float() for t in fetch(e)), 7.0, 1.702)
    got = moe_mxfp4.fused_moe_oss(x, ids, w, packed["gate_up"], gub, packed["down"], dnb, 7.0, 1.702,
                                  gu_scales=packed.get("gu_scales"), dn_scales=packed.get("dn_scales"))
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_mxfp4_kernel_interpreter_suite():
    import os

    from conftest import run_interpreter_suite

    from lynx_edge.kernels import moe_gemm

    if moe_gemm.triton is None or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("triton not installed" if moe_gemm.triton is None else "this is the subprocess")
    run_interpreter_suite(__file__, len(OSS_CASES))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 4, 33])
def test_fused_moe_oss_on_cuda(T):
    from lynx_edge.kernels.moe_mxfp4 import fused_moe_oss, oss_moe_ref

    E, D, I = 32, 2880, 2880  # gpt-oss-20b's expert shape
    x, ids, w, packed, gub, dnb, fetch = _oss_problem(T, 4, E, D, I, torch.bfloat16, True)
    cu = lambda t: t.cuda() if t is not None else None  # noqa: E731
    got = fused_moe_oss(cu(x), cu(ids), cu(w), cu(packed["gate_up"]), cu(gub), cu(packed["down"]), cu(dnb), 7.0,
                        1.702, gu_scales=cu(packed["gu_scales"]), dn_scales=cu(packed["dn_scales"]))
    want = oss_moe_ref(x.float(), ids, w, E, lambda e: tuple(t.float() for t in fetch(e)), 7.0, 1.702)
    err = (got.float().cpu() - want).abs().max() / want.abs().max()
    assert err < 2e-2, err


# LYNX, 4-bit, info (offload: test_gpt_oss_offload.py) ----------------------------------------------------------------------------
class _Watch(RouteSpy):
    """Records (is_decode, ids, exact ids, weights) per call."""

    def record(self, scores, is_decode, ids, w, exact_ids):
        return is_decode, ids, exact_ids, w


def test_lynx_invariants(ckpt, monkeypatch):
    from lynx_edge.lynx import LynxConfig
    from lynx_edge.models import native_layer

    # the spy sees the router's Python calls: the module path (the layer call routes by the same rule
    # natively, bit-identical to it: test_native_route.py)
    monkeypatch.setattr(native_layer, "NATIVE_LAYERS", False)
    eng = Engine.from_pretrained(ckpt, device="cpu", dtype=torch.float32, lynx=LynxConfig(mode="lynx", j=0))
    watch = _Watch(eng.model.routing.route, eng.model.routing.spec)
    eng.model.routing.route = watch
    eng.generate_batch([prompt_ids(n, seed=n) for n in (5, 9, 13, 17, 21, 25)], max_new_tokens=6, ignore_eos=True)
    K, remapped = eng.cfg.top_k, 0
    for dec, ids, ids0, w in watch.calls:
        assert all(len(set(r)) == K for r in ids.tolist())  # k distinct
        assert torch.equal(ids[:, 0], ids0[:, 0])  # top-1 kept
        assert ids.unique().numel() <= ids0.unique().numel()  # the union never grows
        dec = torch.full((len(ids),), dec) if isinstance(dec, bool) else dec.reshape(-1).bool()
        assert torch.equal(ids[~dec], ids0[~dec])  # prefill exact
        torch.testing.assert_close(w.sum(1), torch.ones(len(w)))  # renormalised top-k (gpt-oss's softmax over k)
        remapped += int((ids != ids0).any(1).sum())
    assert remapped > 0


def test_four_bit_is_mxfp4_and_stays_close(ckpt):
    """--int4 on gpt-oss = MXFP4 experts (round-to-nearest at load from a 16-bit checkpoint; an
    MXFP4 checkpoint is kept as published: no second rounding, the published kernel format)."""
    import math

    ref = Engine.from_pretrained(ckpt, device="cpu", dtype=torch.float32)
    q = Engine.from_pretrained(ckpt, device="cpu", dtype=torch.float32, int4=True)
    assert all(layer.mlp.experts.mxfp4 for layer in q.model.layers)
    from lynx_edge.step import prefill

    ids = prompt_ids(60, seed=5)

    def nll(eng):
        lg = prefill(eng.model, eng._cache(1), 0, ids, 0, logits_for="all")[0]
        return torch.nn.functional.cross_entropy(lg[:-1], torch.tensor(ids[1:])).item()

    a, b = nll(ref), nll(q)
    assert 0 < abs(b - a) < 0.05 * a, (a, b)  # changed (4-bit), but close
    assert math.isfinite(b) and isinstance(q.generate(ids[:5], max_new_tokens=4, ignore_eos=True), str)


def test_info_on_the_real_config():
    """20.91B total (published); active 4.19B counting the input embedding as the other families'
    figures do — 3.61B without it, OpenAI's published figure (its model card excludes the embedding)."""
    from typer.testing import CliRunner

    from lynx_edge.cli.main import app
    from lynx_edge.offload.memory import expert_block_bytes

    r = CliRunner().invoke(app, ["info", str(REAL), "-o", "json"])
    assert r.exit_code == 0, r.output
    p = json.loads(r.stdout)["params"]
    V, D, L, E, I, H, Hkv, hd = 201088, 2880, 24, 32, 2880, 64, 8, 64
    attn = D * H * hd + H * hd + 2 * (D * Hkv * hd + Hkv * hd) + H * hd * D + D + H  # q,k,v,o (+biases), sinks
    moe = E * (3 * D * I + 2 * I + D) + E * D + E  # experts with biases, router with bias
    assert p["total"] == 2 * V * D + D + L * (attn + moe + 2 * D)  # exact hand count
    assert p["total"] == pytest.approx(20.9e9, rel=0.01)
    assert p["active"] - V * D == pytest.approx(3.6e9, rel=0.01)
    cfg = ModelConfig.from_file(REAL / "config.json")
    fmt, nb = expert_block_bytes(cfg, torch.bfloat16, True, 32, True)  # the memory plan's bytes per expert
    assert fmt == "mxfp4" and nb == 3 * D * I * 17 // 32 + (2 * I + D) * 2


def test_memory_plan_counts_the_ring_or_the_full_kv():
    """The real config at ctx 4096, B=16, bf16: 12 full layers of 4096 positions and 12 sliding
    (window 128) layers of a ring of 192 (384 slots) — or, with --swa-full, 24 full layers."""
    from lynx_edge.offload import OffloadOptions
    from lynx_edge.offload.memory import plan_memory

    cfg = ModelConfig.from_file(REAL / "config.json")
    per_pos = 16 * 2 * 8 * 64 * 2  # B × (K, V) × Hkv × hd × bf16
    for swa_full, want in ((False, 12 * 4096 + 12 * 384), (True, 24 * 4096)):
        plan = plan_memory(cfg, device="cpu", dtype=torch.bfloat16, offload=False, int4=False, ctx=4096, batch=16,
                           opts=OffloadOptions(swa_full=swa_full))
        kv = {k: v for r in plan.resources for k, v in r.parts.items() if k.startswith("KV cache")}
        assert list(kv.values()) == [per_pos * want], kv
        assert ("ring of 192" in next(iter(kv))) != swa_full
    from typer.testing import CliRunner

    from lynx_edge.cli.main import app
    for flag, want in (([], 12 * 4096 + 12 * 384), (["--swa-full"], 24 * 4096)):  # what info shows
        r = CliRunner().invoke(app, ["info", str(REAL), "-c", "4096", "-b", "16", "--dtype", "bfloat16", "-o", "json", *flag])
        parts = json.loads(r.stdout)["memory"]["resources"][0]["parts"]
        assert [v for k, v in parts.items() if k.startswith("KV cache")] == [per_pos * want]


# Harmony chat template, stop ids ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("harmony")
    write_tokenizer(d)
    return d


CHAT = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? Answer in 日本語."}]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]
HARMONY_CASES = [
    (CHAT, {"add_generation_prompt": True}),
    (CHAT, {"add_generation_prompt": True, "reasoning_effort": "high"}),
    ([{"role": "system", "content": "You are terse."}] + CHAT, {"add_generation_prompt": True,
                                                                "reasoning_effort": "low"}),
    ([{"role": "developer", "content": "Answer in French."}] + CHAT, {"add_generation_prompt": True, "tools": TOOLS}),
    ([{"role": "user", "content": "Add 1 and 2"},
      {"role": "assistant", "content": "", "thinking": "I should call add.",
       "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
      {"role": "tool", "content": "3"}], {"add_generation_prompt": True, "tools": TOOLS}),
    (CHAT[:1] + [{"role": "assistant", "content": "4", "thinking": "2+2 is 4."}], {}),
]


@pytest.mark.parametrize("i", range(len(HARMONY_CASES)))
def test_harmony_template_matches_transformers(tok_dir, i):
    from transformers import AutoTokenizer

    from lynx_edge.tokenizer import Tokenizer

    msgs, kw = HARMONY_CASES[i]
    ours = Tokenizer(tok_dir).apply_chat_template(msgs, **kw)
    ref = AutoTokenizer.from_pretrained(tok_dir).apply_chat_template(msgs, tokenize=False, **kw)
    assert ours == ref
    if kw.get("reasoning_effort"):
        assert f"Reasoning: {kw['reasoning_effort']}" in ours
    if kw.get("add_generation_prompt"):
        assert ours.endswith("<|start|>assistant")


def test_engine_stop_ids_and_reasoning_effort(ckpt):
    eng = Engine.from_pretrained(ckpt, device="cpu", dtype=torch.float32)
    assert eng.eos_token_ids == (200002, 199999)  # generation_config.json: <|return|>, <|endoftext|>
    want = eng.tokenizer.encode(eng.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True,
                                                                  reasoning_effort="high"), add_special_tokens=False)
    assert eng.encode_prompt(CHAT, {"reasoning_effort": "high"}) == want != eng.encode_prompt(CHAT)
    assert 200006 in want and 200008 in want  # <|start|>, <|message|> at their real ids


# the commands on gpt-oss: eval, bench, quantize -----------------------------------------------------------
def _cli(*args):
    from typer.testing import CliRunner

    from lynx_edge.cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args])


def test_eval_perplexity_equals_transformers(ckpt, tmp_path):
    """`lynx-edge eval`: the exact pass's perplexity = exp(mean NLL) transformers gives on the same
    windows (cut by the documented rule: n windows spread over the text); LYNX at batch 1 = exact."""
    import math

    from transformers import AutoTokenizer

    text = (Path(__file__).parent.parent / "lynx_edge" / "demo" / "heldout.txt").read_text()[:3000]
    (tmp_path / "text.txt").write_text(text)
    L, P, N = 24, 8, 2
    r = _cli("eval", ckpt, "-f", tmp_path / "text.txt", "-b", "1,2", "--seqs", N, "--seq-len", L, "--prefill-len", P,
             "-o", "json", "--dtype", "float32")
    assert r.exit_code == 0, r.output
    rows = {row["batch"]: row for row in json.loads(r.stdout.strip().splitlines()[-1])["rows"]}
    ids = AutoTokenizer.from_pretrained(ckpt).encode(text, add_special_tokens=False)
    stride = len(ids) // N
    ref = hf_model(ckpt)
    nll = []
    for w in (ids[i * stride: i * stride + L] for i in range(N)):
        with torch.no_grad():
            lg = ref(torch.tensor([w])).logits[0].float()
        nll.append(torch.nn.functional.cross_entropy(lg[P - 1:-1], torch.tensor(w[P:]), reduction="none"))
    want = math.exp(torch.cat(nll).mean().item())
    for b in (1, 2):  # batched teacher forcing = single = transformers (observed: equal to the last bit)
        assert rows[b]["ppl_exact"] == pytest.approx(want, rel=1e-7)
    assert rows[1]["ppl_lynx"] == rows[1]["ppl_exact"] and rows[1]["unique_lynx"] == rows[1]["unique_exact"] == 4
    assert rows[2]["unique_lynx"] <= rows[2]["unique_exact"]


def test_bench_lynx_both_rows(ckpt):
    r = _cli("bench", ckpt, "--lynx", "both", "-b", "1,3", "-p", "6", "-n", "4", "-r", "1", "-o", "json",
             "--quality", "off")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout.strip().splitlines()[-1])
    rows = {(row["batch"], row["lynx"]): row for row in data["rows"]}
    assert set(rows) == {(1, "off"), (1, "on"), (3, "off"), (3, "on")} and data["config"]["family"] == "gpt_oss"
    for (b, _), row in rows.items():
        assert row["decode_tok_s"] == pytest.approx(b * 1000.0 / row["tpot_ms"], rel=1e-9)  # one run: exact identity
    assert rows[1, "off"]["unique_experts_per_layer"] == rows[1, "on"]["unique_experts_per_layer"] == 4.0  # top-k
    assert 4.0 <= rows[3, "on"]["unique_experts_per_layer"] <= rows[3, "off"]["unique_experts_per_layer"] <= 8.0
    assert {c["batch"] for c in data["compare"]} == {1, 3}


def test_quantize_refuses_in_one_line(ckpt, mx_ckpt, tmp_path):
    """GPTQ INT4 experts run a plain SwiGLU without biases; gpt-oss's are clamped with biases, and its
    4-bit format is MXFP4 (--int4 at load; the published checkpoint is already MXFP4)."""
    r = _cli("quantize", ckpt, "-o", tmp_path / "q")
    assert r.exit_code == 1 and "MXFP4: load with --int4" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = _cli("quantize", mx_ckpt, "-o", tmp_path / "q")
    assert r.exit_code == 1 and "already a 4-bit checkpoint (MXFP4)" in r.stderr
    assert not (tmp_path / "q").exists()


def test_the_loader_releases_mxfp4_blocks_after_their_read(mx_ckpt, monkeypatch):
    """A `*_blocks` tensor waits in the reader for its `*_scales` (the next tensor) before any byte of
    it is read: the loader hands it back (Checkpoint.release) again after that unit, so its pages leave
    the process once read — released only at its own unit, they were faulted back in by the read and
    stayed for the rest of the load (gpt-oss-20b: ~12 GB of file pages counted in the load's RSS)."""
    from lynx_edge.checkpoint import Checkpoint
    from lynx_edge.models.gpt_oss import OssTensorReader

    events: list[tuple] = []  # ("read", data_ptr) when the reader reads a blocks tensor, ("release", data_ptr)
    release, pair = Checkpoint.release, OssTensorReader._mx_pair

    def spy_release(self, names):
        events.extend(("release", self.get(n).data_ptr()) for n in names)
        return release(self, names)

    def spy_pair(self, sink, base, blocks, scales):
        events.append(("read", blocks.data_ptr()))
        return pair(self, sink, base, blocks, scales)

    monkeypatch.setattr(Checkpoint, "release", spy_release)
    monkeypatch.setattr(OssTensorReader, "_mx_pair", spy_pair)
    Engine.from_pretrained(mx_ckpt, device="cpu", dtype=torch.float32)
    reads = [(i, p) for i, (kind, p) in enumerate(events) if kind == "read"]
    assert reads
    for i, p in reads:  # a release of the same bytes after the read
        assert ("release", p) in events[i + 1:], f"blocks read at event {i} never released after it"
