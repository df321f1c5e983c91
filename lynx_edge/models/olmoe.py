"""OLMoE (model_type "olmoe"): 64 experts top-8, RMSNorm over the whole q and k projections
(not per head), then optional clip_qkv on q, k and v; top-k probabilities not renormalised by
default; every layer MoE, no sliding window."""
from dataclasses import dataclass

from ..config import check_act, check_top_k, routed_experts
from .layers import Attention, RMSNorm
from .transformer import kv_cache_spec, moe_or_dense, softmax_router

MODEL_TYPE = "olmoe"

# transformers 5.x OlmoeConfig defaults
DEFAULTS = {"hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 10000.0, "vocab_size": 50304,
            "hidden_size": 2048, "intermediate_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 16,
            "num_key_value_heads": None, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
            "attention_bias": False, "clip_qkv": None, "num_experts_per_tok": 8, "num_experts": 64,
            "norm_topk_prob": False}


@dataclass(frozen=True)
class OlmoeArch:
    clip_qkv: float | None = None


def parse(c: dict, get) -> dict:
    check_act(get)
    n, E, K = int(get("num_hidden_layers")), routed_experts(c, get), int(get("num_experts_per_tok"))
    check_top_k(K, E)
    return dict(num_experts=E, top_k=K, moe_intermediate_size=int(get("intermediate_size")),
                norm_topk_prob=bool(get("norm_topk_prob")), intermediate_size=int(get("intermediate_size")),
                attention_bias=bool(c.get("attention_bias", False)), sliding_windows=(None,) * n,
                moe_layers=(True,) * n, arch=OlmoeArch(get("clip_qkv")))


class OlmoeAttention(Attention):
    """q and k normed over all heads at once (not per head), then q, k, v clipped."""

    def __init__(self, cfg, layer: int, dtype, device):
        super().__init__(cfg, layer, dtype, device)
        self.q_norm = RMSNorm(self.H * self.hd, cfg.rms_norm_eps, dtype, device)
        self.k_norm = RMSNorm(self.Hkv * self.hd, cfg.rms_norm_eps, dtype, device)
        self.clip = cfg.arch.clip_qkv

    def project(self, x):
        q, k, v = super().project(x)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:  # after the norm, as transformers does
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        return q, k, v

    def native_qk_full(self):
        # the kernel reads clip 0 as "no clip" and one eps for both norms (both take rms_norm_eps)
        if (type(self.q_norm) is not RMSNorm or type(self.k_norm) is not RMSNorm or self.q_norm.eps != self.k_norm.eps
                or (self.clip is not None and not self.clip > 0)):
            return None
        return self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.clip


attention = OlmoeAttention
mlp = moe_or_dense
router_spec = softmax_router
cache_spec = kv_cache_spec

RENAMES = ()
EXPERT_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
