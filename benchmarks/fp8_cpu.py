"""FP8 checkpoints on a CPU: what reading them 8-bit gives against the same model in bf16.

Variants of one model, loaded on the CPU with dtype bf16 around the quantized weights:
    bf16                        the 16-bit checkpoint (the reference)
    FP8 checkpoint              quant/fp8.write_checkpoint of it (experts and attention e4m3, 128×128
                                block scales, as Qwen3-*-FP8 are published), read 8-bit (Fp8MoEExperts,
                                Fp8Linear)
    FP8 checkpoint, --int4      the FP8 checkpoint re-quantized to INT4 at load (RTN, group 128)

Quality (demo only: it ships heldout.txt): teacher-forced perplexity on the last three quarters
of heldout.txt in windows of --window tokens, KL of each variant's next-token distribution from
bf16's and top-1 agreement with it. What it measures is FP8 quantization of these weights, which
a published FP8 checkpoint already carries; lynx-edge reads the codes exactly. Speed: decode tok/s
at B=1 and B=16, variants interleaved per round (medians), same threads. Weights: resident bytes.

    python benchmarks/fp8_cpu.py --model demo --threads 1 -r 5
    python benchmarks/fp8_cpu.py --model ~/.cache/lynx-edge/llamacpp/models/random-qwen3moe --no-quality
Writes benchmarks/results/fp8_cpu_<name>.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from int4_act import decode_speed, logits_of, quality  # noqa: E402


def weight_bytes(model) -> int:
    """Parameters, buffers, INT4 blocks and FP8 expert codes + scales (plain tensors on their modules)."""
    n = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    for m in model.modules():
        if hasattr(getattr(m, "packed", None), "layout"):
            n += m.packed.data.numel()
        if hasattr(m, "gate_up_scale"):  # Fp8MoEExperts
            n += sum(t.numel() * t.element_size() for t in (m.gate_up, m.gate_up_scale, m.down, m.down_scale))
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--max-windows", type=int, default=400)
    ap.add_argument("--no-quality", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("-r", "--reps", type=int, default=5)
    ap.add_argument("-n", type=int, default=32, help="decode steps per timed run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from lynx_edge import Engine
    from lynx_edge.bench import cpu_isa
    from lynx_edge.hub import resolve_model
    from lynx_edge.quant.fp8 import write_checkpoint
    from lynx_edge.threads import set_threads

    set_threads(args.threads, explicit=True)
    src = resolve_model(args.model)
    tmp = tempfile.TemporaryDirectory()
    t = time.time()
    fp8 = write_checkpoint(src, Path(tmp.name) / "fp8", (128, 128))
    print(f"wrote the FP8 checkpoint in {time.time() - t:.0f} s", flush=True)
    variants = {"bf16": (src, {}), "FP8 checkpoint": (fp8, {}), "FP8 checkpoint, --int4": (fp8, {"int4": True})}
    engines = {k: Engine.from_pretrained(p, device="cpu", dtype="bfloat16", max_num_seqs=16, **kw)
               for k, (p, kw) in variants.items()}
    base = engines["bf16"]
    rows = [{"variant": k, "experts": e.model.placement.experts, "packed_linears": e.model.placement.packed_linears,
             "weights_mb": weight_bytes(e.model) / 1e6} for k, e in engines.items()]
    if not args.no_quality:
        text = (base.model_dir / "heldout.txt").read_text(encoding="utf-8")
        ids = base.tokenizer.encode(text[len(text) // 4:], add_special_tokens=False)
        W = args.window
        windows = [ids[i:i + W] for i in range(0, len(ids) - W + 1, W)][: args.max_windows]
        lg = {k: logits_of(e, windows) for k, e in engines.items()}
        ppl16 = quality(lg["bf16"], windows, None)["ppl"]
        for r in rows:
            q = quality(lg[r["variant"]], windows, lg["bf16"])
            r.update(ppl=q["ppl"], ppl_change_pct=100 * (q["ppl"] / ppl16 - 1), kl_vs_bf16=q["kl_vs_f32"],
                     top1_agree_vs_bf16=q["top1_agree_vs_f32"])
    speed = decode_speed(engines, args.reps, args.n)
    for r in rows:
        for b in (1, 16):
            r[f"tok_s_b{b}"] = statistics.median(speed[r["variant"]][b])
            r[f"tok_s_b{b}_all"] = speed[r["variant"]][b]
            r[f"speedup_b{b}"] = r[f"tok_s_b{b}"] / statistics.median(speed["bf16"][b])
    name = "demo" if args.model == "demo" else Path(src).name
    res = {"model": str(src), "threads": args.threads, "cpu_capability": cpu_isa(), "reps": args.reps, "n": args.n,
           "loadavg": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}
    out = Path(args.out or ROOT / f"benchmarks/results/fp8_cpu_{name}")
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    md = [f"# FP8 checkpoint on a CPU vs the same model in bf16 ({name})", "",
          f"Decode tok/s, medians of {args.reps} interleaved rounds, {args.threads} thread(s), CPU capability "
          f"{res['cpu_capability']}, load average {res['loadavg'][0]:.2f}; dtype bf16 around the quantized weights. "
          "The FP8 checkpoint is quant/fp8.write_checkpoint of the bf16 one (128×128 blocks, experts and attention)."
          + ("" if args.no_quality else f" Quality: teacher-forced, {len(windows)} windows of {args.window} tokens "
             "of heldout.txt; KL and top-1 against bf16."), "",
          "| variant | experts | linears kept 8/4-bit | weights MB | " + ("perplexity | vs bf16 | KL vs bf16 | top-1 agree | "
                                                                    if not args.no_quality else "")
          + "B=1 tok/s | × bf16 | B=16 tok/s | × bf16 |",
          "|---|---|---|---|" + ("---|---|---|---|" if not args.no_quality else "") + "---|---|---|---|"]
    for r in rows:
        q = "" if args.no_quality else (f"{r['ppl']:.3f} | {r['ppl_change_pct']:+.2f}% | {r['kl_vs_bf16']:.2e} | "
                                        f"{100 * r['top1_agree_vs_bf16']:.2f}% | ")
        md.append(f"| {r['variant']} | {r['experts']} | {r['packed_linears']} | {r['weights_mb']:.1f} | {q}"
                  f"{r['tok_s_b1']:.1f} | {r['speedup_b1']:.2f} | {r['tok_s_b16']:.1f} | {r['speedup_b16']:.2f} |")
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
