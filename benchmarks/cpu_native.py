"""The native CPU kernels (lynx_edge/kernels/cpu_native.c) side by side with what they replace.

Per kernel, medians of interleaved rounds in one process (shared machine: read the ratios):
- INT4 MoE layer: numba kernel vs native, weights rotating over ~150 MB of copies (DRAM-bound,
  as in a big model);
- fp32/bf16 MoE layer: torch's grouped GEMM (moe_ref) vs native;
- projections: torch F.linear vs native, fp32/bf16, 1..512 rows (where NATIVE_ROWS comes from);
- decode attention: the module's torch path vs the native one (demo and 1 GB-model shapes);
- whole decode steps: engines with the native kernels off (LYNX_EDGE_NATIVE=0 semantics) vs on.

    python benchmarks/cpu_native.py            # → benchmarks/results/cpu_native.{json,md}
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from lynx_edge.bench import cpu_isa  # noqa: E402
from lynx_edge.kernels import native  # noqa: E402
from lynx_edge.kernels.moe_gemm import moe_ref  # noqa: E402
from lynx_edge.quant import cpu_kernels  # noqa: E402
from lynx_edge.quant.int4 import Int4Layout  # noqa: E402


def med(fns: dict, rounds: int, reps: int = 5) -> dict[str, float]:
    """Median seconds per call of each fn, the fns alternating within every round."""
    for f in fns.values():
        f()
    ts = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                f()
            ts[k].append((time.perf_counter() - t0) / reps)
    return {k: statistics.median(v) for k, v in ts.items()}


def _int4_blocks(E, D, I, n_copies, g):
    lay = Int4Layout(D, I, 128, True)
    copies = []
    for _ in range(n_copies):
        c = torch.randint(0, 256, (E, lay.nbytes), dtype=torch.uint8, generator=g)
        for name in ("gu_s", "dn_s"):
            off, shape, _ = lay.parts()[name]
            n = shape[0] * shape[1]
            c[:, off:off + 2 * n] = torch.full((E, n), 0.01, dtype=torch.float16).view(torch.uint8).view(E, -1)
        copies.append(c)
    return lay, copies


def bench_kernels(rounds: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for th in (1, 2):
        torch.set_num_threads(th)
        # INT4 MoE layer, the 1 GB random model's shape (E=32, D=1024, I=768, K=4), cold weights
        E, D, I, K = 32, 1024, 768, 4
        lay, copies = _int4_blocks(E, D, I, 4, g)
        for T in (1, 4, 16):
            x = torch.randn(T, D, generator=g)
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
            w = torch.rand(T, K, generator=g)
            it = iter(range(10**9))
            fns = {k: (lambda k=k: cpu_kernels.moe_int4_blocks(x, ids, w, copies[next(it) % 4], lay, kernel=k))
                   for k in ("numba", "native")}
            m = med(fns, rounds)
            gb = len(set(ids.flatten().tolist())) * lay.nbytes / 1e9
            rows.append(dict(kernel="int4 MoE layer", shape=f"E{E} D{D} I{I} K{K}", dtype="int4 g128", threads=th,
                             rows=T, base="numba", base_ms=m["numba"] * 1e3, native_ms=m["native"] * 1e3,
                             native_gb_s=gb / m["native"]))
        # fp32/bf16 MoE layers: the demo's shape and the random model's
        for (E, D, I), dt in [((32, 256, 128), torch.float32), ((32, 1024, 768), torch.float32),
                              ((32, 1024, 768), torch.bfloat16)]:
            n = 3 if D > 256 else 1
            ws = [((torch.randn(E, 2 * I, D, generator=g) * 0.05).to(dt), (torch.randn(E, D, I, generator=g) * 0.05).to(dt))
                  for _ in range(n)]
            for T in (1, 16, 64):
                x = torch.randn(T, D, generator=g).to(dt)
                ids = torch.stack([torch.randperm(E, generator=g)[:4] for _ in range(T)])
                w = torch.rand(T, 4, generator=g)
                it = iter(range(10**9))
                fns = {"torch": lambda: moe_ref(x, ids, w, *ws[next(it) % n]),
                       "native": lambda: native.moe_dense(x, ids, w, *ws[next(it) % n])}
                m = med(fns, rounds)
                rows.append(dict(kernel="MoE layer", shape=f"E{E} D{D} I{I} K4", dtype=str(dt)[6:], threads=th, rows=T,
                                 base="torch moe_ref", base_ms=m["torch"] * 1e3, native_ms=m["native"] * 1e3))
        # projections
        for dt in (torch.float32, torch.bfloat16):
            W = torch.randn(3072, 1024, generator=g).to(dt)
            for T in (1, 4, 16, 128, 512):
                x = torch.randn(T, 1024, generator=g).to(dt)
                m = med({"torch": lambda: F.linear(x, W), "native": lambda: native.linear(x, W)}, rounds)
                rows.append(dict(kernel="projection", shape="3072x1024", dtype=str(dt)[6:], threads=th, rows=T,
                                 base="torch F.linear", base_ms=m["torch"] * 1e3, native_ms=m["native"] * 1e3))
    return rows


def bench_engines(rounds: int, models: list[str]) -> list[dict]:
    from lynx_edge import Engine
    from lynx_edge.bench import measure, synthetic_prompts
    from lynx_edge.threads import set_threads

    out = []
    for model in models:
        for dt in ("float32", "bfloat16"):
            eng = Engine.from_pretrained(model, device="cpu", max_num_seqs=16, dtype=dt)
            for th in (1, 2):
                set_threads(th, explicit=True)
                for B in (1, 16):
                    p = synthetic_prompts(eng, B, 16)
                    res = {"off": [], "on": []}
                    for mode in ("off", "on", "off", "on"):  # warm both
                        _toggle(mode == "on")
                        measure(eng, p, 3)
                    for _ in range(rounds):
                        for mode in ("off", "on"):
                            _toggle(mode == "on")
                            res[mode].append(float(measure(eng, p, 17)["decode_tok_s"]))
                    _toggle(True)
                    m = {k: statistics.median(v) for k, v in res.items()}
                    out.append(dict(model=Path(model).name if model != "demo" else "demo", dtype=dt, threads=th,
                                    batch=B, torch_tok_s=m["off"], native_tok_s=m["on"], ratio=m["on"] / m["off"]))
                    print(out[-1], flush=True)
            del eng
    return out


def _toggle(on: bool) -> None:
    """Native kernels on/off in this process (what LYNX_EDGE_NATIVE=0 does at start-up)."""
    os.environ["LYNX_EDGE_NATIVE"] = "1" if on else "0"
    native.lib.cache_clear()


def to_markdown(res: dict) -> str:
    md = [f"# Native CPU kernels vs what they replace ({res['cpu_isa']}; {res['cores']} cores; torch {res['torch']})", "",
          "Medians of interleaved rounds in one process; ratio = baseline time / native time (> 1: native faster). "
          "INT4 weights rotate over ~150 MB of copies (DRAM-bound). `python benchmarks/cpu_native.py`.", "",
          "## Kernels", "", "| kernel | shape | dtype | threads | rows | baseline | baseline ms | native ms | ratio |",
          "|---|---|---|---|---|---|---|---|---|"]
    for r in res["kernels"]:
        extra = f" ({r['native_gb_s']:.1f} GB/s)" if "native_gb_s" in r else ""
        md.append(f"| {r['kernel']} | {r['shape']} | {r['dtype']} | {r['threads']} | {r['rows']} | {r['base']} | "
                  f"{r['base_ms']:.3f} | {r['native_ms']:.3f}{extra} | {r['base_ms'] / r['native_ms']:.2f}× |")
    md += ["", "## Decode steps (aggregate decode tok/s, 16-token prompts, 17 steps)", "",
           "| model | dtype | threads | B | torch paths | native kernels | ratio |", "|---|---|---|---|---|---|---|"]
    for r in res["engines"]:
        md.append(f"| {r['model']} | {r['dtype']} | {r['threads']} | {r['batch']} | {r['torch_tok_s']:.1f} | "
                  f"{r['native_tok_s']:.1f} | {r['ratio']:.2f}× |")
    return "\n".join(md) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-r", "--rounds", type=int, default=5)
    ap.add_argument("--models", default="demo", help="comma list: demo and/or checkpoint paths")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/cpu_native.json"))
    args = ap.parse_args()
    if native.lib() is None:
        sys.exit("the native kernels did not build here (no C compiler?)")
    res = dict(cpu_isa=cpu_isa(), cores=os.cpu_count(), torch=torch.__version__,
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), loadavg_start=os.getloadavg())
    res["kernels"] = bench_kernels(args.rounds)
    res["engines"] = bench_engines(args.rounds, args.models.split(","))
    res["loadavg_end"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(res, indent=1))
    Path(args.out).with_suffix(".md").write_text(to_markdown(res))
    print(to_markdown(res))


if __name__ == "__main__":
    main()
