"""Make tests/fixtures/awq_tiny: a tiny qwen3_moe checkpoint in AutoAWQ's GEMM format (CPU, ~2 s).

Base: tests/conftest.py make_tiny (random fp16 weights saved by transformers), 2 layers, D = 64,
E = 4 experts of I = 32 in layer 0, a dense MLP (intermediate 64) in layer 1 (mlp_only_layers).
Every linear AutoAWQ quantizes is packed here, following the public format rather than
lynx_edge.quant.awq (so the fixture checks the reader independently):
  * quantizer: AutoAWQ's pseudo_quantize_tensor with zero_point (awq/quantize/quantizer.py):
    per group of G = 32 input columns s = (max − min).clamp(1e-5)/15 (stored fp16),
    z = clamp(−round(min/s), 0, 15), q = clamp(round(w/s) + z, 0, 15);
  * packer: WQLinear_GEMM.from_linear (awq/modules/linear/gemm.py): qweight [in, out/8],
    `qweight[:, col] |= intweight[:, col*8 + order_map[i]] << 4i` with order_map
    [0, 2, 4, 6, 1, 3, 5, 7]; qzeros [in/G, out/8] the same way; scales [in/G, out] fp16.
modules_to_not_convert = ["mlp.gate"] keeps the routers 16-bit; AutoAWQ matches it as a
substring (exclude_layers_to_not_quantize), so the dense layer's mlp.gate_proj stays 16-bit too
(up/down are 4-bit): the loader must go by the tensors present, as real checkpoints require.
expected_dequant.safetensors: {module name: W [out, in] fp32} decoded from the packed words by a
slow loop over the format definition, checked equal to s·(q − z) of the codes before packing.

    PYTHONPATH=. python scripts/make_awq_fixture.py [--out tests/fixtures/awq_tiny]
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_gptq_fixture import tiny_base, to_int32  # noqa: E402

GROUP = 32
ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ WQLinear_GEMM.from_linear
QUANT_CONFIG = {  # as AutoAWQ's AwqConfig.to_transformers_dict writes it into config.json
    "quant_method": "awq", "zero_point": True, "group_size": GROUP, "bits": 4, "version": "gemm",
    "modules_to_not_convert": ["mlp.gate"],
}


def awq_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] → codes [out, in] int64, scales [in/G, out] fp16, zeros [in/G, out] int64."""
    g = w.float().unflatten(1, (-1, GROUP))  # [out, in/G, G]
    mx, mn = g.amax(-1), g.amin(-1)
    s = ((mx - mn).clamp(min=1e-5) / 15).half()
    z = (-torch.round(mn / s.float())).clamp(0, 15)
    q = (torch.round(g / s.float()[..., None]) + z[..., None]).clamp(0, 15)
    return q.flatten(1).long(), s.t().contiguous(), z.t().long().contiguous()


def slow_pack(intweight: list) -> torch.Tensor:
    """intweight [rows][cols] → int32 [rows, cols/8], AutoAWQ's column loop."""
    rows, cols = len(intweight), len(intweight[0])
    packed = [[0] * (cols // 8) for _ in range(rows)]
    for r in range(rows):
        for col in range(cols // 8):
            for i in range(8):
                packed[r][col] |= intweight[r][col * 8 + ORDER_MAP[i]] << (4 * i)
    return to_int32(packed)


def slow_decode(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """Wᵀ[i, o] = (q[i, o] − z[i // G, o])·s[i // G, o], nibble by nibble → W [out, in] fp32."""
    qw, qz = (t["qweight"].long() % 2**32).tolist(), (t["qzeros"].long() % 2**32).tolist()
    s = t["scales"].float().tolist()
    n_in, n_out = len(qw), 8 * len(qw[0])
    w = [[0.0] * n_in for _ in range(n_out)]
    for i in range(n_in):
        for c in range(n_out // 8):
            for k in range(8):
                o = 8 * c + ORDER_MAP[k]
                q = (qw[i][c] >> (4 * k)) & 0xF
                z = (qz[i // GROUP][c] >> (4 * k)) & 0xF
                w[o][i] = s[i // GROUP][o] * (q - z)
    return torch.tensor(w, dtype=torch.float32)


def awq_linear(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    q, s, z = awq_quantize(w)
    t = {"qweight": slow_pack(q.t().tolist()), "qzeros": slow_pack(z.tolist()), "scales": s}
    expected = slow_decode(t)
    direct = (q.float() - z.float().repeat_interleave(GROUP, 0).t()) * s.float().repeat_interleave(GROUP, 0).t()
    assert torch.equal(expected, direct), "slow AWQ pack/decode disagree"
    return t, expected


def quantized(name: str, w: torch.Tensor) -> bool:
    """AutoAWQ quantizes every nn.Linear in a decoder layer except modules_to_not_convert (substrings)."""
    if not (name.startswith("model.layers.") and name.endswith(".weight") and w.dim() == 2):
        return False
    return not any(key in name for key in QUANT_CONFIG["modules_to_not_convert"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="tests/fixtures/awq_tiny")
    args = ap.parse_args()
    from safetensors.torch import save_file

    out = Path(args.out).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        sd = tiny_base(base, "qwen3_moe", num_experts=4, moe_intermediate_size=32, mlp_only_layers=[1],
                       intermediate_size=64)
        tensors, expected = {}, {}
        for name, w in sd.items():
            if not quantized(name, w):
                tensors[name] = w
                continue
            mod = name.removesuffix(".weight")
            t, expected[mod] = awq_linear(w)
            tensors.update({f"{mod}.{k}": v for k, v in t.items()})
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        save_file(expected, str(out / "expected_dequant.safetensors"))
        config = json.loads((base / "config.json").read_text())
        config["quantization_config"] = QUANT_CONFIG
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copy(base / f, out / f)
    print(f"wrote {out}: " + ", ".join(f"{p.name} {p.stat().st_size} B" for p in sorted(out.iterdir())))


if __name__ == "__main__":
    main()
