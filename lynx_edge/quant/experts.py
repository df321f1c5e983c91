"""INT4 experts of one MoE layer, resident on the model's device: the expert backend and load sink.

Built empty (one uint8 buffer [E, nbytes] in lynx_edge.quant.int4's layout) before any weight is
read; the loader streams each projection into it — 16-bit ones are RTN-quantised as they arrive
(`int4=True`, int4.quantize_part: in place, chunk by chunk), 4-bit ones from GPTQ / AWQ
checkpoints are copied in as packed bytes, scales and zeros (a non-act-order GPTQ qweight is
already this layout, transposed) — so no 16-bit copy of the experts ever exists. Forward: the fused INT4 Triton kernel on CUDA, the
compiled CPU kernel (quant/cpu_kernels.py) on a CPU, the torch reference (dequantise the active
experts only) where neither runs.
Glossary: N tokens, D hidden, E experts, K top-k, I expert intermediate, G group size.
"""
from __future__ import annotations

import torch
from torch import nn

from ..kernels.moe_gemm import fused_moe_int4, use_triton
from . import cpu_kernels
from .int4 import GROUP_SIZES, Int4Experts, Int4Layout, quantize_part, write_packed


def group_size_for(hidden: int, inter: int, wanted: int = 128) -> int:
    """The largest supported group ≤ wanted that divides both D and I (the two input dims)."""
    for g in sorted(GROUP_SIZES, reverse=True):
        if g <= wanted and hidden % g == 0 and inter % g == 0:
            return g
    raise ValueError(f"no INT4 group size divides hidden {hidden} and expert intermediate {inter}")


def write_quant(packed: Int4Experts, e: int, part: str, ql, name: str = "expert", act_order: bool = False) -> None:
    """A checkpoint's 4-bit projection (QuantLinear) → expert e's block, exactly: its packed bytes
    (a GPTQ qweight as stored, transposed in the copy), scales and zeros. Its columns are written
    in the checkpoint's order; act-order permutations are the caller's (Int4MoEExperts)."""
    if ql.perm is not None and not act_order:
        raise ValueError(f"{name}: act-order (desc_act) expert weights are not supported here "
                         "(offloaded experts); load without offload, or re-quantize with desc_act=False")
    G = packed.group_size
    if ql.scales.shape[0] * G != ql.n_in:
        raise ValueError(f"{name}: group size {ql.n_in // max(1, ql.scales.shape[0])} does not "
                         f"match the layer's INT4 layout (group {G})")
    if packed.sym and not ql.sym:  # (ql.sym: known from the reader, else checked once here)
        raise ValueError(f"{name}: asymmetric zero points in a symmetric INT4 layout")
    # GPTQ/AWQ: the bytes as read, one copy; a symmetric layout stores no zeros
    write_packed(packed, e, part, ql.packed, ql.scales, None if packed.sym else ql.zeros)


class Int4MoEExperts(nn.Module):
    """Experts of one layer as INT4 (one contiguous block per expert)."""

    def __init__(self, packed: Int4Experts):
        super().__init__()
        self.packed = packed
        self.num_experts, self.hidden, self.inter = packed.num_experts, packed.hidden, packed.inter
        # act-order GPTQ: expert e's gate/up columns are in quantisation order, so it reads
        # x[:, x_perm[e]] (int32 [E, D], None while every expert is in natural order); down's
        # permutation runs over I, internal to the expert, and is absorbed into gate/up's rows.
        self.x_perm: torch.Tensor | None = None
        self._down_perm: dict[int, torch.Tensor] = {}
        self.act: str | None = None  # CPU activations "f32" | "q16" | "q8" (kernels/native.default_int4_act), set at build

    @classmethod
    def empty(cls, E: int, D: int, I: int, group: int, sym: bool, device, act: str | None = None) -> "Int4MoEExperts":
        layout = Int4Layout(D, I, group, sym)
        out = cls(Int4Experts(torch.empty(E, layout.nbytes, dtype=torch.uint8, device=device), layout))
        out.act = act
        return out

    def extra_repr(self) -> str:
        p = self.packed
        return (f"E={p.num_experts}, D={p.hidden}, I={p.inter}, int4 group={p.group_size}, sym={p.sym}"
                + (f", act={self.act}" if self.act else ""))

    def load_part(self, e: int, part: str, w: torch.Tensor) -> None:
        quantize_part(self.packed, e, part, w)

    def load_quant_part(self, e: int, part: str, ql) -> None:
        name = f"expert {e} {part}"
        write_quant(self.packed, e, part, ql, name, act_order=True)
        if ql.perm is None:
            return
        if part == "down":
            self._down_perm[e] = ql.perm
            return
        if self.x_perm is None:
            ar = torch.arange(self.hidden, dtype=torch.int32, device=self.packed.data.device)
            self.x_perm = ar.repeat(self.num_experts, 1)  # [E, D]
        perm = ql.perm.to(self.x_perm.device, torch.int32)
        other = self.x_perm[e]
        natural = torch.equal(other, torch.arange(self.hidden, dtype=torch.int32, device=other.device))
        if not natural and not torch.equal(other, perm):
            raise ValueError(f"{name}: act-order permutation differs from its gate/up sibling's "
                             "(one input permutation per expert is supported)")
        self.x_perm[e] = perm

    def finish_load(self) -> None:
        """Absorb each act-order down projection's permutation p (over I) into gate/up rows:
        down_p · h[p] = down · h, so gate/up rows are reordered to produce h[p] directly."""
        P, I = self.packed, self.inter
        for e, p in self._down_perm.items():
            p = p.to(P.data.device)
            for rows in (slice(0, I), slice(I, 2 * I)):
                P.gu_q[e, rows] = P.gu_q[e, rows][p]
                P.gu_s[e, :, rows] = P.gu_s[e, :, rows][:, p]
                if P.gu_z is not None:
                    P.gu_z[e, :, rows] = P.gu_z[e, :, rows][:, p]
        self._down_perm.clear()

    def forward(self, x, ids, weights):  # x [N, D], ids/weights [N, K] → [N, D]
        if x.device.type == "cpu" and not use_triton(x) and cpu_kernels.available():
            # one compiled call over the packed blocks (no per-step dequantised copy, no Python
            # per expert); fp32 math, tests/test_cpu_lowbit.py bounds it against the reference
            return cpu_kernels.moe_int4_cpu(x, ids, weights, self.packed, x_perm=self.x_perm, act=self.act)
        return fused_moe_int4(x, ids, weights, self.packed, x_perm=self.x_perm)


__all__ = ["Int4MoEExperts", "group_size_for", "write_quant"]
