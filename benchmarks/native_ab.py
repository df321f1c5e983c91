"""This tree's native kernels against another revision's, in one process: the shared set-up of the
kernel A/B benchmarks (attn_decode.py, dense_tiles.py).

    builds = Builds("HEAD~1", "attn_decode")   # both built and loaded; builds.base: short hash
    builds.use("base")                          # every native call now goes to the base build
    paired(base_times, tree_times)              # {"median", "min", "max"} of the per-round ratios
"""
from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNEL = "lynx_edge/kernels/cpu_native.c"


class Builds:
    """The base revision's build and this tree's, with native.lib patched to return the one `use`
    picked (base first). Exits with one line when rev is not a revision with the kernel file."""

    def __init__(self, rev: str, script: str):
        from lynx_edge.kernels import native

        short = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True)
        src = subprocess.run(["git", "show", f"{rev}:{KERNEL}"], cwd=ROOT, capture_output=True)
        if short.returncode or src.returncode:
            sys.exit(f"{script}: --base {rev!r} is not a revision with {KERNEL}")
        self.base = short.stdout.strip()
        base_src = Path(tempfile.mkdtemp()) / "cpu_native.c"
        base_src.write_bytes(src.stdout)
        self.libs = {}
        for tag, path in (("base", base_src), ("tree", ROOT / KERNEL)):
            native.SRC = path
            native.lib.cache_clear()
            self.libs[tag] = native.lib()
            if self.libs[tag] is None:
                sys.exit(f"{script}: the {tag} kernels did not build (see the log above)")
        native.SRC = ROOT / KERNEL
        self.current = "base"
        native.lib = lambda: self.libs[self.current]

    def use(self, tag: str) -> None:
        self.current = tag


def paired(base: list, tree: list) -> dict:
    """Speed-up of tree over base per round (base time / tree time): median, min and max."""
    r = sorted(b / t for b, t in zip(base, tree))
    return {"median": statistics.median(r), "min": r[0], "max": r[-1]}
