"""OffloadOptions: everything a caller (Engine, CLI, benchmarks) can choose about offloading."""
from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError

_PIN = ("auto", "on", "off")
_CPU = ("auto", "never", "always")
_FORMATS = ("auto", "bf16", "fp16", "fp32", "int4", "fp8")


@dataclass
class OffloadOptions:
    enabled: bool = True
    device: str | None = None  # where attention/KV/slots live; None: the model's device
    gpu_budget_gib: float | None = None  # memory for weights + KV + slots; None: free memory / profile
    expert_slots: int | None = None  # fixed number of cached experts (over all layers); overrides the budget
    policy: str | None = None  # lru | lynx; None: the profile's default
    profile: str | None = None  # bundled name or .toml path; None: detected from the device
    lynx: str | None = None  # residency-aware LYNX mode to install ("lynx", "off", …); None: keep the router
    cpu_compute: str = "auto"  # misses: auto (cost model) | never (always fetch) | always (Fiddler-style)
    prefetch: bool = False  # fetch the next layer's likely experts (next router on this hidden state)
    pin: str = "auto"  # pinned host memory: auto (when CUDA) | on | off
    pin_limit_gib: float | None = None  # pin at most this much; the rest is pageable + staging ring
    staging_slots: int = 2  # pinned staging ring for pageable experts (in experts)
    scratch_slots: int | None = None  # transient device slots for experts not admitted (default K)
    expert_format: str = "auto"  # auto (the model's dtype) | bf16 | fp16 | fp32 | int4 | fp8 (an FP8 checkpoint's own)
    int4_group: int = 128
    batch: int = 1  # KV cache the caller will allocate, for the plan
    ctx: int = 4096
    swa_full: bool = False  # sliding-window layers' KV: the full context (True) or a ring (kv_cache.py), for the plan
    reserve_gib: float | None = None  # workspace kept free on the device; None: the profile's

    def __post_init__(self) -> None:
        if self.policy is not None and self.policy not in ("lru", "lynx"):
            raise ConfigError(f"offload policy {self.policy!r} is unknown (use lru or lynx)")
        if self.pin not in _PIN:
            raise ConfigError(f"pin {self.pin!r} is unknown (use {', '.join(_PIN)})")
        if self.cpu_compute not in _CPU:
            raise ConfigError(f"cpu_compute {self.cpu_compute!r} is unknown (use {', '.join(_CPU)})")
        if self.expert_format not in _FORMATS:
            raise ConfigError(f"expert_format {self.expert_format!r} is unknown (use {', '.join(_FORMATS)})")
        for name in ("gpu_budget_gib", "pin_limit_gib", "reserve_gib"):
            v = getattr(self, name)
            if v is not None and not v >= 0:
                raise ConfigError(f"{name} must be ≥ 0, got {v}")
        if self.staging_slots < 1 or self.batch < 1 or self.ctx < 1:
            raise ConfigError("staging_slots, batch and ctx must be ≥ 1")
        if self.expert_slots is not None and self.expert_slots < 0:
            raise ConfigError(f"expert_slots must be ≥ 0, got {self.expert_slots}")


__all__ = ["OffloadOptions"]
