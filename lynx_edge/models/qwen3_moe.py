"""Qwen3-MoE (model_type "qwen3_moe"): fine-grained experts, no shared expert, RMSNorm on each
head of q and k before RoPE, norm_topk_prob (usually true; false when absent), one sliding
window for every layer when use_sliding_window."""
from ..config import check_act, check_top_k, routed_experts, sparse_step_layers
from .layers import Attention
from .transformer import kv_cache_spec, moe_or_dense, softmax_router

MODEL_TYPE = "qwen3_moe"

# transformers 5.x Qwen3MoeConfig defaults
DEFAULTS = {"hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 10000.0, "vocab_size": 151936,
            "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24, "num_attention_heads": 32,
            "num_key_value_heads": 4, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
            "attention_bias": False, "use_sliding_window": False, "sliding_window": 4096,
            "decoder_sparse_step": 1, "moe_intermediate_size": 768, "num_experts_per_tok": 8,
            "num_experts": 128, "norm_topk_prob": False, "mlp_only_layers": None}


def parse(c: dict, get) -> dict:
    check_act(get)
    n, E, K = int(get("num_hidden_layers")), routed_experts(c, get), int(get("num_experts_per_tok"))
    check_top_k(K, E)
    window = get("sliding_window") if get("use_sliding_window") else None
    return dict(num_experts=E, top_k=K, moe_intermediate_size=int(get("moe_intermediate_size")),
                norm_topk_prob=bool(get("norm_topk_prob")), intermediate_size=int(get("intermediate_size")),
                attention_bias=bool(get("attention_bias")), qk_norm="head",
                sliding_windows=(window or None,) * n, moe_layers=sparse_step_layers(get, n, E))


attention = Attention
mlp = moe_or_dense
router_spec = softmax_router
cache_spec = kv_cache_spec

RENAMES = ()
EXPERT_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
