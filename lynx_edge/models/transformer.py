"""The decoder shared by every supported family: embeddings → N × (attention, MLP/MoE) → norm → head.

Family files (mixtral.py, qwen2_moe.py, …) only say how their checkpoint names map onto this
module tree; what differs in the maths (q/k norm, biases, shared expert, sliding windows) is
switched by ModelConfig fields parsed once from config.json.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..routing import RouterSpec
from .layers import Attention, AttnBatch, DenseMLP, Linear, MoEBlock, RMSNorm, Rope, RoutingContext, _param


def router_spec(cfg: ModelConfig) -> RouterSpec:
    """The family's router as the routing hook sees it."""
    return RouterSpec(cfg.num_experts, cfg.top_k, cfg.norm_topk_prob, int(bool(cfg.shared_expert_intermediate_size)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int, ctx: RoutingContext, dtype, device, experts=None):
        super().__init__()
        D = cfg.hidden_size
        self.input_layernorm = RMSNorm(D, cfg.rms_norm_eps, dtype, device)
        self.self_attn = Attention(cfg, i, dtype, device)
        self.post_attention_layernorm = RMSNorm(D, cfg.rms_norm_eps, dtype, device)
        if cfg.moe_layers[i]:
            self.mlp = MoEBlock(cfg, i, ctx, dtype, device, experts(i) if experts else None)
        else:
            self.mlp = DenseMLP(D, cfg.intermediate_size, dtype, device)
        self.is_moe = cfg.moe_layers[i]

    def forward(self, x, ab: AttnBatch, kv, is_decode: torch.Tensor):
        x = x + self.self_attn(self.input_layernorm(x), ab, kv)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, is_decode) if self.is_moe else self.mlp(h))


class MoEForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, experts=None):
        """experts: layer → the expert backend of that MoE layer (None: resident 16-bit)."""
        super().__init__()
        self.cfg, self.dtype, self.device = cfg, dtype, device
        spec = router_spec(cfg)
        self.routing = RoutingContext(spec)
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.routing, dtype, device, experts) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.vocab_size, cfg.hidden_size, False, dtype, device)
        self.rope = Rope(cfg, device)

    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens if self.lm_head is None else self.lm_head.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        ab: AttnBatch,
        kv_cache: list[tuple[torch.Tensor, torch.Tensor]],
        is_decode: torch.Tensor,  # [B·T] bool: the phase of each token, for the routing hook
        logits_for: str = "last",  # last | all
    ) -> torch.Tensor:
        """→ logits fp32, [B, V] for `last`, [B, T, V] for `all`."""
        x = self.embed_tokens[input_ids]  # [B, T, D]
        ab.cos, ab.sin = self.rope.cos_sin(ab.positions, x.dtype)
        for layer, kv in zip(self.layers, kv_cache):
            x = layer(x, ab, kv, is_decode)
        if logits_for == "last":
            x = x[:, -1]
        x = self.norm(x)
        return torch.nn.functional.linear(x, self.head_weight()).float()
