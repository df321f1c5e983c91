"""The one background thread that runs the engine core, and its bridge to asyncio handlers.

Handlers submit requests and get an asyncio.Queue of RequestOutputs; the core thread steps while
there is work and hands each output to its request's queue on the handler's event loop
(call_soon_threadsafe). Aborts go through the core's inbox, so a disconnect frees a row at the
next step. A failed step fails the requests in flight (each gets the error) and the thread goes on.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time

from ..core import EngineCore, RequestOutput
from .metrics import Metrics

log = logging.getLogger("lynx_edge.server")


class CoreWorker:
    def __init__(self, core: EngineCore, metrics: Metrics, telemetry_every: int = 16):
        self.core, self.metrics, self.telemetry_every = core, metrics, telemetry_every
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.accepting = True
        self.thread = threading.Thread(target=self._run, name="lynx-core", daemon=True)

    def start(self) -> "CoreWorker":
        self.thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and not self._stop.is_set()

    def submit(self, prompt_ids: list[int], sp, request_id: str, lynx: bool = True) -> asyncio.Queue:
        """(event loop) → the queue this request's outputs arrive on. Raises QueueFull / ContextError."""
        if not self.accepting:
            raise RuntimeError("the server is shutting down")
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._streams[request_id] = (asyncio.get_running_loop(), q)
        try:
            self.core.add_request(prompt_ids, sp, request_id, lynx=lynx)
        except Exception:
            with self._lock:
                self._streams.pop(request_id, None)
            raise
        return q

    def abort(self, request_id: str) -> None:
        with self._lock:
            live = self._streams.pop(request_id, None) is not None
        if live:
            self.core.abort(request_id)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop admitting; let in-flight requests finish within `timeout`, abort the rest, end the thread."""
        self.accepting = False
        deadline = time.monotonic() + timeout
        while self.in_flight() and time.monotonic() < deadline and self.thread.is_alive():
            time.sleep(0.02)
        with self._lock:
            left = list(self._streams)
        for rid in left:
            self.abort(rid)
        self._stop.set()
        self.core.wakeup.set()
        self.thread.join(timeout=max(1.0, timeout))

    # core thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            if not self.core.has_work():
                self.core.wakeup.wait(0.05)
                continue
            try:
                outs = self.core.step()
            except Exception as exc:  # a bug or a device error: fail what is in flight, keep serving
                log.exception("engine step failed")
                self._fail_all(exc)
                continue
            # metrics before delivery: a client that has its last token sees them in /metrics
            for out in outs:
                self.metrics.observe_output(out)
            self.metrics.observe_step(self.core)
            n += 1
            if n % self.telemetry_every == 0 or not self.core.running:
                try:
                    self.metrics.observe_telemetry(self.core)
                except Exception:  # telemetry never takes the server down
                    log.exception("telemetry failed")
            for out in outs:
                self._deliver(out)

    def _deliver(self, out: RequestOutput | Exception, rid: str | None = None) -> None:
        rid = rid or out.request_id
        with self._lock:
            target = self._streams.get(rid)
            if target is not None and (isinstance(out, Exception) or out.finish_reason is not None):
                self._streams.pop(rid, None)
        if target is not None:
            loop, q = target
            try:
                loop.call_soon_threadsafe(q.put_nowait, out)
            except RuntimeError:  # the handler's loop is closed: nobody is listening
                pass

    def _fail_all(self, exc: Exception) -> None:
        with self._lock:
            rids = list(self._streams)
        for rid in rids:
            self.core.abort(rid)
            self._deliver(exc, rid)
