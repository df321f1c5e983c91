"""Store format for experts with biases and a family activation (gpt-oss): one byte block each.

    gate_up [2I, D] (rows [:I] gate, [I:] up) + bias [2I], down [D, I] + bias [D];
    y = down·act(gate_up·x + b_gu) + b_dn, act: the family's, over [gate | up] → [n, I].

Weights are dense (bf16 / fp16 / fp32, viewed in place) or MXFP4 (e2m1 codes [out, in/2] and e8m0
scales [out, in/32] per projection, as published: 4.25 bits per weight, dequantised one expert at
a time by kernels/moe_mxfp4's reference); biases are in the model dtype. Parts sit at 128-byte
aligned offsets, so a block is one copy and the device slots hold the same layout. The family
describes its experts with an `expert_store(cfg, dtype, four_bit)` hook (weights, act, reader);
nothing here names a family. Glossary: n tokens, D hidden, I expert intermediate.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from ..kernels.moe_mxfp4 import mxfp4_dequant, mxfp4_quantize
from .store import _DENSE, _align, _typed

PARTS = ("gate", "up", "down")


class BiasedFormat:
    """weights: "mxfp4" or a dense name (bf16 | fp16 | fp32); act(h [n, 2I]) → [n, I]; reader():
    a new per-layer reader of checkpoint tensors (load_tensor(sink, name, w), finish())."""

    def __init__(self, weights: str, hidden: int, inter: int, bias_dtype: torch.dtype, act, reader=None,
                 int4_act: str | None = None):
        if weights != "mxfp4" and weights not in _DENSE:
            raise ValueError(f"expert weights {weights!r} are unknown (mxfp4, bf16, fp16, fp32)")
        D, I = hidden, inter
        self.name, self.hidden, self.inter, self.act, self.reader = weights, D, I, act, reader
        self.mx = weights == "mxfp4"
        self.int4_act = int4_act  # CPU MXFP4 rows' activations (the engine's int4_act; None: the default)
        if self.mx and (D % 32 or I % 32):
            raise ValueError(f"MXFP4 experts need hidden ({D}) and intermediate ({I}) sizes divisible by 32")
        self.dtype = torch.uint8 if self.mx else _DENSE[weights]
        self.bias_dtype = bias_dtype
        # (name, shape, dtype) in block order; an MXFP4 row of `in` values is in/2 bytes + in/32 scales
        wide = (lambda n: n // 2) if self.mx else (lambda n: n)
        parts = [("gu", (2 * I, wide(D)), self.dtype)]
        parts += [("gu_s", (2 * I, D // 32), torch.uint8)] if self.mx else []
        parts += [("dn", (D, wide(I)), self.dtype)]
        parts += [("dn_s", (D, I // 32), torch.uint8)] if self.mx else []
        parts += [("gu_b", (2 * I,), bias_dtype), ("dn_b", (D,), bias_dtype)]
        self.layout, off = {}, 0
        for name, shape, dt in parts:
            self.layout[name] = (off, shape, dt)
            n = dt.itemsize
            for s in shape:
                n *= s
            off += _align(n)
        self.nbytes = off

    def _t(self, block: torch.Tensor, name: str) -> torch.Tensor:
        off, shape, dt = self.layout[name]
        return _typed(block, off, shape, dt)

    def _rows(self, block: torch.Tensor, part: str, what: str) -> torch.Tensor:
        """Expert block's rows of one projection: what = "" weights, "_s" scales, "_b" bias."""
        I = self.inter
        if part == "down":
            return self._t(block, "dn" + what)
        t = self._t(block, "gu" + what)
        return t[:I] if part == "gate" else t[I:]

    # -- writers (the load sink: one projection of expert e of a layer buffer uint8 [E, nbytes]) --
    def write_part(self, buf: torch.Tensor, e: int, part: str, w: torch.Tensor) -> None:
        """← a 16/32-bit projection w [out, in]: copied (cast), or RTN-quantised to MXFP4."""
        dst = self._rows(buf[e], part, "")
        if not self.mx:
            dst.copy_(w)
            return
        blocks, scales = mxfp4_quantize(w)
        dst.copy_(blocks.flatten(-2))
        self._rows(buf[e], part, "_s").copy_(scales)

    def write_mx_part(self, buf: torch.Tensor, e: int, part: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        """← an MXFP4 projection (blocks [out, in/32, 16], scales [out, in/32]): bytes as read, or
        dequantised exactly into dense weights."""
        dst = self._rows(buf[e], part, "")
        if not self.mx:
            dst.copy_(mxfp4_dequant(blocks, scales, torch.float32))
            return
        dst.copy_(blocks.flatten(-2))
        self._rows(buf[e], part, "_s").copy_(scales)

    def write_bias(self, buf: torch.Tensor, e: int, part: str, b: torch.Tensor) -> None:
        self._rows(buf[e], part, "_b").copy_(b)

    def write_quant_part(self, buf, e, part, ql, name: str = "expert") -> None:
        raise ValueError(f"{name}: a GPTQ/AWQ linear cannot go into {self.name} experts with biases")

    def pack_into(self, dst, gate_up, down) -> None:
        raise ValueError("experts with biases are stored through their backend's export_to, not as stacked weights")

    def export(self, block: torch.Tensor, e: int, sink) -> None:
        """One stored expert → a resident backend sink (load_part / load_mx_part / load_bias)."""
        for part in PARTS:
            w = self._rows(block, part, "")
            if self.mx:
                sink.load_mx_part(e, part, w.unflatten(-1, (-1, 16)), self._rows(block, part, "_s"))
            else:
                sink.load_part(e, part, w)
            sink.load_bias(e, part, self._rows(block, part, "_b"))

    # -- compute ----------------------------------------------------------------------------------
    def tensors(self, block: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """block uint8 [nbytes] → (gate_up [2I, D], gate_up_bias [2I], down [D, I], down_bias [D]) in
        dtype: views for dense weights of that dtype, one expert dequantised for MXFP4."""
        if self.mx:
            gu = mxfp4_dequant(self._t(block, "gu").unflatten(-1, (-1, 16)), self._t(block, "gu_s"), dtype)
            dn = mxfp4_dequant(self._t(block, "dn").unflatten(-1, (-1, 16)), self._t(block, "dn_s"), dtype)
        else:
            gu, dn = self._t(block, "gu").to(dtype), self._t(block, "dn").to(dtype)
        return gu, self._t(block, "gu_b").to(dtype), dn, self._t(block, "dn_b").to(dtype)

    def compute(self, block: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [n, D] → [n, D] in x's dtype: the ops of kernels/moe_mxfp4.oss_moe_ref for one expert.
        On a CPU, gpt-oss's activation over an MXFP4 / fp32 / bf16 block runs the native kernel on
        the block's bytes in place (no expert dequantised per call)."""
        fast = self._native(block, x)
        if fast is not None:
            return fast
        gu, gu_b, dn, dn_b = self.tensors(block, x.dtype)
        return F.linear(self.act(F.linear(x, gu, gu_b)), dn, dn_b)

    def _native(self, block: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        from ..kernels import native
        from ..kernels.moe_mxfp4 import oss_act

        act = self.act
        if (x.device.type != "cpu" or block.device.type != "cpu" or not isinstance(act, partial)
                or act.func is not oss_act or native.lib() is None):
            return None
        gu, dn = self._t(block, "gu"), self._t(block, "dn")
        if not self.mx and not native.dense_ok(gu, dn):
            return None
        n = x.shape[0]
        sc = dict(gate_up_scales=self._t(block, "gu_s")[None], down_scales=self._t(block, "dn_s")[None]) if self.mx else {}
        return native.moe_oss(x, torch.zeros(n, 1, dtype=torch.int64), torch.ones(n, 1), gu[None], dn[None],
                              self._t(block, "gu_b")[None], self._t(block, "dn_b")[None], act.keywords["limit"],
                              act.keywords["alpha"], **sc, act=self.int4_act if self.mx else None)


def family_format(cfg, dtype: torch.dtype, four_bit: bool, int4_act: str | None = None) -> BiasedFormat | None:
    """The store format of a family that describes its own experts (`expert_store` hook), else None;
    int4_act: its MXFP4 rows' CPU activations."""
    from ..models.transformer import family_of

    hook = getattr(family_of(cfg), "expert_store", None)
    if hook is None:
        return None
    spec = hook(cfg, dtype, four_bit)
    return BiasedFormat(spec["weights"], cfg.hidden_size, cfg.moe_intermediate_size, dtype, spec["act"],
                        spec.get("reader"), int4_act)


__all__ = ["BiasedFormat", "family_format"]
