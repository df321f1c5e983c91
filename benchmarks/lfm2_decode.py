"""LFM2-MoE's CPU decode, two paths side by side in one engine, alternating rounds:

- `--compare conv` (default): on the module path, the short convolutions as one native call a layer
  (native.short_conv: B·x, the depthwise causal conv over the row's state, C·y) against the torch
  path it replaced (state.causal_conv and the gating muls: ~12 torch ops a conv layer);
- `--compare layer`: the MoE layers in the native layer call (models/native_layer.py: the norm, the
  convolution or attention, the residual, the norm and the router logits in one call; the sigmoid
  scorer and routing in torch; the experts and the residual in a second call) against the module
  path (its convolution native too), bf16 and `--int4 --int4-attn`.

The checkpoint: a random LFM2-MoE at LFM2-8B-A1B's widths (hidden 2048, 32 heads / 8 kv heads, 32
experts of 1792 top-4, kernel 3) with the published first 8 layers' types (6 conv, 2 attention), all
MoE, vocabulary 4096 (tests/lfm2_tiny.py, written once under ~/.cache/lynx-edge/bench). Decode tok/s
over 24 tokens after 16-token prompts, medians and the median paired ratio; bf16, and `--int4`
experts (what a laptop runs).

`--compare int4attn`: `--int4` against `--int4 --int4-attn` on the same checkpoint (the convolutions'
in/out projections, attention's q/k/v/o and the dense MLPs INT4 too, RTN at load) and against
`--int4-attn` with the convolutions' projections left bf16 (what it did before session 37), the
engines loaded once, rounds in turn (reversed every other round); with each engine's resident weights
outside the experts (those every token reads: the packed experts live outside the module tree).

    python benchmarks/lfm2_decode.py [--compare conv|layer] [--batch 1,16] [--threads 1] [-r 5] [--out benchmarks/results/lfm2_decode_s37.json]
    python benchmarks/lfm2_decode.py --compare int4attn [--out benchmarks/results/lfm2_int4attn_s37.json]
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

from vs_llamacpp import ab_parser, engines_ab, paired_ratio  # noqa: E402

WIDTHS = dict(vocab_size=4096, hidden_size=2048, intermediate_size=7168, moe_intermediate_size=1792,
              num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=8, num_dense_layers=0,
              initializer_range=0.02)


def checkpoint() -> Path:
    path = Path.home() / ".cache/lynx-edge/bench/lfm2-8b-a1b-widths-8l"
    if not (path / "config.json").is_file():
        from lfm2_tiny import make_lfm2_moe  # needs transformers (the dev extra)

        print(f"writing the random LFM2-MoE checkpoint {path} …", flush=True)
        make_lfm2_moe(path, **WIDTHS)
    return path


def main() -> None:
    ap = ab_parser(__doc__)
    ap.add_argument("--compare", choices=("conv", "layer", "int4attn"), default="conv")
    a = ap.parse_args()
    from lynx_edge import Engine
    from lynx_edge.bench import cpu_isa, synthetic_prompts
    from lynx_edge.models.lfm2_moe import ShortConv
    from lynx_edge.threads import set_threads

    set_threads(a.threads, explicit=True)
    path = checkpoint()
    if a.compare == "int4attn":
        return compare_int4_attn(path, a)
    from lynx_edge.models import native_layer

    native_ok, layers_on = ShortConv._native_ok, native_layer.NATIVE_LAYERS
    if a.compare == "conv":  # the module path's convolution (a layer call runs its own)
        def use(k):
            native_layer.NATIVE_LAYERS = False
            ShortConv._native_ok = native_ok if k == "native" else lambda self, x, state: False
        names, configs = ("native", "torch"), ({}, {"int4": True})
    else:  # the layer call against the module path (its convolution native too)
        def use(k):
            native_layer.NATIVE_LAYERS = k == "layer_call"
        names, configs = ("layer_call", "module_path"), ({}, {"int4": True, "int4_attn": True})
    rows = []
    try:
        for kw in configs:
            for B in (int(b) for b in a.batch.split(",")):
                eng = Engine.from_pretrained(path, device="cpu", max_num_seqs=B, dtype="bfloat16", **kw)
                tok_s = engines_ab(dict.fromkeys(names, eng), synthetic_prompts(eng, B, 16), a.rounds, 24, use=use)
                row = {"experts": "int4" if kw else "bf16", "int4_attn": bool(kw.get("int4_attn")), "batch": B,
                       "threads": a.threads, "tok_s": {k: round(statistics.median(v), 2) for k, v in tok_s.items()},
                       f"{names[0]}_vs_{names[1]}": paired_ratio(tok_s[names[0]], tok_s[names[1]])}
                rows.append(row)
                print(row, flush=True)
                del eng
    finally:
        ShortConv._native_ok, native_layer.NATIVE_LAYERS = native_ok, layers_on
    if a.out:
        a.out.write_text(json.dumps({"benchmark": __doc__.split("\n")[0], "isa": cpu_isa(), "rounds": a.rounds,
                                     "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                     "widths": WIDTHS, "rows": rows}, indent=1) + "\n")


def compare_int4_attn(path: Path, a) -> None:
    from lynx_edge import Engine
    from lynx_edge.bench import cpu_isa, synthetic_prompts
    from lynx_edge.modelinfo import dense_decode_bytes

    from lynx_edge.models.lfm2_moe import ShortConv

    batches = [int(b) for b in a.batch.split(",")]

    def load(**kw):
        return Engine.from_pretrained(path, device="cpu", max_num_seqs=max(batches), dtype="bfloat16", int4=True, **kw)

    engines = {"int4": load(), "int4+attn": load(int4_attn=True)}
    conv = ShortConv.INT4_PROJECTIONS
    ShortConv.INT4_PROJECTIONS = ()  # what --int4-attn made INT4 before session 37: the convolutions stay bf16
    try:
        engines["int4+attn, conv bf16"] = load(int4_attn=True)
    finally:
        ShortConv.INT4_PROJECTIONS = conv
    # MiB every token reads outside the routed experts (modelinfo.dense_decode_bytes)
    non_expert_mb = {k: round(dense_decode_bytes(e.model) / 2**20, 1) for k, e in engines.items()}
    rows = []
    for B in batches:
        tok_s = engines_ab(engines, synthetic_prompts(engines["int4"], B, 16), a.rounds, 24)
        row = {"batch": B, "threads": a.threads, "tok_s": {k: round(statistics.median(v), 2) for k, v in tok_s.items()},
               **{f"{k}_vs_int4": paired_ratio(tok_s[k], tok_s["int4"]) for k in engines if k != "int4"}}
        rows.append(row)
        print(row, flush=True)
    print({"non_expert_mb": non_expert_mb}, flush=True)
    if a.out:
        a.out.write_text(json.dumps({"benchmark": "lfm2_decode.py --compare int4attn", "isa": cpu_isa(),
                                     "rounds": a.rounds, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                     "widths": WIDTHS, "non_expert_mb": non_expert_mb, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
