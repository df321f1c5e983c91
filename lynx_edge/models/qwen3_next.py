"""Qwen3-Next (model_type "qwen3_next"): a hybrid of Gated DeltaNet linear attention and gated full
attention (`layer_types`; by default three linear layers then one full), each followed by an MoE
of many small experts (512, top-10) plus a sigmoid-gated shared expert.

How it differs from Qwen3-MoE:
  - every RMSNorm but the DeltaNet output norm is zero-centred: x̂·(1 + w), in fp32;
  - full attention: q_proj yields q and a per-head output gate ([H, 2·hd], interleaved per head),
    the output is o_proj(attn · sigmoid(gate)); q/k norms per head; RoPE on the first
    partial_rotary_factor (0.25) of each head;
  - linear attention (GatedDeltaNet): x → q, k, v (one short causal conv1d + SiLU over them),
    z (output gate), b (β = sigmoid b), a (decay g = −e^{A_log}·softplus(a + dt_bias)); the gated
    delta rule (delta_rule.py: chunked for prefill, recurrent for decode); RMSNorm(o)·SiLU(z).
    Its cache is a conv state and a recurrent state per sequence (models/state.py), not K/V.
  - multi-token-prediction weights (`mtp.*`) are not run: skipped at load.
On disk the linear layers are `linear_attn.*` (renamed to this runtime's `self_attn`).
Glossary: Hk/Hv linear key/value heads, dk/dv their dims, K conv kernel, C conv channels.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError, check_act, check_top_k, parse_rope, routed_experts, sparse_step_layers
from . import delta_rule
from .layers import Attention, Linear, RMSNorm, _param, _rotate, _write_kv
from .state import State, causal_conv, read_state, write_state
from .transformer import kv_cache_spec, moe_or_dense, softmax_router

MODEL_TYPE = "qwen3_next"

# transformers 5.x Qwen3NextConfig defaults (rope_theta: the class's default_theta); partial_rotary_factor
# and full_attention_interval are __post_init__ keyword defaults
DEFAULTS = {"hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 10000.0, "vocab_size": 151936,
            "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 48, "num_attention_heads": 16,
            "num_key_value_heads": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
            "attention_bias": False, "head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
            "decoder_sparse_step": 1, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
            "num_experts_per_tok": 10, "num_experts": 512, "norm_topk_prob": True, "mlp_only_layers": None,
            "layer_types": None, "partial_rotary_factor": 0.25, "full_attention_interval": 4}


@dataclass(frozen=True)
class HybridArch:
    layer_types: tuple[str, ...]  # per layer: linear_attention | full_attention
    k_heads: int  # Hk
    v_heads: int  # Hv
    k_dim: int  # dk
    v_dim: int  # dv
    conv_kernel: int  # K
    split_proj: bool = False  # Qwen3.5: in_proj_qkv/z/b/a; Qwen3-Next: in_proj_qkvz/ba grouped per key head


def layer_types(c: dict, get, n: int) -> tuple[str, ...]:
    every = int(get("full_attention_interval"))
    types = get("layer_types") or ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    if len(types) != n:
        raise ConfigError(f"layer_types has {len(types)} entries for {n} layers")
    bad = sorted(set(types) - {"linear_attention", "full_attention"})
    if bad:
        raise ConfigError(f"layer_types {bad} are not supported (linear_attention, full_attention)")
    return tuple(types)


def hybrid_fields(c: dict, get, split_proj: bool) -> dict:
    """The fields Qwen3-Next and Qwen3.5-MoE read alike (head_dim and the partial rotary have
    defaults of their own, so the common ones are overridden)."""
    check_act(get)
    n = int(get("num_hidden_layers"))
    head_dim = int(get("head_dim") or int(get("hidden_size")) // int(get("num_attention_heads")))
    rope_c = {**c, "partial_rotary_factor": get("partial_rotary_factor")}
    arch = HybridArch(layer_types(c, get, n), int(get("linear_num_key_heads")), int(get("linear_num_value_heads")),
                      int(get("linear_key_head_dim")), int(get("linear_value_head_dim")),
                      int(get("linear_conv_kernel_dim")), split_proj)
    if arch.v_heads % arch.k_heads:
        raise ConfigError(f"linear_num_value_heads={arch.v_heads} is not a multiple of linear_num_key_heads={arch.k_heads}")
    return dict(head_dim=head_dim, rope=parse_rope(rope_c, get("rope_theta"), head_dim, int(get("max_position_embeddings"))),
                attention_bias=bool(get("attention_bias")), qk_norm="head", sliding_windows=(None,) * n,
                shared_expert_intermediate_size=int(get("shared_expert_intermediate_size")), arch=arch)


def parse(c: dict, get) -> dict:
    n, E, K = int(get("num_hidden_layers")), routed_experts(c, get), int(get("num_experts_per_tok"))
    check_top_k(K, E)
    return dict(num_experts=E, top_k=K, moe_intermediate_size=int(get("moe_intermediate_size")),
                norm_topk_prob=bool(get("norm_topk_prob")), intermediate_size=int(get("intermediate_size")),
                moe_layers=sparse_step_layers(get, n, E), **hybrid_fields(c, get, split_proj=False))


class ZeroCenteredRMSNorm(RMSNorm):
    """RMSNorm whose weight is stored as an offset from 1: (x̂ · (1 + w)) in fp32, then cast."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(RMSNorm):
    """The DeltaNet output norm: RMSNorm(o) (plain weight) times SiLU(z)."""

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (h * F.silu(z.float())).to(x.dtype)


class GatedAttention(Attention):
    """Full attention with a per-head sigmoid output gate (q_proj: [H, 2·hd], q then gate per head)."""

    def __init__(self, cfg, layer: int, dtype, device):
        super().__init__(cfg, layer, dtype, device)
        H, hd, eps = self.H, self.hd, cfg.rms_norm_eps
        self.q_proj = Linear(2 * H * hd, cfg.hidden_size, cfg.attention_bias, dtype, device)
        self.q_norm = ZeroCenteredRMSNorm(hd, eps, dtype, device)
        self.k_norm = ZeroCenteredRMSNorm(hd, eps, dtype, device)

    def project(self, x):
        fused = self._fused()  # one GEMM for q+gate, k, v once loaded
        if fused is not None:
            return fused(x).split([2 * self.H * self.hd, self.Hkv * self.hd, self.Hkv * self.hd], -1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x: torch.Tensor, ab, kv) -> torch.Tensor:
        B, T, _ = x.shape
        H, Hkv, hd = self.H, self.Hkv, self.hd
        qg, k, v = self.project(x)
        q, gate = qg.view(B, T, H, 2 * hd).chunk(2, dim=-1)  # [B, T, H, hd] each
        q = self.q_norm(q).transpose(1, 2)  # [B, H, T, hd]
        k = self.k_norm(k.view(B, T, Hkv, hd)).transpose(1, 2)  # [B, Hkv, T, hd]
        v = v.view(B, T, Hkv, hd).transpose(1, 2)
        q, k = _rotate(q, ab.cos, ab.sin), _rotate(k, ab.cos, ab.sin)
        k_cache, v_cache = kv  # [Bmax, Hkv, S, hd]
        _write_kv(k_cache, v_cache, k, v, ab)
        out = self.sdpa(q, k_cache[ab.rows, :, : ab.kv_len], v_cache[ab.rows, :, : ab.kv_len], ab, T)
        out = out.transpose(1, 2).reshape(B, T, H * hd)
        return self.o_proj(out * torch.sigmoid(gate.reshape(B, T, H * hd)))


class _ConvWeight(nn.Module):
    def __init__(self, C: int, K: int, dtype, device):
        super().__init__()
        self.weight = _param(C, 1, K, dtype=dtype, device=device)  # depthwise, as nn.Conv1d stores it


class GatedDeltaNet(nn.Module):
    """Linear attention with the gated delta rule; cache: (conv state [C, K-1], recurrent state
    [Hv, dk, dv] fp32) per row."""

    def __init__(self, cfg, layer: int, dtype, device):
        super().__init__()
        a, D = cfg.arch, cfg.hidden_size
        self.Hk, self.Hv, self.dk, self.dv = a.k_heads, a.v_heads, a.k_dim, a.v_dim
        self.key_dim, self.value_dim = a.k_heads * a.k_dim, a.v_heads * a.v_dim
        C = 2 * self.key_dim + self.value_dim
        self.split = a.split_proj
        if self.split:
            self.in_proj_qkv = Linear(C, D, False, dtype, device)
            self.in_proj_z = Linear(self.value_dim, D, False, dtype, device)
            self.in_proj_b = Linear(self.Hv, D, False, dtype, device)
            self.in_proj_a = Linear(self.Hv, D, False, dtype, device)
        else:
            self.in_proj_qkvz = Linear(C + self.value_dim, D, False, dtype, device)
            self.in_proj_ba = Linear(2 * self.Hv, D, False, dtype, device)
        self.conv1d = _ConvWeight(C, a.conv_kernel, dtype, device)
        self.dt_bias = _param(self.Hv, dtype=dtype, device=device)
        self.A_log = _param(self.Hv, dtype=dtype, device=device)
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps, dtype, device)
        self.out_proj = Linear(D, self.value_dim, False, dtype, device)

    def project(self, x: torch.Tensor):
        """x [B, T, D] → qkv [B, T, C] (q, k, v of all heads, in that order), z [B, T, Hv, dv],
        b, a [B, T, Hv]."""
        B, T, _ = x.shape
        if self.split:
            return (self.in_proj_qkv(x), self.in_proj_z(x).view(B, T, self.Hv, self.dv),
                    self.in_proj_b(x), self.in_proj_a(x))
        r = self.Hv // self.Hk  # value heads per key head: Qwen3-Next groups the projections per key head
        q, k, v, z = self.in_proj_qkvz(x).view(B, T, self.Hk, -1).split([self.dk, self.dk, r * self.dv, r * self.dv], -1)
        b, a = self.in_proj_ba(x).view(B, T, self.Hk, 2 * r).split([r, r], -1)
        qkv = torch.cat([t.reshape(B, T, -1) for t in (q, k, v)], -1)
        return qkv, z.reshape(B, T, self.Hv, self.dv), b.reshape(B, T, self.Hv), a.reshape(B, T, self.Hv)

    def forward(self, x: torch.Tensor, ab, cache) -> torch.Tensor:
        B, T, _ = x.shape
        conv_state, rec_state = cache
        qkv, z, b, a = self.project(x)
        qkv = F.silu(causal_conv(qkv.transpose(1, 2), self.conv1d.weight, conv_state, ab)).to(x.dtype).transpose(1, 2)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], -1)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [B, T, Hv] log decay ≤ 0
        args = delta_rule.prepare(q.view(B, T, self.Hk, self.dk), k.view(B, T, self.Hk, self.dk),
                                  v.view(B, T, self.Hv, self.dv), g, b.sigmoid())
        rule = delta_rule.recurrent if T == 1 else delta_rule.chunked
        out, state = rule(*args, read_state(rec_state, ab))  # [B, Hv, T, dv]
        write_state(rec_state, ab, state)
        out = self.norm(out.transpose(1, 2).to(x.dtype), z)  # [B, T, Hv, dv]
        return self.out_proj(out.reshape(B, T, self.value_dim))


def attention(cfg, i: int, dtype, device) -> nn.Module:
    if cfg.arch.layer_types[i] == "linear_attention":
        return GatedDeltaNet(cfg, i, dtype, device)
    return GatedAttention(cfg, i, dtype, device)


def cache_spec(cfg, i: int, ctx: int) -> tuple:
    """Full attention: K and V per token; linear attention: its conv state (the last K-1 inputs of
    the C conv channels, model dtype) and its recurrent state (fp32), per sequence."""
    a = cfg.arch
    if a.layer_types[i] == "full_attention":
        return kv_cache_spec(cfg, i, ctx)
    C = 2 * a.k_heads * a.k_dim + a.v_heads * a.v_dim
    return State((C, a.conv_kernel - 1)), State((a.v_heads, a.k_dim, a.v_dim), torch.float32)


norm = ZeroCenteredRMSNorm
mlp = moe_or_dense  # the shared expert is MoEBlock's sigmoid-gated default
router_spec = softmax_router

RENAMES = ((".linear_attn.", ".self_attn."),)
IGNORED = ("mtp.",)  # multi-token-prediction heads: not run
EXPERT_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
