"""LFM2-MoE (model_type "lfm2_moe", LiquidAI LFM2-8B-A1B): a hybrid stack whose token mixer is,
per `layer_types`, either a gated short convolution ("conv") or GQA attention with per-head q/k
RMSNorm ("full_attention"); the first `num_dense_layers` layers have a dense SwiGLU MLP, the rest
an MoE whose router is a sigmoid with a per-expert selection bias.

What differs from the shared decoder, and where:
- Short convolution (ShortConv): in_proj → B, C, x [D each]; B·x goes through a causal depthwise
  conv1d of kernel L = conv_L_cache; C gates its output; out_proj. Its cache per sequence is the
  last L−1 inputs of the conv, a State [D, L−1] (fixed size, independent of the context length).
- Router: weights from sigmoid(logits), selection on sigmoid(logits) + expert_bias (kept fp32, as
  transformers keeps its buffer); norm_topk_prob renormalises, routed_scaling_factor scales.
- Config spelling: `norm_eps` (not rms_norm_eps), `tie_embedding` (older alias), `layer_types`
  or LFM2's `full_attn_idxs`.
- Checkpoint names: operator_norm / ffn_norm / feed_forward / conv / out_proj / q_layernorm /
  embedding_norm (the *final* norm, despite its name), experts w1 (gate) w3 (up) w2 (down).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..config import ConfigError, check_top_k
from ..kernels import native
from ..routing import RouterSpec
from .layers import Attention, AttnBatch, DenseMLP, Linear, MoEBlock, _param
from .state import State, causal_conv
from .transformer import kv_cache_spec

MODEL_TYPE = "lfm2_moe"

# transformers 5.x Lfm2MoeConfig defaults (rope_theta: the class's default_theta)
DEFAULTS = {"vocab_size": 65536, "hidden_size": 2048, "intermediate_size": 7168, "moe_intermediate_size": 1792,
            "num_hidden_layers": 32, "tie_word_embeddings": True, "rope_theta": 1000000.0,
            "max_position_embeddings": 128_000, "norm_eps": 0.00001, "num_attention_heads": 32,
            "num_key_value_heads": 8, "conv_bias": False, "conv_L_cache": 3, "num_dense_layers": 2,
            "num_experts_per_tok": 4, "num_experts": 32, "use_expert_bias": True, "routed_scaling_factor": 1.0,
            "norm_topk_prob": True, "layer_types": None}
# not an Lfm2MoeConfig field (transformers ignores it): common_fields reads it, parse then overrides
# it with norm_eps
READ_BUT_OVERRIDDEN = {"rms_norm_eps": 0.00001}
DEFAULTS.update(READ_BUT_OVERRIDDEN)

LAYER_KINDS = ("conv", "full_attention")


@dataclass(frozen=True)
class Lfm2MoeArch:
    layer_types: tuple[str, ...]  # per layer: conv | full_attention
    conv_L_cache: int = 3  # conv kernel length L (the cache keeps L − 1 inputs)
    conv_bias: bool = False  # biases on in_proj, the conv and out_proj
    use_expert_bias: bool = True
    routed_scaling_factor: float = 1.0


def parse(c: dict, get) -> dict:
    n, E, K = int(get("num_hidden_layers")), int(get("num_experts")), int(get("num_experts_per_tok"))
    check_top_k(K, E)
    types = _layer_types(c, get, n)
    dense = int(get("num_dense_layers"))
    L = int(get("conv_L_cache"))
    if L < 1:
        raise ConfigError(f"conv_L_cache={L} must be >= 1")
    arch = Lfm2MoeArch(types, L, bool(get("conv_bias")), bool(get("use_expert_bias")),
                       float(get("routed_scaling_factor")))
    # common fields spelled LFM2's way: norm_eps (Lfm2MoeConfig has no rms_norm_eps), and an older
    # `tie_embedding` that its __post_init__ lets override tie_word_embeddings
    tie = c["tie_embedding"] if "tie_embedding" in c else get("tie_word_embeddings")
    return dict(rms_norm_eps=float(get("norm_eps")), tie_word_embeddings=bool(tie),
                num_experts=E, top_k=K, moe_intermediate_size=int(get("moe_intermediate_size")),
                norm_topk_prob=bool(get("norm_topk_prob")), intermediate_size=int(get("intermediate_size")),
                attention_bias=False, qk_norm="head", sliding_windows=(None,) * n,
                moe_layers=tuple(i >= dense for i in range(n)), arch=arch)


def _layer_types(c: dict, get, n: int) -> tuple[str, ...]:
    """layer_types as written; else LFM2's full_attn_idxs (its dense sibling's convention).
    transformers' Lfm2MoeConfig derives nothing when both are absent (its model cannot be built),
    so neither do we."""
    types = get("layer_types")
    if types is None and c.get("full_attn_idxs") is not None:
        idx = set(c["full_attn_idxs"])
        types = ["full_attention" if i in idx else "conv" for i in range(n)]
    if types is None:
        raise ConfigError("lfm2_moe config.json needs layer_types (or full_attn_idxs) to say which layers are conv")
    if len(types) != n:
        raise ConfigError(f"layer_types has {len(types)} entries for {n} layers")
    bad = sorted({t for t in types if t not in LAYER_KINDS})
    if bad:
        raise ConfigError(f"layer_types {bad} not supported (lfm2_moe layers are {' or '.join(LAYER_KINDS)})")
    return tuple(types)


class _ConvWeight(nn.Module):
    """The depthwise conv's parameters, shaped as the checkpoint's nn.Conv1d: weight [D, 1, L]."""

    def __init__(self, D: int, L: int, bias: bool, dtype, device):
        super().__init__()
        self.weight = _param(D, 1, L, dtype=dtype, device=device)
        self.bias = _param(D, dtype=dtype, device=device) if bias else None


class ShortConv(nn.Module):
    """Gated short convolution: in_proj → B, C, x; causal depthwise conv1d of B·x continuing from
    the row's conv state (its last L − 1 conv inputs, [Bmax, D, L − 1]; models/state.py: a row
    starting at position 0 reads zeros, the conv's causal padding); C gates the output; out_proj."""

    # `int4_attn` makes both projections INT4 too: 18 of LFM2-8B-A1B's 24 layers are convolutions, and
    # their 2048 -> 6144 -> 2048 projections are ~300 M of its ~1.5 B active parameters
    INT4_PROJECTIONS = ("in_proj", "out_proj")

    def __init__(self, cfg, layer: int, dtype, device):
        super().__init__()
        D, a = cfg.hidden_size, cfg.arch
        self.layer, self.D = layer, D
        self.in_proj = Linear(3 * D, D, a.conv_bias, dtype, device)
        self.conv = _ConvWeight(D, a.conv_L_cache, a.conv_bias, dtype, device)
        self.out_proj = Linear(D, D, a.conv_bias, dtype, device)

    def forward(self, x: torch.Tensor, ab: AttnBatch, cache: tuple[torch.Tensor]) -> torch.Tensor:
        if x.shape[1] == 1 and self._native_ok(x, cache[0]):  # a decode step: one native call between the projections
            B, pos = x.shape[0], ab.positions.reshape(-1).contiguous()  # [B]: one token a row
            y = native.short_conv(self.in_proj(x).view(B, -1).contiguous(), self.conv.weight, self.conv.bias,
                                  cache[0], ab.native_rows(), pos if pos.dtype is torch.int64 else pos.long())
            return self.out_proj(y.view(B, 1, self.D))
        bcx = self.in_proj(x).transpose(1, 2)  # [B, 3D, T]
        b, c, h = bcx.split(self.D, dim=1)  # [B, D, T] each
        y = causal_conv(b * h, self.conv.weight, cache[0], ab, self.conv.bias)  # [B, D, T]
        return self.out_proj((c * y).transpose(1, 2))  # [B, T, D]

    def native_conv(self, dt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(weight [D, 1, L], bias [D] or None) when both are contiguous and in dt, as the native
        convolution reads them (native.short_conv here, and the native decode layer,
        models/native_layer.py, which runs this module's decode step — in_proj, the convolution,
        out_proj — inside its call), else None."""
        w, b = self.conv.weight, self.conv.bias
        ok = w.dtype == dt and w.is_contiguous() and (b is None or (b.dtype == dt and b.is_contiguous()))
        return (w, b) if ok else None

    def _native_ok(self, x: torch.Tensor, state: torch.Tensor) -> bool:
        """Whether native.short_conv takes this decode step (a CPU, fp32/bf16 throughout, contiguous
        state): the same sums as the torch path's fp32 conv, ~2 us against ~0.4 ms of ~12 torch ops a
        layer (LFM2-8B-A1B's 2048 channels, one thread)."""
        return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and native.lib() is not None
                and self.native_conv(x.dtype) is not None and state.dtype == x.dtype and state.is_contiguous())


def attention(cfg, i: int, dtype, device) -> nn.Module:
    """Layer i's token mixer: the short convolution or GQA attention (per-head q/k RMSNorm via
    cfg.qk_norm = "head"; checkpoint q_layernorm/k_layernorm/out_proj renamed to q_norm/k_norm/o_proj)."""
    if cfg.arch.layer_types[i] == "conv":
        return ShortConv(cfg, i, dtype, device)
    return Attention(cfg, i, dtype, device)


# The selection scores the routing hook sees are (probs + bias) × 4: 4 = 1/σ'(0), so a gap between
# two scores is, to first order around p = 1/2, their gap in logit units — the units LYNX's
# default α is derived for (bin span ln(E/K) of logit). A power of two: every score is scaled
# exactly, so the order and the ties of the biased scores, hence the top-k, are unchanged.
SCORE_SCALE = 4.0


class Lfm2MoEBlock(MoEBlock):
    """MoEBlock with LFM2's router: probs = sigmoid(logits) give the weights; the top-k is chosen
    on probs + expert_bias [E] (fp32). The routing hook and LYNX see these biased scores (× the
    exact SCORE_SCALE)."""

    def __init__(self, cfg, layer: int, ctx, dtype, device, experts=None):
        super().__init__(cfg, layer, ctx, dtype, device, experts, scorer=self._score)
        self.expert_bias = _param(cfg.num_experts, dtype=torch.float32, device=device) \
            if cfg.arch.use_expert_bias else None

    def _score(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.sigmoid(logits)  # [N, E] fp32
        return (probs if self.expert_bias is None else probs + self.expert_bias) * SCORE_SCALE, probs


def mlp(cfg, i: int, ctx, dtype, device, experts=None) -> nn.Module:
    if cfg.moe_layers[i]:
        return Lfm2MoEBlock(cfg, i, ctx, dtype, device, experts(i) if experts else None)
    return DenseMLP(cfg.hidden_size, cfg.intermediate_size, dtype, device)


def router_spec(cfg) -> RouterSpec:
    return RouterSpec(cfg.num_experts, cfg.top_k, cfg.norm_topk_prob, 0, cfg.arch.routed_scaling_factor)


def cache_spec(cfg, i: int, ctx: int) -> tuple[tuple[int, ...], ...]:
    """Attention: K and V [Hkv, ctx, hd]; conv: its sequence state [D, L − 1] (model dtype, as
    transformers keeps it), whatever the context."""
    if cfg.arch.layer_types[i] == "conv":
        return (State((cfg.hidden_size, cfg.arch.conv_L_cache - 1)),)
    return kv_cache_spec(cfg, i, ctx)


# applied in order to each checkpoint name (loader.internal_name): attention's out_proj first, so
# the conv's out_proj (moved under self_attn next) keeps its name
RENAMES = (
    (".self_attn.out_proj.", ".self_attn.o_proj."),
    (".self_attn.q_layernorm.", ".self_attn.q_norm."),
    (".self_attn.k_layernorm.", ".self_attn.k_norm."),
    (".conv.in_proj.", ".self_attn.in_proj."),
    (".conv.out_proj.", ".self_attn.out_proj."),
    (".conv.conv.", ".self_attn.conv."),
    (".operator_norm.", ".input_layernorm."),
    (".ffn_norm.", ".post_attention_layernorm."),
    (".feed_forward.w1.", ".mlp.gate_proj."),  # the dense layers' MLP
    (".feed_forward.w3.", ".mlp.up_proj."),
    (".feed_forward.w2.", ".mlp.down_proj."),
    (".feed_forward.", ".mlp."),
    ("model.embedding_norm.", "model.norm."),
)
# LFM2's own expert names, and the Qwen-style ones `lynx-edge quantize` writes
EXPERT_PARTS = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
