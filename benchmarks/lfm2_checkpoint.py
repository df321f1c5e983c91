"""A random LFM2-8B-A1B in its published layout at full size, for benchmarks (full_size.py --model lfm2).

The published config.json (tests/fixtures/lfm2-8b-a1b: 24 layers, 18 gated short convolutions and 6
attention layers, the first 2 dense MLPs of 7168, then 32 experts of 1792 top-4 with sigmoid scores
and an expert bias, hidden 2048, 32 query / 8 KV heads of 64, tied embeddings, vocab 65536) with
random bf16 weights under the names transformers saves (`feed_forward.experts.{j}.w1/w2/w3`,
`conv.in_proj` / `conv.conv` / `conv.out_proj`, `self_attn.out_proj`, q/k layernorms,
`model.embedding_norm`): 8.3 B parameters, 16.7 GB — what a user downloads from the hub. The
tokenizer is the demo's (4096 tokens; the vocabulary keeps its published 65536 rows). Written in
shards of two layers (benchmarks/shards.py), so it never sits in memory whole.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from shards import normal_bf16, save_shards

PUBLISHED = Path(__file__).resolve().parents[1] / "tests/fixtures/lfm2-8b-a1b/config.json"


def write_lfm2(path: Path, layers: int = 24, vocab: int = 65536, seed: int = 0) -> Path:
    """→ path, written once (kept when its config.json is there)."""
    if (path / "config.json").is_file():
        return path
    print(f"writing the random LFM2-8B-A1B checkpoint {path} …", flush=True)
    cfg = json.loads(PUBLISHED.read_text())
    cfg.update(num_hidden_layers=layers, layer_types=cfg["layer_types"][:layers], vocab_size=vocab,
               eos_token_id=0, pad_token_id=0)
    D, I, Id = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["intermediate_size"]
    E, H, KV = cfg["num_experts"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, L = D // H, cfg["conv_L_cache"]
    bf16 = normal_bf16(torch.Generator().manual_seed(seed))

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    def shards():  # two layers a shard (2.8 GB of experts)
        t = {"model.embed_tokens.weight": bf16(vocab, D), "model.embedding_norm.weight": ones(D)}
        for i, kind in enumerate(cfg["layer_types"]):
            p = f"model.layers.{i}."
            t |= {p + "operator_norm.weight": ones(D), p + "ffn_norm.weight": ones(D)}
            if kind == "conv":
                t |= {p + "conv.in_proj.weight": bf16(3 * D, D), p + "conv.conv.weight": bf16(D, 1, L, std=0.2),
                      p + "conv.out_proj.weight": bf16(D, D)}
            else:
                t |= {p + "self_attn.q_proj.weight": bf16(H * hd, D), p + "self_attn.k_proj.weight": bf16(KV * hd, D),
                      p + "self_attn.v_proj.weight": bf16(KV * hd, D), p + "self_attn.out_proj.weight": bf16(D, H * hd),
                      p + "self_attn.q_layernorm.weight": ones(hd), p + "self_attn.k_layernorm.weight": ones(hd)}
            f = p + "feed_forward."
            if i < cfg["num_dense_layers"]:
                t |= {f + "w1.weight": bf16(Id, D), f + "w3.weight": bf16(Id, D), f + "w2.weight": bf16(D, Id)}
            else:
                # logits of std ~0.9 after the RMSNorm (0.02·√2048): sigmoid scores spread over (0, 1),
                # not saturated (session 38's first writer: 0.1, logit std 4.5, every top-4 score ≈ 1;
                # lfm2_full_s38.json ran on it). The expert bias is an untrained checkpoint's zeros: then
                # a token's top-4 biased scores (x4, LYNX's units) lie within ~0.45 of each other, so
                # LYNX keeps every expert (lfm2_lynx_s38.json); a bias of std 0.3 (tests/lfm2_tiny.py)
                # opens gaps that let 29-39% of slots move
                t |= {f + "gate.weight": bf16(E, D), f + "expert_bias": torch.zeros(E)}
                for j in range(E):
                    t |= {f"{f}experts.{j}.w1.weight": bf16(I, D), f"{f}experts.{j}.w3.weight": bf16(I, D),
                          f"{f}experts.{j}.w2.weight": bf16(D, I)}
            if i % 2 == 1 or i == layers - 1:
                yield t
                t = {}

    return save_shards(path, cfg, shards())
