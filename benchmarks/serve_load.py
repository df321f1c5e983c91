"""Serving load: throughput, TTFT and TPOT at several concurrencies, LYNX off vs on, on the demo
and on the zero-padded demo (lynx_edge.padded: same outputs, experts wide enough that decode is
bound by expert weight traffic, as on a real MoE).

The measuring is lynx_edge.server.load (the real server on 127.0.0.1, closed-loop streaming
clients over loopback, staggered starts, varied prompt lengths, greedy, ignore_eos); this script
picks the models and modes, adds "max throughput at a TPOT SLO" and LYNX on/off ratios, and
records peak RSS while serving.

    python benchmarks/serve_load.py                               # demo + padded demo, c = 1,4,16,64
    python benchmarks/serve_load.py -c 1,4 --pad 0 --max-tokens 16 --out /tmp/x
Writes benchmarks/results/serve_load.{json,md} by default. Loopback only; bounded in count and time.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_model(path, label: str, a, sizes: list[int]) -> list[dict]:
    from lynx_edge import Engine
    from lynx_edge.server.load import serve_load

    def show(r):
        print(json.dumps({"model": label, **r}), file=sys.stderr, flush=True)

    rows = []
    engine = Engine.from_pretrained(path, record_routing=True, ctx_size=a.ctx, max_num_seqs=max(sizes))
    for mixed in a.mixed.split(","):
        rows += [{"model": label, **r} for r in serve_load(
            engine, sizes, tuple(a.lynx.split(",")), a.reps, a.requests, a.max_tokens, a.prompt_len, a.stagger_ms,
            a.timeout_s, mixed_steps=mixed == "on", progress=show)]
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--pad", type=int, default=2048, help="also the zero-padded model at this expert intermediate "
                                                          "size (0: skip)")
    ap.add_argument("-c", "--concurrency", default="1,4,16,64")
    ap.add_argument("--lynx", default="off,on", help="comma-separated --lynx modes")
    ap.add_argument("--mixed", default="off", help="mixed steps (prefill chunks in the decode forward): off,on")
    ap.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    ap.add_argument("--reps", type=int, default=3, help="rounds (modes alternate within each); medians reported")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64, help="mean prompt tokens (spread over ¼..1¾ of it)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--stagger-ms", type=float, default=20.0)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 leaves a core to HTTP and clients)")
    ap.add_argument("--slo-ms", type=float, default=50.0, help="TPOT SLO (p90) for the max-throughput line")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="bound per point")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serve_load"))
    a = ap.parse_args(argv)

    import torch

    from lynx_edge.bench import cpu_isa
    from lynx_edge.hub import resolve_model
    from lynx_edge.padded import pad_checkpoint
    from lynx_edge.server.load import compare, markdown, slo_throughput
    from lynx_edge.threads import set_threads

    a.threads = set_threads(a.threads, explicit=True)  # the Engine builds keep it
    sizes = [int(x) for x in a.concurrency.split(",")]
    load_before = os.getloadavg()[0]  # the box is shared: say how busy it was
    src = resolve_model(a.model)
    rows = run_model(src, a.model, a, sizes)
    if a.pad:
        with tempfile.TemporaryDirectory() as tmp:
            padded = pad_checkpoint(src, Path(tmp) / "padded", a.pad)
            rows += run_model(padded, f"{a.model} padded I={a.pad}", a, sizes)
    key = lambda r: f"{r['model']}, lynx {r['lynx']}, mixed {r['mixed']}"  # noqa: E731
    slo = slo_throughput(rows, a.slo_ms, key)
    meta = {"model": a.model, "pad": a.pad, "reps": a.reps, "threads": a.threads, "isa": cpu_isa(), "requests_per_client": a.requests,
            "max_tokens": a.max_tokens, "prompt_len_mean": a.prompt_len, "ctx": a.ctx, "stagger_ms": a.stagger_ms,
            "slo_tpot_p90_ms": a.slo_ms, "max_throughput_at_slo": slo, "cpus": os.cpu_count(),
            "loadavg_1min_before_after": [load_before, os.getloadavg()[0]], "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "lynx_on_vs_off":
                                                    compare(rows, ("model", "lynx", "mixed"))}, indent=1) + "\n")
    text = [f"# serve_load: median of {a.reps} rounds, {a.requests} req/client × {a.max_tokens} tokens, prompts ~{a.prompt_len} tokens, greedy, "
            f"{a.threads} thread(s) ({meta['isa']}), stagger {a.stagger_ms:g} ms ({meta['date']}, {os.cpu_count()} CPUs, "
            f"load average {load_before:.1f} → {os.getloadavg()[0]:.1f})", "",
            markdown(rows, ("model", "lynx", "mixed")),
            f"Max throughput with TPOT p90 ≤ {a.slo_ms:g} ms: " + "; ".join(f"{m}: {v:.1f} tok/s" for m, v in slo.items()),
            ""]
    out.with_suffix(".md").write_text("\n".join(text))
    print("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
