"""Serving load test: throughput, TTFT and TPOT of streaming clients against the real server.

    rows = serve_load(engine, [1, 4, 16], requests=2, max_tokens=32, prompt_len=64)

Starts this package's app under uvicorn on 127.0.0.1 (an ephemeral port) in a thread of this
process and drives it over loopback from a client process of its own (clients in the server's
process would take the GIL from it and skew every latency): `c` closed-loop streaming clients
with staggered starts, each sending `requests` completions one after another (token-id prompts
of varied length, greedy, ignore_eos, `max_tokens` each). Per point: output tokens/s, TTFT and
TPOT percentiles as the clients see them, the server's own mean TPOT, mean decode batch and
distinct experts per MoE layer per decode step (/metrics deltas), and the server process's peak
RSS. `lynx-edge bench --serve` and benchmarks/serve_load.py sit on it. Loopback only; bounded in
count and time.
"""
from __future__ import annotations

import asyncio
import json
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Callable

MODEL = "bench"  # the served model name the clients send


def varied_prompts(engine, n: int, mean_len: int, seed: int = 0) -> list[list[int]]:
    """n token-id prompts of lengths spread over [mean/4, 7·mean/4] (chunked prefill, staggered
    lengths), cut from lynx_edge.bench's synthetic prompts (held-out text when the model has it)."""
    from ..bench import synthetic_prompts

    top = max(1, 7 * mean_len // 4)
    full = synthetic_prompts(engine, n, min(top, engine.ctx // 2), seed)
    lens = [max(1, mean_len // 4 + (i * 37) % max(1, top - mean_len // 4)) for i in range(n)]
    return [p[:k] for p, k in zip(full, lens)]


class LoopbackServer:
    """with LoopbackServer(engine, max_num_seqs=16) as url: …  (uvicorn in a thread, 127.0.0.1)."""

    def __init__(self, engine, max_num_seqs: int, mixed_steps: bool = False, max_waiting: int = 256):
        import uvicorn

        from .app import create_app

        self.app = create_app(engine, model_name=MODEL, max_num_seqs=max_num_seqs, max_waiting=max_waiting,
                              mixed_steps=mixed_steps)
        # proto IPPROTO_TCP: asyncio sets TCP_NODELAY only on such sockets; without it Nagle holds
        # each SSE chunk for the client's delayed ACK (~40 ms) once a connection is reused
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the benchmark server did not start")
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
        self.sock.close()


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else 0.0


def _hist(text: str, name: str) -> tuple[float, float]:
    """(sum, count) of a Prometheus histogram in /metrics text."""
    s = re.search(rf"^{name}_sum ([0-9.e+-]+)$", text, re.M)
    c = re.search(rf"^{name}_count ([0-9.e+-]+)$", text, re.M)
    return (float(s.group(1)) if s else 0.0, float(c.group(1)) if c else 0.0)


def _mean_delta(m0: str, m1: str, name: str) -> float:
    (s0, c0), (s1, c1) = _hist(m0, name), _hist(m1, name)
    return (s1 - s0) / (c1 - c0) if c1 > c0 else 0.0


async def run_point(url: str, prompts: list, clients: int, per_client: int, max_tokens: int,
                    stagger_s: float, timeout_s: float) -> dict:
    """`clients` closed-loop streaming clients → throughput, TTFT/TPOT percentiles, decode batch, experts."""
    import httpx

    ttft, tpot, out_tokens = [], [], 0

    async def client(h, k: int):
        nonlocal out_tokens
        await asyncio.sleep(k * stagger_s)
        for j in range(per_client):
            body = {"model": MODEL, "prompt": prompts[(k * per_client + j) % len(prompts)], "max_tokens": max_tokens,
                    "temperature": 0, "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
            t0, t_first, n = time.perf_counter(), None, 0
            async with h.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
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

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as h:
        m0 = (await h.get(url + "/metrics")).text
        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(client(h, k) for k in range(clients))), timeout=timeout_s)
        wall = time.perf_counter() - t0
        m1 = (await h.get(url + "/metrics")).text
    return {
        "concurrency": clients, "requests": clients * per_client, "output_tokens": out_tokens, "wall_s": wall,
        "throughput_tok_s": out_tokens / wall,
        "ttft_p50_ms": 1e3 * _pct(ttft, 0.5), "ttft_p90_ms": 1e3 * _pct(ttft, 0.9),
        "tpot_p50_ms": 1e3 * _pct(tpot, 0.5), "tpot_p90_ms": 1e3 * _pct(tpot, 0.9),
        "tpot_mean_ms": 1e3 * statistics.fmean(tpot) if tpot else 0.0,
        "server_tpot_mean_ms": 1e3 * _mean_delta(m0, m1, "lynx_tpot_seconds"),
        "mean_decode_batch": _mean_delta(m0, m1, "lynx_step_decode_tokens"),
        "unique_experts_per_layer": _mean_delta(m0, m1, "lynx_unique_experts_per_layer"),
    }


class ClientProcess:
    """with ClientProcess() as run: run(url=…, prompts=…, …) → run_point's row, computed in a
    child Python that loads only this file (stdlib + httpx: no torch, no lynx_edge package) and
    takes jobs as JSON lines on stdin."""

    _BOOT = ("import importlib.util as u, sys; s = u.spec_from_file_location('lynx_load_clients', sys.argv[1]); "
             "m = u.module_from_spec(s); s.loader.exec_module(m); m._client_main()")

    def __enter__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", self._BOOT, __file__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        return self.run

    def run(self, **job) -> dict:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        out = json.loads(self.proc.stdout.readline() or '"the client process ended"')
        if isinstance(out, str):
            raise RuntimeError(f"load clients failed: {out}")
        return out

    def __exit__(self, *exc) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _client_main() -> None:
    for line in sys.stdin:
        try:
            out = asyncio.run(run_point(**json.loads(line)))
        except Exception as exc:  # noqa: BLE001 — back to the parent as one line
            out = f"{type(exc).__name__}: {exc}"
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


def serve_load(engine, concurrency: list[int], modes: tuple[str, ...] = ("off",), reps: int = 1, requests: int = 2,
               max_tokens: int = 32, prompt_len: int = 64, stagger_ms: float = 20.0, timeout_s: float = 900.0,
               mixed_steps: bool = False, progress: Callable[[dict], None] | None = None) -> list[dict]:
    """One row per (LYNX mode, concurrency): each point runs on a fresh server over `engine` in that
    mode (max_num_seqs = the largest concurrency; a warm-up request first), modes alternating
    within each of `reps` rounds so drift on a shared machine hits them alike; numbers are the
    medians over the rounds (tok/s of every round kept). Peak RSS is the server process's."""
    from ..rss import RssWatch

    prompts = varied_prompts(engine, 64, prompt_len)
    runs: dict[tuple[str, int], list[dict]] = {}
    with ClientProcess() as run:
        for _ in range(reps):
            for c in concurrency:
                for mode in modes:
                    engine.set_lynx(mode)
                    with LoopbackServer(engine, max(concurrency), mixed_steps) as url:
                        job = dict(url=url, prompts=prompts, timeout_s=timeout_s)
                        run(**job, clients=1, per_client=1, max_tokens=4, stagger_s=0.0)  # warm-up
                        with RssWatch(interval_s=0.02) as w:
                            r = run(**job, clients=c, per_client=requests, max_tokens=max_tokens,
                                    stagger_s=stagger_ms / 1e3)
                    r.update(lynx=mode, mixed="on" if mixed_steps else "off", rss_peak_mib=w.peak["total"] / 2**20,
                             rss_peak_anon_mib=w.peak["anon"] / 2**20)
                    runs.setdefault((mode, c), []).append(r)
                    if progress is not None:
                        progress(r)
    return [_median_row(runs[(mode, c)]) for mode in modes for c in concurrency]


def _median_row(rs: list[dict]) -> dict:
    row = dict(rs[0])
    for k, v in rs[0].items():
        if isinstance(v, float):
            row[k] = statistics.median(r[k] for r in rs)
    row["reps"], row["throughput_all"] = len(rs), [r["throughput_tok_s"] for r in rs]
    return row


def slo_throughput(rows: list[dict], slo_ms: float, key: Callable[[dict], str]) -> dict[str, float]:
    """Per key: the highest output tok/s among points whose TPOT p90 ≤ slo_ms (the paper's metric)."""
    best: dict[str, float] = {}
    for r in rows:
        if r["tpot_p90_ms"] <= slo_ms:
            best[key(r)] = max(best.get(key(r), 0.0), r["throughput_tok_s"])
    return best


def markdown(rows: list[dict], labels: tuple[str, ...] = ("lynx", "mixed")) -> str:
    """The rows as a Markdown table; with LYNX off and on rows, their side-by-side ratios too."""
    head = [*labels, "c", "requests", "tok/s", "TTFT p50 / p90 ms", "TPOT p50 / p90 ms", "decode batch",
            "unique experts/layer", "peak RSS MiB"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        out.append("| " + " | ".join(str(r.get(k, "")) for k in labels) + f" | {r['concurrency']} | {r['requests']} | "
                   f"{r['throughput_tok_s']:.1f} | {r['ttft_p50_ms']:.0f} / {r['ttft_p90_ms']:.0f} | "
                   f"{r['tpot_p50_ms']:.1f} / {r['tpot_p90_ms']:.1f} | {r['mean_decode_batch']:.1f} | "
                   f"{r['unique_experts_per_layer']:.1f} | {r.get('rss_peak_mib', 0):.0f} |")
    pairs = compare(rows, labels)
    if pairs:
        rest = [k for k in labels if k != "lynx"]
        out += ["", "LYNX on vs off (ratios on/off; tok/s > 1 and TPOT < 1 are wins):", "",
                "| " + " | ".join([*rest, "c", "tok/s", "TPOT p50", "TTFT p50", "unique experts", "peak RSS"]) + " |",
                "|" + "---|" * (len(rest) + 6)]
        for p in pairs:
            out.append("| " + " | ".join(str(p[k]) for k in rest) + f" | {p['concurrency']} | {p['tok_s_ratio']:.2f} | "
                       f"{p['tpot_p50_ratio']:.2f} | {p['ttft_p50_ratio']:.2f} | {p['unique_ratio']:.2f} | "
                       f"{p['rss_ratio']:.2f} |")
    return "\n".join(out) + "\n"


def compare(rows: list[dict], labels: tuple[str, ...] = ("lynx", "mixed")) -> list[dict]:
    """LYNX on / off ratios for each point that has both (same other labels and concurrency)."""
    rest = [k for k in labels if k != "lynx"]
    key = lambda r: (*(r.get(k) for k in rest), r["concurrency"])  # noqa: E731
    off = {key(r): r for r in rows if r.get("lynx") == "off"}
    div = lambda a, b: a / b if b else 0.0  # noqa: E731
    pairs = []
    for r in rows:
        b = off.get(key(r))
        if r.get("lynx") in (None, "off") or b is None:
            continue
        pairs.append({**{k: r.get(k) for k in rest}, "concurrency": r["concurrency"], "lynx": r["lynx"],
                      "tok_s_ratio": div(r["throughput_tok_s"], b["throughput_tok_s"]),
                      "tpot_p50_ratio": div(r["tpot_p50_ms"], b["tpot_p50_ms"]),
                      "ttft_p50_ratio": div(r["ttft_p50_ms"], b["ttft_p50_ms"]),
                      "unique_ratio": div(r["unique_experts_per_layer"], b["unique_experts_per_layer"]),
                      "rss_ratio": div(r.get("rss_peak_mib", 0), b.get("rss_peak_mib", 0))})
    return pairs


__all__ = ["ClientProcess", "LoopbackServer", "compare", "markdown", "run_point", "serve_load", "slo_throughput", "varied_prompts"]
