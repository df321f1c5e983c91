"""Host→device expert copies on a side stream, with events so compute waits only for what it uses.

Each device slot (a row of the pool uint8 [S, nbytes]) has two events: `ready` (recorded on the
copy stream after its last fill; compute waits on it before reading the slot) and `free`
(recorded on the compute stream after the last kernel that read it; the copy stream waits on it
before overwriting the slot). Experts left in pageable host memory go through a pinned staging
ring: host memcpy into ring slot i (after i's previous copy has finished), then an async copy.
On a CPU-only machine the same code runs with the CPU standing in for the device: copies are
plain memory copies and events are no-ops, so all of the logic is exercised by the CPU tests.
"""
from __future__ import annotations

import contextlib

import torch


class _NullEvent:
    """Stands in for torch.cuda.Event when the device is the CPU (work is already done)."""

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class Transfer:
    def __init__(self, store, pool: torch.Tensor, copy: bool = True):
        self.store, self.pool = store, pool  # pool uint8 [S, nbytes] on the device
        self.copy = copy  # False: a CPU device computes from the store in place (fetches only count)
        self.cuda = pool.device.type == "cuda"
        self.stream = torch.cuda.Stream(pool.device) if self.cuda else None
        n = pool.shape[0]
        self.ready: list = [None] * n
        self.free: list = [None] * n
        R = store.staging.shape[0] if store.staging is not None else 0
        self._ring_event: list = [None] * R
        self._ring_next = 0
        self.copies = self.staged = self.bytes_h2d = 0

    def _event(self):
        return torch.cuda.Event() if self.cuda else _NullEvent()

    def _ctx(self):
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    def fetch(self, layer: int, e: int, slot: int) -> int:
        """Start copying expert (layer, e) into pool[slot] → bytes moved."""
        if not self.copy:
            n = self.store.nbytes
            self.copies += 1
            self.bytes_h2d += n  # what a device would have moved (the CPU reads it in place)
            return n
        src, dst = self.store.block(layer, e), self.pool[slot]
        staged = not self.store.pinned.get(layer, False) and self.store.staging is not None
        with self._ctx():
            if self.cuda and self.free[slot] is not None:
                self.stream.wait_event(self.free[slot])  # compute is done reading the old expert
            if staged:
                i = self._ring_next
                self._ring_next = (i + 1) % len(self._ring_event)
                if self._ring_event[i] is not None:
                    self._ring_event[i].synchronize()  # ring slot i's previous copy has left
                ring = self.store.staging[i]
                ring.copy_(src)  # host memcpy: pageable → pinned
                dst.copy_(ring, non_blocking=True)
                self.staged += 1
            else:
                dst.copy_(src, non_blocking=True)
            ev = self._event()
            ev.record(self.stream) if self.cuda else None
            if staged:
                self._ring_event[i] = ev
        self.ready[slot] = ev
        self.copies += 1
        self.bytes_h2d += src.numel()
        return src.numel()

    def wait(self, slot: int) -> None:
        """The compute stream waits for pool[slot]'s fill (no host block)."""
        if not self.copy:
            return
        ev = self.ready[slot]
        if self.cuda and ev is not None:
            torch.cuda.current_stream(self.pool.device).wait_event(ev)

    def mark_used(self, slots) -> None:
        """Kernels reading these slots have been issued on the compute stream."""
        if not self.cuda or not self.copy:
            return
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.pool.device))
        for s in slots:
            self.free[s] = ev

    def synchronize(self) -> None:
        if self.cuda:
            self.stream.synchronize()


__all__ = ["Transfer"]
