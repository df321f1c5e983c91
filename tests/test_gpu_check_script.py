"""scripts/gpu_check.sh fits a 15-minute device lease: a CPU dry run (LYNX_GPU_CHECK_DRY=1) prints
each stage instead of running it; this checks what would come back (≤ 8 files), the stage
timeouts (≤ 560 s with the kill grace), the interpreter (python3) and that the scripts the
stages call accept the flags they are given."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "LYNX_GPU_CHECK_DRY": "1", "TMPDIR": str(tmp_path)}
    env.pop("PYTHON", None)
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and {"summary.json", "summary.txt", "gpu_check_logs.tar.gz"} <= {p.name for p in files}
    s = json.loads((out / "summary.json").read_text())
    timeouts = [st["timeout_s"] for st in s["stages"]]
    assert s["dry_run"] and s["ok"] and s["timeout_sum_s"] == sum(timeouts)
    assert sum(timeouts) + 5 * len(timeouts) <= 560  # `timeout -k 5` grace per stage
    cmds = {st["name"]: " ".join(st["tail"]) for st in s["stages"]}
    assert "python3 -m pytest -m gpu" in cmds["pytest_gpu"]
    assert "python3 scripts/gpu_kernels_bench.py" in cmds["kernels_bench"]
    assert "python3 scripts/gpu_offload_check.py" in cmds["offload_check"]
    assert not list(tmp_path.glob("lynx_gpu_check.*"))  # the log folder is cleaned up


def test_gpu_check_stage_flags_exist():
    """The flags gpu_check.sh passes are ones the scripts parse (a typo would waste a lease)."""
    for script, flags in (("gpu_kernels_bench.py", ("--tokens", "--budget-s", "--out")),
                          ("gpu_offload_check.py", ("--layers", "--steps", "--out"))):
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--help"], capture_output=True,
                           text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert r.returncode == 0, r.stderr
        assert all(f in r.stdout for f in flags), (script, r.stdout)
