"""GPTQ checkpoints (gptqmodel / AutoGPTQ layout, 4 bits) ↔ lynx-edge's INT4 expert layout.

For one linear W [out, in], group size G (tensors as gptqmodel writes them):
    qweight int32 [in/8, out]     q[i, o] = (qweight[i // 8, o] >> 4·(i % 8)) & 0xF   low bits first
    qzeros  int32 [in/G, out/8]   z[g, o] = nibble o % 8 of qzeros[g, o // 8]          (v2)
    scales  fp16  [in/G, out]
    g_idx   int32 [in]            group of input column i
    W[o, i] = scales[g_idx[i], o] · (q[i, o] − z[g_idx[i], o])
v1 (checkpoint_format "gptq", the default) stores z − 1: the writer subtracts 0x11111111 from
each packed qzeros word, so we add it back per word mod 2³² — exact even where a zero of 0 made
the subtraction borrow from the next nibble (this is gptqmodel's own v1↔v2 conversion; readers
that add 1 per nibble mis-read such asymmetric groups). v2 ("gptq_v2") stores z as is.
desc_act (act-order) checkpoints whose g_idx is not i // G are refused with a ValueError: their
groups are not contiguous along the input dim, which the kernels' one-scale-row-per-K-step
streaming (and a per-expert input permutation of x) would need. Names: gptqmodel's MoE naming
`{prefix}.{l}.mlp.experts.{e}.{gate,up,down}_proj.*` and Mixtral's
`{prefix}.{l}.block_sparse_moe.experts.{e}.{w1,w3,w2}.*` (w1 gate, w3 up, w2 down).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from lynx_edge.quant.int4 import GROUP_SIZES, SYM_ZERO, Int4Experts

V1_OFFSET = 0x11111111  # v1 stores every zero nibble minus one
NAMINGS = {  # naming → (expert path, (gate, up, down) module names)
    "qwen": ("mlp.experts", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe.experts", ("w1", "w3", "w2")),
}


@dataclass(frozen=True)
class GPTQConfig:
    group_size: int
    sym: bool
    desc_act: bool = False
    checkpoint_format: str = "gptq"  # "gptq" (v1 zeros) or "gptq_v2"
    bits: int = 4

    @property
    def v1(self) -> bool:
        return self.checkpoint_format != "gptq_v2"

    def to_json(self) -> dict:
        return {
            "quant_method": "gptq", "bits": self.bits, "group_size": self.group_size,
            "sym": self.sym, "desc_act": self.desc_act, "checkpoint_format": self.checkpoint_format,
            "static_groups": False, "true_sequential": True, "pack_dtype": "int32", "lm_head": False,
        }


def read_gptq_config(model_dir: str | Path) -> GPTQConfig:
    """quantize_config.json, else config.json's quantization_config; refuses what we can't run."""
    model_dir = Path(model_dir)
    qc_path = model_dir / "quantize_config.json"
    if qc_path.exists():
        qc = json.loads(qc_path.read_text())
    else:
        qc = json.loads((model_dir / "config.json").read_text()).get("quantization_config") or {}
    method = qc.get("quant_method", "gptq" if qc_path.exists() else None)
    if method != "gptq":
        raise ValueError(f"{model_dir}: not a GPTQ checkpoint (quant_method={method!r})")
    if qc.get("bits") != 4:
        raise ValueError(f"{model_dir}: only 4-bit GPTQ is supported, got bits={qc.get('bits')}")
    if qc.get("group_size") not in GROUP_SIZES:
        raise ValueError(f"{model_dir}: GPTQ group_size must be one of {GROUP_SIZES}, got {qc.get('group_size')}")
    fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"{model_dir}: unsupported GPTQ checkpoint_format {fmt!r}")
    return GPTQConfig(qc["group_size"], bool(qc.get("sym", True)), bool(qc.get("desc_act", False)), fmt)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2³²) → int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_qweight(codes: torch.Tensor) -> torch.Tensor:
    """codes [out, in] (0..15) → qweight int32 [in/8, out]."""
    q = codes.t().to(torch.int64).unflatten(0, (-1, 8))  # [in/8, 8, out]
    shifts = (4 * torch.arange(8, device=q.device)).view(1, 8, 1)
    return _to_int32((q << shifts).sum(1))


def unpack_qweight(qweight: torch.Tensor) -> torch.Tensor:
    """qweight int32 [in/8, out] → codes [out, in] uint8."""
    shifts = (4 * torch.arange(8, device=qweight.device)).view(1, 8, 1)
    q = (qweight.to(torch.int64)[:, None, :] >> shifts) & 0xF  # [in/8, 8, out]
    return q.flatten(0, 1).t().contiguous().to(torch.uint8)


def pack_qzeros(zeros: torch.Tensor, v1: bool = True) -> torch.Tensor:
    """zeros [groups, out] (0..15) → qzeros int32 [groups, out/8]; v1 subtracts 1 per nibble."""
    z = zeros.to(torch.int64).unflatten(1, (-1, 8))  # [groups, out/8, 8]
    words = (z << (4 * torch.arange(8, device=z.device))).sum(-1)
    if v1:
        words = (words - V1_OFFSET) % 2**32
    return _to_int32(words)


def unpack_qzeros(qzeros: torch.Tensor, v1: bool = True) -> torch.Tensor:
    """qzeros int32 [groups, out/8] → zeros [groups, out] uint8."""
    words = qzeros.to(torch.int64) % 2**32
    if v1:
        words = (words + V1_OFFSET) % 2**32
    z = (words[..., None] >> (4 * torch.arange(8, device=words.device))) & 0xF
    return z.flatten(1).to(torch.uint8)


def gptq_to_codes(
    tensors: dict[str, torch.Tensor], cfg: GPTQConfig, name: str = "?"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """{qweight, qzeros, scales[, g_idx]} of one linear → codes [out, in] uint8,
    scales [in/G, out] fp16, zeros [in/G, out] uint8."""
    codes = unpack_qweight(tensors["qweight"])
    n_in, G = codes.shape[1], cfg.group_size
    g_idx = tensors.get("g_idx")
    if g_idx is not None and not torch.equal(g_idx.long().cpu(), torch.arange(n_in) // G):
        raise ValueError(
            f"{name}: act-order (desc_act) g_idx is not supported; re-quantize with desc_act=False"
        )
    scales = tensors["scales"].to(torch.float16)
    zeros = unpack_qzeros(tensors["qzeros"], cfg.v1)[:, : scales.shape[1]]
    if scales.shape != (n_in // G, codes.shape[0]):
        raise ValueError(f"{name}: scales {tuple(scales.shape)} do not match group size {G}")
    return codes, scales, zeros


class TensorSource:
    """Tensors of a safetensors checkpoint (one file or an index of shards), read by name."""

    def __init__(self, model_dir: str | Path):
        from safetensors import safe_open

        model_dir = Path(model_dir)
        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(model_dir.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
            weight_map = {}
            for f in files:
                with safe_open(f, "pt") as h:
                    weight_map.update({k: f.name for k in h.keys()})
        self._map, self._dir, self._open = weight_map, model_dir, safe_open

    def keys(self):
        return self._map.keys()

    def get(self, name: str) -> torch.Tensor:
        with self._open(self._dir / self._map[name], "pt") as h:
            return h.get_tensor(name)


def expert_prefix(layer: int, e: int, naming: str, prefix: str = "model.layers") -> str:
    return f"{prefix}.{layer}.{NAMINGS[naming][0]}.{e}"


def detect_naming(keys, layer: int, prefix: str = "model.layers") -> tuple[str, int]:
    """(naming, number of experts) of a layer from the checkpoint's tensor names."""
    for naming, (path, mods) in NAMINGS.items():
        pat = re.compile(rf"{re.escape(prefix)}\.{layer}\.{re.escape(path)}\.(\d+)\.{mods[0]}\.qweight$")
        found = [int(m.group(1)) for k in keys if (m := pat.match(k))]
        if found:
            return naming, max(found) + 1
    raise ValueError(f"no GPTQ expert tensors for layer {layer} under {prefix!r}")


def read_gptq_experts(
    model_dir: str | Path, layer: int, *, prefix: str = "model.layers",
    source: TensorSource | None = None, cfg: GPTQConfig | None = None,
) -> Int4Experts:
    """All experts of one MoE layer of a GPTQ checkpoint → Int4Experts (sym layout when every
    zero is 8, else asymmetric)."""
    cfg = cfg or read_gptq_config(model_dir)
    src = source or TensorSource(model_dir)
    naming, E = detect_naming(src.keys(), layer, prefix)
    mods = NAMINGS[naming][1]
    parts: list[list[tuple[torch.Tensor, ...]]] = []
    for e in range(E):
        base = expert_prefix(layer, e, naming, prefix)
        row = []
        for m in mods:
            names = ("qweight", "qzeros", "scales", "g_idx")
            ts = {n: src.get(f"{base}.{m}.{n}") for n in names if f"{base}.{m}.{n}" in src.keys()}
            row.append(gptq_to_codes(ts, cfg, f"{base}.{m}"))
        parts.append(row)
    # gate_up = [gate; up] along out: codes concatenate on dim 0, scales/zeros on dim 1
    gu = tuple(torch.stack([torch.cat([p[0][i], p[1][i]], dim=min(i, 1)) for p in parts]) for i in range(3))
    dn = tuple(torch.stack([p[2][i] for p in parts]) for i in range(3))
    sym = bool((gu[2] == SYM_ZERO).all()) and bool((dn[2] == SYM_ZERO).all())
    return Int4Experts.from_codes(gu, dn, cfg.group_size, sym)
