"""DeepSeek-V2 / V2-Lite / Coder-V2 (model_type "deepseek_v2"): multi-head latent attention and
fine-grained experts with always-on shared experts.

Attention (MLA). Keys and values come from one compressed latent per token: kv_a_proj_with_mqa
maps x to a kv_lora_rank latent (RMS-normed) plus a qk_rope_head_dim key part shared by all heads
(the only part that carries RoPE); kv_b_proj expands the latent into each head's qk_nope key and
v_head_dim value. The query is q_proj, or the low-rank q_a_proj → q_a_layernorm → q_b_proj when
q_lora_rank is set. RoPE rotates adjacent pairs (the interleaved layout: transformers views the
rope dims as complex numbers), in fp32. With YaRN the softmax scale is multiplied by
mscale(factor, mscale_all_dim)², as the model's own code does.

The cache holds the latent, not K and V: kv_lora_rank + qk_rope_head_dim values per token and
layer (V2-Lite: 576 instead of 2·16·128 + … = 6144). A forward reads it back in one of two forms:
  expanded   kv_b_proj over every cached token → per-head K, V; ordinary attention (prefill)
  absorbed   kv_b_proj's key half folded into the query and its value half applied after the
             attention, so attention runs on the latent itself as one shared head (decode)
chosen per forward by their multiply-add counts (`MLAttention.mode` forces one, for tests).

MoE. Layers from first_k_dense_replace on (every moe_layer_freq-th) are MoE, the rest dense.
The router is fp32, softmax over all experts, then top-k: `greedy` over all, or
`group_limited_greedy`: only experts of the topk_group groups (of n_group) with the highest best
score are eligible — the scorer gives the others −inf, so neither exact routing nor LYNX can pick
them. Gate weights are the softmax probabilities × routed_scaling_factor, unnormalised; with
norm_topk_prob they are renormalised instead and not scaled, as DeepSeek's own code does
(transformers 5.x ignores the field; every published V2 config has it false). n_shared_experts
shared experts run as one plain (ungated) MLP of n_shared_experts × moe_intermediate_size.
Glossary: B batch, T tokens, S cached positions, D hidden, H heads, r kv_lora_rank,
dn/dr/dv qk_nope/qk_rope/v head dims, E experts, K top-k, G groups.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError, check_act, check_top_k
from ..routing import RouterSpec
from .layers import Attention, AttnBatch, DenseMLP, Linear, MoEBlock, RMSNorm, Rope, fp32_once

MODEL_TYPE = "deepseek_v2"

# transformers 5.x DeepseekV2Config defaults
DEFAULTS = {"hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 10000.0, "vocab_size": 102400,
            "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": None, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
            "attention_bias": False, "mlp_bias": False, "first_k_dense_replace": 0, "kv_lora_rank": 512,
            "q_lora_rank": 1536, "n_group": None, "n_routed_experts": 64, "n_shared_experts": 2,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "routed_scaling_factor": 1.0, "topk_group": None,
            "topk_method": "greedy", "norm_topk_prob": False, "v_head_dim": 128, "num_experts_per_tok": None,
            "moe_intermediate_size": 1407}
# read by DeepSeek's own code, not declared by transformers' class (whose model ignores them)
REMOTE_DEFAULTS = {"moe_layer_freq": 1, "scoring_func": "softmax"}
LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: the norm class default, not rms_norm_eps


@dataclass(frozen=True)
class DeepseekV2Arch:
    kv_lora_rank: int  # r
    q_lora_rank: int | None
    qk_nope_head_dim: int  # dn
    qk_rope_head_dim: int  # dr
    v_head_dim: int  # dv
    mscale_all_dim: float  # YaRN's softmax-scale correction (0: none)
    topk_method: str  # greedy | group_limited_greedy
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    n_shared_experts: int


def parse(c: dict, get) -> dict:
    check_act(get)
    if get("mlp_bias"):
        raise ConfigError("mlp_bias true is not supported for deepseek_v2")
    n, E, K = int(get("num_hidden_layers")), get("n_routed_experts"), get("num_experts_per_tok")
    if E is None or K is None:
        raise ConfigError("deepseek_v2 needs n_routed_experts and num_experts_per_tok (dense DeepSeek is not supported)")
    E, K = int(E), int(K)
    check_top_k(K, E)
    scoring = c.get("scoring_func", REMOTE_DEFAULTS["scoring_func"])
    if scoring != "softmax":
        raise ConfigError(f"scoring_func {scoring!r} is not supported for deepseek_v2 (only softmax)")
    method = get("topk_method")
    G, TG = 1, 1
    if method == "group_limited_greedy":
        G, TG = get("n_group"), get("topk_group")
        if not (isinstance(G, int) and isinstance(TG, int) and 0 < TG <= G and E % G == 0):
            raise ConfigError(f"group_limited_greedy needs n_group dividing {E} experts and 0 < topk_group ≤ n_group "
                              f"(got n_group={G}, topk_group={TG})")
        if K > TG * (E // G):
            raise ConfigError(f"num_experts_per_tok={K} exceeds the {TG * (E // G)} experts of topk_group={TG} groups")
    elif method != "greedy":
        raise ConfigError(f"topk_method {method!r} is not supported (greedy, group_limited_greedy)")
    first, freq = int(get("first_k_dense_replace")), int(c.get("moe_layer_freq") or REMOTE_DEFAULTS["moe_layer_freq"])
    rope = {**(c.get("rope_scaling") or {}), **(c.get("rope_parameters") or {})}
    q_rank = get("q_lora_rank")
    arch = DeepseekV2Arch(
        kv_lora_rank=int(get("kv_lora_rank")), q_lora_rank=int(q_rank) if q_rank else None,
        qk_nope_head_dim=int(get("qk_nope_head_dim")), qk_rope_head_dim=int(get("qk_rope_head_dim")),
        v_head_dim=int(get("v_head_dim")), mscale_all_dim=float(rope.get("mscale_all_dim") or 0),
        topk_method=method, n_group=G, topk_group=TG,
        routed_scaling_factor=float(get("routed_scaling_factor")), n_shared_experts=int(get("n_shared_experts") or 0))
    I = int(get("moe_intermediate_size"))
    return dict(num_experts=E, top_k=K, moe_intermediate_size=I, norm_topk_prob=bool(get("norm_topk_prob")),
                intermediate_size=int(get("intermediate_size")), shared_expert_intermediate_size=arch.n_shared_experts * I,
                attention_bias=bool(get("attention_bias")), sliding_windows=(None,) * n,
                moe_layers=tuple(i >= first and i % freq == 0 for i in range(n)), arch=arch)


# attention ---------------------------------------------------------------------------------------
def softmax_scale(cfg) -> float:
    """(dn + dr)^-½, × mscale(factor, mscale_all_dim)² under YaRN (transformers' yarn_apply_mscale)."""
    a = cfg.arch
    scale = (a.qk_nope_head_dim + a.qk_rope_head_dim) ** -0.5
    if cfg.rope.kind != "default" and a.mscale_all_dim and cfg.rope.factor > 1:
        m = 0.1 * a.mscale_all_dim * math.log(cfg.rope.factor) + 1.0
        scale *= m * m
    return scale


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on adjacent pairs (x0, x1) → (x0·c − x1·s, x0·s + x1·c), in fp32. x [..., T, dr],
    cos/sin [..., T, dr/2] fp32 (broadcast over the heads)."""
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), -1).flatten(-2).to(x.dtype)


class MLAttention(nn.Module):
    """Multi-head latent attention over a latent cache [Bmax, S, r + dr] per layer."""

    mode = "auto"  # auto | absorbed | expanded
    # what `int4_attn` may make INT4: the projections forward calls as modules; not kv_b_proj, whose
    # weight the absorbed path reads itself (kv_b_heads)
    INT4_PROJECTIONS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")

    def __init__(self, cfg, layer: int, dtype, device):
        super().__init__()
        a, D, H = cfg.arch, cfg.hidden_size, cfg.num_heads
        self.H, self.r, self.dn, self.dr, self.dv = H, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
        self.layer, self.window = layer, None
        b, qd = cfg.attention_bias, H * (self.dn + self.dr)
        if a.q_lora_rank is None:
            self.q_proj = Linear(qd, D, False, dtype, device)
        else:
            self.q_a_proj = Linear(a.q_lora_rank, D, b, dtype, device)
            self.q_a_layernorm = RMSNorm(a.q_lora_rank, LATENT_NORM_EPS, dtype, device)
            self.q_b_proj = Linear(qd, a.q_lora_rank, False, dtype, device)
        self.kv_a_proj_with_mqa = Linear(self.r + self.dr, D, b, dtype, device)
        self.kv_a_layernorm = RMSNorm(self.r, LATENT_NORM_EPS, dtype, device)
        self.kv_b_proj = Linear(H * (self.dn + self.dv), self.r, False, dtype, device)
        self.o_proj = Linear(D, H * self.dv, b, dtype, device)
        self.rope = Rope(cfg, device, head_dim=self.dr)  # YaRN over the dr rope dims only
        self.scale = softmax_scale(cfg)

    def _q(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def _cos_sin(self, ab: AttnBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos/sin [B, T, dr/2] of the step, computed once for all layers (kept on the AttnBatch)."""
        cs = getattr(ab, "_mla_cos_sin", None)
        if cs is None:
            cos, sin = self.rope.cos_sin(ab.positions, torch.float32)  # [B, 1, T, dr] (two equal halves)
            cs = cos[:, 0, :, : self.dr // 2], sin[:, 0, :, : self.dr // 2]
            ab._mla_cos_sin = cs
        return cs

    def forward(self, x: torch.Tensor, ab: AttnBatch, cache: tuple[torch.Tensor]) -> torch.Tensor:
        B, T, _ = x.shape
        H, r, dn, dr = self.H, self.r, self.dn, self.dr
        q = self._q(x).view(B, T, H, dn + dr).transpose(1, 2)  # [B, H, T, dn + dr]
        q_nope, q_pe = q.split([dn, dr], -1)
        lat, k_pe = self.kv_a_proj_with_mqa(x).split([r, dr], -1)  # [B, T, r], [B, T, dr]
        cos, sin = self._cos_sin(ab)
        q_pe = _rotate_pairs(q_pe, cos[:, None], sin[:, None])
        k_pe = _rotate_pairs(k_pe, cos, sin)
        (latent_cache,) = cache  # [Bmax, S, r + dr]
        _write_latent(latent_cache, torch.cat((self.kv_a_layernorm(lat), k_pe), -1), ab)
        ctx = latent_cache[ab.rows, : ab.kv_len]  # [B, S, r + dr]
        if self._absorbed_is_cheaper(T, ab.kv_len):
            out = self.absorbed(q_nope, q_pe, ctx, ab)
        else:
            out = self.expanded(q_nope, q_pe, ctx, ab)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, H * self.dv))  # out [B, H, T, dv]

    def _absorbed_is_cheaper(self, T: int, S: int) -> bool:
        if self.mode != "auto":
            return self.mode == "absorbed"
        H, r, dn, dr, dv = self.H, self.r, self.dn, self.dr, self.dv
        expanded = S * r * H * (dn + dv) + H * T * S * (dn + dr + dv)  # kv_b over the cache + attention
        absorbed = H * T * r * (dn + dv) + H * T * S * (2 * r + dr)  # folds per query + latent attention
        return absorbed < expanded

    def expanded(self, q_nope, q_pe, ctx, ab: AttnBatch) -> torch.Tensor:
        """Per-head K and V from every cached latent, then ordinary attention. → [B, H, T, dv]"""
        B, H, T, _ = q_nope.shape
        S = ctx.shape[1]
        lat, k_pe = ctx.split([self.r, self.dr], -1)
        kv = self.kv_b_proj(lat).view(B, S, H, self.dn + self.dv).transpose(1, 2)  # [B, H, S, dn + dv]
        k_nope, v = kv.split([self.dn, self.dv], -1)
        keys = torch.cat((k_nope, k_pe[:, None].expand(B, H, S, self.dr)), -1)  # [B, H, S, dn + dr]
        mask, causal = Attention.attend(self, ab, T)  # no window: uses only ab
        q = torch.cat((q_nope, q_pe), -1)
        if q.device.type == "cpu" and v.shape[-1] < q.shape[-1]:
            # torch's CPU flash kernel takes one head dim for q, k and v; with values narrower than the
            # keys (dv 128 < dn + dr 192) SDPA fell to its math path, [B, H, T, S] scores and all (268 MB
            # for a 2048-token prompt of V2-Lite's 16 heads). Values padded with zeros to the keys' width
            # give the same outputs in their first dv columns. In fp32 (bf16 products are slow without
            # native bf16; the error against fp64 is the math path's, the inputs' rounding). V2-Lite's 16
            # heads, one causal prompt, one thread: 512 tokens 71-78 -> 45-47 ms, 2048 tokens 1189-1208 ->
            # 407-435 ms (benchmarks/mla_prefill.py). A long prompt's fp32 copies (q, keys, padded values)
            # are transient; the math path's scores grew with T x S.
            dt = q.dtype
            vp = F.pad(v.float(), (0, q.shape[-1] - v.shape[-1]))
            out = F.scaled_dot_product_attention(q.float(), keys.float(), vp, attn_mask=mask, is_causal=causal,
                                                 scale=self.scale)
            return out[..., : v.shape[-1]].to(dt)
        return F.scaled_dot_product_attention(q, keys, v, attn_mask=mask, is_causal=causal, scale=self.scale)

    def absorbed(self, q_nope, q_pe, ctx, ab: AttnBatch) -> torch.Tensor:
        """Attention on the latent: q_nope·W_uk^h·latent = (q_nope·W_uk^h)·latent, and the values
        W_uv^h·latent summed over keys = W_uv^h·(summed latent). All heads query the one latent
        head, so they stack as H·T queries of a single head. → [B, H, T, dv]"""
        B, H, T, _ = q_nope.shape
        S, r, dt = ctx.shape[1], self.r, q_nope.dtype
        w = self._kv_b_heads()  # [H, dn + dv, r]
        # one matmul per head over all B·T queries (a broadcast [B, H, ...] @ [H, ...] copied w B times)
        qh = q_nope.transpose(0, 1).reshape(H, B * T, self.dn).to(w.dtype)
        q_lat = torch.bmm(qh, w[:, : self.dn]).view(H, B, T, r).transpose(0, 1).to(dt)  # [B, H, T, r]
        qq = torch.cat((q_lat, q_pe), -1).reshape(B, 1, H * T, r + self.dr)
        mask, causal = Attention.attend(self, ab, T)
        if causal:  # per-query positions no longer line up with is_causal's square: the explicit mask
            mask = ab.mask(None)
        if mask is not None:  # [B, 1, T, S] → the same for each head's block of queries
            mask = mask.expand(B, H, T, S).reshape(B, 1, H * T, S)
        # values = the whole latent row (its last dr outputs dropped): equal q/k/v widths take the
        # fused (flash) kernel, where the r-wide values fell to the math path (CPU bf16: 3.4x slower)
        o = F.scaled_dot_product_attention(qq, ctx[:, None], ctx[:, None], attn_mask=mask,
                                           scale=self.scale)[..., :r]  # [B, 1, H·T, r]
        oh = o.reshape(B, H, T, r).transpose(0, 1).reshape(H, B * T, r).to(w.dtype)
        out = torch.bmm(oh, w[:, self.dn :].transpose(1, 2))  # [H, B·T, dv]
        return out.view(H, B, T, self.dv).transpose(0, 1).to(dt)  # [B, H, T, dv]

    def _kv_b_heads(self) -> torch.Tensor:
        """kv_b_proj's weight as [H, dn + dv, r]; on a CPU a 16-bit one as an fp32 copy made once
        (its 16-bit bmm runs ~5x slower than fp32 without native bf16; the copy costs 2x the
        weight's bytes: 8.4 MB a layer, 227 MB over DeepSeek-V2-Lite's 27)."""
        w = self.kv_b_proj.weight
        if w.device.type == "cpu" and w.dtype != torch.float32:
            w = fp32_once(self, "_kv_b32", w)[0]
        return w.view(self.H, self.dn + self.dv, self.r)


def _write_latent(cache: torch.Tensor, lat: torch.Tensor, ab: AttnBatch) -> None:
    """cache [Bmax, S, r + dr] ← lat [B, T, r + dr] at each token's position in its row."""
    B, T, _ = lat.shape
    if ab.start is not None:  # every row at the same positions: a slice copy
        cache[ab.rows, ab.start : ab.start + T] = lat
        return
    rows = torch.arange(ab.rows.start, ab.rows.stop, device=lat.device) if isinstance(ab.rows, slice) else ab.rows
    cache[rows[:, None].expand(B, T), ab.positions] = lat


def attention(cfg, i: int, dtype, device) -> MLAttention:
    return MLAttention(cfg, i, dtype, device)


def cache_spec(cfg, i: int, ctx: int) -> tuple[tuple[int, ...], ...]:
    """One latent tensor per layer: [ctx, kv_lora_rank + qk_rope_head_dim] per batch row."""
    return ((ctx, cfg.arch.kv_lora_rank + cfg.arch.qk_rope_head_dim),)


# MoE ---------------------------------------------------------------------------------------------
class _Fp32Router(Linear):
    """The router in fp32 whatever the model dtype, as transformers computes DeepSeek's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


def group_limited_scorer(E: int, G: int, TG: int):
    """logits [N, E] → (logits with −inf outside each token's TG best groups, softmax over all E).
    A group's score is its best expert's probability (DeepSeek-V2's group_limited_greedy)."""
    def scorer(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = logits.softmax(-1, dtype=torch.float32)
        best = probs.view(-1, G, E // G).amax(-1)  # [N, G]
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(TG, -1).indices, True)
        return logits.masked_fill(~keep.repeat_interleave(E // G, 1), float("-inf")), probs

    return scorer


def mlp(cfg, i: int, ctx, dtype, device, experts=None) -> nn.Module:
    if not cfg.moe_layers[i]:
        return DenseMLP(cfg.hidden_size, cfg.intermediate_size, dtype, device)
    a = cfg.arch
    scorer = group_limited_scorer(cfg.num_experts, a.n_group, a.topk_group) \
        if a.topk_method == "group_limited_greedy" and a.topk_group < a.n_group else None  # else: plain softmax
    block = MoEBlock(cfg, i, ctx, dtype, device, experts(i) if experts else None, scorer=scorer, shared_gate=False)
    block.gate = _Fp32Router(cfg.num_experts, cfg.hidden_size, False, dtype, device)
    return block


def router_spec(cfg) -> RouterSpec:
    """Weights: probabilities × routed_scaling_factor; renormalised and unscaled with norm_topk_prob
    (K > 1), as DeepSeek-V2's own gate does."""
    a, norm = cfg.arch, cfg.norm_topk_prob and cfg.top_k > 1
    return RouterSpec(cfg.num_experts, cfg.top_k, norm, a.n_shared_experts, 1.0 if norm else a.routed_scaling_factor)


RENAMES = ((".mlp.shared_experts.", ".mlp.shared_expert."),)
EXPERT_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
