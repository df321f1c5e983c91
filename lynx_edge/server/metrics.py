"""Prometheus metrics of one server (its own registry, so several servers can live in a process).

Counters and histograms are fed by the core thread after each step and by the request handlers;
tokens/s is rate() over the token counters.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("lynx_requests", "finished requests by finish reason", ["finish_reason"], registry=r)
        self.errors = Counter("lynx_request_errors", "rejected requests by HTTP status", ["status"], registry=r)
        self.prompt_tokens = Counter("lynx_prompt_tokens", "prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("lynx_generation_tokens", "tokens generated (decode + first)", registry=r)
        self.steps = Counter("lynx_engine_steps", "engine core steps", registry=r)
        self.waiting = Gauge("lynx_queue_waiting", "requests waiting for a KV row", registry=r)
        self.running = Gauge("lynx_running", "requests holding a KV row", registry=r)
        self.free_rows = Gauge("lynx_free_rows", "free KV rows", registry=r)
        self.ttft = Histogram("lynx_ttft_seconds", "time to first token", buckets=_LAT, registry=r)
        self.tpot = Histogram("lynx_tpot_seconds", "time per output token after the first", buckets=_LAT, registry=r)
        self.step_decode = Histogram("lynx_step_decode_tokens", "decode tokens per step",
                                     buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.step_prefill = Histogram("lynx_step_prefill_tokens", "prompt tokens per step (steps with any)",
                                      buckets=(1, 4, 16, 64, 256, 1024, 4096), registry=r)
        self.phase_tokens = Counter("lynx_step_tokens", "tokens run through the model by phase: decode (LYNX may "
                                    "remap), decode_opted_out (exact), prefill (exact)", ["phase"], registry=r)
        self.mixed_steps = Counter("lynx_mixed_steps", "steps whose prefill chunks shared the decode forward",
                                   registry=r)
        self.unique = Histogram("lynx_unique_experts_per_layer", "distinct experts per MoE layer per decode step",
                                buckets=(1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128), registry=r)
        self.lynx = Gauge("lynx_lynx", "LYNX telemetry since start (pure decode steps)", ["stat"], registry=r)
        self.lynx_mixed = Gauge("lynx_lynx_mixed", "LYNX telemetry since start over forwards that also held prefill "
                                "or opted-out tokens (per layer per forward)", ["stat"], registry=r)
        self.offload = Gauge("lynx_offload", "offload counters (expert cache, PCIe bytes)", ["stat"], registry=r)

    def observe_step(self, core) -> None:
        """After a core step (core thread): gauges and per-step histograms."""
        c, s = core.counts(), core.last_step
        self.waiting.set(c["waiting"])
        self.running.set(c["running"])
        self.free_rows.set(c["free_rows"])
        self.steps.inc()
        self.prompt_tokens.inc(s.get("prefill_tokens", 0))
        out = s.get("opted_out_tokens", 0)
        self.phase_tokens.labels("decode").inc(s.get("decode_tokens", 0) - out)
        self.phase_tokens.labels("decode_opted_out").inc(out)
        self.phase_tokens.labels("prefill").inc(s.get("prefill_tokens", 0))
        if s.get("mixed"):
            self.mixed_steps.inc()
        if s.get("decode_tokens"):
            self.step_decode.observe(s["decode_tokens"])
        if s.get("prefill_tokens"):
            self.step_prefill.observe(s["prefill_tokens"])
        if s.get("unique_experts"):
            self.unique.observe(s["unique_experts"])

    def observe_telemetry(self, core) -> None:
        """LYNX and offload summaries (host syncs: called every few steps, on the core thread)."""
        lynx = core.lynx_summary()
        keys = ("unique_before", "unique_after", "reduction_pct", "remap_rate_pct", "displaced_mass_per_token")
        if lynx:
            for k in keys:
                self.lynx.labels(k).set(lynx[k])
            for k in ("layer_steps", "tokens", "decode_tokens", *keys):
                self.lynx_mixed.labels(k).set(lynx["mixed"][k])
        rt = getattr(core.model, "offload", None)
        if rt is not None:
            for k, v in rt.stats().items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.offload.labels(k).set(v)

    def observe_output(self, out) -> None:
        if out.token_ids:
            self.generation_tokens.inc(len(out.token_ids))
        if out.ttft_s is not None:
            self.ttft.observe(out.ttft_s)
        if out.tpot_s is not None:
            self.tpot.observe(out.tpot_s)
        if out.finish_reason is not None:
            self.requests.labels(out.finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
