"""The decoder every family builds: embeddings → N × (token mixer, MLP/MoE) → norm → head.

A family module (mixtral.py, qwen3_moe.py, …) says what its layer i is made of through two
hooks, `attention(cfg, i, dtype, device)` and `mlp(cfg, i, ctx, dtype, device, experts)`, and
what its cache holds per layer (`cache_spec`). The shared defaults a family picks from are here.
"""
from __future__ import annotations

import functools
import itertools

import torch
from torch import nn
from torch.nn import functional as F

from ..config import ModelConfig
from ..kernels import native
from ..routing import RouterSpec
from .layers import AttnBatch, DenseMLP, Linear, MoEBlock, RMSNorm, Rope, RoutingContext, _param, linear
from . import native_layer


def family_of(cfg: ModelConfig):
    from . import FAMILIES  # the package imports this module: resolve at call time

    return FAMILIES[cfg.model_type]


def router_spec(cfg: ModelConfig) -> RouterSpec:
    """The model's router as the routing hook sees it (the family's `router_spec`)."""
    return family_of(cfg).router_spec(cfg)


def softmax_router(cfg: ModelConfig) -> RouterSpec:
    """softmax → top-k → optional renorm (Mixtral, Qwen-MoE, OLMoE)."""
    return RouterSpec(cfg.num_experts, cfg.top_k, cfg.norm_topk_prob, int(bool(cfg.shared_expert_intermediate_size)))


def moe_or_dense(cfg: ModelConfig, i: int, ctx: RoutingContext, dtype, device, experts=None) -> nn.Module:
    """Layer i's MLP: the MoE block where cfg.moe_layers says, else a dense SwiGLU MLP."""
    if cfg.moe_layers[i]:
        return MoEBlock(cfg, i, ctx, dtype, device, experts(i) if experts else None)
    return DenseMLP(cfg.hidden_size, cfg.intermediate_size, dtype, device)


def kv_cache_spec(cfg: ModelConfig, i: int, ctx: int) -> tuple[tuple[int, ...], ...]:
    """Layer i's cache tensors per batch row: K and V, [Hkv, ctx, hd] each."""
    shape = (cfg.num_kv_heads, ctx, cfg.head_dim)
    return shape, shape


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int, ctx: RoutingContext, dtype, device, experts=None):
        super().__init__()
        family, D = family_of(cfg), cfg.hidden_size
        norm = getattr(family, "norm", RMSNorm)  # a family may use its own norm (e.g. Qwen3-Next's 1 + w)
        self.input_layernorm = norm(D, cfg.rms_norm_eps, dtype, device)
        self.self_attn = family.attention(cfg, i, dtype, device)
        self.post_attention_layernorm = norm(D, cfg.rms_norm_eps, dtype, device)
        self.mlp = family.mlp(cfg, i, ctx, dtype, device, experts)
        self.is_moe = isinstance(self.mlp, MoEBlock)

    _native: "NativeLayer | bool | None" = None  # None: not tried yet; False: this layer runs the module path

    def forward(self, x, ab: AttnBatch, kv, is_decode: torch.Tensor):
        if x.shape[1] == 1 and x.device.type == "cpu" and self._native is not False:
            out = self._native_decode(x, ab, kv, is_decode)
            if out is not None:
                return out
        x = x + self.self_attn(self.input_layernorm(x), ab, kv)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, is_decode) if self.is_moe else self.mlp(h))


    def _native_decode(self, x, ab: AttnBatch, kv, is_decode):
        """The decode step in two native calls (native_layer.py), or None: the module path runs."""
        if not native_layer.NATIVE_LAYERS:
            return None
        nl = native_layer.native_of(self)
        return None if nl is None else nl.forward(x, ab, kv, is_decode)


class MoEForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, experts=None):
        """experts: layer → the expert backend of that MoE layer (None: resident 16-bit)."""
        super().__init__()
        self.cfg, self.dtype, self.device = cfg, dtype, device
        spec = router_spec(cfg)
        self.routing = RoutingContext(spec)
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.routing, dtype, device, experts) for i in range(cfg.num_layers))
        self.norm = getattr(family_of(cfg), "norm", RMSNorm)(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.vocab_size, cfg.hidden_size, False, dtype, device)
        self.rope = Rope(cfg, device)
        # int8_head (quant/int8.py): (q int8 [V, D], s fp32 [V]) read instead of the 16-bit head
        self.head_int8: tuple[torch.Tensor, torch.Tensor] | None = None
        # the head's activations: "q8" for the int8 head (--int4-act q8), "bf16" for a bf16 head (bf16_act)
        self.head_act: str | None = None

    def head_weight(self) -> torch.Tensor:
        assert self.head_int8 is None, "the head is int8 (head_int8)"
        return self.embed_tokens if self.lm_head is None else self.lm_head.weight

    def quantize_head(self, act: str | None = None, huge_pages: bool = False) -> None:
        """int8_head: the output head becomes int8 rows with fp32 scales (quant/int8.py), read with
        int8 activations too when act is "q8". An untied lm_head's 16-bit weight is freed; a tied one
        stays (it is also the embedding). huge_pages: its codes on 2 MiB pages (hugepages.py)."""
        from ..quant.int8 import quantize_rows

        self.head_int8, self.head_act = quantize_rows(self.head_weight(), huge_pages), act
        self.lm_head = None
        self.__dict__.pop("_native_head", None)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] (after the final norm) → logits [..., V] fp32."""
        if self.head_int8 is None:
            return linear(x, self.head_weight(), act=self.head_act).float()
        q, s = self.head_int8
        if native.lib() is not None and x.device.type == "cpu":
            y = native.linear_int8(x, q, s, act=self.head_act)
        else:
            from ..quant.int8 import linear_int8_torch

            y = linear_int8_torch(x, q, s)
        return y.to(x.dtype).float()  # rounded as a 16-bit head's logits are (and the native stack's)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, ab: AttnBatch, kv_cache: list, is_decode: torch.Tensor,
                logits_for: str = "last") -> torch.Tensor:
        """→ logits fp32, [B, V] for `last`, [B, T, V] for `all` (see run)."""
        return self.run(input_ids, ab, kv_cache, is_decode, logits_for)

    def run(
        self,
        input_ids: torch.Tensor,  # [B, T]
        ab: AttnBatch,
        kv_cache: list[tuple[torch.Tensor, ...]],  # per layer: what its family's cache_spec says
        is_decode: torch.Tensor,  # [B·T] bool: the phase of each token, for the routing hook
        logits_for: str = "last",  # last | all
    ) -> torch.Tensor:
        """forward without nn.Module's call machinery and without entering inference mode: the
        decode hot path (step.decode_step) calls this. Every parameter and buffer is created with
        requires_grad=False, so no autograd history is recorded either way; entering inference
        mode and the module call cost ~5 µs per step, 2–3× that between the kernels.
        → logits fp32, [B, V] for `last`, [B, T, V] for `all`."""
        x = F.embedding(input_ids, self.embed_tokens)  # [B, T, D]; a copy of rows, as indexing, in fewer steps
        start = 0
        if x.shape[1] == 1 and x.device.type == "cpu":
            # a decode-shaped step: the leading layers (and the head) in one native call, RoPE rows
            # straight from the table (the module path's cos/sin are computed only if it runs)
            ab.rope = (self.rope, x.dtype)
            head_of = (lambda: native_layer.head_plan(self, x)) if logits_for == "last" else None
            start, logits = native_layer.decode_stack(self.layers, x, ab, kv_cache, head_of)
            if logits is not None:
                return logits
        ab.cos, ab.sin = self.rope.cos_sin(ab.positions, x.dtype, ab.kv_len)
        for layer, kv in itertools.islice(zip(self.layers, kv_cache), start, None):
            x = layer(x, ab, kv, is_decode)
        if logits_for == "last":
            x = x[:, -1]
        return self.logits(self.norm(x))


@functools.lru_cache(maxsize=16)
def meta_model(cfg: ModelConfig) -> MoEForCausalLM:
    """The model exactly as this module builds it for cfg, in bf16 on the meta device (no memory),
    for the counts to read (count_params, the memory plan's non_expert_bytes) — not to change: it is
    shared. Kept: one build takes 10-25 ms, and a load plans with it several times."""
    return MoEForCausalLM(cfg, torch.bfloat16, torch.device("meta"))


@functools.lru_cache(maxsize=16)
def count_params(cfg: ModelConfig) -> tuple[int, int, int]:
    """(non-expert params, routed-expert params, MoE layers) of the model exactly as this module
    builds it, counted on the meta device (no memory): every family's own layers count themselves."""
    model = meta_model(cfg)
    expert = non_expert = 0
    for name, p in model.named_parameters():
        if ".mlp.experts." in name:
            expert += p.numel()
        else:
            non_expert += p.numel()
    return non_expert, expert, sum(1 for layer in model.layers if layer.is_moe)
