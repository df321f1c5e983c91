"""Block-scaled FP8 checkpoints (quant_method "fp8": Qwen3-*-FP8, DeepSeek-V3) and FP8 experts.

A linear W [out, in] is stored as `<name>.weight` float8_e4m3fn [out, in] and
`<name>.weight_scale_inv` fp32 [⌈out/bn⌉, ⌈in/bk⌉], weight_block_size = [bn, bk] (128 × 128 as
published): W[o, i] = e4m3(weight[o, i]) · scale_inv[o // bn, i // bk]. ("_inv" is the writer's
name for what dequantisation multiplies by, as transformers' FP8 integration and DeepSeek's
weight_dequant read it.) Non-linear tensors (norms, the router, embeddings, lm_head) stay 16-bit.

`dequant` is the exact reference (e4m3 → fp32 is exact; one fp32 rounding for the product) that
every non-expert FP8 linear goes through at load, into the model dtype. Experts: on a CPU with
the native kernels, `Fp8MoEExperts` keeps them 8-bit — one byte per weight, half of bf16 — and
the native MoE kernel reads the codes in place (kernels/cpu_native.c f8_rows); elsewhere (a GPU,
the offload store, `--int4`) they are dequantised per projection as they stream in, like any
16-bit expert. Glossary: E experts, D hidden, I expert intermediate, (bn, bk) the scale block.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import native
from .linear import fuse_rows

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite e4m3fn value
SCALE_SUFFIX = "_scale_inv"  # <name>.weight → <name>.weight_scale_inv
# per-tensor activation scales of "static" activation schemes: weight-only compute does not use them
IGNORED_SUFFIXES = (".input_scale", ".activation_scale")


def _expand(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    bn, bk = block
    n, k = shape
    return scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def check_scale(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], name: str) -> None:
    """ValueError (one line) when scale's shape is not [⌈out/bn⌉, ⌈in/bk⌉] for w [out, in]."""
    bn, bk = block
    want = (-(-w.shape[0] // bn), -(-w.shape[1] // bk)) if w.dim() == 2 else None
    if want is None or tuple(scale.shape) != want:
        raise ValueError(f"{name}: weight {tuple(w.shape)} with scale {tuple(scale.shape)} does not match "
                         f"weight_block_size {list(block)} (expected scale {want})")


def dequant(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """w [out, in] float8_e4m3fn (or its uint8 bytes), scale [⌈out/bn⌉, ⌈in/bk⌉] → fp32 [out, in],
    exact: the native kernel on a CPU (whole bk blocks), else e4m3 → fp16 by bits (see
    cpu_native.c f8_h: the same value ×2⁻⁸, converted exactly), 4× faster than torch's own
    float8 → fp32 conversion, which `dequant_ref` keeps as the reference."""
    if w.device.type == "cpu" and w.dim() == 2 and w.shape[1] % block[1] == 0 and native.lib() is not None:
        return native.dequant_fp8(w, scale, block)
    half = (w.view(torch.int8).to(torch.int16) * 128).bitwise_and_(0xBFFF - 0x10000).view(torch.float16)
    (n, k), (bn, bk) = w.shape, block
    s = scale.float() * 256.0
    if n % bn == 0 and k % bk == 0:  # whole blocks: one broadcast multiply, no expanded scale tensor
        return (half.view(n // bn, bn, k // bk, bk).float() * s[:, None, :, None]).view(n, k)
    return half.float() * _expand(s, (n, k), block)


def dequant_ref(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """dequant through torch's float8_e4m3fn → fp32 conversion (the independent reference)."""
    w = w.view(FP8) if w.dtype == torch.uint8 else w
    return w.float() * _expand(scale.float(), tuple(w.shape), block)


def quantize(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] → (codes float8_e4m3fn [out, in], scale fp32 [⌈out/bn⌉, ⌈in/bk⌉]) with each block's
    absolute max at 448, as the published checkpoints were written (tests and benchmarks write
    FP8 checkpoints with it)."""
    bn, bk = block
    n, k = w.shape
    wf = w.float()
    pad = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
    pad[:n, :k] = wf
    amax = pad.view(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    codes = (wf / _expand(scale, (n, k), block)).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return codes, scale


def _quantized_here(name: str, t: torch.Tensor) -> bool:
    """Which tensors a published FP8 checkpoint stores FP8: every 2-D projection weight inside the
    decoder layers (attention, experts, shared experts, dense MLPs) but not the router."""
    return (t.dim() == 2 and name.endswith("_proj.weight") or re.search(r"\.experts\.\d+\.w[123]\.weight$", name)
            is not None) and ".layers." in name


def write_checkpoint(src: str | Path, dst: str | Path, block: tuple[int, int] = (128, 128)) -> Path:
    """A 16/32-bit safetensors checkpoint → the same model as a block-scaled FP8 checkpoint in the
    published layout (Qwen/Qwen3-30B-A3B-FP8: projection weights e4m3 + weight_scale_inv fp32,
    everything else as it was, config.json's quantization_config). For tests and benchmarks: the
    hub's FP8 checkpoints are what users load."""
    import json
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy2(f, dst / f.name)
    out: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for name in fh.keys():
                t = fh.get_tensor(name)
                if _quantized_here(name, t):
                    out[name], out[name + SCALE_SUFFIX] = quantize(t, block)
                else:
                    out[name] = t.to(torch.bfloat16) if t.is_floating_point() else t
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": list(block)}
    cfg["torch_dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def write_projection(views: tuple, part: str, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                     name: str) -> None:
    """One FP8 projection as the checkpoint stores it (w [out, in] e4m3 or its bytes, scale
    [out/bn, in/bk]) into one expert's views (gate_up codes [2I, D], their scales [2I/bn, D/bk],
    down codes [D, I], their scales [D/bn, I/bk]): gate rows first, then up. ValueError (one line)
    for a wrong dtype or shape. The resident experts and the offload store's block share it."""
    gu, gs, dn, ds = views
    if w.dtype not in (FP8, torch.uint8):
        raise ValueError(f"{name}: stored {str(w.dtype).replace('torch.', '')}, expected float8_e4m3fn beside "
                         "its weight_scale_inv")
    check_scale(w, scale, block, name)
    if part == "down":
        dst, sdst = dn, ds
    else:
        I, bn = gu.shape[0] // 2, block[0]
        rows = slice(0, I) if part == "gate" else slice(I, 2 * I)
        dst, sdst = gu[rows], gs[rows.start // bn: rows.stop // bn]
    if tuple(w.shape) != tuple(dst.shape):
        raise ValueError(f"{name}: shape {tuple(w.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(w.view(dst.dtype))
    sdst.copy_(scale)


def linear_fits(in_f: int, block: tuple[int, int]) -> bool:
    """Whether the native FP8 linear reads a weight with in_f inputs: whole bk blocks, bk % 32 == 0."""
    return block[0] > 0 and block[1] > 0 and block[1] % 32 == 0 and in_f % block[1] == 0


def experts_fit(D: int, I: int, block: tuple[int, int]) -> bool:
    """Whether the native kernel reads experts of this shape in place: every projection's inputs as
    linear_fits takes them (D for gate/up, I for down), and whole scale blocks over its rows."""
    return linear_fits(D, block) and linear_fits(I, block) and I % block[0] == 0 and D % block[0] == 0


# rows up to which the native kernel runs a linear; past them (prefill) WIDEN_ROWS output rows at
# a time are dequantised to fp32 and torch's GEMM runs (compute-bound there)
NATIVE_MAX_ROWS = 32
WIDEN_ROWS = 1024


class Fp8Linear(nn.Module):
    """y = x Wᵀ (+ b) for an FP8 checkpoint's attention / dense linear W [out, in], kept 8-bit on a
    CPU with the native kernels (half of bf16's bytes and memory; chosen at build,
    build._keep_linears_packed). `weight` float8_e4m3fn [out, in], `weight_scale_inv` fp32
    [⌈out/bn⌉, in/bk], both filled by the loader (`load_fp8`)."""

    def __init__(self, out_f: int, in_f: int, bias: bool, dtype, device, block: tuple[int, int]):
        super().__init__()
        self.out_features, self.in_features, self.block = out_f, in_f, tuple(block)
        self.register_buffer("weight", torch.empty(out_f, in_f, dtype=FP8, device=device))
        bn, bk = self.block
        self.register_buffer("weight_scale_inv", torch.empty(-(-out_f // bn), in_f // bk, device=device))
        self.bias = nn.Parameter(torch.empty(out_f, dtype=dtype, device=device), requires_grad=False) if bias else None
        self.loaded = False

    def extra_repr(self) -> str:
        return f"out={self.out_features}, in={self.in_features}, fp8 e4m3 block={list(self.block)}"

    def load_fp8(self, w: torch.Tensor, scale: torch.Tensor) -> None:
        if w.dtype not in (FP8, torch.uint8) or tuple(w.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight is {str(w.dtype).replace('torch.', '')} {list(w.shape)}, expected float8_e4m3fn "
                             f"[{self.out_features}, {self.in_features}]")
        check_scale(w, scale, self.block, "weight")
        self.weight.copy_(w.view(FP8) if w.dtype == torch.uint8 else w)
        self.weight_scale_inv.copy_(scale)
        self.loaded = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() // self.in_features <= NATIVE_MAX_ROWS:
            return self.native(x)
        return self.widened(x)

    def widened(self, x: torch.Tensor) -> torch.Tensor:
        """WIDEN_ROWS output rows at a time dequantised to fp32 (exact), one fp32 GEMM each → x's
        dtype: prefill, and the reference the kernel is tested against."""
        xf, bn = x.float(), self.block[0]
        step = max(bn, WIDEN_ROWS // bn * bn)  # whole scale blocks per chunk
        outs = []
        for n in range(0, self.out_features, step):
            w = dequant(self.weight[n:n + step], self.weight_scale_inv[n // bn:(n + step) // bn + 1], self.block)
            outs.append(F.linear(xf, w, None if self.bias is None else self.bias[n:n + step].float()))
        return torch.cat(outs, -1).to(x.dtype)

    def native(self, x: torch.Tensor) -> torch.Tensor:
        return native.linear_fp8(x, self.weight, self.weight_scale_inv, self.block, self.bias)

    def storage(self) -> int:
        return self.weight.data_ptr()

    def native_lin(self):
        """(native.Lin, tensors it points into, rows up to which forward runs it) for the whole-layer
        decode call (models/native_layer.py); None before the load or on views of a fused q/k/v."""
        if not self.loaded or not (self.weight.is_contiguous() and self.weight_scale_inv.is_contiguous()):
            return None
        b32 = None if self.bias is None else self.bias.detach().float().contiguous()
        return native.fp8_lin(self.weight, self.weight_scale_inv, self.block, b32), [b32], NATIVE_MAX_ROWS

    @staticmethod
    def fuse(lins: list["Fp8Linear"]) -> "Fp8Linear | None":
        """One Fp8Linear over the output rows of all of lins (q, k, v: one kernel call), theirs
        turned into views of it; None unless each part but the last is whole scale-block rows and
        block, inputs and bias presence agree."""
        a = lins[0]
        bn = a.block[0]
        if not all(m.loaded and m.block == a.block and m.in_features == a.in_features
                   and (m.bias is None) == (a.bias is None) for m in lins) \
                or any(m.out_features % bn for m in lins[:-1]):
            return None
        out = Fp8Linear(sum(m.out_features for m in lins), a.in_features, a.bias is not None,
                        a.bias.dtype if a.bias is not None else torch.float32, a.weight.device, a.block)
        out.weight = torch.cat([m.weight for m in lins])
        out.weight_scale_inv = torch.cat([m.weight_scale_inv for m in lins])

        def views(m, at: int, n: int) -> None:
            m.weight = out.weight[at:at + n]
            m.weight_scale_inv = out.weight_scale_inv[at // bn:at // bn + m.weight_scale_inv.shape[0]]

        return fuse_rows(lins, out, views)


class Fp8MoEExperts(nn.Module):
    """Experts of one layer as block-scaled FP8, read in place on a CPU (one byte per weight).
        gate_up        [E, 2I, D] float8_e4m3fn   gate rows then up rows, as StackedExperts
        gate_up_scale  [E, 2I/bn, D/bk] fp32
        down           [E, D, I] float8_e4m3fn
        down_scale     [E, D/bn, I/bk] fp32
    The load sink for an FP8 checkpoint's experts (`load_fp8_part`); the forward is the native
    kernel (native.moe_fp8), or the torch reference on the experts in use where it is not built."""

    def __init__(self, E: int, D: int, I: int, block: tuple[int, int], device="cpu"):
        super().__init__()
        if not experts_fit(D, I, block):
            raise ValueError(f"FP8 experts D={D}, I={I} do not fit whole {list(block)} blocks")
        bn, bk = block
        self.num_experts, self.hidden, self.inter, self.block = E, D, I, (bn, bk)
        self.gate_up = torch.empty(E, 2 * I, D, dtype=FP8, device=device)
        self.gate_up_scale = torch.empty(E, 2 * I // bn, D // bk, dtype=torch.float32, device=device)
        self.down = torch.empty(E, D, I, dtype=FP8, device=device)
        self.down_scale = torch.empty(E, D // bn, I // bk, dtype=torch.float32, device=device)

    @staticmethod
    def nbytes(D: int, I: int, block: tuple[int, int]) -> int:
        """Bytes per expert: codes plus scales."""
        bn, bk = block
        return 3 * D * I + 4 * (2 * I // bn * (D // bk) + D // bn * (I // bk))

    def extra_repr(self) -> str:
        return f"E={self.num_experts}, D={self.hidden}, I={self.inter}, fp8 e4m3 block={list(self.block)}"

    def load_fp8_part(self, e: int, part: str, w: torch.Tensor, scale: torch.Tensor,
                      block: tuple[int, int] | None = None) -> None:
        """One projection as the checkpoint stores it: w [out, in] e4m3, scale [out/bn, in/bk]."""
        if block is not None and tuple(block) != self.block:
            raise ValueError(f"weight_block_size {list(block)} differs from this layer's {list(self.block)}")
        write_projection((self.gate_up[e], self.gate_up_scale[e], self.down[e], self.down_scale[e]), part, w, scale,
                         self.block, f"expert {e} {part}")

    def load_part(self, e: int, part: str, w: torch.Tensor) -> None:
        raise ValueError(f"expert {e} {part} is stored {w.dtype} in a layer of FP8 experts "
                         "(no weight_scale_inv beside it); mixed FP8/16-bit expert layers are not supported")

    def dequantized(self, experts: torch.Tensor | slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [n, 2I, D], down [n, D, I]) fp32 of the experts selected: the reference weights."""
        gu, gs = self.gate_up[experts], self.gate_up_scale[experts]
        dn, ds = self.down[experts], self.down_scale[experts]
        bn, bk = self.block
        return (gu.float() * gs.repeat_interleave(bn, 1).repeat_interleave(bk, 2),
                dn.float() * ds.repeat_interleave(bn, 1).repeat_interleave(bk, 2))

    def native_moe(self):
        """(native.MoeLayer, max slots) for the native decode layer (models/native_layer.py), or
        (None, 0) where the kernels are not built."""
        if native.lib() is None or self.gate_up.device.type != "cpu":
            return None, 0
        plan = native.MoeLayer(native.FMT_FP8, None, self.num_experts, 1, None, None, self.gate_up.data_ptr(),
                               self.down.data_ptr(), 0, 0, self.hidden, self.inter, 0, self.gate_up_scale.data_ptr(),
                               self.down_scale.data_ptr(), *self.block)
        return plan, 1 << 30

    def forward(self, x, ids, weights):  # x [N, D], ids/weights [N, K] → [N, D] in x's dtype
        if x.device.type == "cpu" and native.lib() is not None:
            return native.moe_fp8(x, ids, weights, self.gate_up, self.gate_up_scale, self.down, self.down_scale,
                                  self.block)
        from ..kernels.moe_gemm import moe_ref

        used, local = torch.unique(ids, return_inverse=True)  # only the experts in use are widened
        gu, dn = self.dequantized(used)
        return moe_ref(x.float(), local, weights.float(), gu, dn).to(x.dtype)


__all__ = ["E4M3_MAX", "FP8", "Fp8Linear", "Fp8MoEExperts", "linear_fits", "check_scale", "dequant", "dequant_ref", "experts_fit", "quantize", "write_checkpoint", "write_projection"]
