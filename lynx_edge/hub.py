"""Model resolution: a local directory, an alias, or a Hugging Face repo id (HF cache first).

Works offline when the files are in the HF cache; downloads (with huggingface_hub's progress
bars) when online; when offline and absent, says what to download and where.
"""
from __future__ import annotations

import os
from pathlib import Path

# alias → HF repo id ("demo" is the model embedded in the package)
ALIASES = {
    "mixtral-8x7b": "mistralai/Mixtral-8x7B-Instruct-v0.1",
    "mixtral-8x22b": "mistralai/Mixtral-8x22B-Instruct-v0.1",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
    "qwen3-30b-a3b-fp8": "Qwen/Qwen3-30B-A3B-FP8",  # block-scaled FP8 (quant/fp8.py): half the memory of bf16
    "qwen3-coder-30b-a3b-fp8": "Qwen/Qwen3-Coder-30B-A3B-Instruct-FP8",
    "qwen1.5-moe-a2.7b": "Qwen/Qwen1.5-MoE-A2.7B-Chat",
    "qwen2-57b-a14b": "Qwen/Qwen2-57B-A14B-Instruct",
    "olmoe-1b-7b": "allenai/OLMoE-1B-7B-0125-Instruct",
    "gpt-oss-20b": "openai/gpt-oss-20b",
    "deepseek-v2-lite": "deepseek-ai/DeepSeek-V2-Lite-Chat",
    "deepseek-coder-v2-lite": "deepseek-ai/DeepSeek-Coder-V2-Lite-Instruct",
    "qwen3.6-35b-a3b": "Qwen/Qwen3.6-35B-A3B",
    "qwen3.5-35b-a3b": "Qwen/Qwen3.5-35B-A3B",
    "qwen3-next-80b-a3b": "Qwen/Qwen3-Next-80B-A3B-Instruct",
    "lfm2-8b-a1b": "LiquidAI/LFM2-8B-A1B",
}
# What a runtime needs from a repo: never pickles, never remote code.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]


class ModelNotFound(FileNotFoundError):
    """The model is neither a directory, nor in the HF cache, nor downloadable now."""


def demo_dir() -> Path:
    return Path(__file__).resolve().parent / "demo"


def resolve_model(name: str | os.PathLike | None, offline: bool | None = None) -> Path:
    """→ a local directory holding config.json and the weights."""
    if name is None or str(name) == "demo":
        path = demo_dir()
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{path}: the embedded demo model is missing from this installation")
        return path
    name = str(name)
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    repo = ALIASES.get(name.lower(), name)
    if name.startswith((".", "/", "~")) or repo.count("/") != 1:
        known = ", ".join(["demo", *ALIASES])
        raise ModelNotFound(f"{name}: no such directory, and not an HF repo id or alias ({known})")
    return _from_hub(repo, offline)


def _from_hub(repo: str, offline: bool | None) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:  # the cache first: works with no network at all
        return Path(snapshot_download(repo, local_files_only=True, allow_patterns=ALLOW_PATTERNS))
    except LocalEntryNotFoundError:
        pass
    if offline is None:
        offline = bool(constants.HF_HUB_OFFLINE)
    hint = (
        f"{repo} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}); on a machine with network run "
        f"`hf download {repo}` (or set HF_HOME to a cache that has it)"
    )
    if offline:
        raise ModelNotFound(hint + " — this machine is offline")
    try:
        return Path(snapshot_download(repo, allow_patterns=ALLOW_PATTERNS))
    except Exception as exc:  # network errors come in many types; the message is what matters
        raise ModelNotFound(f"{hint} — download failed: {type(exc).__name__}") from None
