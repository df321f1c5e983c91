"""Device check of the MoE GEMM kernels: correctness against the torch references (bf16) and
effective bandwidth against a read ceiling measured in the same run, one MoE layer at the
Mixtral-8x7B (D 4096, I 14336, E 8, K 2) and Qwen3-30B-A3B (D 2048, I 768, E 128, K 8) shapes.

    PYTHONPATH=. python scripts/gpu_kernels_bench.py --out "$OUT"    # CUDA (H200: torch 2.11, Triton 3.6)
    PYTHONPATH=. python scripts/gpu_kernels_bench.py --dry-run       # CPU smoke test: tiny shapes, torch path

Effective bandwidth = bytes of the active experts' weights (+ INT4 scales/zeros) ÷ time per call,
at T ∈ {1, 8, 16, 64} with uniform random routing; weight copies rotate so the timed bytes come
from HBM, not L2. Times: CUDA-graph replay (no launch overhead) and eager (with it). Routing
time per layer for exact top-k and the LYNX kernel (lynx_route, its arguments from
lynx.kernel_args). Writes kernels_bench.json and kernels_bench.md under --out, after every
section (a timeout still leaves the finished parts); --budget-s stops starting new sections once
that much time has passed (each T and format costs a few JIT compiles). Installs nothing. Glossary: T tokens, D hidden, E experts,
K top-k, I expert intermediate, C weight copies.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
import traceback
from pathlib import Path

import torch

from lynx_edge.kernels.moe_gemm import fused_moe, fused_moe_int4, moe_ref
from lynx_edge.quant.int4 import Int4Experts, int4_moe_ref, quantize_experts

SHAPES = {"mixtral-8x7b": (4096, 14336, 8, 2), "qwen3-30b-a3b": (2048, 768, 128, 8)}  # D, I, E, K
DRY_SHAPES = {"tiny-coarse": (128, 256, 8, 2), "tiny-fine": (64, 64, 16, 4)}
TOKENS = [1, 8, 16, 64]  # --tokens


class Clock:
    """Wall time per call: CUDA events on GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn, n: int) -> float:
        """Seconds per fn() over n back-to-back calls (after one warm-up call)."""
        fn()
        self.sync()
        if not self.cuda:
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            return (time.perf_counter() - t0) / n
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / n

    def time_graph(self, fns: list, replays: int) -> float:
        """Seconds per call of fns captured back to back in one CUDA graph (no launch overhead)."""
        for f in fns:
            f()
        self.sync()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for f in fns:
                f()
        return self.time(graph.replay, replays) / len(fns)



LYNX = "lynx"  # time the LYNX path (mode off would time plain top-k)


def read_ceiling(device: torch.device, clock: Clock) -> dict:
    """Read-only bandwidth of a buffer > L2 (a fp32-accumulating sum reads every byte once) and
    copy bandwidth (read + write), bytes/s."""
    nbytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    buf = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(buf)
    t_read = clock.time(lambda: buf.view(-1, 8192).sum(dim=1, dtype=torch.float32), 20)
    t_copy = clock.time(lambda: dst.copy_(buf), 20)
    out = {"buffer_bytes": nbytes, "read_Bps": nbytes / t_read, "copy_Bps": 2 * nbytes / t_copy}
    out["ceiling_Bps"] = max(out["read_Bps"], out["copy_Bps"])
    del buf, dst
    return out


def make_layer(D, I, E, device, seed) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 gate_up [E, 2I, D], down [E, D, I] with N(0, 1/fan-in) entries."""
    g = torch.Generator(device=device).manual_seed(seed)
    gu = torch.randn(E, 2 * I, D, generator=g, device=device).div_(D**0.5).bfloat16()
    dn = torch.randn(E, D, I, generator=g, device=device).div_(I**0.5).bfloat16()
    return gu, dn


def make_routing(T, K, E, device, seed) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, K] distinct per token (uniform), weights [T, K] fp32 summing to 1."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    return ids.to(device), w.to(device)


def int4_bytes_per_expert(p: Int4Experts) -> int:
    """Bytes the kernels read for one expert: packed weights + scales (+ zeros), no padding."""
    return sum(math.prod(shape) * dt.itemsize for _off, shape, dt in p.layout.parts().values())


def errors(y: torch.Tensor, ref: torch.Tensor) -> dict:
    """bf16 tolerances of tests/test_moe_kernels.py: max error < 6e-2 of the output scale, mean
    relative error < 2e-2 (the bf16 reference itself rounds h and silu to bf16)."""
    d = (y.float() - ref.float()).abs()
    max_abs, mean_rel = d.max().item(), (d.mean() / ref.float().abs().mean()).item()
    ok = max_abs < 6e-2 * max(1.0, ref.float().abs().max().item()) and mean_rel < 2e-2
    return {"max_abs": max_abs, "mean_rel": mean_rel, "ok": bool(ok)}


def check_shape(name, shape, device, clock, dry) -> dict:
    """Correctness and bandwidth of fused_moe / fused_moe_int4 for one layer shape."""
    D, I, E, K = shape
    gu, dn = make_layer(D, I, E, device, 0)
    packed = quantize_experts(gu, dn, 128 if not dry else 32, sym=True)
    res = {"shape": dict(D=D, I=I, E=E, K=K), "correctness": [], "bandwidth": []}
    for T in TOKENS:  # correctness against the torch references, bf16
        x = torch.randn(T, D, device=device, generator=torch.Generator(device=device).manual_seed(T)).bfloat16()
        ids, w = make_routing(T, K, E, device, T)
        res["correctness"].append({
            "T": T, "bf16": errors(fused_moe(x, ids, w, gu, dn), moe_ref(x, ids, w, gu, dn)),
            "int4": errors(fused_moe_int4(x, ids, w, packed), int4_moe_ref(x, ids, w, packed)),
        })
    try:
        res["lynx_layer"] = lynx_layer(packed, shape, device, clock)
    except Exception as e:
        res["lynx_layer"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 60 << 20) if clock.cuda else 0
    expert_bytes = {"bf16": 3 * I * D * 2, "int4": int4_bytes_per_expert(packed)}
    for fmt in ("bf16", "int4"):
        # enough weight copies that one graph's calls touch ≥ 4×L2 of distinct bytes at T = 1
        active1 = min(K, E) * expert_bytes[fmt]
        copies = 1 if not clock.cuda else max(1, min(16, math.ceil(4 * l2 / active1)))
        layers = [(gu, dn) if fmt == "bf16" else packed]
        for c in range(1, copies):
            layers.append(make_layer(D, I, E, device, c) if fmt == "bf16" else
                          Int4Experts(packed.data.clone(), packed.layout))
        for T in TOKENS:
            res["bandwidth"].append(bench_one(fmt, layers, T, D, E, K, expert_bytes[fmt], device, clock))
            print(f"{name:14s} {fmt:4s} T={T:3d} {res['bandwidth'][-1]}", flush=True)
        del layers
    return res


def bench_one(fmt, layers, T, D, E, K, expert_bytes, device, clock) -> dict:
    """Time one MoE call per weight copy, each with its own routing."""
    calls, nbytes = [], 0
    for c, layer in enumerate(layers):
        x = torch.randn(T, D, device=device).bfloat16()
        ids, w = make_routing(T, K, E, device, 1000 * T + c)
        nbytes += len(set(ids.flatten().tolist())) * expert_bytes
        if fmt == "bf16":
            calls.append(lambda x=x, ids=ids, w=w, l=layer: fused_moe(x, ids, w, *l))
        else:
            calls.append(lambda x=x, ids=ids, w=w, l=layer: fused_moe_int4(x, ids, w, l))
    n = len(calls)
    out = {"fmt": fmt, "T": T, "copies": n, "bytes_per_call": nbytes / n}
    it = iter(range(1 << 62))
    rotate = lambda: calls[next(it) % n]()  # noqa: E731
    out["eager_s"] = clock.time(rotate, max(n, 20))
    out["eager_Bps"] = out["bytes_per_call"] / out["eager_s"]
    if clock.cuda:
        try:
            out["graph_s"] = clock.time_graph(calls, max(3, 60 // n))
            out["graph_Bps"] = out["bytes_per_call"] / out["graph_s"]
        except Exception as e:  # a host sync in the launch path makes capture fail
            out["graph_error"] = f"{type(e).__name__}: {e}"[:300]
    return out


def lynx_layer(packed, shape, device, clock) -> dict:
    """Route with lynx_route (if present) and feed its expert-major table to fused_moe_int4:
    same output as without the table; time of route + GEMM as one CUDA graph."""
    from lynx_edge.kernels import lynx_route as lr
    from lynx_edge.lynx import LynxConfig, kernel_args
    from lynx_edge.routing import RouterSpec

    D, _I, E, K = shape
    spec, out = RouterSpec(num_experts=E, top_k=K, norm_topk_prob=True), {}
    if not lr.available(device):
        return {"lynx_route": "not available on this device"}
    args = kernel_args(spec, LynxConfig.parse(LYNX))
    for T in TOKENS:
        x = torch.randn(T, D, device=device).bfloat16()
        logits, isd = torch.randn(T, E, device=device) * 2, torch.ones(T, dtype=torch.bool, device=device)

        def layer():
            ids, w, active, counts, table, _stats = lr.lynx_route(logits, isd, **args)
            return fused_moe_int4(x, ids, w, packed, table=lr.gemm_table(active, counts, table, K)), ids, w

        y, ids, w = layer()
        row = {"table_matches": errors(y, fused_moe_int4(x, ids, w, packed))["max_abs"] == 0.0}
        row["route_gemm_s"] = clock.time_graph([layer], 50) if clock.cuda else clock.time(layer, 3)
        out[f"T={T}"] = row
    return out


def routing_times(device, clock) -> dict:
    """Per-layer routing time: exact softmax→top-k (torch) and the LYNX kernel if present."""
    from lynx_edge.kernels import lynx_route as lr
    from lynx_edge.lynx import LynxConfig, kernel_args
    from lynx_edge.routing import RouterSpec, exact_route

    ok = lr.available(device)
    out = {"lynx_route": "present" if ok else "not available on this device"}
    for name, (_D, _I, E, K) in SHAPES.items():
        spec = RouterSpec(num_experts=E, top_k=K, norm_topk_prob=True)
        args = kernel_args(spec, LynxConfig.parse(LYNX))
        for T in TOKENS:
            logits = torch.randn(T, E, device=device)
            is_decode = torch.ones(T, dtype=torch.bool, device=device)
            row = {"exact_s": clock.time(lambda: exact_route(logits, spec), 50)}
            if ok:
                try:
                    route = lambda: lr.lynx_route(logits, is_decode, **args)  # noqa: E731
                    row["lynx_route_s"] = clock.time(route, 50)
                    if clock.cuda:
                        row["lynx_route_graph_s"] = clock.time_graph([route], 50)
                except Exception as e:  # an API this script does not know: record, don't crash
                    row["lynx_route_error"] = f"{type(e).__name__}: {e}"[:300]
            out[f"{name}/T={T}"] = row
    return out


def write(out_dir: Path, res: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "kernels_bench.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    ceil = res.get("ceiling", {}).get("ceiling_Bps")
    lines = [f"# MoE GEMM kernels on {res['device']}", "",
             f"torch {res['torch']}, triton {res['triton']}; read ceiling "
             f"{(ceil or 0) / 1e12:.2f} TB/s (read-only {res.get('ceiling', {}).get('read_Bps', 0) / 1e12:.2f},"
             f" copy {res.get('ceiling', {}).get('copy_Bps', 0) / 1e12:.2f})", "",
             "| shape | fmt | T | MB/call | graph µs | graph TB/s | % ceiling | eager µs | max err ok |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in res.get("shapes", {}).items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'][:80]} |")
            continue
        ok = {c["T"]: (c["bf16"]["ok"], c["int4"]["ok"]) for c in r["correctness"]}
        for b in r["bandwidth"]:
            fmt_i = 0 if b["fmt"] == "bf16" else 1
            g_s, g_bps = b.get("graph_s"), b.get("graph_Bps")
            pct = f"{100 * g_bps / ceil:.0f}%" if g_bps and ceil else "-"
            lines.append(f"| {name} | {b['fmt']} | {b['T']} | {b['bytes_per_call'] / 1e6:.1f} | "
                         f"{g_s * 1e6 if g_s else float('nan'):.1f} | {(g_bps or 0) / 1e12:.2f} | {pct} | "
                         f"{b['eager_s'] * 1e6:.1f} | {ok.get(b['T'], ('?', '?'))[fmt_i]} |")
    (out_dir / "kernels_bench.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_out"))
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, torch reference path")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="decode batch sizes T, e.g. 1,16,64")
    ap.add_argument("--budget-s", type=float, default=None, help="start no new section after this many s")
    args = ap.parse_args()
    TOKENS[:] = [int(t) for t in args.tokens.split(",")]
    t0 = time.perf_counter()
    over = lambda: args.budget_s is not None and time.perf_counter() - t0 > args.budget_s  # noqa: E731
    dry = args.dry_run or not torch.cuda.is_available()
    device = torch.device("cpu" if dry else "cuda")
    clock, out_dir = Clock(device), Path(args.out)
    try:
        import triton
        tv = triton.__version__
    except ImportError:
        tv = None
    res = {"device": "cpu (dry run)" if dry else torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": tv, "dry_run": dry, "shapes": {}}
    res["ceiling"] = read_ceiling(device, clock)
    write(out_dir, res)
    for name, shape in (DRY_SHAPES if dry else SHAPES).items():
        if over():
            res["shapes"][name] = {"error": f"skipped: past --budget-s {args.budget_s}"}
            continue
        try:
            res["shapes"][name] = check_shape(name, shape, device, clock, dry)
        except Exception as e:
            traceback.print_exc()
            res["shapes"][name] = {"error": f"{type(e).__name__}: {e}"[:500]}
        write(out_dir, res)
        if clock.cuda:
            torch.cuda.empty_cache()
    try:
        res["routing"] = routing_times(device, clock) if not over() else {"error": "skipped: past --budget-s"}
    except Exception as e:
        res["routing"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    write(out_dir, res)
    print((out_dir / "kernels_bench.md").read_text())
    bad = [n for n, r in res["shapes"].items()
           if ("error" in r and not r["error"].startswith("skipped")) or not all(c[f]["ok"] for c in r["correctness"] for f in ("bf16", "int4"))]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
