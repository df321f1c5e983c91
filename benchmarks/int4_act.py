"""4-bit attention and integer activations on a CPU: what they cost in quality and give in speed.

Variants of the demo model (or --model), all loaded on the CPU in bf16 (--dtype) around the 4-bit weights:
    16-bit                      the reference
    experts 4-bit               `lynx-edge quantize` (experts only, as before)
    experts + attention 4-bit   `lynx-edge quantize --attn` (attention read packed: quant/linear.py)
    … --int4-act q16            the same with int16 activations (a scale per weight group, integer dots)
    … --int4-act q8             the same with int8 activations (Q8 blocks of 32, integer dots)
    --int4 [--int4-attn]        the 16-bit checkpoint quantised at load (RTN, no calibration):
                                experts, and with --int4-attn attention too

Quality: teacher-forced perplexity on the last three quarters of heldout.txt in windows of
--window tokens (32: every 4-bit call then runs the decode-sized kernels, where q8 applies), the
KL divergence of each variant's next-token distribution from the f32-activation variant of the same
checkpoint, and top-1 agreement with it. Speed: decode tok/s at B=1 and B=16, variants interleaved
per round (medians), same threads.

    python benchmarks/int4_act.py [--model demo] [--method gptq] [--threads 1] [-r 5]
Writes benchmarks/results/int4_act.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def logits_of(engine, windows: list[list[int]]) -> list[torch.Tensor]:
    from lynx_edge.step import prefill

    return [prefill(engine.model, engine._cache(1), 0, ids, 0, logits_for="all")[0].float() for ids in windows]


def quality(logits: list[torch.Tensor], windows, ref: list[torch.Tensor] | None) -> dict:
    nll = n = 0.0
    kl = agree = 0.0
    for lg, ids, rf in zip(logits, windows, ref or logits):
        nll += torch.nn.functional.cross_entropy(lg[:-1], torch.tensor(ids[1:]), reduction="sum").item()
        n += len(ids) - 1
        lp, lr = lg.log_softmax(-1), rf.log_softmax(-1)
        kl += (lr.exp() * (lr - lp)).sum().item()
        agree += (lg.argmax(-1) == rf.argmax(-1)).sum().item()
    rows = sum(lg.shape[0] for lg in logits)
    return {"ppl": math.exp(nll / n), "kl_vs_f32": kl / rows, "top1_agree_vs_f32": agree / rows}


def weight_bytes(model) -> int:
    """Parameters, buffers and INT4 expert blocks (Int4MoEExperts.packed, a plain object)."""
    n = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    return n + sum(m.packed.data.numel() for m in model.modules() if hasattr(getattr(m, "packed", None), "layout"))


def decode_speed(engines: dict, reps: int, n: int) -> dict:
    """variant → {B: [decode tok/s per round]} for B = 1 and 16 (16-token synthetic prompts), the
    variants interleaved within each round after one warm-up each."""
    from lynx_edge.bench import measure, synthetic_prompts

    speed = {k: {1: [], 16: []} for k in engines}
    prompts = {b: synthetic_prompts(next(iter(engines.values())), b, 16) for b in (1, 16)}
    for e in engines.values():  # warm-up
        for b in (1, 16):
            measure(e, prompts[b], 4)
    for _ in range(reps):
        for b in (1, 16):
            for k, e in engines.items():
                speed[k][b].append(float(measure(e, prompts[b], n + 1)["decode_tok_s"]))
    return speed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--method", default="gptq", help="gptq | rtn")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--max-windows", type=int, default=400)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("-r", "--reps", type=int, default=5)
    ap.add_argument("-n", type=int, default=32, help="decode steps per timed run")
    ap.add_argument("--dtype", default="bfloat16", help="the dtype around the 4-bit weights (float32: the rows' "
                    "own error, without bf16's rounding of every activation)")
    ap.add_argument("--acts", default="q16,q8", help="integer activations to set beside f32")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/int4_act"))
    args = ap.parse_args()
    from lynx_edge import Engine
    from lynx_edge.bench import cpu_isa
    from lynx_edge.quantize import quantize_model
    from lynx_edge.threads import set_threads

    set_threads(args.threads, explicit=True)
    tmp = tempfile.TemporaryDirectory()
    ckpt = {}
    for name, attn in (("experts", False), ("experts+attn", True)):
        t = time.time()
        ckpt[name] = quantize_model(args.model, Path(tmp.name) / name, method=args.method, group_size=args.group,
                                    attention=attn)
        print(f"quantized {name} in {time.time() - t:.0f} s", flush=True)
    acts = [a for a in args.acts.split(",") if a]
    f32 = {"int4_act": "f32"}  # the exact rows, whatever the default
    variants = {"16-bit": (args.model, {})}
    ref_of = {}
    for name, src, kw in (("experts 4-bit", ckpt["experts"], {}), ("experts + attention 4-bit", ckpt["experts+attn"], {}),
                          # the same from the 16-bit checkpoint at load: RTN, no calibration
                          ("--int4 --int4-attn (RTN experts + attention at load)", args.model,
                           {"int4": True, "int4_attn": True})):
        variants[name] = (src, kw | f32)
        for a in acts:
            variants[f"{name}, --int4-act {a}"] = (src, kw | {"int4_act": a})
            ref_of[f"{name}, --int4-act {a}"] = name
    engines = {k: Engine.from_pretrained(src, device="cpu", dtype=args.dtype, max_num_seqs=16, **kw)
               for k, (src, kw) in variants.items()}
    base = engines["16-bit"]
    text = (base.model_dir / "heldout.txt").read_text(encoding="utf-8")
    ids = base.tokenizer.encode(text[len(text) // 4 :], add_special_tokens=False)
    W = args.window
    windows = [ids[i : i + W] for i in range(0, len(ids) - W + 1, W)][: args.max_windows]
    lg = {k: logits_of(e, windows) for k, e in engines.items()}
    rows = []
    for k in engines:
        q = quality(lg[k], windows, lg.get(ref_of.get(k, k)))
        if k not in ref_of:
            q["kl_vs_f32"] = q["top1_agree_vs_f32"] = None
        rows.append({"variant": k, **q, "ppl_change_pct": 100 * (q["ppl"] / quality(lg["16-bit"], windows, None)["ppl"] - 1),
                     "weights_mb": weight_bytes(engines[k].model) / 1e6})
    speed = decode_speed(engines, args.reps, args.n)
    for r in rows:
        for b in (1, 16):
            r[f"tok_s_b{b}"] = statistics.median(speed[r["variant"]][b])
            r[f"tok_s_b{b}_all"] = speed[r["variant"]][b]
    res = {"model": args.model, "method": args.method, "group": args.group, "window": W, "windows": len(windows),
           "threads": args.threads, "cpu_capability": cpu_isa(), "reps": args.reps, "n": args.n,
           "loadavg": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "dtype": args.dtype, "rows": rows}
    Path(args.out + ".json").write_text(json.dumps(res, indent=1))
    md = [f"# 4-bit attention and integer activations on a CPU ({args.model}, {args.method.upper()} G={args.group}, {args.dtype} "
          "around the 4-bit weights)", "",
          f"Quality: teacher-forced over {len(windows)} windows of {W} tokens from the last three quarters of "
          "heldout.txt (every 4-bit call runs the decode-sized kernels at ≤ 32 rows). KL and top-1 compare each "
          "integer-activation variant with the same checkpoint's f32-activation logits. Speed: decode tok/s, medians of "
          f"{args.reps} interleaved rounds, {args.threads} thread(s), CPU capability {res['cpu_capability']}, "
          f"load average {res['loadavg'][0]:.2f}.", "",
          "| variant | perplexity | vs 16-bit | KL vs f32 act | top-1 agree | weights MB | B=1 tok/s | B=16 tok/s |",
          "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kl = "–" if r["kl_vs_f32"] is None else f"{r['kl_vs_f32']:.2e}"
        top1 = "–" if r["top1_agree_vs_f32"] is None else f"{100 * r['top1_agree_vs_f32']:.2f}%"
        md.append(f"| {r['variant']} | {r['ppl']:.3f} | {r['ppl_change_pct']:+.2f}% | {kl} | {top1} | "
                  f"{r['weights_mb']:.1f} | {r['tok_s_b1']:.1f} | {r['tok_s_b16']:.1f} |")
    Path(args.out + ".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
