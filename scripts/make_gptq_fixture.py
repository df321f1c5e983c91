"""Make tests/fixtures/gptq_tiny: a tiny Qwen3-MoE quantised by gptqmodel itself (CPU).

One decoder layer, D = 64, expert I = 64, E = 4, K = 2; 4-bit, group 32, asymmetric, desc_act off,
gptqmodel's default v1 checkpoint format. Writes gptqmodel's config.json, quantize_config.json
and model.safetensors, plus expected_dequant.safetensors: the layer's experts dequantised by
gptqmodel's own TorchLinear.dequantize_weight (fp32 scales, so exact) as
`layers.0.gate_up` [E, 2I, D] and `layers.0.down` [E, D, I] — what lynx_edge.quant.formats must
reproduce. Needs `pip install gptqmodel` (not a project dependency; tested with 7.7.0, ~1–2 min):

    PYTHONPATH=. python scripts/make_gptq_fixture.py [--out tests/fixtures/gptq_tiny]

`--kind actorder` / `--kind mixed` need no gptqmodel: they pack GPTQ tensors here with a slow
loop over the format definition (lynx_edge/quant/formats.py docstring; gptqmodel's v1 zeros =
v2 word − 0x11111111) from RTN codes of a random tiny checkpoint (tests/conftest.py make_tiny):
  actorder → tests/fixtures/gptq_actorder_tiny: qwen3_moe, 1 layer, E = 4, I = 64, G = 32, asym,
    desc_act with a random act order per linear (g_idx = shuffled i // G), q/k/v/o quantized too.
  mixed → tests/fixtures/gptq_mixed_tiny: qwen2_moe, 2 layers, E = 4, G = 32, sym, attention and
    shared expert quantized, layer 1 expert 2 left 16-bit (gptqmodel `dynamic` "-:" rule).
Both write expected_dequant.safetensors: {module name: W [out, in] fp32} decoded from the packed
words by a slow per-element loop, and checked against s·(q − z) of the codes before packing.

    PYTHONPATH=. python scripts/make_gptq_fixture.py --kind actorder
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")  # gptqmodel's pool refuses 1 worker on 2 cores

import torch  # noqa: E402


def build_base(path: Path) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    Qwen3MoeForCausalLM(cfg).eval().save_pretrained(path)


def quantize(base: Path, out: Path) -> None:
    from gptqmodel import GPTQModel, QuantizeConfig

    torch.manual_seed(0)
    qc = QuantizeConfig(bits=4, group_size=32, sym=False, desc_act=False)
    model = GPTQModel.load(str(base), qc, device="cpu")
    calib = [{"input_ids": torch.randint(0, 128, (48,)).tolist(), "attention_mask": [1] * 48} for _ in range(16)]
    model.quantize(calib, batch_size=1)
    model.save(str(out))


def expected_dequant(out: Path) -> dict[str, torch.Tensor]:
    """gptqmodel's own dequantisation of layer 0's experts (it converts v1 zeros on load)."""
    from gptqmodel import BACKEND, GPTQModel

    model = GPTQModel.load(str(out), device="cpu", backend=BACKEND.TORCH, dtype=torch.float16)
    mods = dict(model.model.named_modules())
    gate_up, down = [], []
    for e in range(4):
        w = {}
        for name in ("gate_proj", "up_proj", "down_proj"):
            m = mods[f"model.layers.0.mlp.experts.{e}.{name}"]
            m.scales = m.scales.float()  # fp32 products: exact, no fp16 rounding of s·(q − z)
            w[name] = m.dequantize_weight().t().contiguous()  # [in, out] → [out, in]
        gate_up.append(torch.cat([w["gate_proj"], w["up_proj"]]))
        down.append(w["down_proj"])
    return {"layers.0.gate_up": torch.stack(gate_up).float(), "layers.0.down": torch.stack(down).float()}


# ------------------------------------------------------------------ writers without gptqmodel

ROOT = Path(__file__).resolve().parents[1]
V1_OFFSET = 0x11111111  # gptqmodel's v2 → v1: every packed zero word minus 0x11111111 (mod 2³²)
GPTQ_GROUP = 32


def tiny_base(path: Path, family: str, **overrides) -> dict[str, torch.Tensor]:
    """tests/conftest.py make_tiny's random fp16 checkpoint (saved by transformers) → its tensors."""
    import sys

    from safetensors.torch import load_file

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import make_tiny

    make_tiny(path, family, dtype=torch.float16, **overrides)
    return load_file(path / "model.safetensors")


def to_int32(rows: list) -> torch.Tensor:
    """Python ints in [0, 2³²) → int32 tensor with the same bits."""
    t = torch.tensor(rows, dtype=torch.int64)
    return torch.where(t >= 2**31, t - 2**32, t).to(torch.int32)


def slow_pack_gptq(q: list, z: list, v1: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q [in][out], z [groups][out] (0..15) → qweight [in/8, out], qzeros [groups, ⌈out/8⌉] int32,
    one nibble at a time: input row i in bits 4·(i % 8) of word row i // 8; output column o of a
    zero row in bits 4·(o % 8) of word o // 8."""
    n_in, n_out = len(q), len(q[0])
    qweight = [[0] * n_out for _ in range(n_in // 8)]
    for i in range(n_in):
        for o in range(n_out):
            qweight[i // 8][o] |= q[i][o] << (4 * (i % 8))
    qzeros = [[0] * ((n_out + 7) // 8) for _ in z]
    for g, row in enumerate(z):
        for o in range(n_out):
            qzeros[g][o // 8] |= row[o] << (4 * (o % 8))
        if v1:
            qzeros[g] = [(w - V1_OFFSET) % 2**32 for w in qzeros[g]]
    return to_int32(qweight), to_int32(qzeros)


def slow_decode_gptq(t: dict[str, torch.Tensor], v1: bool) -> torch.Tensor:
    """The format definition element by element: W[o, i] = s[g, o]·(q[i, o] − z[g, o]), g = g_idx[i]."""
    qw, qz = (t["qweight"].long() % 2**32).tolist(), (t["qzeros"].long() % 2**32).tolist()
    s, g_idx = t["scales"].float().tolist(), t["g_idx"].tolist()
    n_in, n_out = 8 * len(qw), len(qw[0])
    w = [[0.0] * n_in for _ in range(n_out)]
    for i in range(n_in):
        g = g_idx[i]
        for o in range(n_out):
            word = (qz[g][o // 8] + V1_OFFSET) % 2**32 if v1 else qz[g][o // 8]
            q, z = (qw[i // 8][o] >> (4 * (i % 8))) & 0xF, (word >> (4 * (o % 8))) & 0xF
            w[o][i] = s[g][o] * (q - z)  # fp16 scale × small int: exact in fp32
    return torch.tensor(w, dtype=torch.float32)


def gptq_linear(w: torch.Tensor, sym: bool, gen: torch.Generator | None,
                order: torch.Tensor | None = None) -> tuple[dict, torch.Tensor]:
    """RTN-quantise w [out, in] in GPTQ's layout; gen → a random act order (desc_act): groups are G
    consecutive columns of that order, so g_idx[order[j]] = j // G is a shuffled i // G. `order`:
    reuse a sibling's act order (linears that read the same input share GPTQ's Hessian, so
    gptqmodel gives them the same order: q/k/v, and an expert's gate/up)."""
    from lynx_edge.quant.int4 import quantize_rtn

    n_in = w.shape[1]
    if order is None:
        order = torch.randperm(n_in, generator=gen) if gen is not None else torch.arange(n_in)
    codes_o, s, z = quantize_rtn(w.float()[:, order], GPTQ_GROUP, sym)  # [out, in] in act order
    q = torch.empty_like(codes_o)
    q[:, order] = codes_o  # back to the original column order, as the checkpoint stores it
    g_idx = torch.empty(n_in, dtype=torch.int32)
    g_idx[order] = (torch.arange(n_in) // GPTQ_GROUP).to(torch.int32)
    qweight, qzeros = slow_pack_gptq(q.t().tolist(), z.tolist(), v1=True)
    t = {"qweight": qweight, "qzeros": qzeros, "scales": s, "g_idx": g_idx}
    expected = slow_decode_gptq(t, v1=True)
    gi = g_idx.long()
    direct = (q.float() - z.float()[gi].t()) * s.float()[gi].t()  # s·(q − z) before any packing
    assert torch.equal(expected, direct), "slow GPTQ pack/decode disagree"
    return t, expected


def _gptq_quantized(kind: str, name: str, w: torch.Tensor) -> bool:
    if not name.endswith(".weight") or w.dim() != 2:
        return False
    if kind == "mixed" and ".layers.1.mlp.experts.2." in name:
        return False  # the expert gptqmodel's dynamic "-:" rule left 16-bit
    linears = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.experts.", "mlp.shared_expert.")
    return any(k in name for k in linears)


def write_gptq_fixture(kind: str, out: Path) -> None:
    """kind "actorder" | "mixed" (see the module docstring) → out/."""
    import json

    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        if kind == "actorder":
            sd = tiny_base(base, "qwen3_moe", num_hidden_layers=1, num_experts=4, moe_intermediate_size=64)
            sym, gen = False, torch.Generator().manual_seed(1)
            qcfg = {  # AutoGPTQ 0.7-style quantize_config.json with act order on
                "bits": 4, "group_size": GPTQ_GROUP, "damp_percent": 0.01, "desc_act": True, "static_groups": False,
                "sym": False, "true_sequential": True, "model_name_or_path": None, "model_file_base_name": "model",
                "quant_method": "gptq", "checkpoint_format": "gptq",
            }
        else:
            sd = tiny_base(base, "qwen2_moe", num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32)
            sym, gen = True, None
            qcfg = {  # gptqmodel-style, the 16-bit expert named by a negative `dynamic` rule
                "bits": 4, "group_size": GPTQ_GROUP, "desc_act": False, "sym": True, "lm_head": False,
                "dynamic": {r"-:model\.layers\.1\.mlp\.experts\.2\..*": {}},
                "quant_method": "gptq", "checkpoint_format": "gptq", "pack_dtype": "int32",
                "meta": {"quantizer": ["lynx-edge scripts/make_gptq_fixture.py"], "static_groups": False, "true_sequential": True},
            }
        tensors, expected, orders = {}, {}, {}
        for name, w in sd.items():
            if not _gptq_quantized(kind, name, w):
                tensors[name] = w
                continue
            mod = name.removesuffix(".weight")
            shared = re.sub(r"(q_proj|k_proj|v_proj)$", "qkv", re.sub(r"(gate_proj|up_proj)$", "gate_up", mod))
            if gen is not None and shared not in orders:
                orders[shared] = torch.randperm(w.shape[1], generator=gen)
            t, expected[mod] = gptq_linear(w, sym, gen, orders.get(shared))
            tensors.update({f"{mod}.{k}": v for k, v in t.items()})
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        save_file(expected, str(out / "expected_dequant.safetensors"))
        config = json.loads((base / "config.json").read_text())
        config["quantization_config"] = qcfg
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (out / "quantize_config.json").write_text(json.dumps(qcfg, indent=2) + "\n")
        for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copy(base / f, out / f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=("gptqmodel", "actorder", "mixed"), default="gptqmodel")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.kind != "gptqmodel":
        out = Path(args.out or f"tests/fixtures/gptq_{args.kind}_tiny").resolve()
        write_gptq_fixture(args.kind, out)
        print(f"wrote {out}: " + ", ".join(f"{p.name} {p.stat().st_size} B" for p in sorted(out.iterdir())))
        return
    args.out = args.out or "tests/fixtures/gptq_tiny"
    from safetensors.torch import save_file

    dst = Path(args.out).resolve()
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # gptqmodel writes logs/ into the working directory: keep it out of the repo
        try:
            base, out = Path(tmp) / "base", Path(tmp) / "quant"
            build_base(base)
            quantize(base, out)
            dst.mkdir(parents=True, exist_ok=True)
            for f in ("config.json", "quantize_config.json", "model.safetensors"):
                shutil.copy(out / f, dst / f)
            save_file(expected_dequant(out), str(dst / "expected_dequant.safetensors"))
            os.chmod(dst / "expected_dequant.safetensors", 0o644)
        finally:
            os.chdir(cwd)
    print(f"wrote {dst}: " + ", ".join(f"{p.name} {p.stat().st_size} B" for p in sorted(dst.iterdir())))


if __name__ == "__main__":
    main()
