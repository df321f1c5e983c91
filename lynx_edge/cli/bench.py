"""`lynx-edge bench [MODEL]`: prefill and decode speed, unique experts, LYNX vs exact.
The measuring is lynx_edge.bench.run_bench; this module parses options and renders."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from . import ui
from .common import CliError, engine_options, load_engine, need
from .options import (SCHEDULER_STEPS, BatchSizes, CtxSize, SchedulerSteps, Device, Dtype, Bf16Act, Int4, Int4Act, Int4Attn, Int8Head, NoRepack, SwaFull, Model, Offload, Profile, Seed, TableJsonCsv,
                      check_lynx, parse_sizes)

_MODES = {"off": ["off"], "on": ["on"], "lynx": ["lynx"], "both": ["off", "on"]}


def bench(
    model: Model = "demo",
    lynx: Annotated[str, typer.Option("--lynx", help="off | on (recommended rule) | both (side by side, with the speed-up) | lynx | lynx-mass:T | budget:M")] = "off",
    batch_sizes: BatchSizes = "1,4,16",
    prompt_len: Annotated[int, typer.Option("--n-prompt", "-p", help="prompt tokens per sequence")] = 128,
    gen_len: Annotated[int, typer.Option("--n-gen", "-n", help="generated tokens per sequence")] = 128,
    reps: Annotated[int, typer.Option("--repetitions", "-r", help="timed repetitions (after one warm-up); modes alternate within each")] = 5,
    output: Annotated[TableJsonCsv, typer.Option("--output", "-o", help="table | json (one line, every number) | csv")] = TableJsonCsv.table,
    save: Annotated[Optional[str], typer.Option("--save", help="also write the full results (JSON, with threads, --int4, --offload) to FILE")] = None,
    quality: Annotated[str, typer.Option("--quality", help="with --lynx both: fast (seconds) | full (the README sweep, minutes) | off")] = "fast",
    simulate: Annotated[Optional[str], typer.Option("--simulate", help="also project each run's routing onto a hardware profile (name or .toml)")] = None,
    shape: Annotated[Optional[str], typer.Option("--shape", help="model shape for --simulate: this model, or mixtral-8x7b, qwen3-30b-a3b, olmoe-1b-7b")] = None,
    plot: Annotated[Optional[str], typer.Option("--plot", help="write a PNG: tok/s and unique experts vs batch size")] = None,
    seed: Seed = 0,
    serve: Annotated[bool, typer.Option("--serve", help="load-test the OpenAI server instead: -b concurrent streaming clients, 2 requests each of -n tokens (prompts ~-p tokens), -r rounds; throughput, TTFT/TPOT percentiles, max throughput at --slo-ms")] = False,
    slo_ms: Annotated[float, typer.Option("--slo-ms", min=0, help="with --serve: the TPOT p90 SLO for the max-throughput line")] = 50.0,
    offload: Offload = False,
    int4: Int4 = False,
    int4_act: Int4Act = None,
    bf16_act: Bf16Act = None,
    int4_attn: Int4Attn = False,
    int8_head: Int8Head = False,
    no_repack: NoRepack = False,
    swa_full: SwaFull = False,
    profile: Profile = None,
    ctx_size: CtxSize = None,
    dtype: Dtype = None,
    device: Device = None,
    num_scheduler_steps: SchedulerSteps = SCHEDULER_STEPS,
) -> None:
    """Benchmark prefill and decode per batch size on synthetic prompts (mean ± std over -r runs)."""
    from .. import bench as lib

    sizes = parse_sizes(batch_sizes)
    value = check_lynx(lynx, extra=tuple(_MODES))  # before the model loads
    modes = _MODES.get(value, [value])
    if quality not in ("fast", "full", "off"):
        raise typer.BadParameter(f"{quality!r}: use fast, full or off", param_hint="--quality")
    if plot and importlib.util.find_spec("matplotlib") is None:
        raise CliError("--plot needs matplotlib, which is not installed", "pip install 'lynx-edge[bench]'")
    if simulate:
        need([("lynx_edge.offload.projection", "project")], "--simulate", "run without --simulate")
    if serve:
        if simulate or plot:
            raise CliError("--simulate and --plot do not apply to --serve")
        need([("lynx_edge.server.load", "serve_load")], "--serve", "pip install fastapi uvicorn prometheus_client httpx")
        opts = engine_options("off", offload, int4, profile, ctx_size or max(2 * prompt_len + gen_len + 8, 256),
                              int4_act=int4_act, int4_attn=int4_attn, int8_head=int8_head, no_repack=no_repack, swa_full=swa_full, bf16_act=bf16_act)
        engine = load_engine(model, dtype, device, max_num_seqs=max(sizes), **opts)  # the plan counts every row's KV
        result = _serve(engine, sizes, modes, prompt_len, gen_len, reps, slo_ms)
        _render_serve(result, output)
        if save:
            Path(save).write_text(json.dumps(result, default=str, indent=1) + "\n", encoding="utf-8")
            ui.note(f"results written to {save}")
        return
    opts = engine_options("off", offload, int4, profile, ctx_size or max(prompt_len + gen_len + 8, 256),  # ≥ 256: eval windows
                          int4_act=int4_act, int4_attn=int4_attn, int8_head=int8_head, no_repack=no_repack, swa_full=swa_full, bf16_act=bf16_act)
    engine = load_engine(model, dtype, device, num_scheduler_steps=num_scheduler_steps, **opts)
    project = lib.projector(engine, simulate, shape) if simulate else None
    cpu = ""
    if engine.model.device.type == "cpu":  # which CPU kernels the numbers come from
        cpu = f"{'native' if lib.native_kernels() else 'torch/numba (no C compiler)'} CPU kernels · "
    ui.note(f"threads {engine.config.threads} · {engine.model.placement.experts} experts · {cpu}"
            f"{len(sizes)} batch sizes × {len(modes)} modes × {reps + 1} runs (-t sets threads)", stderr=True)
    result = lib.run_bench(engine, sizes, prompt_len, gen_len, reps, modes, seed=seed or 0,
                           progress=ui.progress_line("bench"), project=project)
    if simulate:
        result["config"]["simulate"] = {"profile": simulate, "shape": shape or "this model", "label": "projected"}
    if len(modes) > 1 and quality != "off":
        ui.note(f"quality ({quality}): perplexity and greedy agreement, LYNX vs exact …", stderr=True)
        _merge_quality(result, *lib.quality_delta(engine, sizes, modes[1], level=quality))
    elif len(modes) > 1:
        _merge_quality(result, None, "--quality off")
    _render(result, output)
    if save:
        Path(save).write_text(json.dumps(result, default=str, indent=1) + "\n", encoding="utf-8")
        ui.note(f"results written to {save}")
    if plot:
        path = lib.plot_bench(result, plot)
        ui.note(f"plot written to {path}")


def _serve(engine, sizes: list[int], modes: list[str], prompt_len: int, gen_len: int, reps: int, slo_ms: float) -> dict:
    from ..server import load

    ui.note(f"threads {engine.config.threads} · serving {engine.model_dir.name} on 127.0.0.1 · concurrency "
            f"{','.join(map(str, sizes))} × {len(modes)} modes × {reps} rounds", stderr=True)
    rows = load.serve_load(engine, sizes, tuple(modes), reps, max_tokens=gen_len, prompt_len=prompt_len)
    slo = load.slo_throughput(rows, slo_ms, lambda r: f"lynx {r['lynx']}")
    config = {"model": str(engine.model_dir), "threads": engine.config.threads, "concurrency": sizes, "modes": modes,
              "rounds": reps, "max_tokens": gen_len, "prompt_len_mean": prompt_len, "slo_tpot_p90_ms": slo_ms}
    return {"config": config, "rows": rows, "compare": load.compare(rows), "max_throughput_at_slo": slo}


def _render_serve(result: dict, output: TableJsonCsv) -> None:
    from ..server.load import markdown

    if output is TableJsonCsv.csv:
        ui.csv_rows(result["rows"])
    elif output is TableJsonCsv.table:
        slo = result["max_throughput_at_slo"]
        ui.write(markdown(result["rows"]) + f"\nmax throughput with TPOT p90 ≤ {result['config']['slo_tpot_p90_ms']:g} ms: "
                 + ("; ".join(f"{k}: {v:.1f} tok/s" for k, v in slo.items()) or "no point meets it") + "\n")
    else:
        ui.json_line(result)


def _merge_quality(result: dict, quality: list[dict] | None, source: str) -> None:
    result["quality"] = source if quality is not None else None
    if quality is None:
        result["quality_note"] = source
        return
    by_batch = {q["batch"]: q for q in quality}
    for row in result.get("compare", []):
        q = by_batch.get(row["batch"], {})
        row.update({k: q[k] for k in ("ppl_change_pct", "greedy_agreement_pct") if q.get(k) is not None})


def _render(result: dict, output: TableJsonCsv) -> None:
    if output is TableJsonCsv.csv:
        ui.csv_rows(result["rows"])
    elif output is TableJsonCsv.table:  # the table alone: every number is in -o json / --save
        ui.bench_table(result)
    else:
        ui.json_line(result)

