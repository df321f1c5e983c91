"""What an expert costs by its token count, and what that leaves LYNX on the zero-padded demo (issue 16).

LYNX at B = 16 cuts the experts a layer reads (the demo's 64 slots over ~28 experts → ~20), not its
slots: every token still runs k experts. So its speed-up is bounded by how an expert's time splits
into a part paid once per expert read (its bytes) and a part paid per token (multiply-adds).

Three parts, one thread (--threads), the demo's experts zero-padded to I = 8192 (lynx_cpu.py: 12.6 MB of bf16
an expert, as the engine lays them out — packed gate/up rows where the build packs):
- t(n): one expert's MoE call with n tokens, from DRAM (32 experts' copies cycled) and from the L3
  (the same copy again);
- one decode step's four layers with the ids the engine routed, exact and LYNX (captured from the
  demo's B = 16 decode with synthetic prompts): the measured time per layer, and Σ t(n) over the
  layer's experts (each expert alone, one after another);
- the bound: were the per-token part free, a layer would cost unique experts × t(1) either way, so
  LYNX's speed-up could reach the ratio of unique experts and no more; what the tokens add over
  that, per slot.

    python benchmarks/expert_tokens.py [-r 5] [--out benchmarks/results/expert_tokens.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

D, PAD, COPIES, TOKENS = 256, 8192, 32, (1, 2, 3, 4, 5, 6, 8)


def expert_curve(native, rounds: int) -> dict:
    """n → (cold ms, L3 ms) of one expert's call with n tokens."""
    g = torch.Generator().manual_seed(0)
    dt = torch.bfloat16
    packed = native.pack_choice(torch.empty(1, 2 * PAD, D, dtype=dt), torch.empty(1, D, PAD, dtype=dt))
    gus = [torch.randn(1, 2 * PAD, D, generator=g).to(dt) for _ in range(COPIES)]
    dns = [torch.randn(1, D, PAD, generator=g).to(dt) for _ in range(COPIES)]
    if packed[0]:
        gus = [native.pack_rows(w.view(2 * PAD, D)).view(1, 2 * PAD, D) for w in gus]
    if packed[1]:
        dns = [native.pack_rows(w.view(D, PAD)).view(1, D, PAD) for w in dns]

    def ms(n: int, cold: bool) -> float:
        x, ids, w = torch.randn(n, D, generator=g), torch.zeros(n, 1, dtype=torch.int64), torch.ones(n, 1)
        out = []
        for _ in range(rounds):
            t = time.perf_counter()
            for c in range(COPIES):
                k = c if cold else 0
                native.moe_dense(x, ids, w, gus[k], dns[k], stream=True, packed=packed)
            out.append((time.perf_counter() - t) / COPIES * 1e3)
        return statistics.median(out)

    return {n: (ms(n, True), ms(n, False)) for n in TOKENS}


def routed_layers(native, rounds: int) -> dict:
    """mode → (per-layer ms, the layers' token counts per expert) over one decode step's 4 layers."""
    from lynx_cpu import pad_experts  # beside this script

    from lynx_edge import Engine
    from lynx_edge.bench import measure, synthetic_prompts
    from lynx_edge.models import native_layer

    eng = Engine.from_pretrained("demo", device="cpu", dtype="bfloat16", max_num_seqs=16)
    pad_experts(eng, PAD)
    native_layer.NATIVE_LAYERS = False  # the module path: its expert calls carry the ids to capture
    real, calls = native.moe_dense, []
    native.moe_dense = lambda *a, **k: calls.append((a, k)) or real(*a, **k)
    prompts = synthetic_prompts(eng, 16, 64)
    got = {}
    for mode in ("off", "lynx"):
        eng.set_lynx(mode)
        calls.clear()
        measure(eng, prompts, 6)
        got[mode] = [c for c in calls if c[0][1].shape[0] == 16][-len(eng.model.layers):]  # the last step's layers
    native.moe_dense = real
    native_layer.NATIVE_LAYERS = True
    times = {m: [] for m in got}
    for r in range(rounds):  # modes alternating
        for m in (("off", "lynx") if r % 2 == 0 else ("lynx", "off")):
            t = time.perf_counter()
            for a, k in got[m]:
                real(*a, **k)
            times[m].append((time.perf_counter() - t) / len(got[m]) * 1e3)
    counts = {m: [torch.bincount(a[1].flatten()).tolist() for a, _ in got[m]] for m in got}
    return {m: (statistics.median(times[m]), [[n for n in c if n] for c in counts[m]]) for m in got}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-r", "--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="JSON file for the result (default: print only)")
    a = ap.parse_args()
    from lynx_edge.kernels import native
    from lynx_edge.threads import set_threads

    if native.lib() is None:
        sys.exit("the native CPU kernels did not build here")
    set_threads(a.threads, explicit=True)
    curve = expert_curve(native, a.rounds)
    for n, (c, h) in curve.items():
        print(f"t({n}) from DRAM {c:.3f} ms, from L3 {h:.3f} ms", flush=True)
    layers = routed_layers(native, a.rounds)

    def t_of(n: int) -> float:  # the cold curve, linear past its last point
        if n in curve:
            return curve[n][0]
        hi = max(curve)
        return curve[hi][0] + (n - hi) * (curve[hi][0] - curve[hi - 2][0]) / 2

    res = {"threads": a.threads, "dtype": "bfloat16", "pad": PAD, "rounds": a.rounds, "torch": torch.__version__,
           "isa": torch.backends.cpu.get_cpu_capability(),
           "t_n_ms": {n: {"dram": round(c, 4), "l3": round(h, 4)} for n, (c, h) in curve.items()}, "layers": {}}
    for m, (ms, counts) in layers.items():
        unique = statistics.mean(len(c) for c in counts)
        res["layers"][m] = {"ms_per_layer": round(ms, 3), "unique_experts": unique,
                            "sum_t_n_ms": round(statistics.mean(sum(t_of(n) for n in c) for c in counts), 3),
                            "bytes_only_ms": round(unique * curve[1][0], 3), "tokens_per_expert": counts}
    off, on = res["layers"]["off"], res["layers"]["lynx"]
    res["lynx_speedup"] = round(off["ms_per_layer"] / on["ms_per_layer"], 3)
    # the bound: were the per-token part free, each layer would cost its experts' bytes alone
    res["lynx_bound_unique_ratio"] = round(off["unique_experts"] / on["unique_experts"], 3)
    for m in (off, on):  # what the tokens add over the bytes, per slot
        m["per_slot_ms"] = round((m["ms_per_layer"] - m["bytes_only_ms"]) / 64, 4)
    print(json.dumps({k: v for k, v in res.items() if k != "t_n_ms"}, default=str)[:2000])
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
