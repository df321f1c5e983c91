"""Model families, one module each, named after HF model_type; all build MoEForCausalLM."""
from . import mixtral, olmoe, qwen2_moe, qwen3_moe
from .transformer import MoEForCausalLM

FAMILIES = {m.MODEL_TYPE: m for m in (mixtral, qwen2_moe, qwen3_moe, olmoe)}

__all__ = ["FAMILIES", "MoEForCausalLM"]
