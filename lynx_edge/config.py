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

# What each family reads from config.json when a field is absent: transformers 5.x's config-class
# defaults (MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig, OlmoeConfig field defaults; rope_theta is
# the class's `default_theta`). None means "derived" exactly as the class's __post_init__ does
# (num_key_value_heads → num_attention_heads, head_dim → hidden_size // num_attention_heads).
# tests/test_real_checkpoints.py walks this table against the installed transformers classes.
# bos/eos ids are deliberately absent: generation reads them from the files as written.
_COMMON = {"hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 10000.0}
DEFAULTS: dict[str, dict] = {
    "mixtral": {**_COMMON, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "sliding_window": None,
                "num_experts_per_tok": 2, "num_local_experts": 8, "rope_theta": 1e6},
    "qwen2_moe": {**_COMMON, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
                  "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
                  "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "use_sliding_window": False,
                  "sliding_window": 4096, "max_window_layers": 28, "decoder_sparse_step": 1,
                  "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                  "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": False,
                  "mlp_only_layers": None, "qkv_bias": True},
    "qwen3_moe": {**_COMMON, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                  "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4,
                  "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "attention_bias": False,
                  "use_sliding_window": False, "sliding_window": 4096, "decoder_sparse_step": 1,
                  "moe_intermediate_size": 768, "num_experts_per_tok": 8, "num_experts": 128,
                  "norm_topk_prob": False, "mlp_only_layers": None},
    "olmoe": {**_COMMON, "vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 2048,
              "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": None,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "attention_bias": False,
              "clip_qkv": None, "num_experts_per_tok": 8, "num_experts": 64, "norm_topk_prob": False},
}


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


def _rope(c: dict, default_theta: float) -> RopeConfig:
    # transformers 5.x: rope_parameters = {rope_theta, rope_type, factor}; 4.x: rope_theta + rope_scaling
    params = dict(c.get("rope_parameters") or {})
    scaling = c.get("rope_scaling") or {}
    theta = params.get("rope_theta", c.get("rope_theta", default_theta))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    factor = params.get("factor", scaling.get("factor", 1.0))
    if kind not in ("default", "linear"):
        raise ConfigError(f"rope scaling type {kind!r} is not supported (supported: default, linear)")
    if kind == "linear" and not factor > 0:
        raise ConfigError(f"rope linear scaling factor must be > 0, got {factor}")
    return RopeConfig(theta=float(theta), kind=kind, factor=float(factor) if kind == "linear" else 1.0)


def _sliding(mt: str, c: dict, n: int) -> tuple[int | None, ...]:
    """Per-layer attention window, as transformers 5 builds it for each family."""
    g = lambda name: _get(mt, c, name)  # noqa: E731
    if mt == "olmoe":
        return tuple([None] * n)
    if mt == "mixtral":
        return tuple([g("sliding_window") or None] * n)
    window = g("sliding_window") if g("use_sliding_window") else None
    if mt == "qwen3_moe":  # one mask for all layers
        return tuple([window or None] * n)
    # qwen2_moe: layer_types, or its __post_init__ default (even layers below max_window_layers)
    layer_types = c.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 and i < g("max_window_layers") and g("use_sliding_window")
        else "full_attention" for i in range(n)]
    if len(layer_types) != n:
        raise ConfigError(f"layer_types has {len(layer_types)} entries for {n} layers")
    return tuple(window or None if t == "sliding_attention" else None for t in layer_types)


def _moe_layers(mt: str, c: dict, n: int, num_experts: int) -> tuple[bool, ...]:
    if mt in ("mixtral", "olmoe"):
        return tuple([True] * n)
    step = _get(mt, c, "decoder_sparse_step") or 1
    dense = set(_get(mt, c, "mlp_only_layers") or [])
    return tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(n))


def _get(mt: str, c: dict, name: str):
    """config.json's value, or transformers' class default for this family when the field is absent
    (present-but-null stays None: transformers distinguishes the two, e.g. Mixtral num_key_value_heads)."""
    return c[name] if name in c else DEFAULTS[mt][name]


def _parse(mt: str, c: dict) -> ModelConfig:
    g = lambda name: _get(mt, c, name)  # noqa: E731
    n = int(g("num_hidden_layers"))
    heads = int(g("num_attention_heads"))
    hidden = int(g("hidden_size"))
    kv = int(g("num_key_value_heads") or heads)  # None → heads, as the config classes' __post_init__
    if mt == "mixtral":
        E, inter_e, norm_topk = int(g("num_local_experts")), int(g("intermediate_size")), True
    else:
        # transformers 5 writes num_local_experts for qwen3_moe; older configs num_experts
        E = int(c["num_local_experts"] if c.get("num_experts") is None and c.get("num_local_experts") is not None
                else g("num_experts"))
        inter_e = int(g("intermediate_size") if mt == "olmoe" else g("moe_intermediate_size"))
        norm_topk = bool(g("norm_topk_prob"))
    K = int(g("num_experts_per_tok"))
    if not 0 < K <= E:
        raise ConfigError(f"num_experts_per_tok={K} must be in 1..{E}")
    if heads % kv:
        raise ConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    if g("hidden_act") != "silu":
        raise ConfigError(f"hidden_act {g('hidden_act')!r} is not supported (only silu)")
    eos = c.get("eos_token_id")  # as written: transformers' generate reads the file, not class defaults
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    vocab = int(g("vocab_size"))
    return ModelConfig(
        model_type=mt,
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=n,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=int(c.get("head_dim") or hidden // heads),
        rms_norm_eps=float(g("rms_norm_eps")),
        rope=_rope(c, DEFAULTS[mt]["rope_theta"]),
        max_position_embeddings=int(g("max_position_embeddings")),
        num_experts=E,
        top_k=K,
        moe_intermediate_size=inter_e,
        norm_topk_prob=norm_topk,
        intermediate_size=int(g("intermediate_size")),
        shared_expert_intermediate_size=int(g("shared_expert_intermediate_size")) if mt == "qwen2_moe" else 0,
        attention_bias=bool(g("qkv_bias")) if mt == "qwen2_moe" else bool(c.get("attention_bias", False)),
        qk_norm={"qwen3_moe": "head", "olmoe": "full"}.get(mt, "none"),
        clip_qkv=g("clip_qkv") if mt == "olmoe" else None,
        tie_word_embeddings=bool(g("tie_word_embeddings")),
        sliding_windows=_sliding(mt, c, n),
        moe_layers=_moe_layers(mt, c, n, E),
        bos_token_id=c.get("bos_token_id"),
        eos_token_ids=tuple(i for i in eos_ids if isinstance(i, int) and 0 <= i < vocab),
        torch_dtype=c.get("torch_dtype") or c.get("dtype"),
        raw=c,
    )


# generation_config.json fields used as sampling defaults when the caller gives none
GENERATION_FIELDS = {"do_sample": bool, "temperature": (int, float), "top_k": int, "top_p": (int, float),
                     "repetition_penalty": (int, float), "max_new_tokens": int}


@dataclass(frozen=True)
class GenerationConfig:
    """What generation_config.json says: the end-of-sequence ids and the sampling defaults."""

    eos_token_ids: tuple[int, ...] | None = None  # None: the file does not say (fall back to config.json)
    defaults: dict = field(default_factory=dict)  # subset of GENERATION_FIELDS the file sets
    source: str = "generation_config.json"

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "GenerationConfig":
        path = Path(model_dir) / "generation_config.json"
        if not path.is_file():
            return cls()
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        eos = data.get("eos_token_id")
        eos_ids = None if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        if eos_ids is not None and not all(isinstance(i, int) and not isinstance(i, bool) for i in eos_ids):
            raise ConfigError(f"{path}: eos_token_id must be an int or a list of ints, got {eos!r}")
        defaults = {}
        for name, typ in GENERATION_FIELDS.items():
            value = data.get(name)
            if value is None:
                continue
            if not isinstance(value, typ) or (typ is not bool and isinstance(value, bool)):
                raise ConfigError(f"{path}: field {name!r} has the wrong type ({value!r})")
            defaults[name] = float(value) if typ == (int, float) else value
        return cls(eos_token_ids=eos_ids, defaults=defaults, source=str(path))
