"""`lynx-edge quantize`: GPTQ (or RTN) the experts of a checkpoint and write a GPTQ checkpoint.

`quantize_model(src, out)` calibrates on text, quantizes every MoE layer's experts and writes a
GPTQ-format checkpoint (v1 zeros) that Engine.from_pretrained loads as INT4; non-expert weights
stay 16-bit. (INT4 at load — `int4=True` — and reading GPTQ/AWQ checkpoints live in build.py,
loader.py and quant/experts.py.)
Glossary: T tokens, D hidden, E experts, K top-k, I expert intermediate, G group size.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .quant.experts import group_size_for
from .quant.gptq import quantize_experts_gptq, write_gptq_checkpoint
from .quant.int4 import Int4Experts, quantize_experts


def _moe_blocks(model):
    return [(i, model.layers[i].mlp) for i in model.cfg.moe_layer_ids]


class _Capture(nn.Module):
    """Wraps a layer's experts during calibration: records each expert's inputs, then computes."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.rows: dict[int, list[torch.Tensor]] = {}

    def forward(self, x, ids, weights):
        for e in ids.unique().tolist():
            tok = (ids == e).any(-1)
            self.rows.setdefault(e, []).append(x[tok].float().cpu())
        return self.inner(x, ids, weights)


def quantize_model(src, out_dir, method: str = "gptq", group_size: int = 128, sym: bool = True,
                   calib_text: str | None = None, calib_tokens: int = 16384, window: int = 256,
                   progress: Callable[[int, int], None] | None = None) -> Path:
    """src (a directory or name) → out_dir: a GPTQ-format checkpoint (v1 zeros) with INT4 experts.

    Calibration text defaults to the first quarter of the model's heldout.txt (the rest is left
    for evaluation). Experts that see no calibration token fall back to RTN."""
    from .checkpoint import Checkpoint
    from .engine import Engine

    if method not in ("gptq", "rtn"):
        raise ValueError(f"method must be gptq or rtn, got {method!r}")
    eng = Engine.from_pretrained(src, device="cpu", dtype="float32")
    model, cfg = eng.model, eng.cfg
    G = group_size_for(cfg.hidden_size, cfg.moe_intermediate_size, group_size)
    caps = {}
    if method == "gptq":
        for i, block in _moe_blocks(model):
            caps[i] = block.experts = _Capture(block.experts)
        _calibrate(eng, calib_text, calib_tokens, window)
    layers = {}
    blocks = _moe_blocks(model)
    for n, (i, block) in enumerate(blocks):
        ex = block.experts.inner if method == "gptq" else block.experts
        if method == "rtn":
            layers[i] = quantize_experts(ex.gate_up.data, ex.down.data, G, sym)
        else:
            layers[i] = _gptq_layer(ex, caps[i].rows, G, sym)
        if progress:
            progress(n + 1, len(blocks))
    # non-expert tensors: copied from the source checkpoint, 16-bit
    ckpt, extra = Checkpoint(eng.model_dir), {}
    for name in ckpt.names():
        if ".experts." in name:
            continue
        t = ckpt.get(name)
        extra[name] = t.to(torch.bfloat16) if t.dtype == torch.float32 else t.clone()
    config = json.loads((eng.model_dir / "config.json").read_text())
    naming = "mixtral" if cfg.model_type == "mixtral" else "qwen"
    out = write_gptq_checkpoint(out_dir, layers, naming=naming, config=config, extra_tensors=extra)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja", "heldout.txt"):
        if (eng.model_dir / f).is_file():
            shutil.copy(eng.model_dir / f, out / f)
    return out


def _calibrate(eng, text: str | None, tokens: int, window: int) -> None:
    if text is None:
        held = eng.model_dir / "heldout.txt"
        if not held.is_file():
            raise FileNotFoundError(f"{held}: no calibration text (pass calib_text)")
        full = held.read_text(encoding="utf-8", errors="replace")
        text = full[: len(full) // 4]
    ids = eng.tokenizer.encode(text, add_special_tokens=False)[:tokens]
    from .step import prefill

    for s in range(0, max(1, len(ids) - 1), window):
        chunk = ids[s : s + window]
        if len(chunk) > 1:
            prefill(eng.model, eng._cache(1), 0, chunk, 0)


def _gptq_layer(ex, rows: dict[int, list[torch.Tensor]], G: int, sym: bool) -> Int4Experts:
    E, D = ex.gate_up.shape[0], ex.gate_up.shape[2]
    # experts nobody routed to during calibration: identity Hessian ≈ RTN
    x_in = [torch.cat(rows[e]) if e in rows else torch.eye(D) for e in range(E)]
    return quantize_experts_gptq(ex.gate_up.data, ex.down.data, x_in, None, G, sym)


__all__ = ["quantize_model"]
