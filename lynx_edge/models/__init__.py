"""Model families, one module each, named after HF model_type; all build MoEForCausalLM.

A family module reads top to bottom as "how this model differs", and provides:
  MODEL_TYPE                      the HF model_type
  DEFAULTS                        transformers' config-class defaults for the fields it reads
  parse(c, get) -> dict           config.json → the ModelConfig fields beyond the common ones
                                  (config.common_fields), incl. `arch` for what only it has
  attention(cfg, i, dtype, dev)   layer i's token mixer: forward(x, AttnBatch, cache) → [B, T, D]
  mlp(cfg, i, ctx, dtype, dev, experts)   layer i's MoE block (an MoEBlock) or dense MLP
  router_spec(cfg) -> RouterSpec  its router as the routing hook and LYNX see it
  cache_spec(cfg, i, ctx)         layer i's cache tensors, shapes per batch row
  RENAMES, EXPERT_PARTS           its checkpoint name map (loader.py)
Shared pieces (RMSNorm, RoPE, GQA attention, the MoE block, the routing hook) live in layers.py
and transformer.py.
"""
from . import deepseek_v2, gpt_oss, lfm2_moe, mixtral, olmoe, qwen2_moe, qwen3_5_moe, qwen3_moe, qwen3_next
from .transformer import MoEForCausalLM

FAMILIES = {m.MODEL_TYPE: m for m in (mixtral, qwen2_moe, qwen3_moe, olmoe, qwen3_next, qwen3_5_moe, deepseek_v2, gpt_oss, lfm2_moe)}

__all__ = ["FAMILIES", "MoEForCausalLM"]
