"""Random checkpoints in a published layout, written shard by shard (benchmarks only).

A full-size model's weights (16.6 GB of bf16 for LFM2-8B-A1B) never sit in memory at once: each
shard's tensors are made, saved and dropped before the next's.
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch


def save_shards(path: Path, cfg: dict, shards: Iterable[dict[str, torch.Tensor]]) -> Path:
    """Each dict of `shards` → one model-NNNNN.safetensors, then the index, config.json and the demo's
    tokenizer (4096 tokens: the converters pad a larger vocab_size) → path. Written under a .part
    name and renamed last, so an interrupted run leaves no half checkpoint that looks whole."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from lynx_edge.hub import resolve_model

    tmp = path.with_name(path.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for i, tensors in enumerate(shards):
        save_file(tensors, tmp / f"model-{i:05d}.safetensors", metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {}}
    for f in sorted(tmp.glob("model-*.safetensors")):
        with safe_open(f, "pt") as h:
            index["weight_map"] |= {k: f.name for k in h.keys()}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(resolve_model("demo") / f, tmp / f)
    tmp.rename(path)
    return path


def normal_bf16(g: torch.Generator):
    """→ bf16(*shape, std=…): N(0, std²) draws from g, in bf16."""
    def bf16(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)
    return bf16
