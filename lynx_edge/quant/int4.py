"""Group-wise INT4 expert weights: the executable spec of lynx-edge's format.

A weight W [N, Kin] (out, in; as F.linear takes it) is cut along its input dim into groups of
G ∈ {32, 64, 128} columns. Group g of output row n has an fp16 scale s[g, n] and an integer zero
point z[g, n] ∈ [0, 15]; a code q ∈ [0, 15] dequantises as

    w = s · (q − z)            symmetric: z = 8 for every group (not stored)

Quantisation (RTN, as GPTQ's quantizer does it): per group xmin = min(w, 0), xmax = max(w, 0);
symmetric s = 2·max(|xmin|, xmax)/15, asymmetric s = (xmax − xmin)/15 and z = round(−xmin/s);
s is rounded up to fp16 first, then q = clamp(round(w/s) + z, 0, 15) (round half to even).
An all-zero group uses the range [−1, 1]. Hence |w − deq| ≤ s/2 (+ fp32 rounding).

Tensors (the layout the kernels stream; scales/zeros are group-major like GPTQ's):
    packed q [N, Kin/2] uint8   byte j of a row = q[2j] | q[2j+1] << 4   (low nibble first)
    scales   [Kin/G, N] fp16
    zeros    [Kin/G, N] uint8   asymmetric only

Int4Experts holds all E experts of a layer in one uint8 buffer [E, nbytes]; row e is expert e,
parts at fixed 128-byte-aligned offsets (see Int4Layout.parts), so an offload store moves one
expert with one copy:
    gu_q [2I, D/2]  gu_s [D/G, 2I]  (gu_z [D/G, 2I])  dn_q [D, I/2]  dn_s [I/G, D]  (dn_z [I/G, D])
gate_up rows [:I] are gate, [I:] up (as moe_ref). Glossary: T tokens, D hidden, E experts,
K top-k, I expert intermediate, G group size.
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import numpy as np
import torch

from lynx_edge.kernels.moe_gemm import moe_ref_lazy

GROUP_SIZES = (32, 64, 128)
SYM_ZERO = 8  # the implicit zero point of symmetric groups
ALIGN = 128  # byte alignment of every part inside an expert block


def quantize_rtn(
    w: torch.Tensor, group_size: int = 128, sym: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest. w [..., N, Kin] → codes [..., N, Kin] uint8, scales [..., Kin/G, N] fp16,
    zeros [..., Kin/G, N] uint8 (all 8 when sym)."""
    w = w.float()  # once: group_params and quantize_with reuse it
    s, z = group_params(w, group_size, sym)
    return quantize_with(w, s, z, group_size), s, z


def group_params(
    w: torch.Tensor, group_size: int, sym: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales [..., Kin/G, N] fp16 and zeros [..., Kin/G, N] uint8 of w [..., N, Kin]."""
    _check_group(w.shape[-1], group_size)
    g = w.float().unflatten(-1, (-1, group_size))  # [..., N, ng, G]
    xmin = g.amin(-1).clamp(max=0)
    xmax = g.amax(-1).clamp(min=0)
    if sym:
        xmax = torch.maximum(-xmin, xmax)
        xmin = -xmax
    empty = (xmin == 0) & (xmax == 0)
    xmin = torch.where(empty, -1.0, xmin)
    xmax = torch.where(empty, 1.0, xmax)
    # fp16 scales (as GPTQ stores them), rounded up so the range still fits 15 steps (keeps
    # |w − deq| ≤ s/2) and ≥ the smallest normal so w/s stays finite
    s32 = ((xmax - xmin) / 15).clamp(min=2.0**-14)
    s = s32.half()
    s = torch.where(s.float() < s32, torch.nextafter(s, torch.full_like(s, torch.inf)), s)
    if sym:
        z = torch.full_like(s, SYM_ZERO, dtype=torch.uint8)
    else:
        z = torch.round(-xmin / s.float()).clamp(0, 15).to(torch.uint8)
    return s.transpose(-1, -2).contiguous(), z.transpose(-1, -2).contiguous()


def quantize_with(
    w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Codes [..., N, Kin] uint8 of w [..., N, Kin] for given scales/zeros [..., Kin/G, N]."""
    g = w.float().unflatten(-1, (-1, group_size))  # [..., N, Kin/G, G]
    q = g / _per_group(scales)  # in-place from here: one temporary of w's size
    q.round_().add_(_per_group(zeros)).clamp_(0, 15)
    return q.to(torch.uint8).flatten(-2)


def pack(q: torch.Tensor) -> torch.Tensor:
    """Codes [..., N, Kin] (0..15) → bytes [..., N, Kin/2] uint8, even column in the low nibble."""
    q = q.to(torch.uint8).contiguous()
    # little-endian int16 pairs: q[2j] in bits 0-3, q[2j+1] in bits 8-11 → one byte, no strided ops
    v = q.view(torch.int16)
    return ((v | (v >> 4)) & 0xFF).to(torch.uint8)


def unpack(p: torch.Tensor) -> torch.Tensor:
    """Bytes [..., N, Kin/2] uint8 → codes [..., N, Kin] uint8 (inverse of pack)."""
    q = torch.empty(*p.shape[:-1], 2 * p.shape[-1], dtype=torch.uint8, device=p.device)
    q[..., 0::2] = p & 0xF
    q[..., 1::2] = p >> 4
    return q


def dequant(
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """w = s·(q − z) in fp32, then cast. packed [..., N, Kin/2], scales/zeros [..., Kin/G, N]
    (zeros None = symmetric, z = 8) → [..., N, Kin] dtype."""
    q = unpack(packed).float().unflatten(-1, (-1, group_size))  # [..., N, Kin/G, G]
    z = SYM_ZERO if zeros is None else _per_group(zeros)
    return ((q - z) * _per_group(scales)).flatten(-2).to(dtype)


def _per_group(t: torch.Tensor) -> torch.Tensor:
    """[..., Kin/G, N] → fp32 [..., N, Kin/G, 1], broadcasting over a group's G weights."""
    return t.transpose(-1, -2).float()[..., None]


def _check_group(k: int, group_size: int) -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"INT4 group size must be one of {GROUP_SIZES}, got {group_size}")
    if k % group_size:
        raise ValueError(f"input dim {k} is not a multiple of the group size {group_size}")


@dataclass(frozen=True)
class Int4Layout:
    """Byte layout of one expert block for hidden D, intermediate I, group G."""

    hidden: int  # D
    inter: int  # I
    group_size: int = 128
    sym: bool = True

    def parts(self) -> dict[str, tuple[int, tuple[int, ...], torch.dtype]]:
        """name → (byte offset, shape, dtype), in block order."""
        D, I, G = self.hidden, self.inter, self.group_size
        spec = [
            ("gu_q", (2 * I, D // 2), torch.uint8),
            ("gu_s", (D // G, 2 * I), torch.float16),
            ("gu_z", (D // G, 2 * I), torch.uint8),
            ("dn_q", (D, I // 2), torch.uint8),
            ("dn_s", (I // G, D), torch.float16),
            ("dn_z", (I // G, D), torch.uint8),
        ]
        out, off = {}, 0
        for name, shape, dt in spec:
            if self.sym and name.endswith("_z"):
                continue
            out[name] = (off, shape, dt)
            off += _align(shape[0] * shape[1] * dt.itemsize)
        return out

    @functools.cached_property
    def part_offsets(self) -> np.ndarray:
        """int64 [6]: byte offsets of gu_q, gu_s, gu_z, dn_q, dn_s, dn_z (zeros: 0 when sym), as the
        native / numba kernels take them; built once per layout."""
        parts = self.parts()
        return np.array([parts[n][0] if n in parts else 0 for n in ("gu_q", "gu_s", "gu_z", "dn_q", "dn_s", "dn_z")],
                        dtype=np.int64)

    @property
    def nbytes(self) -> int:
        """Bytes per expert (a multiple of ALIGN)."""
        off, shape, dt = list(self.parts().values())[-1]
        return off + _align(shape[0] * shape[1] * dt.itemsize)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Int4Experts:
    """All E experts of one MoE layer in one contiguous uint8 buffer data [E, nbytes].

    Attributes gu_q, gu_s, gu_z, dn_q, dn_s, dn_z are views [E, ...] into data (gu_z/dn_z are None
    when sym). data[e] is expert e's whole block: copy it to move the expert.
    """

    def __init__(self, data: torch.Tensor, layout: Int4Layout):
        _check_group(layout.hidden, layout.group_size)
        _check_group(layout.inter, layout.group_size)
        if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != layout.nbytes:
            raise ValueError(f"expected uint8 [E, {layout.nbytes}], got {data.dtype} {tuple(data.shape)}")
        self.data, self.layout = data, layout
        E = data.shape[0]
        self.gu_z = self.dn_z = None
        for name, (off, shape, dt) in layout.parts().items():
            n = shape[0] * shape[1] * dt.itemsize
            view = data[:, off : off + n].view(dt).view(E, *shape)
            setattr(self, name, view)

    group_size = property(lambda self: self.layout.group_size)
    sym = property(lambda self: self.layout.sym)
    hidden = property(lambda self: self.layout.hidden)
    inter = property(lambda self: self.layout.inter)
    num_experts = property(lambda self: self.data.shape[0])

    @classmethod
    def empty(cls, num_experts: int, layout: Int4Layout, device="cpu") -> "Int4Experts":
        return cls(torch.zeros(num_experts, layout.nbytes, dtype=torch.uint8, device=device), layout)

    @classmethod
    def from_codes(
        cls,
        gu: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # codes [E,2I,D], s/z [E,D/G,2I]
        dn: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # codes [E,D,I], s/z [E,I/G,D]
        group_size: int,
        sym: bool,
    ) -> "Int4Experts":
        """Assemble from unpacked codes + scales + zeros. sym requires every zero to be 8."""
        (q_gu, s_gu, z_gu), (q_dn, s_dn, z_dn) = gu, dn
        E, two_i, D = q_gu.shape
        if sym and not (bool((z_gu == SYM_ZERO).all()) and bool((z_dn == SYM_ZERO).all())):
            raise ValueError("sym=True needs every zero point to be 8")
        out = cls.empty(E, Int4Layout(D, two_i // 2, group_size, sym), q_gu.device)
        out.gu_q.copy_(pack(q_gu))
        out.gu_s.copy_(s_gu)
        out.dn_q.copy_(pack(q_dn))
        out.dn_s.copy_(s_dn)
        if not sym:
            out.gu_z.copy_(z_gu)
            out.dn_z.copy_(z_dn)
        return out

    def codes(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Inverse of from_codes: ((q_gu, s_gu, z_gu), (q_dn, s_dn, z_dn)), zeros filled for sym."""
        def z(t, s):
            return torch.full_like(s, SYM_ZERO, dtype=torch.uint8) if t is None else t.clone()

        return (
            (unpack(self.gu_q), self.gu_s.clone(), z(self.gu_z, self.gu_s)),
            (unpack(self.dn_q), self.dn_s.clone(), z(self.dn_z, self.dn_s)),
        )

    def dequant_expert(self, e: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (gate_up [2I, D], down [D, I]) in dtype."""
        G = self.group_size
        gz = None if self.gu_z is None else self.gu_z[e]
        dz = None if self.dn_z is None else self.dn_z[e]
        return (
            dequant(self.gu_q[e], self.gu_s[e], gz, G, dtype),
            dequant(self.dn_q[e], self.dn_s[e], dz, G, dtype),
        )

    def to(self, device) -> "Int4Experts":
        return Int4Experts(self.data.to(device), self.layout)


def quantize_experts(
    gate_up: torch.Tensor, down: torch.Tensor, group_size: int = 128, sym: bool = True
) -> Int4Experts:
    """RTN-quantise stacked experts gate_up [E, 2I, D], down [E, D, I] into one Int4Experts."""
    return Int4Experts.from_codes(
        quantize_rtn(gate_up, group_size, sym), quantize_rtn(down, group_size, sym), group_size, sym
    )


def part_views(
    packed: Int4Experts, e: int, part: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Expert e's destination for one projection (views into packed.data): part gate | up
    (rows [:I] / [I:] of gate_up) or down → (q [N, Kin/2] uint8, scales [Kin/G, N] fp16,
    zeros [Kin/G, N] uint8 or None when sym). gate/up scales are strided views (row stride 2I)."""
    if part == "down":
        return packed.dn_q[e], packed.dn_s[e], None if packed.sym else packed.dn_z[e]
    if part not in ("gate", "up"):
        raise ValueError(f"unknown expert projection {part!r} (gate, up or down)")
    I = packed.inter
    rows = slice(0, I) if part == "gate" else slice(I, 2 * I)
    z = None if packed.sym else packed.gu_z[e, :, rows]
    return packed.gu_q[e, rows], packed.gu_s[e, :, rows], z


def write_part(
    packed: Int4Experts, e: int, part: str, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> None:
    """Write one projection of expert e in place from unpacked codes [out, in] (0..15) and
    scales/zeros [in/G, out] (write_packed after pack)."""
    write_packed(packed, e, part, pack(codes), scales, zeros)


def write_packed(
    packed: Int4Experts, e: int, part: str, qbytes: torch.Tensor, scales: torch.Tensor,
    zeros: torch.Tensor | None,
) -> None:
    """Write one projection of expert e in place, already packed: qbytes [out, in/2] uint8 in
    pack()'s layout, or the same bytes as little-endian int32 words [out, in/8] (any strides: a
    GPTQ qweight [in/8, out] transposed is exactly this, so it lands with one copy). scales/zeros
    [in/G, out]. A symmetric layout stores no zeros, so it needs every zero to be 8 (ValueError
    otherwise; zeros None: the caller knows they are). Works on any device (host → device copies
    of one projection)."""
    if zeros is None and not packed.sym:
        raise ValueError("an asymmetric INT4 layout needs the zero points")
    if packed.sym and zeros is not None and not bool((zeros == SYM_ZERO).all()):
        raise ValueError("asymmetric zero points in a symmetric INT4 layout")
    q, s, z = part_views(packed, e, part)
    dst = q.view(qbytes.dtype)
    if dst.shape != qbytes.shape or s.shape != scales.shape:
        raise ValueError(f"{part} projection: packed {tuple(qbytes.shape)} / scales {tuple(scales.shape)}, "
                         f"expected {tuple(dst.shape)} / {tuple(s.shape)} for this INT4 layout")
    dst.copy_(qbytes)
    s.copy_(scales)  # casts to fp16 in the copy (exact for fp16 checkpoints: checked by the reader)
    if z is not None:
        z.copy_(zeros)


# ------------------------------------------------------------------ fast RTN (load path)
#
# quantize_rtn + pack above are the spec; rtn_pack_into computes the same bytes in a few in-place
# passes over an L2-sized fp32 chunk instead of ~20 full-size temporaries (bit-identical; tested
# against the spec in tests/test_int4.py). Rounding: x + 1.5·2²³ is x rounded to an integer, ties
# to even (the fp32 add rounds once, in the default mode, and the ulp there is 1; 1.5·2²³ and the
# symmetric zero 8 are even, so ties land as torch.round's do); for 2²³ ≤ v < 2²⁴ the low mantissa
# byte of v is v − 1.5·2²³, so after clamping to [M, M + 15] byte 0 of each fp32 word (little
# endian) is the code, and pairs of those bytes pack with one uint8 op straight into the block.

_MAGIC = 12582912.0  # 1.5·2²³
CHUNK_ELEMS = 1 << 18  # fp32 elements per chunk (1 MiB: the chain of passes stays in L2)
_scratch = threading.local()


def _chunk_buffer(n: int) -> torch.Tensor:
    """A reused fp32 scratch of ≥ n elements (per thread; about CHUNK_ELEMS, one row if longer)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < n:
        buf = _scratch.buf = torch.empty(n, dtype=torch.float32)
    return buf[:n]


def _range_params(mn: torch.Tensor, mx: torch.Tensor, sym: bool):
    """group_params from per-group min/max fp32 [n, ng] (both modified in place) → scales fp16
    [n, ng], their fp32 values, zeros as fp32 and uint8 [n, ng] (None, None when sym). The same
    values as group_params in fewer small ops (all exact rewrites):
    sym: max(−min(mn, 0), max(mx, 0)) = max(mx, −mn, 0), the range 2·xmax (doubling is exact),
    an empty group has xmax = 0; rounding a positive fp16 scale up one step is +1 on its bits."""
    if sym:
        xmax = torch.maximum(mx, mn.neg_(), out=mx).clamp_(min=0)
        xmax.masked_fill_(xmax == 0, 1.0)
        s32 = xmax.mul_(2)
    else:
        mn.clamp_(max=0)
        mx.clamp_(min=0)
        empty = mn == mx  # both 0 (mn ≤ 0 ≤ mx)
        mn.masked_fill_(empty, -1.0)
        s32 = mx.masked_fill_(empty, 1.0).sub_(mn)
    s32.div_(15).clamp_(min=2.0**-14)
    s = s32.half()
    s = (s.view(torch.int16) + (s.float() < s32)).view(torch.float16)  # s > 0: next fp16 up = bits + 1
    sf = s.float()
    if sym:
        return s, sf, None, None
    zf = torch.round(mn.neg_().div_(sf)).clamp_(0, 15)
    return s, sf, zf, zf.to(torch.uint8)


def rtn_pack_into(
    w: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor, z_out: torch.Tensor | None, group_size: int,
    sym: bool,
) -> None:
    """RTN of w [N, K] (any float dtype and strides, e.g. a view of a checkpoint's mmap) written
    into CPU tensors q_out [N, K/2] uint8 (packed), s_out [K/G, N] fp16 and z_out [K/G, N] uint8
    (None when sym), chunk by chunk: the same bytes as pack(quantize_rtn(w)) and its scales/zeros."""
    N, K = w.shape
    G = group_size
    _check_group(K, G)
    if w.device.type != "cpu":
        w = w.cpu()
    chunks = -(-N * K // CHUNK_ELEMS)  # ≥ 1; rows split evenly (no one-row tail chunk)
    rows = -(-N // chunks)
    buf = _chunk_buffer(rows * K)
    for r0 in range(0, N, rows):
        r1 = min(N, r0 + rows)
        n = r1 - r0
        x = buf[: n * K].view(n, K // G, G)
        x.view(n, K).copy_(w[r0:r1])
        s, sf, zf, z = _range_params(x.amin(-1), x.amax(-1), sym)
        x.div_(sf[..., None])
        if sym:
            x.add_(_MAGIC + SYM_ZERO)
        else:
            x.add_(_MAGIC).add_(zf[..., None])
        x.clamp_(_MAGIC, _MAGIC + 15)
        b = x.view(n, K // 2, 2).view(torch.uint8)  # [n, K/2, 8]: byte 0 = even code, byte 4 = odd
        torch.add(b[..., 0], b[..., 4], alpha=16, out=q_out[r0:r1])
        s_out[:, r0:r1].copy_(s.t())
        if z_out is not None:
            z_out[:, r0:r1].copy_(z.t())


def quantize_part(packed: Int4Experts, e: int, part: str, w: torch.Tensor) -> None:
    """RTN-quantise one 16/32-bit projection w [out, in] into expert e's block (part as in
    part_views), through rtn_pack_into: fp32 temporaries of one chunk, not of the projection.
    A device block gets the host result with one copy per tensor."""
    q, s, z = part_views(packed, e, part)
    if tuple(w.shape) != (q.shape[0], 2 * q.shape[1]):
        raise ValueError(f"{part} projection: shape {tuple(w.shape)}, expected {(q.shape[0], 2 * q.shape[1])}")
    if packed.data.device.type == "cpu":
        rtn_pack_into(w, q, s, z, packed.group_size, packed.sym)
        return
    hq, hs = torch.empty(q.shape, dtype=torch.uint8), torch.empty(s.shape, dtype=torch.float16)
    hz = None if z is None else torch.empty(z.shape, dtype=torch.uint8)
    rtn_pack_into(w, hq, hs, hz, packed.group_size, packed.sym)
    q.copy_(hq)
    s.copy_(hs)
    if z is not None:
        z.copy_(hz)


def dequantize_experts(
    packed: Int4Experts, dtype=torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """All experts back to (gate_up [E, 2I, D], down [E, D, I]) in dtype."""
    G = packed.group_size
    return (
        dequant(packed.gu_q, packed.gu_s, packed.gu_z, G, dtype),
        dequant(packed.dn_q, packed.dn_s, packed.dn_z, G, dtype),
    )


def int4_moe_ref(
    x: torch.Tensor,  # [T, D]
    ids: torch.Tensor,  # [T, K] int64
    weights: torch.Tensor,  # [T, K] fp32
    packed: Int4Experts,
) -> torch.Tensor:
    """moe_ref on dequantised weights (x's dtype), dequantising only the experts in ids → [T, D]."""
    return moe_ref_lazy(x, ids, weights, packed.num_experts, lambda e: packed.dequant_expert(e, x.dtype))


__all__ = [
    "GROUP_SIZES", "Int4Experts", "Int4Layout", "dequant", "dequantize_experts", "group_params",
    "int4_moe_ref", "pack", "part_views", "quantize_experts", "quantize_part", "quantize_rtn", "quantize_with",
    "rtn_pack_into", "unpack", "write_packed", "write_part",
]
