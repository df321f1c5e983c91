"""CPU threads for torch's intra-op pool: one explicit setting per process, or a load-aware default.

Why not torch's default (one thread per core): every op of a decode step is a parallel region
whose barrier waits for its slowest thread, so on a busy machine a descheduled thread stalls
every small op for a scheduler time slice. Measured on a shared 2-core box (load average ~7,
demo model, benchmarks/results/threads.md): TPOT 24–46 ms with 1 thread vs 480–620 ms with 2 at
B=1, 42–49 ms vs 318–1013 ms at B=16. So the default is the cores that are idle *now* (cores
minus the 1-minute load average), at least 1, at most the physical cores.
"""
from __future__ import annotations

import os

import torch

_explicit: int | None = None  # set by --threads / threads=: wins over the default everywhere


def _cores() -> tuple[int, int]:
    """(usable logical cpus, physical cores among them) — affinity-aware where the OS says."""
    try:
        logical = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        logical = os.cpu_count() or 1
    try:
        import psutil

        physical = psutil.cpu_count(logical=False) or logical
    except Exception:  # psutil missing or no /proc: assume no SMT
        physical = logical
    return logical, max(1, min(physical, logical))


def default_threads() -> int:
    """The explicit setting if any, else idle physical cores (≥ 1) from the 1-minute load."""
    if _explicit is not None:
        return _explicit
    logical, physical = _cores()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = 0.0
    idle = logical - int(load + 0.5)  # cores busy on average, rounded: under half a core is noise
    return max(1, min(physical, idle))


def set_threads(n: int | None, explicit: bool = False) -> int:
    """Set torch's intra-op threads to n (None: default_threads()) → the count now in use.
    explicit=True makes n the process-wide setting later Engine builds keep (the CLI's -t)."""
    global _explicit
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise ValueError(f"threads: expected an integer ≥ 1, got {n!r}")
    if explicit:
        _explicit = n
    n = n if n is not None else default_threads()
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def current() -> int:
    return torch.get_num_threads()


__all__ = ["current", "default_threads", "set_threads"]
