"""Each family against transformers (the reference): logits, greedy continuation, batching, KV cache."""
import pytest
import torch

from lynx_edge import Engine
from lynx_edge.step import prefill

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]
PROMPT = "def add(a, b):\n    return"


def _hf(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(tiny_models, family):
    eng = Engine.from_pretrained(tiny_models[family], device="cpu")
    ids = eng.tokenizer.encode(PROMPT)
    kv = eng._cache(1)
    ours = prefill(eng.model, kv, 0, ids, 0, logits_for="all")[0]
    with torch.no_grad():
        ref = _hf(tiny_models[family])(torch.tensor([ids])).logits[0].float()
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_32_tokens_match_transformers(tiny_models, family):
    eng = Engine.from_pretrained(tiny_models[family], device="cpu")
    ids = eng.tokenizer.encode(PROMPT)
    out = []
    for c in eng.stream(ids, max_new_tokens=32, ignore_eos=True):
        out += c.token_ids
    ref = _hf(tiny_models[family]).generate(
        torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(ids):].tolist()
    assert out == ref


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_equals_single(tiny_models, family):
    eng = Engine.from_pretrained(tiny_models[family], device="cpu")
    prompts = ["def", "import os\nimport", "The quick brown fox jumps over", "class Point:\n    def __init__(self"]
    batch = eng.generate_batch(prompts, max_new_tokens=12, ignore_eos=True)
    single = [eng.generate(p, max_new_tokens=12, ignore_eos=True) for p in prompts]
    assert batch == single


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_kv_cached_decode_equals_recompute(tiny_models, family):
    eng = Engine.from_pretrained(tiny_models[family], device="cpu")
    ids = eng.tokenizer.encode(PROMPT)
    toks = []
    for c in eng.stream(ids, max_new_tokens=8, ignore_eos=True):
        toks += c.token_ids
    # recompute the whole sequence from scratch in one prefill: each step's argmax must agree
    kv = eng._cache(1)
    full = prefill(eng.model, kv, 0, ids + toks, 0, logits_for="all")[0]
    assert full[len(ids) - 1:-1].argmax(-1).tolist() == toks


def test_sliding_window_matches_transformers(tmp_path):
    from conftest import make_tiny

    path = make_tiny(tmp_path / "m", "mixtral", sliding_window=4)
    eng = Engine.from_pretrained(path, device="cpu")
    ids = eng.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    assert len(ids) > 6
    ours = prefill(eng.model, eng._cache(1), 0, ids, 0, logits_for="all")[0]
    with torch.no_grad():
        ref = _hf(path)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_linear_rope_scaling_matches_transformers(tmp_path):
    from conftest import make_tiny

    path = make_tiny(tmp_path / "m", "qwen3_moe", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    eng = Engine.from_pretrained(path, device="cpu")
    ids = eng.tokenizer.encode(PROMPT)
    ours = prefill(eng.model, eng._cache(1), 0, ids, 0, logits_for="all")[0]
    with torch.no_grad():
        ref = _hf(path)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
