"""Configuration parsed once: the model spec from an HF config.json, and the engine options.

`ModelConfig.from_dict` reads the fields every family shares (sizes, heads, norms, RoPE in both
transformers 4.x `rope_theta`/`rope_scaling` and 5.x `rope_parameters` spellings, ids) and asks
the family module (lynx_edge/models/<model_type>.py) for the rest: its MoE shape, router rule,
per-layer windows and layer kinds, and anything only it has (`arch`). A field absent from
config.json takes transformers' config-class default for that family (the family's DEFAULTS).
Anything it cannot honour is a one-line `ConfigError`.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

Getter = Callable[[str], Any]  # field name → config.json's value or the family default


class ConfigError(ValueError):
    """A config.json (or option) lynx-edge cannot honour."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | yarn
    factor: float = 1.0  # linear: positions / factor; yarn: the context extension factor
    dim: int | None = None  # rotary dims per head (None: all of head_dim; partial_rotary_factor < 1)
    # yarn (transformers' _compute_yarn_parameters): frequency blend between beta_fast and beta_slow
    # rotations of the original context, and cos/sin scaled by attention_factor
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True


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
    shared_expert_intermediate_size: int = 0  # always-on shared expert(s), summed (0 = none)
    attention_bias: bool = False  # q/k/v biases (Qwen2-MoE)
    qk_norm: str = "none"  # none | head (RMSNorm on each head's hd, before RoPE)
    tie_word_embeddings: bool = False
    sliding_windows: tuple[int | None, ...] = ()  # per layer; None = full attention
    moe_layers: tuple[bool, ...] = ()  # per layer; False = dense MLP
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None  # the checkpoint's dtype as written in config.json
    arch: Any = None  # what only this family has (a frozen dataclass from its module), e.g. OLMoE clip_qkv
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
        from .models import FAMILIES  # the families import this module: resolve them at call time

        mt = c.get("model_type")
        family = FAMILIES.get(mt) if isinstance(mt, str) else None
        if family is None:
            raise ConfigError(f"unsupported model_type {mt!r}; supported: {', '.join(FAMILIES)}")
        raw = c
        if isinstance(c.get("text_config"), dict):  # a multimodal wrapper: the text model's fields
            c = {**{k: v for k, v in c.items() if k != "text_config"}, **c["text_config"], "model_type": mt}
        get = family_getter(family.DEFAULTS, c)
        try:
            # a family's parse may also override a common field (e.g. its own rope default)
            return cls(**{**common_fields(c, get), **family.parse(c, get)}, raw=raw)
        except KeyError as exc:
            raise ConfigError(f"config.json lacks required field {exc.args[0]!r}") from None

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i, m in enumerate(self.moe_layers) if m]


def family_getter(defaults: dict, c: dict) -> Getter:
    """config.json's value, or transformers' class default for this family when the field is absent
    (present-but-null stays None: transformers distinguishes the two, e.g. Mixtral num_key_value_heads)."""
    return lambda name: c[name] if name in c else defaults[name]


def common_fields(c: dict, get: Getter) -> dict:
    """The ModelConfig fields every family reads the same way."""
    n = int(get("num_hidden_layers"))
    heads, hidden = int(get("num_attention_heads")), int(get("hidden_size"))
    kv = int(get("num_key_value_heads") or heads)  # None → heads, as the config classes' __post_init__
    if heads % kv:
        raise ConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    head_dim = int(c.get("head_dim") or hidden // heads)
    eos = c.get("eos_token_id")  # as written: transformers' generate reads the file, not class defaults
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    vocab = int(get("vocab_size"))
    return dict(
        model_type=c["model_type"], vocab_size=vocab, hidden_size=hidden, num_layers=n, num_heads=heads,
        num_kv_heads=kv, head_dim=head_dim, rms_norm_eps=float(get("rms_norm_eps")),
        rope=parse_rope(c, get("rope_theta"), head_dim, int(get("max_position_embeddings"))),
        max_position_embeddings=int(get("max_position_embeddings")),
        tie_word_embeddings=bool(get("tie_word_embeddings")),
        bos_token_id=c.get("bos_token_id"),
        eos_token_ids=tuple(i for i in eos_ids if isinstance(i, int) and 0 <= i < vocab),
        torch_dtype=c.get("torch_dtype") or c.get("dtype"),
    )


def check_top_k(K: int, E: int) -> None:
    if not 0 < K <= E:
        raise ConfigError(f"num_experts_per_tok={K} must be in 1..{E}")


def check_act(get: Getter, allowed: tuple[str, ...] = ("silu",)) -> None:
    if get("hidden_act") not in allowed:
        raise ConfigError(f"hidden_act {get('hidden_act')!r} is not supported (only {', '.join(allowed)})")


def routed_experts(c: dict, get: Getter) -> int:
    """E: transformers 5 writes num_local_experts for some families whose older configs say num_experts."""
    if c.get("num_experts") is None and c.get("num_local_experts") is not None:
        return int(c["num_local_experts"])
    return int(get("num_experts"))


def sparse_step_layers(get: Getter, n: int, E: int) -> tuple[bool, ...]:
    """Which layers are MoE under Qwen's decoder_sparse_step / mlp_only_layers."""
    step = get("decoder_sparse_step") or 1
    dense = set(get("mlp_only_layers") or [])
    return tuple(i not in dense and E > 0 and (i + 1) % step == 0 for i in range(n))


def _yarn_mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def parse_rope(c: dict, default_theta: float, head_dim: int, max_pos: int) -> RopeConfig:
    """transformers 5.x: rope_parameters = {rope_theta, rope_type, factor, …}; 4.x: rope_theta +
    rope_scaling. yarn's derived values follow transformers' _compute_yarn_parameters."""
    params = dict(c.get("rope_parameters") or {})
    params = {**(c.get("rope_scaling") or {}), **params}
    theta = params.get("rope_theta", c.get("rope_theta", default_theta))
    kind = params.get("rope_type") or params.get("type") or "default"
    partial = params.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)) or 1.0
    dim = int(head_dim * partial) if partial != 1.0 else None
    if kind not in ("default", "linear", "yarn"):
        raise ConfigError(f"rope scaling type {kind!r} is not supported (supported: default, linear, yarn)")
    factor = params.get("factor", 1.0)
    if kind == "default":
        return RopeConfig(theta=float(theta), dim=dim)
    if kind == "linear":
        if not (factor or 0) > 0:
            raise ConfigError(f"rope linear scaling factor must be > 0, got {factor}")
        return RopeConfig(theta=float(theta), kind="linear", factor=float(factor), dim=dim)
    orig = params.get("original_max_position_embeddings") or c.get("original_max_position_embeddings")
    if not orig:
        raise ConfigError("rope yarn needs original_max_position_embeddings")
    if factor is None:  # DeepSeek-V3 style: the extension is max / original
        factor = max_pos / orig
    attn = params.get("attention_factor")
    if attn is None:
        ms, ms_all = params.get("mscale"), params.get("mscale_all_dim")
        attn = _yarn_mscale(factor, ms) / _yarn_mscale(factor, ms_all) if ms and ms_all else _yarn_mscale(factor)
    return RopeConfig(theta=float(theta), kind="yarn", factor=float(factor), dim=dim,
                      original_max_position_embeddings=int(orig),
                      beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                      attention_factor=float(attn), truncate=bool(params.get("truncate", True)))


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
