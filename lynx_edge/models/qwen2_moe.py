"""Qwen2-MoE / Qwen1.5-MoE (model_type "qwen2_moe"): fine-grained experts plus one shared expert
whose output is scaled by sigmoid(shared_expert_gate(x)); q/k/v biases; top-k probabilities not
renormalised (norm_topk_prob false); dense MLP layers where mlp_only_layers/decoder_sparse_step say."""

MODEL_TYPE = "qwen2_moe"
RENAMES = ()
EXPERT_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
