"""Tiny random LFM2-MoE checkpoints written by transformers (shared by tests/test_lfm2_moe.py and
benchmarks/lynx_lfm2_moe.py).

The config is the published LFM2-8B-A1B config.json (tests/fixtures/lfm2-8b-a1b, see its
SOURCES.md) with only the sizes shrunk: its first 8 layers' `layer_types` (conv, conv, attention,
conv, conv, conv, attention, conv), 2 dense layers, 32 experts top-4, GQA 4:1, bias routing.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

PUBLISHED = Path(__file__).parent / "fixtures" / "lfm2-8b-a1b" / "config.json"
# sizes only (D and I are multiples of the INT4 group 32); initializer_range: a random model whose
# greedy text varies (the 0.02 default repeats one token)
SIZES = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
         "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 1,
         "max_position_embeddings": 512, "eos_token_id": 2, "initializer_range": 0.15}


def tiny_config(**changes) -> dict:
    cfg = json.loads(PUBLISHED.read_text())
    cfg.update(SIZES)
    cfg["layer_types"] = cfg["layer_types"][: cfg["num_hidden_layers"]]
    for k, v in changes.items():
        cfg.pop(k, None) if v is None else cfg.__setitem__(k, v)
    return cfg


def make_lfm2_moe(path: Path, seed: int = 0, bias_std: float = 0.3, **changes) -> Path:
    """save_pretrained of a random Lfm2MoeForCausalLM (+ the test tokenizer); config.json is then
    rewritten as the shrunk published dict (absent fields stay absent). Routers are sharpened,
    norms made non-trivial and expert_bias (zeros at init) drawn N(0, bias_std), so the biased
    selection differs from the unbiased one."""
    import transformers
    from conftest import write_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(**changes)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    config = transformers.AutoConfig.from_pretrained(path)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("feed_forward.gate.weight"):
                p.normal_(0, 0.5)
            elif n.endswith("norm.weight"):  # operator/ffn/embedding norms and q/k layernorms
                p.uniform_(0.5, 1.5)
            elif n.endswith("conv.bias") or n.endswith("proj.bias"):
                p.normal_(0, 0.1)
        for n, b in model.named_buffers():
            if n.endswith("expert_bias"):
                b.normal_(0, bias_std)
    model.save_pretrained(path)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    write_tokenizer(path)
    return path
