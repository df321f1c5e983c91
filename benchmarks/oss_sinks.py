"""gpt-oss's decode attention on the CPU: the native kernel with the sinks in its softmax
(lynx_attn_decode) against the torch path (SinkAttention.sdpa), same engine, alternating rounds.

The checkpoint is vs_llamacpp.py's `--models oss` (benchmarks/oss_checkpoint.py: gpt-oss-20b's
layer shapes, 8 layers, MXFP4 experts), written first if absent. Decode tok/s over 32 tokens after
8-token prompts (B = 1) or 16-token ones (B = 16), medians and the median paired ratio.

    python benchmarks/oss_sinks.py [--batch 1,16] [--threads 1] [-r 5]
Appends a run to benchmarks/results/oss_sinks.json.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from native_ab import append_run  # noqa: E402
from oss_checkpoint import write_oss  # noqa: E402
from vs_llamacpp import CACHE, OSS_LAYERS, ours  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("-r", "--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/oss_sinks.json"))
    a = ap.parse_args()
    from lynx_edge import Engine
    from lynx_edge.bench import cpu_isa, synthetic_prompts
    from lynx_edge.models.layers import Attention
    from lynx_edge.threads import set_threads

    set_threads(a.threads, explicit=True)
    path = write_oss(CACHE / "models/oss-gptoss", OSS_LAYERS)
    native = Attention._decode_native
    paths = {"native": native, "torch": lambda self, x, ab, kv: None}
    rows = []
    for B in (int(b) for b in a.batch.split(",")):
        eng = Engine.from_pretrained(path, device="cpu", max_num_seqs=B, dtype="bfloat16")
        prompts = synthetic_prompts(eng, B, 8 if B == 1 else 16)
        tok_s = {k: [] for k in paths}
        try:
            for r in range(a.rounds + 1):  # round 0: warm-up
                for k, fn in paths.items():
                    Attention._decode_native = fn
                    v = ours(eng, prompts, 32 if r else 4, "off")
                    if r:
                        tok_s[k].append(v)
        finally:
            Attention._decode_native = native
        row = {"batch": B, "threads": a.threads, "tok_s": {k: round(statistics.median(v), 2) for k, v in tok_s.items()},
               "native_vs_torch": round(statistics.median(n / t for n, t in zip(tok_s["native"], tok_s["torch"])), 3)}
        rows.append(row)
        print(row, flush=True)
        del eng
    append_run(Path(a.out), {"benchmark": __doc__.split("\n")[0], "isa": cpu_isa(), "rounds": a.rounds,
                             "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows})


if __name__ == "__main__":
    main()
