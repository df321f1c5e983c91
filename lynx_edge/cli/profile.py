"""`lynx-edge profile [-o FILE]`: measure this machine (memory, PCIe and CPU bandwidth) into a
hardware profile for placement (lynx_edge.offload calibration)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from . import ui
from .options import Device

_CALIBRATE = [("lynx_edge.offload.calibrate", "calibrate"), ("lynx_edge.offload.profile", "calibrate"),
              ("lynx_edge.offload", "calibrate")]


def profile(
    output: Annotated[Path, typer.Option("--output", "-o", help="where to write the profile (TOML)")] = Path("profile.toml"),
    device: Device = None,
) -> None:
    """Calibrate this machine and write a hardware profile."""
    from ..bench import call_supported
    from .common import need

    run = need(_CALIBRATE, "calibration (lynx_edge.offload.calibrate)")
    with ui.progress("calibrating", unit="steps") as cb:
        result = call_supported(run, out=output, device=device, progress=cb)
    if isinstance(result, str) and not output.exists():
        output.write_text(result)
    if isinstance(result, dict):
        ui.kv_table(f"profile → {output}", result)
    else:
        ui.note(f"profile written to {output}", stderr=False)
