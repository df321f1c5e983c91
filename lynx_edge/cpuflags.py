"""What this CPU can do, read once from /proc/cpuinfo (Linux x86; elsewhere nothing is claimed).

    cpu_flags()  # {"avx2", "avx512f", "avx512_bf16", …}
    cpu_bf16()  # native bf16 math: the CPU default dtype (build.default_dtype) and the prefill
                # GEMMs (models/layers.py) follow it
"""
from __future__ import annotations

import functools
import os

BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # x86 bf16 dot products / tiles


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The flags line of /proc/cpuinfo as a set (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_bf16() -> bool:
    """This CPU multiplies bf16 natively (x86 AVX512_BF16 or AMX-BF16): torch's bf16 GEMMs run on
    oneDNN's bf16 kernels there. $LYNX_EDGE_CPU_BF16=1/0 says so instead (Arm's BF16 extension is
    not measured yet, so it counts as absent)."""
    env = os.environ.get("LYNX_EDGE_CPU_BF16")
    if env in ("0", "1"):
        return env == "1"
    return any(f in cpu_flags() for f in BF16_FLAGS)
