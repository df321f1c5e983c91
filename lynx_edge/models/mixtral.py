"""Mixtral (model_type "mixtral"): top-2 of 8 SwiGLU experts, renormalised gates, GQA, optional
sliding window on every layer. On disk: `block_sparse_moe.gate` and `experts.{e}.w1/w3/w2`
(gate/up/down); transformers ≥ 5 in memory fuses them as `mlp.experts.gate_up_proj/down_proj`."""
from ..config import check_act, check_top_k
from .layers import Attention
from .transformer import kv_cache_spec, moe_or_dense, softmax_router

MODEL_TYPE = "mixtral"

# transformers 5.x MixtralConfig defaults (rope_theta: the class's default_theta)
DEFAULTS = {"hidden_act": "silu", "tie_word_embeddings": False, "vocab_size": 32000, "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
            "sliding_window": None, "num_experts_per_tok": 2, "num_local_experts": 8, "rope_theta": 1e6}


def parse(c: dict, get) -> dict:
    check_act(get)
    n, E, K = int(get("num_hidden_layers")), int(get("num_local_experts")), int(get("num_experts_per_tok"))
    check_top_k(K, E)
    return dict(num_experts=E, top_k=K, moe_intermediate_size=int(get("intermediate_size")), norm_topk_prob=True,
                intermediate_size=int(get("intermediate_size")), attention_bias=bool(c.get("attention_bias", False)),
                sliding_windows=(get("sliding_window") or None,) * n, moe_layers=(True,) * n)


attention = Attention
mlp = moe_or_dense
router_spec = softmax_router
cache_spec = kv_cache_spec

RENAMES = ((".block_sparse_moe.", ".mlp."),)
EXPERT_PARTS = {"w1": "gate", "w3": "up", "w2": "down"}
