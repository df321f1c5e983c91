"""The sliding-window ring (kv_cache.py) against the full-context KV (--swa-full) on a gpt-oss-20b-shaped
checkpoint: KV bytes, peak memory of load and serving, decode speed, and the greedy tokens of both.

Each mode runs in a fresh process (one 13.8 GB copy of the model resident at a time), the modes
alternating round by round: load under RssWatch, then `--batch` prompts of `--prompt` tokens and
`--tokens` greedy tokens each (one untimed run first), timed; the peak anonymous memory of serving
is measured from the process start. Medians over rounds; the tokens of every run are compared.

    python benchmarks/swa_ring.py --model ~/.cache/lynx-edge/llamacpp/models/oss-24l-v201088 \
        --batch 16 --ctx 4096 --prompt 64 --tokens 16 -r 2 --threads 2 --out benchmarks/results/swa_ring_s31.json
The checkpoint: benchmarks/full_size.py writes it (random weights in gpt-oss-20b's published layout).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lynx_edge.cpuflags import cpu_flags  # noqa: E402


def child(path: Path, swa_full: bool, threads: int, batch: int, ctx: int, prompt: int, tokens: int) -> dict:
    """One fresh process: load, one untimed and one timed greedy generation → bytes, memory, tok/s, tokens."""
    from lynx_edge import Engine
    from lynx_edge.bench import synthetic_prompts
    from lynx_edge.kv_cache import KVCache
    from lynx_edge.rss import RssWatch
    from lynx_edge.threads import set_threads

    with RssWatch() as load:
        eng = Engine.from_pretrained(path, device="cpu", threads=threads, max_num_seqs=batch, ctx_size=ctx,
                                     swa_full=swa_full)
    set_threads(threads, explicit=True)
    prompts = synthetic_prompts(eng, batch, prompt)

    def run() -> tuple[list[list[int]], dict]:
        out = [[] for _ in prompts]
        stats = None
        for c in eng.stream_batch(prompts, max_new_tokens=tokens, do_sample=False, ignore_eos=True):
            out[c.index] += c.token_ids
            stats = c.stats or stats
        return out, stats

    with RssWatch() as serve:
        run()  # untimed: allocates the cache, warms the kernels
        toks, stats = run()
    return {"kv_bytes": KVCache.bytes_needed(eng.cfg, batch, ctx, eng.model.dtype, swa_full),
            "load_peak_anon": load.peak["anon"] - load.start["anon"],
            "serve_peak_anon": serve.peak["anon"] - load.start["anon"],
            "decode_tok_s": float(stats["decode_tok_s"]), "prefill_tok_s": float(stats["prefill_tok_s"]),
            "tokens": toks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("-r", "--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", choices=["ring", "full"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        got = child(a.model, a.child == "full", a.threads, a.batch, a.ctx, a.prompt, a.tokens)
        print("RESULT " + json.dumps(got))
        return
    runs: dict[str, list[dict]] = {"ring": [], "full": []}
    for r in range(a.rounds):
        for mode in (("ring", "full") if r % 2 == 0 else ("full", "ring")):
            cmd = [sys.executable, __file__, "--child", mode, "--model", str(a.model), "--batch", str(a.batch),
                   "--ctx", str(a.ctx), "--prompt", str(a.prompt), "--tokens", str(a.tokens), "--threads",
                   str(a.threads)]
            p = subprocess.run(cmd, capture_output=True, text=True)
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            if p.returncode or not line:
                raise SystemExit(f"{mode} run failed:\n{p.stderr[-3000:]}")
            runs[mode].append(json.loads(line[-1][7:]))
            got = runs[mode][-1]
            print(f"round {r} {mode}: KV {got['kv_bytes'] / 2**30:.2f} GiB, serve peak "
                  f"{got['serve_peak_anon'] / 2**30:.2f} GiB, decode {got['decode_tok_s']:.2f} tok/s", flush=True)
    same = all(run["tokens"] == runs["full"][0]["tokens"] for m in runs for run in runs[m])
    med = {m: {k: statistics.median(run[k] for run in rs) for k in rs[0] if k != "tokens"} for m, rs in runs.items()}
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "lynx_edge": commit,
           "machine": " ".join(sorted(cpu_flags())),
           "args": {k: str(v) for k, v in vars(a).items() if k not in ("out", "child")}, "median": med,
           "tokens_equal": same, "decode_ratio_ring_over_full": med["ring"]["decode_tok_s"] / med["full"]["decode_tok_s"],
           "serve_peak_saved_gib": (med["full"]["serve_peak_anon"] - med["ring"]["serve_peak_anon"]) / 2**30,
           "runs": {m: [{k: v for k, v in run.items() if k != "tokens"} for run in rs] for m, rs in runs.items()}}
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=1))
    if a.out:
        a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
