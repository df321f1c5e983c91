"""bf16 weights on bf16 activations (`--bf16-act bf16`) against fp32 activations on a CPU: speed and quality.

With AVX512-BF16 the native kernels multiply bf16 rows by the activations rounded to bf16 in
vdpbf16ps (32 multiply-adds an instruction, no widening: dp_block in kernels/cpu_native.c) instead
of widening each weight to fp32 (16 an instruction). The routers stay fp32.

Quality: teacher-forced over windows of --window tokens from the last three quarters of heldout.txt
(≤ 32 rows: every projection and expert call runs the decode kernels): perplexity, and the KL
divergence and top-1 agreement of each bf16 variant's next-token distribution against the fp32
checkpoint (--dtype float32, exact) and against the bf16 model on fp32 activations.
Speed: decode ms per step for B = 1, 4, 16 with LYNX off and B = 4, 16 with LYNX on, the two
activation modes alternating within each round on one engine (its modules switched between runs:
two engines' weights would evict each other from the cache), same threads; the ratio column is
the median of the per-round ratios f32 / bf16, with their min–max.

    python benchmarks/bf16_act.py [--model demo] [--threads 1] [-r 7] [--out benchmarks/results/bf16_act]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--max-windows", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("-r", "--reps", type=int, default=7)
    ap.add_argument("-n", type=int, default=32, help="decode steps per timed run")
    ap.add_argument("--batch", default="1,4,16")
    ap.add_argument("--speed-only", action="store_true", help="no quality pass (a model without heldout.txt)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/bf16_act"))
    args = ap.parse_args()
    from int4_act import logits_of, quality

    from lynx_edge import Engine
    from lynx_edge.bench import cpu_isa, measure, synthetic_prompts
    from lynx_edge.build import _bf16_activations
    from lynx_edge.kernels import native
    from lynx_edge.threads import set_threads

    if not native.bf16_dp():
        sys.exit("this build has no bf16 rows on bf16 inputs (needs AVX512-BF16): nothing to compare")
    set_threads(args.threads, explicit=True)
    sizes = [int(b) for b in args.batch.split(",")]
    mk = lambda **kw: Engine.from_pretrained(args.model, device="cpu", max_num_seqs=max(sizes), **kw)  # noqa: E731
    exact = {"f32": mk(dtype="bfloat16", bf16_act="f32"), "bf16": mk(dtype="bfloat16", bf16_act="bf16")}
    W, windows, qual = args.window, [], []
    if not args.speed_only:
        ref32 = mk(dtype="float32")
        text = (ref32.model_dir / "heldout.txt").read_text(encoding="utf-8")
        ids = ref32.tokenizer.encode(text[len(text) // 4 :], add_special_tokens=False)
        windows = [ids[i : i + W] for i in range(0, len(ids) - W + 1, W)][: args.max_windows]
        lg32 = logits_of(ref32, windows)
        lg = {k: logits_of(e, windows) for k, e in exact.items()}
        del ref32
        qual = [{"variant": "fp32 checkpoint (reference)", **quality(lg32, windows, None)}]
    for k in exact if qual else ():
        q = quality(lg[k], windows, lg32)
        qual.append({"variant": f"bf16, --bf16-act {k}", "ppl": q["ppl"], "kl_vs_fp32": q["kl_vs_f32"],
                     "top1_vs_fp32": q["top1_agree_vs_f32"]})
        if k == "bf16":
            q2 = quality(lg[k], windows, lg["f32"])
            qual[-1] |= {"kl_vs_bf16_f32act": q2["kl_vs_f32"], "top1_vs_bf16_f32act": q2["top1_agree_vs_f32"]}
    for r in qual:
        print(json.dumps(r), flush=True)

    # speed: one engine per LYNX mode whose activations switch between runs (the plans follow:
    # native_layer._key), so both modes read the same weights from the same caches
    del exact
    rows = []
    for lynx in ("off", "on"):
        eng = mk(dtype="bfloat16", bf16_act="f32", lynx=lynx)
        for B in sizes:
            if lynx == "on" and B == 1:
                continue  # nothing to pool
            prompts = synthetic_prompts(eng, B, 16)
            for k in ("f32", "bf16"):
                _bf16_activations(eng.model, k)
                measure(eng, prompts, 8)  # warm-up: plans built
            ms = {"f32": [], "bf16": []}
            for _ in range(args.reps):
                for k in ms:
                    _bf16_activations(eng.model, k)
                    ms[k].append(measure(eng, prompts, args.n + 1)["tpot_ms"])
            ratios = [a / b for a, b in zip(ms["f32"], ms["bf16"])]
            row = {"lynx": lynx, "batch": B, "ms_f32": statistics.median(ms["f32"]),
                   "ms_bf16": statistics.median(ms["bf16"]), "speedup": statistics.median(ratios),
                   "speedup_min": min(ratios), "speedup_max": max(ratios), "ms_f32_all": ms["f32"], "ms_bf16_all": ms["bf16"]}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if not k.endswith("_all")}), flush=True)
    res = {"model": args.model, "threads": args.threads, "cpu_capability": cpu_isa(), "reps": args.reps, "n": args.n,
           "window": W, "windows": len(windows), "loadavg": os.getloadavg(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "quality": qual, "speed": rows}
    Path(args.out + ".json").write_text(json.dumps(res, indent=1) + "\n")
    md = [f"# bf16 weights on bf16 activations ({args.model}, CPU, {args.threads} thread(s), {res['cpu_capability']})", "",
          f"Quality: teacher-forced over {len(windows)} windows of {W} tokens from heldout.txt; KL and top-1 against the "
          "fp32 checkpoint's logits (and the bf16 model on fp32 activations). Speed: decode ms per step, medians of "
          f"{args.reps} rounds, modes alternating; speed-up = median of per-round ratios (min–max). Load average "
          f"{res['loadavg'][0]:.2f}.", "",
          "| variant | perplexity | KL vs fp32 | top-1 vs fp32 | KL vs bf16 on fp32 act | top-1 vs it |", "|---|---|---|---|---|---|"]
    for r in qual:
        f = lambda k, pct=False: "–" if r.get(k) is None else (f"{100 * r[k]:.2f}%" if pct else f"{r[k]:.2e}")  # noqa: E731
        md.append(f"| {r['variant']} | {r['ppl']:.4f} | {f('kl_vs_fp32')} | {f('top1_vs_fp32', True)} | "
                  f"{f('kl_vs_bf16_f32act')} | {f('top1_vs_bf16_f32act', True)} |")
    md += ["", "| LYNX | B | f32 act ms | bf16 act ms | speed-up (min–max) |", "|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['lynx']} | {r['batch']} | {r['ms_f32']:.3f} | {r['ms_bf16']:.3f} | "
                  f"{r['speedup']:.2f}× ({r['speedup_min']:.2f}–{r['speedup_max']:.2f}) |")
    Path(args.out + ".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
