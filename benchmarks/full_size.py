"""Full-size MoE models on this box, lynx-edge vs llama.cpp, CPU decode: gpt-oss-20b (`--model oss`: all 24
layers, the real 201088-token vocabulary, 13.8 GB of MXFP4 experts and bf16 rest, as published) and
LFM2-8B-A1B (`--model lfm2`: 24 layers, 65536-token vocabulary, 16.7 GB of bf16 as published); random
weights in the published layouts (benchmarks/oss_checkpoint.py, benchmarks/lfm2_checkpoint.py).

vs_llamacpp.py keeps one engine loaded while llama.cpp runs beside it, which a 24 GB box cannot do
with two copies of these models: here each round runs llama.cpp (llama-bench B=1,
llama-batched-bench B=16; its GGUF mmapped) and then lynx-edge in a fresh process (load under
RssWatch, then B=1 and B=16 LYNX off / on, each timed after an untimed run of the same test), so
only one copy is resident at a time. Rounds alternate the two tools; medians are reported. The
child also records load seconds and the peak anonymous / file-backed memory of load and serving.

`--bits` picks the pairs (vs_llamacpp.PAIRS): gpt-oss `mxfp4` (its MXFP4 experts on both sides; the
default), LFM2 `bf16` (llama.cpp BF16) and `int4all` (`--int4 --int4-attn --int8-head`, RTN INT4 at
load from the bf16 checkpoint, against llama-quantize's Q4_0 of the BF16 GGUF).

    python benchmarks/full_size.py --threads 2 -r 3 --out benchmarks/results/oss_full_s29.json
    python benchmarks/full_size.py --model lfm2 --bits bf16,int4all --threads 2 -r 3 --out benchmarks/results/lfm2_full_s38.json
With --prefill P it times prompt processing instead: llama-bench -p P -n 0 against lynx-edge's prefill
of one P-token prompt (after an untimed 64-token one), tok/s.
Needs ~28 GB (gpt-oss) or ~40 GB (LFM2: checkpoint, BF16 and Q4_0 GGUFs) of disk, cached under
~/.cache/lynx-edge/llamacpp/models, and the llama.cpp build of vs_llamacpp.py (built on first use).
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


def child(path: Path, threads: int, n: int, batch: int, n16: int, prompt: int, engine_kw: dict,
          prefill: int = 0) -> dict:
    """One fresh process: load, then B=1 and B=batch decode → tok/s and memory (prefill > 0: that
    many prompt tokens' prefill → tok/s instead)."""
    from lynx_edge import Engine
    from lynx_edge.bench import measure, synthetic_prompts
    from lynx_edge.rss import RssWatch
    from lynx_edge.threads import set_threads

    if prefill:
        from lynx_edge.step import prefill as run_prefill

        eng = Engine.from_pretrained(path, device="cpu", threads=threads, **engine_kw)
        set_threads(threads, explicit=True)
        ids, kv = synthetic_prompts(eng, 1, prefill)[0], eng._cache(1)
        run_prefill(eng.model, kv, 0, ids[:64], 0)  # untimed (llama-bench's warm-up)
        t0 = time.perf_counter()
        run_prefill(eng.model, kv, 0, ids, 0)
        return {"pp": prefill / (time.perf_counter() - t0)}

    t0 = time.perf_counter()
    with RssWatch() as load:
        eng = Engine.from_pretrained(path, device="cpu", threads=threads, max_num_seqs=batch, **engine_kw)
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


# per model: its writer (module, function), full depth and vocabulary, and the bits it is compared at by default
MODELS = {"oss": dict(writer=("oss_checkpoint", "write_oss"), layers=24, vocab=201088, bits="mxfp4"),
          "lfm2": dict(writer=("lfm2_checkpoint", "write_lfm2"), layers=24, vocab=65536, bits="bf16,int4all")}


def _engine_kw(args, bits: str) -> dict:
    from vs_llamacpp import PAIRS

    kw = dict(PAIRS[bits][1])
    if args.int4_act:
        kw["int4_act"] = args.int4_act
    return kw


def _ours(args, path: Path, bits: str, prefill: int = 0) -> dict:
    """The lynx-edge child's result (a fresh process)."""
    cmd = [sys.executable, __file__, "--child", str(path), "--threads", str(args.threads), "-n", str(args.n),
           "--batch", str(args.batch), "--n16", str(args.n16), "--prompt", str(args.prompt),
           "--prefill", str(prefill), "--engine-kw", json.dumps(_engine_kw(args, bits))]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"the lynx-edge child failed: {res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def prepare(args) -> tuple[Path, Path, dict]:
    """→ (the llama.cpp bin dir, the checkpoint, {bits: its GGUF}), each made once and cached."""
    import importlib

    from vs_llamacpp import CACHE, PAIRS, llamacpp_build, llamacpp_source, quantize, to_gguf

    module, writer = MODELS[args.model]["writer"]
    work = CACHE / "models"
    work.mkdir(parents=True, exist_ok=True)
    src = llamacpp_source()
    bins = llamacpp_build(src, 2)
    name = f"{args.model}-{args.layers}l-v{args.vocab}"
    path = getattr(importlib.import_module(module), writer)(work / name, args.layers, args.vocab)
    # the converter's bf16 keeps gpt-oss's MXFP4 experts MXFP4; other types are quantised from it
    bf16 = to_gguf(src, path, work / f"{name}-bf16.gguf", "bf16")
    ggufs = {}
    for bits in args.bits.split(","):
        kind = PAIRS[bits][0]
        ggufs[bits] = bf16 if kind in ("BF16", "MXFP4") else quantize(bins, bf16, work / f"{name}-{kind.lower()}.gguf",
                                                                         2, kind)
    return bins, path, ggufs


def _page_in(path: Path) -> None:
    """Read the file through once, so llama.cpp's mmap finds it in the page cache. The lynx-edge child
    before it held its own copy (16.7 GB for LFM2 in bf16), which pushed the GGUF out; llama-bench's
    warm-up touches only the experts its few tokens route to, so the timed run would read the rest
    from disk (a B=1 BF16 round at 1.95 tok/s against 4.3-5.4). Load time is not timed on either side."""
    with open(path, "rb", buffering=0) as f:
        while f.read(1 << 26):
            pass


def run(args) -> dict:
    import torch
    from vs_llamacpp import PAIRS, cpu_flags, llama_batched_retry, llama_tg, repack_off_if_it_crashes

    bins, path, ggufs = prepare(args)
    if args.prefill:
        return run_prefill(args, bins, path, ggufs)
    rows = {bits: {"llama_b1": [], "llama_bB": [], "ours": []} for bits in ggufs}
    for r in range(args.rounds):
        for bits, gguf in ggufs.items():
            row = rows[bits]
            _page_in(gguf)
            row["llama_b1"].append(llama_tg(bins, gguf, args.threads, args.n)["tok_s"])
            if args.batch > 1:
                tg, row["llama_bB_flags"] = repack_off_if_it_crashes(
                    lambda *f: llama_batched_retry(bins, gguf, args.threads, args.batch, args.prompt, args.n16, *f),
                    row.get("llama_bB_flags"), ["--no-repack"])
                row["llama_bB"].append(tg)
            row["ours"].append(_ours(args, path, bits))
            bb = f", {row['llama_bB'][-1]:.1f} B={args.batch} {' '.join(row['llama_bB_flags'])}" if args.batch > 1 else ""
            print(f"round {r + 1} {bits}: llama.cpp {PAIRS[bits][0]} {row['llama_b1'][-1]:.2f} tok/s B=1{bb}; "
                  f"lynx-edge {row['ours'][-1]}", flush=True)
    med = statistics.median
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "lynx_edge": _commit(),
           "torch": torch.__version__, "machine": cpu_flags(), "threads": args.threads, "model": args.model,
           "int4_act": args.int4_act or "default", "layers": args.layers, "vocab": args.vocab,
           "checkpoint_bytes": sum(f.stat().st_size for f in path.glob("*.safetensors")), "pairs": {}}
    for bits, row in rows.items():
        ours = {k: med(o[k] for o in row["ours"]) for k in row["ours"][0]}
        pair = {"llama_type": PAIRS[bits][0], "engine_kw": _engine_kw(args, bits), "gguf_bytes": ggufs[bits].stat().st_size,
                "rounds": row, "ours": ours,
                "b1": {"llama": med(row["llama_b1"]), "ours": ours["b1"], "ratio": ours["b1"] / med(row["llama_b1"])}}
        if args.batch > 1:
            ll = med(row["llama_bB"])
            pair["bB"] = {"batch": args.batch, "llama": ll, "off": ours["off"], "on": ours["on"],
                          "ratio_off": ours["off"] / ll, "ratio_on": ours["on"] / ll}
        res["pairs"][bits] = pair
    return res


def run_prefill(args, bins: Path, path: Path, ggufs: dict) -> dict:
    """Prompt processing, llama-bench pp and lynx-edge's prefill alternating round by round → medians
    (the first of --bits)."""
    import torch
    from vs_llamacpp import cpu_flags, repack_off_if_it_crashes, sh

    bits, gguf = next(iter(ggufs.items()))
    rows = {"llama_pp": [], "ours_pp": []}
    for r in range(args.rounds):
        for tool in (("llama", "ours") if r % 2 == 0 else ("ours", "llama")):
            if tool == "llama":
                _page_in(gguf)
                out, rows["llama_flags"] = repack_off_if_it_crashes(
                    lambda *f: sh([bins / "llama-bench", "-m", gguf, "-p", args.prefill, "-n", 0, "-t", args.threads,
                                   "-r", 1, "-o", "json", *f]), rows.get("llama_flags"), ["--repack", "0"])
                rows["llama_pp"].append(float(json.loads(out)[0]["avg_ts"]))
            else:
                rows["ours_pp"].append(_ours(args, path, bits, args.prefill)["pp"])
        print(f"round {r + 1}: pp{args.prefill} llama.cpp {rows['llama_pp'][-1]:.2f} tok/s, lynx-edge "
              f"{rows['ours_pp'][-1]:.2f}", flush=True)
    med = statistics.median
    ll, us = med(rows["llama_pp"]), med(rows["ours_pp"])
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "lynx_edge": _commit(),
            "torch": torch.__version__, "machine": cpu_flags(), "threads": args.threads, "model": args.model,
            "bits": bits, "int4_act": args.int4_act or "default", "layers": args.layers, "vocab": args.vocab,
            "rounds": rows, "pp": {"tokens": args.prefill, "llama": ll, "ours": us, "ratio": us / ll}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="oss")
    ap.add_argument("--bits", help="comma-separated vs_llamacpp.PAIRS names (default: the model's: gpt-oss mxfp4, "
                    "LFM2 bf16,int4all)")
    ap.add_argument("--layers", type=int, help="default: the model's full depth (24)")
    ap.add_argument("--vocab", type=int, help="default: the model's published vocabulary")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-r", "--rounds", type=int, default=3)
    ap.add_argument("-n", type=int, default=32, help="decode tokens at B=1")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--n16", type=int, default=16, help="decode tokens per sequence at --batch")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens per sequence at --batch")
    ap.add_argument("--int4-act", help="lynx-edge's 4-bit activations: q16 (the AVX2 default), q8 (llama.cpp's "
                    "Q4_0 / MXFP4 x Q8_0 scheme) or f32")
    ap.add_argument("--prefill", type=int, default=0, help="time the prefill of this many prompt tokens instead")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--engine-kw", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.threads, args.n, args.batch, args.n16, args.prompt,
                               json.loads(args.engine_kw), args.prefill)))
        return
    m = MODELS[args.model]
    args.layers, args.vocab, args.bits = args.layers or m["layers"], args.vocab or m["vocab"], args.bits or m["bits"]
    res = run(args)
    text = json.dumps(res, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k in ("pp",)} or
                     {b: {k: p[k] for k in ("b1", "bB", "ours") if k in p} for b, p in res["pairs"].items()}, indent=1))
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
