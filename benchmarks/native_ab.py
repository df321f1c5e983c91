"""This tree's native kernels against another revision's, in one process: the shared set-up of the
kernel A/B benchmarks (attn_decode.py, dense_tiles.py).

    libs, base = tree_and_base("HEAD~1", "attn_decode")   # {"base": CDLL, "tree": CDLL}, short hash
    use(libs, "base")   # every native call now goes to the base build
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNEL = "lynx_edge/kernels/cpu_native.c"


def tree_and_base(rev: str, script: str) -> tuple[dict, str]:
    """Both builds, loaded (native.lib patched to pick one through `use`) → (libs, base's short
    hash); exits with one line when rev is not a revision with the kernel file."""
    from lynx_edge.kernels import native

    short = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True)
    src = subprocess.run(["git", "show", f"{rev}:{KERNEL}"], cwd=ROOT, capture_output=True)
    if short.returncode or src.returncode:
        sys.exit(f"{script}: --base {rev!r} is not a revision with {KERNEL}")
    base_src = Path(tempfile.mkdtemp()) / "cpu_native.c"
    base_src.write_bytes(src.stdout)
    libs = {}
    for tag, path in (("base", base_src), ("tree", ROOT / KERNEL)):
        native.SRC = path
        native.lib.cache_clear()
        libs[tag] = native.lib()
        if libs[tag] is None:
            sys.exit(f"{script}: the {tag} kernels did not build (see the log above)")
    native.SRC = ROOT / KERNEL
    libs["_current"] = "base"
    native.lib = lambda: libs[libs["_current"]]
    return libs, short.stdout.strip()


def use(libs: dict, tag: str) -> None:
    libs["_current"] = tag
