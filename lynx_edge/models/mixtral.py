"""Mixtral (model_type "mixtral"): top-2 of 8 SwiGLU experts, renormalised gates, GQA, optional
sliding window on every layer. On disk: `block_sparse_moe.gate` and `experts.{e}.w1/w3/w2`
(gate/up/down); transformers ≥ 5 in memory fuses them as `mlp.experts.gate_up_proj/down_proj`."""

MODEL_TYPE = "mixtral"
RENAMES = ((".block_sparse_moe.", ".mlp."),)
EXPERT_PARTS = {"w1": "gate", "w3": "up", "w2": "down"}
