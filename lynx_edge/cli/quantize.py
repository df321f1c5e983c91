"""`lynx-edge quantize MODEL -o DIR [--attn]`: write a GPTQ-format INT4 copy of a checkpoint's experts
(a shared expert too; and attention)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from . import ui
from .options import RequiredModel


def quantize(
    model: RequiredModel,
    output: Annotated[Path, typer.Option("--output", "-o", help="directory for the quantized checkpoint")],
    group_size: Annotated[int, typer.Option("--group-size", "-g", help="INT4 group size: 32, 64 or 128")] = 128,
    method: Annotated[str, typer.Option("--method", help="gptq (calibrated on held-out text) or rtn")] = "gptq",
    calib: Annotated[Path | None, typer.Option("--calib", help="calibration text file (default: heldout.txt)")] = None,
    attn: Annotated[bool, typer.Option("--attn", help="quantize attention q/k/v/o too (as published GPTQ "
                                                      "checkpoints do; read packed on a CPU)")] = False,
) -> None:
    """Quantize a model's experts — a shared expert too — (and with --attn its attention) to INT4
    (GPTQ or RTN) and save a GPTQ-format checkpoint."""
    from ..hub import resolve_model
    from ..quantize import quantize_model

    src = resolve_model(model)
    text = calib.read_text(encoding="utf-8", errors="replace") if calib else None
    with ui.progress("quantizing layers", unit="layers") as cb:
        out = quantize_model(src, output, method=method, group_size=group_size, calib_text=text, progress=cb,
                             attention=attn)
    ui.note(f"quantized {src} → {out}", stderr=False)
