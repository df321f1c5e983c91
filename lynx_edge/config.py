"""Configuration parsed once: the model spec from an HF config.json, and the engine options.

`ModelConfig.from_dict` understands the config.json of every supported family (mixtral,
qwen2_moe, qwen3_moe, olmoe) in both transformers 4.x (rope_theta / rope_scaling) and 5.x
(rope_parameters) spellings; anything it cannot honour is a one-line `ConfigError`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


class ConfigError(ValueError):
    """A config.json (or option) lynx-edge cannot honour."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | linear
    factor: float = 1.0  # linear: positions are divided by factor


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int  # D
    num_layers: int
    num_heads: int  # H
    num_kv_heads: int  # Hkv
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    num_experts: int  # E
    top_k: int  # K
    moe_intermediate_size: int  # I
    norm_topk_prob: bool
    intermediate_size: int = 0  # dense MLP layers (Qwen mlp_only_layers / decoder_sparse_step)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE shared expert (0 = none)
    attention_bias: bool = False  # q/k/v biases (Qwen2-MoE)
    qk_norm: str = "none"  # none | head (Qwen3: per head_dim) | full (OLMoE: over all heads)
    clip_qkv: float | None = None  # OLMoE
    tie_word_embeddings: bool = False
    sliding_windows: tuple[int | None, ...] = ()  # per layer; None = full attention
    moe_layers: tuple[bool, ...] = ()  # per layer; False = dense MLP
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None  # the checkpoint's dtype as written in config.json
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: config.json not found")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        try:
            return cls.from_dict(data)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None

    @classmethod
    def from_dict(cls, c: dict) -> "ModelConfig":
        mt = c.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {mt!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        try:
            return _parse(mt, c)
        except KeyError as exc:
            raise ConfigError(f"config.json lacks required field {exc.args[0]!r}") from None

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i, m in enumerate(self.moe_layers) if m]


def _rope(c: dict) -> RopeConfig:
    # transformers 5.x: rope_parameters = {rope_theta, rope_type, factor}; 4.x: rope_theta + rope_scaling
    params = dict(c.get("rope_parameters") or {})
    scaling = c.get("rope_scaling") or {}
    theta = params.get("rope_theta", c.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    factor = params.get("factor", scaling.get("factor", 1.0))
    if kind not in ("default", "linear"):
        raise ConfigError(f"rope scaling type {kind!r} is not supported (supported: default, linear)")
    if kind == "linear" and not factor > 0:
        raise ConfigError(f"rope linear scaling factor must be > 0, got {factor}")
    return RopeConfig(theta=float(theta), kind=kind, factor=float(factor) if kind == "linear" else 1.0)


def _sliding(mt: str, c: dict, n: int) -> tuple[int | None, ...]:
    window = c.get("sliding_window")
    if mt == "mixtral":
        return tuple([window or None] * n)
    if mt == "olmoe":
        return tuple([None] * n)
    layer_types = c.get("layer_types")
    if layer_types:
        if len(layer_types) != n:
            raise ConfigError(f"layer_types has {len(layer_types)} entries for {n} layers")
        return tuple(window if t == "sliding_attention" and window else None for t in layer_types)
    if c.get("use_sliding_window") and window:
        first = c.get("max_window_layers", 0)
        return tuple(window if i >= first else None for i in range(n))
    return tuple([None] * n)


def _moe_layers(mt: str, c: dict, n: int, num_experts: int) -> tuple[bool, ...]:
    if mt in ("mixtral", "olmoe"):
        return tuple([True] * n)
    step = c.get("decoder_sparse_step", 1) or 1
    dense = set(c.get("mlp_only_layers") or [])
    return tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(n))


def _parse(mt: str, c: dict) -> ModelConfig:
    n = int(c["num_hidden_layers"])
    heads = int(c["num_attention_heads"])
    hidden = int(c["hidden_size"])
    kv = int(c.get("num_key_value_heads") or heads)
    if mt == "mixtral":
        E, inter_e, norm_topk = int(c["num_local_experts"]), int(c["intermediate_size"]), True
    else:
        # transformers 5 writes num_local_experts for qwen3_moe; older configs num_experts
        E = int(c["num_experts"] if c.get("num_experts") is not None else c["num_local_experts"])
        inter_e = int(c["intermediate_size"] if mt == "olmoe" else c["moe_intermediate_size"])
        norm_topk = bool(c.get("norm_topk_prob", mt == "qwen3_moe"))
    K = int(c["num_experts_per_tok"])
    if not 0 < K <= E:
        raise ConfigError(f"num_experts_per_tok={K} must be in 1..{E}")
    if heads % kv:
        raise ConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    if c.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {c.get('hidden_act')!r} is not supported (only silu)")
    eos = c.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    vocab = int(c["vocab_size"])
    return ModelConfig(
        model_type=mt,
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=n,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=int(c.get("head_dim") or hidden // heads),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope=_rope(c),
        max_position_embeddings=int(c.get("max_position_embeddings", 4096)),
        num_experts=E,
        top_k=K,
        moe_intermediate_size=inter_e,
        norm_topk_prob=norm_topk,
        intermediate_size=int(c.get("intermediate_size", 0)),
        shared_expert_intermediate_size=int(c.get("shared_expert_intermediate_size", 0))
        if mt == "qwen2_moe"
        else 0,
        attention_bias=bool(c.get("qkv_bias", True)) if mt == "qwen2_moe" else bool(c.get("attention_bias", False)),
        qk_norm={"qwen3_moe": "head", "olmoe": "full"}.get(mt, "none"),
        clip_qkv=c.get("clip_qkv") if mt == "olmoe" else None,
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        sliding_windows=_sliding(mt, c, n),
        moe_layers=_moe_layers(mt, c, n, E),
        bos_token_id=c.get("bos_token_id"),
        eos_token_ids=tuple(i for i in eos_ids if 0 <= i < vocab),
        torch_dtype=c.get("torch_dtype") or c.get("dtype"),
        raw=c,
    )
