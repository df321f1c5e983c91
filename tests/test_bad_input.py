"""Each bad-input case gives its documented one-line error, naming the file or tensor."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from lynx_edge import Engine
from lynx_edge.config import ConfigError
from lynx_edge.engine import ContextError
from lynx_edge.hub import ModelNotFound
from lynx_edge.loader import LoadError
from lynx_edge.tokenizer import TokenizerError


@pytest.fixture
def model_copy(tiny_models, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(tiny_models["qwen3_moe"], dst)
    return dst


def _one_line(exc) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_unknown_model_type_lists_supported(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["model_type"] = "llama"
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        Engine.from_pretrained(model_copy)
    msg = _one_line(e)
    assert "'llama'" in msg and "mixtral" in msg and "olmoe" in msg and "config.json" in msg


def test_missing_tensor_named(model_copy):
    sd = load_file(model_copy / "model.safetensors")
    del sd["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(sd, model_copy / "model.safetensors")
    with pytest.raises(LoadError) as e:
        Engine.from_pretrained(model_copy)
    assert "layers.1.mlp.experts.3" in _one_line(e) and "up" in str(e.value)


def test_missing_plain_tensor_named(model_copy):
    sd = load_file(model_copy / "model.safetensors")
    del sd["model.layers.0.self_attn.k_norm.weight"]
    save_file(sd, model_copy / "model.safetensors")
    with pytest.raises(LoadError, match="layers.0.self_attn.k_norm.weight"):
        Engine.from_pretrained(model_copy)


def test_wrong_shape_named(model_copy):
    sd = load_file(model_copy / "model.safetensors")
    sd["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    save_file(sd, model_copy / "model.safetensors")
    with pytest.raises(LoadError) as e:
        Engine.from_pretrained(model_copy)
    assert "model.layers.0.self_attn.q_proj.weight" in _one_line(e) and "(3, 3)" in str(e.value)


def test_truncated_safetensors(model_copy):
    f = model_copy / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(LoadError) as e:
        Engine.from_pretrained(model_copy)
    assert "truncated" in _one_line(e) and "model.safetensors" in str(e.value)


def test_corrupt_safetensors(model_copy):
    (model_copy / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + b"\0" * 64)
    with pytest.raises(LoadError, match="corrupt"):
        Engine.from_pretrained(model_copy)


def test_missing_tokenizer(model_copy):
    (model_copy / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Engine.from_pretrained(model_copy)


def test_pickle_refused_without_opt_in(model_copy):
    sd = load_file(model_copy / "model.safetensors")
    (model_copy / "model.safetensors").unlink()
    torch.save(sd, model_copy / "pytorch_model.bin")
    with pytest.raises(LoadError) as e:
        Engine.from_pretrained(model_copy)
    assert "allow_pickle" in _one_line(e)
    eng = Engine.from_pretrained(model_copy, allow_pickle=True)  # explicit opt-in: weights_only unpickling
    assert eng.generate("def", max_new_tokens=2, ignore_eos=True) is not None


def test_sharded_checkpoint_loads_same(tiny_models, tmp_path):
    src = tiny_models["mixtral"]
    dst = tmp_path / "sharded"
    shutil.copytree(src, dst)
    sd = load_file(dst / "model.safetensors")
    (dst / "model.safetensors").unlink()
    names = sorted(sd)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: sd[k] for k in part}, dst / fname)
        weight_map.update({k: fname for k in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    a = Engine.from_pretrained(src).generate("def", max_new_tokens=8, ignore_eos=True)
    b = Engine.from_pretrained(dst).generate("def", max_new_tokens=8, ignore_eos=True)
    assert a == b


def test_fused_expert_names_load_same(tiny_models, tmp_path):
    """transformers' in-memory fused names (experts.gate_up_proj / down_proj) load identically."""
    src = tiny_models["qwen3_moe"]
    dst = tmp_path / "fused"
    shutil.copytree(src, dst)
    sd = load_file(dst / "model.safetensors")
    out = {k: v for k, v in sd.items() if ".experts." not in k}
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts"
        gate = torch.stack([sd[f"{p}.{e}.gate_proj.weight"] for e in range(8)])
        up = torch.stack([sd[f"{p}.{e}.up_proj.weight"] for e in range(8)])
        out[f"{p}.gate_up_proj"] = torch.cat([gate, up], dim=1)
        out[f"{p}.down_proj"] = torch.stack([sd[f"{p}.{e}.down_proj.weight"] for e in range(8)])
    save_file(out, dst / "model.safetensors")
    a = Engine.from_pretrained(src).generate("def", max_new_tokens=8, ignore_eos=True)
    b = Engine.from_pretrained(dst).generate("def", max_new_tokens=8, ignore_eos=True)
    assert a == b


def test_bf16_checkpoint_loads(tiny_models, tmp_path):
    from conftest import make_tiny

    path = make_tiny(tmp_path / "bf16", "olmoe", dtype=torch.bfloat16)
    eng = Engine.from_pretrained(path, dtype="bfloat16")
    assert eng.model.embed_tokens.dtype == torch.bfloat16
    assert isinstance(eng.generate("def", max_new_tokens=4, ignore_eos=True), str)


def test_prompt_over_context(tiny_models):
    eng = Engine.from_pretrained(tiny_models["olmoe"], ctx_size=16)
    long = "def add(a, b): return a + b " * 20
    with pytest.raises(ContextError) as e:
        eng.generate(long, max_new_tokens=4)
    assert "context of 16" in _one_line(e)
    text = eng.generate(long, max_new_tokens=4, truncate=True, ignore_eos=True)  # only when asked
    assert isinstance(text, str)


def test_unknown_rope_scaling_rejected(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "longrope", "factor": 4.0, "rope_theta": 10000.0}
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="'longrope'"):
        Engine.from_pretrained(model_copy)
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}  # without its length
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="original_max_position_embeddings"):
        Engine.from_pretrained(model_copy)


def test_missing_directory():
    with pytest.raises(ModelNotFound, match="no such directory"):
        Engine.from_pretrained("./does/not/exist")


def test_unknown_sampling_argument(tiny_models):
    eng = Engine.from_pretrained(tiny_models["olmoe"])
    with pytest.raises(TypeError, match="temprature"):
        eng.generate("def", temprature=0.5)


# prompts and generation arguments (issue 11 item 6): one clear error, or the documented result
def test_bad_token_ids_named(tiny_models):
    eng = Engine.from_pretrained(tiny_models["olmoe"])
    V = eng.cfg.vocab_size
    for bad in (-1, V):
        for call in (lambda: eng.generate([5, bad], max_new_tokens=2),
                     lambda: eng.generate_batch([[5], [bad]], max_new_tokens=2)):
            with pytest.raises(ValueError) as e:
                call()
            assert f"token id {bad} " in _one_line(e)


def test_empty_prompts(tiny_models):
    eng = Engine.from_pretrained(tiny_models["olmoe"])
    for empty in ([], "", ()):
        with pytest.raises(ContextError, match="empty prompt"):
            eng.generate(empty, max_new_tokens=2)
    assert eng.generate_batch([], max_new_tokens=2) == []
    assert list(eng.stream_batch([], max_new_tokens=2)) == []


def test_max_new_tokens_zero_and_none(tiny_models):
    eng = Engine.from_pretrained(tiny_models["olmoe"], ctx_size=24)
    chunks = list(eng.stream("def", max_new_tokens=0))
    assert [c.token_ids for c in chunks] == [[]] and chunks[-1].finish_reason == "length"
    assert chunks[-1].stats["completion_tokens"] == 0
    assert eng.generate_batch(["def", "import"], max_new_tokens=0) == ["", ""]
    ids = eng.tokenizer.encode("def add(a, b):")
    out = [t for c in eng.stream(ids, max_new_tokens=None, ignore_eos=True) for t in c.token_ids]
    assert len(ids) + len(out) == 24  # until the context is full
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.generate("def", max_new_tokens=-1)


def test_bad_stop_strings_and_eos_ids(tiny_models):
    eng = Engine.from_pretrained(tiny_models["olmoe"])
    for bad in ([""], ["x", ""]):
        with pytest.raises(ValueError, match="stop_strings") as e:
            eng.generate("def", max_new_tokens=2, stop_strings=bad)
        _one_line(e)
    with pytest.raises(ValueError, match="eos_token_id"):
        eng.generate("def", max_new_tokens=2, eos_token_id="2")
    with pytest.raises(ValueError, match="seed has 1 entries for 2 prompts"):
        eng.generate_batch(["a", "b"], max_new_tokens=2, do_sample=True, seed=[1])


def test_bad_generation_config_named(model_copy):
    (model_copy / "generation_config.json").write_text('{"eos_token_id": [1, 2')
    with pytest.raises(ConfigError) as e:
        Engine.from_pretrained(model_copy)
    assert "generation_config.json" in _one_line(e)
    (model_copy / "generation_config.json").write_text('{"temperature": "hot"}')
    with pytest.raises(ConfigError, match="temperature"):
        Engine.from_pretrained(model_copy)
