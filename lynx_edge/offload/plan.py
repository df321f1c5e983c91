"""Placement plan: what goes on the GPU and what stays in host memory, decided from shapes alone.

Non-expert weights (embeddings, attention, routers, norms, shared experts, dense MLPs), the KV
cache the caller asks for and a workspace reserve go on the GPU; the rest of the GPU budget
becomes expert slots; every expert lives in host memory (pinned where the OS allows, else
pageable plus a small pinned staging ring). `make_plan` loads no weights and decides the slots;
whether the whole load fits (GPU, host RAM, pinned, load peak) is `plan_memory`'s verdict
(offload/memory.py, re-exported here). Glossary: B batch, D hidden, E experts, K top-k, I intermediate.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import psutil
import torch

from ..config import ModelConfig
from ..kv_cache import KVCache
from .memory import MemoryPlan, PlanError, QuantInfo, Resource, non_expert_bytes, offload_slots, plan_memory
from .options import OffloadOptions
from .profile import Profile, detect_profile, load_profile
from .store import store_format

GIB = 2**30


@dataclass
class Plan:
    model_type: str
    device: str
    dtype: str  # non-expert weights and KV
    expert_format: str  # bf16 | fp16 | fp32 | int4
    profile: str
    policy: str
    num_moe_layers: int
    num_experts: int  # E per MoE layer
    top_k: int
    expert_bytes: int  # one expert's contiguous block
    non_expert_bytes: int
    kv_bytes: int
    reserve_bytes: int
    budget_bytes: int | None  # GPU memory the plan may use (None: unbounded, the CPU stands in)
    expert_slots: int  # cached experts on the device (over all layers)
    scratch_slots: int  # transient device slots for experts the cache does not admit
    host_expert_bytes: int
    host_available_bytes: int
    pin: str  # auto | on | off
    pin_limit_bytes: int | None
    staging_slots: int  # pinned staging ring (used only for experts left in pageable memory)
    batch: int
    ctx: int
    pcie_gbps: float
    warnings: list[str] = field(default_factory=list)

    @property
    def total_experts(self) -> int:
        return self.num_moe_layers * self.num_experts

    @property
    def fits_all(self) -> bool:
        return self.expert_slots >= self.total_experts

    @property
    def device_bytes(self) -> int:
        slots = (self.expert_slots + self.scratch_slots) * self.expert_bytes
        return self.non_expert_bytes + self.kv_bytes + self.reserve_bytes + slots

    def expected_bytes_per_step(self, batch: int) -> float:
        """Host→device bytes per decode step, uniform routing, cache holding a random fraction f
        of all experts: layers · E·(1 − (1 − K/E)^B) · (1 − f) · expert bytes."""
        f = min(1.0, self.expert_slots / max(1, self.total_experts))
        unique = self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** batch)
        return self.num_moe_layers * unique * (1 - f) * self.expert_bytes

    def report(self) -> dict:
        """Dry-run report: rows (what, where, bytes, note) and a summary dict."""
        per_tok = self.expected_bytes_per_step(1)
        per_step_b = self.expected_bytes_per_step(self.batch)
        pinned = self.host_expert_bytes if self.pin_limit_bytes is None else min(self.pin_limit_bytes, self.host_expert_bytes)
        pinned = 0 if self.pin == "off" or self.device == "cpu" else pinned
        rows = [
            {"what": "non-expert weights", "where": self.device, "bytes": self.non_expert_bytes,
             "note": "embeddings, attention, routers, norms, shared/dense MLPs"},
            {"what": f"KV cache (B={self.batch}, ctx={self.ctx})", "where": self.device, "bytes": self.kv_bytes, "note": ""},
            {"what": "workspace reserve", "where": self.device, "bytes": self.reserve_bytes, "note": "activations, allocator slack"},
            {"what": f"expert slots ({self.expert_slots} of {self.total_experts})", "where": self.device,
             "bytes": self.expert_slots * self.expert_bytes, "note": f"policy {self.policy}"},
            {"what": f"scratch slots ({self.scratch_slots})", "where": self.device,
             "bytes": self.scratch_slots * self.expert_bytes, "note": "experts used once, not cached"},
            {"what": f"all experts ({self.total_experts} × {self.expert_bytes / 2**20:.2f} MiB)", "where": "host",
             "bytes": self.host_expert_bytes,
             "note": self._pin_note(pinned)},
        ]
        summary = {
            "device_bytes": self.device_bytes, "budget_bytes": self.budget_bytes,
            "host_expert_bytes": self.host_expert_bytes, "host_available_bytes": self.host_available_bytes,
            "fits_all": self.fits_all, "expert_slots": self.expert_slots,
            "expected_bytes_per_token_b1": per_tok, f"expected_bytes_per_step_b{self.batch}": per_step_b,
            "expected_tok_s_b1_pcie_bound": (self.pcie_gbps * 1e9 / per_tok) if per_tok else None,
            "label": "expected (uniform routing, PCIe-bound; not measured)",
            "warnings": list(self.warnings),
        }
        return {"rows": rows, "summary": summary, "plan": asdict(self)}

    def _pin_note(self, pinned: int) -> str:
        if self.device == "cpu":
            return "pageable (the CPU is the device: nothing to pin)"
        if pinned >= self.host_expert_bytes:
            return "pinned (attempted at load; falls back to pageable + staging ring)"
        return f"pinned {pinned / GIB:.2f} GiB, the rest pageable + staging ring"

    def to_text(self) -> str:
        """Plain-text table of report() (the CLI may render it its own way)."""
        rep = self.report()
        lines = [f"offload plan — {self.model_type}, profile {self.profile}, experts {self.expert_format}"]
        for r in rep["rows"]:
            lines.append(f"  {r['what']:<42} {r['where']:<6} {r['bytes'] / GIB:9.3f} GiB  {r['note']}")
        s = rep["summary"]
        budget = "unbounded" if s["budget_bytes"] is None else f"{s['budget_bytes'] / GIB:.3f} GiB"
        lines.append(f"  device total {s['device_bytes'] / GIB:.3f} GiB of {budget}")
        lines.append(f"  expected host→device per token at B=1: {s['expected_bytes_per_token_b1'] / 2**20:.1f} MiB "
                     f"({s['label']})")
        lines += [f"  warning: {w}" for w in s["warnings"]]
        return "\n".join(lines)


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def _budget(opts: OffloadOptions, prof: Profile, dev: torch.device) -> int | None:
    if opts.gpu_budget_gib is not None:
        return int(opts.gpu_budget_gib * GIB)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free)
    return int(prof.gpu_memory_gib * GIB) if prof.gpu_memory_gib else None


def make_plan(cfg: ModelConfig, opts: OffloadOptions | None = None, dtype: torch.dtype = torch.bfloat16,
              device: str | torch.device | None = None, profile: Profile | None = None,
              host_available: int | None = None, device_bytes_in_use: int = 0, fmt=None) -> Plan:
    """Decide placement from shapes and budgets; loads no weights. device_bytes_in_use: bytes
    already on the device that the plan accounts for itself (weights loaded before attach);
    fmt: the store format the runtime will use (default: store_format from the options)."""
    opts = opts or OffloadOptions()
    dev = torch.device(device or opts.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    prof = profile or (load_profile(opts.profile) if opts.profile else detect_profile(dev))
    fmt = fmt or store_format(cfg, opts.expert_format, dtype, opts.int4_group)
    elem = torch.empty((), dtype=dtype).element_size()
    layers, E = len(cfg.moe_layer_ids), cfg.num_experts
    total = layers * E
    kv = KVCache.bytes_needed(cfg, opts.batch, opts.ctx, dtype, opts.swa_full)
    fixed = non_expert_bytes(cfg, elem)
    reserve = int((opts.reserve_gib if opts.reserve_gib is not None else prof.reserve_gib) * GIB)
    scratch = opts.scratch_slots if opts.scratch_slots is not None else cfg.top_k
    budget = _budget(opts, prof, dev)
    if budget is not None and dev.type == "cuda" and opts.gpu_budget_gib is None:
        budget += device_bytes_in_use  # free memory + what our own weights already hold
    warnings: list[str] = []
    if opts.expert_slots is not None:
        slots = min(opts.expert_slots, total)
        if slots < 0:
            raise PlanError(f"expert_slots must be ≥ 0, got {opts.expert_slots}")
    elif budget is None:
        slots = total  # the CPU stands in for the device: every expert is "resident"
    else:
        if budget - fixed - kv - reserve - scratch * fmt.nbytes < 0:
            raise PlanError(
                f"the GPU budget of {budget / GIB:.2f} GiB does not hold the non-expert weights "
                f"({fixed / GIB:.2f} GiB) + KV cache ({kv / GIB:.2f} GiB, B={opts.batch}, ctx={opts.ctx}) + reserve "
                f"({reserve / GIB:.2f} GiB) + {scratch} scratch experts; lower ctx/batch or raise the budget")
        slots = offload_slots(budget, fixed + kv + reserve, scratch, fmt.nbytes, total)
    if budget is not None and slots == total and opts.expert_slots is None:
        scratch = 0  # everything fits: nothing is ever fetched into scratch
    if slots + scratch < cfg.top_k:
        warnings.append(f"only {slots + scratch} device expert slots (< top-k {cfg.top_k}): misses run in waves")
    host = host_available if host_available is not None else psutil.virtual_memory().available
    if total * fmt.nbytes > host:  # the memory plan (plan_memory) owns this verdict; the slot plan only notes it
        warnings.append(f"the experts need {total * fmt.nbytes / GIB:.2f} GiB of host memory, "
                        f"{host / GIB:.2f} GiB is available")
    pin_limit = int(opts.pin_limit_gib * GIB) if opts.pin_limit_gib is not None else None
    if pin_limit is not None and pin_limit < total * fmt.nbytes and opts.pin != "off":
        warnings.append("pinned memory is limited: the rest of the experts stay pageable and go through a pinned staging ring")
    link = prof.h2d_pinned_gbps if opts.pin != "off" else prof.h2d_pageable_gbps
    return Plan(
        model_type=cfg.model_type, device=dev.type, dtype=_dtype_name(dtype), expert_format=fmt.name,
        profile=prof.name, policy=opts.policy or prof.policy, num_moe_layers=layers, num_experts=E,
        top_k=cfg.top_k, expert_bytes=fmt.nbytes, non_expert_bytes=fixed, kv_bytes=kv, reserve_bytes=reserve,
        budget_bytes=budget, expert_slots=int(slots), scratch_slots=int(scratch),
        host_expert_bytes=total * fmt.nbytes, host_available_bytes=int(host), pin=opts.pin,
        pin_limit_bytes=pin_limit, staging_slots=opts.staging_slots, batch=opts.batch, ctx=opts.ctx,
        pcie_gbps=link, warnings=warnings,
    )


__all__ = ["MemoryPlan", "Plan", "PlanError", "QuantInfo", "Resource", "make_plan", "non_expert_bytes", "plan_memory"]
