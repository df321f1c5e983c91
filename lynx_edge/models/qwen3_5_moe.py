"""Qwen3.5 / Qwen3.6 MoE (model_type "qwen3_5_moe"): the Qwen3-Next hybrid (qwen3_next.py) as the
text model of a vision-language wrapper. config.json nests it under `text_config` (config.py
merges those fields); its rope_parameters carry M-RoPE sections, which for text alone (the same
position on the t/h/w axes) is the plain partial rotary used here.

How it differs from Qwen3-Next: the DeltaNet projections are separate and flat (in_proj_qkv,
in_proj_z, in_proj_b, in_proj_a), every layer is MoE, top-k probabilities are always
renormalised, and the text model sits under `model.language_model.` on disk.
Not run, skipped at load with their weights never read: the vision tower (`model.visual.*` — this
runtime takes text prompts only) and the multi-token-prediction heads (`mtp.*`).
"""
from __future__ import annotations

from ..config import check_top_k, routed_experts
from .qwen3_next import (EXPERT_PARTS, attention, cache_spec, hybrid_fields, mlp, norm,  # noqa: F401
                         router_spec)

MODEL_TYPE = "qwen3_5_moe"

# transformers 5.x Qwen3_5MoeTextConfig defaults (rope_theta: the class's default_theta); partial_rotary_factor
# and full_attention_interval are __post_init__ keyword defaults
DEFAULTS = {"hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 10000.0, "vocab_size": 248320,
            "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2,
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "attention_bias": False, "head_dim": 256,
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32, "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512, "num_experts_per_tok": 8, "num_experts": 256,
            "layer_types": None, "partial_rotary_factor": 0.25, "full_attention_interval": 4}


def parse(c: dict, get) -> dict:
    n, E, K = int(get("num_hidden_layers")), routed_experts(c, get), int(get("num_experts_per_tok"))
    check_top_k(K, E)
    return dict(num_experts=E, top_k=K, moe_intermediate_size=int(get("moe_intermediate_size")),
                norm_topk_prob=True, moe_layers=(E > 0,) * n, **hybrid_fields(c, get, split_proj=True))


RENAMES = (("model.language_model.", "model."), (".linear_attn.", ".self_attn."))
IGNORED = ("visual.", "mtp.")  # the vision tower and the multi-token-prediction heads: not run
