#!/usr/bin/env bash
# Device check on one CUDA GPU, sized for a 15-minute device lease (written for an H200 with
# torch 2.11 + Triton 3.6): the -m gpu tests (kernels vs references in bf16, CUDA-graph capture,
# one host sync per decode step), the MoE GEMM / INT4 / routing kernel bench, offloaded decode.
# Run from the checkout; installs nothing:
#   OUT=/path/to/results bash scripts/gpu_check.sh
# Writes ≤ 8 files under $OUT: summary.json (stages, rc, seconds), summary.txt, kernels_bench.md,
# gpu_offload_check.md and gpu_check_logs.tar.gz (every log and JSON). Stage timeouts sum to
# 535 s (+5 s kill grace each): the JIT compiles ~30 kernel variants in the test stage.
# LYNX_GPU_CHECK_DRY=1: print each stage's command instead of running it (CPU test of this script).
# Exit status: non-zero if a stage failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/lynx_gpu_check.XXXXXX")
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PY=${PYTHON:-python3}
DRY=${LYNX_GPU_CHECK_DRY:-0}
unset TRITON_INTERPRET LYNX_TRITON_INTERPRET  # compiled kernels, not the CPU interpreter
STAGES=()  # name|timeout_s|rc|wall_s

stage() {  # stage NAME TIMEOUT_S CMD... → $LOGS/NAME.log
  local name=$1 t=$2 t0=$SECONDS rc
  shift 2
  if [ "$DRY" = 1 ]; then
    echo "[dry run] $name (timeout ${t}s): $*" | tee "$LOGS/$name.log"
    rc=0
  else
    echo "== $name (timeout ${t}s): $*"
    timeout -k 5 "$t" "$@" > "$LOGS/$name.log" 2>&1
    rc=$?
    tail -n 30 "$LOGS/$name.log"
  fi
  STAGES+=("$name|$t|$rc|$((SECONDS - t0))")
}

stage env 15 bash -c 'date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
  "$PY" -c "import torch, triton; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"triton\", triton.__version__); print(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0))"'
# kernels vs references (bf16), CUDA-graph capture, decode-step host syncs; ≈ 30 JIT compiles
stage pytest_gpu 200 "$PY" -m pytest -m gpu -q -p no:cacheprovider --durations=15 tests
# correctness + bandwidth at Mixtral-8x7B and Qwen3-30B-A3B layer shapes, routing time
stage kernels_bench 190 "$PY" scripts/gpu_kernels_bench.py --out "$LOGS" --tokens 1,16,64 --budget-s 150
# offloaded decode of a Mixtral-8x7B-shaped model: pinned bandwidth vs achieved, tok/s ± LYNX
stage offload_check 130 "$PY" scripts/gpu_offload_check.py --layers 2 --steps 6 --out "$LOGS"

for f in kernels_bench.md gpu_offload_check.md; do
  [ -f "$LOGS/$f" ] && cp "$LOGS/$f" "$OUT/$f"
done
tar -czf "$OUT/gpu_check_logs.tar.gz" -C "$LOGS" .
"$PY" - "$OUT" "$LOGS" "$DRY" "${STAGES[@]}" <<'PYEOF'
import json, sys
from pathlib import Path
out, logs, dry, stages = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1", sys.argv[4:]
rows = []
for s in stages:
    name, t, rc, wall = s.split("|")
    rc = 0 if name == "pytest_gpu" and rc == "5" else int(rc)  # 5: no gpu tests collected
    tail = (logs / f"{name}.log").read_text(errors="replace").strip().splitlines()[-3:]
    rows.append({"name": name, "timeout_s": int(t), "rc": rc, "wall_s": int(wall), "tail": tail})
summary = {"dry_run": dry, "ok": all(r["rc"] == 0 for r in rows),
           "timeout_sum_s": sum(r["timeout_s"] for r in rows), "stages": rows}
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
lines = [f"{r['name']}: rc={r['rc']} {r['wall_s']}s (timeout {r['timeout_s']}s) | " + " / ".join(r["tail"])
         for r in rows]
(out / "summary.txt").write_text("\n".join(lines + [f"ok={summary['ok']}"]) + "\n")
print("\n".join(lines))
sys.exit(0 if summary["ok"] else 1)
PYEOF
rc=$?
rm -rf "$LOGS"
exit $rc
