"""lynx-edge vs transformers `generate`: CPU decode tok/s on the same random MoE checkpoint.

Both run in this one process, side by side, on a Mixtral-style checkpoint written by
transformers (8 layers, hidden 512, 8 experts top-2, random weights). Decode time is measured the
same way for both: time(prompt → 1 + n tokens) − time(prompt → 1 token), median over repeats.

    python benchmarks/vs_transformers.py [--batch 1,16] [--dtype float32,bfloat16] [--new 32] [--repeats 3]

Each dtype is run by both on weights of that dtype (bfloat16: how checkpoints are published and
what a user's RAM holds; float32: lynx-edge's CPU default for checkpoints up to 2 GiB).

Decode of this model is bound by the weights it reads, so each row also gives the bytes of weights
one decode step reads (attention, routers, norms and head, plus the experts the step's routing hit,
counted from lynx-edge's routing telemetry — the same exact top-k as transformers'), each side's
weight-read rate, and the machine's streaming read rate at the same threads (a 1 GiB fp32 sum):
`ceiling` = that rate / transformers' rate is the largest speed-up any engine reading the same
bytes from DRAM could show (caches can hold part of a small model, so it is approximate).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def make_checkpoint(path: Path) -> Path:
    from conftest import make_tiny  # the tests' checkpoint writer: transformers' save_pretrained

    return make_tiny(path, "mixtral", hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                     num_key_value_heads=4, intermediate_size=1024, num_local_experts=8, vocab_size=8192,
                     max_position_embeddings=1024)


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def read_gbps(repeats: int = 5) -> float:
    """The machine's streaming read rate at the current torch threads: a sum over 1 GiB of fp32."""
    x = torch.ones(1 << 28)
    return x.numel() * 4 / timed(lambda: x.sum(), repeats) / 1e9


def step_bytes(eng, unique_per_layer: float) -> float:
    """Bytes of weights one decode step reads: everything but the embedding table (one row) and the
    routed experts, plus unique_per_layer experts of every MoE layer."""
    from lynx_edge.modelinfo import param_counts

    cfg, es = eng.cfg, eng.model.embed_tokens.element_size()
    c = param_counts(cfg)
    return es * (c["non_expert"] - cfg.vocab_size * cfg.hidden_size
                 + c["moe_layers"] * unique_per_layer * c["params_per_expert"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=None, help="default: lynx_edge.threads (idle cores)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/vs_transformers.json"))
    args = ap.parse_args()
    from lynx_edge.bench import cpu_isa, measure
    from lynx_edge.threads import set_threads

    args.threads = set_threads(args.threads, explicit=True)  # the Engine keeps it; recorded with the ISA
    import transformers

    from lynx_edge import Engine

    ckpt = make_checkpoint(Path(tempfile.mkdtemp()) / "mixtral-8l-512")
    set_threads(args.threads)  # importing the tests' conftest set torch's threads to 2
    bandwidth = read_gbps()
    rows = []
    for dtype in args.dtype.split(","):
        hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dtype)).eval()
        eng = Engine.from_pretrained(ckpt, device="cpu", dtype=dtype)
        for B in [int(b) for b in args.batch.split(",")]:
            g = torch.Generator().manual_seed(B)
            prompts = torch.randint(10, 8000, (B, args.prompt), generator=g)

            def hf_run(n):
                with torch.inference_mode():
                    hf.generate(prompts, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

            def ours_run(n):
                eng.generate_batch([p.tolist() for p in prompts], max_new_tokens=n, ignore_eos=True)

            res = {"dtype": dtype, "batch": B}
            for name, run in (("transformers", hf_run), ("lynx_edge", ours_run)):
                t1 = timed(lambda: run(1), args.repeats)
                tn = timed(lambda: run(1 + args.new), args.repeats)
                res[f"{name}_decode_tok_s"] = B * args.new / max(tn - t1, 1e-9)
            res["speedup"] = res["lynx_edge_decode_tok_s"] / res["transformers_decode_tok_s"]
            eng.model.routing.stats.record = True  # routing telemetry for one more run, off while timed
            unique = measure(eng, [p.tolist() for p in prompts], 1 + args.new)["unique_experts_per_layer"]
            eng.model.routing.stats.record = False
            nbytes = step_bytes(eng, unique)
            res |= {"unique_experts_per_layer": unique, "weights_mb_per_step": nbytes / 1e6,
                    "stream_read_gb_s": bandwidth}
            for name in ("transformers", "lynx_edge"):
                res[f"{name}_weights_gb_s"] = nbytes * res[f"{name}_decode_tok_s"] / B / 1e9
            res["ceiling"] = bandwidth / res["transformers_weights_gb_s"]
            rows.append(res)
            print(json.dumps(res), flush=True)
        del hf, eng
    out = {"benchmark": "decode tok/s, lynx-edge vs transformers generate (CPU, same process, same dtype)",
           "model": "mixtral-style random: 8 layers, D=512, 8 experts top-2, I=1024, vocab 8192",
           "transformers": transformers.__version__, "torch": torch.__version__, "threads": args.threads, "isa": cpu_isa(),
           "prompt_tokens": args.prompt, "new_tokens": args.new, "repeats": args.repeats, "results": rows}
    Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
