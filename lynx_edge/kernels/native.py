"""Native CPU kernels (cpu_native.c): built for this machine on first use, cached, loaded by ctypes.

What they compute, each in one call with fp32 products and sums: an MoE layer over INT4 blocks,
stacked fp32/bf16 experts or gpt-oss's MXFP4/16-bit experts with biases (`moe_int4`, `moe_dense`,
`moe_oss`), a dense projection (`linear`; `linear_int4` for a packed GPTQ / AWQ one), a decode
step's attention after the fused q/k/v projection (`attn_decode`) and RMSNorm (`rmsnorm`). Threads: torch's count, run on torch's own
OpenMP pool (see OPENMP below and parallel() in the C file: a pool of our own was slow to wake,
and two pools side by side collapse on a small machine).

Why built here and not shipped: the kernels are compiled with -march=native, so they use
whatever the CPU has (AVX-512, AVX2+FMA, portable loops elsewhere) with no per-ISA wheels. The
first call runs the system C compiler (`$CC`, else cc/gcc/clang; ~1 s) into
`$XDG_CACHE_HOME/lynx-edge/native/` under a name that hashes the source, flags and the CPU's
feature flags, so a home directory shared by different machines never loads a library built for
another ISA. No compiler, a failed build, an unwritable cache, or LYNX_EDGE_NATIVE=0: `lib()`
returns None and the torch / numba paths run instead — same results within the stated fp32 bounds.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SRC = Path(__file__).with_name("cpu_native.c")
# LYNX_EDGE_NATIVE_ARCH picks another -march (e.g. haswell: the AVX2/FMA paths; x86-64: the
# portable loops) — how the tests check the paths this machine's own ISA would not take
# -ffp-contract=off: a scalar a * b + c stays two roundings wherever the compiler puts it. With
# contraction (gcc's default) it may fuse the same line in one tile shape and not in another (seen
# with -march=znver4: the INT4 q8 zero-point sums of a token differed alone and in a batch); the
# vector paths' fused multiply-adds are explicit intrinsics and unaffected
FLAGS = ["-O3", f"-march={os.environ.get('LYNX_EDGE_NATIVE_ARCH', 'native')}", "-fPIC", "-shared", "-fno-math-errno",
         "-ffp-contract=off"]
# -fopenmp links libgomp.so.1, which the loader binds to the copy torch already loaded (same
# soname): one OpenMP runtime, one thread pool. Tried first; the build retries without it.
OPENMP = ["-fopenmp"]


def _cpu_id() -> str:
    """The CPU's feature flags (what -march=native compiles for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lynx-edge" / "native"


def build(cc: str | None = None) -> Path | None:
    """The cached library for this source, compiler and CPU, compiled if missing → its path, or
    None (no compiler, or the compile failed: logged once)."""
    cc = cc or _compiler()
    if cc is None:
        log.info("no C compiler: the native CPU kernels are off (numba / torch run instead)")
        return None
    key = hashlib.sha256(b"\0".join([SRC.read_bytes(), cc.encode(), " ".join(FLAGS + OPENMP).encode(),
                                     _cpu_id().encode()])).hexdigest()[:16]
    out = cache_dir() / f"cpu_native-{key}.so"
    if out.is_file():
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)  # compile aside, then one atomic rename
        os.close(fd)
    except OSError as e:  # e.g. a read-only home: run without the native kernels, say why once
        log.warning("cannot write the native CPU kernels' cache %s (numba / torch paths used instead): %s",
                    out.parent, e)
        return None
    try:
        err = ""
        for extra in (OPENMP, []):
            r = subprocess.run([cc, *FLAGS, *extra, "-o", tmp, str(SRC), "-lm"], capture_output=True, text=True,
                               timeout=120)
            if r.returncode == 0:
                os.replace(tmp, out)
                return out
            err = (r.stderr.strip().splitlines() or [str(r.returncode)])[-1]
        log.warning("building the native CPU kernels failed (numba / torch paths used instead): %s", err)
        return None
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("building the native CPU kernels failed (numba / torch paths used instead): %s", e)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def expected() -> bool:
    """Whether lib() gives the kernels here, answered without compiling them (a dry run such as
    `lynx-edge info` should not wait ~15 s for the first build): lib()'s own answer once it has run
    (or where it was replaced: tests, benchmarks switching builds), else not disabled and a C
    compiler present — a build that then fails falls back as lib() says."""
    info = getattr(lib, "cache_info", None)
    if info is None or info().currsize:
        return lib() is not None
    return os.environ.get("LYNX_EDGE_NATIVE", "1") != "0" and platform.system() != "Windows" and _compiler() is not None


@functools.lru_cache(maxsize=None)
def lib() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (disabled, no compiler, failed build or load)."""
    if os.environ.get("LYNX_EDGE_NATIVE", "1") == "0" or platform.system() == "Windows":
        return None
    path = build()
    if path is None:
        return None
    try:
        so = ctypes.CDLL(str(path))
    except OSError as e:
        log.warning("loading the native CPU kernels failed (numba kernel used instead): %s", e)
        return None
    p, i, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    so.lynx_moe.argtypes = [i, p, p, p, p, p, L, L, p, p, p, i, i, i, i, i, i, p, i, p, p, p, p, i, ctypes.c_float,
                            ctypes.c_float, i, i, i, i]
    so.lynx_moe.restype = i
    if hasattr(so, "lynx_pack_copy"):  # an older build (benchmarks' A/B bases) has none
        so.lynx_pack_copy.argtypes = [p, p, L, L, i, i]
        so.lynx_pack_copy.restype = None
    so.lynx_linear.argtypes = [i, p, p, p, i, i, i, p, i, i]
    so.lynx_linear.restype = None
    so.lynx_linear_int8.argtypes = [p, p, p, p, i, i, i, p, i, i]
    so.lynx_linear_int8.restype = i
    so.lynx_i8_q8.argtypes = []
    so.lynx_i8_q8.restype = i
    so.lynx_q16_pays.argtypes = []
    so.lynx_q16_pays.restype = i
    for name in ("lynx_scratch_kept", "lynx_scratch_release"):
        if hasattr(so, name):  # an older build (benchmarks' A/B bases) has neither
            getattr(so, name).argtypes = []
            getattr(so, name).restype = L
    so.lynx_linear_int4.argtypes = [p, p, p, p, p, p, i, i, i, i, p, i, i]
    so.lynx_linear_int4.restype = i
    so.lynx_linear_fp8.argtypes = [p, p, p, i, i, p, i, i, i, p, i]
    so.lynx_linear_fp8.restype = None
    so.lynx_dequant_fp8.argtypes = [p, p, i, i, i, i, p, i]
    so.lynx_dequant_fp8.restype = None
    so.lynx_dequant_int4.argtypes = [p, p, p, i, i, i, p, i]
    so.lynx_dequant_int4.restype = None
    f = ctypes.c_float
    so.lynx_attn_decode.argtypes = [p, i, i, i, i, i, p, p, f, f, p, p, p, p, p, p, i, L, L, i, p, i, p, i]
    so.lynx_attn_decode.restype = i
    so.lynx_rmsnorm.argtypes = [i, p, p, f, L, i, p, i]
    so.lynx_rmsnorm.restype = i
    so.lynx_qk_full.argtypes = [p, i, i, i, i, i, p, p, f, f]
    so.lynx_qk_full.restype = i
    so.lynx_layer_attn.argtypes = [p, p, i, p, p, p, p, p, p, i, L, L, p, p, p, i]
    so.lynx_layer_attn.restype = i
    so.lynx_layer_moe.argtypes = [p, i, p, p, p, i, i, p, p, i]
    so.lynx_layer_moe.restype = i
    so.lynx_shared_expert.argtypes = [p, p, i, p, i]
    so.lynx_shared_expert.restype = i
    so.lynx_route.argtypes = [p, p, i, i, p, p, p, p]
    so.lynx_route.restype = i
    so.lynx_layer.argtypes = [p, p, p, p, i, p, p, p, p, p, p, i, L, L, p, p, p, p, i]
    so.lynx_layer.restype = i
    so.lynx_layers.argtypes = [i, p, p, p, p, i, p, p, p, p, p, p, i, L, L, p, p, p, p, p, f, p, p, i]
    so.lynx_layers.restype = i
    so.lynx_short_conv.argtypes = [i, p, i, i, i, p, p, p, L, p, p, p]
    so.lynx_short_conv.restype = i
    so.lynx_argmax.argtypes = [p, L]
    so.lynx_argmax.restype = L
    so.lynx_decode.argtypes = [i, p, p, p, p, L, p, i, p, p, L, p, p, p, p, i, L, L, p, p, p, p, f, p, i, p, i, p, p, i]
    so.lynx_decode.restype = i
    so.lynx_exp.argtypes = [p, L, p]
    so.lynx_exp.restype = None
    so.lynx_silu_mul.argtypes = [p, p, L]
    so.lynx_silu_mul.restype = None
    if hasattr(so, "lynx_amx_enable"):  # an older build (benchmarks' A/B bases) has none
        so.lynx_amx_enable.argtypes = [i]
        so.lynx_amx_enable.restype = i
        so.lynx_amx_enable(int(os.environ.get("LYNX_EDGE_AMX", "0") == "1"))  # opt-in: see results/amx_experts_s39.json
    for name in ("lynx_bf16_dp", "lynx_bf16_pays"):
        if hasattr(so, name):  # an older build (benchmarks' A/B bases) has none
            getattr(so, name).argtypes = []
            getattr(so, name).restype = i
    return so


FMT_INT4, FMT_F32, FMT_BF16, FMT_MXFP4, FMT_FP8, FMT_I8 = 0, 1, 2, 3, 4, 5
# INT4 weights against "f32" activations (exact to fp32 rounding of the dequantised weight), "q16"
# (int16 activations with a scale per weight group, integer dot products: each input within 2^-16
# of its group's largest, 128× finer than bf16's own rounding; see q16_block in the C file) or "q8"
# (int8 activations in blocks of 32: llama.cpp's Q4_0 × Q8_0 scheme, ~2^-8; see q8_rows).
# Engine option int4_act per engine; LYNX_EDGE_INT4_ACT (INT4_ACT) sets the default, else
# default_int4_act(): q16 where it is measured to beat the f32 rows (lynx_q16_pays) — AVX2 builds
# without AVX-512 (1.2-1.4x end to end at fp32's quality within KL 3e-6; benchmarks/results/
# int4_act_q16_s24.md, int4_act_q16_f32_s24.md, int4_act_rows.json) and AVX-512 builds on AMD CPUs
# (a Zen4: 1.24-2.5x the f32 rows, int4_act_rows_s40.json) — f32 elsewhere (an Intel CPU's full-width
# 512-bit fp32 rows and the portable loops are unmeasured against q16).
INT4_ACTS = ("f32", "q16", "q8")
INT4_ACT = os.environ.get("LYNX_EDGE_INT4_ACT") or None
_ACT_CODE = {"f32": 0, "q8": 1, "q16": 2}  # the C file's ACT_F32 / ACT_Q8 / ACT_Q16


def default_int4_act() -> str:
    """The INT4 activations when none is named: INT4_ACT, else q16 where it was measured faster than
    the f32 rows (AVX2 without AVX-512; AVX-512 on an AMD CPU), else f32."""
    return INT4_ACT or ("q16" if _q16_pays() else "f32")


@functools.lru_cache(maxsize=None)
def _q16_pays() -> bool:
    so = lib()  # asked once: act_code(None) sits on INT4 kernel calls
    return so is not None and bool(so.lynx_q16_pays())


def act_code(act: str | None) -> int:
    """The native INT4 kernels' activation mode for act (None: default_int4_act())."""
    return _ACT_CODE[act or default_int4_act()]


# bf16 weights against "f32" activations (exact: each weight widens to fp32) or "bf16" (the
# activations rounded to bf16, 2^-9 relative, as llama.cpp's BF16 rows and torch's bf16 matmuls
# round them; the products and sums stay fp32): vdpbf16ps multiplies 32 pairs an instruction where
# the fp32 rows widen and multiply 16 (dp_block in the C file). Engine option bf16_act, resolved at
# build (build.bf16_act; the routers stay fp32, experts streamed from DRAM run the fp32 rows on the
# rounded inputs: see dp_block); LYNX_EDGE_BF16_ACT (BF16_ACT) sets the default, else default_bf16_act(): bf16 where the
# build has AVX512-BF16 on an AMD CPU and the model's weights stay in the last-level cache, so its
# steps are bound by multiply-adds (measured on a Zen4: the demo's decode 1.10-1.38x, its logits KL
# 1.6e-4 from fp32 activations, benchmarks/results/bf16_act_s42.md); f32 for a model that streams
# from DRAM (the random 1.28 GB qwen3_moe 0.94x at B = 1, 1.06x at B = 16: bf16_act_random_s42.md),
# and elsewhere (Intel's AVX512-BF16 unmeasured; without it the build has no bf16 rows on bf16
# inputs). The kernel calls below take act explicitly (None: f32): routers and references stay
# exact unless a caller asks.
BF16_ACTS = ("f32", "bf16")
BF16_ACT = os.environ.get("LYNX_EDGE_BF16_ACT") or None
# the C file's ACT_BF16, and ACT_BF16S for a projection whose rows stream from DRAM (a second
# prefetch a line on: dp_block), which the modules name "bf16-stream"
ACT_BF16, ACT_BF16S = 3, 4


def bf16_dp() -> bool:
    """Whether this build multiplies bf16 rows by bf16 activations (AVX512-BF16), so "bf16" changes anything."""
    so = lib()
    return so is not None and bool(getattr(so, "lynx_bf16_dp", lambda: 0)())


def default_bf16_act(model_bytes: int | None = None) -> str:
    """The bf16 rows' activations when none is named: BF16_ACT, else bf16 where it measured faster
    (AVX512-BF16 on an AMD CPU: lynx_bf16_pays, for a model of model_bytes that does not stream from
    DRAM: streamed), else f32."""
    if BF16_ACT:
        return BF16_ACT
    so = lib()
    pays = so is not None and getattr(so, "lynx_bf16_pays", lambda: 0)()
    return "bf16" if pays and (model_bytes is None or not streamed(model_bytes)) else "f32"


def bf16_code(act: str | None, weight_dtype: torch.dtype) -> int:
    """The kernels' act argument for a weight of weight_dtype under bf16 activations act ("bf16",
    "bf16-stream": its rows come from DRAM; None: f32)."""
    if weight_dtype != torch.bfloat16 or act not in ("bf16", "bf16-stream"):
        return 0
    return ACT_BF16S if act == "bf16-stream" else ACT_BF16
# token-expert slots per MoE call: bounds the kernel's fp32 scratch, S·(2D + I) floats (~60 MiB at
# D=2048, I=768) however long the prompt being prefilled
MAX_SLOTS = 4096


@functools.lru_cache(maxsize=None)
def llc_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """This CPU's last-level cache (one instance, as Linux's sysfs reports it), or None where unknown."""
    for index in (3, 2):
        f = Path(root) / f"index{index}" / "size"
        try:
            text = f.read_text().strip()
        except OSError:
            continue
        num, unit = text.rstrip("KMG"), text[len(text.rstrip("KMG")):]
        if num.isdigit():
            return int(num) << {"": 0, "K": 10, "M": 20, "G": 30}[unit]
    return None


def streamed(expert_bytes: int) -> bool:
    """Whether a model's 16/32-bit experts (all layers' bytes) come from DRAM at each decode step: they
    outgrow the last-level cache (unknown: assumed so). The native kernel then reads short expert rows
    whole, one after another, which streams faster from DRAM but runs slower from cache (one thread on
    an AMD EPYC Zen3, L3 32 MiB: bf16 rows of 256 inputs from DRAM 1.05-1.23x at 1-3 tokens,
    benchmarks/results/expert_rows_s27.json; the demo's 25 MB of bf16 experts, L3-resident, forced
    streamed 0.94-1.0x end to end, padded_stream_s27.json)."""
    llc = llc_bytes()
    return llc is None or expert_bytes > llc
_FMT = {torch.float32: FMT_F32, torch.bfloat16: FMT_BF16}
MOE_GU_PACKED, MOE_DN_PACKED = 2, 4  # lynx_moe's stream bits: gate_up / down hold packed rows
PACK_W = 8  # packed rows: groups of pack_group() rows, their inputs interleaved 8 at a time
PACK_MAX_K = 1024  # pack_choice: bf16 rows of at most this many inputs (measured there)


def packable(rows: int, inputs: int) -> bool:
    """Whether a [rows, inputs] fp32/bf16 expert matrix may be packed: this build's kernels read it
    (cpu_native.c, ROWS_PACKED: rows whole groups of 4, inputs of 8; not the AVX-512 build) and its
    rows are short enough to gain (≤ PACK_MAX_K inputs, the measured bound)."""
    g = pack_group()
    return g > 0 and rows % g == 0 and inputs % PACK_W == 0 and inputs <= PACK_MAX_K


def pack_choice(gate_up: torch.Tensor, down: torch.Tensor) -> tuple[bool, bool]:
    """Which of a layer's stacked experts (gate_up [E, 2I, D], down [E, D, I], streamed from DRAM) to
    keep in packed rows: bf16 matrices whose rows have at most PACK_MAX_K inputs, where this build
    reads them. One thread on an AMD EPYC Zen3, bf16 experts from DRAM, packed / row-major
    (`python benchmarks/expert_rows.py --base HEAD --packed`, results/packed_rows_s30_experts.json):
    one matrix of an expert packed (256-input gate/up rows, 512-1024-input down rows) 1.05-1.25x at
    one to three tokens an expert, 0.97-1.02x at four (a 4 x 3 tile, then a 4 x 1 from cache, where
    row-major runs 2 x 4), 1.02-1.05x at six; both matrices of 1024 x 768 experts 1.23-1.34x at one
    to three, 0.92x at four. Not packed: 2048-input gate/up rows (0.94-0.97x) and 1408-input down
    rows (~1.0x), which row-major tiles already stream well, and fp32 rows (0.83-0.96x at one token:
    a step of four rows spans two cache lines). End to end: results/packed_rows_s30.json."""
    if gate_up.dtype != torch.bfloat16 or down.dtype != torch.bfloat16:
        return False, False
    E, two_i, D = gate_up.shape
    I = two_i // 2
    return packable(I, D), packable(D, I)


def pack_group() -> int:
    """Rows per group of this build's packed rows; 0 where its kernels read none."""
    fn = getattr(lib(), "lynx_pack_rows", None)  # an older build (benchmarks' A/B bases) has none
    return int(fn()) if fn is not None else 0


def pack_rows(w: torch.Tensor) -> torch.Tensor:
    """w [..., R, K] row-major → the same shape in packed rows: each group of 4 rows' inputs
    interleaved 8 at a time (row 0's 0..7, row 1's 0..7, .., row 3's, then row 0's 8..15), so a tile of
    four rows reads its bytes in address order. A new contiguous tensor."""
    *lead, R, K = w.shape
    g = pack_group()
    return w.reshape(*lead, R // g, g, K // PACK_W, PACK_W).transpose(-3, -2).reshape(w.shape)


def pack_into(dst: torch.Tensor, w: torch.Tensor) -> None:
    """dst [R, K] (contiguous) ← pack_rows(w), row-major w [R, K]: the native copy on torch's threads
    (a load sink: no packed temporary), or pack_rows then a copy for a strided / other-dtype w."""
    R, K = w.shape
    if w.dtype == dst.dtype and w.is_contiguous() and dst.is_contiguous() and w.device.type == "cpu":
        lib().lynx_pack_copy(dst.data_ptr(), w.data_ptr(), R, K, w.element_size(), torch.get_num_threads())
        return
    dst.copy_(pack_rows(w))


def unpack_rows(w: torch.Tensor) -> torch.Tensor:
    """pack_rows's inverse: packed rows [..., R, K] → row-major (a new contiguous tensor)."""
    *lead, R, K = w.shape
    g = pack_group()
    return w.reshape(*lead, R // g, K // PACK_W, g, PACK_W).transpose(-3, -2).reshape(w.shape)


def dense_ok(*ws: torch.Tensor) -> bool:
    """Whether moe_dense / linear take these weights (CPU, one dtype of fp32 or bf16, contiguous)
    and the kernels built. Plain loops: this runs several times per layer per decode step."""
    dt = ws[0].dtype
    if dt not in _FMT:
        return False
    for w in ws:
        if w.dtype is not dt or w.device.type != "cpu" or not w.is_contiguous():
            return False
    return lib() is not None


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as a contiguous tensor of dtype, without a dispatched op when it already is one (these
    wrappers sit on the per-layer decode path, where each torch op costs microseconds)."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def _call_moe(fmt, x, ids, w, perm, data, E, nbytes, offs, gu, dn, sym, G, D, I, oss=(None, None, None, None, 0, 0.0, 0.0),
              act: int = 0, blocks: tuple[int, int] = (0, 0), stream: int = 1) -> torch.Tensor:
    so = lib()
    x32, ids64, w32 = _as(x, torch.float32), _as(ids, torch.int64), _as(w, torch.float32)
    T, K = ids64.shape
    out = torch.empty(T, D, dtype=torch.float32)
    step = max(1, MAX_SLOTS // K)  # tokens per call (a long prompt's prefill runs in several)
    for t0 in range(0, T, step):
        n = min(step, T - t0)  # row slices of contiguous tensors: contiguous, pointers offset
        rc = so.lynx_moe(fmt, x32[t0].data_ptr(), ids64[t0].data_ptr(), w32[t0].data_ptr(), perm, data, E, nbytes,
                         offs, gu, dn, sym, G, D, I, n, K, out[t0].data_ptr(), torch.get_num_threads(), *oss, act, *blocks,
                         int(stream))
        _check_moe(rc, ids64, E)
    return out


def _check_moe(rc: int, ids64: torch.Tensor, E: int) -> None:
    """lynx_moe's return code → nothing (0), IndexError naming the bad id (-3), MemoryError."""
    if rc == -3:
        bad = ids64[(ids64 < 0) | (ids64 >= E)]
        raise IndexError(f"expert id {int(bad[0])} out of range for {E} experts")
    if rc == -4:
        raise ValueError("packed expert rows need an fp32/bf16 layer with I and D multiples of 8, on a build "
                         "whose kernels read them (lynx_pack_rows)")
    if rc != 0:
        raise MemoryError("the native MoE kernel could not allocate its scratch buffers")


def moe_int4(x, ids, weights, data: torch.Tensor, offs, sym: bool, G: int, D: int, I: int,
             perm: torch.Tensor | None = None, act: str | None = None) -> torch.Tensor:
    """Σ_k weights[t, k] · expert_{ids[t, k]}(x[t]) over INT4 blocks data uint8 [E, nbytes] (byte
    offsets offs int64 [6] of gu_q, gu_s, gu_z, dn_q, dn_s, dn_z; perm [E, D] int32 act order) →
    [T, D] fp32. act: "f32", "q16" or "q8" activations (None: default_int4_act())."""
    p = None if perm is None else _as(perm, torch.int32)
    out = _call_moe(FMT_INT4, x, ids, weights, None if p is None else p.data_ptr(), data.data_ptr(),
                    data.shape[0], data.shape[1], offs.ctypes.data, None, None, int(sym), G, D, I,
                    act=act_code(act))
    return out


def moe_dense(x, ids, weights, gate_up: torch.Tensor, down: torch.Tensor, stream: bool = True,
              packed: tuple[bool, bool] = (False, False), act: str | None = None) -> torch.Tensor:
    """moe_ref's result over stacked fp32/bf16 experts gate_up [E, 2I, D], down [E, D, I], read in
    place → [T, D] in x's dtype; products and sums in fp32 (h = silu(gate)·up stays fp32).
    stream: the experts come from DRAM at each use (see streamed): the same sums, read in the order
    that streams fastest. packed: gate_up's / down's rows are in pack_rows's layout (the same sums).
    act "bf16": bf16 experts in row-major rows multiply x and h rounded to bf16 (see BF16_ACTS)."""
    E, two_i, D = gate_up.shape
    mode = int(stream) | (MOE_GU_PACKED if packed[0] else 0) | (MOE_DN_PACKED if packed[1] else 0)
    out = _call_moe(_FMT[gate_up.dtype], x, ids, weights, None, None, E, gate_up.element_size(), None,
                    gate_up.data_ptr(), down.data_ptr(), 0, 0, D, two_i // 2, act=bf16_code(act, gate_up.dtype),
                    stream=mode)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def moe_fp8(x, ids, weights, gate_up: torch.Tensor, gate_up_scales: torch.Tensor, down: torch.Tensor,
            down_scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """moe_ref's result over block-scaled FP8 experts read in place — e4m3fn codes gate_up
    [E, 2I, D], down [E, D, I] (float8_e4m3fn or their uint8 bytes) with fp32 scales
    [E, 2I/bn, D/bk], [E, D/bn, I/bk], block = (bn, bk) — → [T, D] in x's dtype; products and
    sums in fp32 (each block's sum times its scale), h = silu(gate)·up in fp32."""
    E, two_i, D = gate_up.shape
    gs, ds = _as(gate_up_scales, torch.float32), _as(down_scales, torch.float32)
    out = _call_moe(FMT_FP8, x, ids, weights, None, None, E, 1, None, gate_up.data_ptr(), down.data_ptr(), 0, 0,
                    D, two_i // 2, (gs.data_ptr(), ds.data_ptr(), None, None, 0, 0.0, 0.0), blocks=tuple(block))
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def moe_oss(x, ids, weights, gate_up: torch.Tensor, down: torch.Tensor, gate_up_b: torch.Tensor,
            down_b: torch.Tensor, limit: float, alpha: float, gate_up_scales: torch.Tensor | None = None,
            down_scales: torch.Tensor | None = None, act: str | None = None) -> torch.Tensor:
    """gpt-oss's MoE layer (kernels/moe_mxfp4.oss_moe_ref's result) over MXFP4 experts — code bytes
    gate_up [E, 2I, D/2], down [E, D, I/2] with e8m0 scales [E, 2I, D/32], [E, D, I/32] — or
    16-bit ones [E, 2I, D], [E, D, I]; biases gate_up_b [E, 2I], down_b [E, D] fp32 → [T, D] in x's
    dtype (products and sums in fp32, the activation in fp32). act: the MXFP4 rows' activations as
    the INT4 rows' (None: default_int4_act()): "f32" exact, "q16" int16 in blocks of 32 (integer
    products, ~2^-16 of each block's largest input), "q8" int8 (2^-8, llama.cpp's MXFP4 x Q8_0)."""
    E, two_i = gate_up.shape[:2]
    D = down.shape[1]
    mx = gate_up_scales is not None
    gb, db = _as(gate_up_b, torch.float32), _as(down_b, torch.float32)
    oss = (gate_up_scales.data_ptr() if mx else None, down_scales.data_ptr() if mx else None, gb.data_ptr(),
           db.data_ptr(), 1, float(limit), float(alpha))
    out = _call_moe(FMT_MXFP4 if mx else _FMT[gate_up.dtype], x, ids, weights, None, None, E,
                    1 if mx else gate_up.element_size(), None, gate_up.data_ptr(), down.data_ptr(), 0, 0, D, two_i // 2,
                    oss, act=act_code(act) if mx else 0)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def short_conv(bcx: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor,
               rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """LFM2's gated short convolution for one token per row (lynx_short_conv): bcx [B, 3D] (the
    in_proj's B, C, x; model dtype fp32/bf16, contiguous), weight [D, 1, L] and bias [D] or None in
    the same dtype, the rows' conv state [Bmax, D, L-1] (same dtype, contiguous; updated in place),
    rows / pos int64 [B] (position 0: a new sequence, its state read as zeros) → C · conv(B · x) [B, D]."""
    B, D = bcx.shape[0], bcx.shape[1] // 3
    out = torch.empty(B, D, dtype=bcx.dtype)
    rc = lib().lynx_short_conv(_FMT[bcx.dtype], bcx.data_ptr(), B, D, weight.shape[-1], weight.data_ptr(),
                               None if bias is None else bias.data_ptr(), state.data_ptr(), state.shape[0],
                               rows.data_ptr(), pos.data_ptr(), out.data_ptr())
    if rc == -2:
        raise MemoryError("the native short convolution could not allocate its scratch")
    if rc != 0:
        raise IndexError(f"a conv state row outside the cache's {state.shape[0]} rows")
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, act: str | None = None
           ) -> torch.Tensor:
    """F.linear for a CPU fp32/bf16 weight [N, Kin] with fp32 accumulation → [..., N] in x's dtype;
    act "bf16": a bf16 weight meets x rounded to bf16 (see BF16_ACTS)."""
    N, Kin = weight.shape
    x2 = _as(x.reshape(-1, Kin), torch.float32)
    b = None if bias is None else _as(bias, torch.float32)
    out = torch.empty(x2.shape[0], N, dtype=torch.float32)
    if x2.shape[0]:
        lib().lynx_linear(_FMT[weight.dtype], x2.data_ptr(), weight.data_ptr(), None if b is None else b.data_ptr(),
                          x2.shape[0], Kin, N, out.data_ptr(), torch.get_num_threads(), bf16_code(act, weight.dtype))
    out = out.view(*x.shape[:-1], N)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def scratch_kept() -> int:
    """Bytes of kernel scratch kept between calls (a prompt's MoE buffers, up to 256 MiB; see
    take_block in the C file): reused so their pages are not faulted in again at every call."""
    so = lib()
    return int(so.lynx_scratch_kept()) if so is not None else 0


def release_scratch() -> int:
    """Free the kernel scratch kept between calls (the next long prompt allocates it again) → bytes freed."""
    so = lib()
    return int(so.lynx_scratch_release()) if so is not None else 0


def i8_q8() -> bool:
    """Whether linear_int8 runs act="q8" as int8 activations here (AVX512-VNNI or AVX2 builds); elsewhere
    it runs the fp32 activations."""
    return bool(lib().lynx_i8_q8())


def linear_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                act: str | None = None) -> torch.Tensor:
    """x [..., K] @ (q * scale[:, None])ᵀ (+ bias) for int8 rows q [N, K] with fp32 row scales [N]
    (quant/int8.py), fp32 products and sums → [..., N] fp32. act "q8": int8 activations in blocks of
    256 with integer dot products (approximate; where i8_q8() and K % 64 == 0)."""
    N, Kin = q.shape
    x2 = _as(x.reshape(-1, Kin), torch.float32)
    b = None if bias is None else _as(bias, torch.float32)
    out = torch.empty(x2.shape[0], N, dtype=torch.float32)
    if x2.shape[0]:
        rc = lib().lynx_linear_int8(x2.data_ptr(), _as(q, torch.int8).data_ptr(),
                                    _as(scale, torch.float32).data_ptr(), None if b is None else b.data_ptr(),
                                    x2.shape[0], Kin, N, out.data_ptr(), torch.get_num_threads(), int(act == "q8"))
        if rc:
            raise MemoryError("the int8 linear could not allocate its activation scratch")
    return out.view(*x.shape[:-1], N)


def linear_int4(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                perm: torch.Tensor | None = None, bias: torch.Tensor | None = None, act: str | None = None
                ) -> torch.Tensor:
    """x @ Wᵀ (+ bias) for an INT4 linear W [N, Kin] read packed — codes packed uint8 [N, Kin/2],
    fp16 scales [Kin/G, N], uint8 zeros [Kin/G, N] or None (symmetric), perm int32 [Kin] or None
    (act order) — with fp32 products and sums (act "q16" / "q8": integer activations, see INT4_ACTS) →
    [..., N] in x's dtype."""
    N, h = packed.shape
    Kin, G = 2 * h, 2 * h // scales.shape[0]
    x2 = _as(x.reshape(-1, Kin), torch.float32)
    scales, zeros = _as(scales, torch.float16), None if zeros is None else _as(zeros, torch.uint8)
    b = None if bias is None else _as(bias, torch.float32)
    out = torch.empty(x2.shape[0], N, dtype=torch.float32)
    if x2.shape[0]:
        rc = lib().lynx_linear_int4(x2.data_ptr(), packed.data_ptr(), scales.data_ptr(),
                                    None if zeros is None else zeros.data_ptr(), None if perm is None else perm.data_ptr(),
                                    None if b is None else b.data_ptr(), x2.shape[0], Kin, N, G, out.data_ptr(),
                                    torch.get_num_threads(), act_code(act))
        if rc != 0:
            raise MemoryError("the native INT4 linear could not allocate its scratch buffers")
    out = out.view(*x.shape[:-1], N)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def linear_fp8(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ Wᵀ (+ bias) for a block-scaled FP8 linear W [N, Kin] read in place — e4m3 codes [N, Kin],
    fp32 scales [⌈N/bn⌉, Kin/bk] — with fp32 products and sums → [..., N] in x's dtype."""
    N, Kin = codes.shape
    x2 = _as(x.reshape(-1, Kin), torch.float32)
    b = None if bias is None else _as(bias, torch.float32)
    s = _as(scale, torch.float32)
    out = torch.empty(x2.shape[0], N, dtype=torch.float32)
    if x2.shape[0]:
        lib().lynx_linear_fp8(x2.data_ptr(), codes.data_ptr(), s.data_ptr(), block[0], block[1],
                              None if b is None else b.data_ptr(), x2.shape[0], Kin, N, out.data_ptr(),
                              torch.get_num_threads())
    out = out.view(*x.shape[:-1], N)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def dequant_fp8(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """quant/fp8.dequant's result (fp32 [N, K], exact) for e4m3 codes [N, K] (bk | K) and fp32 scales."""
    N, K = codes.shape
    c, s = codes if codes.is_contiguous() else codes.contiguous(), _as(scale, torch.float32)
    out = torch.empty(N, K, dtype=torch.float32)
    lib().lynx_dequant_fp8(c.data_ptr(), s.data_ptr(), block[0], block[1], N, K, out.data_ptr(),
                           torch.get_num_threads())
    return out


def fp8_lin(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], bias32: torch.Tensor | None) -> Lin:
    """A Lin over an FP8 linear's codes [N, K] and fp32 block scales (contiguous)."""
    N, K = codes.shape
    return Lin(FMT_FP8, codes.data_ptr(), scale.data_ptr(), None, None, None if bias32 is None else bias32.data_ptr(),
               N, K, block[1], 0, block[0])


def dequant_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None) -> torch.Tensor:
    """int4.dequant's result (fp32 [N, Kin], code order), exact, for packed [N, Kin/2] uint8,
    fp16 scales and uint8 zeros [Kin/G, N] (None: symmetric)."""
    N, h = packed.shape
    scales, zeros = _as(scales, torch.float16), None if zeros is None else _as(zeros, torch.uint8)
    out = torch.empty(N, 2 * h, dtype=torch.float32)
    lib().lynx_dequant_int4(_as(packed, torch.uint8).data_ptr(), scales.data_ptr(),
                            None if zeros is None else zeros.data_ptr(), 2 * h, N, 2 * h // scales.shape[0],
                            out.data_ptr(), torch.get_num_threads())
    return out


def attn_decode(qkv: torch.Tensor, H: int, Hkv: int, hd: int, q_norm: torch.Tensor | None,
                k_norm: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                rows: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, window: int | None,
                sinks: torch.Tensor | None = None, ring: int = 0) -> torch.Tensor | None:
    """One decode token per row: qkv [B, (H + 2·Hkv)·hd] (the fused projection's output) → the
    attention output [B, H·hd] fp32, K/V written into the caches [Bmax, Hkv, S, hd] (fp32 or bf16)
    at rows[b], position pos[b]; q/k RMSNorm weights [hd] (or None), RoPE cos/sin [B, rd] over the
    first rd dims, scale 1/√hd, keys pos − window + 1 .. pos; sinks [H] fp32: one more logit per head
    in each softmax, without a value (gpt-oss); ring R > 0: the caches are a window layer's ring
    (kv_cache.py: S = 2R, position p at slots p mod R and p mod R + R). None: a shape the kernel
    does not take."""
    B = qkv.shape[0]
    q32 = _as(qkv, torch.float32)
    qn = None if q_norm is None else _as(q_norm, torch.float32)
    kn = None if k_norm is None else _as(k_norm, torch.float32)
    c32, s32 = _as(cos, torch.float32), _as(sin, torch.float32)
    p64, r64 = _as(pos, torch.int64), _as(rows, torch.int64)
    out = torch.empty(B, H * hd, dtype=torch.float32)
    rc = lib().lynx_attn_decode(q32.data_ptr(), B, H, Hkv, hd, c32.shape[-1], None if qn is None else qn.data_ptr(),
                                None if kn is None else kn.data_ptr(), eps, hd ** -0.5, c32.data_ptr(),
                                s32.data_ptr(), p64.data_ptr(), r64.data_ptr(), k_cache.data_ptr(),
                                v_cache.data_ptr(), _FMT[k_cache.dtype], k_cache.shape[0], k_cache.shape[2], window or 0,
                                out.data_ptr(), torch.get_num_threads(), None if sinks is None else sinks.data_ptr(),
                                ring)
    if rc == -2:
        raise MemoryError("the native attention kernel could not allocate its scores buffer")
    return out if rc == 0 else None


def qk_full(qkv: torch.Tensor, H: int, Hkv: int, hd: int, q_weight: torch.Tensor, k_weight: torch.Tensor,
            eps: float, clip: float | None) -> torch.Tensor | None:
    """OLMoE's q/k: qkv [B, (H + 2·Hkv)·hd] (fp32 or the model dtype) → fp32 with q RMSNormed over
    all its heads at once by q_weight [H·hd], k by k_weight [Hkv·hd] (the model dtype, whose
    roundings it follows), then q, k and v clipped to ±clip (None: not). A contiguous fp32 qkv is
    written in place (the decode step's own projection output: no copy per step). None: widths the
    kernel does not take."""
    dt = q_weight.dtype
    if dt not in _FMT or k_weight.dtype != dt:
        return None
    out = _as(qkv, torch.float32)
    rc = lib().lynx_qk_full(out.data_ptr(), out.shape[0], H, Hkv, hd, _FMT[dt], _as(q_weight, dt).data_ptr(),
                            _as(k_weight, dt).data_ptr(), eps, clip or 0.0)
    return out if rc == 0 else None


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm over the last dim of x (fp32 or bf16, weight the same dtype) with fp32 statistics,
    rounding as the torch path does (lynx_edge.models.layers.RMSNorm) → x's shape and dtype, or
    None for a width the kernel does not take."""
    xc = _as(x, x.dtype)
    out = torch.empty_like(xc)
    D = x.shape[-1]
    if x.numel() == 0:
        return out
    rc = lib().lynx_rmsnorm(_FMT[x.dtype], xc.data_ptr(), weight.data_ptr(), eps, x.numel() // D, D, out.data_ptr(),
                            torch.get_num_threads())
    return out if rc == 0 else None


# --- a whole decoder layer at decode (lynx_layer_attn / lynx_layer_moe; models/native_layer.py) ---


class Lin(ctypes.Structure):
    """One projection for the layer calls: dense fp32/bf16 [N, K], INT4 packed, or FP8 codes with
    block scales (G = bk, bn) (lin_t in the C file)."""
    _fields_ = [("kind", ctypes.c_int), ("w", ctypes.c_void_p), ("s", ctypes.c_void_p), ("z", ctypes.c_void_p),
                ("perm", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("N", ctypes.c_int), ("K", ctypes.c_int),
                ("G", ctypes.c_int), ("act", ctypes.c_int), ("bn", ctypes.c_int)]


class AttnLayer(ctypes.Structure):
    """attn_layer_t: what lynx_layer_attn reads of one layer (pointers into its weights)."""
    _fields_ = [("fmt", ctypes.c_int), ("D", ctypes.c_int), ("H", ctypes.c_int), ("Hkv", ctypes.c_int),
                ("hd", ctypes.c_int), ("rd", ctypes.c_int), ("window", ctypes.c_int), ("eps1", ctypes.c_float),
                ("eps2", ctypes.c_float), ("eps_qk", ctypes.c_float), ("scale", ctypes.c_float),
                ("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p), ("qn", ctypes.c_void_p),
                ("kn", ctypes.c_void_p), ("qkv", Lin), ("o", Lin), ("gate", Lin),
                ("qfw", ctypes.c_void_p), ("kfw", ctypes.c_void_p), ("clip", ctypes.c_float),  # OLMoE's (qk_full)
                ("sinks", ctypes.c_void_p), ("ring", ctypes.c_int),  # gpt-oss's sinks [H] fp32; a ring cache's period
                ("conv_w", ctypes.c_void_p), ("conv_b", ctypes.c_void_p), ("conv_L", ctypes.c_int)]  # LFM2's conv


class MoeLayer(ctypes.Structure):
    """moe_layer_t: one layer's experts for lynx_layer_moe (INT4 blocks, stacked fp32/bf16, or FP8
    codes with their block scales gus/dns and block (bn, bk))."""
    _fields_ = [("fmt", ctypes.c_int), ("data", ctypes.c_void_p), ("E", ctypes.c_long), ("nbytes", ctypes.c_long),
                ("offs", ctypes.c_void_p), ("perm", ctypes.c_void_p), ("gu", ctypes.c_void_p),
                ("dn", ctypes.c_void_p), ("sym", ctypes.c_int), ("G", ctypes.c_int), ("D", ctypes.c_int),
                ("I", ctypes.c_int), ("act", ctypes.c_int), ("gus", ctypes.c_void_p), ("dns", ctypes.c_void_p),
                ("bn", ctypes.c_int), ("bk", ctypes.c_int), ("stream", ctypes.c_int),
                ("shared", ctypes.c_void_p),  # a SharedExpert's address, or None
                ("gub", ctypes.c_void_p), ("dnb", ctypes.c_void_p), ("act_kind", ctypes.c_int),  # gpt-oss's biases
                ("limit", ctypes.c_float), ("alpha", ctypes.c_float)]  # and clamped SwiGLU (act_kind 1)


class SharedExpert(ctypes.Structure):
    """shared_t: a shared expert's projections (gate, up, down) and its scale's row sg (sg.N = 0: none)."""
    _fields_ = [("gate", Lin), ("up", Lin), ("down", Lin), ("sg", Lin)]


def shared_expert(plan: SharedExpert, x: torch.Tensor) -> torch.Tensor:
    """The shared expert over x [N, D] (fp32, or the model dtype) → fp32 [N, D]: sigmoid(sg·x) ×
    down(silu(gate x) · up x) in fp32 (lynx_shared_expert; lynx_layer_moe runs the same)."""
    x32 = _as(x, torch.float32)
    out = torch.empty(x32.shape[0], plan.down.N, dtype=torch.float32)
    if lib().lynx_shared_expert(ctypes.byref(plan), x32.data_ptr(), x32.shape[0], out.data_ptr(),
                                torch.get_num_threads()) != 0:
        raise MemoryError("the native shared expert could not allocate its scratch buffers")
    return out


def dense_lin(weight: torch.Tensor, bias32: torch.Tensor | None, act: str | None = None) -> Lin:
    """A Lin over a contiguous CPU fp32/bf16 weight [N, K] (bias fp32 or None; the caller keeps them
    alive); act as linear's."""
    N, K = weight.shape
    return Lin(_FMT[weight.dtype], weight.data_ptr(), None, None, None, None if bias32 is None else bias32.data_ptr(),
               N, K, 0, bf16_code(act, weight.dtype))


def int8_lin(q: torch.Tensor, scale: torch.Tensor, bias32: torch.Tensor | None, act: str | None = None) -> Lin:
    """A Lin over int8 rows q [N, K] with fp32 row scales [N] (contiguous; quant/int8.py); act as
    linear_int8's."""
    N, K = q.shape
    return Lin(FMT_I8, q.data_ptr(), scale.data_ptr(), None, None, None if bias32 is None else bias32.data_ptr(),
               N, K, 0, int(act == "q8"))


def int4_lin(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, perm: torch.Tensor | None,
             bias32: torch.Tensor | None, act: str | None) -> Lin:
    """A Lin over an INT4 linear's contiguous buffers (as linear_int4 takes them)."""
    N, h = packed.shape
    return Lin(FMT_INT4, packed.data_ptr(), scales.data_ptr(), None if zeros is None else zeros.data_ptr(),
               None if perm is None else perm.data_ptr(), None if bias32 is None else bias32.data_ptr(), N, 2 * h,
               2 * h // scales.shape[0], act_code(act))


def layer_attn(plan: AttnLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
               rows: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, n_logits: int):
    """x [B, D] (model dtype, contiguous) → (x1 [B, D] model dtype, h2 [B, D] fp32, logits [B, E]
    fp32), or None when the attention kernel does not take the shape (nothing written)."""
    B, D = x.shape
    x1 = torch.empty_like(x)
    h2 = torch.empty(B, D, dtype=torch.float32)
    logits = torch.empty(B, n_logits, dtype=torch.float32)
    rc = lib().lynx_layer_attn(ctypes.byref(plan), x.data_ptr(), B, cos.data_ptr(), sin.data_ptr(), pos.data_ptr(),
                               rows.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), _FMT[k_cache.dtype],
                               k_cache.shape[0], k_cache.shape[2], x1.data_ptr(), h2.data_ptr(), logits.data_ptr(),
                               torch.get_num_threads())
    if rc == -2:
        raise MemoryError("the native decode layer could not allocate its scratch buffers")
    return (x1, h2, logits) if rc == 0 else None


def layer_moe(plan: MoeLayer, h2: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, x1: torch.Tensor
              ) -> torch.Tensor:
    """x1 + the experts over h2 (fp32 [B, D]) for ids/weights [B, K] → [B, D] in x1's dtype."""
    ids64, w32 = _as(ids, torch.int64), _as(weights, torch.float32)
    out = torch.empty_like(x1)
    rc = lib().lynx_layer_moe(ctypes.byref(plan), _FMT[x1.dtype], h2.data_ptr(), ids64.data_ptr(), w32.data_ptr(),
                              ids64.shape[0], ids64.shape[1], x1.data_ptr(), out.data_ptr(), torch.get_num_threads())
    _check_moe(rc, ids64, plan.E)
    return out


# --- routing (lynx_route): softmax → exact top-k → LYNX's all-decode selection, one call ---

ROUTE_EXACT = -1  # the other kinds are lynx_host.KIND_LYNX / KIND_BUDGET / KIND_MASS


class Route(ctypes.Structure):
    """route_t: one router's decision rule (routing.ExactRouter's, or a LYNX rule for T tokens)."""
    _fields_ = [("K", ctypes.c_int), ("norm", ctypes.c_int), ("kind", ctypes.c_int), ("beta", ctypes.c_int),
                ("j", ctypes.c_int), ("protect", ctypes.c_int), ("pooled", ctypes.c_int), ("alpha", ctypes.c_float),
                ("arg", ctypes.c_float), ("slack", ctypes.c_float), ("scale", ctypes.c_float),
                ("discard", ctypes.c_int)]  # 1: LYNX computed, the exact choice returned (its cost alone)


def exact_plan(K: int, norm: bool, scale: float = 1.0) -> Route:
    return Route(K, int(norm), ROUTE_EXACT, 0, 0, 0, 0, 1.0, 0.0, 1.0, scale)


def route(logits: torch.Tensor, plan: Route, probs: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 contiguous CPU → (ids [T, K] int64, weights [T, K] fp32, stats [7] fp64:
    LynxResult.vec). probs [T, E] fp32: the softmax to use (tests: torch's); None: lynx_route's own."""
    T, E = logits.shape
    ids = torch.empty(T, plan.K, dtype=torch.int64)
    w = torch.empty(T, plan.K, dtype=torch.float32)
    vec = torch.empty(7, dtype=torch.float64)
    rc = lib().lynx_route(logits.data_ptr(), None if probs is None else probs.data_ptr(), T, E, ctypes.byref(plan),
                          ids.data_ptr(), w.data_ptr(), vec.data_ptr())
    if rc == -2:
        raise MemoryError("the native router could not allocate its scratch buffers")
    if rc != 0:
        raise ValueError(f"the native router does not take logits of shape {tuple(logits.shape)} with top-{plan.K}")
    return ids, w, vec


def layer(attn: AttnLayer, moe: MoeLayer, plan: Route, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          pos: torch.Tensor, rows: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor):
    """A whole decode layer: x [B, D] (model dtype, contiguous) → (out [B, D], ids [B, K], weights
    [B, K], stats [7]), or None when the attention kernel does not take the shape (nothing written)."""
    B, D = x.shape
    out = torch.empty_like(x)
    ids = torch.empty(B, plan.K, dtype=torch.int64)
    w = torch.empty(B, plan.K, dtype=torch.float32)
    vec = torch.empty(7, dtype=torch.float64)
    rc = lib().lynx_layer(ctypes.byref(attn), ctypes.byref(moe), ctypes.byref(plan), x.data_ptr(), B, cos.data_ptr(),
                          sin.data_ptr(), pos.data_ptr(), rows.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                          _FMT[k_cache.dtype], k_cache.shape[0], k_cache.shape[2], out.data_ptr(), ids.data_ptr(),
                          w.data_ptr(), vec.data_ptr(), torch.get_num_threads())
    if rc == -1:
        return None
    if rc == -2:
        raise MemoryError("the native decode layer could not allocate its scratch buffers")
    _check_moe(rc, ids, moe.E)
    return out, ids, w, vec


class Stack:
    """lynx_layers' arguments that do not change between decode steps, prepared once: the n layers'
    plans (attention, experts, route) and their caches as ctypes pointer arrays. Building them
    per step cost more Python than the rest of the call's arguments (models/native_layer.py keeps
    one per batch size and rebuilds it when a plan or a cache changes)."""

    def __init__(self, attn: list, moe: list, plans: list, kv: list):
        n = self.n = len(attn)
        ptrs = ctypes.c_void_p * n
        self.keep = (attn, moe, plans)  # the arrays hold addresses only
        self.K, self.E = plans[0].K, [m.E for m in moe]
        kc = kv[0][0]
        # one S for the call: the full caches' positions (a window layer's ring, kv_cache.RingKV, holds 2 x its
        # period, which its plan's ring says)
        S = next((c[0].shape[2] for c in kv if not getattr(c, "period", 0)), kc.shape[2])
        self.cache = (ptrs(*[c[0].data_ptr() for c in kv]), ptrs(*[c[1].data_ptr() for c in kv]), _FMT[kc.dtype],
                      kc.shape[0], S)
        self.plans = (ptrs(*map(ctypes.addressof, attn)), ptrs(*map(ctypes.addressof, moe)),
                      ptrs(*map(ctypes.addressof, plans)))

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor,
                 head: tuple | None = None) -> tuple:
        """x [B, D] (model dtype, contiguous; overwritten with the last layer's output) → (layers
        run, ids [n, B, K], weights [n, B, K], stats [n, 7], logits [B, V] fp32 or None). head: (final
        norm weight, eps, Lin of the head) → the logits too, when all n layers ran. Fewer than n run
        when a layer's attention kernel rejects the shape; nothing of it was written."""
        n, K, B = self.n, self.K, x.shape[0]
        ids = torch.empty(n, B, K, dtype=torch.int64)
        w = torch.empty(n, B, K, dtype=torch.float32)
        vec = torch.empty(n, 7, dtype=torch.float64)
        done = ctypes.c_int(0)
        logits = None if head is None else torch.empty(B, head[2].N, dtype=torch.float32)
        rc = lib().lynx_layers(n, *self.plans, x.data_ptr(), B, cos.data_ptr(), sin.data_ptr(), pos.data_ptr(),
                               rows.data_ptr(), *self.cache, ids.data_ptr(), w.data_ptr(), vec.data_ptr(),
                               ctypes.byref(done), None if head is None else head[0].data_ptr(),
                               0.0 if head is None else head[1], None if head is None else ctypes.byref(head[2]),
                               None if logits is None else logits.data_ptr(), torch.get_num_threads())
        if rc == -2:
            raise MemoryError("the native decode layers could not allocate their scratch buffers")
        if rc not in (0, -1):
            _check_moe(rc, ids[done.value], self.E[done.value])
        return done.value, ids, w, vec, (logits if rc == 0 and done.value == n else None)


    def greedy(self, emb: torch.Tensor, tokens: list[int], cos_tab: torch.Tensor, sin_tab: torch.Tensor,
               pos: list[int], rows: torch.Tensor, head: tuple, steps: int, stops: list[int]) -> tuple:
        """Up to `steps` greedy decode steps in one call (lynx_decode): each step embeds the rows'
        tokens (emb [V, D], model dtype), runs the n layers and the head, and feeds each row's argmax
        to the next step; it ends early after a step where a row chose one of `stops`. cos_tab /
        sin_tab [P, rd] fp32 rows by position; pos [B] the rows' first positions. → (steps run, tokens
        [steps, B] int64, ids [steps, n, B, K], weights [steps, n, B, K], stats [steps, n, 7], rc:
        0, or -1 when a step's attention kernel rejected the shape after the steps run)."""
        n, K, B = self.n, self.K, len(tokens)
        tok = torch.tensor(tokens, dtype=torch.int64)
        at = torch.tensor(pos, dtype=torch.int64)
        out = torch.empty(steps, B, dtype=torch.int64)
        ids = torch.empty(steps, n, B, K, dtype=torch.int64)
        w = torch.empty(steps, n, B, K, dtype=torch.float32)
        vec = torch.empty(steps, n, 7, dtype=torch.float64)
        stop = torch.tensor(sorted(stops) or [0], dtype=torch.int64)
        ran = ctypes.c_int(0)
        rc = lib().lynx_decode(n, *self.plans, emb.data_ptr(), emb.shape[0], tok.data_ptr(), B, cos_tab.data_ptr(),
                               sin_tab.data_ptr(), cos_tab.shape[0], at.data_ptr(), rows.data_ptr(), *self.cache,
                               ids.data_ptr(), w.data_ptr(), vec.data_ptr(), head[0].data_ptr(), head[1],
                               ctypes.byref(head[2]), steps, stop.data_ptr(), len(stops), out.data_ptr(),
                               ctypes.byref(ran), torch.get_num_threads())
        if rc == -2:
            raise MemoryError("the native decode could not allocate its scratch buffers")
        if rc == -4:
            raise ValueError(f"a decode token outside the vocabulary of {emb.shape[0]}, or a position past the "
                             f"RoPE table of {cos_tab.shape[0]}")
        if rc not in (0, -1):
            _check_moe(rc, ids[ran.value], self.E[0])
        return ran.value, out, ids, w, vec, rc


__all__ = ["AttnLayer", "Lin", "MoeLayer", "attn_decode", "build", "cache_dir", "dense_lin", "dense_ok", "dequant_int4",
           "exact_plan", "int4_lin", "layer", "layer_attn", "Stack", "layer_moe", "lib", "route", "Route", "linear", "linear_int4", "moe_dense", "moe_int4", "moe_oss", "streamed",
           "rmsnorm"]
