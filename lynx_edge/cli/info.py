"""`lynx-edge info [MODEL]`: the config, parameter counts (total / active per token) and the
placement plan as a dry run — from config.json alone, no weights loaded."""
from __future__ import annotations

from typing import Annotated

import typer

from . import ui
from .common import CliError, need
from .options import Model, Profile, TableJson

_PLAN = [("lynx_edge.offload.plan", "dry_run"), ("lynx_edge.offload.plan", "plan_placement"),
         ("lynx_edge.offload.plan", "make_plan"), ("lynx_edge.offload.plan", "plan")]


def info(
    model: Model = "demo",
    profile: Profile = None,
    output: Annotated[TableJson, typer.Option("--output", "-o", help="table | json")] = TableJson.table,
) -> None:
    """Show a model's config, parameter counts and placement plan without loading weights."""
    from ..bench import call_supported
    from ..modelinfo import describe, load_config, param_counts

    cfg, where = load_config(model)
    counts = param_counts(cfg)
    plan = None
    try:
        make_plan = need(_PLAN, "placement planning (lynx_edge.offload.plan)")
    except CliError:
        if profile:
            raise
        make_plan = None
    if make_plan is not None:
        plan = call_supported(make_plan, cfg, profile=profile)
        plan = plan if isinstance(plan, (dict, str)) or plan is None else getattr(plan, "summary", lambda: str(plan))()
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
    elif isinstance(plan, dict):
        ui.kv_table("placement plan (dry run)", plan)
    else:
        ui.line(str(plan))
