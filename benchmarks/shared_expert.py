"""Qwen2-MoE's shared expert inside the native layer call (issue 16), at Qwen1.5-MoE-A2.7B's shapes.

A random qwen2_moe checkpoint of Qwen1.5-MoE-A2.7B's layer shapes (hidden 2048, 16 heads of 128 with
q/k/v biases, 60 experts of 1408 top-4, a sigmoid-gated shared expert of 5632) in 2 of its 24
layers, bf16, the tests' 4096-token vocabulary — written once by transformers (~20 s, 2.3 GB). Decode
TPOT, three ways alternating in one process:
- `layer call`: the whole layer in native calls, the shared expert inside (lynx_shared_expert);
- `module, shared native`: the module path, its shared expert one native call (the same kernel);
- `module, shared torch (before)`: the module path with the shared expert as torch ops (three
  projections, silu, mul, sigmoid, each rounded to bf16), as every shared-expert layer ran before.

    python benchmarks/shared_expert.py [--threads 1] [--batch 1,16] [-r 7] [--int4] [--out FILE]

--int4: the routed experts, attention and shared expert 4-bit (RTN at load: --int4 --int4-attn), as a
published GPTQ checkpoint holds them.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def make_checkpoint(path: Path) -> Path:
    from conftest import make_tiny  # the tests' checkpoint writer: transformers' save_pretrained

    if (path / "config.json").is_file():
        return path
    return make_tiny(path, "qwen2_moe", dtype=torch.bfloat16, hidden_size=2048, num_hidden_layers=2,
                     num_attention_heads=16, num_key_value_heads=16, moe_intermediate_size=1408,
                     shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4,
                     intermediate_size=5632, max_position_embeddings=4096)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("-r", "--rounds", type=int, default=7)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: written to a temporary one)")
    ap.add_argument("--int4", action="store_true",
                    help="4-bit: routed experts (--int4) and attention / shared expert (--int4-attn), RTN at load")
    ap.add_argument("--out", default=None, help="JSON file for the rows (default: print only)")
    a = ap.parse_args()
    from lynx_edge import Engine
    from lynx_edge.bench import measure, synthetic_prompts
    from lynx_edge.models import native_layer
    from lynx_edge.models.layers import MoEBlock
    from lynx_edge.threads import set_threads

    path = make_checkpoint(Path(a.model) if a.model else Path(tempfile.mkdtemp()) / "qwen15-moe-2l")
    set_threads(a.threads, explicit=True)  # importing the tests' conftest set torch's threads
    sizes = [int(b) for b in a.batch.split(",")]
    quant = dict(int4=True, int4_attn=True) if a.int4 else {}
    eng = Engine.from_pretrained(str(path), device="cpu", dtype="bfloat16", max_num_seqs=max(sizes), **quant)
    real = MoEBlock.native_shared
    variants = {"layer call": (True, real), "module, shared native": (False, real),
                "module, shared torch (before)": (False, lambda self: None)}
    rows = []
    for B in sizes:
        prompts = synthetic_prompts(eng, B, 16)
        tp = {k: [] for k in variants}
        for r in range(a.rounds):
            for k, (layer_call, shared) in (variants.items() if r % 2 == 0 else reversed(list(variants.items()))):
                native_layer.NATIVE_LAYERS, MoEBlock.native_shared = layer_call, shared
                for layer in eng.model.layers:
                    layer._native = None  # decided again under this variant
                tp[k].append(measure(eng, prompts, 17)["tpot_ms"])
        native_layer.NATIVE_LAYERS, MoEBlock.native_shared = True, real
        before = tp["module, shared torch (before)"]
        row = {"batch": B, "threads": a.threads,
               "tpot_ms": {k: round(statistics.median(v), 3) for k, v in tp.items()},
               "speedup_vs_before": {k: round(statistics.median([b / t for t, b in zip(v, before)]), 3)
                                     for k, v in tp.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"model": "qwen2_moe, Qwen1.5-MoE-A2.7B layer shapes, 2 layers, bf16",
                                           "int4": a.int4,
                                           "rounds": a.rounds, "torch": torch.__version__,
                                           "isa": torch.backends.cpu.get_cpu_capability(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
