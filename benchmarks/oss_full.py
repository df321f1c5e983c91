"""gpt-oss-20b at full size on this box: all 24 layers and the real 201088-token vocabulary (13.8 GB of
MXFP4 experts and bf16 rest, as published; random weights), lynx-edge vs llama.cpp, CPU decode.

vs_llamacpp.py keeps one engine loaded while llama.cpp runs beside it, which a 24 GB box cannot do
with two 13.8 GB copies of this model: here each round runs llama.cpp (llama-bench B=1,
llama-batched-bench B=16; its GGUF mmapped) and then lynx-edge in a fresh process (load under
RssWatch, then B=1 and B=16 LYNX off / on, each timed after an untimed run of the same test), so
only one copy is resident at a time. Rounds alternate the two tools; medians are reported. The
child also records load seconds and the peak anonymous / file-backed memory of load and serving.

    python benchmarks/oss_full.py --threads 2 -r 3 --out benchmarks/results/oss_full_s29.json
With --prefill P it times prompt processing instead: llama-bench -p P -n 0 against lynx-edge's prefill
of one P-token prompt (after an untimed 64-token one), tok/s.
Needs ~28 GB of disk (checkpoint + GGUF, cached under ~/.cache/lynx-edge/llamacpp/models) and the
llama.cpp build of vs_llamacpp.py (built on first use).
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
sys.path.insert(0, str(Path(__file__).resolve().parent))


def child(path: Path, threads: int, n: int, batch: int, n16: int, prompt: int, int4_act: str | None,
          prefill: int = 0) -> dict:
    """One fresh process: load, then B=1 and B=batch decode → tok/s and memory (prefill > 0: that
    many prompt tokens' prefill → tok/s instead)."""
    from lynx_edge import Engine
    from lynx_edge.bench import measure, synthetic_prompts
    from lynx_edge.rss import RssWatch
    from lynx_edge.threads import set_threads

    if prefill:
        from lynx_edge.step import prefill as run_prefill

        eng = Engine.from_pretrained(path, device="cpu", threads=threads, int4_act=int4_act)
        set_threads(threads, explicit=True)
        ids, kv = synthetic_prompts(eng, 1, prefill)[0], eng._cache(1)
        run_prefill(eng.model, kv, 0, ids[:64], 0)  # untimed (llama-bench's warm-up)
        t0 = time.perf_counter()
        run_prefill(eng.model, kv, 0, ids, 0)
        return {"pp": prefill / (time.perf_counter() - t0)}

    t0 = time.perf_counter()
    with RssWatch() as load:
        eng = Engine.from_pretrained(path, device="cpu", threads=threads, max_num_seqs=batch, int4_act=int4_act)
    load_s = time.perf_counter() - t0
    set_threads(threads, explicit=True)
    p1, pB = synthetic_prompts(eng, 1, 8), synthetic_prompts(eng, batch, prompt)
    out = {"load_s": load_s, "load_peak_anon": load.peak["anon"] - load.start["anon"],
           "load_peak_file": load.peak["file"] - load.start["file"]}

    def timed(prompts, tokens, lynx):
        eng.set_lynx(lynx)
        measure(eng, prompts, tokens + 1)  # untimed: the same test once (llama-bench's warm-up)
        return float(measure(eng, prompts, tokens + 1)["decode_tok_s"])

    with RssWatch() as serve:
        out["b1"] = timed(p1, n, "off")
        if batch > 1:
            out["off"] = timed(pB, n16, "off")
            out["on"] = timed(pB, n16, "on")
    out["serve_peak_anon"] = serve.peak["anon"] - load.start["anon"]
    return out


def _commit() -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


def run(args) -> dict:
    import torch
    from oss_checkpoint import write_oss
    from vs_llamacpp import (CACHE, cpu_flags, llama_batched_retry, llama_tg, llamacpp_build,
                             llamacpp_source, to_gguf)

    work = CACHE / "models"
    work.mkdir(parents=True, exist_ok=True)
    src = llamacpp_source()
    bins = llamacpp_build(src, 2)
    path = write_oss(work / f"oss{args.layers}-v{args.vocab}", args.layers, args.vocab)
    gguf = to_gguf(src, path, work / f"oss{args.layers}-v{args.vocab}-mxfp4.gguf", "bf16")
    if args.prefill:
        return run_prefill(args, bins, path, gguf)
    rows = {"llama_b1": [], "llama_bB": [], "ours": []}
    for r in range(args.rounds):
        rows["llama_b1"].append(llama_tg(bins, gguf, args.threads, args.n)["tok_s"])
        if args.batch > 1:
            rows["llama_bB"].append(llama_batched_retry(bins, gguf, args.threads, args.batch, args.prompt, args.n16))
        cmd = [sys.executable, __file__, "--child", str(path), "--threads", str(args.threads), "-n", str(args.n),
               "--batch", str(args.batch), "--n16", str(args.n16), "--prompt", str(args.prompt)]
        cmd += ["--int4-act", args.int4_act] if args.int4_act else []
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"the lynx-edge child failed: {res.stderr[-2000:]}")
        rows["ours"].append(json.loads(res.stdout.strip().splitlines()[-1]))
        bb = f", {rows['llama_bB'][-1]:.1f} B={args.batch}" if args.batch > 1 else ""
        print(f"round {r + 1}: llama.cpp {rows['llama_b1'][-1]:.2f} tok/s B=1{bb}; lynx-edge {rows['ours'][-1]}",
              flush=True)
    med = statistics.median
    ours = {k: med(o[k] for o in rows["ours"]) for k in rows["ours"][0]}
    commit = _commit()
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "lynx_edge": commit,
           "torch": torch.__version__, "machine": cpu_flags(), "threads": args.threads,
           "int4_act": args.int4_act or "default", "layers": args.layers, "vocab": args.vocab,
           "checkpoint_bytes": sum(f.stat().st_size for f in path.glob("*.safetensors")),
           "gguf_bytes": gguf.stat().st_size, "rounds": rows, "ours": ours,
           "b1": {"llama": med(rows["llama_b1"]), "ours": ours["b1"], "ratio": ours["b1"] / med(rows["llama_b1"])}}
    if args.batch > 1:
        ll = med(rows["llama_bB"])
        res["bB"] = {"batch": args.batch, "llama": ll, "off": ours["off"], "on": ours["on"],
                     "ratio_off": ours["off"] / ll, "ratio_on": ours["on"] / ll}
    return res


def run_prefill(args, bins: Path, path: Path, gguf: Path) -> dict:
    """Prompt processing, llama-bench pp and lynx-edge's prefill alternating round by round → medians."""
    import torch
    from vs_llamacpp import cpu_flags, sh

    rows = {"llama_pp": [], "ours_pp": []}
    for r in range(args.rounds):
        for tool in (("llama", "ours") if r % 2 == 0 else ("ours", "llama")):
            if tool == "llama":
                out = sh([bins / "llama-bench", "-m", gguf, "-p", args.prefill, "-n", 0, "-t", args.threads, "-r", 1,
                          "-o", "json"])
                rows["llama_pp"].append(float(json.loads(out)[0]["avg_ts"]))
            else:
                cmd = [sys.executable, __file__, "--child", str(path), "--threads", str(args.threads), "--prefill",
                       str(args.prefill)] + (["--int4-act", args.int4_act] if args.int4_act else [])
                res = subprocess.run(cmd, capture_output=True, text=True)
                if res.returncode != 0:
                    raise RuntimeError(f"the lynx-edge child failed: {res.stderr[-2000:]}")
                rows["ours_pp"].append(json.loads(res.stdout.strip().splitlines()[-1])["pp"])
        print(f"round {r + 1}: pp{args.prefill} llama.cpp {rows['llama_pp'][-1]:.2f} tok/s, lynx-edge "
              f"{rows['ours_pp'][-1]:.2f}", flush=True)
    med = statistics.median
    commit = _commit()
    ll, us = med(rows["llama_pp"]), med(rows["ours_pp"])
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "lynx_edge": commit,
            "torch": torch.__version__, "machine": cpu_flags(), "threads": args.threads,
            "int4_act": args.int4_act or "default", "layers": args.layers, "vocab": args.vocab,
            "rounds": rows, "pp": {"tokens": args.prefill, "llama": ll, "ours": us, "ratio": us / ll}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--vocab", type=int, default=201088)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-r", "--rounds", type=int, default=3)
    ap.add_argument("-n", type=int, default=32, help="decode tokens at B=1")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--n16", type=int, default=16, help="decode tokens per sequence at --batch")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens per sequence at --batch")
    ap.add_argument("--int4-act", help="lynx-edge's MXFP4 activations: q16 (the AVX2 default), q8 (llama.cpp's "
                    "MXFP4 x Q8_0 scheme) or f32")
    ap.add_argument("--prefill", type=int, default=0, help="time the prefill of this many prompt tokens instead")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.threads, args.n, args.batch, args.n16, args.prompt, args.int4_act,
                               args.prefill)))
        return
    res = run(args)
    text = json.dumps(res, indent=1)
    print(json.dumps({k: res[k] for k in ("b1", "bB", "ours", "pp") if k in res}, indent=1))
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
