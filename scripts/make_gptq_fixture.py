"""Make tests/fixtures/gptq_tiny: a tiny Qwen3-MoE quantised by gptqmodel itself (CPU).

One decoder layer, D = 64, expert I = 64, E = 4, K = 2; 4-bit, group 32, asymmetric, desc_act off,
gptqmodel's default v1 checkpoint format. Writes gptqmodel's config.json, quantize_config.json
and model.safetensors, plus expected_dequant.safetensors: the layer's experts dequantised by
gptqmodel's own TorchLinear.dequantize_weight (fp32 scales, so exact) as
`layers.0.gate_up` [E, 2I, D] and `layers.0.down` [E, D, I] — what lynx_edge.quant.formats must
reproduce. Needs `pip install gptqmodel` (not a project dependency; tested with 7.7.0, ~1–2 min):

    PYTHONPATH=. python scripts/make_gptq_fixture.py [--out tests/fixtures/gptq_tiny]
"""
from __future__ import annotations

import argparse
import os
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="tests/fixtures/gptq_tiny")
    args = ap.parse_args()
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
