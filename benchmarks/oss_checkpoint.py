"""A random gpt-oss checkpoint in the published layout, for benchmarks (vs_llamacpp.py --models oss).

openai/gpt-oss-20b's config.json (tests/fixtures/real) with its layer shapes as published — hidden
2880, 64 query / 8 KV heads of 64 with biases and sinks, 32 experts of 2880 with biases, top-4,
alternating 128-token windows, YaRN — at `layers` of its 24 layers and the demo's 4096-token
vocabulary (its tokenizer): the experts as `*_blocks` / `*_scales` MXFP4 bytes (random codes, e8m0
scales 2^-6..2^-1, as a trained checkpoint's sit), everything else bf16. Per decode token at B = 1 it
reads what a gpt-oss-20b layer reads: 4 experts' 49.6 MB of MXFP4 and 53 MB of bf16 attention, so
the experts and attention weigh as in the real model; only its 24 MB head is smaller (the real
vocabulary's is 1.16 GB of bf16).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from shards import normal_bf16, save_shards

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT / "tests/fixtures/real/gpt-oss-20b"


def write_oss(path: Path, layers: int = 8, vocab: int = 4096, seed: int = 0) -> Path:
    """→ path, written once (kept when its config.json is there)."""
    if (path / "config.json").is_file():
        return path
    print(f"writing the random gpt-oss checkpoint {path} …", flush=True)
    cfg = json.loads((REAL / "config.json").read_text())
    cfg.update(num_hidden_layers=layers, layer_types=cfg["layer_types"][:layers], vocab_size=vocab,
               eos_token_id=0, pad_token_id=0)
    D, I, E = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
    H, KV, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    g = torch.Generator().manual_seed(seed)
    bf16 = normal_bf16(g)

    def codes(*shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)

    def scales(*shape):
        return torch.randint(121, 127, shape, dtype=torch.uint8, generator=g)

    def shards():  # two layers a shard: a few GB never sit in memory at once
        t = {"model.embed_tokens.weight": bf16(vocab, D), "model.norm.weight": torch.ones(D, dtype=torch.bfloat16),
             "lm_head.weight": bf16(vocab, D)}
        for i in range(layers):
            p = f"model.layers.{i}."
            t |= {p + "input_layernorm.weight": torch.ones(D, dtype=torch.bfloat16),
                  p + "post_attention_layernorm.weight": torch.ones(D, dtype=torch.bfloat16),
                  p + "self_attn.q_proj.weight": bf16(H * hd, D), p + "self_attn.q_proj.bias": bf16(H * hd),
                  p + "self_attn.k_proj.weight": bf16(KV * hd, D), p + "self_attn.k_proj.bias": bf16(KV * hd),
                  p + "self_attn.v_proj.weight": bf16(KV * hd, D), p + "self_attn.v_proj.bias": bf16(KV * hd),
                  p + "self_attn.o_proj.weight": bf16(D, H * hd), p + "self_attn.o_proj.bias": bf16(D),
                  p + "self_attn.sinks": bf16(H, std=1.0),
                  p + "mlp.router.weight": bf16(E, D, std=0.1), p + "mlp.router.bias": bf16(E),
                  p + "mlp.experts.gate_up_proj_blocks": codes(E, 2 * I, D // 32, 16),
                  p + "mlp.experts.gate_up_proj_scales": scales(E, 2 * I, D // 32),
                  p + "mlp.experts.gate_up_proj_bias": bf16(E, 2 * I),
                  p + "mlp.experts.down_proj_blocks": codes(E, D, I // 32, 16),
                  p + "mlp.experts.down_proj_scales": scales(E, D, I // 32),
                  p + "mlp.experts.down_proj_bias": bf16(E, D)}
            if i % 2 == 1 or i == layers - 1:
                yield t
                t = {}

    return save_shards(path, cfg, shards())
