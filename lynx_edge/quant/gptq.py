"""Quantise expert weights to INT4: RTN and GPTQ, and write GPTQ-format checkpoints.

GPTQ (Frantar et al., 2022), as gptqmodel runs it with act_order off: H = 2/n·XᵀX of the layer's
inputs X [n, in], damped by `damp`·mean(diag H); the columns are quantised left to right in
blocks of 128, each column's error spread over the not-yet-quantised columns through the upper
Cholesky factor of H⁻¹ (lazy batch updates between blocks). A group's scale/zero is chosen
when the sweep reaches its first column, from the error-updated weights (RTN rule of int4.py).
The model-level wiring (calibration forward passes) lives elsewhere; this module is tensor-level.
Glossary: E experts, D hidden, I expert intermediate, G group size, n calibration rows.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from lynx_edge.quant.formats import (
    NAMINGS, GPTQConfig, expert_prefix, pack_qweight, pack_qzeros,
)
from lynx_edge.quant.int4 import Int4Experts, group_params, quantize_rtn

Codes = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # codes [out, in], scales/zeros [in/G, out]


def hessian(x: torch.Tensor) -> torch.Tensor:
    """x [n, in] → H = 2/n·xᵀx [in, in] fp64 (fp64: the Cholesky of H⁻¹ needs the headroom)."""
    x = x.reshape(-1, x.shape[-1]).double()
    return 2.0 / max(1, x.shape[0]) * (x.t() @ x)


def gptq_quantize(
    w: torch.Tensor,  # [out, in]
    x: torch.Tensor,  # [n, in] calibration inputs of this linear
    group_size: int = 128,
    sym: bool = True,
    damp: float = 0.01,
    block_size: int = 128,
    H: torch.Tensor | None = None,
) -> Codes:
    """GPTQ codes [out, in] uint8, scales [in/G, out] fp16, zeros [in/G, out] uint8. H: x's
    Hessian when the caller already has it (several linears over one input)."""
    if H is None and x.shape[0] == 0:  # no calibration data (an expert no token chose): RTN
        return quantize_rtn(w, group_size, sym)
    W = w.double().clone()
    H = hessian(x) if H is None else H.clone()
    dead = torch.diag(H) == 0  # inputs never active: their weights don't matter
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += damp * torch.diag(H).mean() * torch.eye(H.shape[0], dtype=H.dtype)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    n_out, n_in = W.shape
    block = max(group_size, block_size // group_size * group_size)  # groups never straddle blocks
    codes = torch.empty(n_out, n_in, dtype=torch.uint8)
    scales, zeros = [], []
    for i1 in range(0, n_in, block):
        i2 = min(i1 + block, n_in)
        W1, Hinv1 = W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2]
        Err1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            if i % group_size == 0:  # new group: params from the error-updated weights
                s, z = group_params(W1[:, i : i + group_size], group_size, sym)  # [1, out]
                scales.append(s)
                zeros.append(z)
                s64, z64 = s[0].double(), z[0].double()
            q = (torch.round(W1[:, i] / s64) + z64).clamp(0, 15)
            codes[:, i1 + i] = q.to(torch.uint8)
            err = (W1[:, i] - s64 * (q - z64)) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]  # lazy update of the columns after this block
    return codes, torch.cat(scales), torch.cat(zeros)


def rtn_quantize(w: torch.Tensor, group_size: int = 128, sym: bool = True) -> Codes:
    """Round-to-nearest codes/scales/zeros of w [out, in] (int4.quantize_rtn)."""
    return quantize_rtn(w, group_size, sym)


def quantize_experts_gptq(
    gate_up: torch.Tensor,  # [E, 2I, D]
    down: torch.Tensor,  # [E, D, I]
    x_in: list[torch.Tensor],  # per expert [n_e, D]: the tokens routed to it
    h_in: list[torch.Tensor] | None = None,  # per expert [n_e, I]; default silu(gate)·up of x_in
    group_size: int = 128,
    sym: bool = True,
    damp: float = 0.01,
) -> Int4Experts:
    """GPTQ every expert (gate and up share x's Hessian) into one Int4Experts."""
    gu, dn = [], []
    I = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        x = x_in[e].float()
        if h_in is None:
            g = x @ gate_up[e].float().t()
            h = F.silu(g[:, :I]) * g[:, I:]
        else:
            h = h_in[e].float()
        gu.append(gptq_quantize(gate_up[e], x, group_size, sym, damp))
        dn.append(gptq_quantize(down[e], h, group_size, sym, damp))
    stack = lambda parts: tuple(torch.stack(t) for t in zip(*parts))  # noqa: E731
    return Int4Experts.from_codes(stack(gu), stack(dn), group_size, sym)


def gptq_tensors(codes: Codes, group_size: int, v1: bool = True) -> dict[str, torch.Tensor]:
    """One linear's codes [out, in], scales/zeros [in/G, out] → GPTQ tensors (v1 zeros by default)."""
    q, s, z = codes
    return {
        "qweight": pack_qweight(q),
        "qzeros": pack_qzeros(z, v1),
        "scales": s.to(torch.float16).contiguous(),
        "g_idx": (torch.arange(q.shape[1]) // group_size).to(torch.int32),
    }


def expert_gptq_tensors(
    experts: Int4Experts, layer: int, naming: str = "qwen", prefix: str = "model.layers", v1: bool = True
) -> dict[str, torch.Tensor]:
    """All experts of one layer → {name: tensor} with gptqmodel's (or Mixtral's) names."""
    (q_gu, s_gu, z_gu), (q_dn, s_dn, z_dn) = experts.to("cpu").codes()
    I, G = experts.inter, experts.group_size
    gate, up, down = NAMINGS[naming][1]
    out = {}
    for e in range(experts.num_experts):
        base = expert_prefix(layer, e, naming, prefix)
        per_mod = {
            gate: (q_gu[e, :I], s_gu[e, :, :I], z_gu[e, :, :I]),
            up: (q_gu[e, I:], s_gu[e, :, I:], z_gu[e, :, I:]),
            down: (q_dn[e], s_dn[e], z_dn[e]),
        }
        for mod, codes in per_mod.items():
            for k, t in gptq_tensors(codes, G, v1).items():
                out[f"{base}.{mod}.{k}"] = t.contiguous()
    return out


def write_gptq_checkpoint(
    out_dir: str | Path,
    layers: dict[int, Int4Experts],  # layer index → its quantised experts
    *,
    naming: str = "qwen",  # "qwen" (mlp.experts.{e}.gate_proj) or "mixtral" (block_sparse_moe w1/w2/w3)
    prefix: str = "model.layers",
    config: dict | None = None,  # the model's config.json to extend with quantization_config
    extra_tensors: dict[str, torch.Tensor] | None = None,  # unquantised tensors (norms, attention …)
    checkpoint_format: str = "gptq",  # "gptq" = v1 zeros (z − 1), "gptq_v2" = z
) -> Path:
    """Write model.safetensors + quantize_config.json + config.json (with quantization_config)."""
    from safetensors.torch import save_file

    first = next(iter(layers.values()))
    G, sym = first.group_size, first.sym
    if any(x.group_size != G or x.sym != sym for x in layers.values()):
        raise ValueError("all layers must share group size and symmetry")
    cfg = GPTQConfig(G, sym, False, checkpoint_format)
    tensors = dict(extra_tensors or {})
    for layer, experts in layers.items():
        tensors.update(expert_gptq_tensors(experts, layer, naming, prefix, cfg.v1))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    qc = cfg.to_json()
    (out / "quantize_config.json").write_text(json.dumps(qc, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps({**(config or {}), "quantization_config": qc}, indent=2) + "\n")
    return out


__all__ = [
    "expert_gptq_tensors", "gptq_quantize", "gptq_tensors", "hessian", "quantize_experts_gptq",
    "rtn_quantize", "write_gptq_checkpoint",
]
