"""Published 4-bit checkpoints (GPTQ, AWQ) → lynx-edge's INT4 group layout (quant/int4.py).

read_quant_config parses quantize_config.json / config.json's quantization_config once;
linear_from_checkpoint turns one linear's stored tensors into a QuantLinear (codes, per-group
scales and zeros, optional act-order column permutation); codes stay packed when the file's
bytes already are int4.py's layout (GPTQ without act-order: qweight transposed, read as little-
endian bytes, is int4.pack's [out, in/2]). GPTQ layout (gptqmodel / AutoGPTQ), for one linear
W [out, in], group size G:
    qweight int32 [in/8, out]     q[i, o] = (qweight[i // 8, o] >> 4·(i % 8)) & 0xF   low bits first
    qzeros  int32 [in/G, out/8]   z[g, o] = nibble o % 8 of qzeros[g, o // 8]          (v2)
    scales  fp16  [in/G, out]
    g_idx   int32 [in]            group of input column i
    W[o, i] = scales[g_idx[i], o] · (q[i, o] − z[g_idx[i], o])
v1 (checkpoint_format "gptq", the default) stores z − 1: the writer subtracts 0x11111111 from
each packed qzeros word, so we add it back per word mod 2³² — exact even where a zero of 0 made
the subtraction borrow from the next nibble (gptqmodel's own v1↔v2 conversion). v2 stores z.
Act-order (desc_act): g_idx is a shuffled i // G; perm = stable argsort(g_idx) makes every group
G contiguous columns again, so QuantLinear keeps codes in perm order and the perm beside them.
AWQ layout: quant/awq.py. Names: gptqmodel's MoE naming `{prefix}.{l}.mlp.experts.{e}.{gate,
up,down}_proj.*` and Mixtral's `{prefix}.{l}.block_sparse_moe.experts.{e}.{w1,w3,w2}.*`.
"""
from __future__ import annotations

import functools
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from lynx_edge.quant.awq import awq_packed, unpack_awq_words
from lynx_edge.quant.int4 import GROUP_SIZES, SYM_ZERO, Int4Experts, pack, unpack

assert sys.byteorder == "little", "GPTQ/AWQ words are read as little-endian bytes"
V1_OFFSET = 0x11111111  # v1 stores every zero nibble minus one
SYM_WORD_V1, SYM_WORD_V2 = 0x77777777, 0x88888888 - 2**32  # a qzeros word of eight 8s (int32), v1 / v2
QUANT_TENSOR_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
NAMINGS = {  # naming → (expert path, (gate, up, down) module names)
    "qwen": ("mlp.experts", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe.experts", ("w1", "w3", "w2")),
}
GPTQ_FORMATS = {"gptq": "gptq_v1", "gptq_v2": "gptq_v2"}  # checkpoint_format → zero_format


class QuantConfigError(ValueError):
    """An unsupported or malformed quantization config; the message is one line naming file and field."""


@dataclass(frozen=True)
class QuantConfig:
    method: str  # "gptq" | "awq"
    bits: int  # 4
    group_size: int  # one of GROUP_SIZES
    sym: bool
    desc_act: bool
    zero_format: str  # "gptq_v1" | "gptq_v2" | "awq"
    modules_to_not_convert: tuple[str, ...] = ()  # AWQ: substrings of module names left 16-bit
    dynamic_skip: tuple[str, ...] = ()  # gptqmodel `dynamic` "-:" regexes (re.match) left 16-bit
    lm_head: bool = False  # gptqmodel: lm_head quantized too
    weight_block: tuple[int, int] | None = None  # fp8: weight_block_size (bn, bk), one fp32 scale per block

    def is_quantized(self, module: str) -> bool:
        """Whether the config says `module` (e.g. "model.layers.0.mlp.gate") is stored 4-bit:
        AWQ's substring rule (AutoAWQ exclude_layers_to_not_quantize, vLLM is_layer_skipped_awq)
        and gptqmodel's negative `dynamic` regexes. The tensors present (qweight vs weight) are the
        ground truth; this is the cross-check."""
        if any(key in module for key in self.modules_to_not_convert):
            return False
        return not any(re.match(p, module) for p in self.dynamic_skip)


def _find_quant_block(model_dir: Path, config: dict) -> tuple[dict, str, str] | None:
    """(block, file path, field prefix for messages) or None for a 16-bit checkpoint.
    quantize_config.json (AutoGPTQ / gptqmodel) first, then config.json's quantization_config
    (transformers, optimum, AutoAWQ), then AutoAWQ's legacy quant_config.json."""
    qpath = model_dir / "quantize_config.json"
    if qpath.is_file():
        return _read_json(qpath), str(qpath), ""
    block = config.get("quantization_config")
    if block is not None:
        if not isinstance(block, dict):
            raise QuantConfigError(f"{model_dir / 'config.json'}: quantization_config is not an object")
        return block, str(model_dir / "config.json"), "quantization_config."
    apath = model_dir / "quant_config.json"
    if apath.is_file():
        return {"quant_method": "awq", **_read_json(apath)}, str(apath), ""
    return None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise QuantConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise QuantConfigError(f"{path}: expected a JSON object")
    return data


def read_quant_config(model_dir: str | Path, config: dict) -> QuantConfig | None:
    """The checkpoint's 4-bit settings, None for a 16-bit checkpoint; QuantConfigError (one line
    naming the file and the field) for anything lynx-edge cannot run."""
    found = _find_quant_block(Path(model_dir), config)
    if found is None:
        return None
    qc, path, pre = found

    def bad(field: str, why: str) -> QuantConfigError:
        return QuantConfigError(f"{path}: {pre}{field} = {qc.get(field)!r} {why}")

    method = str(qc.get("quant_method", "gptq" if path.endswith("quantize_config.json") else "")).lower()
    if method == "mxfp4":  # gpt-oss as published: e2m1 experts, one e8m0 scale per 32 (its family reads them)
        return QuantConfig("mxfp4", 4, 32, True, False, "mxfp4", tuple(qc.get("modules_to_not_convert") or ()))
    if method == "fp8":
        return _fp8_config(qc, bad)
    if method not in ("gptq", "awq"):
        raise bad("quant_method", "is not supported; lynx-edge reads 4-bit GPTQ, AWQ (GEMM), MXFP4 (gpt-oss) "
                                  "and block-scaled FP8 checkpoints")
    bits_key = "w_bit" if "w_bit" in qc and "bits" not in qc else "bits"
    if qc.get(bits_key) != 4:
        raise bad(bits_key, "is not supported; lynx-edge reads 4-bit GPTQ/AWQ only")
    g_key = "q_group_size" if "q_group_size" in qc and "group_size" not in qc else "group_size"
    if qc.get(g_key) not in GROUP_SIZES:
        why = "(per-channel) is not supported" if qc.get(g_key) == -1 else "is not supported"
        raise bad(g_key, f"{why}; group size must be one of {GROUP_SIZES}")
    G = int(qc[g_key])
    if method == "awq":
        return _awq_config(qc, bad, G)
    return _gptq_config(qc, bad, G, f"{path}: {pre}")


def _fp8_config(qc: dict, bad) -> QuantConfig:
    """Block-scaled FP8 (transformers' FineGrainedFP8 / DeepSeek-V3 / Qwen3-*-FP8): e4m3 weights
    with `weight_scale_inv` per weight_block_size block (quant/fp8.py), stored float32 or, with
    scale_fmt "ue8m0" (DeepSeek-V3.1, GLM), as powers of two (float32 or F8_E8M0: widened exactly). The activation scheme does
    not matter here: weights are dequantised or read 8-bit, activations stay fp32/16-bit."""
    if str(qc.get("fmt", "e4m3")).lower() not in ("e4m3", "float8_e4m3fn"):
        raise bad("fmt", "is not supported; FP8 checkpoints are read as e4m3")
    if str(qc.get("scale_fmt") or "float32").lower() not in ("float32", "ue8m0"):
        raise bad("scale_fmt", "is not supported; FP8 block scales are read as float32 or ue8m0 (powers of two)")
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise bad("weight_block_size", "is not supported; FP8 checkpoints need a [rows, cols] block of positive "
                                       "integers (per-tensor FP8 scales are not read)")
    skip = qc.get("modules_to_not_convert") or []
    if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
        raise bad("modules_to_not_convert", "must be a list of module names")
    return QuantConfig("fp8", 8, int(block[1]), True, False, "fp8", tuple(skip), weight_block=(int(block[0]), int(block[1])))


def _awq_config(qc: dict, bad, G: int) -> QuantConfig:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise bad("version", "is not supported; only AutoAWQ's GEMM packing is read (gemv/marlin/exllama differ)")
    if qc.get("zero_point", True) is not True:
        raise bad("zero_point", "is not supported; AutoAWQ GEMM checkpoints carry zero points")
    if qc.get("backend") not in (None, "autoawq"):
        raise bad("backend", "is not supported; only AutoAWQ-packed checkpoints are read")
    skip = qc.get("modules_to_not_convert") or []
    if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
        raise bad("modules_to_not_convert", "must be a list of module names")
    return QuantConfig("awq", 4, G, False, False, "awq", tuple(skip))


def _gptq_config(qc: dict, bad, G: int, where: str) -> QuantConfig:
    fmt_key = "checkpoint_format" if "checkpoint_format" in qc else "format"
    fmt = str(qc.get(fmt_key, "gptq")).lower()
    if fmt not in GPTQ_FORMATS:
        raise bad(fmt_key, "is not supported; GPTQ checkpoint formats read: gptq (v1), gptq_v2")
    if qc.get("is_marlin_format"):
        raise bad("is_marlin_format", "is not supported (Marlin-repacked weights); use the plain GPTQ checkpoint")
    if str(qc.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
        raise bad("pack_dtype", "is not supported; GPTQ words must be int32")
    for flag in ("sym", "desc_act", "lm_head"):
        if not isinstance(qc.get(flag, False), bool):
            raise bad(flag, "must be true or false")
    skip = []
    dynamic = qc.get("dynamic") or {}
    if not isinstance(dynamic, dict):
        raise bad("dynamic", "must be an object of regex → overrides")
    for pattern, override in dynamic.items():
        if pattern.startswith("-:"):
            skip.append(pattern[2:])
            continue
        base = {"bits": 4, "group_size": G, "sym": qc.get("sym", True), "desc_act": qc.get("desc_act", False)}
        changed = {k: v for k, v in (override or {}).items() if k in base and v != base[k]}
        if changed:
            raise QuantConfigError(
                f"{where}dynamic[{pattern!r}] overrides {changed} per module; "
                "lynx-edge reads one bits/group_size/sym/desc_act per checkpoint"
            )
    return QuantConfig(
        "gptq", 4, G, bool(qc.get("sym", True)), bool(qc.get("desc_act", False)), GPTQ_FORMATS[fmt],
        (), tuple(skip), bool(qc.get("lm_head", False)),
    )


class QuantLinear:
    """One linear W [out, in] in lynx-edge's INT4 group layout: its codes either unpacked (one per
    byte) or packed as int4.py stores them, whichever the reader had; the other form is derived on
    first use. Sinks that store INT4 take `packed` (no unpack/repack for GPTQ or AWQ), 16-bit
    sinks take dequant().
        codes   [out, in] uint8 0..15, columns in `perm` order when perm is not None
        packed  [out, in/2] uint8 (int4.pack's layout), or the same bytes as little-endian int32
                words [out, in/8] — a GPTQ qweight transposed, a strided view of the file
        scales  [in/G, out] fp16;  zeros [in/G, out] uint8 (read-only: may be an expanded 8)
        perm    [in] int64 or None: W[:, perm] is what codes/scales/zeros describe
        sym     every zero is 8, when the reader already knows (else checked on first use)"""

    def __init__(self, codes: torch.Tensor | None, scales: torch.Tensor, zeros: torch.Tensor,
                 perm: torch.Tensor | None = None, *, packed: torch.Tensor | None = None, sym: bool | None = None):
        if (codes is None) == (packed is None):
            raise ValueError("QuantLinear takes its codes either unpacked or packed (exactly one)")
        self._codes, self._packed, self._sym = codes, packed, sym
        self.scales, self.zeros, self.perm = scales, zeros, perm

    @property
    def codes(self) -> torch.Tensor:
        if self._codes is None:
            p = self._packed
            self._codes = unpack(p if p.dtype == torch.uint8 else p.contiguous().view(torch.uint8))
        return self._codes

    @property
    def packed(self) -> torch.Tensor:
        if self._packed is None:
            self._packed = pack(self._codes)
        return self._packed

    @property
    def n_in(self) -> int:
        if self._codes is not None:
            return self._codes.shape[1]
        return self._packed.shape[1] * (2 if self._packed.dtype == torch.uint8 else 8)

    @property
    def group_size(self) -> int:
        return self.n_in // self.scales.shape[0]

    @property
    def sym(self) -> bool:
        if self._sym is None:
            self._sym = bool((self.zeros == SYM_ZERO).all())
        return self._sym

    def dequant(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [out, in] in the original column order: s·(q − z) in fp32 (exact), then cast."""
        w = self.codes.float()  # [out, in] in perm order; updated in place below
        g = w.view(w.shape[0], self.scales.shape[0], -1)  # [out, in/G, G]
        g.sub_(self.zeros.t().float()[..., None]).mul_(self.scales.t().float()[..., None])
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)  # column perm[j] ← column j
        return w.to(dtype)


def permute_out(ql: QuantLinear, perm_out: torch.Tensor) -> QuantLinear:
    """The same linear with output rows reordered: dequant() becomes W[perm_out, :]. Exact; used
    to absorb a down_proj's act-order perm over I into gate/up rows (I is internal to an expert)."""
    p = perm_out.to(torch.long)
    return QuantLinear(ql.codes[p].contiguous(), ql.scales[:, p].contiguous(), ql.zeros[:, p].contiguous(), ql.perm)


def _scales_fp16(scales: torch.Tensor, name: str) -> torch.Tensor:
    if not scales.is_floating_point():
        raise ValueError(f"{name}.scales: expected a float tensor, got {scales.dtype}")
    s = scales.to(torch.float16)
    if scales.dtype != torch.float16 and not torch.equal(s.to(scales.dtype), scales):
        raise ValueError(f"{name}.scales: {scales.dtype} values are not exactly representable in fp16")
    return s


def _shape(t: torch.Tensor, want: tuple[int, ...], name: str, part: str) -> None:
    if tuple(t.shape) != want:
        raise ValueError(f"{name}.{part}: shape {tuple(t.shape)}, expected {want} for this linear")


@functools.lru_cache(maxsize=32)
def _natural_groups(n: int, group_size: int) -> torch.Tensor:
    """int32 [n] = i // G: a non-act-order g_idx."""
    return (torch.arange(n, dtype=torch.int32) // group_size).to(torch.int32)


def act_order_perm(g_idx: torch.Tensor, group_size: int, name: str = "?") -> torch.Tensor | None:
    """g_idx [in] → None when it is i // G, else perm = stable argsort(g_idx) [in] int64, checked so
    that g_idx[perm] == i // G (every group exactly G columns)."""
    if g_idx.dtype == torch.int32 and torch.equal(g_idx, _natural_groups(g_idx.numel(), group_size)):
        return None  # the common case, checked without temporaries
    g = g_idx.to(torch.long).cpu()
    natural = torch.arange(g.numel()) // group_size
    if torch.equal(g, natural):
        return None
    perm = torch.argsort(g, stable=True)
    if not torch.equal(g[perm], natural):
        raise ValueError(f"{name}.g_idx: groups are not {group_size} columns each; not a GPTQ act-order g_idx")
    return perm


def linear_from_checkpoint(tensors: dict[str, torch.Tensor], qc: QuantConfig, name: str = "?") -> QuantLinear:
    """{qweight, qzeros, scales[, g_idx]} of ONE linear as stored (GPTQ or AWQ) → QuantLinear.
    Errors are one line naming the tensor."""
    for part in ("qweight", "qzeros", "scales"):
        if part not in tensors:
            raise ValueError(f"{name}.{part}: missing from the checkpoint ({qc.method} needs qweight, qzeros, scales)")
    qweight, qzeros, G = tensors["qweight"], tensors["qzeros"], qc.group_size
    for part in ("qweight", "qzeros"):
        if tensors[part].dtype != torch.int32 or tensors[part].dim() != 2:
            t = tensors[part]
            raise ValueError(f"{name}.{part}: expected a 2-D int32 tensor, got {t.dtype} {tuple(t.shape)}")
    if qc.method == "awq":
        n_in, n_out = qweight.shape[0], 8 * qweight.shape[1]
    else:
        n_in, n_out = 8 * qweight.shape[0], qweight.shape[1]
    if n_in % G:
        raise ValueError(f"{name}.qweight: input dim {n_in} is not a multiple of group_size {G}")
    scales = _scales_fp16(tensors["scales"], name)
    _shape(scales, (n_in // G, n_out), name, "scales")
    _shape(qzeros, (n_in // G, (n_out + 7) // 8), name, "qzeros")
    if qc.method == "awq":
        if "g_idx" in tensors:
            raise ValueError(f"{name}.g_idx: AWQ checkpoints have no g_idx")
        return QuantLinear(None, scales, unpack_awq_words(qzeros), packed=awq_packed(qweight))
    v1 = qc.zero_format == "gptq_v1"
    if bool((qzeros == (SYM_WORD_V1 if v1 else SYM_WORD_V2)).all()):  # symmetric: every zero 8
        zeros, sym = torch.full((1, 1), SYM_ZERO, dtype=torch.uint8, device=qzeros.device).expand(n_in // G, n_out), True
    else:
        zeros, sym = unpack_qzeros(qzeros, v1)[:, :n_out], None
    perm = None
    if "g_idx" in tensors:
        _shape(tensors["g_idx"], (n_in,), name, "g_idx")
        perm = act_order_perm(tensors["g_idx"], G, name)
    if perm is None:  # qweight transposed is already int4.py's packed layout: no decode at all
        return QuantLinear(None, scales, zeros, packed=qweight.t(), sym=sym)
    codes = unpack_qweight(qweight)[:, perm].contiguous()  # column j of codes is input column perm[j]
    return QuantLinear(codes, scales, zeros, perm, sym=sym)


# ------------------------------------------------------------------ GPTQ words, legacy API


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
    """Legacy: read_quant_config narrowed to GPTQ (ValueError for anything else)."""
    model_dir = Path(model_dir)
    cfg_path = model_dir / "config.json"
    config = _read_json(cfg_path) if cfg_path.is_file() else {}
    qc = read_quant_config(model_dir, config)
    if qc is None or qc.method != "gptq":
        raise ValueError(f"{model_dir}: not a GPTQ checkpoint (quant_method={qc and qc.method!r})")
    fmt = "gptq_v2" if qc.zero_format == "gptq_v2" else "gptq"
    return GPTQConfig(qc.group_size, qc.sym, qc.desc_act, fmt)


def _as_quant_config(cfg: GPTQConfig) -> QuantConfig:
    return QuantConfig("gptq", 4, cfg.group_size, cfg.sym, cfg.desc_act, "gptq_v1" if cfg.v1 else "gptq_v2")


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2³²) → int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_qweight(codes: torch.Tensor) -> torch.Tensor:
    """codes [out, in] (0..15) → qweight int32 [in/8, out]."""
    q = codes.t().to(torch.int64).unflatten(0, (-1, 8))  # [in/8, 8, out]
    shifts = (4 * torch.arange(8, device=q.device)).view(1, 8, 1)
    return _to_int32((q << shifts).sum(1))


def unpack_qweight(qweight: torch.Tensor) -> torch.Tensor:
    """qweight int32 [in/8, out] → codes [out, in] uint8. Transposed, the little-endian words are
    bytes [out, in/2] with input 2j in the low nibble of byte j and 2j+1 in the high one (int4.py's
    packed layout), so two uint8 passes unpack them."""
    b = qweight.t().contiguous().view(torch.uint8)  # [out, in/2]
    q = torch.empty(b.shape[0], 2 * b.shape[1], dtype=torch.uint8, device=b.device)
    q[:, 0::2] = b & 0xF
    q[:, 1::2] = b >> 4
    return q


def pack_qzeros(zeros: torch.Tensor, v1: bool = True) -> torch.Tensor:
    """zeros [groups, out] (0..15) → qzeros int32 [groups, out/8]; v1 subtracts 1 per nibble."""
    z = zeros.to(torch.int64).unflatten(1, (-1, 8))  # [groups, out/8, 8]
    words = (z << (4 * torch.arange(8, device=z.device))).sum(-1)
    if v1:
        words = (words - V1_OFFSET) % 2**32
    return _to_int32(words)


def unpack_qzeros(qzeros: torch.Tensor, v1: bool = True) -> torch.Tensor:
    """qzeros int32 [groups, out/8] → zeros [groups, out] uint8. Each word's little-endian bytes
    hold two zeros (low nibble first); a v1 word gets its 0x11111111 back first, added in int64 so
    the sum's low 32 bits are the word mod 2³² (a carry past bit 31 lands in bytes 4-7, unread)."""
    shape = (qzeros.shape[0], 8 * qzeros.shape[1])
    words = qzeros.to(torch.int64)
    if v1:
        words += V1_OFFSET
    b = words.view(torch.uint8).view(*qzeros.shape, 8)[..., :4]  # [groups, out/8, 4]
    z = torch.empty(*qzeros.shape, 4, 2, dtype=torch.uint8, device=qzeros.device)
    z[..., 0] = b & 0xF
    z[..., 1] = b >> 4
    return z.view(shape)


def gptq_to_codes(
    tensors: dict[str, torch.Tensor], cfg: GPTQConfig, name: str = "?"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Legacy: one non-act-order GPTQ linear → codes [out, in] uint8, scales [in/G, out] fp16,
    zeros [in/G, out] uint8 (act-order g_idx refused: use linear_from_checkpoint)."""
    ql = linear_from_checkpoint(tensors, _as_quant_config(cfg), name)
    if ql.perm is not None:
        raise ValueError(f"{name}: act-order (desc_act) g_idx here is not supported; use linear_from_checkpoint")
    return ql.codes, ql.scales, ql.zeros


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
    zero is 8, else asymmetric). A down_proj act-order perm is absorbed into gate/up rows; an
    act-order perm on gate/up (over the hidden dim, shared by all experts' input) is refused."""
    qc = _as_quant_config(cfg or read_gptq_config(model_dir))
    src = source or TensorSource(model_dir)
    naming, E = detect_naming(src.keys(), layer, prefix)
    gu, dn = [], []
    for e in range(E):
        base = expert_prefix(layer, e, naming, prefix)
        lin = []
        for m in NAMINGS[naming][1]:
            keys = {n: f"{base}.{m}.{n}" for n in QUANT_TENSOR_SUFFIXES if f"{base}.{m}.{n}" in src.keys()}
            lin.append(linear_from_checkpoint({n: src.get(k) for n, k in keys.items()}, qc, f"{base}.{m}"))
        gate, up, down = lin
        for ql, m in ((gate, NAMINGS[naming][1][0]), (up, NAMINGS[naming][1][1])):
            if ql.perm is not None:
                raise ValueError(f"{base}.{m}: act-order (desc_act) g_idx over the hidden dim is not supported here")
        if down.perm is not None:  # down reads h[perm]: produce h in that order
            gate, up = permute_out(gate, down.perm), permute_out(up, down.perm)
        gu.append((torch.cat([gate.codes, up.codes]), torch.cat([gate.scales, up.scales], 1),
                   torch.cat([gate.zeros, up.zeros], 1)))
        dn.append((down.codes, down.scales, down.zeros))
    gu_t = tuple(torch.stack([p[i] for p in gu]) for i in range(3))
    dn_t = tuple(torch.stack([p[i] for p in dn]) for i in range(3))
    sym = bool((gu_t[2] == SYM_ZERO).all()) and bool((dn_t[2] == SYM_ZERO).all())
    return Int4Experts.from_codes(gu_t, dn_t, qc.group_size, sym)
