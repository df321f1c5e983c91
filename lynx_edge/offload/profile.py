"""Hardware profiles: the figures the planner and the cost model use (memory, PCIe, CPU speed).

A profile is a small TOML file with four tables, e.g. lynx_edge/offload/profiles/rtx4090-24gb.toml:

    name = "rtx4090-24gb"
    [gpu]     memory_gib, hbm_gbps, tflops, unified_memory, match = ["4090"]
    [link]    h2d_pinned_gbps, h2d_pageable_gbps, latency_us
    [cpu]     mem_gbps, expert_gbps, gflops, latency_us
    [offload] policy = "lynx" | "lru", reserve_gib
    [host]    memory_gib (the machine's RAM: what `info --profile` plans host memory against)

`load_profile` takes a bundled name or a path; unknown keys and impossible values are one-line
`ProfileError`s. `calibrate` measures this machine and returns a Profile (`save` writes it).
"""
from __future__ import annotations

import math
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from ..config import ConfigError

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
POLICIES = ("lru", "lynx")


class ProfileError(ConfigError):
    """A profile lynx-edge cannot use (unknown name or key, impossible value)."""


@dataclass(frozen=True)
class Profile:
    name: str
    gpu_memory_gib: float  # 0 = no GPU (the CPU stands in for the device)
    gpu_hbm_gbps: float  # device memory bandwidth: expert GEMVs on the GPU read weights at this rate
    gpu_tflops: float  # dense bf16 matmul throughput
    h2d_pinned_gbps: float  # host→device from pinned memory
    h2d_pageable_gbps: float  # host→device from pageable memory (driver-staged)
    cpu_mem_gbps: float  # host memory copy bandwidth
    cpu_expert_gbps: float  # weight bytes/s a CPU expert streams at 1 token (memory-bound GEMV)
    cpu_gflops: float  # CPU matmul throughput at many tokens
    description: str = ""
    unified_memory: bool = False  # GPU and CPU share memory (Jetson, CPU-only)
    gpu_match: tuple[str, ...] = ()  # substrings of torch.cuda.get_device_name that pick this profile
    link_latency_us: float = 10.0  # fixed cost per host→device copy
    cpu_latency_us: float = 50.0  # fixed cost per CPU expert call (activation round trip, dispatch)
    policy: str = "lynx"  # default cache policy
    reserve_gib: float = 0.5  # GPU memory kept free for activations and allocator slack
    host_memory_gib: float | None = None  # the machine's RAM; None: unknown (plans use this host's)
    # code bytes/s of an INT4 host-store expert at 1 token (the native kernel, its default activations):
    # per byte slower than a 16-bit expert's stream (the rows are bound by their vector ops); None:
    # cpu_expert_gbps stands in
    cpu_int4_expert_gbps: float | None = None

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(to_toml(self))
        return path


# TOML table → key → (Profile field, kind, required). kind: float (>0), float0 (≥0), bool, str, list
_SCHEMA: dict[str, dict[str, tuple[str, str, bool]]] = {
    "": {"name": ("name", "str", True), "description": ("description", "str", False)},
    "gpu": {"memory_gib": ("gpu_memory_gib", "float0", True), "hbm_gbps": ("gpu_hbm_gbps", "float", True),
            "tflops": ("gpu_tflops", "float", True), "unified_memory": ("unified_memory", "bool", False),
            "match": ("gpu_match", "list", False)},
    "link": {"h2d_pinned_gbps": ("h2d_pinned_gbps", "float", True),
             "h2d_pageable_gbps": ("h2d_pageable_gbps", "float", True),
             "latency_us": ("link_latency_us", "float0", False)},
    "cpu": {"mem_gbps": ("cpu_mem_gbps", "float", True), "expert_gbps": ("cpu_expert_gbps", "float", True),
            "gflops": ("cpu_gflops", "float", True), "latency_us": ("cpu_latency_us", "float0", False),
            "int4_expert_gbps": ("cpu_int4_expert_gbps", "float", False)},
    "offload": {"policy": ("policy", "str", False), "reserve_gib": ("reserve_gib", "float0", False)},
    "host": {"memory_gib": ("host_memory_gib", "float", False)},
}
_MAX = 1e6  # no memory (GiB), bandwidth (GB/s) or rate beyond this is physical


def _value(where: str, key: str, kind: str, v):
    if kind == "str":
        if not isinstance(v, str):
            raise ProfileError(f"{where}{key} must be a string, got {v!r}")
        return v
    if kind == "bool":
        if not isinstance(v, bool):
            raise ProfileError(f"{where}{key} must be true or false, got {v!r}")
        return v
    if kind == "list":
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise ProfileError(f"{where}{key} must be a list of strings, got {v!r}")
        return tuple(v)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ProfileError(f"{where}{key} must be a number, got {v!r}")
    if (kind == "float" and v <= 0) or v < 0 or v > _MAX:
        bound = "> 0" if kind == "float" else "≥ 0"
        raise ProfileError(f"{where}{key} = {v} is impossible (must be {bound} and ≤ {_MAX:g})")
    return float(v)


def profile_from_dict(data: dict, source: str = "profile") -> Profile:
    """Validate a parsed TOML document → Profile; any problem is one ProfileError line."""
    kw: dict = {}
    try:
        for table, value in data.items():
            if isinstance(value, dict):
                if table not in _SCHEMA or not table:
                    raise ProfileError(f"unknown table [{table}] (known: gpu, link, cpu, offload, host)")
                items, prefix = value.items(), f"[{table}] "
            elif table in _SCHEMA[""]:
                items, prefix, table = [(table, value)], "", ""
            else:
                raise ProfileError(f"unknown key {table!r} (known top-level keys: name, description)")
            for key, v in items:
                if key not in _SCHEMA[table]:
                    raise ProfileError(f"unknown key {prefix}{key} (known: {', '.join(_SCHEMA[table])})")
                attr, kind, _ = _SCHEMA[table][key]
                kw[attr] = _value(prefix, key, kind, v)
        for table, keys in _SCHEMA.items():
            for key, (attr, _, required) in keys.items():
                if required and attr not in kw:
                    raise ProfileError(f"missing key {f'[{table}] ' if table else ''}{key}")
        if kw.get("policy", "lynx") not in POLICIES:
            raise ProfileError(f"[offload] policy {kw['policy']!r} is unknown (use {' or '.join(POLICIES)})")
        if kw["gpu_memory_gib"] and kw.get("reserve_gib", 0.5) >= kw["gpu_memory_gib"]:
            raise ProfileError("[offload] reserve_gib must be smaller than [gpu] memory_gib")
    except ProfileError as exc:
        raise ProfileError(f"{source}: {exc}") from None
    return Profile(**kw)


def list_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def load_profile(name_or_path: str | Path) -> Profile:
    """A bundled profile by name ("rtx4090-24gb") or a TOML file by path."""
    text = str(name_or_path)
    path = Path(text)
    if not (path.suffix == ".toml" or "/" in text or "\\" in text):
        path = PROFILE_DIR / f"{text}.toml"
        if not path.is_file():
            raise ProfileError(f"unknown profile {text!r}; bundled: {', '.join(list_profiles())} (or give a .toml path)")
    if not path.is_file():
        raise ProfileError(f"{path}: profile file not found")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{path}: not valid TOML ({exc})") from None
    return profile_from_dict(data, str(path))


def detect_profile(device: torch.device | str | None = None) -> Profile:
    """The bundled profile matching this device (by GPU name), cpu-only for a CPU device, else
    a measured one (quick calibration)."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type != "cuda":
        return load_profile("cpu-only")
    gpu = torch.cuda.get_device_name(dev).lower()
    for name in list_profiles():
        prof = load_profile(name)
        if any(m.lower() in gpu for m in prof.gpu_match):
            return prof
    return calibrate(name="detected", device=dev)


def to_toml(p: Profile) -> str:
    """Profile → TOML text in the bundled files' layout."""
    def fmt(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, tuple):
            return "[" + ", ".join(fmt(s) for s in v) + "]"
        return f"{v:.6g}"

    lines = []
    for table, keys in _SCHEMA.items():
        vals = [(key, getattr(p, attr)) for key, (attr, _, _) in keys.items()]
        vals = [(k, v) for k, v in vals if v is not None]  # an optional key left unset is not written
        if table and vals:
            lines.append(f"\n[{table}]")
        lines += [f"{key} = {fmt(v)}" for key, v in vals]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- calibration


def _best(fn, reps: int) -> float:
    fn()  # warm-up
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_cpu(size_mb: int = 256, hidden: int = 2048, inter: int = 1408, reps: int = 3) -> dict:
    """Host copy bandwidth, CPU expert weight-streaming rate (1 token) and matmul GFLOP/s (64
    tokens), measured on the path a Fiddler-style CPU expert takes: a bf16 host-store block
    through DenseFormat.compute (the native kernel where it built, else torch); and where the INT4
    kernel built, an INT4 block's rate at 1 token through Int4Format.compute (code bytes/s)."""
    from ..quant import cpu_kernels
    from .store import DenseFormat, Int4Format

    n = size_mb * 2**20 // 4
    a, b = torch.ones(n), torch.empty(n)
    mem = 2 * a.nbytes / _best(lambda: b.copy_(a), reps)  # read + write
    fmt, tiny = DenseFormat("bf16", hidden, inter), DenseFormat("bf16", 64, 64)
    blocks = torch.zeros(max(2, 64 * 2**20 // fmt.nbytes), fmt.nbytes, dtype=torch.uint8)  # ≥ 64 MiB: not cache-resident
    g = torch.Generator().manual_seed(0)
    fmt.pack_into(blocks, torch.randn(1, 2 * inter, hidden, generator=g) * 0.02,
                  torch.randn(1, hidden, inter, generator=g) * 0.02)
    blocks[1:] = blocks[0]
    x1, x64 = torch.randn(1, hidden, generator=g), torch.randn(64, hidden, generator=g)
    it = iter(range(1 << 62))
    expert = fmt.nbytes / _best(lambda: fmt.compute(blocks[next(it) % len(blocks)], x1), reps * 3)
    flops = 64 * 2 * 3 * hidden * inter / _best(lambda: fmt.compute(blocks[0], x64), reps * 3)
    small, x0 = torch.zeros(tiny.nbytes, dtype=torch.uint8), x1[:, :64].contiguous()
    latency = _best(lambda: tiny.compute(small, x0), reps * 10)  # fixed cost of one tiny expert call
    out = {"cpu_mem_gbps": mem / 1e9, "cpu_expert_gbps": expert / 1e9, "cpu_gflops": flops / 1e9,
           "cpu_latency_us": latency * 1e6}
    if cpu_kernels.available():
        f4 = Int4Format(hidden, inter)
        b4 = torch.zeros(max(2, 64 * 2**20 // f4.nbytes), f4.nbytes, dtype=torch.uint8)  # ≥ 64 MiB, as above
        f4.pack_into(b4[:1], torch.randn(1, 2 * inter, hidden, generator=g) * 0.02,
                     torch.randn(1, hidden, inter, generator=g) * 0.02)
        b4[1:] = b4[0]
        out["cpu_int4_expert_gbps"] = f4.nbytes / _best(lambda: f4.compute(b4[next(it) % len(b4)], x1), reps * 3) / 1e9
    return out


def measure_cuda(device: torch.device, size_mb: int = 256, reps: int = 3) -> dict:
    """Pinned and pageable host→device bandwidth, device copy bandwidth, bf16 matmul TFLOP/s."""
    def timed(fn) -> float:
        def run():
            fn()
            torch.cuda.synchronize(device)
        return _best(run, reps)

    n = size_mb * 2**20
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(n, dtype=torch.uint8)
    dst = torch.empty(n, dtype=torch.uint8, device=device)
    dst2 = torch.empty_like(dst)
    h2d = n / timed(lambda: dst.copy_(pinned, non_blocking=True))
    h2d_pg = n / timed(lambda: dst.copy_(pageable))
    hbm = 2 * n / timed(lambda: dst2.copy_(dst))
    m = torch.randn(4096, 4096, dtype=torch.bfloat16, device=device)
    tflops = 2 * 4096**3 / timed(lambda: m @ m)
    small = torch.empty(4096, dtype=torch.uint8, pin_memory=True)
    latency = timed(lambda: dst[:4096].copy_(small, non_blocking=True))  # fixed cost of one copy
    total = torch.cuda.get_device_properties(device).total_memory
    return {"h2d_pinned_gbps": h2d / 1e9, "h2d_pageable_gbps": h2d_pg / 1e9, "gpu_hbm_gbps": hbm / 1e9,
            "gpu_tflops": tflops / 1e12, "gpu_memory_gib": total / 2**30, "link_latency_us": latency * 1e6}


def calibrate(name: str = "this-machine", device: torch.device | str | None = None, size_mb: int = 256,
              save_to: str | Path | None = None) -> Profile:
    """Measure this machine → Profile (written to save_to when given). A CPU device (or no CUDA)
    gives a unified-memory profile whose 'host→device' rate is the host copy rate."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cpu = measure_cpu(size_mb)
    if dev.type == "cuda":
        gpu = measure_cuda(dev, size_mb)
        desc = f"calibrated on {torch.cuda.get_device_name(dev)}"
        kw = dict(unified_memory=False)
    else:
        copy = cpu["cpu_mem_gbps"] / 2
        gpu = {"h2d_pinned_gbps": copy, "h2d_pageable_gbps": copy, "gpu_hbm_gbps": cpu["cpu_mem_gbps"],
               "gpu_tflops": cpu["cpu_gflops"] / 1e3, "gpu_memory_gib": 0.0, "link_latency_us": 1.0}
        desc, kw = "calibrated on the CPU (no GPU: the CPU stands in for the device)", dict(unified_memory=True)
    vals = {k: float(f"{v:.4g}") for k, v in {**cpu, **gpu}.items()}
    host = float(f"{psutil.virtual_memory().total / 2**30:.4g}")
    prof = Profile(name=name, description=desc, reserve_gib=0.5 if dev.type == "cuda" else 0.0,
                   host_memory_gib=host, **kw, **vals)
    profile_from_dict(tomllib.loads(to_toml(prof)), name)  # the written file must load back
    if save_to is not None:
        prof.save(save_to)
    return prof


__all__ = ["POLICIES", "PROFILE_DIR", "Profile", "ProfileError", "calibrate", "detect_profile", "list_profiles",
           "load_profile", "profile_from_dict", "to_toml"]
