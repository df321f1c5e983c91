"""Serving load: throughput, TTFT and TPOT at several concurrencies, LYNX off vs on.

Starts the real server (lynx_edge.server, uvicorn on 127.0.0.1, an ephemeral port) in this
process, and drives it with closed-loop streaming clients over loopback: `c` clients, staggered
starts, each sending `--requests` completions one after another (prompts of varied length from
the demo's held-out text, greedy, ignore_eos, `--max-tokens` each). Records per point: output
tokens/s, TTFT and TPOT percentiles, mean decode batch and distinct experts per MoE layer per
decode step (from /metrics histogram deltas), and "max throughput at a TPOT SLO".

    python benchmarks/serve_load.py                          # demo, c = 1,4,16, LYNX off,on
    python benchmarks/serve_load.py -c 1,4 --lynx off --max-tokens 16 --out /tmp/x
Writes benchmarks/results/serve_load.{json,md} by default. Loopback only; bounded in count and time.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import socket
import statistics
import sys
import threading
import time
from pathlib import Path


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _hist(text: str, name: str) -> tuple[float, float]:
    """(sum, count) of a Prometheus histogram in /metrics text."""
    s = re.search(rf"^{name}_sum ([0-9.e+-]+)$", text, re.M)
    c = re.search(rf"^{name}_count ([0-9.e+-]+)$", text, re.M)
    return (float(s.group(1)) if s else 0.0, float(c.group(1)) if c else 0.0)


def start_server(engine, max_num_seqs: int, mixed_steps: bool = False):
    import uvicorn

    from lynx_edge.server import create_app

    app = create_app(engine, model_name="m", max_num_seqs=max_num_seqs, max_waiting=256,
                     mixed_steps=mixed_steps)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    for _ in range(600):
        if srv.started:
            break
        time.sleep(0.05)
    return srv, th, f"http://127.0.0.1:{sock.getsockname()[1]}"


async def run_point(url: str, prompts: list[str], clients: int, per_client: int, max_tokens: int,
                    stagger_s: float, timeout_s: float) -> dict:
    import httpx

    ttft, tpot, out_tokens = [], [], 0

    async def client(h, k: int):
        nonlocal out_tokens
        await asyncio.sleep(k * stagger_s)
        for j in range(per_client):
            body = {"model": "m", "prompt": prompts[(k * per_client + j) % len(prompts)], "max_tokens": max_tokens,
                    "temperature": 0, "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
            t0, t_first, n = time.perf_counter(), None, 0
            async with h.stream("POST", url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    d = json.loads(line[6:])
                    if d.get("usage"):
                        n = d["usage"]["completion_tokens"]
                    elif d["choices"] and d["choices"][0]["text"] and t_first is None:
                        t_first = time.perf_counter()
            t1 = time.perf_counter()
            if t_first is not None:
                ttft.append(t_first - t0)
                if n > 1:
                    tpot.append((t1 - t_first) / (n - 1))
            out_tokens += n

    async with httpx.AsyncClient(timeout=timeout_s) as h:
        m0 = (await h.get(url + "/metrics")).text
        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(client(h, k) for k in range(clients))), timeout=timeout_s)
        wall = time.perf_counter() - t0
        m1 = (await h.get(url + "/metrics")).text
    (bs0, bc0), (bs1, bc1) = _hist(m0, "lynx_step_decode_tokens"), _hist(m1, "lynx_step_decode_tokens")
    (us0, uc0), (us1, uc1) = _hist(m0, "lynx_unique_experts_per_layer"), _hist(m1, "lynx_unique_experts_per_layer")
    return {
        "concurrency": clients, "requests": clients * per_client, "output_tokens": out_tokens, "wall_s": wall,
        "throughput_tok_s": out_tokens / wall,
        "ttft_p50_ms": 1e3 * _pct(ttft, 0.5), "ttft_p90_ms": 1e3 * _pct(ttft, 0.9),
        "tpot_p50_ms": 1e3 * _pct(tpot, 0.5), "tpot_p90_ms": 1e3 * _pct(tpot, 0.9),
        "tpot_mean_ms": 1e3 * statistics.fmean(tpot) if tpot else 0.0,
        "mean_decode_batch": (bs1 - bs0) / (bc1 - bc0) if bc1 > bc0 else 0.0,
        "unique_experts_per_layer": (us1 - us0) / (uc1 - uc0) if uc1 > uc0 else 0.0,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("-c", "--concurrency", default="1,4,16")
    ap.add_argument("--lynx", default="off,on", help="comma-separated --lynx modes")
    ap.add_argument("--mixed", default="off", help="mixed steps (prefill chunks in the decode forward): off,on")
    ap.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--stagger-ms", type=float, default=50.0)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest on a busy box)")
    ap.add_argument("--slo-ms", type=float, default=50.0, help="TPOT SLO (p90) for the max-throughput line")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="bound per point")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "serve_load"))
    a = ap.parse_args(argv)

    import torch

    from lynx_edge import Engine
    from lynx_edge.hub import resolve_model

    torch.set_num_threads(a.threads)
    sizes = [int(x) for x in a.concurrency.split(",")]
    text = (resolve_model(a.model) / "heldout.txt")
    src = text.read_text() if text.is_file() else "def f(x):\n    return x\n" * 200
    prompts = [src[i * 997 % max(1, len(src) - 400):][: 40 + 37 * (i % 8)] for i in range(64)]  # 40..300 chars
    rows = []
    for mode in a.lynx.split(","):
        for mixed in a.mixed.split(","):
            engine = Engine.from_pretrained(a.model, lynx=mode, record_routing=True)
            srv, th, url = start_server(engine, max(sizes), mixed == "on")
            try:
                for c in sizes:
                    r = asyncio.run(run_point(url, prompts, c, a.requests, a.max_tokens, a.stagger_ms / 1e3,
                                              a.timeout_s))
                    r["lynx"], r["mixed"] = mode, mixed
                    rows.append(r)
                    print(json.dumps(r), file=sys.stderr, flush=True)
            finally:
                srv.should_exit = True
                th.join(timeout=60)
    slo = {}
    for r in rows:
        key = f"lynx {r['lynx']}, mixed {r['mixed']}"
        if r["tpot_p90_ms"] <= a.slo_ms:
            slo[key] = max(slo.get(key, 0.0), r["throughput_tok_s"])
    meta = {"model": a.model, "threads": a.threads, "requests_per_client": a.requests, "max_tokens": a.max_tokens,
            "stagger_ms": a.stagger_ms, "slo_tpot_p90_ms": a.slo_ms, "max_throughput_at_slo": slo,
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# serve_load: {a.model}, {a.requests} req/client × {a.max_tokens} tokens, greedy, "
             f"{a.threads} thread(s), stagger {a.stagger_ms:g} ms ({meta['date']})", "",
             "| lynx | mixed | c | requests | tok/s | TTFT p50 / p90 ms | TPOT p50 / p90 ms | decode batch "
             "| unique experts/layer |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['lynx']} | {r['mixed']} | {r['concurrency']} | {r['requests']} | {r['throughput_tok_s']:.1f} | "
                     f"{r['ttft_p50_ms']:.0f} / {r['ttft_p90_ms']:.0f} | {r['tpot_p50_ms']:.1f} / {r['tpot_p90_ms']:.1f} | "
                     f"{r['mean_decode_batch']:.1f} | {r['unique_experts_per_layer']:.1f} |")
    lines += ["", f"Max throughput with TPOT p90 ≤ {a.slo_ms:g} ms: "
              + "; ".join(f"{m}: {v:.1f} tok/s" for m, v in slo.items()), ""]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
