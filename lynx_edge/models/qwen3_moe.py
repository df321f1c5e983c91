"""Qwen3-MoE (model_type "qwen3_moe"): fine-grained experts, no shared expert, RMSNorm on each
head of q and k before RoPE, norm_topk_prob (usually true)."""

MODEL_TYPE = "qwen3_moe"
RENAMES = ()
EXPERT_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
