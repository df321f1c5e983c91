"""Transparent huge pages for the weights a CPU decode streams.

A CPU decode step reads its weights from DRAM once per token, page after page; with 4 KiB pages
every 4 KiB costs a TLB miss and a page walk. Linux backs memory with 2 MiB pages where a range is
marked MADV_HUGEPAGE before its first touch (THP "madvise", the default of most distributions).
The model is built with its weight tensors allocated but not yet written (torch.empty), so marking
them between build and load puts the streamed-in weights on 2 MiB pages. Measured on the 2-core
VM: a 1 GiB fp32 sum at 12.1-12.6 GB/s against 10.9-11.5 GB/s on 4 KiB pages (one thread).
The price is paid at load: there a 1.28 GB model loaded in 2.2-3.1 s against 0.7-1.0 s (a fresh
process's first touch of 2 MiB frames is slow on that VM). So it is an Engine option,
`EngineConfig.huge_pages` (build.LoadOptions.huge_pages): on where a process lives long
(`lynx-edge serve`), opt-in elsewhere; None reads $LYNX_EDGE_THP (`env_default`), which also lets
a user turn serve's off (LYNX_EDGE_THP=0). Off Linux, with THP "never", or where madvise fails,
nothing changes.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

import torch

HUGE = 2 << 20  # the x86-64 / arm64 (4 KiB base page) transparent huge page
MIN_BYTES = 4 * HUGE  # smaller tensors gain little and may share their pages with other allocations
MADV_HUGEPAGE = 14


def env_default(default: bool = False) -> bool:
    """$LYNX_EDGE_THP ("1" on, "0" off) where set, else `default`: what huge_pages=None means."""
    value = os.environ.get("LYNX_EDGE_THP")
    return default if value is None else value == "1"


@functools.lru_cache(maxsize=None)
def _madvise():
    """libc's madvise, or None where THP cannot be asked for (not Linux, THP off, no libc)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled", encoding="ascii") as f:
            if "[never]" in f.read():
                return None
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def advise(tensors) -> int:
    """Mark the whole 2 MiB pages inside the storage of each CPU tensor of ≥ 8 MiB (once per storage,
    whatever views of it are passed) MADV_HUGEPAGE → bytes marked. Pages already touched keep their
    size until the kernel collapses them; data is never moved."""
    fn = _madvise()
    if fn is None:
        return 0
    done, seen = 0, set()
    for t in tensors:
        st = t.untyped_storage()
        if t.device.type != "cpu" or st.nbytes() < MIN_BYTES or st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        start = (st.data_ptr() + HUGE - 1) & ~(HUGE - 1)
        end = (st.data_ptr() + st.nbytes()) & ~(HUGE - 1)
        if end > start and fn(start, end - start, MADV_HUGEPAGE) == 0:
            done += end - start
    return done


def model_tensors(model: torch.nn.Module):
    """Every tensor the model's modules hold: parameters, buffers, and tensors kept as attributes of
    a module or of an object it holds (the expert sinks: stacked 16-bit, packed INT4 or FP8)."""
    for m in model.modules():
        for value in vars(m).values():
            items = value.values() if isinstance(value, dict) else [value]
            for v in items:
                if isinstance(v, torch.Tensor):
                    yield v
                elif not isinstance(v, torch.nn.Module) and hasattr(v, "__dict__"):
                    yield from (x for x in vars(v).values() if isinstance(x, torch.Tensor))


__all__ = ["advise", "env_default", "model_tensors"]
