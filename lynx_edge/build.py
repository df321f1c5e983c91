"""Load a checkpoint in one pass: plan placement → build without weights → stream into place.

    model = load_model(model_dir, cfg, LoadOptions(device="cuda", dtype=None, offload=True, int4=True))

1. Placement is decided from config.json, the checkpoint's tensor names and the options alone:
   the dtype, where non-expert weights live (the device), and for every MoE layer its expert
   backend — resident 16-bit (`StackedExperts`), resident INT4 (`Int4MoEExperts`), resident FP8
   (`Fp8MoEExperts`: an FP8 checkpoint on a CPU with the native kernels), or the offload store (`OffloadedExperts` over a pinned host store) — and the INT4 layout (RTN groups
   for `int4=True`, the checkpoint's own group/symmetry for GPTQ and AWQ).
2. The model is built with those backends, non-expert parameters allocated empty on the device,
   experts as empty INT4 blocks or store buffers: no 16-bit expert is ever materialised.
3. `loader.load_weights` streams each tensor from the safetensors mmap into its home.
Peak anonymous memory during the load is the final footprint plus one projection's fp32
temporaries (RTN) — see benchmarks/load_memory.py. Glossary: E experts, D hidden, I intermediate.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from . import hugepages
from .checkpoint import Checkpoint
from .config import ConfigError, ModelConfig
from .cpuflags import cpu_bf16
from .loader import ProgressFn, expert_storage, load_weights
from .models import FAMILIES, MoEForCausalLM
from .models.layers import StackedExperts

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
# A bf16 checkpoint stays bf16 on a CPU with native bf16 math or lynx-edge's native kernels; without
# both (torch's bf16 GEMMs are slow there) it is widened to fp32 only while that costs little memory:
# a bigger 16-bit checkpoint stays 16-bit so it is not doubled in RAM (see default_dtype).
CPU_FP32_MAX_BYTES = 2 << 30


@dataclass
class LoadOptions:
    device: str | None = None  # None: cuda when present, else cpu
    dtype: str | torch.dtype | None = None  # None: bf16 on CUDA; on CPU see default_dtype
    offload: bool = False
    int4: bool = False
    int4_group: int = 128
    int4_act: str | None = None  # CPU INT4 activations: "f32" (exact) | "q16" (int16, ~2^-16) | "q8" (int8, approximate); None: $LYNX_EDGE_INT4_ACT, else q16 where measured faster (native.default_int4_act), else f32
    int4_attn: bool = False  # CPU: a 16-bit checkpoint's attention / dense projections INT4 too (RTN at load)
    bf16_act: str | None = None  # CPU bf16 weights' activations: "f32" (exact) | "bf16" (rounded, 2^-9); None: $LYNX_EDGE_BF16_ACT, else bf16 where measured faster (native.default_bf16_act: AMD AVX512-BF16, a model that fits the LLC), else f32
    int8_head: bool = False  # CPU: the output head int8 with row scales (quant/int8.py; approximate)
    huge_pages: bool = False  # CPU: weights on 2 MiB transparent huge pages (hugepages.py; slower load)
    repack: bool = True  # CPU: streamed bf16 experts of short rows in packed rows (native.pack_choice)
    allow_pickle: bool = False
    ctx: int = 4096  # for the offload plan's KV share
    batch: int = 1  # KV rows the caller will allocate (serve: --max-num-seqs), for the plans' KV share
    swa_full: bool = False  # the sliding-window layers' KV the caller will allocate: full (True) or a ring
    offload_options: dict | None = None  # OffloadOptions fields (budget, slots, policy, profile…)


def resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' asked for, but CUDA is not available in this torch build")
    return dev


def resolve_dtype(dtype, device: torch.device, cfg: ModelConfig, ckpt_bytes: int) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ConfigError(f"dtype {dtype} not supported; use torch.float32, torch.bfloat16 or torch.float16")
        return dtype
    if dtype is not None:
        dtype = named_dtype(dtype, "dtype")
        if dtype == torch.float16 and device.type == "cpu":
            warnings.warn("float16 on a CPU decodes on torch's ops (the native kernels have no fp16 rows): "
                          "bfloat16 or float32 are ~10x faster", RuntimeWarning, stacklevel=3)
        return dtype
    return default_dtype(device, cfg, ckpt_bytes)


def named_dtype(name: str, source: str) -> torch.dtype:
    """"float32" | "bfloat16" | "float16" → the torch dtype; anything else one ConfigError naming
    where it came from (--dtype, $LYNX_EDGE_CPU_DTYPE)."""
    if name not in DTYPES:
        raise ConfigError(f"{source}={name!r} is not a dtype; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def _native_kernels() -> bool:
    """lynx-edge's native CPU kernels run here (kernels/native.py; asked without building them)."""
    from .kernels import native

    return native.expected()


def default_dtype(device: torch.device, cfg: ModelConfig, ckpt_bytes: int) -> torch.dtype:
    """bf16 on CUDA. On CPU: a bf16 checkpoint stays bf16 where the CPU has native bf16 math
    (cpu_bf16: on a Zen4 EPYC the demo then prefills 1.45× and decodes 1.7–2.0× faster than in fp32
    at +0.03% perplexity, benchmarks/results/cpu_dtype_s15_t1.md) or lynx-edge's native kernels
    run (they widen bf16 rows in registers and prefill bf16 themselves: on an AVX2 Zen3 without
    native bf16 the demo decodes 1.45–1.85× faster than in fp32 and prefills at 0.98–1.09× over two
    runs, perplexity +0.05%, 99.2% greedy agreement; a random 1.28 GB qwen3_moe decodes 1.41–1.52×
    faster and prefills 1.21× (one prompt) / 0.85× (16 × 128 tokens), in half the memory:
    cpu_dtype_s25_t1.md, cpu_dtype_random_s25_t1.md); elsewhere fp32
    while the checkpoint is ≤ 2 GiB (torch's fp32 GEMMs beat its bf16 ones up to 1.5× on CPUs
    without native bf16 math: benchmarks/results/cpu_native.md), else the checkpoint's own 16-bit
    dtype (memory first) — bf16 for an fp16 one where the native kernels run (below).
    $LYNX_EDGE_CPU_DTYPE (float32, bfloat16, …) makes the choice instead."""
    if device.type == "cuda":
        return torch.bfloat16
    env = os.environ.get("LYNX_EDGE_CPU_DTYPE")  # the choice made by hand (--dtype still wins)
    if env:
        return named_dtype(env, "LYNX_EDGE_CPU_DTYPE")
    ckpt = DTYPES.get(str(cfg.torch_dtype or "bfloat16"), torch.bfloat16)
    if ckpt == torch.bfloat16 and (cpu_bf16() or _native_kernels()):
        return torch.bfloat16
    if ckpt == torch.float32 or ckpt_bytes <= CPU_FP32_MAX_BYTES:
        return torch.float32
    if ckpt == torch.float16 and _native_kernels():
        # the native kernels have no fp16 rows: an fp16 model would decode on torch's ops (the demo's
        # 4-bit checkpoint exported fp16: 4.01 ms a token against 0.34 in bf16,
        # benchmarks/results/fp16_checkpoint_cpu_s25.json). bf16 halves fp32's bytes; it rounds
        # what the checkpoint keeps unquantized (embeddings, head, norms, routers) to 8 significant
        # bits — exactly the values an fp16 export of a bf16-trained model holds (GPTQ / AWQ
        # checkpoints are mostly such exports); --dtype float32 keeps them exact
        return torch.bfloat16
    return ckpt


@dataclass
class Placement:
    """What the builder decided (kept on the model as model.placement, shown by bench/info)."""

    device: str
    dtype: str
    experts: str  # bf16 | fp16 | fp32 | int4 | fp8
    where: str  # device | host (offload)
    int4_group: int | None = None
    int4_sym: bool | None = None
    quant_method: str | None = None  # gptq | awq for a 4-bit checkpoint, fp8 for a block-scaled FP8 one
    dense_layers: tuple[int, ...] = ()  # mixed layers kept 16-bit (a 4-bit checkpoint with 16-bit experts)
    packed_linears: int = 0  # 4-bit / FP8 non-expert linears read packed (CPU: Int4Linear, Fp8Linear)
    int4_act: str | None = None  # CPU INT4 kernels' activations: f32 | q16 | q8 (None: not an INT4 CPU model)
    bf16_act: str | None = None  # CPU bf16 weights' activations: f32 | bf16 (None: no bf16 weight on a CPU)
    int8_head: bool = False  # the output head read as int8 rows (quant/int8.py)


def load_model(model_dir: Path, cfg: ModelConfig, opts: LoadOptions, progress: ProgressFn | None = None):
    """→ MoEForCausalLM with every weight in place (and model.offload when offloading)."""
    from .quant.formats import read_quant_config
    from .quant.fp8 import experts_fit

    dev = resolve_device(opts.device)
    family = FAMILIES[cfg.model_type]
    ckpt = Checkpoint(model_dir, opts.allow_pickle)
    try:
        qc = read_quant_config(model_dir, cfg.raw)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    dt = resolve_dtype(opts.dtype, dev, cfg, ckpt.total_bytes)
    act = int4_act(opts.int4_act, cpu=dev.type == "cpu")
    if dev.type == "cpu" and dt == torch.bfloat16:
        bf16_act(opts.bf16_act)  # a bad value fails here, before the weights load
    D, I = cfg.hidden_size, cfg.moe_intermediate_size
    storage = expert_storage(ckpt, family)
    fp8 = qc is not None and qc.method == "fp8"  # 8-bit: kept 8-bit or dequantised, never INT4 unless asked
    int4 = (qc is not None and not fp8) or opts.int4
    if qc is not None and not fp8:
        group, sym = qc.group_size, qc.sym
    elif opts.int4:
        from .quant.experts import group_size_for

        group, sym = group_size_for(D, I, opts.int4_group), True
    else:
        group = sym = None
    mixed = tuple(i for i in cfg.moe_layer_ids if qc is not None and storage.get(i, set()) >= {"dense", "quant"})
    # an FP8 checkpoint's experts stay FP8: resident on a CPU with the native kernels, or in the
    # offload store (half of bf16's host memory and PCIe bytes); elsewhere they are dequantised
    fp8_fit = fp8 and not int4 and experts_fit(D, I, qc.weight_block) and getattr(family, "experts", None) is None
    fp8_block = qc.weight_block if fp8_fit and not opts.offload and _fp8_native(dev) else None
    store_block = qc.weight_block if fp8_fit and opts.offload else None
    name = "int4" if int4 else "fp8" if fp8_block or store_block else \
        {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dt]
    placement = Placement(dev.type, str(dt).replace("torch.", ""), name, "host" if opts.offload else "device",
                          group, sym, qc.method if qc is not None else None, mixed if not opts.offload else ())
    _check_memory(cfg, opts, dev, dt, qc, ckpt.total_bytes)
    rt = None
    if opts.offload:
        rt = _offload_runtime(cfg, opts, dt, dev, name, group, sym, mixed, store_block, act)
    experts = _backends(cfg, dt, dev, int4, group, sym, mixed, rt, act, fp8_block, opts.repack)
    model = MoEForCausalLM(cfg, dt, dev, experts=experts)
    if qc is not None:
        placement.packed_linears = _keep_linears_packed(model, ckpt, family, dev, act, qc)
    rtn_linears = _int4_linears(model, dev, opts.int4_group, act) if opts.int4_attn else 0
    placement.packed_linears += rtn_linears
    if (int4 or rtn_linears) and dev.type == "cpu":
        placement.int4_act = act
    if dev.type == "cpu" and opts.huge_pages:  # the weights land on 2 MiB pages as they stream in
        hugepages.advise(hugepages.model_tensors(model))
    load_weights(model, ckpt, family, qc, progress)
    ckpt.close()
    if opts.int8_head:
        placement.int8_head = _int8_head(model, dev, act, opts.huge_pages)
    if dev.type == "cpu" and dt == torch.bfloat16:
        nbytes = _decode_bytes(model)
        placement.bf16_act = _bf16_activations(model, bf16_act(opts.bf16_act, nbytes), nbytes)
    model.placement = placement
    if rt is not None:
        from .offload.runtime import _install_route

        rt.bind(model)
        _install_route(rt, rt.opts)
    return model


def int4_act(value: str | None, cpu: bool = True) -> str | None:
    """The CPU INT4 kernels' activations: value, else $LYNX_EDGE_INT4_ACT, else q16 where the native
    kernels measured it faster than the f32 rows (AVX2 without AVX-512; AVX-512 on an AMD CPU), else
    f32; checked. Off the CPU (cpu False) an unnamed value stays None: the kernels resolve it if a CPU
    expert ever runs (offload), without building them at load for a GPU model."""
    from .kernels import native

    if value is None and not cpu:
        return None
    act = value or native.default_int4_act()
    if act not in native.INT4_ACTS:
        raise ConfigError(f"int4 activations {act!r} not supported; use one of {', '.join(native.INT4_ACTS)}")
    return act


def bf16_act(value: str | None, model_bytes: int | None = None) -> str:
    """The CPU bf16 weights' activations: value, else $LYNX_EDGE_BF16_ACT, else bf16 where the native
    kernels measured it faster (AVX512-BF16 on an AMD CPU, a model of model_bytes that stays in the
    last-level cache: native.default_bf16_act), else f32; checked."""
    from .kernels import native

    act = value or native.default_bf16_act(model_bytes)
    if act not in native.BF16_ACTS:
        raise ConfigError(f"bf16 activations {act!r} not supported; use one of {', '.join(native.BF16_ACTS)}")
    return act


def _bf16_activations(model, act: str, nbytes: int | None = None) -> str:
    """Every bf16 projection, expert stack and head of a CPU model told its activations act → what
    runs: "bf16" only where the native kernels have bf16 rows on bf16 inputs (else "f32"). The
    routers (and the shared expert's scalar gate) stay fp32: a top-k decision is the last place
    for a rounding that can flip a choice. The projections and head are "bf16-stream" where the
    model's weights outgrow the last-level cache (each step reads them from DRAM: the kernel then
    prefetches further ahead; experts carry their own `streamed`). nbytes: _decode_bytes(model), if known."""
    from .kernels import native
    from .models.layers import Linear, MoEBlock

    if act == "bf16" and not native.bf16_dp():
        act = "f32"
    on = act == "bf16"
    exact = {id(m) for blk in model.modules() if isinstance(blk, MoEBlock)
             for m in (blk.gate, blk.shared_expert_gate) if m is not None}
    if on and nbytes is None:
        nbytes = _decode_bytes(model)
    lin = ("bf16-stream" if native.streamed(nbytes) else "bf16") if on else None
    for m in model.modules():
        if isinstance(m, StackedExperts):
            m.act = "bf16" if on else None
        elif isinstance(m, Linear) and id(m) not in exact:
            m.act = lin
        fused = getattr(m, "_qkv", None)  # an attention's fused q/k/v (built at its first forward, not a submodule)
        if fused and isinstance(fused[0], Linear):
            fused[0].act = lin
    if model.head_int8 is None:
        model.head_act = lin
    return act


def _decode_bytes(model) -> int:
    """The bytes of weights a model's decode steps may read: modelinfo.dense_decode_bytes (attention,
    norms, routers, head) plus every resident expert (16-bit parameters, or packed blocks, which live
    outside the module tree)."""
    from .modelinfo import dense_decode_bytes

    experts = sum(p.nbytes for name, p in model.named_parameters() if ".mlp.experts." in name)
    packed = sum(m.packed.data.nbytes for m in model.modules()
                 if isinstance(getattr(getattr(m, "packed", None), "data", None), torch.Tensor))
    return dense_decode_bytes(model) + experts + packed


def _fp8_native(dev) -> bool:
    """Resident FP8 experts stay 8-bit (quant/fp8.Fp8MoEExperts) on a CPU with the native kernels;
    on a GPU they are dequantised at load (bf16)."""
    from .kernels import native

    return dev.type == "cpu" and native.lib() is not None


def _keep_linears_packed(model, ckpt: Checkpoint, family, dev, act: str | None = None, qc=None) -> int:
    """On a CPU with the native kernels, the checkpoint's 4-bit attention / shared-expert / dense
    linears become Int4Linear (read packed each step: a quarter of bf16's bytes and memory), and an
    FP8 checkpoint's become Fp8Linear (8-bit: half), instead of being widened at load; elsewhere
    they stay 16-bit Linears. → how many were kept packed."""
    from .kernels import native
    from .loader import fp8_linears, packed_linears
    from .models.layers import Linear
    from .quant.fp8 import Fp8Linear, linear_fits
    from .quant.linear import Int4Linear

    if dev.type != "cpu" or native.lib() is None:
        return 0
    fp8 = qc is not None and qc.method == "fp8"
    n = 0
    for name in sorted(fp8_linears(ckpt, family) if fp8 else packed_linears(ckpt, family)):
        parent, _, leaf = name.rpartition(".")
        try:
            owner = model.get_submodule(parent)
        except AttributeError:
            continue
        old = getattr(owner, leaf, None)
        if type(old) is not Linear:
            continue
        out_f, in_f = old.weight.shape
        if fp8 and not linear_fits(in_f, qc.weight_block):
            continue
        new = Fp8Linear(out_f, in_f, old.bias is not None, old.weight.dtype, dev, qc.weight_block) if fp8 else \
            Int4Linear(out_f, in_f, old.bias is not None, old.weight.dtype, dev, act)
        setattr(owner, leaf, new)
        n += 1
    return n


def _int8_head(model, dev, act: str | None, huge_pages: bool = False) -> bool:
    """`int8_head`: on a CPU with the native kernels the output head becomes int8 rows with fp32
    scales (quant/int8.py), read at half of bf16's bytes every token, with int8 activations when the
    INT4 kernels' are (`int4_act="q8"`); elsewhere it stays 16-bit (RuntimeWarning). → whether it
    was made int8."""
    from .kernels import native

    if dev.type != "cpu" or native.lib() is None:
        warnings.warn("int8_head applies on a CPU with the native kernels; the head stays 16-bit here",
                      RuntimeWarning, stacklevel=3)
        return False
    model.quantize_head(act, huge_pages)
    return True


def _int4_linears(model, dev, group: int, act: str | None) -> int:
    """`int4_attn`: on a CPU with the native kernels, the 16-bit projections a module lists in its
    class's INT4_PROJECTIONS (plain `Linear`s: attention's q/k/v/o in Attention and its subclasses,
    dense / shared-expert MLPs, LFM2's short-convolution in/out projections, MLA's but kv_b_proj; not
    routers, not the lm_head, not a weight its module reads itself, such as MLA's kv_b_proj or a
    linear-attention layer's) become Int4Linear that RTN-quantise their weight as the loader streams
    it (group `group`, or a smaller one where it does not divide the inputs: rtn_group; symmetric)
    — as llama.cpp's Q4_0 does to every 2-D weight. Elsewhere nothing changes (RuntimeWarning).
    → how many were made INT4."""
    from .kernels import native
    from .models.layers import int4_projections
    from .quant.linear import Int4Linear

    if dev.type != "cpu" or native.lib() is None:
        warnings.warn("int4_attn applies on a CPU with the native kernels; attention stays 16-bit here",
                      RuntimeWarning, stacklevel=3)
        return 0
    n = 0
    for owner, leaf, old, g in int4_projections(model, group):
        out_f, in_f = old.weight.shape
        new = Int4Linear(out_f, in_f, old.bias is not None, old.weight.dtype, dev, act)
        new.rtn_group = g
        setattr(owner, leaf, new)
        n += 1
    return n


def _check_memory(cfg: ModelConfig, opts: LoadOptions, dev, dt, qc, file_bytes: int) -> None:
    """The memory plan for this machine, before anything is allocated: a load that cannot fit
    fails now with one line (the plan's summary and hint), not after minutes with an OOM."""
    from .offload import OffloadOptions
    from .offload.memory import plan_memory

    extra = {k: v for k, v in (opts.offload_options or {}).items() if k != "profile"}
    oo = OffloadOptions(device=str(dev), ctx=opts.ctx, batch=opts.batch, swa_full=opts.swa_full,
                        int4_group=opts.int4_group, **extra)
    plan = plan_memory(cfg, device=dev.type, dtype=dt, offload=opts.offload, int4=opts.int4, quant=qc,
                       ctx=opts.ctx, batch=opts.batch, opts=oo, file_bytes=file_bytes, int4_attn=opts.int4_attn,
                       int8_head=opts.int8_head)
    plan.check()


def _backends(cfg: ModelConfig, dt, dev, int4: bool, group, sym, mixed, rt, act: str | None = None,
              fp8_block: tuple[int, int] | None = None, repack: bool = True):
    """layer → its expert backend (a load sink), chosen once here."""
    D, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    own = getattr(FAMILIES[cfg.model_type], "experts", None)  # a family with its own expert math (gpt-oss)
    from .kernels import native

    # 16-bit experts on a CPU: do all layers' experts outgrow the last-level cache (each step then reads
    # its experts from DRAM)? The native kernel's read order follows (native.streamed).
    streamed = native.streamed(len(cfg.moe_layer_ids) * E * 3 * D * I * dt.itemsize)

    def make(layer: int):
        if rt is not None:  # the store's format carries the family's expert math and reader
            from .offload.experts import OffloadedExperts

            return OffloadedExperts.make(rt, layer)
        if own is not None:
            return own(cfg, layer, dt, dev, four_bit=int4, act=act)
        if int4 and layer not in mixed:
            from .quant.experts import Int4MoEExperts

            return Int4MoEExperts.empty(E, D, I, group, sym, dev, act)
        if fp8_block is not None:
            from .quant.fp8 import Fp8MoEExperts

            return Fp8MoEExperts(E, D, I, fp8_block, dev)
        return StackedExperts(E, D, I, dt, dev, streamed=streamed, pack=repack)

    return make


def _offload_runtime(cfg, opts: LoadOptions, dt, dev, name, group, sym, mixed, fp8_block=None, act=None):
    from .offload import OffloadOptions
    from .offload.runtime import make_runtime
    from .offload.store import store_format

    if mixed:
        warnings.warn(f"layers {list(mixed)} of this 4-bit checkpoint keep some experts 16-bit; offloaded "
                      "as INT4 they are RTN-quantised (approximate)", RuntimeWarning, stacklevel=3)
    extra = dict(opts.offload_options or {})
    oo = OffloadOptions(device=str(dev), ctx=opts.ctx, batch=opts.batch, swa_full=opts.swa_full,
                        expert_format=name if name in ("int4", "fp8") else "auto", int4_group=group or 128, **extra)
    # 4-bit host experts computed on the CPU (INT4, MXFP4) run the engine's int4_act
    fmt = store_format(cfg, oo.expert_format, dt, group or 128, sym if sym is not None else True, fp8_block, act)
    return make_runtime(cfg, oo, dt, dev, fmt=fmt)


__all__ = ["DTYPES", "LoadOptions", "Placement", "default_dtype", "load_model", "resolve_device", "resolve_dtype"]
