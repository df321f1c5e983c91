"""Model resolution against a fake Hugging Face cache laid out as huggingface_hub lays it out
(models--org--name/refs/main → snapshots/<hash>/…), offline: the reference is the layout itself."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lynx_edge.hub import ALIASES, ModelNotFound, resolve_model

ROOT = Path(__file__).resolve().parents[1]
REPO = ALIASES["olmoe-1b-7b"]
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OLMOE_CONFIG = {  # a small but valid olmoe config.json (no weights needed to resolve or describe)
    "model_type": "olmoe", "vocab_size": 320, "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 24, "num_experts": 8,
    "num_experts_per_tok": 2, "max_position_embeddings": 512, "torch_dtype": "bfloat16",
}


def fake_cache(root: Path, repo: str = REPO) -> Path:
    """→ the snapshot directory of `repo` in an HF cache rooted at `root`."""
    storage = root / ("models--" + repo.replace("/", "--"))
    (storage / "refs").mkdir(parents=True)
    (storage / "refs" / "main").write_text(COMMIT)
    snap = storage / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(OLMOE_CONFIG))
    return snap


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    root = tmp_path / "hub"
    snap = fake_cache(root)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return snap


def test_alias_and_repo_id_resolve_to_the_cached_snapshot(hf_cache):
    assert resolve_model("olmoe-1b-7b").resolve() == hf_cache.resolve()
    assert resolve_model("OLMoE-1B-7B").resolve() == hf_cache.resolve()
    assert resolve_model(REPO).resolve() == hf_cache.resolve()


def test_offline_and_absent_names_the_repo_and_the_download_command(hf_cache):
    with pytest.raises(ModelNotFound) as err:
        resolve_model("someorg/absent-moe")
    msg = str(err.value)
    assert "someorg/absent-moe" in msg and "hf download someorg/absent-moe" in msg and "offline" in msg


def test_local_directory_and_bad_names(tmp_path):
    assert resolve_model(tmp_path) == tmp_path
    with pytest.raises(ModelNotFound, match="no such directory"):
        resolve_model(str(tmp_path / "missing"))
    with pytest.raises(ModelNotFound, match="alias"):
        resolve_model("not-a-model")


def test_modelinfo_reads_config_from_the_cache(hf_cache):
    from lynx_edge.modelinfo import load_config

    cfg, where = load_config("olmoe-1b-7b")
    assert cfg.model_type == "olmoe" and cfg.num_experts == 8
    assert Path(where).resolve() == hf_cache.resolve()
    with pytest.raises(ModelNotFound, match="hf download someorg/absent"):
        load_config("someorg/absent")


def test_env_variables_in_a_fresh_process(tmp_path):
    """HF_HUB_CACHE / HF_HUB_OFFLINE as a user sets them (huggingface_hub reads them at import)."""
    snap = fake_cache(tmp_path / "hub")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    code = ("from lynx_edge.hub import resolve_model, ModelNotFound\n"
            "print(resolve_model('olmoe-1b-7b'))\n"
            "try:\n    resolve_model('someorg/absent')\nexcept ModelNotFound as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    found, absent = out.stdout.strip().splitlines()
    assert Path(found).resolve() == snap.resolve()
    assert "someorg/absent" in absent and "hf download someorg/absent" in absent
