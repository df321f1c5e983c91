"""`lynx-edge quantize MODEL -o DIR`: write an INT4 copy of a checkpoint (lynx_edge.quant)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from . import ui
from .common import need
from .options import RequiredModel

_QUANTIZE = [("lynx_edge.quant", "quantize_model"), ("lynx_edge.quant.model", "quantize_model"),
             ("lynx_edge.quant.gptq", "quantize_model")]


def quantize(
    model: RequiredModel,
    output: Annotated[Path, typer.Option("--output", "-o", help="directory for the quantized checkpoint")],
    group_size: Annotated[int, typer.Option("--group-size", "-g", help="INT4 group size: 32, 64 or 128")] = 128,
) -> None:
    """Quantize a model's experts to INT4 and save the result."""
    from ..bench import call_supported
    from ..hub import resolve_model

    run = need(_QUANTIZE, "model quantization (lynx_edge.quant.quantize_model)")
    src = resolve_model(model)
    with ui.progress("quantizing", unit="steps") as cb:
        result = call_supported(run, src, output, group_size=group_size, progress=cb)
    ui.note(f"quantized {src} → {result or output}", stderr=False)
