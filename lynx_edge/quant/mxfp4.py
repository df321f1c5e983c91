"""MXFP4 (OCP microscaling FP4) as gpt-oss publishes its experts: the format.

A linear W [out, in] is stored as `<name>_blocks` uint8 [out, in/32, 16] — two e2m1 codes per byte,
the low nibble the even element — and `<name>_scales` uint8 [out, in/32], an e8m0 exponent per
32 values: W[r, 32g + j] = e2m1(code) · 2^(scales[r, g] − 127). 4.25 bits per weight.
gpt-oss stacks experts on a leading E axis and interleaves gate/up rows (even rows gate).
The torch reference (dequant, round-to-nearest quantize) lives beside the Triton kernel that
decodes the same bytes in registers (kernels/moe_mxfp4.py); this module adds what a checkpoint
writer and the memory plan need. Glossary: E experts, D hidden, I expert intermediate.
"""
from __future__ import annotations

import torch

from ..kernels.moe_mxfp4 import BLOCK, FP4_VALUES, mxfp4_dequant, mxfp4_quantize

BITS_PER_WEIGHT = 4 + 8 / BLOCK


def nbytes(out: int, inp: int) -> int:
    """Bytes of one MXFP4 linear [out, in]: codes + scales."""
    if inp % BLOCK:
        raise ValueError(f"MXFP4 needs the input size ({inp}) to be a multiple of {BLOCK}")
    return out * inp // 2 + out * inp // BLOCK


def pack_linear(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [..., out, in] → (blocks [..., out, in/32, 16], scales [..., out, in/32]) as published."""
    return mxfp4_quantize(w)


def unpack_linear(blocks: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """(blocks [..., out, in/32, 16], scales [..., out, in/32]) → W [..., out, in]."""
    return mxfp4_dequant(blocks, scales, dtype)


def codes(blocks: torch.Tensor) -> torch.Tensor:
    """blocks [..., G, 16] → e2m1 codes [..., G·32] (uint8 0..15, element order)."""
    return torch.stack((blocks & 0xF, blocks >> 4), dim=-1).flatten(-3)


__all__ = ["BITS_PER_WEIGHT", "BLOCK", "FP4_VALUES", "codes", "nbytes", "pack_linear", "unpack_linear"]
