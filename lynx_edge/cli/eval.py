"""`lynx-edge eval [MODEL]`: LYNX against exact routing per batch size — unique experts,
perplexity, greedy agreement — computed by lynx_edge.eval; this module only renders."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from . import ui
from .common import CliError, engine_options, load_engine, need
from .options import BatchSizes, Bf16Act, CtxSize, Device, Dtype, Lynx, Model, TableJson, parse_sizes


def evaluate(
    model: Model = "demo",
    file: Annotated[Optional[Path], typer.Option("--file", "-f", help="text to evaluate on (default: the eval module's own)")] = None,
    batch_sizes: BatchSizes = "1,4,16",
    lynx: Lynx = "on",
    seqs: Annotated[int, typer.Option("--seqs", help="windows of held-out text")] = 32,
    seq_len: Annotated[int, typer.Option("--seq-len", help="tokens per window")] = 128,
    prefill_len: Annotated[int, typer.Option("--prefill-len", help="tokens of each window prefilled exactly; the rest is decoded")] = 64,
    output: Annotated[TableJson, typer.Option("--output", "-o", help="table | json")] = TableJson.table,
    ctx_size: CtxSize = None,
    dtype: Dtype = None,
    device: Device = None,
    bf16_act: Bf16Act = None,
) -> None:
    """Measure LYNX's effect on quality and expert use against exact routing."""
    from ..bench import call_supported, eval_rows

    sizes = parse_sizes(batch_sizes)
    run = need([("lynx_edge.eval", "evaluate"), ("lynx_edge.eval", "run_eval")], "evaluation (lynx_edge.eval)")
    if file is not None and not file.is_file():
        raise CliError(f"{file}: no such file", "--file takes a UTF-8 text file")
    text = file.read_text(encoding="utf-8") if file is not None else None
    engine = load_engine(model, dtype, device, **engine_options("off", ctx_size=ctx_size, bf16_act=bf16_act))
    result = call_supported(run, engine, text=text, batch_sizes=sizes, lynx=lynx, num_seqs=seqs, seq_len=seq_len,
                            prefill_len=prefill_len)
    rows = eval_rows(result)
    if output is TableJson.table:
        ui.eval_table(rows, f"{engine.model_dir} · LYNX {lynx} vs exact")
    ui.json_line({"model": str(engine.model_dir), "lynx": lynx, "rows": rows})
