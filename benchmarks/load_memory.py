"""Peak memory and speed of loading a checkpoint, per mode: plain, int4, offload, offload+int4, gptq,
fp8 (an FP8 checkpoint: experts and attention kept 8-bit on a CPU) and fp8-int4 (the same, --int4).

Writes a random qwen3_moe checkpoint (bf16, per-expert names as published checkpoints have them),
a GPTQ (RTN-packed) copy and a block-scaled FP8 copy (quant/fp8.write_checkpoint) of it, then loads each mode in a fresh subprocess with
lynx_edge.build.load_model under lynx_edge.rss.RssWatch, and records per mode: peak and final
anonymous memory (what the process allocated) and file-backed memory (the checkpoint's page
cache through the mmap, reclaimable) over the pre-load baseline, the final resident footprint of
the model, load seconds and GB/s, and the bound the loader promises:

    peak anonymous ≤ final footprint + one layer's 16-bit experts + 10%

    python benchmarks/load_memory.py                       # ≥ 2 GB of bf16 experts, all modes
    python benchmarks/load_memory.py --layers 4 --experts 16 --hidden 256 --inter 512 --out /tmp/x.json
The default run writes benchmarks/results/load_memory.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("plain", "int4", "offload", "offload-int4", "gptq", "gptq-offload", "fp8", "fp8-int4")


def write_checkpoint(path: Path, layers: int, experts: int, hidden: int, inter: int, vocab: int = 4096,
                     seed: int = 0, top_k: int = 4, heads: int | None = None, kv_heads: int | None = None,
                     head_dim: int = 64, max_positions: int = 4096) -> Path:
    """A random qwen3_moe checkpoint in bf16 with on-disk per-expert names, one safetensors shard
    per layer (as big checkpoints are sharded) plus an index. heads defaults to hidden / 64, kv_heads
    to half of them (a published model's shapes: Qwen3-30B-A3B is 32 / 4 heads of 128, top-8)."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    heads, hd = heads or max(1, hidden // 64), head_dim
    cfg = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=vocab,
               hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
               num_key_value_heads=kv_heads or max(1, heads // 2),
               head_dim=hd, intermediate_size=4 * hidden, moe_intermediate_size=inter, num_experts=experts,
               num_experts_per_tok=min(top_k, experts), norm_topk_prob=True, max_position_embeddings=max_positions,
               rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False, torch_dtype="bfloat16",
               eos_token_id=0, bos_token_id=None)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))

    def rnd(*shape, scale=0.02):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    Hkv = cfg["num_key_value_heads"]
    weight_map = {}
    head = {"model.embed_tokens.weight": rnd(vocab, hidden), "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            "lm_head.weight": rnd(vocab, hidden)}
    save_file(head, str(path / "model-head.safetensors"))
    weight_map.update({k: "model-head.safetensors" for k in head})
    for i in range(layers):
        p = f"model.layers.{i}."
        t = {p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
             p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
             p + "self_attn.q_proj.weight": rnd(heads * hd, hidden), p + "self_attn.k_proj.weight": rnd(Hkv * hd, hidden),
             p + "self_attn.v_proj.weight": rnd(Hkv * hd, hidden), p + "self_attn.o_proj.weight": rnd(hidden, heads * hd),
             p + "self_attn.q_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
             p + "self_attn.k_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
             p + "mlp.gate.weight": rnd(experts, hidden)}
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            t[q + "gate_proj.weight"] = rnd(inter, hidden)
            t[q + "up_proj.weight"] = rnd(inter, hidden)
            t[q + "down_proj.weight"] = rnd(hidden, inter)
        name = f"model-{i:05d}.safetensors"
        save_file(t, str(path / name))
        weight_map.update({k: name for k in t})
        del t
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def write_gptq(src: Path, dst: Path, group: int = 128) -> Path:
    """The same model with RTN-INT4 experts in GPTQ format (v1 zeros), one layer at a time."""
    import torch

    from lynx_edge.checkpoint import Checkpoint
    from lynx_edge.quant.gptq import write_gptq_checkpoint
    from lynx_edge.quant.int4 import quantize_experts

    ck = Checkpoint(src)
    cfg = json.loads((src / "config.json").read_text())
    L, E = cfg["num_hidden_layers"], cfg["num_experts"]
    layers = {}
    for i in range(L):
        p = f"model.layers.{i}.mlp.experts."
        gu = torch.stack([torch.cat([ck.get(f"{p}{e}.gate_proj.weight"), ck.get(f"{p}{e}.up_proj.weight")]) for e in range(E)])
        dn = torch.stack([ck.get(f"{p}{e}.down_proj.weight") for e in range(E)])
        layers[i] = quantize_experts(gu.float(), dn.float(), group, True)
    extra = {k: ck.get(k).clone() for k in ck.names() if ".experts." not in k}
    return write_gptq_checkpoint(dst, layers, naming="qwen", config=cfg, extra_tensors=extra)


def footprint(model) -> int:
    """Bytes the loaded model keeps: parameters/buffers, INT4 blocks and the offload store."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    for i in model.cfg.moe_layer_ids:
        ex = model.layers[i].mlp.experts
        packed = getattr(ex, "packed", None)
        if packed is not None:
            total += packed.data.numel()
        if hasattr(ex, "gate_up_scale"):  # resident FP8 experts (quant/fp8.Fp8MoEExperts): codes and block scales
            total += sum(t.numel() * t.element_size() for t in (ex.gate_up, ex.gate_up_scale, ex.down, ex.down_scale))
    rt = getattr(model, "offload", None)
    if rt is not None:
        total += rt.store.host_bytes() + rt.pool.numel()
        if rt.store.staging is not None:
            total += rt.store.staging.numel()
    return total


def child(mode: str, ckpt: Path, dtype: str | None, threads: int) -> dict:
    """Load once (in this fresh process) and measure."""
    import torch

    torch.set_num_threads(threads)
    from lynx_edge.build import LoadOptions, load_model
    from lynx_edge.config import ModelConfig
    from lynx_edge.rss import RssWatch

    # the modules a load may import lazily (INT4 / offload backends and their compiled CPU kernels:
    # numba alone is ~20 MB) are a once-per-process cost, not load memory: import them first
    import lynx_edge.offload.runtime  # noqa: F401
    import lynx_edge.quant.experts  # noqa: F401

    cfg = ModelConfig.from_file(ckpt / "config.json")
    opts = LoadOptions(device="cpu", dtype=dtype, offload="offload" in mode, int4=mode.endswith("int4"),
                       offload_options=dict(profile="cpu-only") if "offload" in mode else None)
    t0 = time.perf_counter()
    with RssWatch() as w:
        model = load_model(ckpt, cfg, opts)
    secs = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    return dict(mode=mode, dtype=str(model.dtype).replace("torch.", ""), seconds=secs, checkpoint_bytes=size,
                load_gb_s=size / secs / 1e9, footprint=footprint(model), **w.report())


def run(args) -> dict:
    import torch

    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="lynx_load_"))
    src = work / "bf16"
    if not (src / "config.json").is_file():
        write_checkpoint(src, args.layers, args.experts, args.hidden, args.inter)
    modes = args.modes.split(",")
    if any(m.startswith("gptq") for m in modes) and not (work / "gptq" / "config.json").is_file():
        write_gptq(src, work / "gptq")
    if any(m.startswith("fp8") for m in modes) and not (work / "fp8" / "config.json").is_file():
        from lynx_edge.quant.fp8 import write_checkpoint as write_fp8

        write_fp8(src, work / "fp8", (128, 128))
    layer16 = args.experts * 3 * args.hidden * args.inter * 2  # one layer's bf16 experts
    rows = []
    for mode in modes:
        ck = work / ("gptq" if mode.startswith("gptq") else "fp8" if mode.startswith("fp8") else "bf16")
        cmd = [sys.executable, __file__, "--child", mode, "--dir", str(ck), "--threads", str(args.threads)]
        if args.dtype:
            cmd += ["--dtype", args.dtype]
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
        if out.returncode != 0:
            raise SystemExit(f"{mode}: load failed\n{out.stderr[-2000:]}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        r["bound"] = int((r["footprint"] + layer16) * 1.10)
        r["within_bound"] = r["peak_anon"] <= r["bound"]
        r["peak_over_footprint"] = r["peak_anon"] / max(1, r["footprint"])
        rows.append(r)
        print(f"{mode:13s} peak anon {r['peak_anon'] / 2**20:8.1f} MiB  final anon {r['end_anon'] / 2**20:8.1f} MiB  "
              f"footprint {r['footprint'] / 2**20:8.1f} MiB  bound {r['bound'] / 2**20:8.1f} MiB  "
              f"file {r['peak_file'] / 2**20:8.1f} MiB  {r['seconds']:6.2f} s  {r['load_gb_s']:5.2f} GB/s", flush=True)
    experts16 = args.layers * layer16
    return dict(machine=dict(cpu_count=os.cpu_count(), torch=torch.__version__, threads=args.threads),
                checkpoint=dict(layers=args.layers, experts=args.experts, hidden=args.hidden, inter=args.inter,
                                bf16_expert_bytes=experts16, one_layer_bf16_expert_bytes=layer16),
                rows=rows)


def to_markdown(res: dict) -> str:
    c = res["checkpoint"]
    lines = [f"# Load memory — random qwen3_moe, {c['layers']} layers × {c['experts']} experts, D={c['hidden']}, "
             f"I={c['inter']} ({c['bf16_expert_bytes'] / 1e9:.2f} GB of bf16 experts), CPU, "
             f"{res['machine']['threads']} threads", "",
             "Anonymous = memory the process allocated; file-backed = the checkpoint's pages through the mmap "
             "(page cache, reclaimable). Bound = (final footprint + one layer's bf16 experts) × 1.1.", "",
             "| mode | dtype | peak anon MiB | final anon MiB | footprint MiB | bound MiB | within | peak file MiB | s | GB/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        mib = lambda k: f"{r[k] / 2**20:.0f}"  # noqa: E731
        lines.append(f"| {r['mode']} | {r['dtype']} | {mib('peak_anon')} | {mib('end_anon')} | {mib('footprint')} | "
                     f"{mib('bound')} | {'yes' if r['within_bound'] else 'NO'} | {mib('peak_file')} | "
                     f"{r['seconds']:.2f} | {r['load_gb_s']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--dtype", default=None, help="model dtype (default: the runtime's CPU default)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", default=None, help="work directory (checkpoints are cached there)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/load_memory.json + .md)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, Path(args.dir), args.dtype, args.threads)))
        return
    res = run(args)
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / "load_memory.json"
    out.write_text(json.dumps(res, indent=1) + "\n")
    out.with_suffix(".md").write_text(to_markdown(res))


if __name__ == "__main__":
    main()
