"""Process memory as Linux accounts it: anonymous vs file-backed resident pages, and their peaks.

Loading through an mmap makes the checkpoint's pages resident as *file-backed* memory (page
cache the kernel can drop), so "peak RSS" alone overstates what a load needs. `RssWatch` samples
/proc/self/status in a background thread and keeps the peaks of RssAnon (what the process
really allocated) and RssFile apart; on non-Linux systems it falls back to psutil's RSS.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import psutil

_STATUS = Path("/proc/self/status")


def rss() -> dict[str, int]:
    """{"anon": bytes, "file": bytes, "total": bytes} resident now."""
    try:
        fields = {}
        for line in _STATUS.read_text().splitlines():
            if line.startswith(("RssAnon:", "RssFile:", "RssShmem:", "VmRSS:")):
                k, v = line.split(":", 1)
                fields[k] = int(v.split()[0]) * 1024
        return {"anon": fields["RssAnon"], "file": fields["RssFile"] + fields.get("RssShmem", 0),
                "total": fields["VmRSS"]}
    except (OSError, KeyError, ValueError):
        total = psutil.Process().memory_info().rss
        return {"anon": total, "file": 0, "total": total}


class RssWatch:
    """with RssWatch() as w: …  → w.peak["anon"], w.peak["file"], w.start, w.end (bytes)."""

    def __init__(self, interval_s: float = 0.002):
        self.interval = interval_s
        self.start = self.end = self.peak = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        now = rss()
        for k, v in now.items():
            if v > self.peak.get(k, 0):
                self.peak[k] = v

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval)

    def __enter__(self) -> "RssWatch":
        self.start = rss()
        self.peak = dict(self.start)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        self.end = rss()

    def report(self) -> dict[str, int]:
        """Bytes over the start: peak and final, anonymous and file-backed."""
        return {"peak_anon": self.peak["anon"] - self.start["anon"], "end_anon": self.end["anon"] - self.start["anon"],
                "peak_file": self.peak["file"] - self.start["file"], "end_file": self.end["file"] - self.start["file"]}


__all__ = ["RssWatch", "rss"]
