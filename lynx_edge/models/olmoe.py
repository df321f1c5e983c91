"""OLMoE (model_type "olmoe"): 64 experts top-8, RMSNorm over the whole q and k projections
(not per head), optional clip_qkv, top-k probabilities not renormalised by default."""

MODEL_TYPE = "olmoe"
RENAMES = ()
EXPERT_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
