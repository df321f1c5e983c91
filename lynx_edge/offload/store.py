"""Host-memory expert store: every expert of every MoE layer as one contiguous byte block.

An expert is a uint8 block of `fmt.nbytes` (parts at 128-byte-aligned offsets) plus its math
`fmt.compute(block, x [n, D]) → [n, D]`, so one fetch is one copy, the device slots use the same
layout, and whoever runs an expert (device slot or CPU) never assumes the expert's form. Dense
formats (bf16/fp16/fp32) view the bytes in place; INT4 (lynx_edge.quant.int4 layout) and FP8 (an
FP8 checkpoint's codes and block scales, quant/fp8.py) dequantise; all are plain SwiGLU (`fmt.weights(block, dtype) → (gate_up [2I, D], down [D, I])`). A family
with its own experts (biases, another activation, MXFP4) gets biased.BiasedFormat (store_format).
Each layer's E blocks are one host buffer [E, nbytes], pinned where the OS allows; when pinning
fails or is limited the rest stays pageable and copies go through a small pinned staging ring,
with a warning.
"""
from __future__ import annotations

import warnings
import weakref

import torch

from ..kernels.moe_gemm import expert_mlp

ALIGN = 128
_DENSE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _typed(buf: torch.Tensor, off: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A typed view of bytes [off, off + prod(shape)·size) of buf [..., nbytes] → [..., *shape]."""
    n = dtype.itemsize
    for s in shape:
        n *= s
    return buf[..., off : off + n].view(dtype).view(*buf.shape[:-1], *shape)


class DenseFormat:
    """gate_up [2I, D] then down [D, I] in one dtype."""

    def __init__(self, name: str, hidden: int, inter: int):
        self.name, self.dtype, self.hidden, self.inter = name, _DENSE[name], hidden, inter
        self.gu_shape, self.dn_shape = (2 * inter, hidden), (hidden, inter)
        self.dn_off = _align(2 * inter * hidden * self.dtype.itemsize)
        self.nbytes = self.dn_off + _align(hidden * inter * self.dtype.itemsize)

    def pack_into(self, dst: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """dst uint8 [E, nbytes] ← gate_up [E, 2I, D], down [E, D, I] (any device/dtype)."""
        _typed(dst, 0, self.gu_shape, self.dtype).copy_(gate_up)
        _typed(dst, self.dn_off, self.dn_shape, self.dtype).copy_(down)

    def write_part(self, buf: torch.Tensor, e: int, part: str, w: torch.Tensor) -> None:
        """Expert e of a layer buffer uint8 [E, nbytes] ← one projection w [out, in] (gate | up |
        down), cast in the copy."""
        block, I = buf[e], self.inter
        if part == "down":
            _typed(block, self.dn_off, self.dn_shape, self.dtype).copy_(w)
        else:
            gu = _typed(block, 0, self.gu_shape, self.dtype)
            (gu[:I] if part == "gate" else gu[I:]).copy_(w)

    def write_quant_part(self, buf: torch.Tensor, e: int, part: str, ql, name: str = "expert") -> None:
        self.write_part(buf, e, part, ql.dequant(self.dtype))  # a 4-bit expert kept 16-bit: exact

    def weights(self, block: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """block uint8 [nbytes] → (gate_up [2I, D], down [D, I]); views when dtype matches."""
        gu = _typed(block, 0, self.gu_shape, self.dtype)
        dn = _typed(block, self.dn_off, self.dn_shape, self.dtype)
        return gu.to(dtype), dn.to(dtype)

    def compute(self, block: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [n, D] → [n, D]: the plain SwiGLU expert stored in block. On a CPU an fp32/bf16 block is
        read in place by the native kernel (no widened copy of the expert per call)."""
        from ..kernels import native

        if x.device.type == "cpu" and block.device.type == "cpu":
            gu = _typed(block, 0, self.gu_shape, self.dtype)
            dn = _typed(block, self.dn_off, self.dn_shape, self.dtype)
            if native.dense_ok(gu, dn):
                n = x.shape[0]
                return native.moe_dense(x, torch.zeros(n, 1, dtype=torch.int64), torch.ones(n, 1), gu[None], dn[None])
        return expert_mlp(x, *self.weights(block, x.dtype))


class Int4Format:
    """lynx_edge.quant.int4's expert block (RTN-quantised at pack time, dequantised on use)."""

    def __init__(self, hidden: int, inter: int, group: int = 128, sym: bool = True, int4_act: str | None = None):
        from ..quant.int4 import Int4Layout  # only INT4 users need the quant package

        self.name, self.hidden, self.inter = "int4", hidden, inter
        self.layout = Int4Layout(hidden, inter, group, sym)
        self.nbytes = self.layout.nbytes
        self._last = None  # (layer buffer, its Int4Experts view): see _view
        self.int4_act = int4_act  # CPU experts' activations (the engine's int4_act; None: the default)

    def _view(self, buf: torch.Tensor):
        """A layer buffer uint8 [E, nbytes] as Int4Experts; the last one is kept, since a load
        writes a layer's projections one after another (building the views costs as much as
        landing a small GPTQ projection)."""
        from ..quant.int4 import Int4Experts

        if self._last is None or self._last[0] is not buf:
            self._last = (buf, Int4Experts(buf, self.layout))
        return self._last[1]

    def write_part(self, buf: torch.Tensor, e: int, part: str, w: torch.Tensor) -> None:
        """Expert e of a layer buffer ← one 16/32-bit projection, RTN-quantised in place."""
        from ..quant.int4 import quantize_part

        quantize_part(self._view(buf), e, part, w)

    def write_quant_part(self, buf: torch.Tensor, e: int, part: str, ql, name: str = "expert") -> None:
        from ..quant.experts import write_quant

        write_quant(self._view(buf), e, part, ql, name)  # GPTQ/AWQ bytes as read (act-order refused)

    def finish_load(self) -> None:
        self._last = None  # drop the cached view (it holds a layer buffer)

    def pack_into(self, dst: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        from ..quant.int4 import quantize_experts

        q = quantize_experts(gate_up.float().cpu(), down.float().cpu(), self.layout.group_size, self.layout.sym)
        dst.copy_(q.data)

    def weights(self, block: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        from ..quant.int4 import Int4Experts

        return Int4Experts(block.view(1, -1), self.layout).dequant_expert(0, dtype)

    def compute(self, block: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        from ..quant import cpu_kernels  # the packed block read in place (Int4MoEExperts' CPU kernel)

        if x.device.type == "cpu" and cpu_kernels.available():
            return cpu_kernels.experts_rows(x, [0], [x.shape[0]], block.view(1, -1), self.layout, self.int4_act)
        return expert_mlp(x, *self.weights(block, x.dtype))


class Fp8Format:
    """An FP8 checkpoint's expert as published (quant/fp8.py): e4m3 codes gate_up [2I, D] and down
    [D, I] with their fp32 block scales [2I/bn, D/bk], [D/bn, I/bk] — half of bf16's bytes in host
    memory and over PCIe, and exact to the checkpoint. On a CPU the native kernel reads the block in
    place; on a device the slot is dequantised (exactly) before the plain SwiGLU."""

    def __init__(self, hidden: int, inter: int, block: tuple[int, int]):
        bn, bk = block
        self.name, self.hidden, self.inter, self.block = "fp8", hidden, inter, tuple(block)
        self.gu_s_shape, self.dn_s_shape = (2 * inter // bn, hidden // bk), (hidden // bn, inter // bk)
        self.gu_s_off = _align(2 * inter * hidden)
        self.dn_off = self.gu_s_off + _align(4 * self.gu_s_shape[0] * self.gu_s_shape[1])
        self.dn_s_off = self.dn_off + _align(hidden * inter)
        self.nbytes = self.dn_s_off + _align(4 * self.dn_s_shape[0] * self.dn_s_shape[1])

    def _parts(self, block: torch.Tensor):
        """block uint8 [..., nbytes] → (gu codes, gu scales, dn codes, dn scales) views."""
        D, I = self.hidden, self.inter
        return (_typed(block, 0, (2 * I, D), torch.uint8), _typed(block, self.gu_s_off, self.gu_s_shape, torch.float32),
                _typed(block, self.dn_off, (D, I), torch.uint8), _typed(block, self.dn_s_off, self.dn_s_shape, torch.float32))

    def write_fp8_part(self, buf: torch.Tensor, e: int, part: str, w: torch.Tensor, scale: torch.Tensor,
                       name: str = "expert") -> None:
        """Expert e ← one FP8 projection as the checkpoint stores it (codes and scales copied)."""
        from ..quant.fp8 import write_projection

        write_projection(self._parts(buf[e]), part, w, scale, self.block, name)

    def write_part(self, buf: torch.Tensor, e: int, part: str, w: torch.Tensor) -> None:
        """A 16/32-bit projection: quantised to FP8 blocks (approximate; FP8 checkpoints store FP8)."""
        from ..quant.fp8 import quantize

        self.write_fp8_part(buf, e, part, *quantize(w, self.block))

    def write_quant_part(self, buf: torch.Tensor, e: int, part: str, ql, name: str = "expert") -> None:
        self.write_part(buf, e, part, ql.dequant(torch.float32))

    def pack_into(self, dst: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        I = self.inter
        for e in range(dst.shape[0]):
            self.write_part(dst, e, "gate", gate_up[e, :I].float().cpu())
            self.write_part(dst, e, "up", gate_up[e, I:].float().cpu())
            self.write_part(dst, e, "down", down[e].float().cpu())

    def weights(self, block: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        from ..quant.fp8 import dequant

        gu, gs, dn, ds = self._parts(block)
        return dequant(gu, gs, self.block).to(dtype), dequant(dn, ds, self.block).to(dtype)

    def compute(self, block: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        from ..kernels import native

        if x.device.type == "cpu" and block.device.type == "cpu" and native.lib() is not None:
            gu, gs, dn, ds = self._parts(block)
            n = x.shape[0]
            return native.moe_fp8(x, torch.zeros(n, 1, dtype=torch.int64), torch.ones(n, 1), gu[None], gs[None],
                                  dn[None], ds[None], self.block)
        return expert_mlp(x, *self.weights(block, x.dtype))


def expert_format(name: str, dtype: torch.dtype, hidden: int, inter: int, group: int = 128, sym: bool = True,
                  block: tuple[int, int] | None = None, int4_act: str | None = None):
    """"auto" (the model's dtype), bf16, fp16, fp32, int4 or fp8 (an FP8 checkpoint's block) → a format object.
    int4_act: the CPU activations of int4 experts (build.int4_act's answer; None: the kernels' default)."""
    if name == "fp8":
        if block is None:
            raise ValueError("expert format fp8 is an FP8 checkpoint's own (its weight_block_size)")
        return Fp8Format(hidden, inter, block)
    if name == "auto":
        name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    if name == "int4":
        return Int4Format(hidden, inter, group, sym, int4_act)
    if name not in _DENSE:
        raise ValueError(f"expert format {name!r} is unknown (use auto, bf16, fp16, fp32, int4)")
    return DenseFormat(name, hidden, inter)


def store_format(cfg, name: str, dtype: torch.dtype, group: int = 128, sym: bool = True,
                 block: tuple[int, int] | None = None, int4_act: str | None = None):
    """The store format of cfg's experts: the family's own (experts with biases and their own
    activation, see biased.py) when it describes them, else expert_format(name, …). name "int4"
    asks a family with its own experts for its 4-bit format; a dense name for that dtype. int4_act:
    the CPU activations of 4-bit experts computed on the host (INT4 and MXFP4 rows)."""
    from .biased import family_format

    dense = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    fmt = family_format(cfg, dense.get(name, dtype), name == "int4", int4_act)
    if fmt is not None:
        return fmt
    return expert_format(name, dtype, cfg.hidden_size, cfg.moe_intermediate_size, group, sym, block, int4_act)


def _alloc_pinned(shape: tuple[int, ...]) -> torch.Tensor:
    """Page-locked host memory of exactly prod(shape) bytes (raises where the OS/driver refuses;
    tests monkeypatch this). `pin_memory=True` would go through PyTorch's caching host allocator,
    which rounds every block up to a power of two (pytorch issue 150517: Mixtral's 84 GiB of bf16
    experts would pin 128 GiB); instead the pageable buffer is registered with cudaHostRegister,
    and unregistered when the buffer is freed."""
    buf = torch.empty(shape, dtype=torch.uint8)
    if buf.numel() == 0:
        return buf
    cudart = torch.cuda.cudart()
    ptr, size = buf.data_ptr(), buf.numel()
    err = cudart.cudaHostRegister(ptr, size, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {size / 2**30:.2f} GiB failed ({err})")
    weakref.finalize(buf, cudart.cudaHostUnregister, ptr)
    return buf


class HostExpertStore:
    """All experts in host memory: layer → uint8 [E, nbytes]; block(layer, e) → uint8 [nbytes].

    want_pin: try page-locked buffers (layer by layer, up to pin_limit bytes). Whatever ends up
    pageable is copied through `staging` [staging_slots, nbytes] (pinned when possible).
    """

    def __init__(self, fmt, num_experts: int, want_pin: bool, pin_limit: int | None = None, staging_slots: int = 2):
        self.fmt, self.E = fmt, num_experts
        self.want_pin, self.pin_limit = want_pin, pin_limit
        self.staging_slots = staging_slots
        self.layers: dict[int, torch.Tensor] = {}
        self.pinned: dict[int, bool] = {}
        self.pinned_bytes = 0
        self.pin_failed = False
        self.staging: torch.Tensor | None = None
        self.staging_pinned = False
        self.notes: list[str] = []

    @property
    def nbytes(self) -> int:
        return self.fmt.nbytes

    def _alloc(self, layer: int) -> torch.Tensor:
        shape, size = (self.E, self.fmt.nbytes), self.E * self.fmt.nbytes
        limited = self.pin_limit is not None and self.pinned_bytes + size > self.pin_limit
        if self.want_pin and not self.pin_failed and not limited:
            try:
                buf = _alloc_pinned(shape)
                self.pinned[layer], self.pinned_bytes = True, self.pinned_bytes + size
                return buf
            except (RuntimeError, MemoryError) as exc:
                self.pin_failed = True
                self._warn(f"pinning host memory failed ({str(exc).splitlines()[0][:120]}); experts from "
                           f"layer {layer} on stay pageable and are copied through a pinned staging ring")
        elif self.want_pin and limited and not self.pin_failed and self.staging is None:
            self._warn(f"pinned memory limit of {self.pin_limit / 2**30:.2f} GiB reached at layer {layer}: "
                       "the rest stays pageable and is copied through a pinned staging ring")
        self.pinned[layer] = False
        if self.want_pin and self.staging is None:
            self._make_staging()
        return torch.empty(shape, dtype=torch.uint8)

    def _make_staging(self) -> None:
        shape = (self.staging_slots, self.fmt.nbytes)
        try:
            self.staging, self.staging_pinned = _alloc_pinned(shape), True
        except (RuntimeError, MemoryError):
            self.staging, self.staging_pinned = torch.empty(shape, dtype=torch.uint8), False
            self._warn("the staging ring could not be pinned either: copies run at pageable speed")

    def _warn(self, msg: str) -> None:
        self.notes.append(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)

    def put(self, layer: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Store a layer's stacked experts gate_up [E, 2I, D], down [E, D, I] (any device)."""
        buf = self.layers.get(layer)
        if buf is None:
            buf = self.layers[layer] = self._alloc(layer)
        for e0 in range(0, self.E, 8):  # a few experts at a time: bounded temporaries (INT4, casts)
            e1 = min(self.E, e0 + 8)
            self.fmt.pack_into(buf[e0:e1], gate_up[e0:e1], down[e0:e1])

    def put_blocks(self, layer: int, data: torch.Tensor) -> None:
        """Store ready-made blocks uint8 [E, nbytes] (e.g. Int4Experts.data)."""
        buf = self.layers.get(layer)
        if buf is None:
            buf = self.layers[layer] = self._alloc(layer)
        buf.copy_(data)

    def ensure_layer(self, layer: int) -> torch.Tensor:
        """The layer's buffer uint8 [E, nbytes], allocated (and pinned) on first use."""
        buf = self.layers.get(layer)
        if buf is None:
            buf = self.layers[layer] = self._alloc(layer)
        return buf

    def write_part(self, layer: int, e: int, part: str, w: torch.Tensor) -> None:
        """Stream one projection of expert (layer, e) straight into its block (load sink)."""
        self.fmt.write_part(self.ensure_layer(layer), e, part, w)

    def write_quant_part(self, layer: int, e: int, part: str, ql) -> None:
        self.fmt.write_quant_part(self.ensure_layer(layer), e, part, ql, f"layer {layer} expert {e} {part}")

    def write_fp8_part(self, layer: int, e: int, part: str, w: torch.Tensor, scale: torch.Tensor,
                       block: tuple[int, int]) -> None:
        """An FP8 checkpoint's projection: kept FP8 by an Fp8Format store, else dequantised (exact)
        and written as a 16-bit one would be (an int4 or 16-bit store)."""
        buf, name = self.ensure_layer(layer), f"layer {layer} expert {e} {part}"
        if isinstance(self.fmt, Fp8Format) and tuple(block) == self.fmt.block:
            self.fmt.write_fp8_part(buf, e, part, w, scale, name)
            return
        from ..quant.fp8 import check_scale, dequant

        check_scale(w, scale, block, name)
        self.fmt.write_part(buf, e, part, dequant(w, scale, block))

    def write_mx_part(self, layer: int, e: int, part: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        """An MXFP4 projection (formats that hold one: biased.BiasedFormat)."""
        self.fmt.write_mx_part(self.ensure_layer(layer), e, part, blocks, scales)

    def write_bias(self, layer: int, e: int, part: str, b: torch.Tensor) -> None:
        self.fmt.write_bias(self.ensure_layer(layer), e, part, b)

    def finish_load(self) -> None:
        """After the load: formats drop what they cached while writing."""
        finish = getattr(self.fmt, "finish_load", None)
        if finish is not None:
            finish()

    def block(self, layer: int, e: int) -> torch.Tensor:
        return self.layers[layer][e]

    def weights(self, layer: int, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fmt.weights(self.layers[layer][e], dtype)

    def compute(self, layer: int, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert (layer, e) on x [n, D] from its host block (the format's own math)."""
        return self.fmt.compute(self.layers[layer][e], x)

    def host_bytes(self) -> int:
        return sum(b.numel() for b in self.layers.values())


__all__ = ["DenseFormat", "Fp8Format", "HostExpertStore", "Int4Format", "expert_format", "store_format"]
