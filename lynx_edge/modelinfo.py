"""What a model is, from its config.json alone (no weights loaded): parameter counts, total and
active per token, and the size of one expert — what `lynx-edge info` prints and what placement
plans size against. Glossary: E experts, K top-k.
"""
from __future__ import annotations

import socket
from pathlib import Path
from urllib.parse import urlparse

from .config import ModelConfig
from .hub import ALIASES, ModelNotFound, resolve_model

_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "fp8": 1, "int4": 0.5}


def bytes_per_param(dtype: str | None) -> float:
    """Bytes per weight for a config.json dtype name (bf16 when the config does not say)."""
    return _BYTES.get(str(dtype or "bfloat16").replace("torch.", ""), 2)


def param_counts(cfg: ModelConfig, dtype: str | None = None) -> dict:
    """→ dict(total, active, expert, non_expert, expert_bytes_per_expert, …) in parameters
    (bytes for the last, at `dtype` or the checkpoint's dtype). Active = what one token touches:
    everything but the routed experts, plus K of them per MoE layer. Counted from the modules the
    family builds (on the meta device), so every family's own layers are counted as built."""
    from .models.transformer import count_params

    non_expert, expert, n_moe = count_params(cfg)
    per_expert = expert // max(n_moe * cfg.num_experts, 1)
    return {
        "total": non_expert + expert,
        "active": non_expert + n_moe * cfg.top_k * per_expert,
        "expert": expert,
        "non_expert": non_expert,
        "params_per_expert": per_expert,
        "expert_bytes_per_expert": int(per_expert * bytes_per_param(dtype or cfg.torch_dtype)),
        "moe_layers": n_moe,
    }


def describe(cfg: ModelConfig) -> dict:
    """The config fields `info` shows, in HF's vocabulary."""
    return {
        "family": cfg.model_type,
        "layers": cfg.num_layers,
        "moe_layers": sum(cfg.moe_layers),
        "experts": cfg.num_experts,
        "top_k": cfg.top_k,
        "hidden": cfg.hidden_size,
        "expert_intermediate": cfg.moe_intermediate_size,
        "shared_expert_intermediate": cfg.shared_expert_intermediate_size,
        "heads": f"{cfg.num_heads} (kv {cfg.num_kv_heads}, head_dim {cfg.head_dim})",
        "vocab": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "dtype": cfg.torch_dtype or "unspecified",
    }


def load_config(name: str | Path | None) -> tuple[ModelConfig, str]:
    """config.json of a local dir / alias / HF repo without fetching weights → (cfg, where).

    A repo that is not cached gets only its config.json downloaded (a few KB) when online."""
    try:
        where = resolve_model(name, offline=True)
        return ModelConfig.from_file(where / "config.json"), str(where)
    except ModelNotFound:
        repo = ALIASES.get(str(name).lower(), str(name))
        from huggingface_hub import constants, hf_hub_download

        if name is None or repo.count("/") != 1 or str(name).startswith((".", "/", "~")) or constants.HF_HUB_OFFLINE:
            raise
        if not _reachable(constants.ENDPOINT):  # fail in seconds, not after the hub client's retries
            raise ModelNotFound(f"{repo}: not in the Hugging Face cache and {constants.ENDPOINT} is unreachable "
                                f"(offline); on a machine with network run `hf download {repo}`") from None
    try:
        path = hf_hub_download(repo, "config.json")
    except Exception as exc:  # network errors come in many types
        raise ModelNotFound(f"{repo}: cannot fetch config.json ({type(exc).__name__}); "
                            f"on a machine with network run `hf download {repo}`") from None
    return ModelConfig.from_file(path), repo


def _reachable(url: str, timeout: float = 3.0) -> bool:
    """Can we open a TCP connection to the hub's host (DNS + connect, one try)?"""
    u = urlparse(url)
    try:
        with socket.create_connection((u.hostname or "", u.port or (443 if u.scheme == "https" else 80)), timeout):
            return True
    except OSError:
        return False


def read_quant(where: str | Path, cfg: ModelConfig):
    """The checkpoint's 4-bit format as plan_memory takes it (offload.memory.QuantInfo), read by
    the loader's own reader (quant.formats.read_quant_config: quantize_config.json, config.json's
    quantization_config, AutoAWQ's quant_config.json); None for a float checkpoint. What the
    loader would refuse is one line naming the file and field."""
    from .offload.memory import QuantInfo
    from .quant.formats import read_quant_config

    qc = read_quant_config(Path(where), cfg.raw)
    return None if qc is None else QuantInfo(qc.method, qc.bits, qc.group_size, qc.sym, qc.weight_block)


def checkpoint_bytes(where: str | Path) -> int | None:
    """Size on disk of the directory's *.safetensors files (None when there are none)."""
    files = list(Path(where).glob("*.safetensors")) if Path(where).is_dir() else []
    return sum(f.stat().st_size for f in files) if files else None


def dense_decode_bytes(model) -> int:
    """Bytes of the built model's weights that every decode step reads whatever the routing:
    attention, norms, routers, dense MLPs and the output head, 16-bit or packed (the embedding only
    where it is the head: an untied table is read one row per token). The routed experts are left
    out: resident 16-bit ones are counted by the caller, packed or offloaded ones live outside the
    module tree."""
    tied = model.lm_head is None and model.head_int8 is None
    tensors = {t.data_ptr(): t for name, t in [*model.named_parameters(), *model.named_buffers()]
               if ".mlp.experts." not in name and (tied or name != "embed_tokens")}
    head = model.head_int8 or ()
    return sum(t.nbytes for t in tensors.values()) + sum(t.nbytes for t in head)


__all__ = ["bytes_per_param", "checkpoint_bytes", "dense_decode_bytes", "describe", "load_config", "param_counts",
           "read_quant"]
