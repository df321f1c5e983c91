"""OLMoE CPU decode: the native layer call (q/k norm over all heads and clip_qkv in lynx_qk_full,
then the native attention) against the torch attention it replaced (module path: the norms, clip,
RoPE, KV write and SDPA as torch ops), in one process, the two alternating round by round.

The checkpoint is written by transformers at OLMoE-1B-7B's widths (hidden 2048, 16 heads of 128,
64 experts of 1024, top-8, vocabulary 50304) with fewer layers (default 2, random weights), bf16 as
published. Both paths give the same greedy tokens (checked); TPOT is the engine's streaming call
(bench.measure's), median over rounds.

    python benchmarks/olmoe_decode.py [--layers 2] [--batch 1,16] [--threads 1] [-r 5]
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


def make_checkpoint(path: Path, layers: int) -> Path:
    from conftest import make_tiny  # the tests' writer: transformers' save_pretrained

    return make_tiny(path, "olmoe", dtype=torch.bfloat16, hidden_size=2048, num_hidden_layers=layers,
                     num_attention_heads=16, num_key_value_heads=16, intermediate_size=1024, num_experts=64,
                     num_experts_per_tok=8, vocab_size=50304, max_position_embeddings=4096)


def use_torch_attention(eng, on: bool) -> None:
    """on: every layer runs the module path with torch attention (what OLMoE ran before
    lynx_qk_full); off: the native layer call. The next decode step rebuilds what it needs."""
    for layer in eng.model.layers:
        layer._native = False if on else None
        layer.self_attn._native_decode = False if on else None


def run(eng, prompts, new: int):
    toks, last = [[] for _ in prompts], None
    for c in eng.stream_batch(prompts, max_new_tokens=new, ignore_eos=True):
        toks[c.index] += c.token_ids
        last = c if c.stats else last
    return toks, last.stats["tpot_ms"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("-r", "--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/olmoe_decode.json"))
    args = ap.parse_args()
    from lynx_edge.bench import cpu_isa
    from lynx_edge.threads import set_threads

    threads = set_threads(args.threads, explicit=True)
    from lynx_edge import Engine

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(Path(tmp) / "olmoe", args.layers)
        for B in [int(b) for b in args.batch.split(",")]:
            eng = Engine.from_pretrained(path, device="cpu", max_num_seqs=B)
            g = torch.Generator().manual_seed(B)
            prompts = [torch.randint(10, 50000, (args.prompt,), generator=g).tolist() for _ in range(B)]
            tp = {"native": [], "torch_attention": []}
            toks = {}
            for r in range(args.rounds + 1):  # round 0 warms both up
                for mode in tp:
                    use_torch_attention(eng, mode == "torch_attention")
                    toks[mode], ms = run(eng, prompts, args.new)
                    if r:
                        tp[mode].append(ms)
            native_ran = all(type(layer._native).__name__ == "NativeLayer" for layer in eng.model.layers)
            use_torch_attention(eng, False)
            toks["native"], _ = run(eng, prompts, args.new)
            native_ran = native_ran or all(type(layer._native).__name__ == "NativeLayer" for layer in eng.model.layers)
            row = {"batch": B, "tpot_ms": {m: statistics.median(v) for m, v in tp.items()},
                   "tpot_all": tp, "native_layer_ran": native_ran,
                   "same_greedy_tokens": toks["native"] == toks["torch_attention"]}
            row["speedup"] = row["tpot_ms"]["torch_attention"] / row["tpot_ms"]["native"]
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "tpot_all"}), flush=True)
            del eng
    out = {"benchmark": "OLMoE decode TPOT: native layer call vs torch attention (module path), alternating",
           "model": f"random OLMoE, OLMoE-1B-7B widths, {args.layers} layers, bf16", "threads": threads,
           "isa": cpu_isa(), "prompt_tokens": args.prompt, "new_tokens": args.new, "rounds": args.rounds,
           "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
