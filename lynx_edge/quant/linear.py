"""A 4-bit attention / dense linear kept packed on a CPU (GPTQ and AWQ checkpoints).

Published 4-bit checkpoints quantise every decoder linear, not only the experts: q/k/v/o, shared
experts and dense MLPs. Widening those to 16-bit at load (what the GPU path does) costs a real
user's box twice: Qwen3-30B-A3B's attention is ~0.9 B parameters, 1.8 GB in bf16 against 0.5 GB
packed, and at B=1 decode it is the biggest share of the bytes read per token (the 8 active
experts of a layer are ~1.8 B parameters in 4-bit, 0.9 GB). On a CPU with the native kernels
(kernels/native.linear_int4) the linear stays in int4.py's layout and is read packed:

    packed [N, Kin/2] uint8   scales [Kin/G, N] fp16   zeros [Kin/G, N] uint8 or None (sym: 8)
    perm   [Kin] int32 or None: act order, code column j multiplies input perm[j]

Decode-sized inputs (≤ NATIVE_MAX_ROWS rows) run the native kernel, fp32 products and sums
(within fp32 rounding of F.linear on the dequantised weight), or integer activations with
act="q16" (int16, ~2^-16) or "q8" (int8, approximate; kernels/native.default_int4_act); prefill widens WIDEN_ROWS output
rows at a time to fp32 and runs torch's GEMM (compute-bound there, where MKL wins). The choice of
this class is made once, at build time (build.install_int4_linears), only where the kernels
built; elsewhere the loader dequantises into a plain Linear as before. Glossary: N out, Kin in,
G group size.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import native
from .int4 import dequant

# rows (tokens) up to which the native kernel beats widening + torch's fp32 GEMM (measured:
# benchmarks/results/cpu_native.md, "INT4 linear"); beyond, prefill widens row chunks
NATIVE_MAX_ROWS = 32
WIDEN_ROWS = 1024  # output rows widened to fp32 at a time in prefill (≤ 1024·Kin·4 bytes of scratch)


class Int4Linear(nn.Module):
    """y = x Wᵀ (+ b) for W [out_f, in_f] held as INT4 codes with group scales/zeros (see module doc).
    Built empty; the loader fills it with `load_quant` (a quant.formats.QuantLinear)."""

    def __init__(self, out_f: int, in_f: int, bias: bool, dtype, device, act: str | None = None):
        super().__init__()
        self.act = act  # "f32" | "q16" | "q8" activations for the kernel (kernels/native.default_int4_act), set at build
        self.out_features, self.in_features = out_f, in_f
        self.register_buffer("packed", torch.empty(0, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.empty(0, dtype=torch.float16, device=device))
        self.zeros: torch.Tensor | None = None
        self.perm: torch.Tensor | None = None
        self.bias = nn.Parameter(torch.empty(out_f, dtype=dtype, device=device), requires_grad=False) if bias else None
        self.loaded = False
        self.rtn_group: int | None = None  # set when built to take a 16-bit weight (load_dense), else None

    def extra_repr(self) -> str:
        g = self.in_features // self.scales.shape[0] if self.loaded else "?"
        return (f"out={self.out_features}, in={self.in_features}, int4 group={g}, sym={self.zeros is None}, "
                f"act_order={self.perm is not None}")

    def load_quant(self, ql) -> None:
        """Take one checkpoint linear (quant.formats.QuantLinear): codes stay packed."""
        n_in = ql.n_in
        if (ql.scales.shape[1], n_in) != (self.out_features, self.in_features):
            raise ValueError(f"4-bit weight is [{ql.scales.shape[1]}, {n_in}], expected "
                             f"[{self.out_features}, {self.in_features}]")
        p = ql.packed
        own = lambda t: t.clone(memory_format=torch.contiguous_format)  # noqa: E731  (one copy, off the mmap)
        self.packed = own(p) if p.dtype == torch.uint8 else own(p).view(torch.uint8)
        self.scales = own(ql.scales.to(torch.float16))
        self.zeros = None if ql.sym else own(ql.zeros.to(torch.uint8))
        self.perm = None if ql.perm is None else ql.perm.to(torch.int32).contiguous()
        self.loaded = True

    def load_dense(self, w: torch.Tensor) -> None:
        """A 16/32-bit weight [out, in] (a float checkpoint's attention under `int4_attn`), RTN-
        quantised symmetrically in groups of `self.rtn_group` as it arrives: approximate, like
        --int4's experts; one projection's fp32 temporaries at a time."""
        from .formats import QuantLinear
        from .int4 import quantize_rtn

        if tuple(w.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight is {list(w.shape)}, expected [{self.out_features}, {self.in_features}]")
        codes, scales, zeros = quantize_rtn(w, self.rtn_group, sym=True)
        self.load_quant(QuantLinear(codes, scales, zeros, sym=True))

    @property
    def group_size(self) -> int:
        return self.in_features // self.scales.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() // self.in_features <= NATIVE_MAX_ROWS:
            return self.native(x)
        return self.widened(x)

    def widened(self, x: torch.Tensor) -> torch.Tensor:
        """The torch path: WIDEN_ROWS output rows at a time dequantised to fp32 (exact), one fp32
        GEMM each → x's dtype. Also the reference the kernel is tested against."""
        xf = x.float()
        if self.perm is not None:  # codes are in perm order: permute the input once instead
            xf = xf[..., self.perm.long()]
        outs = []
        for n in range(0, self.out_features, WIDEN_ROWS):
            m = slice(n, n + WIDEN_ROWS)
            z = None if self.zeros is None else self.zeros[:, m]
            w = (native.dequant_int4(self.packed[m], self.scales[:, m], z) if native.lib() is not None
                 else dequant(self.packed[m], self.scales[:, m], z, self.group_size))
            outs.append(F.linear(xf, w, None if self.bias is None else self.bias[m].float()))
        return torch.cat(outs, -1).to(x.dtype)

    def native(self, x: torch.Tensor) -> torch.Tensor:
        return native.linear_int4(x, self.packed, self.scales, self.zeros, self.perm, self.bias, self.act)

    def storage(self) -> int:
        return self.packed.data_ptr()

    def native_lin(self):
        """(native.Lin, tensors it points into, rows up to which forward runs it) for the whole-layer
        decode call (models/native_layer.py), or None before the load or on views (a fused q/k/v's
        parts: the fused module is the one the layer call reads)."""
        if not self.loaded or not all(t is None or t.is_contiguous() for t in (self.packed, self.scales, self.zeros)):
            return None
        b32 = None if self.bias is None else self.bias.detach().float().contiguous()
        return (native.int4_lin(self.packed, self.scales, self.zeros, self.perm, b32, self.act), [b32],
                NATIVE_MAX_ROWS)

    @staticmethod
    def fuse(lins: list["Int4Linear"]) -> "Int4Linear | None":
        """One Int4Linear over the output rows of all of lins (q, k, v: one kernel call), their
        buffers turned into views of it; None unless they share group size, symmetry, act-order
        permutation and bias presence (GPTQ's act order sorts by the input's Hessian diagonal, the
        same for q, k and v, so their permutations agree in practice)."""
        a = lins[0]
        same = all(m.loaded and m.group_size == a.group_size and m.act == a.act and (m.zeros is None) == (a.zeros is None)
                   and (m.bias is None) == (a.bias is None) and m.in_features == a.in_features
                   and ((m.perm is None and a.perm is None) or (m.perm is not None and a.perm is not None
                                                                  and torch.equal(m.perm, a.perm)))
                   for m in lins)
        if not same:
            return None
        out = Int4Linear(sum(m.out_features for m in lins), a.in_features, a.bias is not None,
                         a.bias.dtype if a.bias is not None else torch.float32, a.packed.device, a.act)
        out.packed = torch.cat([m.packed for m in lins])  # [ΣN, Kin/2]
        out.scales = torch.cat([m.scales for m in lins], 1)  # [Kin/G, ΣN]
        out.zeros = None if a.zeros is None else torch.cat([m.zeros for m in lins], 1)
        out.perm = a.perm

        def views(m, at: int, n: int) -> None:
            m.packed = out.packed[at : at + n]
            m.scales = out.scales[:, at : at + n]
            if m.zeros is not None:
                m.zeros = out.zeros[:, at : at + n]

        return fuse_rows(lins, out, views)


def fuse_rows(lins: list, out, views) -> object:
    """The tail every packed linear's fuse shares (Int4Linear, fp8.Fp8Linear): out's bias = the
    parts' biases concatenated, out marked loaded, then each part re-pointed at its output rows of
    out's fused buffers — views(m, at, n) for its own tensors, its bias here — so the separate
    copies are freed. → out."""
    if out.bias is not None:
        out.bias.data = torch.cat([m.bias.data for m in lins])
    out.loaded = True
    at = 0
    for m in lins:
        n = m.out_features
        views(m, at, n)
        if m.bias is not None:
            m.bias.data = out.bias.data[at : at + n]
        at += n
    return out


__all__ = ["Int4Linear", "NATIVE_MAX_ROWS", "fuse_rows"]
