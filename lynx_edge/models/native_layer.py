"""A decoder layer's CPU decode step in two native calls around the router.

The module path of one decode layer is ~40 Python and torch calls around five native kernels
(norms, fused q/k/v, attention, o_proj, router, experts, dtype casts, residual adds): on a small
model that is most of the step, and it is serial when the kernels use two threads. Here

    lynx_layer_attn   x → RMSNorm → q/k/v → attention (cache write) → o_proj → + x = x1,
                      RMSNorm(x1) = h2, router logits          (one call)
    ctx.route         the routing decision, in torch as before (exact / LYNX / offload routers)
    lynx_layer_moe    x1 + experts(h2)                         (one call)

with the same kernels and the same roundings as the module path: the result is bit-equal to it
(tests/test_native_layer.py), and, as the kernels sum each row the same way in any batch, a row's
result does not depend on the batch it runs in. The plan (pointers into the
layer's weights) is built on the first decode step and checked against the weights' storage each
step. Layers of another shape — a family's own attention or norm, shared experts, a scorer, an
offloaded or gpt-oss expert backend — and batches past the kernels' row limits run the module path.
Glossary: B rows, D hidden, E experts, K top-k.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from ..kernels import native
from .layers import Attention, AttnBatch, Linear, MoEBlock, RMSNorm, StackedExperts

# LYNX_EDGE_NATIVE_LAYER=0: every layer runs the module path (the kernels still run inside it)
NATIVE_LAYERS = os.environ.get("LYNX_EDGE_NATIVE_LAYER", "1") != "0"
DENSE_ROWS = {torch.bfloat16: 128, torch.float32: 32}  # layers.NATIVE_ROWS: the module path's projections are native up to these
INT4_ROWS = 32  # quant/linear.NATIVE_MAX_ROWS (models never import quant: duck-typed here)
FP32_SLOTS = 512  # layers.NATIVE_SLOTS: fp32 experts run natively up to this many token-expert slots


def _is_int4_linear(m) -> bool:
    return hasattr(m, "packed") and hasattr(m, "scales") and getattr(m, "loaded", False)


def _lin(m, keep: list):
    """A native.Lin for a Linear or an INT4 linear (None when neither fits); keep collects the
    tensors the plan points into."""
    b = m.bias
    b32 = None if b is None else b.detach().float().contiguous()
    if b32 is not None:
        keep.append(b32)
    if type(m) is Linear:
        return native.dense_lin(m.weight, b32) if native.dense_ok(m.weight) else None
    if _is_int4_linear(m):
        parts = [m.packed, m.scales, m.zeros, m.perm]
        if not all(t is None or (t.device.type == "cpu" and t.is_contiguous()) for t in parts):
            return None
        return native.int4_lin(m.packed, m.scales, m.zeros, m.perm, b32, m.act)
    return None


class NativeLayer:
    """The two layer calls' plans for one DecoderLayer, and what they point into."""

    def __init__(self, layer, attn_plan, moe_plan, keep: list, key: tuple, max_rows: int, max_slots: int):
        self.layer, self.attn_plan, self.moe_plan, self.keep, self.key = layer, attn_plan, moe_plan, keep, key
        self.max_rows, self.max_slots = max_rows, max_slots
        self.mlp = layer.mlp  # read once: nn.Module attribute lookups cost microseconds per step
        self.n_experts = self.mlp.gate.weight.shape[0]

    @classmethod
    def make(cls, layer) -> "NativeLayer | None":
        if native.lib() is None or not layer.is_moe:
            return None
        n1, n2, attn, mlp = layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn, layer.mlp
        dt = n1.weight.dtype
        if type(n1) is not RMSNorm or type(n2) is not RMSNorm or dt not in DENSE_ROWS or n2.weight.dtype != dt:
            return None
        if not (native.dense_ok(n1.weight) and native.dense_ok(n2.weight)) or n1.weight.shape[0] > 4096:
            return None
        if type(attn) is not Attention or type(mlp) is not MoEBlock or mlp.scorer is not None:
            return None
        if mlp.shared_expert is not None or attn.qk_norm not in ("none", "head"):
            return None
        head = attn.qk_norm == "head"
        if head and (type(attn.q_norm) is not RMSNorm or type(attn.k_norm) is not RMSNorm):
            return None
        fused = attn._fused()
        keep: list = []
        lins = [None if fused is None else _lin(fused, keep), _lin(attn.o_proj, keep), _lin(mlp.gate, keep)]
        if any(x is None for x in lins) or mlp.gate.weight.dtype != dt:
            return None
        int4 = any(_is_int4_linear(m) for m in (fused, attn.o_proj))
        max_rows = min(DENSE_ROWS[dt], INT4_ROWS) if int4 else DENSE_ROWS[dt]
        qn = kn = None
        if head:
            qn, kn = attn.q_norm.weight.detach().float().contiguous(), attn.k_norm.weight.detach().float().contiguous()
            keep += [qn, kn]
        plan = native.AttnLayer(native._FMT[dt], n1.weight.shape[0], attn.H, attn.Hkv, attn.hd, 0, attn.window or 0,
                                n1.eps, n2.eps, attn.q_norm.eps if head else 0.0, attn.hd ** -0.5,
                                n1.weight.data_ptr(), n2.weight.data_ptr(),
                                None if qn is None else qn.data_ptr(), None if kn is None else kn.data_ptr(), *lins)
        moe, slots = _moe_plan(mlp.experts, keep, dt)
        key = _key(layer)
        return cls(layer, plan, moe, keep, key, max_rows, slots)

    def valid(self) -> bool:
        return _key(self.layer) == self.key

    def forward(self, x: torch.Tensor, ab: AttnBatch, kv, is_decode: torch.Tensor) -> torch.Tensor | None:
        """x [B, 1, D] → the layer's output, or None (the module path runs: nothing was written)."""
        B = x.shape[0]
        mlp = self.mlp
        k_cache, v_cache = kv
        if (B > self.max_rows or ab.cos is None or k_cache.dtype != v_cache.dtype or k_cache.dtype not in DENSE_ROWS
                or not (k_cache.is_contiguous() and v_cache.is_contiguous()) or not x.is_contiguous()):
            return None
        step = ab.native_step()
        self.attn_plan.rd = step[2].shape[-1]  # RoPE dims per head (partial rotary: < hd)
        got = native.layer_attn(self.attn_plan, x.view(B, -1), step[2], step[3], step[1], step[0], k_cache, v_cache,
                                self.n_experts)
        if got is None:
            return None
        x1, h2, logits = got
        ids, weights = mlp.ctx.route(logits, is_decode, mlp.layer)
        mlp.ctx.stats.add(mlp.layer, ids)
        if self.moe_plan is not None and ids.numel() <= self.max_slots:
            out = native.layer_moe(self.moe_plan, h2, ids, weights, x1)
        else:  # another expert backend (offload), or past the native slots: the backend's own call
            out = x1 + mlp.experts(h2.to(x1.dtype), ids, weights)
        return out.view(x.shape)


def _moe_plan(experts, keep: list, dt) -> tuple[native.MoeLayer | None, int]:
    """(the MoE call's plan, max token-expert slots) for resident experts on a CPU; (None, 0) else."""
    if type(experts) is StackedExperts and native.dense_ok(experts.gate_up, experts.down):
        E, two_i, D = experts.gate_up.shape
        plan = native.MoeLayer(native._FMT[experts.gate_up.dtype], None, E, experts.gate_up.element_size(), None, None,
                               experts.gate_up.data_ptr(), experts.down.data_ptr(), 0, 0, D, two_i // 2, 0)
        return plan, (FP32_SLOTS if experts.gate_up.dtype == torch.float32 else 1 << 30)
    packed = getattr(experts, "packed", None)
    layout = getattr(packed, "layout", None)
    if layout is None or packed.data.device.type != "cpu" or not packed.data.is_contiguous():
        return None, 0
    parts = layout.parts()
    offs = np.array([parts[n][0] if n in parts else 0 for n in ("gu_q", "gu_s", "gu_z", "dn_q", "dn_s", "dn_z")],
                    dtype=np.int64)
    perm = experts.x_perm
    if perm is not None:
        perm = perm.to(torch.int32).contiguous()
        keep.append(perm)
    keep.append(offs)
    q8 = int((getattr(experts, "act", None) or native.INT4_ACT) == "q8")
    plan = native.MoeLayer(native.FMT_INT4, packed.data.data_ptr(), packed.data.shape[0], packed.data.shape[1],
                           offs.ctypes.data, None if perm is None else perm.data_ptr(), None, None, int(layout.sym),
                           layout.group_size, layout.hidden, layout.inter, q8)
    return plan, 1 << 30


def _key(layer) -> tuple:
    """The modules and storages the plan points into: a module or weight replaced (not written in
    place) rebuilds the plan. Plain attribute reads: this runs every layer of every decode step."""
    m = layer._modules
    attn, mlp = m["self_attn"], m["mlp"]
    am, mm = attn._modules, mlp._modules
    ex = mm["experts"]
    exp = ex._parameters["gate_up"] if type(ex) is StackedExperts else getattr(getattr(ex, "packed", None), "data", None)
    return (am["q_proj"], am["q_proj"].storage(), am["o_proj"], am["o_proj"].storage(), mm["gate"],
            mm["gate"]._parameters["weight"].data_ptr(), m["input_layernorm"]._parameters["weight"].data_ptr(),
            m["post_attention_layernorm"]._parameters["weight"].data_ptr(), ex,
            None if exp is None else exp.data_ptr())


__all__ = ["NativeLayer"]
