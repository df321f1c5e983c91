"""CPU decode with the weights on 2 MiB transparent huge pages vs 4 KiB pages (lynx_edge/hugepages.py).

Two engines of the same checkpoint in one process, one built with huge_pages=False (4 KiB pages)
and one with huge_pages=True (weights marked MADV_HUGEPAGE before they stream in); decode tok/s
measured in alternating rounds, ratio = huge / 4 KiB per round, median and range.

    python benchmarks/huge_pages.py --model PATH [--dtype bfloat16] [--int4 ...] [--batch 1,16] [-r 9] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def anon_huge_kib() -> int | None:
    """This process's anonymous memory on huge pages (/proc/self/smaps_rollup), KiB."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--int4", action="store_true")
    ap.add_argument("--int4-attn", action="store_true")
    ap.add_argument("--int8-head", action="store_true")
    ap.add_argument("--int4-act", default=None)
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("-r", "--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/huge_pages.json"))
    args = ap.parse_args()
    from lynx_edge import Engine
    from lynx_edge.bench import cpu_isa, measure, synthetic_prompts
    from lynx_edge.threads import set_threads

    set_threads(args.threads, explicit=True)
    sizes = [int(b) for b in args.batch.split(",")]
    opts = dict(dtype=args.dtype, int4=args.int4, int4_attn=args.int4_attn, int8_head=args.int8_head)
    if args.int4_act:
        opts["int4_act"] = args.int4_act
    engines, huge_kib = {}, {}
    for tag, huge in (("4k", False), ("huge", True)):
        before = anon_huge_kib() or 0
        engines[tag] = Engine.from_pretrained(args.model, device="cpu", max_num_seqs=max(sizes), huge_pages=huge,
                                              **opts)
        huge_kib[tag] = (anon_huge_kib() or 0) - before
    rows = []
    for B in sizes:
        prompts = synthetic_prompts(engines["4k"], B, 8 if B == 1 else 16)
        n = 65 if B == 1 else 33
        tok_s = {k: [] for k in engines}
        for r in range(args.rounds):
            for tag in (("4k", "huge") if r % 2 == 0 else ("huge", "4k")):
                tok_s[tag].append(measure(engines[tag], prompts, n)["decode_tok_s"])
        ratios = sorted(h / f for f, h in zip(tok_s["4k"], tok_s["huge"]))
        row = {"batch": B, "tok_s_4k": statistics.median(tok_s["4k"]), "tok_s_huge": statistics.median(tok_s["huge"]),
               "ratio_median": statistics.median(ratios), "ratio_min": ratios[0], "ratio_max": ratios[-1]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    res = {"benchmark": "decode tok/s, weights on 2 MiB transparent huge pages vs 4 KiB pages (same process)",
           "model": args.model, "options": opts, "threads": args.threads, "isa": cpu_isa(), "rounds": args.rounds,
           "anon_huge_pages_mib": {k: v / 1024 for k, v in huge_kib.items()}, "rows": rows,
           "loadavg": os.getloadavg()}
    out = Path(args.out)
    runs = json.loads(out.read_text()) if out.is_file() else []
    out.write_text(json.dumps(runs + [res], indent=1) + "\n")


if __name__ == "__main__":
    main()
