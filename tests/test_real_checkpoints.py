"""Published checkpoints' own files against transformers (issue 11).

Each model is a tiny random checkpoint built from a real config.json (only the sizes shrunk, every
other field kept, absent fields left absent), with the real generation_config.json,
tokenizer_config.json, chat templates and tokenizer.json (tests/fixtures/real/, see its README).
References: transformers' config classes (defaults), AutoModelForCausalLM (logits, greedy ids,
stopping), AutoTokenizer (chat templates, decode).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import lzma
import random
import shutil
from pathlib import Path

import pytest
import torch

from lynx_edge import Engine
from lynx_edge.config import ModelConfig
from lynx_edge.models import FAMILIES
from lynx_edge.tokenizer import Detokenizer, Tokenizer

REAL = Path(__file__).parent / "fixtures" / "real"
MODELS = {"mixtral": "mixtral-8x7b-instruct-v0.1", "qwen3_moe": "qwen3-30b-a3b",
          "qwen2_moe": "qwen1.5-moe-a2.7b-chat", "olmoe": "olmoe-1b-7b-0924"}
# sizes only: everything else in the real config.json is kept as written
SIZES = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 48,
         "moe_intermediate_size": 24, "shared_expert_intermediate_size": 40, "num_experts": 8,
         "num_local_experts": 8, "head_dim": 16}
PROMPT = "The capital of France is Paris. Héllo wörld — 日本語 🙂\ndef add(a, b):"


def _write_tokenizer(name: str, dst: Path) -> None:
    src = REAL / name
    if (src / "tokenizer.json.xz").is_file():
        (dst / "tokenizer.json").write_bytes(lzma.decompress((src / "tokenizer.json.xz").read_bytes()))
        return
    # the Qwen models share one byte-level BPE; each keeps its own added tokens
    tok = json.loads(lzma.decompress((REAL / "qwen-bpe" / "tokenizer.json.xz").read_bytes()))
    if (src / "added_tokens.json").is_file():
        tok["added_tokens"] = json.loads((src / "added_tokens.json").read_text())
    (dst / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))


def real_files(name: str, dst: Path) -> Path:
    """The real non-weight files of `name` in dst (tokenizer.json rebuilt from the compressed copy)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in (REAL / name).iterdir():
        if f.suffix in (".json", ".jinja") and f.name != "added_tokens.json":
            shutil.copy(f, dst / f.name)
    _write_tokenizer(name, dst)
    return dst


def shrink(cfg: dict) -> dict:
    out = dict(cfg)
    heads = cfg["num_attention_heads"]
    for k, v in SIZES.items():
        if k in out:
            out[k] = v
    if "num_key_value_heads" in cfg:  # keep the GQA ratio
        out["num_key_value_heads"] = max(1, SIZES["num_attention_heads"] * cfg["num_key_value_heads"] // heads)
    out["num_experts_per_tok"] = min(cfg["num_experts_per_tok"], 4)
    return out


def build(family: str, dst: Path, seed: int = 0, rig=None) -> Path:
    """A tiny random checkpoint with the real files; config.json rewritten to the shrunk real dict
    after save_pretrained, so absent fields stay absent (transformers reads them the same way)."""
    import transformers

    name = MODELS[family]
    real_files(name, dst)
    cfg = shrink(json.loads((REAL / name / "config.json").read_text()))
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    config = transformers.AutoConfig.from_pretrained(dst)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("mlp.gate.weight"):  # sharper routers: clear-cut top-k choices
                p.normal_(0, 0.5)
            elif n.endswith("norm.weight"):  # non-trivial norms, so eps and clip order matter
                p.uniform_(0.5, 1.5)
        if rig is not None:
            rig(model, dst)
    model.save_pretrained(dst)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))  # the real (shrunk) file, not transformers'
    shutil.copy(REAL / name / "generation_config.json", dst / "generation_config.json")
    return dst


def variant(src: Path, dst: Path, **changes) -> Path:
    """The same weights (linked) under a config.json with fields changed (None: removed)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    for k, v in changes.items():
        cfg.pop(k, None) if v is None else cfg.__setitem__(k, v)
    (dst / "config.json").unlink()
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def hf_model(path: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def real_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("real")
    out = {f: build(f, root / f) for f in MODELS}
    # item 2: OLMoE's file has no rms_norm_eps; qwen3_moe without norm_topk_prob means False
    out["qwen3_moe:no-norm_topk_prob"] = variant(out["qwen3_moe"], root / "q3-nonorm", norm_topk_prob=None)
    # item 3: clip_qkv is applied after OLMoE's q/k norm
    out["olmoe:clip_qkv"] = variant(out["olmoe"], root / "olmoe-clip", clip_qkv=0.5)
    # YaRN, the way Qwen3 model cards extend the context: the prompt runs past the original length
    out["qwen3_moe:yarn"] = variant(out["qwen3_moe"], root / "q3-yarn", rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})
    return out


# item 2: the family-defaults table -----------------------------------------------------------------
HF_CLASSES = {"mixtral": "MixtralConfig", "qwen2_moe": "Qwen2MoeConfig", "qwen3_moe": "Qwen3MoeConfig",
              "olmoe": "OlmoeConfig"}


@pytest.mark.parametrize("family", list(HF_CLASSES))
def test_defaults_table_matches_transformers(family):
    import transformers

    cls = getattr(transformers, HF_CLASSES[family])
    declared = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(cls)}
    for name, value in FAMILIES[family].DEFAULTS.items():
        ref = cls.default_theta if name == "rope_theta" else declared.get(name, "<not a field>")
        assert ref == value and type(ref) is type(value), f"{family}.{name}: table {value!r}, transformers {ref!r}"
    # and what a config.json with nothing but model_type parses to, against the class instance
    ours, ref = ModelConfig.from_dict({"model_type": family}), cls()
    assert ours.rms_norm_eps == ref.rms_norm_eps and ours.vocab_size == ref.vocab_size
    assert ours.max_position_embeddings == ref.max_position_embeddings
    assert ours.num_kv_heads == ref.num_key_value_heads and ours.num_heads == ref.num_attention_heads
    assert ours.head_dim == (getattr(ref, "head_dim", None) or ref.hidden_size // ref.num_attention_heads)
    assert ours.rope.theta == ref.rope_parameters["rope_theta"]
    assert ours.top_k == ref.num_experts_per_tok and ours.num_layers == ref.num_hidden_layers
    assert ours.num_experts == (ref.num_local_experts if family == "mixtral" else ref.num_experts)
    if family != "mixtral":
        assert ours.norm_topk_prob == ref.norm_topk_prob
    assert ours.tie_word_embeddings == ref.tie_word_embeddings


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_sliding_window_layers_match_transformers(family):
    import transformers

    cls = getattr(transformers, HF_CLASSES[family])
    for kw in ({}, {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 5},
               {"use_sliding_window": True, "sliding_window": 64, "layer_types": ["full_attention"] * 4}):
        ref = cls(num_hidden_layers=4, **kw)
        ours = ModelConfig.from_dict({"model_type": family, "num_hidden_layers": 4, **kw}).sliding_windows
        if family == "qwen2_moe":
            want = tuple(ref.sliding_window or None if t == "sliding_attention" else None for t in ref.layer_types)
        else:  # one mask for every layer
            want = tuple([ref.sliding_window] * 4)
        assert ours == want, kw


def test_defaults_table_test_catches_a_wrong_value(monkeypatch):
    monkeypatch.setitem(FAMILIES["olmoe"].DEFAULTS, "rms_norm_eps", 1e-6)  # the old guess
    with pytest.raises(AssertionError, match="rms_norm_eps"):
        test_defaults_table_matches_transformers("olmoe")


# logits and greedy ids per model -------------------------------------------------------------------
CASES = ["mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "qwen3_moe:no-norm_topk_prob", "olmoe:clip_qkv",
         "qwen3_moe:yarn"]


@pytest.mark.parametrize("case", CASES)
def test_prefill_logits_and_greedy_match_transformers(real_models, case):
    from lynx_edge.step import prefill

    path = real_models[case]
    eng = Engine.from_pretrained(path, device="cpu", dtype=torch.float32)
    ids = eng.tokenizer.encode(PROMPT)
    ref = hf_model(path)
    ours = prefill(eng.model, eng._cache(1), 0, ids, 0, logits_for="all")[0]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)
    out = [t for c in eng.stream(ids, max_new_tokens=12, do_sample=False, ignore_eos=True) for t in c.token_ids]
    gen = ref.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                       eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert out == gen


def test_parity_cases_are_sensitive(real_models):
    """The old guesses (OLMoE eps 1e-6, qwen3_moe norm_topk_prob True when absent) move the logits by
    more than the parity tolerance, so the cases above would catch them."""
    from lynx_edge.models.layers import RMSNorm
    from lynx_edge.routing import ExactRouter, RouterSpec
    from lynx_edge.step import prefill

    def logits(eng):
        ids = eng.tokenizer.encode(PROMPT)
        return prefill(eng.model, eng._cache(1), 0, ids, 0, logits_for="all")[0]

    eng = Engine.from_pretrained(real_models["olmoe"], device="cpu")
    assert eng.cfg.rms_norm_eps == 1e-5
    right = logits(eng)
    for m in eng.model.modules():
        if isinstance(m, RMSNorm):
            m.eps = 1e-6
    assert (logits(eng) - right).abs().max() > 1e-3
    eng = Engine.from_pretrained(real_models["qwen3_moe:no-norm_topk_prob"], device="cpu")
    assert eng.cfg.norm_topk_prob is False
    right = logits(eng)
    spec = eng.model.routing.spec
    eng.model.routing.route = ExactRouter(RouterSpec(spec.num_experts, spec.top_k, True, 0))
    assert (logits(eng) - right).abs().max() > 3e-4


# item 1: end-of-sequence ids and generation defaults -------------------------------------------------
def _rig_eos(model, dst):
    """lm_head row 151643 (<|endoftext|>, an eos id only in generation_config.json) made to win at the
    third greedy step: its row is the normed hidden state of that step, scaled up."""
    tok = Tokenizer(dst)
    ids = tok.encode("The capital of France is")
    x = torch.tensor([ids])
    for _ in range(2):
        nxt = model(x).logits[0, -1].argmax()
        x = torch.cat([x, nxt.view(1, 1)], 1)
    h = model.model(x).last_hidden_state[0, -1]  # after the final norm
    model.lm_head.weight[151643] = h * (50.0 / h.norm() ** 2)


@pytest.fixture(scope="module")
def rigged_qwen3(tmp_path_factory) -> Path:
    return build("qwen3_moe", tmp_path_factory.mktemp("rig") / "q3", rig=_rig_eos)


def test_generation_config_eos_stops_like_transformers(rigged_qwen3):
    eng = Engine.from_pretrained(rigged_qwen3, device="cpu")
    assert eng.cfg.eos_token_ids == (151645,) and eng.eos_token_ids == (151645, 151643)
    ids = eng.tokenizer.encode("The capital of France is")
    chunks = list(eng.stream(ids, max_new_tokens=20, do_sample=False))
    out = [t for c in chunks for t in c.token_ids]
    ref = hf_model(rigged_qwen3).generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)[0, len(ids):]
    assert out == ref.tolist() and out[-1] == 151643 and len(out) < 20
    assert chunks[-1].finish_reason == "stop"
    # eos_token_id= replaces the model's set (transformers' argument), int or list
    for eos in (out[0], [out[0]]):
        got = [t for c in eng.stream(ids, max_new_tokens=20, do_sample=False, eos_token_id=eos) for t in c.token_ids]
        assert got == out[:1]
    got = [t for c in eng.stream(ids, max_new_tokens=5, do_sample=False, eos_token_id=[151645]) for t in c.token_ids]
    want = hf_model(rigged_qwen3).generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False,
                                           eos_token_id=[151645])[0, len(ids):].tolist()
    assert got == want and len(got) == 5


def test_tokenizer_eos_is_not_a_stop_token_when_the_model_files_say_otherwise(real_models, tmp_path):
    src = real_models["olmoe"]
    eng = Engine.from_pretrained(src, device="cpu")
    ids = eng.tokenizer.encode("The capital of France is")
    first = [t for c in eng.stream(ids, max_new_tokens=6, do_sample=False) for t in c.token_ids]
    bad = variant(src, tmp_path / "bad-eos")
    tc = json.loads((src / "tokenizer_config.json").read_text())
    tc["eos_token"] = eng.tokenizer.tok.id_to_token(first[1])  # a token greedy produces
    (bad / "tokenizer_config.json").unlink()
    (bad / "tokenizer_config.json").write_text(json.dumps(tc))
    eng2 = Engine.from_pretrained(bad, device="cpu")
    assert eng2.tokenizer.eos_token_id == first[1]
    again = [t for c in eng2.stream(ids, max_new_tokens=6, do_sample=False) for t in c.token_ids]
    ref = hf_model(bad).generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
    assert again == first == ref


def test_generation_defaults_from_generation_config(real_models):
    eng = Engine.from_pretrained(real_models["qwen3_moe"], device="cpu")
    sp = eng.sampling_params()
    assert (sp.do_sample, sp.temperature, sp.top_k, sp.top_p) == (True, 0.6, 20, 0.95)
    assert eng.sampling_params(temperature=0.9, do_sample=False).temperature == 0.9
    ids = eng.tokenizer.encode("Hi")
    implicit = eng.generate(ids, max_new_tokens=8, seed=3, ignore_eos=True)
    explicit = eng.generate(ids, max_new_tokens=8, seed=3, ignore_eos=True, do_sample=True, temperature=0.6,
                            top_k=20, top_p=0.95)
    assert implicit == explicit
    mix = Engine.from_pretrained(real_models["mixtral"], device="cpu").sampling_params()
    assert (mix.do_sample, mix.temperature, mix.top_k) == (False, 1.0, 0)  # nothing in its file


def test_dtype_accepts_torch_dtypes(real_models):
    eng = Engine.from_pretrained(real_models["olmoe"], device="cpu", dtype=torch.bfloat16)
    assert eng.model.embed_tokens.dtype == torch.bfloat16


# item 4: chat templates ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tok")
    out = {MODELS[f]: real_files(MODELS[f], root / MODELS[f]) for f in MODELS}
    olmo = real_files(MODELS["olmoe"], root / "olmoe-instruct")
    shutil.copy(olmo / "chat_template.olmo-instruct.jinja", olmo / "chat_template.jinja")
    out["olmoe-instruct"] = olmo
    return out


CHAT = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? Answer in 日本語."}]
SYSTEM = [{"role": "system", "content": "You are terse."}]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "number"}, "b": {"type": "number"}}}}}]
THOUGHT = [{"role": "user", "content": "Hi"},
           {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
           {"role": "user", "content": "Call add"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
           {"role": "tool", "content": "3"}]


@pytest.mark.parametrize("name", list(MODELS.values()))
def test_real_tokenizers_encode_and_decode_like_transformers(tok_dirs, name):
    ours, ref = _tokenizers(tok_dirs[name])
    for text in (PROMPT, "  two  spaces\n\n\ttab", "<|im_start|>user\nhi<|im_end|>", ""):
        ids = ours.encode(text)
        assert ids == ref(text)["input_ids"], text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


@functools.lru_cache(maxsize=None)
def _tokenizers(d: Path):
    from transformers import AutoTokenizer

    return Tokenizer(d), AutoTokenizer.from_pretrained(d)


def _both(d: Path, msgs, **kw):
    ours, ref = _tokenizers(d)
    return ours.apply_chat_template(msgs, **kw), ref.apply_chat_template(msgs, tokenize=False, **kw)


QWEN3_CASES = [
    (CHAT, {}), (CHAT, {"add_generation_prompt": True}),
    (SYSTEM + CHAT, {"add_generation_prompt": True, "enable_thinking": False}),
    (CHAT, {"add_generation_prompt": True, "enable_thinking": True}),
    (SYSTEM + CHAT, {"add_generation_prompt": True, "tools": TOOLS}),
    (THOUGHT, {"add_generation_prompt": True, "tools": TOOLS, "enable_thinking": False}),
    (CHAT, {"add_generation_prompt": True, "documents": [{"title": "t", "text": "x"}], "reasoning_effort": "low"}),
    (CHAT + [{"role": "assistant", "content": "6, i.e."}], {"continue_final_message": True}),
]


@pytest.mark.parametrize("i", range(len(QWEN3_CASES)))
def test_qwen3_template_with_arguments_matches_transformers(tok_dirs, i):
    msgs, kw = QWEN3_CASES[i]
    ours, ref = _both(tok_dirs["qwen3-30b-a3b"], msgs, **kw)
    assert ours == ref


@pytest.mark.parametrize("name", ["mixtral-8x7b-instruct-v0.1", "olmoe-instruct", "qwen1.5-moe-a2.7b-chat"])
def test_other_real_templates_match_transformers(tok_dirs, name):
    d = tok_dirs[name]
    for msgs in (CHAT, SYSTEM + CHAT):
        for kw in ({}, {"add_generation_prompt": True}, {"enable_thinking": False, "add_generation_prompt": True}):
            try:
                ours, ref = _both(d, msgs, **kw)
            except Exception as exc:  # Mixtral's Dec-2023 template rejects a system role: both must
                from jinja2.exceptions import TemplateError

                assert isinstance(exc, TemplateError) and name.startswith("mixtral") and msgs[0]["role"] == "system"
                with pytest.raises(TemplateError, match="roles"):
                    Tokenizer(d).apply_chat_template(msgs, **kw)
                continue
            assert ours == ref, (msgs, kw)
    if name.startswith("mixtral"):  # the 2024 template (system folded into the first [INST]), by argument
        t2024 = (d / "chat_template_2024.jinja").read_text()
        for msgs in (CHAT, SYSTEM + CHAT):
            ours, ref = _both(d, msgs, chat_template=t2024)
            assert ours == ref and ("You are terse.\n\n" in ours) == (msgs[0]["role"] == "system")


def test_generation_tag_and_tojson_options_match_transformers(tok_dirs, tmp_path):
    d = real_files(MODELS["olmoe"], tmp_path / "t")
    (d / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}A: {{ m.content }}"
        "{% endgeneration %}{% else %}U: {{ m.content }}{% endif %}\n{% endfor %}"
        "{{ tools | tojson(separators=(',', ':'), sort_keys=True) }}|{{ tools | tojson(indent=2) }}"
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}"
        "{% if flavour is defined %}|{{ flavour }}{% endif %}")
    ours, ref = _both(d, CHAT, tools=[{"z": 1, "a": ["é", "<&>"]}], flavour="x")
    assert ours == ref and '{"a":["é","<&>"],"z":1}' in ours and "A: 4" in ours


def test_engine_passes_chat_template_kwargs(real_models):
    eng = Engine.from_pretrained(real_models["qwen3_moe"], device="cpu")
    want = eng.tokenizer.encode(eng.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True,
                                                                  enable_thinking=False), add_special_tokens=False)
    assert eng.encode_prompt(CHAT, {"enable_thinking": False}) == want
    assert eng.encode_prompt(CHAT) != want
    kw = dict(max_new_tokens=4, do_sample=False, ignore_eos=True)
    assert eng.generate(CHAT, chat_template_kwargs={"enable_thinking": False}, **kw) == eng.generate(want, **kw)


# item 5: streaming text equals the final text ---------------------------------------------------------
def _stream_equals_decode(tok: Tokenizer, ids: list[int]) -> None:
    det, text = Detokenizer(tok), ""
    final = tok.decode(ids)
    for i in ids:
        text += det.push(i)
        assert final.startswith(text), (ids, text, final)
    text += det.flush()
    assert text == final, ids


@pytest.mark.parametrize("name", ["mixtral-8x7b-instruct-v0.1", "qwen3-30b-a3b", "olmoe-1b-7b-0924"])
def test_stream_text_equals_decode_on_byte_mixed_sequences(tok_dirs, name):
    tok, ref = _tokenizers(tok_dirs[name])
    rng = random.Random(0)
    if tok.byte_ids:  # SentencePiece byte fallback: <0xNN> tokens
        assert len(tok.byte_ids) == 256
        raw = sorted(tok.byte_ids)
    else:  # byte-level BPE: the 256 one-byte tokens
        raw = sorted(i for t, i in tok.tok.get_vocab(with_added_tokens=False).items() if len(t) == 1)
    words = tok.encode("Hello wörld, 日本語 🙂 and\n  more text", add_special_tokens=False)
    specials = [i for i in (tok.eos_token_id, tok.bos_token_id) if i is not None]
    for _ in range(40):
        ids = [rng.choice(raw) if rng.random() < 0.6 else rng.choice(words + specials) for _ in range(rng.randint(1, 24))]
        # whole characters split into bytes, stray continuation bytes, cut mid-character
        ch = "é日🙂"[rng.randrange(3)].encode()
        ids += [tok.tok.token_to_id(f"<0x{b:02X}>") for b in ch] if tok.byte_ids else tok.encode(ch.decode())
        ids = ids[: rng.randint(1, len(ids))]
        _stream_equals_decode(tok, ids)
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_stream_chunks_join_to_decode_in_the_engine(real_models):
    eng = Engine.from_pretrained(real_models["mixtral"], device="cpu")
    for seed in range(3):
        chunks = list(eng.stream("Héllo", max_new_tokens=24, do_sample=True, temperature=5.0, seed=seed,
                                 ignore_eos=True))
        ids = [t for c in chunks for t in c.token_ids]
        assert "".join(c.text for c in chunks) == eng.tokenizer.decode(ids)


# item 6: bad prompts on a real vocabulary ----------------------------------------------------------------
def test_out_of_vocabulary_ids_are_one_clear_line(real_models):
    eng = Engine.from_pretrained(real_models["olmoe"], device="cpu")
    V = eng.cfg.vocab_size
    for bad in (-1, V, V + 10):
        with pytest.raises(ValueError) as e:
            eng.generate([12092, bad], max_new_tokens=2)
        assert f"token id {bad} " in str(e.value) and "\n" not in str(e.value)
    assert isinstance(eng.generate([V - 1], max_new_tokens=1, ignore_eos=True), str)  # padding rows are valid


# the CLI: --chat-template-kwargs, --verbose-prompt, defaults from the model ---------------------------
def test_cli_chat_template_kwargs_and_verbose_prompt(real_models):
    from typer.testing import CliRunner

    from lynx_edge.cli.main import app

    path = real_models["qwen3_moe"]
    run = lambda *a: CliRunner().invoke(app, ["chat", str(path), "-p", "hi", "-n", "2", "--verbose-prompt", *a])  # noqa: E731
    r = run("--chat-template-kwargs", '{"enable_thinking": false}')
    assert r.exit_code == 0, r.output
    _, ref = _both(path, [{"role": "user", "content": "hi"}], add_generation_prompt=True, enable_thinking=False)
    assert ref.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and ref in r.stderr
    assert "temperature=0.6" in r.stderr and "top_k=20" in r.stderr  # the model's defaults, announced
    r = run("--temp", "0")
    _, plain = _both(path, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert r.exit_code == 0 and plain in r.stderr and "</think>" not in r.stderr
    assert "temperature=" not in r.stderr
    r = run("--chat-template-kwargs", "{oops")
    assert r.exit_code != 0 and "--chat-template-kwargs" in r.output and "Traceback" not in r.output


def test_cli_chat_without_a_template_is_plain_text(real_models):
    from typer.testing import CliRunner

    from lynx_edge.cli.main import app

    path = real_models["olmoe"]  # the base model: no chat template
    r = CliRunner().invoke(app, ["chat", str(path), "-p", "The capital of France is", "-n", "4", "--temp", "0"])
    assert r.exit_code == 0, r.output
    eng = Engine.from_pretrained(path, device="cpu")
    assert r.stdout == eng.generate("The capital of France is", max_new_tokens=4, do_sample=False) + "\n"
