"""`lynx-edge info [MODEL]`: the config, parameter counts (total / active per token) and the
offload placement plan as a dry run — from config.json alone, no weights loaded."""
from __future__ import annotations

from typing import Annotated, Optional

import typer

from . import ui
from .common import CliError, need
from .options import Device, Int4, Model, Profile, TableJson


def info(
    model: Model = "demo",
    profile: Profile = None,
    int4: Int4 = False,
    gpu_budget: Annotated[Optional[float], typer.Option("--gpu-budget", help="GPU memory for the plan, GiB")] = None,
    batch: Annotated[int, typer.Option("--batch-size", "-b", help="sequences the KV cache is planned for")] = 1,
    ctx_size: Annotated[int, typer.Option("--ctx-size", "-c", help="context the KV cache is planned for")] = 4096,
    device: Device = None,
    output: Annotated[TableJson, typer.Option("--output", "-o", help="table | json")] = TableJson.table,
) -> None:
    """Show a model's config, parameter counts and placement plan without loading weights."""
    from ..modelinfo import describe, load_config, param_counts

    cfg, where = load_config(model)
    counts = param_counts(cfg)
    plan = _plan(cfg, profile, int4, gpu_budget, batch, ctx_size, device)
    if output is TableJson.json:
        ui.json_line({"model": where, "config": describe(cfg), "params": counts, "plan": plan})
        return
    ui.kv_table(f"{where}", describe(cfg))
    ui.kv_table("parameters", {
        "total": ui.fmt_count(counts["total"]),
        "active per token": f"{ui.fmt_count(counts['active'])} ({100 * counts['active'] / counts['total']:.1f}%)",
        "experts": f"{ui.fmt_count(counts['expert'])} in {counts['moe_layers']} MoE layers",
        "non-expert": ui.fmt_count(counts["non_expert"]),
        "one expert": f"{ui.fmt_count(counts['params_per_expert'])} params, "
                      f"{ui.fmt_bytes(counts['expert_bytes_per_expert'])} at {cfg.torch_dtype or 'bfloat16'}",
    })
    if plan is None:
        ui.note("placement plan: not available in this build (lynx_edge.offload.plan)", stderr=False)
    else:
        ui.plan_table(plan)


def _plan(cfg, profile, int4, gpu_budget, batch, ctx, device) -> dict | None:
    """The offload plan's dry-run report (None when this build has no planner and none was asked for)."""
    try:
        make_plan = need([("lynx_edge.offload.plan", "make_plan")], "placement planning (lynx_edge.offload.plan)")
    except CliError:
        if profile or int4 or gpu_budget is not None:
            raise
        return None
    import torch

    from ..offload import OffloadOptions

    opts = OffloadOptions(profile=profile, expert_format="int4" if int4 else "auto", gpu_budget_gib=gpu_budget,
                          batch=batch, ctx=min(ctx, cfg.max_position_embeddings))
    dtype = {"float32": torch.float32, "float16": torch.float16}.get(str(cfg.torch_dtype), torch.bfloat16)
    return make_plan(cfg, opts, dtype=dtype, device=device).report()
