"""Native dense rows (dense_tile in kernels/cpu_native.c: fp32 / bf16 projections, the head, the
stacked experts): this tree's build against another revision's, in one process, alternating rounds.

Two parts:
- `lynx_linear` alone on one thread at the demo's shapes (its 4096-row head and 512-row q/k/v/o
  inputs of 256) and Qwen3-30B-A3B's (hidden 2048, expert intermediate 768), T = 1, 2, 3, 4, 16
  tokens, fp32 and bf16 weights; the output's largest difference to float64, relative to its
  largest value, for both builds;
- the demo (or `--model`) end to end (Engine, greedy, prompts of 128, 32 decode tokens) at B = 1, 4
  and 16, LYNX off and on: TPOT with each build, and LYNX's speed-up with each (median of paired
  ratios).

    python benchmarks/dense_tiles.py --base HEAD~1 [-r 15] [--threads 2]   # → results/dense_tiles.json
    python benchmarks/dense_tiles.py --base HEAD~1 --skip-linear --model mixtral --dtype float32,bfloat16 \
        --batch 1,16 --threads 1 --out benchmarks/results/dense_prefetch.json   # vs_transformers.py's model
    LYNX_EDGE_NATIVE_ARCH=haswell python benchmarks/dense_tiles.py ...    # the AVX2 build
    python benchmarks/dense_tiles.py --base HEAD~1 --skip-linear --pad 8192 --batch 1,4,16 --threads 1  # padded demo
    python benchmarks/dense_tiles.py --base HEAD~1 --skip-linear --model CKPT_4BIT --dtype bfloat16 --int4-act q8
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from native_ab import Builds, alternate, append_run, paired, parser  # noqa: E402  (beside this script)

LINEAR = [  # name, K (inputs), N (rows)
    ("demo head", 256, 4096), ("demo q/k/v", 256, 512),
    ("Qwen3-30B-A3B expert gate/up", 2048, 768), ("Qwen3-30B-A3B o_proj", 4096, 2048)]
TOKENS = (1, 2, 3, 4, 16)


def _paired(base: list, tree: list) -> dict:
    return {k: round(v, 3) for k, v in paired(base, tree).items()}


def linear_rows(builds, rounds: int, tokens: tuple = TOKENS, dtypes: tuple = (torch.float32, torch.bfloat16),
                shapes: list = LINEAR) -> list:
    from lynx_edge.kernels import native

    torch.set_num_threads(1)
    rows = []
    for dt in dtypes:
        for name, K, N in shapes:
            g = torch.Generator().manual_seed(0)
            w = torch.randn(N, K, generator=g).to(dt)
            for T in tokens:
                x = torch.randn(T, K, generator=g)
                ref = x.double() @ w.double().T
                err = {}
                for tag in ("base", "tree"):
                    builds.use(tag)
                    err[tag] = float((native.linear(x, w).double() - ref).abs().max() / ref.abs().max())
                t0 = time.perf_counter()
                native.linear(x, w)
                reps = max(1, int(5e-3 / max(1e-6, time.perf_counter() - t0)))
                ms = alternate(builds, rounds, lambda: native.linear(x, w), reps)
                row = {"shape": f"{name} T={T} {str(dt)[6:]}", "base_ms": round(statistics.median(ms["base"]), 4),
                       "tree_ms": round(statistics.median(ms["tree"]), 4), "speedup": _paired(ms["base"], ms["tree"]),
                       "rel_err_base": err["base"], "rel_err_tree": err["tree"]}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def demo_rows(builds, rounds: int, threads: int, model: str = "demo", dtype: str | None = None,
              batches: tuple = (1, 4, 16), int4_act: str | None = None, int8_head: bool = False, pad: int = 0,
              streamed: bool | None = None) -> list:
    from lynx_edge import Engine
    from lynx_edge.bench import measure, synthetic_prompts
    from lynx_edge.threads import set_threads

    set_threads(threads, explicit=True)
    if model == "mixtral":  # vs_transformers.py's checkpoint: 8 layers, D=512, 8 experts top-2, I=1024
        import tempfile

        from vs_transformers import make_checkpoint  # beside this script

        model = str(make_checkpoint(Path(tempfile.mkdtemp()) / "mixtral-8l-512"))
        set_threads(threads, explicit=True)  # importing the tests' conftest set torch's threads
    eng = Engine.from_pretrained(model, device="cpu", dtype=dtype, max_num_seqs=16, int4_act=int4_act, int8_head=int8_head)
    if pad:  # lynx_cpu.py's zero-padded experts: the same outputs, experts from DRAM
        from lynx_cpu import pad_experts  # beside this script

        pad_experts(eng, pad)
    if streamed is not None:  # the experts' read order forced (default: the builder's cache rule)
        for layer in eng.model.layers:
            if layer.is_moe:
                layer.mlp.experts.streamed = streamed
    rows = []
    for B in batches:
        prompts = synthetic_prompts(eng, B, 128)
        modes = ("off", "lynx") if B > 1 else ("off",)
        tp = {(tag, m): [] for tag in ("base", "tree") for m in modes}
        for r in range(rounds):
            for tag in (("base", "tree") if r % 2 == 0 else ("tree", "base")):
                builds.use(tag)
                for m in (modes if r % 2 == 0 else modes[::-1]):
                    eng.set_lynx(m)
                    tp[(tag, m)].append(measure(eng, prompts, 32)["tpot_ms"])
        row = {"model": Path(model).name, "dtype": str(eng.model.embed_tokens.dtype)[6:], "batch": B,
               "threads": threads, "int4_act": int4_act, "int8_head": int8_head, "pad": pad,
               "streamed": next((getattr(layer.mlp.experts, "streamed", None) for layer in eng.model.layers
                                 if layer.is_moe), None)}  # 16-bit experts only
        for m in modes:
            row[m] = {"base_tpot_ms": round(statistics.median(tp[("base", m)]), 4),
                      "tree_tpot_ms": round(statistics.median(tp[("tree", m)]), 4),
                      "speedup": _paired(tp[("base", m)], tp[("tree", m)])}
        if B > 1:
            for tag in ("base", "tree"):
                row[f"lynx_speedup_{tag}"] = _paired(tp[(tag, "off")], tp[(tag, "lynx")])
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = parser("dense_tiles.json", rounds=15)
    ap.add_argument("--threads", type=int, default=2, help="threads for the end-to-end part")
    ap.add_argument("--skip-linear", action="store_true")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="tokens per call in the lynx_linear part")
    ap.add_argument("--linear-dtypes", default="float32,bfloat16")
    ap.add_argument("--linear-shapes", default=None, help="comma-separated names' prefixes (e.g. 'demo'); default: all")
    ap.add_argument("--model", default="demo", help="the end-to-end model: demo, mixtral (vs_transformers.py's), or a path")
    ap.add_argument("--dtype", default=None, help="comma-separated dtypes for the end-to-end part (default: the CPU default)")
    ap.add_argument("--batch", default="1,4,16")
    ap.add_argument("--int4-act", default=None, choices=("f32", "q16", "q8"),
                    help="activations of a 4-bit checkpoint's rows (--model PATH): lynx-edge's --int4-act")
    ap.add_argument("--int8-head", action="store_true", help="lynx-edge's --int8-head")
    ap.add_argument("--pad", type=int, default=0, help="zero-pad the experts to this intermediate size (lynx_cpu.py)")
    ap.add_argument("--streamed", default=None, choices=("on", "off"),
                    help="force the experts' read order (default: the builder's last-level-cache rule)")
    a = ap.parse_args()
    builds = Builds(a.base, "dense_tiles")
    run = builds.header("native dense rows, this tree vs --base (same process, alternating rounds)", a.rounds)
    if not a.skip_linear:
        shapes = [s for s in LINEAR if not a.linear_shapes or any(s[0].startswith(p) for p in a.linear_shapes.split(","))]
        run["linear_1_thread"] = linear_rows(builds, a.rounds, tuple(int(t) for t in a.tokens.split(",")),
                                             tuple(getattr(torch, d) for d in a.linear_dtypes.split(",")), shapes)
    run["demo_end_to_end"] = [row for dt in (a.dtype or "").split(",") for row in demo_rows(
        builds, a.rounds, a.threads, a.model, dt or None, tuple(int(b) for b in a.batch.split(",")), a.int4_act,
        a.int8_head, a.pad, None if a.streamed is None else a.streamed == "on")]
    append_run(Path(a.out), run)


if __name__ == "__main__":
    main()
