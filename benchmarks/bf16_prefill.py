"""bf16 prefill on a CPU: the GEMM paths chosen with native bf16 math vs without, side by side.

models/layers.py runs a bf16 model's prefill-sized projections (past 128 rows) and experts (past
512 token-expert slots) as torch's bf16 GEMMs where the CPU multiplies bf16 natively
(cpuflags.cpu_bf16), and as fp32 GEMMs on widened weights / the native kernel elsewhere. This
times both on the same engine in one process ($LYNX_EDGE_CPU_BF16 flipped between alternating
measurements; it is read per call), prefill tok/s of bench's synthetic prompts, medians and the
median of the per-round ratios.

    python benchmarks/bf16_prefill.py [--model demo[,PATH]] [-b 1,16] [-p 128,512] [-r 7] [--threads 1,2]
Writes benchmarks/results/bf16_prefill.json (or --out).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo", help="comma-separated: demo and/or checkpoint paths")
    ap.add_argument("-b", "--batch", default="1,16")
    ap.add_argument("-p", "--prompt", default="128,512")
    ap.add_argument("-r", "--rounds", type=int, default=7)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/bf16_prefill.json"))
    a = ap.parse_args()
    import torch

    from lynx_edge import Engine
    from lynx_edge.bench import cpu_isa, measure, synthetic_prompts
    from lynx_edge.cpuflags import cpu_flags
    from lynx_edge.threads import set_threads

    rows = []
    for model in a.model.split(","):
        eng = Engine.from_pretrained(model, device="cpu", dtype="bfloat16", max_num_seqs=max(int(b) for b in a.batch.split(",")))
        for t in (int(x) for x in a.threads.split(",")):
            set_threads(t, explicit=True)
            for B in (int(b) for b in a.batch.split(",")):
                for P in (int(p) for p in a.prompt.split(",")):
                    prompts = synthetic_prompts(eng, B, P)
                    got: dict[str, list[float]] = {"0": [], "1": []}
                    for _ in range(a.rounds):
                        for v in ("0", "1"):
                            os.environ["LYNX_EDGE_CPU_BF16"] = v
                            got[v].append(measure(eng, prompts, 2)["prefill_tok_s"])
                    row = {"model": Path(model).name, "threads": t, "batch": B, "prompt": P,
                           "prefill_tok_s_widened": statistics.median(got["0"]),
                           "prefill_tok_s_bf16_gemm": statistics.median(got["1"]),
                           "speedup": statistics.median(b / w for w, b in zip(got["0"], got["1"])),
                           "all": got}
                    rows.append(row)
                    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k != "all"}),
                          flush=True)
    os.environ.pop("LYNX_EDGE_CPU_BF16", None)
    flags = sorted(f for f in cpu_flags() if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_vnni"))
    Path(a.out).write_text(json.dumps({"benchmark": "bf16 prefill tok/s: torch bf16 GEMMs (native bf16 CPUs) vs widened fp32 / native kernel",
                                       "isa": cpu_isa(), "cpu_flags": flags, "torch": torch.__version__,
                                       "rounds": a.rounds, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
