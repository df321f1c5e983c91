"""Streamed bf16 experts in packed rows against row-major, end to end: decode TPOT of one engine
(exact and LYNX) with the layer's experts re-laid out between rounds, alternating, in one process.

The builder keeps streamed bf16 expert matrices of short rows in packed rows (native.pack_choice);
this puts the same engine's experts row-major or packed in turn (StackedExperts re-lays them out
in place) and times the streaming call with each. --pad zero-pads the experts first (lynx_cpu.py's
memory-bound demo). Outputs are bit-equal either way (the same sums; checked on the first round).

    python benchmarks/packed_rows.py [--model demo] [--pad 8192] [--batch 1,4,16] [-r 5] [--threads 1]
Appends to benchmarks/results/packed_rows.json (or --out).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("--pad", type=int, default=0, help="zero-pad the experts to this intermediate size first")
    ap.add_argument("--batch", default="1,4,16")
    ap.add_argument("--lynx", default="on", help="the LYNX mode timed beside exact ('' for exact only)")
    ap.add_argument("-r", "--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=24, help="decode tokens per round")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prefill", type=int, default=512, help="also time one prompt of this many tokens (0: skip)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/packed_rows.json"))
    a = ap.parse_args()
    from lynx_edge.threads import set_threads

    threads = set_threads(a.threads, explicit=True)
    from lynx_edge import Engine
    from lynx_edge.bench import cpu_isa, synthetic_prompts
    from lynx_edge.kernels import native
    from lynx_edge.models.layers import StackedExperts
    from native_ab import append_run, paired

    batches = [int(b) for b in a.batch.split(",")]
    eng = Engine.from_pretrained(a.model, device="cpu", dtype="bfloat16", record_routing=True)
    prompts = synthetic_prompts(eng, max(batches), a.prompt)  # held-out text where the model has it
    if a.pad:
        from lynx_cpu import pad_experts

        pad_experts(eng, a.pad)
    experts = [layer.mlp.experts for layer in eng.model.layers
               if layer.is_moe and type(layer.mlp.experts) is StackedExperts]
    if not experts or not any(native.pack_choice(experts[0].gate_up, experts[0].down)) or not experts[0].streamed:
        sys.exit("packed_rows: this model's experts are not streamed bf16 ones of short rows (native.pack_choice)")

    def layout(packed: bool) -> None:
        for ex in experts:
            ex.relayout(ex.streamed, pack=packed)

    layout(True)
    lay = experts[0].packed_rows
    modes = ["off"] + ([a.lynx] if a.lynx else [])
    run = {"benchmark": "streamed bf16 experts, packed rows vs row-major, decode TPOT (same process, alternating)",
           "model": a.model, "pad": a.pad, "threads": threads, "isa": cpu_isa(), "rounds": a.rounds,
           "tokens": a.tokens, "prompt": a.prompt, "packed": {"gate_up": lay[0], "down": lay[1]},
           "expert_shape": list(experts[0].gate_up.shape), "rows": []}
    for B in batches:
        ms = {(p, m): [] for p in ("row_major", "packed") for m in modes}
        outs = {}
        for r in range(a.rounds + 1):  # round 0 warms up and checks the tokens
            for p in (("row_major", "packed") if r % 2 == 0 else ("packed", "row_major")):
                layout(p == "packed")
                for m in modes:
                    eng.set_lynx(m)
                    toks, last = [[] for _ in range(B)], None
                    for c in eng.stream_batch(prompts[:B], max_new_tokens=a.tokens, ignore_eos=True):
                        toks[c.index] += c.token_ids
                        last = c if c.stats else last
                    if r:
                        ms[(p, m)].append(last.stats["tpot_ms"])
                    else:
                        outs[(p, m)] = toks
        row = {"batch": B, "bit_equal": all(outs[("packed", m)] == outs[("row_major", m)] for m in modes)}
        for m in modes:
            row[m] = {"row_major_tpot_ms": round(statistics.median(ms[("row_major", m)]), 3),
                      "packed_tpot_ms": round(statistics.median(ms[("packed", m)]), 3),
                      "speedup": {k: round(v, 3) for k, v in paired(ms[("row_major", m)], ms[("packed", m)]).items()}}
        if a.lynx:
            for p in ("row_major", "packed"):
                row[f"lynx_speedup_{p}"] = round(paired(ms[(p, "off")], ms[(p, a.lynx)])["median"], 3)
        run["rows"].append(row)
        print(json.dumps(row), flush=True)
    if a.prefill:  # prefill: many tokens an expert, where packed rows run 4 x 3 tiles (row-major 2 x 4)
        prompt = synthetic_prompts(eng, 1, a.prefill, seed=1)
        s = {"row_major": [], "packed": []}
        for r in range(a.rounds + 1):
            for p in (("row_major", "packed") if r % 2 == 0 else ("packed", "row_major")):
                layout(p == "packed")
                eng.set_lynx("off")
                t0 = time.perf_counter()
                for _ in eng.stream_batch(prompt, max_new_tokens=1, ignore_eos=True):
                    pass
                if r:
                    s[p].append(time.perf_counter() - t0)
        row = {"prefill_tokens": a.prefill, "row_major_tok_s": round(a.prefill / statistics.median(s["row_major"]), 1),
               "packed_tok_s": round(a.prefill / statistics.median(s["packed"]), 1),
               "speedup": {k: round(v, 3) for k, v in paired(s["row_major"], s["packed"]).items()}}
        run["prefill"] = row
        print(json.dumps(row), flush=True)
    append_run(Path(a.out), run)


if __name__ == "__main__":
    main()
