"""CPU decode TPOT, LYNX vs exact, side by side in one run, with unique experts per layer.

On the demo model as is, and with every expert's intermediate size zero-padded (default 8192):
outputs and routing are identical (silu(0)·0 = 0 and zero columns of down add nothing) but the
experts weigh ≥ 1 GB, so decode is memory-bound as on a real large MoE.

    python benchmarks/lynx_cpu.py [--model demo] [--batch 1,4,8,16,32] [--pad 8192] [--lynx lynx] [--dtype D]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def pad_experts(engine, inter: int) -> float:
    """Zero-pad every expert to intermediate size `inter` in place. → total expert GB."""
    total = 0
    for layer in engine.model.layers:
        if not layer.is_moe:
            continue
        ex = layer.mlp.experts
        gu0, dn0 = ex.weights()  # row-major
        E, I2, D = gu0.shape
        I = I2 // 2
        gu = torch.zeros(E, 2 * inter, D, dtype=gu0.dtype)
        gu[:, :I], gu[:, inter : inter + I] = gu0[:, :I], gu0[:, I:]
        dn = torch.zeros(E, D, inter, dtype=dn0.dtype)
        dn[:, :, :I] = dn0
        ex.replace(gu, dn)
        total += gu.numel() * gu.element_size() + dn.numel() * dn.element_size()
    from lynx_edge.kernels import native

    for layer in engine.model.layers:  # the builder's rule for the padded size (they now come from DRAM; packed rows)
        if layer.is_moe:
            layer.mlp.experts.streamed = native.streamed(total)
    return total / 1e9


def measure(engine, prompts, B, new, reps, modes) -> list[dict]:
    """Alternate modes rep by rep so drift on a shared machine hits both alike."""
    tp = {m: [] for m in modes}
    info = {}
    for r in range(reps + 1):  # the first round is a warm-up
        for m in modes:
            engine.set_lynx(m)
            last = None
            for c in engine.stream_batch(prompts[:B], max_new_tokens=new, ignore_eos=True):
                last = c if c.stats else last
            if r:
                tp[m].append(last.stats["tpot_ms"])
            info[m] = last.stats
    rows = []
    for m in modes:
        st = info[m]
        rows.append({"batch": B, "mode": m, "tpot_ms": statistics.median(tp[m]),
                     "tpot_all": tp[m], "unique_experts_per_layer": st.get("unique_experts_per_layer"),
                     "remap_rate_pct": (st.get("lynx") or {}).get("remap_rate_pct", 0.0)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("--batch", default="1,4,8,16,32")
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--pad", type=int, default=8192, help="0: skip the padded run")
    ap.add_argument("--lynx", default="lynx")
    ap.add_argument("--threads", type=int, default=None, help="default: lynx_edge.threads (idle cores)")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: the CPU default, build.default_dtype)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/lynx_cpu.json"))
    args = ap.parse_args()
    from lynx_edge.bench import cpu_isa
    from lynx_edge.threads import set_threads

    args.threads = set_threads(args.threads, explicit=True)  # the Engine keeps it; recorded with the ISA
    from lynx_edge import Engine
    from lynx_edge.eval import load_sequences

    batches = [int(b) for b in args.batch.split(",")]
    eng = Engine.from_pretrained(args.model, device="cpu", dtype=args.dtype, record_routing=True)
    prompts = load_sequences(eng, num_seqs=max(batches), seq_len=args.prompt)
    modes = ["off", args.lynx]
    out = {"benchmark": "CPU decode TPOT, LYNX vs exact (median of reps, alternated)", "model": args.model,
           "lynx": args.lynx, "threads": args.threads, "isa": cpu_isa(), "dtype": eng.model.placement.dtype, "new_tokens": args.new, "prompt_tokens": args.prompt, "runs": []}
    for label, pad in (("as-is", 0), (f"padded-I{args.pad}", args.pad)):
        if label != "as-is" and not pad:
            continue
        gb = pad_experts(eng, pad) if pad else None
        rows = []
        for B in batches:
            rows += measure(eng, prompts, B, args.new, args.reps, modes)
            ex, ly = rows[-2], rows[-1]
            ly["speedup_vs_exact"] = ex["tpot_ms"] / ly["tpot_ms"]
            print(json.dumps({k: v for k, v in ly.items() if k != "tpot_all"} | {"label": label,
                              "exact_tpot_ms": ex["tpot_ms"], "exact_unique": ex["unique_experts_per_layer"]}), flush=True)
        out["runs"].append({"label": label, "expert_gb": gb, "rows": rows})
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
