"""AWQ checkpoints (AutoAWQ "gemm" packing, 4 bits) ↔ unpacked codes / zeros / scales.

For one linear W [out, in], group size G (tensors as AutoAWQ's WQLinear_GEMM stores them):
    qweight int32 [in, out/8]     8 output columns per word, in AWQ_ORDER
    qzeros  int32 [in/G, out/8]   same packing as qweight, zeros stored as is (no −1 offset)
    scales  fp16  [in/G, out]
    Wᵀ[i, o] = (q[i, o] − z[i // G, o]) · s[i // G, o]
Nibble k (bits 4k..4k+3) of word c holds output column 8c + AWQ_ORDER[k]. The layout is defined
by AutoAWQ's packer (awq/modules/linear/gemm.py, WQLinear_GEMM.from_linear: `order_map =
[0, 2, 4, 6, 1, 3, 5, 7]`, `qweight[:, col] |= intweight[:, col*8 + order_map[i]] << 4i`, the same
loop for qzeros) and read back the same way by AutoAWQ's dequantize_gemm
(awq/utils/packing_utils.py: AWQ_REVERSE_ORDER [0, 4, 1, 5, 2, 6, 3, 7]) and by vLLM's
awq_dequantize / awq_gemm Triton kernels (vllm/model_executor/layers/quantization/awq_triton.py:
shifts = reverse order · 4). It interleaves even and odd columns so the CUDA kernel can
convert pairs of nibbles to fp16 with one bit trick; the reader only has to undo the order.
"""
from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of a word holds column AWQ_ORDER[k]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j of a word sits in nibble AWQ_REVERSE_ORDER[j]


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2³²) → int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_awq_words(vals: torch.Tensor) -> torch.Tensor:
    """vals [rows, cols] (0..15, cols % 8 == 0) → int32 [rows, cols/8] in AutoAWQ's order."""
    v = vals.to(torch.int64).unflatten(1, (-1, 8))  # [rows, cols/8, 8] natural column order
    v = v[..., list(AWQ_ORDER)]  # nibble k takes column AWQ_ORDER[k]
    shifts = 4 * torch.arange(8, device=v.device)
    return _to_int32((v << shifts).sum(-1))


def unpack_awq_words(words: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols/8] → uint8 [rows, cols] in natural column order, one nibble plane at a
    time in int32 (the arithmetic shift's sign bits are masked off: small transients)."""
    rows, n8 = words.shape
    out = torch.empty(rows, n8, 8, dtype=torch.uint8, device=words.device)  # [rows, cols/8, 8]
    for k in range(8):
        out[..., AWQ_ORDER[k]] = ((words >> (4 * k)) & 0xF).to(torch.uint8)  # nibble k → column AWQ_ORDER[k]
    return out.view(rows, 8 * n8)


def pack_awq(
    codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor
) -> dict[str, torch.Tensor]:
    """codes [out, in] (0..15), zeros [in/G, out] (0..15), scales [in/G, out] →
    {qweight [in, out/8] int32, qzeros [in/G, out/8] int32, scales [in/G, out] fp16}."""
    return {
        "qweight": pack_awq_words(codes.t()),
        "qzeros": pack_awq_words(zeros),
        "scales": scales.to(torch.float16).contiguous(),
    }


def unpack_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """qweight [in, out/8], qzeros [in/G, out/8] → codes [out, in] uint8, zeros [in/G, out] uint8.
    The words are transposed first (8× fewer elements than the codes) and read as little-endian
    bytes: byte b of a word holds nibbles 2b (low) and 2b + 1 (high), i.e. output columns
    AWQ_ORDER[2b] and AWQ_ORDER[2b + 1]; each lands in whole output rows."""
    b = qweight.t().contiguous().view(torch.uint8).view(qweight.shape[1], qweight.shape[0], 4)  # [out/8, in, 4]
    codes = torch.empty(b.shape[0], 8, b.shape[1], dtype=torch.uint8, device=b.device)  # [out/8, 8, in]
    for byte in range(4):
        codes[:, AWQ_ORDER[2 * byte]] = b[..., byte] & 0xF
        codes[:, AWQ_ORDER[2 * byte + 1]] = b[..., byte] >> 4
    return codes.view(-1, b.shape[1]), unpack_awq_words(qzeros)


_LOW = 0x0F0F0F0F  # the even nibbles of a word (nibble 2b: low half of byte b)
_HIGH = 0xF0F0F0F0 - 2**32  # the odd nibbles, as an int32 constant


def awq_packed(qweight: torch.Tensor) -> torch.Tensor:
    """qweight [in, out/8] → int4.py's packed codes [out, in/2] uint8 (= pack(unpack_awq(…)[0])),
    without unpacking to one code per byte. A packed byte pairs inputs 2j (low nibble) and 2j+1
    of one output; AWQ keeps an output's code at the same nibble of rows 2j and 2j+1, so per
    word pair (E = row 2j, O = row 2j+1): lo = E's even nibbles | O's even nibbles << 4 holds,
    in byte b, output column AWQ_ORDER[2b]'s packed byte; hi (the odd nibbles) AWQ_ORDER[2b+1]'s.
    AWQ_ORDER[2b + h] = 4·(b % 2) + 2·h + b // 2, so one axis permutation puts every byte in place."""
    n_in, n8 = qweight.shape
    qt = qweight.t().contiguous()  # [out/8, in]: one int32 transpose, rows then pair up cheaply
    even, odd = qt[:, 0::2], qt[:, 1::2]  # [out/8, in/2]
    lohi = torch.empty(n8, n_in // 2, 2, dtype=torch.int32, device=qweight.device)
    torch.bitwise_or(even & _LOW, (odd & _LOW) << 4, out=lohi[..., 0])
    torch.bitwise_or((even >> 4) & _LOW, odd & _HIGH, out=lohi[..., 1])
    b = lohi.view(torch.uint8).view(n8, n_in // 2, 2, 2, 2)  # [out/8, in/2, h, b // 2, b % 2]
    out = torch.empty(n8, 2, 2, 2, n_in // 2, dtype=torch.uint8, device=qweight.device)  # [out/8, b%2, h, b//2, in/2]
    out.copy_(b.permute(0, 4, 2, 3, 1))
    return out.view(8 * n8, n_in // 2)


__all__ = ["AWQ_ORDER", "AWQ_REVERSE_ORDER", "awq_packed", "pack_awq", "pack_awq_words", "unpack_awq", "unpack_awq_words"]
