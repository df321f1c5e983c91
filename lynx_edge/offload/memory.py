"""Memory plan: every resource a load needs (GPU, host RAM, pinned host memory) with a verdict.

Computed from config.json alone (no weights). For each resource: the steady-state need, the
load PEAK need, what the machine has (a profile's machine, or this one), a verdict — fits /
tight (within 10%) / does not fit (pinned: limited) — and what would make it fit. The load
contract it plans for: the model is built without expert weights, every tensor streams from the
safetensors mmap into its final home, so peak anonymous host memory ≤ 1.1 × (final host
footprint + one layer's 16-bit experts); the mmap's page cache is reported apart (reclaimable).
Pinned memory is exact (one cudaHostRegister block per layer), not pin_memory=True's next_pow2.
Glossary: L MoE layers, E experts, K top-k, D hidden, I expert intermediate, G group size.
"""
from __future__ import annotations

import resource as _resource
from dataclasses import asdict, dataclass, field

import psutil
import torch

from ..config import ConfigError, ModelConfig
from ..kv_cache import KVCache, layer_specs
from ..quant.fp8 import Fp8MoEExperts
from ..quant.fp8 import experts_fit as fp8_experts_fit
from .options import OffloadOptions
from .profile import Profile, load_profile

GIB = 2**30
TIGHT = 0.9  # need above 90% of what the machine has is "tight"
LOAD_SLACK = 1.1  # the load contract's +10%
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PlanError(ConfigError):
    """The model cannot be placed (one clear line); `plan_text` holds the whole plan when known."""

    def __init__(self, message: str, plan_text: str = ""):
        super().__init__(message)
        self.plan_text = plan_text


@dataclass(frozen=True)
class QuantInfo:
    """A 4-bit checkpoint's expert format (GPTQ / AWQ): 0.5 B/param + fp16 scales per group
    (+ a zero per group when asymmetric). quant.formats.QuantConfig has the same fields and can
    be passed as is (modelinfo.read_quant converts one)."""

    method: str = "gptq"  # gptq | awq | mxfp4 | fp8
    bits: int = 4
    group_size: int = 128
    sym: bool = True
    weight_block: tuple[int, int] | None = None  # fp8: (bn, bk), one fp32 scale per block


def four_bit(quant) -> bool:
    """Whether a checkpoint's quantization (QuantInfo / QuantConfig, or None) stores 4-bit experts."""
    return quant is not None and quant.bits == 4


@dataclass
class Resource:
    key: str  # gpu | host | pinned | unified | page_cache
    name: str
    steady_bytes: int  # after the load
    peak_bytes: int  # during the load
    available_bytes: int | None  # what the machine has (None: unlimited / not checked)
    verdict: str  # fits | tight | does not fit | limited | info
    hint: str = ""  # what would make it fit
    minimum_bytes: int | None = None  # what must fit (offload: the expert cache shrinks to the rest)
    parts: dict[str, int] = field(default_factory=dict)  # what the steady need is made of
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.verdict != "does not fit"

    @property
    def need_bytes(self) -> int:
        """What the verdict compares with what the machine has."""
        return self.minimum_bytes if self.minimum_bytes is not None else max(self.steady_bytes, self.peak_bytes)


@dataclass
class MemoryPlan:
    model_type: str
    mode: str  # plain | int4 | offload | offload+int4 | gptq-4bit[+offload] | awq-4bit[+offload] | fp8[+int4][+offload]
    device: str  # cpu | cuda
    dtype: str  # non-expert weights and KV
    expert_format: str  # bf16 | fp16 | fp32 | int4 | fp8
    expert_bytes: int  # one expert block
    total_experts: int  # L·E
    expert_slots: int | None  # offload on CUDA: experts cached on the device
    ctx: int
    batch: int
    machine: str  # "profile rtx4090-24gb" | "this machine"
    resources: list[Resource]
    notes: list[str] = field(default_factory=list)
    pinned_pow2_bytes: int | None = None  # what pin_memory=True would have pinned (information)

    @property
    def fits(self) -> bool:
        return all(r.ok for r in self.resources)

    def resource(self, key: str) -> Resource | None:
        return next((r for r in self.resources if r.key == key), None)

    def report(self) -> dict:
        """JSON-able: the plan's fields, resources as dicts (+ need_bytes: what each verdict
        compared), fits and the one-line summary."""
        rep = asdict(self)
        for d, r in zip(rep["resources"], self.resources):
            d["need_bytes"] = r.need_bytes
        return {**rep, "fits": self.fits, "summary": self.summary()}

    def summary(self) -> str:
        """One line: what does not fit and the hint (or that everything fits)."""
        bad = [r for r in self.resources if not r.ok]
        if not bad:
            return f"{self.model_type} ({self.mode}) fits {self.machine}"
        parts = [f"{r.name} needs {_gib(r.need_bytes)} of {_gib(r.available_bytes)}" + (f" ({r.hint})" if r.hint else "")
                 for r in bad]
        return f"{self.model_type} ({self.mode}) does not fit {self.machine}: " + "; ".join(parts)

    def check(self) -> None:
        """Raise PlanError (one line + .plan_text) when a resource does not fit."""
        if not self.fits:
            raise PlanError(self.summary(), self.to_text())

    def to_text(self) -> str:
        head = (f"memory plan — {self.model_type}, {self.mode}, experts {self.expert_format} "
                f"({self.expert_bytes / 2**20:.2f} MiB each), {self.device} {self.dtype}, "
                f"ctx {self.ctx} × batch {self.batch}, {self.machine}")
        lines = [head, f"  {'resource':<26}{'steady':>12}{'load peak':>12}{'has':>12}  verdict"]
        for r in self.resources:
            has = "—" if r.available_bytes is None else _gib(r.available_bytes)
            lines.append(f"  {r.name:<26}{_gib(r.steady_bytes):>12}{_gib(r.peak_bytes):>12}{has:>12}  {r.verdict}"
                         + (f" — {r.hint}" if r.hint else ""))
            if r.parts:
                lines.append("      " + "; ".join(f"{k} {_gib(v)}" for k, v in r.parts.items()))
            if r.note:
                lines.append(f"      {r.note}")
        lines += [f"  note: {n}" for n in self.notes]
        lines.append(f"  {'fits' if self.fits else 'DOES NOT FIT'}: {self.summary()}")
        return "\n".join(lines)


def _gib(n: int | None) -> str:
    if n is None:
        return "unlimited"
    return f"{n / GIB:.2f} GiB" if n >= GIB // 4 or n == 0 else (f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB")


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def verdict(need: int, have: int | None) -> str:
    if have is None:
        return "fits"
    return "fits" if need <= TIGHT * have else "tight" if need <= have else "does not fit"


def memlock_limit() -> int | None:
    """This process's RLIMIT_MEMLOCK soft limit in bytes (None: unlimited)."""
    soft, _ = _resource.getrlimit(_resource.RLIMIT_MEMLOCK)
    return None if soft == _resource.RLIM_INFINITY or soft < 0 else int(soft)


@dataclass(frozen=True)
class Machine:
    name: str
    gpu_bytes: int | None  # None: no GPU resource (CPU device)
    host_bytes: int
    unified: bool  # GPU and host share one memory (Jetson)
    reserve_bytes: int  # device workspace (activations, allocator slack)
    memlock_bytes: int | None  # None: unlimited


def machine_for(device: str, profile: Profile | None, opts: OffloadOptions) -> Machine:
    """What the planned machine has: the profile's GPU and RAM, else this machine's free memory."""
    memlock = int(opts.pin_limit_gib * GIB) if opts.pin_limit_gib is not None else memlock_limit()
    budget = int(opts.gpu_budget_gib * GIB) if opts.gpu_budget_gib is not None else None
    if profile is not None:
        if device == "cuda" and not profile.gpu_memory_gib:
            raise ConfigError(f"profile {profile.name} has no GPU ([gpu] memory_gib = 0); plan with --device cpu")
        host = int(profile.host_memory_gib * GIB) if profile.host_memory_gib else psutil.virtual_memory().available
        gpu = budget if budget is not None else int(profile.gpu_memory_gib * GIB)
        reserve = opts.reserve_gib if opts.reserve_gib is not None else profile.reserve_gib
        return Machine(f"profile {profile.name}", gpu if device == "cuda" else None, host,
                       profile.unified_memory and device == "cuda", int(reserve * GIB) if device == "cuda" else 0,
                       memlock)
    host = psutil.virtual_memory().available
    if device != "cuda":
        return Machine("this machine", None, host, False, 0, memlock)
    if not torch.cuda.is_available():
        what = "in this torch build" if torch.version.cuda is None else "(no CUDA device is visible)"
        raise ConfigError(f"CUDA is not available {what}; use --profile to plan for a GPU machine")
    free, _ = torch.cuda.mem_get_info()
    reserve = opts.reserve_gib if opts.reserve_gib is not None else 0.5
    return Machine("this machine", budget if budget is not None else int(free), host, False, int(reserve * GIB), memlock)


def choose_device(device: str | None, profile: Profile | None) -> str:
    """--device, else the profile's kind of machine, else cuda when this torch sees a GPU."""
    if device is not None:
        dev = str(device).lower()
        if dev.split(":")[0] not in ("cpu", "cuda"):
            raise ConfigError(f"--device {device!r} is not supported (cpu or cuda)")
        return dev.split(":")[0]
    if profile is not None:
        return "cuda" if profile.gpu_memory_gib else "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def choose_dtype(dtype: str | None, device: str, cfg: ModelConfig, file_bytes: int | None = None) -> torch.dtype:
    """--dtype, else the dtype the Engine would load in (build.default_dtype: bf16 on CUDA; on a CPU
    a bf16 checkpoint's bf16 where the CPU has native bf16, else fp32 for checkpoints up to 2 GiB,
    else the checkpoint's own 16-bit dtype). The checkpoint's size
    is file_bytes, or its parameters at the config's dtype when the weights are not here (`info` on
    a config alone), so a 60 GB model is planned in bf16 as it loads, not in fp32."""
    if dtype is None:
        from ..build import default_dtype
        from ..modelinfo import bytes_per_param, param_counts

        if file_bytes is None:
            file_bytes = int(param_counts(cfg)["total"] * bytes_per_param(cfg.torch_dtype))
        return default_dtype(torch.device(device), cfg, file_bytes)
    name = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(dtype.lower(), dtype.lower())
    if name not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not supported (float32, bfloat16 or float16)")
    return DTYPES[name]


def expert_block_bytes(cfg: ModelConfig, dtype: torch.dtype, four_bit: bool, group: int, sym: bool,
                       offload: bool = False) -> tuple[str, int]:
    """(format name, bytes of one expert block) as the store and the stacked experts hold them."""
    D, I = cfg.hidden_size, cfg.moe_intermediate_size
    from ..models.transformer import family_of

    own = getattr(family_of(cfg), "expert_block_bytes", None)  # a family with its own expert format (gpt-oss)
    if own is not None:
        if offload:  # the store's block: the same parts at 128-byte aligned offsets
            from .biased import family_format

            fmt = family_format(cfg, dtype, four_bit)
            if fmt is not None:
                return fmt.name, fmt.nbytes
        return own(cfg, dtype, four_bit)
    if four_bit:
        from ..quant.int4 import Int4Layout

        return "int4", Int4Layout(D, I, group, sym).nbytes
    from .store import DenseFormat

    name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    return name, DenseFormat(name, D, I).nbytes


def non_expert_bytes(cfg: ModelConfig, elem: int, int4_attn: bool = False, int8_head: bool = False,
                     group: int = 128) -> int:
    """Bytes of every weight except the routed experts, as the family's modules allocate them
    (counted on the meta device: a weight in the model dtype at `elem` bytes, one a module keeps in
    another dtype, such as LFM2's fp32 expert bias, at its own). int4_attn: the projections
    models.layers.int4_projections picks count as packed INT4 (half a byte a weight, an fp16 scale per
    group; biases stay); int8_head: the head as int8 rows with fp32 scales (an untied lm_head's 16-bit
    weight freed, a tied one kept: it is the embedding) — both as a CPU with the native kernels holds them."""
    from ..models.layers import int4_projections
    from ..models.transformer import meta_model

    dt = torch.bfloat16
    model = meta_model(cfg)
    total = sum(p.numel() * (elem if p.dtype is dt else p.element_size())
                for n, p in model.named_parameters() if ".mlp.experts." not in n)
    for _, _, lin, g in int4_projections(model, group) if int4_attn else ():
        out_f, in_f = lin.weight.shape
        total += out_f * in_f // 2 + out_f * (in_f // g) * 2 - lin.weight.numel() * elem
    if int8_head:
        V, D = model.head_weight().shape
        total += V * D + V * 4 - (V * D * elem if model.lm_head is not None else 0)
    return total


def offload_slots(budget: int, fixed: int, scratch: int, eb: int, total: int) -> int:
    """Expert slots the device budget holds after `fixed` bytes and `scratch` transient slots
    (negative room → 0; the caller reports it)."""
    room = budget - fixed - scratch * eb
    return max(0, min(total, room // eb)) if room >= 0 else 0


def plan_memory(cfg: ModelConfig, *, device: str, dtype: torch.dtype, offload: bool, int4: bool,
                quant: QuantInfo | None = None, ctx: int, batch: int = 1, opts: OffloadOptions | None = None,
                profile: Profile | str | None = None, file_bytes: int | None = None, int4_attn: bool = False,
                int8_head: bool = False) -> MemoryPlan:
    """The memory plan of loading `cfg` this way (module doc); never raises for a plan that does
    not fit (see MemoryPlan.check), only for bad input (ConfigError). file_bytes: the checkpoint's
    size on disk when known (else estimated from the config) for the page-cache line. int4_attn /
    int8_head (`--int4-attn`, `--int8-head`): on a CPU, the non-expert weights as those flags hold them."""
    from .hints import add_hints

    args = dict(device=device, dtype=dtype, offload=offload, int4=int4, quant=quant, ctx=ctx, batch=batch,
                opts=opts or OffloadOptions(), profile=load_profile(profile) if isinstance(profile, str) else profile,
                file_bytes=file_bytes, int4_attn=int4_attn, int8_head=int8_head)
    plan = build(cfg, **args)
    add_hints(plan, cfg, args)
    return plan


def build(cfg: ModelConfig, *, device, dtype, offload, int4, quant, ctx, batch, opts, profile, file_bytes,
          int4_attn=False, int8_head=False) -> MemoryPlan:
    """plan_memory without hints (the hint search calls this for alternatives)."""
    dev = torch.device(device).type
    if dev not in ("cpu", "cuda"):
        raise ConfigError(f"device {device!r} is not supported (cpu or cuda)")
    if ctx < 1 or batch < 1:
        raise ConfigError(f"ctx ({ctx}) and batch ({batch}) must be ≥ 1")
    m = machine_for(dev, profile, opts)
    four = four_bit(quant) or int4
    group, sym = (quant.group_size, quant.sym) if four_bit(quant) else (opts.int4_group, True)
    D, I, E, K = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.top_k
    fp8 = quant is not None and quant.method == "fp8"
    if fp8 and not four and offload and fp8_experts_fit(D, I, quant.weight_block):
        from .store import Fp8Format

        fmt, eb = "fp8", Fp8Format(D, I, quant.weight_block).nbytes  # the store keeps the checkpoint's bytes
    elif fp8 and not four and dev == "cpu" and fp8_experts_fit(D, I, quant.weight_block):
        fmt, eb = "fp8", Fp8MoEExperts.nbytes(D, I, quant.weight_block)  # read 8-bit by the native kernel
    else:  # an FP8 checkpoint elsewhere: experts dequantised at load, as 16-bit (or --int4) ones
        fmt, eb = expert_block_bytes(cfg, dtype, four, group, sym, offload)
    L = len(cfg.moe_layer_ids)
    total, experts = L * E, L * E * eb
    elem = dtype.itemsize
    ckpt_elem = DTYPES.get(str(cfg.torch_dtype).replace("torch.", ""), torch.bfloat16).itemsize
    layer16 = E * 3 * D * I * ckpt_elem  # one layer's experts as they stream from a float checkpoint
    # a 4-bit checkpoint's quantized non-expert linears: dequantized; --int4-attn / --int8-head: a CPU's only
    int4_attn, int8_head = int4_attn and dev == "cpu", int8_head and dev == "cpu"
    ne = non_expert_bytes(cfg, elem, int4_attn, int8_head, opts.int4_group)
    swa_full = opts.swa_full
    kv = KVCache.bytes_needed(cfg, batch, ctx, dtype, swa_full)
    if fp8:
        mode = "fp8" + ("+int4" if int4 else "") + ("+offload" if offload else "")
    else:
        mode = (f"{quant.method}-4bit" if quant else "int4" if int4 else "plain") if not offload else \
            (f"{quant.method}-4bit+offload" if quant else "offload+int4" if int4 else "offload")
    resources, notes, slots = [], [], None
    pow2 = L * next_pow2(E * eb) + next_pow2(opts.staging_slots * eb) if dev == "cuda" and offload else None
    state = batch * KVCache.state_bytes(cfg, dtype)  # linear-attention / conv state: per row, not per token
    kv_name = f"KV cache (B={batch}, ctx={ctx})" if not state else \
        f"KV cache + sequence state (B={batch}, ctx={ctx}; state {_gib(state)})"
    rings = [R for _, R in layer_specs(cfg, ctx, swa_full) if R]
    if rings:  # sliding-window layers keep a ring, not the context (kv_cache.py; --swa-full: all of it)
        kv_name = kv_name[:-1] + f"; {len(rings)} sliding-window layers keep a ring of {rings[0]} positions)"
    fixed = {"non-expert weights": ne, kv_name: kv}
    host_parts: dict[str, int] = {}
    if dev == "cuda":
        dev_parts = {**fixed, "workspace reserve": m.reserve_bytes}
        base = ne + kv + m.reserve_bytes
        if offload:
            scratch = opts.scratch_slots if opts.scratch_slots is not None else K
            slots = min(opts.expert_slots, total) if opts.expert_slots is not None else \
                offload_slots(m.gpu_bytes, base, scratch, eb, total)
            if slots == total and opts.expert_slots is None:
                scratch = 0  # everything is resident: nothing is ever fetched into scratch
            dev_parts[f"expert slots ({slots} of {total})"] = slots * eb
            dev_parts[f"scratch slots ({scratch})"] = scratch * eb
            minimum = base + scratch * eb + (slots * eb if opts.expert_slots is not None else 0)
            host_parts = {f"expert store ({total} × {eb / 2**20:.2f} MiB)": experts,
                          f"staging ring ({opts.staging_slots})": opts.staging_slots * eb}
            per_tok = L * K * (1 - slots / total) * eb
            notes.append(f"expected host→device per token at B=1: {per_tok / 2**20:.1f} MiB "
                         "(uniform routing, cache holding a random subset; not measured)")
        else:
            dev_parts["all experts"] = experts
            minimum = None
        dev_need = sum(dev_parts.values())
        host_need = sum(host_parts.values())
        host_peak = int(LOAD_SLACK * (host_need + layer16))
        if m.unified:
            need, peak = dev_need + host_need, dev_need + host_peak
            resources.append(Resource("unified", "unified memory (GPU + host)", need, peak, m.host_bytes,
                                      verdict(max(need, peak), m.host_bytes), parts={**dev_parts, **host_parts},
                                      note="GPU and CPU share this memory"))
        else:
            resources.append(Resource("gpu", "GPU memory", dev_need, dev_need, m.gpu_bytes,
                                      verdict(minimum or dev_need, m.gpu_bytes), minimum_bytes=minimum,
                                      parts=dev_parts, note="the expert cache takes the rest of the budget"
                                      if offload and opts.expert_slots is None else ""))
            resources.append(Resource("host", "host RAM", host_need, host_peak, m.host_bytes,
                                      verdict(host_peak, m.host_bytes), parts=host_parts,
                                      note="load peak: final + one layer's 16-bit experts, + 10%"))
            if offload and opts.pin != "off":
                resources.append(_pinned(host_need, m.memlock_bytes))
                notes.append(f"pinned exactly (one cudaHostRegister block per layer): {_gib(host_need)}; "
                             f"pin_memory=True would have pinned next_pow2 per layer = {_gib(pow2)} "
                             "(PyTorch's caching host allocator rounds up, pytorch#150517)")
    else:
        host_parts = {**fixed, ("expert store" if offload else "all experts"): experts}
        need = sum(host_parts.values())
        peak = int(LOAD_SLACK * (need + layer16))
        resources.append(Resource("host", "host RAM", need, peak, m.host_bytes, verdict(peak, m.host_bytes),
                                  parts=host_parts, note="CPU device: weights, experts and KV live here; "
                                  "load peak: final + one layer's 16-bit experts, + 10%"))
        if offload:
            notes.append("offload on a CPU device: experts are served from the host store (no slot copies)")
    fb = file_bytes if file_bytes is not None else _file_estimate(cfg, ckpt_elem, quant, eb, total)
    resources.append(Resource("page_cache", "page cache (reclaimable)", fb, fb, None, "info",
                              note="the checkpoint's mmap: file-backed, the OS drops it under pressure; "
                                   "not counted in host RAM" + ("" if file_bytes is not None else " (estimated)")))
    if int4_attn or int8_head:
        notes.append("non-expert weights with " + " and ".join(
            f for f, on in ((f"--int4-attn (attention / dense projections INT4, group {opts.int4_group})", int4_attn),
                            ("--int8-head (the output head int8 rows)", int8_head)) if on)
                     + ", as the native CPU kernels hold them")
    if fp8:
        notes.append(f"fp8 checkpoint (e4m3, {quant.weight_block[0]}×{quant.weight_block[1]} blocks): experts "
                     + (("stored 8-bit in the offload store" if offload else "read 8-bit by the native CPU kernel")
                        if fmt == "fp8" else f"dequantized at load to {fmt}")
                     + f"; the other FP8 linears are dequantized at load to {_name(dtype)}")
    elif quant is not None:
        where = ("on a CPU with the native kernels they stay 4-bit (quant/linear.py), so this is an upper "
                 "bound" if dev == "cpu" else "they are dequantized at load")
        notes.append(f"{quant.method} checkpoint: experts stay 4-bit (g{quant.group_size}, "
                     f"{'sym' if quant.sym else 'asym'}); quantized non-expert linears are counted at "
                     f"{_name(dtype)} ({where})")
    return MemoryPlan(cfg.model_type, mode, dev, _name(dtype), fmt, eb, total, slots, ctx, batch, m.name,
                      resources, notes, pow2)


def _pinned(need: int, limit: int | None) -> Resource:
    if limit is None or need <= limit:
        return Resource("pinned", "pinned host memory", need, need, limit, "fits",
                        note="expert store + staging ring, pinned exactly (inside host RAM)")
    return Resource("pinned", "pinned host memory", need, need, limit, "limited",
                    hint=f"raise the memlock limit (ulimit -l) to ≥ {_gib(need)} or unlimited",
                    note=f"pinned memory limited to {_gib(limit)}: the rest is pageable + staging ring, slower")


def _file_estimate(cfg: ModelConfig, ckpt_elem: int, quant: QuantInfo | None, eb: int, total: int) -> int:
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    experts = total * per_expert if quant is not None and quant.method == "fp8" else total * eb if quant \
        else total * per_expert * ckpt_elem
    return non_expert_bytes(cfg, ckpt_elem) + experts


def _name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


__all__ = ["MemoryPlan", "PlanError", "QuantInfo", "Resource", "build", "choose_device", "choose_dtype", "machine_for", "memlock_limit",
           "next_pow2", "non_expert_bytes", "offload_slots", "plan_memory", "verdict"]
