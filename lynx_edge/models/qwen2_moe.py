"""Qwen2-MoE / Qwen1.5-MoE (model_type "qwen2_moe"): fine-grained experts plus one shared expert
whose output is scaled by sigmoid(shared_expert_gate(x)); q/k/v biases; top-k probabilities not
renormalised (norm_topk_prob false); dense MLP layers where mlp_only_layers/decoder_sparse_step
say; sliding windows on the layers `layer_types` names."""
from ..config import ConfigError, check_act, check_top_k, routed_experts, sparse_step_layers
from .layers import Attention
from .transformer import kv_cache_spec, moe_or_dense, softmax_router

MODEL_TYPE = "qwen2_moe"

# transformers 5.x Qwen2MoeConfig defaults
DEFAULTS = {"hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 10000.0, "vocab_size": 151936,
            "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16,
            "num_key_value_heads": 16, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
            "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
            "decoder_sparse_step": 1, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
            "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": False, "mlp_only_layers": None,
            "qkv_bias": True}


def parse(c: dict, get) -> dict:
    check_act(get)
    n, E, K = int(get("num_hidden_layers")), routed_experts(c, get), int(get("num_experts_per_tok"))
    check_top_k(K, E)
    return dict(num_experts=E, top_k=K, moe_intermediate_size=int(get("moe_intermediate_size")),
                norm_topk_prob=bool(get("norm_topk_prob")), intermediate_size=int(get("intermediate_size")),
                shared_expert_intermediate_size=int(get("shared_expert_intermediate_size")),
                attention_bias=bool(get("qkv_bias")), sliding_windows=_windows(c, get, n),
                moe_layers=sparse_step_layers(get, n, E))


def _windows(c: dict, get, n: int) -> tuple[int | None, ...]:
    """layer_types, or its __post_init__ default: even layers below max_window_layers slide."""
    window = get("sliding_window") if get("use_sliding_window") else None
    types = c.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 and i < get("max_window_layers") and get("use_sliding_window")
        else "full_attention" for i in range(n)]
    if len(types) != n:
        raise ConfigError(f"layer_types has {len(types)} entries for {n} layers")
    return tuple(window or None if t == "sliding_attention" else None for t in types)


attention = Attention
mlp = moe_or_dense  # the shared expert is MoEBlock's sigmoid-gated default
router_spec = softmax_router
cache_spec = kv_cache_spec

RENAMES = ()
EXPERT_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
