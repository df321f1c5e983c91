"""`--int8-head` on a CPU: what the 8-bit output head costs in quality and buys in decode speed.

For each weight setting (bf16; --int4 --int4-attn, the demo's llama.cpp Q4_0 comparison, with fp32
and with q8 activations — q8 reads the int8 head with int8 activations too) two
engines of the same checkpoint run in this one process, the 16-bit head and the int8 head:
- quality: teacher-forced on the model's held-out text (eval.py's decode path: 64-token prefill,
  then batched decode steps on the true tokens), perplexity of each and greedy agreement (the
  share of positions where both heads pick the same next token);
- speed: greedy decode tok/s (bench.measure) at B=1 and B=16, rounds alternating between the two
  engines, medians and the median of the paired ratios.

    python benchmarks/int8_head.py [--model demo] [--threads 1] [--rounds 7] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# the last: --int4-act q8, so the int8 head's activations are int8 too (integer dot products)
SETTINGS = {"bf16": {}, "int4+attn": dict(int4=True, int4_attn=True),
            "int4+attn q8": dict(int4=True, int4_attn=True, int4_act="q8")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch

    from lynx_edge import Engine
    from lynx_edge.bench import cpu_isa, measure
    from lynx_edge.eval import _run, load_sequences
    from lynx_edge.threads import set_threads

    set_threads(a.threads, explicit=True)
    rows = []
    for name, opts in SETTINGS.items():
        engs = {h: Engine.from_pretrained(a.model, device="cpu", dtype="bfloat16", max_num_seqs=16, int8_head=h, **opts)
                for h in (False, True)}
        m = engs[True].model
        seqs = load_sequences(engs[False], num_seqs=32, seq_len=128)
        q = {h: _run(e, seqs, 8, 64) for h, e in engs.items()}
        row = {"setting": name, "head_activations": m.head_act, "head_bytes_16bit": m.cfg.vocab_size * m.cfg.hidden_size * 2,
               "head_bytes_int8": m.head_int8[0].numel() + 4 * m.head_int8[1].numel(),
               "tokens": int(q[False].nll.numel()),
               "ppl_16bit_head": math.exp(q[False].nll.mean().item()), "ppl_int8_head": math.exp(q[True].nll.mean().item()),
               "greedy_agreement": (q[False].argmax == q[True].argmax).float().mean().item()}
        for B in (1, 16):
            prompts = [[(7 * i + j) % 4000 + 5 for j in range(8 if B == 1 else 16)] for i in range(B)]
            n = 64 if B == 1 else 32
            tok_s = {False: [], True: []}
            for r in range(a.rounds):
                for h in ((False, True) if r % 2 == 0 else (True, False)):
                    tok_s[h].append(measure(engs[h], prompts, n + 1)["decode_tok_s"])
            ratios = [b / a_ for a_, b in zip(tok_s[False], tok_s[True])]
            row[f"B{B}"] = {"tok_s_16bit_head": statistics.median(tok_s[False]),
                            "tok_s_int8_head": statistics.median(tok_s[True]), "speedup": statistics.median(ratios),
                            "speedup_min_max": [min(ratios), max(ratios)]}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del engs
    res = {"what": "--int8-head vs the 16-bit head, same checkpoint, one process", "model": a.model,
           "threads": a.threads, "isa": cpu_isa(), "torch": torch.__version__, "rounds": a.rounds,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
