"""gpt-oss's CPU decode, two paths side by side in one engine, alternating rounds:

- `--compare sinks` (default): the decode attention's native kernel with the sinks in its softmax
  (lynx_attn_decode) against the torch path (SinkAttention.sdpa);
- `--compare layer`: the whole-layer native call (models/native_layer.py: attention with sinks and
  the window layers' ring, the biased router, the MXFP4 experts; all layers in one call a step)
  against the module path (the same kernels, ~40 Python and torch calls a layer between them);
- `--compare int4attn`: `--int4-attn` (attention's q/k/v/o 4-bit, RTN at load: a quarter of its
  bf16 bytes) against bf16 attention, two engines loaded once (approximate: not bit-equal).

The checkpoint is vs_llamacpp.py's `--models oss` (benchmarks/oss_checkpoint.py: gpt-oss-20b's
layer shapes, 8 layers, MXFP4 experts), written first if absent. Decode tok/s over 32 tokens after
8-token prompts (B = 1) or 16-token ones (B = 16), medians and the median paired ratio.

    python benchmarks/oss_sinks.py [--compare sinks|layer|int4attn] [--batch 1,16] [--threads 1] [-r 5]
Appends a run to benchmarks/results/oss_sinks.json (--compare layer: oss_layer_call.json; int4attn:
oss_int4attn.json).
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
from vs_llamacpp import CACHE, OSS_LAYERS, engines_ab, ours, paired_ratio  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("-r", "--rounds", type=int, default=5)
    ap.add_argument("--compare", choices=("sinks", "layer", "int4attn"), default="sinks")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from lynx_edge import Engine
    from lynx_edge.bench import cpu_isa, synthetic_prompts
    from lynx_edge.models import native_layer
    from lynx_edge.models.layers import Attention
    from lynx_edge.threads import set_threads

    set_threads(a.threads, explicit=True)
    path = write_oss(CACHE / "models/oss-gptoss", OSS_LAYERS)
    out = Path(a.out or ROOT / "benchmarks/results" / {"sinks": "oss_sinks.json", "layer": "oss_layer_call.json",
                                                        "int4attn": "oss_int4attn.json"}[a.compare])
    if a.compare == "int4attn":
        return compare_int4_attn(path, out, a)
    if a.compare == "sinks":
        native = Attention._decode_native
        paths = {"native": lambda: setattr(Attention, "_decode_native", native),
                 "torch": lambda: setattr(Attention, "_decode_native", lambda self, x, ab, kv: None)}
    else:
        paths = {"layer_call": lambda: setattr(native_layer, "NATIVE_LAYERS", True),
                 "module_path": lambda: setattr(native_layer, "NATIVE_LAYERS", False)}
    new, old = paths  # the path measured, the one it is measured against
    rows = []
    for B in (int(b) for b in a.batch.split(",")):
        eng = Engine.from_pretrained(path, device="cpu", max_num_seqs=B, dtype="bfloat16")
        prompts = synthetic_prompts(eng, B, 8 if B == 1 else 16)
        tok_s = {k: [] for k in paths}
        try:
            for r in range(a.rounds + 1):  # round 0: warm-up
                for k, use in paths.items():
                    use()
                    v = ours(eng, prompts, 32 if r else 4, "off")
                    if r:
                        tok_s[k].append(v)
        finally:
            paths[new]()
        row = {"batch": B, "threads": a.threads, "compare": a.compare,
               "tok_s": {k: round(statistics.median(v), 2) for k, v in tok_s.items()},
               f"{new}_vs_{old}": round(statistics.median(n / t for n, t in zip(tok_s[new], tok_s[old])), 3)}
        rows.append(row)
        print(row, flush=True)
        del eng
    append_run(out, {"benchmark": __doc__.split("\n")[0], "isa": cpu_isa(), "rounds": a.rounds,
                     "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows})


def compare_int4_attn(path: Path, out: Path, a) -> None:
    from lynx_edge import Engine
    from lynx_edge.bench import cpu_isa, synthetic_prompts

    batches = [int(b) for b in a.batch.split(",")]
    engines = {k: Engine.from_pretrained(path, device="cpu", max_num_seqs=max(batches), dtype="bfloat16",
                                         int4_attn=k == "int4_attn") for k in ("bf16_attn", "int4_attn")}
    rows = []
    for B in batches:
        tok_s = engines_ab(engines, synthetic_prompts(engines["bf16_attn"], B, 8 if B == 1 else 16), a.rounds, 32)
        row = {"batch": B, "threads": a.threads, "compare": a.compare,
               "tok_s": {k: round(statistics.median(v), 2) for k, v in tok_s.items()},
               "int4_attn_vs_bf16_attn": paired_ratio(tok_s["int4_attn"], tok_s["bf16_attn"])}
        rows.append(row)
        print(row, flush=True)
    append_run(out, {"benchmark": "oss_sinks.py --compare int4attn", "isa": cpu_isa(), "rounds": a.rounds,
                     "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows})


if __name__ == "__main__":
    main()
