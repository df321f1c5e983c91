"""This tree's native kernels against another revision's, in one process: the shared set-up of the
kernel A/B benchmarks (attn_decode.py, dense_tiles.py, int4_rows.py).

    builds = Builds("HEAD~1", "attn_decode")   # both built and loaded; builds.base: short hash
    ap = parser("attn_decode.json", rounds=15)  # --base, -r/--rounds, --out (under benchmarks/results/)
    builds.use("base")                          # every native call now goes to the base build
    ms = alternate(builds, rounds, fn, reps)    # {"base": [ms...], "tree": [ms...]}, order alternating
    paired(ms["base"], ms["tree"])              # {"median", "min", "max"} of the per-round ratios
    append_run(path, builds.header(what, a.rounds) | {...})  # the results file: a JSON list of runs
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
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

    def header(self, benchmark: str, rounds: int) -> dict:
        """The fields every recorded run starts with: what was measured, against which revision, on
        which ISA and build flags."""
        import torch

        from lynx_edge.bench import cpu_isa
        from lynx_edge.kernels import native

        return {"benchmark": benchmark, "base": self.base, "isa": cpu_isa(), "march": native.FLAGS[1],
                "rounds": rounds, "torch": torch.__version__}


def parser(out: str, rounds: int) -> argparse.ArgumentParser:
    """The kernel A/Bs' shared options: --base REV (required), -r/--rounds, --out (default
    benchmarks/results/<out>)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="git revision whose cpu_native.c is the baseline")
    ap.add_argument("-r", "--rounds", type=int, default=rounds)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results" / out))
    return ap


def paired(base: list, tree: list) -> dict:
    """Speed-up of tree over base per round (base time / tree time): median, min and max."""
    r = sorted(b / t for b, t in zip(base, tree))
    return {"median": statistics.median(r), "min": r[0], "max": r[-1]}


def alternate(builds: Builds, rounds: int, fn, reps: int = 1) -> dict:
    """ms per fn() call with each build, `reps` calls per sample, the build that goes first
    alternating round by round (background load hits both alike) → {"base": [...], "tree": [...]}."""
    ms = {"base": [], "tree": []}
    for r in range(rounds):
        for tag in (("base", "tree") if r % 2 == 0 else ("tree", "base")):
            builds.use(tag)
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            ms[tag].append((time.perf_counter() - t0) / reps * 1e3)
    return ms


def gb_row(builds: Builds, rounds: int, call, gb: float, reps: int = 1, start=None) -> dict:
    """One weight-streaming A/B row: call() run once with each build (its outputs compared bit for bit),
    then timed alternating (`reps` calls per sample) → GB/s of `gb` GB per call with each build, the
    paired speed-up and bit_equal. start: called before each build's first call (a call that walks
    through its weights starts from the same place)."""
    import torch

    ys = {}
    for tag in ("base", "tree"):
        builds.use(tag)
        if start is not None:
            start()
        ys[tag] = call()
    ms = alternate(builds, rounds, call, reps)
    return {"base_gb_s": round(gb / statistics.median(ms["base"]) * 1e3, 2),
            "tree_gb_s": round(gb / statistics.median(ms["tree"]) * 1e3, 2),
            "speedup": {k: round(v, 3) for k, v in paired(ms["base"], ms["tree"]).items()},
            "bit_equal": torch.equal(ys["base"], ys["tree"])}


def append_run(path: Path, run: dict) -> None:
    """Add run to the results file at path (a JSON list of runs, made when missing)."""
    runs = json.loads(path.read_text()) if path.is_file() else []
    runs.append(run)
    path.write_text(json.dumps(runs, indent=1) + "\n")
