"""Building blocks shared by every family: RMSNorm, RoPE, grouped-query attention, MoE block.

Parameters are allocated uninitialised (`torch.empty`) with the final dtype and device so the
loader streams checkpoint tensors straight into them. Parameter names mirror the HF checkpoint
names (after the loader's per-family renaming), e.g. `layers.3.mlp.experts.gate_up`.
Glossary: B batch rows, T tokens per row, N = B·T, D hidden, H/Hkv heads, hd head dim,
S cache length, E experts, K top-k, I expert intermediate.
"""
from __future__ import annotations

import functools

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..cpuflags import cpu_bf16
from ..kernels import native
from ..kernels.moe_gemm import expert_mlp, fused_moe, moe_ref
from ..routing import ExactRouter, RouteFn, RouterSpec, RoutingStats


def _param(*shape: int, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


# CPU projections and experts by what measured fastest on this kind of machine
# (benchmarks/results/cpu_native.md, AVX-512 without native bf16 math, 1-2 threads):
# - fp32 weights: the native kernel up to 32 rows (MKL's small-M path is slower at 2-8 rows, level
#   at 1 and 16; and one kernel for every decode-sized batch keeps decode batch-invariant: a row's
#   logits alone equal its logits in any batch of ≤ 32), torch's GEMM beyond (a real blocked GEMM:
#   2-6x the native kernel from 64 rows up);
# - bf16 weights: torch widens bf16 slowly without native bf16 math, so the native kernel (which
#   widens by a shift and reads half fp32's bytes) up to 128 rows, and past that torch's fp32 GEMM
#   on the weight widened in row chunks (a bounded transient; 4-5x torch's bf16 GEMM at 512 rows).
# A CPU with native bf16 math (cpuflags.cpu_bf16: AVX512_BF16 / AMX) turns the last around: there
# torch's bf16 GEMM (oneDNN) ran 3.8-5.0x the widened fp32 one past 128 rows on a Zen4 EPYC (129 to
# 2048 rows, 1 and 2 threads), so bf16 prefill GEMMs stay bf16 (its rounding: as transformers' bf16).
NATIVE_ROWS = {torch.bfloat16: (1, 128), torch.float32: (1, 32)}
# fp32 bytes of a bf16 weight widened at a time past NATIVE_ROWS: a chunk stays below glibc's mmap
# threshold (32 MiB at most), so chunks reuse heap pages where whole 4096-row chunks (47 MB for gpt-oss-20b's
# q/k/v) were mapped and faulted in afresh at every call, and it sits in the L3 while the GEMM reads it:
# gpt-oss-20b's q/k/v and o projections, 512 tokens, 1.1-1.3x (benchmarks/results/widen_chunks_s32.json)
WIDEN_BYTES = 8 << 20


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, act: str | None = None
           ) -> torch.Tensor:
    """F.linear, or on a CPU the path that measured faster for this weight dtype and row count
    (same result dtype; fp32 products and sums either way). act "bf16": in the native kernel a bf16
    weight meets x rounded to bf16 (kernels/native.BF16_ACTS)."""
    if x.device.type != "cpu" or weight.dtype not in NATIVE_ROWS or x.dtype not in NATIVE_ROWS:
        return F.linear(x, weight, bias)
    lo, hi = NATIVE_ROWS[weight.dtype]
    rows = x.numel() // x.shape[-1]
    if lo <= rows <= hi and native.dense_ok(weight):
        return native.linear(x, weight, bias, act)
    if weight.dtype == torch.bfloat16 and rows > hi and not (x.dtype == torch.bfloat16 and cpu_bf16()):
        xf = x.float()
        step = max(1, WIDEN_BYTES // (4 * weight.shape[1]))  # rows a chunk
        out = torch.cat([F.linear(xf, weight[n:n + step].float(),
                                  None if bias is None else bias[n:n + step].float())
                         for n in range(0, weight.shape[0], step)], dim=-1)
        return out.to(x.dtype)
    return F.linear(x, weight, bias)


class Linear(nn.Module):
    # the native kernel's activations for a bf16 weight: "bf16", "bf16-stream" (rows from DRAM) or None (fp32);
    # set at build (build._bf16_activations)
    act: str | None = None

    def __init__(self, out_f: int, in_f: int, bias: bool, dtype, device):
        super().__init__()
        self.weight = _param(out_f, in_f, dtype=dtype, device=device)
        self.bias = _param(out_f, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.act)

    def native(self, x: torch.Tensor) -> torch.Tensor | None:
        """The native kernel's result at any row count (a decode step's fused q/k/v), or None
        when it does not take this weight."""
        return native.linear(x, self.weight, self.bias, self.act) if native.dense_ok(self.weight) else None

    def storage(self) -> int:
        return self.weight.data_ptr()

    def native_lin(self):
        """(native.Lin, tensors it points into, rows up to which the module path runs it natively)
        for the whole-layer decode call (native_layer.py), or None when the kernel does not take it."""
        if not native.dense_ok(self.weight) or self.weight.dtype not in NATIVE_ROWS:
            return None
        b32 = None if self.bias is None else self.bias.detach().float().contiguous()
        return native.dense_lin(self.weight, b32, self.act), [b32], NATIVE_ROWS[self.weight.dtype][1]

    @staticmethod
    def fuse(lins: list["Linear"]) -> "Linear | None":
        """One Linear over the rows of all of lins (one GEMM instead of several), with their weights
        and biases turned into views of it (no extra memory); None when dtypes or bias presence
        differ."""
        if len({(m.weight.dtype, m.weight.device, m.act) for m in lins}) != 1 or len({m.bias is None for m in lins}) != 1:
            return None
        out = Linear.__new__(Linear)
        nn.Module.__init__(out)
        out.act = lins[0].act
        out.weight = nn.Parameter(torch.cat([m.weight.data for m in lins]), requires_grad=False)
        has_b = lins[0].bias is not None
        out.bias = nn.Parameter(torch.cat([m.bias.data for m in lins]), requires_grad=False) if has_b else None
        at = 0
        for m in lins:
            n = m.weight.shape[0]
            m.weight.data = out.weight.data[at : at + n]
            if has_b:
                m.bias.data = out.bias.data[at : at + n]
            at += n
        return out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype, device):
        super().__init__()
        self.weight = _param(dim, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics, as transformers does, then back to the activation dtype. On a CPU one
        # native call with the same roundings instead of seven ops (a decode layer runs four norms).
        if (x.device.type == "cpu" and x.dtype is self.weight.dtype and x.dtype in NATIVE_ROWS
                and native.dense_ok(self.weight)):
            y = native.rmsnorm(x, self.weight, self.eps)
            if y is not None:
                return y
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Rope(nn.Module):
    """Rotary embeddings (rotate-half layout): default, linear or YaRN frequencies, over the first
    `rope.dim` dims of each head (all of head_dim unless partial_rotary_factor < 1)."""

    def __init__(self, cfg: ModelConfig, device, head_dim: int | None = None):
        super().__init__()
        r = cfg.rope
        dim = r.dim or head_dim or cfg.head_dim
        # [dim/2] base frequencies, computed as transformers does (int64 arange, then float), on
        # the CPU as transformers' init does (and no meta-device op when only counting parameters)
        pos_freqs = r.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        self.scale = 1.0  # cos/sin multiplier (YaRN's attention factor)
        if r.kind == "yarn":
            inv, self.scale = _yarn_inv_freq(pos_freqs, dim, r), r.attention_factor
        else:
            inv = (1.0 / pos_freqs) / r.factor
        self.register_buffer("inv_freq", inv.to(device), persistent=False)

    TABLE_CHUNK = 256  # positions per block of the CPU cos/sin table

    def cos_sin(self, positions: torch.Tensor, dtype, bound: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] → cos, sin [B, 1, T, dim] in dtype. bound (a host int > every
        position, e.g. AttnBatch.kv_len): on a CPU, rows of a table kept per dtype and grown in
        blocks of TABLE_CHUNK positions, each block computed by _cos_sin: two index ops per step
        instead of nine; the same values whichever batch or step asks."""
        if bound is None or positions.device.type != "cpu":
            return self._cos_sin(positions, dtype)
        tab = self.table(dtype, bound)
        return tab[0][positions][:, None], tab[1][positions][:, None]

    def table(self, dtype, bound: int) -> tuple:
        """(cos, sin [n, dim] in dtype, the same two widened to fp32 for the native kernels) for
        positions < n, n ≥ bound (a multiple of TABLE_CHUNK)."""
        tab = self.__dict__.setdefault("_table", {}).get(dtype)
        if tab is None or tab[0].shape[0] < bound:
            n = -(-bound // self.TABLE_CHUNK) * self.TABLE_CHUNK
            have = 0 if tab is None else tab[0].shape[0]
            new = [self._cos_sin(torch.arange(at, at + self.TABLE_CHUNK)[None], dtype) for at in
                   range(have, n, self.TABLE_CHUNK)]  # [1, 1, CHUNK, dim] each
            cs = [torch.cat(([] if tab is None else [tab[i]]) + [c[i][0, 0] for c in new]) for i in (0, 1)]
            tab = self._table[dtype] = (*cs, cs[0].float(), cs[1].float())
        return tab

    def _cos_sin(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [B, T] → cos, sin [B, 1, T, dim]
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        if self.scale != 1.0:
            return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _yarn_inv_freq(pos_freqs: torch.Tensor, dim: int, r) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): dims that rotate fewer than beta_slow times over the original
    context are interpolated (÷ factor), those above beta_fast extrapolated (kept), a linear ramp
    between — the formula of transformers' _compute_yarn_parameters."""
    def corr_dim(rot: float) -> float:  # the dim whose wavelength fits `rot` turns in the original context
        return dim * math.log(r.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(r.theta))

    low, high = corr_dim(r.beta_fast), corr_dim(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extra = 1 - ramp  # 1: extrapolate (high-frequency dims), 0: interpolate
    return (1.0 / (r.factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    d = cos.shape[-1]
    if d < x.shape[-1]:  # partial rotary: the first d dims rotate, the rest pass through
        return torch.cat((_rotate(x[..., :d], cos, sin), x[..., d:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def fp32_once(owner, attr: str, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """fp32 contiguous copies of ts (for the native kernels, or fp32 math on a CPU), made once and
    kept on owner.attr (made again when one of ts changes: another tensor, or written in place)."""
    key = tuple((t.data_ptr(), t._version) for t in ts)
    cached = getattr(owner, attr, None)
    if cached is None or cached[0] != key:
        cached = (key, tuple(t.detach().float().contiguous() for t in ts))
        setattr(owner, attr, cached)
    return cached[1]


@functools.lru_cache(maxsize=64)
def _arange(start: int, stop: int) -> torch.Tensor:
    """int64 [stop - start] on the CPU, made once per range (the native calls only read it)."""
    return torch.arange(start, stop)


@dataclass
class AttnBatch:
    """Where the tokens of one forward sit in the KV cache (fixed for all layers of the step)."""

    positions: torch.Tensor  # [B, T] absolute position of each token in its sequence
    rows: torch.Tensor | slice  # cache rows of the B sequences (a slice when contiguous: no gather)
    kv_len: int  # keys to attend over: max(position) + 1
    cos: torch.Tensor | None = None  # [B, 1, T, hd]
    sin: torch.Tensor | None = None
    masks: dict = field(default_factory=dict)  # window → bool mask [B, 1, T, kv_len]
    native: tuple | None = None  # the native decode attention's per-step inputs (rows, positions, cos, sin)
    # (Rope, dtype) of a CPU decode step whose cos/sin are not computed yet: native_step reads the
    # rope table's fp32 rows instead (what cos/sin would widen to), the module path computes them
    rope: tuple | None = None
    # every row's tokens at positions start..start+T-1 (a host int; None: rows differ). Lets the
    # KV write be a slice copy and decode / fresh prefill skip the mask (see Attention.attend).
    start: int | None = None
    # [B] each row's end (its last real token's position + 1) when rows are padded (step.prefill_rows):
    # a window layer's ring keeps only real tokens (a pad would overwrite a position still in the window)
    ends: torch.Tensor | None = None

    def native_step(self) -> tuple:
        """(rows int64 [B], positions int64 [B], cos, sin fp32 [B, rd]) of a decode step, for the
        native attention calls: made once per step, shared by every layer."""
        if self.native is None:
            pos = self.positions.reshape(-1)  # [B]: one token per row
            if pos.dtype is not torch.int64:
                pos = pos.to(torch.int64)
            if self.cos is None and self.rope is not None:
                tab = self.rope[0].table(self.rope[1], self.kv_len)
                cos, sin = tab[2].index_select(0, pos), tab[3].index_select(0, pos)  # fresh, contiguous
            else:
                B = pos.shape[0]
                cos, sin = self.cos.reshape(B, -1).float().contiguous(), self.sin.reshape(B, -1).float().contiguous()
            # contiguous: the native calls read raw pointers, and an equal-length prefill's positions
            # are an expanded (stride-0) view whose reshape stays one
            self.native = (self.native_rows(), pos.contiguous(), cos, sin)
        return self.native

    def native_rows(self) -> torch.Tensor:
        """The rows' cache indices, int64 [B] contiguous (a slice's made once per range)."""
        rows = _arange(self.rows.start, self.rows.stop) if isinstance(self.rows, slice) else self.rows
        return rows.contiguous() if rows.dtype is torch.int64 else rows.to(torch.int64).contiguous()

    def mask(self, window: int | None) -> torch.Tensor:
        if window not in self.masks:
            kv = torch.arange(self.kv_len, device=self.positions.device)
            q = self.positions[:, None, :, None]  # [B, 1, T, 1]
            m = kv <= q
            if window:
                m &= kv > q - window
            self.masks[window] = m
        return self.masks[window]


class Attention(nn.Module):
    """Grouped-query attention over a KV cache (k, v) of [Bmax, Hkv, S, hd] per layer.

    A family that differs subclasses one step: `project` (x → flat q, k, v: e.g. OLMoE's norm
    and clip over all heads) or `sdpa` (the attention itself: e.g. gpt-oss's sinks).
    """

    # the projections `int4_attn` may make INT4 (build._int4_linears): modules every subclass calls
    # as modules, never reading their weights
    INT4_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")

    def __init__(self, cfg: ModelConfig, layer: int, dtype, device, o_bias: bool = False):
        super().__init__()
        D, H, Hkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.H, self.Hkv, self.hd, self.layer = H, Hkv, hd, layer
        self.window = cfg.sliding_windows[layer]
        b = cfg.attention_bias
        self.q_proj = Linear(H * hd, D, b, dtype, device)
        self.k_proj = Linear(Hkv * hd, D, b, dtype, device)
        self.v_proj = Linear(Hkv * hd, D, b, dtype, device)
        self.o_proj = Linear(D, H * hd, o_bias, dtype, device)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm == "head":  # Qwen3: RMSNorm over each head's hd
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype, device)

    def _fused(self) -> nn.Module | None:
        """One projection [(H + 2·Hkv)·hd, D] for q, k and v (one GEMM instead of three), built at
        the first forward — after the loader has streamed q/k/v into their own modules — by their
        class's `fuse` (a plain Linear, or a packed INT4 one: quant/linear.py) with the three turned
        into views of it (no extra memory). None when they are not one class that fuses, or were
        replaced since."""
        f = getattr(self, "_qkv", None)
        if f is not None:
            return f[0] if f and self.q_proj.storage() == f[1] else None
        lins = [self.q_proj, self.k_proj, self.v_proj]
        kind = type(lins[0])
        fused = kind.fuse(lins) if all(type(m) is kind for m in lins) and hasattr(kind, "fuse") else None
        self._qkv = (fused, self.q_proj.storage()) if fused is not None else ()
        return fused

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, D] → q [B, T, H·hd], k, v [B, T, Hkv·hd]."""
        fused = self._fused()
        if fused is not None:
            return fused(x).split([self.H * self.hd, self.Hkv * self.hd, self.Hkv * self.hd], -1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x: torch.Tensor, ab: AttnBatch, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        B, T, _ = x.shape
        if T == 1 and x.device.type == "cpu" and self._native_decode is not False:
            out = self._decode_native(x, ab, kv)
            if out is not None:
                return out
        q, k, v = self.project(x)
        q = q.view(B, T, self.H, self.hd).transpose(1, 2)  # [B, H, T, hd]
        k = k.view(B, T, self.Hkv, self.hd).transpose(1, 2)  # [B, Hkv, T, hd]
        v = v.view(B, T, self.Hkv, self.hd).transpose(1, 2)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _rotate(q, ab.cos, ab.sin), _rotate(k, ab.cos, ab.sin)
        k_cache, v_cache = kv  # [Bmax, Hkv, S, hd]
        ring = getattr(kv, "period", 0)
        if ring:  # a window layer's ring (kv_cache.py): its own write and read
            keys, vals, attn = _ring_kv(k_cache, v_cache, k, v, ab, ring, self.window)
            out = self.sdpa(q, keys, vals, ab, T, attn)
        else:
            _write_kv(k_cache, v_cache, k, v, ab)
            keys = k_cache[ab.rows, :, : ab.kv_len]  # [B, Hkv, kv_len, hd]
            vals = v_cache[ab.rows, :, : ab.kv_len]
            out = self.sdpa(q, keys, vals, ab, T)  # [B, H, T, hd]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.H * self.hd))

    _native_decode: bool | None = None  # None: not decided yet; False: this layer always runs torch
    _native_form: tuple | bool | None = None  # native_form's answer, once decided

    def native_form(self) -> tuple[bool, tuple | None] | None:
        """How this layer's decode attention maps onto the native kernel, decided once (for this
        layer's own decode and for the native layer call, models/native_layer.py): None where it
        does not — a subclass's own attend, an sdpa that does more than add sinks, a project that
        native_qk_full does not describe, q/k norms other than RMSNorm per head, no native library;
        else (sinks, qk_full): whether its sdpa adds learned sinks (native_sinks) and OLMoE's q/k
        norm over all heads and clip (native_qk_full; None for the base's project)."""
        if self._native_form is None:  # the class's answer, kept; the weights it names are read each call
            cls = type(self)
            norms_ok = self.qk_norm == "none" or (self.qk_norm == "head" and type(self.q_norm) is RMSNorm
                                                  and type(self.k_norm) is RMSNorm)
            sinks = cls.native_sinks is not Attention.native_sinks
            full = self.native_qk_full() is not None
            ok = ((cls.project is Attention.project or full) and (cls.sdpa is Attention.sdpa or sinks)
                  and cls.attend is Attention.attend and norms_ok and native.lib() is not None)
            self._native_form = (sinks, full) if ok else False
        if not self._native_form:
            return None
        sinks, full = self._native_form
        if not full:
            return sinks, None
        qk = self.native_qk_full()  # the norms' current weights (replaced ones too), or None if it no longer fits
        return None if qk is None else (sinks, qk)

    def _decode_native(self, x: torch.Tensor, ab: AttnBatch, kv) -> torch.Tensor | None:
        """A CPU decode step in two native calls after the fused projection (kernels/cpu_native.c:
        norm, RoPE, cache write and attention for every row and head at once) instead of ~40 torch
        ops, where native_form says the kernel computes this class's attention; other classes and
        shapes the kernel does not take run the torch path."""
        form = self.native_form()
        if self._native_decode is None:
            self._native_decode = form is not None
        if form is None:
            return None
        fused = self._fused()
        k_cache, v_cache = kv
        if (fused is None or ab.cos is None or k_cache.dtype != v_cache.dtype or k_cache.dtype not in NATIVE_ROWS
                or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
            return None
        B = x.shape[0]
        qkv = fused.native(x.view(B, -1))
        full = form[1]
        if qkv is not None and full is not None:
            qkv = native.qk_full(qkv, self.H, self.Hkv, self.hd, *full)
        if qkv is None:
            return None
        step = ab.native_step()  # per step, shared by every layer: rows, positions, cos, sin
        head = self.qk_norm == "head"
        out = native.attn_decode(qkv, self.H, self.Hkv, self.hd, self.q_norm.weight if head else None,
                                 self.k_norm.weight if head else None, self.q_norm.eps if head else 0.0,
                                 step[2], step[3], step[1], step[0], k_cache, v_cache, self.window,
                                 self.native_sinks(), getattr(kv, "period", 0))
        if out is None:
            return None
        return self.o_proj(out.to(x.dtype).view(B, 1, self.H * self.hd))

    def native_qk_full(self) -> tuple | None:
        """A subclass whose `project` only adds RMSNorm over all of q's and k's heads at once and
        an optional clip of q, k and v (OLMoE) gives the native decode (q_weight [H·hd], k_weight
        [Hkv·hd], eps, clip or None) here (kernels/native.qk_full); None: this class's own project."""
        return None

    def native_sinks(self) -> torch.Tensor | None:
        """A subclass whose sdpa adds one learned logit per head to each softmax (gpt-oss) gives the
        native decode those logits here, [H] fp32; None: plain softmax."""
        return None

    def sdpa(self, q, keys, vals, ab: AttnBatch, T: int, attn: tuple | None = None) -> torch.Tensor:
        """q [B, H, T, hd] over keys/vals [B, Hkv, S, hd] → [B, H, T, hd]; attn: (mask, is_causal)
        when the caller made them (a ring's), else attend's."""
        mask, causal = attn if attn is not None else self.attend(ab, T)
        return F.scaled_dot_product_attention(
            q, keys, vals, attn_mask=mask, is_causal=causal, enable_gqa=self.H != self.Hkv
        )

    def attend(self, ab: AttnBatch, T: int) -> tuple[torch.Tensor | None, bool]:
        """(attn_mask, is_causal) for SDPA. No mask is built when every row sits at the same
        positions and no sliding window cuts in: a decode step then sees all kv_len keys, a
        prefill from position 0 is plain causal; otherwise the materialised bool mask."""
        if ab.start is not None and (not self.window or ab.kv_len <= self.window):
            if T == 1 and ab.kv_len == ab.start + 1:
                return None, False
            if ab.start == 0 and ab.kv_len == T:
                return None, T > 1
        return ab.mask(self.window), False


def _write_kv(k_cache, v_cache, k, v, ab: AttnBatch) -> None:
    B, _, T, _ = k.shape
    if ab.start is not None:  # same positions in every row: a slice copy, no index tensors
        k_cache[ab.rows, :, ab.start : ab.start + T] = k  # [B, Hkv, T, hd]
        v_cache[ab.rows, :, ab.start : ab.start + T] = v
        return
    ri = _row_index(ab, k.device)[:, None].expand(B, T)  # [B, T]
    k_cache[ri, :, ab.positions] = k.transpose(1, 2)  # [B, T, Hkv, hd]
    v_cache[ri, :, ab.positions] = v.transpose(1, 2)


def _row_index(ab: AttnBatch, device) -> torch.Tensor:
    """The rows' cache indices as a tensor on `device` (a slice's made here)."""
    return torch.arange(ab.rows.start, ab.rows.stop, device=device) if isinstance(ab.rows, slice) else ab.rows


def _ring_kv(k_cache, v_cache, k, v, ab: AttnBatch, R: int, W: int) -> tuple:
    """A window-W layer's ring of R positions (kv_cache.py: position p at slots p mod R and
    p mod R + R of [Bmax, Hkv, 2R, hd]): write this forward's k, v [B, Hkv, T, hd] and give what
    its queries attend over → (keys, vals [B, Hkv, L, hd], (mask [B, 1, T, L] bool or None, causal)).
    T == 1 (decode; a mixed step's prompt tokens, one per row): written first, then each row's
    window read as the ring's contiguous slots in position order, as a full cache's rows are read.
    T > 1 (a prefill chunk, at most W before it in the ring): the W - 1 positions before each row's
    first token read from the ring and joined with the chunk's own k, v; then the chunk's last R
    real tokens written (a pad, past its row's end, never: ab.ends)."""
    B, _, T, _ = k.shape
    dev = k.device
    rows = _row_index(ab, dev)
    if T == 1:
        pos = ab.positions.reshape(B)
        for off in (0, R):  # both copies of each position
            slot = pos % R + off
            k_cache[rows, :, slot] = k[:, :, 0]  # [B, Hkv, hd]
            v_cache[rows, :, slot] = v[:, :, 0]
        if ab.start is not None:  # every row at one position: one slice of the ring
            lo = max(0, ab.start - W + 1)
            a, L = lo % R, ab.start - lo + 1
            return k_cache[ab.rows, :, a : a + L], v_cache[ab.rows, :, a : a + L], (None, False)
        L = min(W, ab.kv_len)  # the longest row's window
        lo = (pos - W + 1).clamp(min=0)
        j = torch.arange(L, device=dev)
        idx = (lo % R)[:, None] + j  # [B, L] < 2R
        mask = (j < (pos - lo + 1)[:, None])[:, None, None]  # [B, 1, 1, L]
        return (k_cache[rows[:, None], :, idx].transpose(1, 2), v_cache[rows[:, None], :, idx].transpose(1, 2),
                (mask, False))
    pos = ab.positions  # [B, T]
    if ab.start == 0:  # a fresh prompt: nothing before it
        keys, vals = k, v
        attn = (None, True) if T <= W else (ab.mask(W), False)
    else:
        first = pos.min(dim=1).values  # [B] each row's first real token (pads sit past its end)
        j = torch.arange(W - 1, device=dev)
        before = first[:, None] - (W - 1) + j  # [B, W-1] positions, < 0 where the row has fewer
        idx = ((first - (W - 1)) % R)[:, None] + j
        keys = torch.cat([k_cache[rows[:, None], :, idx].transpose(1, 2), k], dim=2)  # [B, Hkv, W-1+T, hd]
        vals = torch.cat([v_cache[rows[:, None], :, idx].transpose(1, 2), v], dim=2)
        kpos = torch.cat([before, pos], dim=1)[:, None, :]  # [B, 1, W-1+T]
        qpos = pos[:, :, None]  # [B, T, 1]
        attn = (((kpos >= 0) & (kpos <= qpos) & (kpos > qpos - W))[:, None], False)  # [B, 1, T, W-1+T]
    ends = ab.ends if ab.ends is not None else pos.max(dim=1).values + 1
    keep = (pos < ends[:, None]) & (pos >= ends[:, None] - R)  # [B, T]: the real tokens the ring keeps
    b, t = keep.nonzero(as_tuple=True)
    for off in (0, R):
        slot = pos[b, t] % R + off
        k_cache[rows[b], :, slot] = k[b, :, t]  # [N, Hkv, hd]
        v_cache[rows[b], :, slot] = v[b, :, t]
    return keys, vals, attn


class DenseMLP(nn.Module):
    INT4_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # see Attention's

    def __init__(self, D: int, inter: int, dtype, device):
        super().__init__()
        self.gate_proj = Linear(inter, D, False, dtype, device)
        self.up_proj = Linear(inter, D, False, dtype, device)
        self.down_proj = Linear(D, inter, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def cpu_moe(x, ids, weights, gate_up, down, stream: bool = True, packed: tuple[bool, bool] = (False, False),
            act: str | None = None):
    """Resident experts on a CPU: the native kernel (one call, each active expert's rows read once,
    fp32 sums) at decode-sized batches, and for bf16 experts at any batch where the CPU has no
    native bf16 math or the experts are small; past NATIVE_SLOTS slots moe_ref's grouped GEMM (fp32,
    or bf16 on a CPU with native bf16 for experts of GROUPED_BF16_MIN weights per projection and
    more: it rounds gate, up and h to bf16 as transformers' bf16 experts do). stream: the experts
    come from DRAM at each use (native.streamed). packed: gate_up / down in native.pack_rows's layout,
    which only the native kernel reads (at every batch). act: the native kernel's activations for bf16
    experts ("bf16" or None: fp32; kernels/native.BF16_ACTS)."""
    if packed[0] or packed[1]:
        return native.moe_dense(x, ids, weights, gate_up, down, stream, packed, act)
    big = ids.numel() > NATIVE_SLOTS and (gate_up.dtype != torch.bfloat16 or (
        x.dtype == torch.bfloat16 and down[0].numel() >= GROUPED_BF16_MIN and cpu_bf16()))
    if not big and native.dense_ok(gate_up, down):
        return native.moe_dense(x, ids, weights, gate_up, down, stream, act=act)
    return moe_ref(x, ids, weights, gate_up, down)


NATIVE_SLOTS = 512  # fp32 token-expert slots per call up to which cpu_moe takes the native kernel
# bf16 experts' D x I from which torch's bf16 grouped GEMM beats the native kernel past NATIVE_SLOTS on
# a CPU with native bf16 (Zen4 EPYC, 2 threads: D=1024, I=768 1.9x at 32768 slots, 2.2x at 2048;
# the demo's D=256, I=128 0.56-0.93x, too small to amortise its gathers and per-group set-up)
GROUPED_BF16_MIN = 1 << 18


class StackedExperts(nn.Module):
    """All E experts of a layer resident as two stacked tensors in the model dtype.

    An expert backend is any module with `__call__(x [N, D], ids [N, K], weights [N, K]) -> [N, D]`
    that is also a load sink: `load_part(e, part, w)` takes one projection (part gate | up | down,
    w [out, in] as the checkpoint stores it, a view of the file's mmap) and puts it in its final
    home; `load_quant_part(e, part, QuantLinear)` takes a 4-bit one. The builder picks the backend
    (resident 16-bit, INT4, offloaded) once per layer; the loader streams into it.
    On CUDA (with Triton) the grouped GEMM kernel runs, elsewhere its torch reference.
    `streamed`: on a CPU, whether the experts come from DRAM at each step (the builder sets it from
    all layers' bytes against the last-level cache: native.streamed); the native kernel picks its
    read order by it, and where the builder allows (`pack`) the layout: streamed bf16 matrices of short
    rows are kept in packed rows (native.pack_choice), which only the native kernel reads — `weights()`
    gives them row-major. Setting `streamed` (or `relayout`) re-lays them out in place.
    """

    act: str | None = None  # the native kernel's activations for bf16 experts: "bf16" or None (fp32); set at build

    def __init__(self, E: int, D: int, inter: int, dtype, device, streamed: bool = True, pack: bool = False):
        super().__init__()
        self.num_experts, self.hidden, self.inter = E, D, inter
        self.gate_up = _param(E, 2 * inter, D, dtype=dtype, device=device)  # [E, 2I, D]
        self.down = _param(E, D, inter, dtype=dtype, device=device)  # [E, D, I]
        self._fn = fused_moe if torch.device(device).type == "cuda" else cpu_moe  # fused_moe: Triton or its ref
        self._pack = pack and self._fn is cpu_moe
        self._streamed = streamed
        self.packed_rows = self._layout(streamed)  # (gate_up, down) in packed rows; the tensors are empty yet

    def _layout(self, streamed: bool) -> tuple[bool, bool]:
        if not (self._pack and streamed):
            return False, False
        return native.pack_choice(self.gate_up, self.down)

    @property
    def streamed(self) -> bool:
        return self._streamed

    @streamed.setter
    def streamed(self, on: bool) -> None:
        self.relayout(on)

    def relayout(self, streamed: bool, pack: bool | None = None) -> None:
        """The weights re-laid out in place for `streamed` (and whether this module may pack, where
        given: the builder's `pack`)."""
        gu, dn = self.weights()
        self._streamed = streamed
        if pack is not None:
            self._pack = pack and self._fn is cpu_moe
        self.replace(gu, dn)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2I, D], down [E, D, I]) row-major: the parameters, or copies where packed."""
        gu, dn = self.gate_up.data, self.down.data
        return (native.unpack_rows(gu) if self.packed_rows[0] else gu), (native.unpack_rows(dn) if self.packed_rows[1] else dn)

    def replace(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """New row-major weights (any E, I), put in this module's layout."""
        self.num_experts, self.inter = gate_up.shape[0], gate_up.shape[1] // 2
        self.gate_up = nn.Parameter(gate_up, requires_grad=False)
        self.down = nn.Parameter(down, requires_grad=False)
        self.packed_rows = self._layout(self._streamed)
        if self.packed_rows[0]:
            self.gate_up.data = native.pack_rows(gate_up)
        if self.packed_rows[1]:
            self.down.data = native.pack_rows(down)

    def load_part(self, e: int, part: str, w: torch.Tensor) -> None:
        I = self.inter
        dst = self.down.data[e] if part == "down" else self.gate_up.data[e, : I] if part == "gate" \
            else self.gate_up.data[e, I:]
        if self.packed_rows[part == "down"]:  # the packed layout (I % 4 == 0: gate, up whole groups)
            native.pack_into(dst, w)
        else:
            dst.copy_(w)

    def load_quant_part(self, e: int, part: str, ql) -> None:
        # a 4-bit expert in a layer kept 16-bit (a mixed layer): exact dequantisation
        self.load_part(e, part, ql.dequant(self.gate_up.dtype))

    def forward(self, x, ids, weights):
        if self._fn is cpu_moe:
            return cpu_moe(x, ids, weights, self.gate_up, self.down, self._streamed, self.packed_rows, self.act)
        return self._fn(x, ids, weights, self.gate_up, self.down)


class RoutingContext:
    """Shared by every MoE block of a model: the routing function and the stats sink."""

    def __init__(self, spec: RouterSpec):
        self.spec = spec
        self.route: RouteFn = ExactRouter(spec)
        self.stats = RoutingStats()
        self.is_decode: bool | None = None  # the phase of the forward in progress (a Python bool)

    def begin_step(self, is_decode: bool) -> None:
        """Called once per model forward, before the first layer (step boundaries for telemetry,
        the phase for anything that counts per phase, e.g. the offload runtime)."""
        self.is_decode = is_decode
        self.stats.begin_step(is_decode)
        begin = getattr(self.route, "begin_step", None)
        if begin is not None:
            begin(is_decode)  # the router takes its branches on this host bool: no device sync


Scorer = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


class MoEBlock(nn.Module):
    """Router → routing hook → expert backend (+ an always-on shared expert).

    What a family may change, all fixed at build time: `router_bias` (gpt-oss), `scorer`
    (router logits [N, E] → (scores the family selects its top-k on, probabilities its gate
    weights come from, or None for softmax(scores)); e.g. DeepSeek's group-limited choice),
    the expert backend (the builder's `experts`), and whether the shared expert is sigmoid-gated
    (Qwen2-MoE) or plain (DeepSeek).
    """

    def __init__(self, cfg: ModelConfig, layer: int, ctx: RoutingContext, dtype, device, experts=None, *,
                 router_bias: bool = False, scorer: Scorer | None = None, shared_gate: bool = True):
        super().__init__()
        D, E = cfg.hidden_size, cfg.num_experts
        self.layer, self.ctx, self.scorer = layer, ctx, scorer
        self.gate = Linear(E, D, router_bias, dtype, device)  # the router
        # the expert backend, chosen by the builder (default: resident 16-bit)
        self.experts = experts if experts is not None else StackedExperts(E, D, cfg.moe_intermediate_size, dtype, device)
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = DenseMLP(D, cfg.shared_expert_intermediate_size, dtype, device)
            if shared_gate:
                self.shared_expert_gate = Linear(1, D, False, dtype, device)

    def forward(self, x: torch.Tensor, is_decode: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N, D]
        logits = self.gate(x).float()  # [N, E]
        if self.scorer is None:
            ids, weights = self.ctx.route(logits, is_decode, self.layer)
        else:
            scores, probs = self.scorer(logits)
            ids, weights = self.ctx.route(scores, is_decode, self.layer, probs=probs)
        self.ctx.stats.add(self.layer, ids)
        return self.with_shared(self.experts(x, ids, weights), x).view(shape)

    def with_shared(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y (the routed experts' output [N, D]) plus the shared expert over x [N, D], if there is one:
        on a CPU one native call, fp32 inside, added to y's rounded values (what lynx_layer_moe does);
        elsewhere, or past its native rows, torch ops."""
        if self.shared_expert is None:
            return y
        plan = self.native_shared() if x.device.type == "cpu" else None
        if plan is not None and x.shape[0] <= plan[2]:
            return (y.float() + native.shared_expert(plan[0], x)).to(y.dtype)
        s = self.shared_expert(x)
        return y + (s if self.shared_expert_gate is None else torch.sigmoid(self.shared_expert_gate(x)) * s)

    _shared: tuple | None = None  # (key, native_shared's answer)

    def native_shared(self) -> tuple | None:
        """(native.SharedExpert, tensors it points into, rows up to which it runs natively) for the
        shared expert on a CPU — read by this block's decode and by the layer call (native_layer.py)
        alike, so both compute it the same way — or None where a projection has no native form (or
        no native library). Kept while its projections' weights stay where they are."""
        mods = [self.shared_expert.gate_proj, self.shared_expert.up_proj, self.shared_expert.down_proj]
        mods += [self.shared_expert_gate] if self.shared_expert_gate is not None else []
        key = tuple((m, m.storage(), getattr(m, "loaded", True)) for m in mods)
        if self._shared is None or self._shared[0] != key:
            got = [getattr(m, "native_lin", lambda: None)() for m in mods] if native.lib() is not None else [None]
            plan = None
            if all(g is not None for g in got):
                lins = [g[0] for g in got] + ([] if len(got) == 4 else [native.Lin()])  # sg.N = 0: no scale
                plan = (native.SharedExpert(*lins), [t for g in got for t in g[1] if t is not None],
                        min(g[2] for g in got))
            self._shared = (key, plan)
        return self._shared[1]


def rtn_group(n_in: int, group: int) -> int:
    """The group for an `int4_attn` projection of n_in inputs: `group`, or where it does not divide
    n_in the largest of its halvings down to 32 (llama.cpp Q4_0's block) that does — gpt-oss's hidden
    2880 takes 64 — else 0 (the projection stays 16-bit)."""
    g = group
    while g >= 32 and n_in % g:
        g //= 2
    return g if g >= 32 and n_in % g == 0 else 0


def int4_projections(model: nn.Module, group: int):
    """→ (owner, leaf name, its Linear, its RTN group) for each projection `int4_attn` makes INT4: the
    plain `Linear`s the owners' classes list in INT4_PROJECTIONS whose inputs a group divides
    (rtn_group). build._int4_linears replaces them; the memory plan (offload/memory.py) counts them
    on the meta device."""
    for owner in list(model.modules()):
        for leaf in getattr(type(owner), "INT4_PROJECTIONS", ()):
            old = getattr(owner, leaf, None)
            g = type(old) is Linear and rtn_group(old.weight.shape[1], group)
            if g:
                yield owner, leaf, old, g


__all__ = [
    "AttnBatch", "Attention", "DenseMLP", "Linear", "MoEBlock", "RMSNorm", "Rope",
    "RoutingContext", "StackedExperts", "expert_mlp", "int4_projections", "rtn_group",
]
