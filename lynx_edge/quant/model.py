"""INT4 experts in a model: the expert backend, RTN at load, GPTQ checkpoints in and out.

- `Int4MoEExperts`: the MoE block's expert backend over one Int4Experts buffer; Triton on
  CUDA, the torch reference (dequantise the active experts only) elsewhere.
- `quantize_experts_rtn(model)`: replace every layer's experts by RTN INT4 (Engine int4=True).
- `load_gptq_experts(model, dir)`: experts straight from a GPTQ checkpoint (no dequantised copy).
- `quantize_model(src, out)`: GPTQ (or RTN) the experts of a checkpoint, calibrated on text, and
  write a GPTQ checkpoint; non-expert weights stay in 16-bit.
Glossary: T tokens, D hidden, E experts, K top-k, I expert intermediate, G group size.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..kernels.moe_gemm import fused_moe_int4
from .formats import read_gptq_config, read_gptq_experts
from .gptq import quantize_experts_gptq, write_gptq_checkpoint
from .int4 import GROUP_SIZES, Int4Experts, quantize_experts


class Int4MoEExperts(nn.Module):
    """Experts of one layer as INT4 (one contiguous block per expert)."""

    def __init__(self, packed: Int4Experts | None):
        super().__init__()
        self.packed = packed

    def forward(self, x, ids, weights):  # x [T, D], ids/weights [T, K] → [T, D]
        return fused_moe_int4(x, ids, weights, self.packed)


def group_size_for(cfg, wanted: int = 128) -> int:
    """The largest supported group ≤ wanted that divides both D and I (the two input dims)."""
    for g in sorted(GROUP_SIZES, reverse=True):
        if g <= wanted and cfg.hidden_size % g == 0 and cfg.moe_intermediate_size % g == 0:
            return g
    raise ValueError(f"no INT4 group size divides hidden {cfg.hidden_size} and expert intermediate "
                     f"{cfg.moe_intermediate_size}")


def _moe_blocks(model):
    return [(i, model.layers[i].mlp) for i in model.cfg.moe_layer_ids]


def quantize_experts_rtn(model, group_size: int = 128, sym: bool = True) -> None:
    """Round-to-nearest INT4 for every layer's experts, in place, one layer at a time."""
    G = group_size_for(model.cfg, group_size)
    for _, block in _moe_blocks(model):
        ex = block.experts
        packed = quantize_experts(ex.gate_up.data, ex.down.data, G, sym).to(model.device)
        block.experts = Int4MoEExperts(packed)  # the 16/32-bit experts are freed here


def is_gptq_checkpoint(model_dir: Path, cfg) -> bool:
    qc = cfg.raw.get("quantization_config") or {}
    return qc.get("quant_method") == "gptq" or (model_dir / "quantize_config.json").is_file()


def prepare_gptq(model) -> None:
    """Before loading a GPTQ checkpoint: experts come from qweight/scales, not from .weight tensors."""
    for _, block in _moe_blocks(model):
        block.experts = Int4MoEExperts(None)


def load_gptq_experts(model, model_dir: Path) -> None:
    cfg = read_gptq_config(model_dir)
    for i, block in _moe_blocks(model):
        block.experts = Int4MoEExperts(read_gptq_experts(model_dir, i, cfg=cfg).to(model.device))


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
    from ..engine import Engine
    from ..loader import checkpoint_files, iter_tensor_refs, _Reader

    if method not in ("gptq", "rtn"):
        raise ValueError(f"method must be gptq or rtn, got {method!r}")
    eng = Engine.from_pretrained(src, device="cpu", dtype="float32")
    model, cfg = eng.model, eng.cfg
    G = group_size_for(cfg, group_size)
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
    files = checkpoint_files(eng.model_dir)
    reader, extra = _Reader(), {}
    for ref in iter_tensor_refs(files):
        if ".experts." in ref.name:
            continue
        t = reader.get(ref)
        extra[ref.name] = t.to(torch.bfloat16) if t.dtype == torch.float32 else t
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
    from ..step import prefill

    for s in range(0, max(1, len(ids) - 1), window):
        chunk = ids[s : s + window]
        if len(chunk) > 1:
            prefill(eng.model, eng._cache(1), 0, chunk, 0)


def _gptq_layer(ex, rows: dict[int, list[torch.Tensor]], G: int, sym: bool) -> Int4Experts:
    E, D = ex.gate_up.shape[0], ex.gate_up.shape[2]
    # experts nobody routed to during calibration: identity Hessian ≈ RTN
    x_in = [torch.cat(rows[e]) if e in rows else torch.eye(D) for e in range(E)]
    return quantize_experts_gptq(ex.gate_up.data, ex.down.data, x_in, None, G, sym)


__all__ = ["Int4MoEExperts", "group_size_for", "is_gptq_checkpoint", "load_gptq_experts", "prepare_gptq",
           "quantize_experts_rtn", "quantize_model"]
