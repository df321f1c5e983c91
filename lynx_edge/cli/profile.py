"""`lynx-edge profile [-o FILE]`: measure this machine (memory, PCIe and CPU bandwidth) into a
hardware profile for placement and projections (lynx_edge.offload.profile.calibrate)."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer

from . import ui
from .common import need
from .options import Device


def profile(
    output: Annotated[Path, typer.Option("--output", "-o", help="where to write the profile (TOML)")] = Path("profile.toml"),
    name: Annotated[str, typer.Option("--name", help="the profile's name")] = "this-machine",
    size_mb: Annotated[int, typer.Option("--size-mb", help="buffer size of each bandwidth test")] = 256,
    device: Device = None,
) -> None:
    """Calibrate this machine and write a hardware profile (use it with --profile / --simulate)."""
    from ..bench import call_supported

    calibrate = need([("lynx_edge.offload.profile", "calibrate"), ("lynx_edge.offload", "calibrate")],
                     "calibration (lynx_edge.offload.profile.calibrate)")
    ui.note(f"measuring {device or 'this machine'} ({size_mb} MB buffers)…")
    prof = call_supported(calibrate, name=name, device=device, size_mb=size_mb, save_to=output)
    rows = dataclasses.asdict(prof) if dataclasses.is_dataclass(prof) else dict(prof or {})
    ui.kv_table(f"profile {name} → {output}", {k: v for k, v in rows.items() if v not in ((), "", None)})
