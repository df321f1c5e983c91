"""Continuous-batching engine core: requests join and leave at any step.

A KV cache of `max_num_seqs` rows × ctx is allocated once (the Engine's own cache). Each step():
takes new requests and aborts from a thread-safe inbox, admits waiting requests into free rows,
runs one decode forward over every running row, then prefills waiting prompts in chunks up to a
token budget (a long prompt never stalls the others' decode), samples each request with its own
SamplingParams and seeded generator, and returns the per-request outputs. Only the thread that
calls step() touches the model. Glossary: B decode rows, V vocabulary.
"""
from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .engine import ContextError, Engine, _Seq
from .models.layers import AttnBatch
from .sampling import SamplingParams, select_tokens
from .step import decode_greedy, decode_step, prefill, prefill_rows
from .tokenizer import Detokenizer


class CapacityError(ValueError):
    """The KV cache for max_num_seqs × ctx does not fit the memory that is free."""


class QueueFull(RuntimeError):
    """The waiting queue is at its bound: the caller should retry later (HTTP 429)."""

BURST_S = 0.02  # the longest a greedy burst runs between two reads of the inbox (and two streamed chunks)


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    text: str  # new text since the previous output
    token_ids: list[int]  # new token ids
    finish_reason: str | None = None  # stop | length | abort | None while running
    prompt_tokens: int = 0
    completion_tokens: int = 0  # so far
    ttft_s: float | None = None  # on the first output that carries a token
    tpot_s: float | None = None  # mean time per output token after the first, on the last output


@dataclass
class _Request:
    id: str
    ids: list[int]  # prompt token ids
    sp: SamplingParams
    lynx: bool  # opted in to LYNX decode routing (meaningful when the engine's LYNX is on)
    stops: set[int]
    seq: _Seq
    gen: torch.Generator | None = None
    seen: torch.Tensor | None = None  # [V] bool: tokens seen (repetition penalty only)
    row: int | None = None  # KV cache row while admitted
    done: int = 0  # prompt tokens already in the cache
    last: int | None = None  # the newest sampled token, not yet run through the model
    t_arrival: float = field(default_factory=time.perf_counter)
    t_first: float | None = None


class EngineCore:
    """Step-driven scheduler over one Engine (which it then owns: do not call engine.stream meanwhile).

    max_num_seqs: KV rows (sequences decoding together); prefill_budget: prompt tokens per step;
    max_waiting: bound of the waiting queue (beyond it add_request raises QueueFull)."""

    def __init__(self, engine: Engine, max_num_seqs: int = 16, prefill_budget: int = 256, max_waiting: int = 64,
                 mixed_steps: bool = False, session: bool = False, num_scheduler_steps: int = 1):
        if max_num_seqs < 1 or prefill_budget < 1 or max_waiting < 0:
            raise ValueError("max_num_seqs and prefill_budget must be >= 1, max_waiting >= 0")
        self.engine, self.model = engine, engine.model
        self.kv_bytes = _check_kv_fits(engine, max_num_seqs)
        self.kv = engine._cache(max_num_seqs)  # allocated once: max_num_seqs × ctx
        if not session:
            engine.reset()  # rows are reused by requests: no cached chat session survives
        # session (Engine.stream): the caller keeps row 0's chat prefix and the routing stats of
        # the whole generation (else they are read and cleared every step)
        self.per_step_stats = not session
        self.ctx = engine.ctx
        self.max_num_seqs, self.prefill_budget, self.max_waiting = max_num_seqs, prefill_budget, max_waiting
        # prefill chunks ride in the decode forward (one forward per step); not with sequence state
        # (linear attention, convolutions): a chunk packed as one token per row would run a row's
        # tokens side by side, while its state must see them in order (kv_cache.py)
        self.mixed_steps = mixed_steps and not self.kv.stateful
        self._free = list(range(max_num_seqs))  # min-heap: low rows first, so batches stay contiguous
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []  # admitted, in admission order
        self._inbox: deque = deque()
        self._lock = threading.Lock()
        self.wakeup = threading.Event()  # set when the inbox gets something
        self._ids = itertools.count()
        self.last_step: dict = {}  # telemetry of the latest step (tokens per phase, unique experts)
        self.totals = {"steps": 0, "decode_tokens": 0, "opted_out_tokens": 0, "prefill_tokens": 0, "mixed_steps": 0}
        self._mixed_lynx: torch.Tensor | None = None  # [1 + S] LYNX sums over forwards not all-decode
        # greedy decode steps per step() (vLLM's multi-step scheduling): up to this many run in one
        # call (step.decode_greedy), fewer when a step is slow, so a burst stays within BURST_S and
        # streaming stays smooth; the inbox (new requests, aborts) is read between bursts
        self.num_scheduler_steps = max(1, int(num_scheduler_steps))
        self._step_s: float | None = None  # seconds per decode step (running mean): sizes the bursts
        self._steps = 0  # decode steps the latest step() ran

    # thread-safe API ------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], sp: SamplingParams, request_id: str | None = None,
                    lynx: bool = True, cached: int = 0) -> str:
        """Queue a request (any thread). Raises ContextError (prompt over the context) or QueueFull.
        cached: prompt tokens already in the request's KV row (Engine.stream's chat prefix, row 0)."""
        if not prompt_ids:
            raise ContextError("empty prompt")
        if len(prompt_ids) >= self.ctx:
            raise ContextError(f"prompt of {len(prompt_ids)} tokens does not fit the context of {self.ctx}")
        rid = request_id or f"req-{next(self._ids)}"
        req = _Request(rid, list(prompt_ids), sp, lynx, self.engine._stop_ids(sp),
                       _Seq(ids=list(prompt_ids), detok=Detokenizer(self.engine.tokenizer)))
        req.done = cached
        with self._lock:
            queued = len(self.waiting) + sum(1 for kind, _ in self._inbox if kind == "add")
            if queued >= self.max_waiting + len(self._free):
                raise QueueFull(f"the waiting queue is full ({self.max_waiting} requests)")
            self._inbox.append(("add", req))
        self.wakeup.set()
        return rid

    def abort(self, request_id: str) -> None:
        """Cancel a request (any thread); its row is freed at the start of the next step."""
        with self._lock:
            self._inbox.append(("abort", request_id))
        self.wakeup.set()

    @property
    def free_rows(self) -> int:
        return len(self._free)

    def has_work(self) -> bool:
        return bool(self._inbox or self.waiting or self.running)

    def counts(self) -> dict:
        return {"waiting": len(self.waiting), "running": len(self.running), "free_rows": len(self._free)}

    # the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling step: inbox → admit → decode all running rows → prefill chunks → outputs."""
        outs: list[RequestOutput] = []
        self._drain_inbox(outs)
        self._admit()
        stats = self.model.routing.stats
        if self.per_step_stats:
            stats.clear()
        ready = [r for r in self.running if r.last is not None]
        chunks = self._plan_chunks() if ready and self.mixed_steps else []
        cap = self.kv.max_chunk  # a window layer's ring: a longer chunk runs as its own prefill forward
        if cap is not None and any(n > cap for _, n in chunks):
            chunks = []
        self._steps = 0
        if ready:
            t = time.perf_counter()
            outs += self._decode(ready, chunks)
            dt = (time.perf_counter() - t) / self._steps
            self._step_s = dt if self._step_s is None else 0.8 * self._step_s + 0.2 * dt
        unique = stats.unique_per_layer(decode_only=True) if stats.record and ready and self.per_step_stats else None
        n_prefill = sum(n for _, n in chunks) + (0 if chunks else self._prefill_chunks(outs))
        if self.per_step_stats:
            stats.clear()  # bounded: only this step's ids were kept
        # tokens per phase: decode (LYNX may remap them), decode of opted-out requests (exact),
        # prefill (exact); mixed: the prefill chunks shared the decode forward
        self.last_step = {"decode_steps": self._steps, "decode_tokens": len(ready) * self._steps,
                          "opted_out_tokens": sum(not r.lynx for r in ready),
                          "prefill_tokens": n_prefill, "mixed": bool(chunks), "unique_experts": unique}
        self.totals["steps"] += 1
        for k in ("decode_tokens", "opted_out_tokens", "prefill_tokens"):
            self.totals[k] += self.last_step[k]
        self.totals["mixed_steps"] += bool(chunks)
        for r in [r for r in self.running if r.seq.finish is not None]:
            self._release(r)
        return outs

    def lynx_summary(self) -> dict | None:
        """LYNX telemetry since start, or None when LYNX is off. Core thread only (a host read).
        The top level: pure decode forwards; "mixed": forwards that also held prefill chunks or
        opted-out requests' tokens (exact), where only the opted-in decode slots can be remapped."""
        tel = getattr(self.engine.lynx, "telemetry", None)
        if tel is None:
            return None
        return {**tel.summary(), "mixed": _mixed_summary(self._mixed_lynx)}

    # internals ----------------------------------------------------------------------------
    def _drain_inbox(self, outs: list[RequestOutput]) -> None:
        with self._lock:
            items, self._inbox = list(self._inbox), deque()
            self.wakeup.clear()
        for kind, item in items:
            if kind == "add":
                self._start(item, outs)
            else:
                self._abort(item, outs)

    def _start(self, r: _Request, outs: list[RequestOutput]) -> None:
        dev, sp = self.model.device, r.sp
        if sp.max_new_tokens == 0:  # nothing to generate: no forward at all
            outs.append(RequestOutput(r.id, "", [], "length", len(r.ids), 0))
            return
        if sp.do_sample:
            r.gen = torch.Generator(device=dev)
            seed = sp.seed[0] if isinstance(sp.seed, (list, tuple)) else sp.seed
            r.gen.manual_seed(int(seed) if seed is not None else time.time_ns() % (2**63))
        if sp.repetition_penalty != 1.0:
            r.seen = torch.zeros(self.engine.cfg.vocab_size, dtype=torch.bool, device=dev)
            r.seen[torch.tensor(r.ids, device=dev)] = True
        self.waiting.append(r)

    def _abort(self, rid: str, outs: list[RequestOutput]) -> None:
        for r in list(self.waiting):
            if r.id == rid:
                self.waiting.remove(r)
                outs.append(RequestOutput(rid, "", [], "abort", len(r.ids), len(r.seq.out)))
                return
        for r in self.running:
            if r.id == rid:
                r.seq.finish = "abort"
                self._release(r)
                outs.append(RequestOutput(rid, "", [], "abort", len(r.ids), len(r.seq.out)))
                return

    def _admit(self) -> None:
        while self.waiting and self._free:
            r = self.waiting.popleft()
            r.row = heapq.heappop(self._free)
            self.kv.lengths[r.row] = 0
            self.running.append(r)

    def _release(self, r: _Request) -> None:
        if r.row is not None:
            self.kv.lengths[r.row] = 0  # stale K/V past a row's length is masked, never read
            heapq.heappush(self._free, r.row)
            r.row = None
        if r in self.running:
            self.running.remove(r)

    def _prefill_chunks(self, outs: list[RequestOutput]) -> int:
        """Prompt tokens of admitted requests, oldest first, up to the step's token budget: the
        chunks of several requests share one forward (step.prefill_rows, grouped so padding stays
        small); with sequence state (linear attention, convolutions: kv.stateful) one forward per
        request, as a pad token would enter the row's state (kv_cache.py)."""
        plan = self._plan_chunks()
        finished: list[tuple[_Request, torch.Tensor]] = []
        groups = [[c] for c in plan] if self.kv.stateful else _pad_groups(plan)
        for group in groups:
            if len(group) == 1:
                (r, n), = group
                logits = prefill(self.model, self.kv, r.row, r.ids[r.done:r.done + n], r.done)  # [1, V]
            else:
                logits, keep = prefill_rows(self.model, self.kv, [r.row for r, _ in group],
                                            [r.ids[r.done:r.done + n] for r, n in group], [r.done for r, _ in group])
                if keep is not None:
                    _drop_pads(self.model.routing.stats, keep)
            for i, (r, n) in enumerate(group):
                r.done += n
                if r.done == len(r.ids):
                    finished.append((r, logits[i:i + 1]))
        order = {id(r): i for i, (r, _) in enumerate(plan)}  # sample in admission order, as one call
        finished.sort(key=lambda f: order[id(f[0])])
        if finished:
            outs += self._sample([r for r, _ in finished], torch.cat([lg for _, lg in finished]))
        return sum(n for _, n in plan)

    def _plan_chunks(self) -> list[tuple[_Request, int]]:
        """(request, tokens) of prompt chunks for this step, oldest first, within the token budget."""
        budget, plan = self.prefill_budget, []
        for r in self.running:
            if budget <= 0:
                break
            if r.done < len(r.ids) and r.seq.finish is None:
                n = min(budget, len(r.ids) - r.done)
                plan.append((r, n))
                budget -= n
        return plan

    def _decode(self, reqs: list[_Request], chunks: list[tuple[_Request, int]] = ()) -> list[RequestOutput]:
        """One forward over the B rows' newest tokens (+ mixed-step chunks) → sampled outputs."""
        self._steps = 1
        if not chunks and all(r.lynx for r in reqs):  # the common step: step.decode_step, the one hot path
            n = self._burst(reqs)
            if n > 1:
                return self._greedy(reqs, n)
            tokens = torch.tensor([r.last for r in reqs], device=self.model.device)  # [B]
            return self._sample(reqs, decode_step(self.model, self.kv, [r.row for r in reqs], tokens))
        return self._packed(reqs, chunks)

    def _burst(self, reqs: list[_Request]) -> int:
        """Greedy decode steps to run in one call for these requests: 1 unless every one is plain
        greedy (no sampling, penalty or stop strings: the native call's argmax and stop ids decide
        exactly as _sample and _advance would); within num_scheduler_steps, BURST_S of steps at the
        measured step time, each request's token limit, and the context (less one step, so no token
        inside a burst meets the context's end)."""
        if self.num_scheduler_steps == 1 or self._step_s is None:
            return 1
        n = min(self.num_scheduler_steps, int(BURST_S / max(self._step_s, 1e-6)))
        for r in reqs:
            sp = r.sp
            if sp.do_sample or r.seen is not None or sp.stop_strings:
                return 1
            if sp.max_new_tokens is not None:
                n = min(n, sp.max_new_tokens - len(r.seq.out))
            n = min(n, self.ctx - 2 - self.kv.lengths[r.row])
        return n

    def _greedy(self, reqs: list[_Request], n: int) -> list[RequestOutput]:
        """Up to n greedy decode steps in one call; one output per request with all its new tokens
        (the burst ends after a step where a row chose a stop id, so only its last step finishes one)."""
        stops = set().union(*(r.stops for r in reqs))
        steps = decode_greedy(self.model, self.kv, [r.row for r in reqs], [r.last for r in reqs], n, stops)
        self._steps = len(steps)
        now = time.perf_counter()
        return [self._emit(r, [toks[i] for toks in steps], now) for i, r in enumerate(reqs)]

    def _packed(self, reqs: list[_Request], chunks: list[tuple[_Request, int]]) -> list[RequestOutput]:
        """One forward over the B rows' newest tokens, plus (mixed steps) P prompt-chunk tokens packed
        as one token per attention row: N = B + P tokens, each [1, 1] at its own row and position, so
        the MoE routes decode and prefill tokens together. LYNX per token: decode tokens of requests
        that opted in are remapped; prefill tokens and opted-out requests' tokens stay exact and their
        experts count as needed."""
        dev, kv = self.model.device, self.kv
        rows = [r.row for r in reqs]
        lengths = [kv.lengths[row] for row in rows]
        toks, flags = [r.last for r in reqs], [r.lynx for r in reqs]
        for r, n in chunks:  # K/V of all N tokens is written before attention reads: chunks see themselves
            rows += [r.row] * n
            lengths += list(range(r.done, r.done + n))
            toks += r.ids[r.done:r.done + n]
            flags += [False] * n
        tokens = torch.tensor(toks, device=dev)  # [N]
        phase = True if all(flags) else False if not any(flags) else None  # None: per token
        positions = torch.tensor(lengths, device=dev)[:, None]  # [N, 1]
        ab = AttnBatch(positions=positions, rows=_rows(rows, dev), kv_len=max(lengths) + 1)
        rc = self.model.routing
        rc.begin_step(phase)  # the router: all decode (True), all exact (False) or per token (None)
        rc.is_decode = True  # yet a decode step for the offload counters and the routing stats
        if rc.stats.record and rc.stats.decode:
            rc.stats.decode[-1] = True
        is_decode = torch.tensor(flags, dtype=torch.bool, device=dev)  # [B]
        logits = self.model(tokens.view(-1, 1), ab, kv.layers, is_decode)  # [N, V]
        self._add_mixed_lynx()
        B = len(reqs)
        for r in reqs:
            kv.lengths[r.row] += 1
        outs, at, done = self._sample(reqs, logits[:B]), B, []
        for r, n in chunks:
            r.done += n
            kv.lengths[r.row] = r.done
            at += n
            if r.done == len(r.ids):
                done.append((r, at - 1))  # its last prompt token's logits
        if done:
            outs += self._sample([r for r, _ in done], logits[[i for _, i in done]])
        return outs

    def _add_mixed_lynx(self) -> None:
        """LynxTelemetry keeps running sums of pure decode forwards only; this adds the latest
        (packed) forward's per-layer stat vectors to the core's own sums, on the device (no sync)."""
        tel = getattr(self.engine.lynx, "telemetry", None)
        last = tel.steps[-1] if tel is not None and tel.steps else None
        if not last:
            return
        vecs = torch.stack([v.double() for v in last.values()])  # [L, S]
        row = torch.cat([torch.full((1,), float(len(last)), dtype=torch.float64, device=vecs.device), vecs.sum(0)])
        self._mixed_lynx = row if self._mixed_lynx is None else self._mixed_lynx + row

    def _sample(self, reqs: list[_Request], logits: torch.Tensor) -> list[RequestOutput]:
        """logits [B, V] → one token per request (its own params and generator) → outputs."""
        plain = [not r.sp.do_sample and r.seen is None for r in reqs]  # greedy: one argmax for them all
        greedy = logits.argmax(dim=-1) if any(plain) else None  # [B]
        if all(plain):
            chosen = greedy.tolist()  # the one host sync of the step's sampling
        else:
            picks = [greedy[i:i + 1] if plain[i] else
                     select_tokens(logits[i:i + 1], r.sp, r.seen[None] if r.seen is not None else None,
                                   [r.gen] if r.gen is not None else None) for i, r in enumerate(reqs)]
            chosen = torch.cat(picks).tolist()
        now = time.perf_counter()
        return [self._emit(r, [tok], now) for r, tok in zip(reqs, chosen)]

    def _emit(self, r: _Request, toks: list[int], now: float) -> RequestOutput:
        """A request's new tokens (one sampled, or a greedy burst's), each through engine._advance up to
        the one that finishes it → its output (text and ids of them all; TTFT on its first, TPOT on
        its last)."""
        first = r.t_first is None
        if first:
            r.t_first = now
        texts, ids, finish = [], [], None
        for tok in toks:
            if r.seen is not None:
                r.seen[tok] = True
            c = self.engine._advance(r.seq, r.row, tok, r.stops, r.sp)
            r.last = tok
            texts.append(c.text)
            ids += c.token_ids
            if c.finish_reason is not None:
                finish = c.finish_reason
                break
        n = len(r.seq.out)
        out = RequestOutput(r.id, "".join(texts), ids, finish, len(r.ids), n,
                            ttft_s=now - r.t_arrival if first else None)
        if finish is not None and n > 1:
            out.tpot_s = (now - r.t_first) / (n - 1)
        return out

def _pad_groups(plan: list[tuple[_Request, int]], max_pad: float = 0.25) -> list[list[tuple[_Request, int]]]:
    """Chunks → groups that each run as one padded forward: longest first, a chunk joins the
    current group while the group's pad tokens stay within max_pad of its real tokens (equal
    lengths: one group, no padding)."""
    groups: list[list[tuple[_Request, int]]] = []
    real = 0
    for c in sorted(plan, key=lambda c: -c[1]):
        if groups and groups[-1][0][1] * (len(groups[-1]) + 1) <= (1 + max_pad) * (real + c[1]):
            groups[-1].append(c)
            real += c[1]
        else:
            groups.append([c])
            real = c[1]
    return groups


def _drop_pads(stats, keep: torch.Tensor) -> None:
    """The routing stats of the latest forward without its pad tokens (ids [B·T, K] → [N_real, K])."""
    if stats.record and stats.steps:
        last = stats.steps[-1]
        for layer, ids in last.items():
            last[layer] = ids[keep]


def _mixed_summary(acc: torch.Tensor | None) -> dict:
    """Core sums [layer-forwards, *lynx._STATS] → means per MoE layer per forward, as LynxTelemetry's."""
    from .lynx import _STATS

    n, *tot = acc.tolist() if acc is not None else [0.0] * (1 + len(_STATS))
    d = dict(zip(_STATS, tot))
    div = lambda a, b: a / b if b else 0.0  # noqa: E731
    before, after = div(d["unique_before"], n), div(d["unique_after"], n)
    return {"layer_steps": int(n), "tokens": div(d["tokens"], n), "decode_tokens": div(d["decode_tokens"], n),
            "unique_before": before, "unique_after": after, "reduction_pct": 100.0 * div(before - after, before),
            "remap_rate_pct": 100.0 * div(d["remapped_slots"], d["decode_slots"]),
            "displaced_mass_per_token": div(d["displaced_mass"], d["decode_tokens"])}


def _check_kv_fits(engine: Engine, rows: int) -> int:
    """Bytes of a KV cache of `rows` × ctx; a clear error when the device (or host RAM) lacks them,
    rather than an OOM mid-allocation or the cache's silent context fallback."""
    from .kv_cache import KVCache

    kv = engine.kv
    if kv is not None and kv.batch >= rows:
        return KVCache.bytes_needed(engine.cfg, kv.batch, kv.ctx, kv.dtype, kv.swa_full)
    need = KVCache.bytes_needed(engine.cfg, rows, engine.ctx, engine.model.dtype, engine.config.swa_full)
    dev = torch.device(engine.model.device)
    if dev.type == "cuda":
        free = torch.cuda.mem_get_info(dev)[0]
    else:
        import psutil

        free = psutil.virtual_memory().available
    if need > free:
        raise CapacityError(f"the KV cache for {rows} sequences × {engine.ctx} tokens needs {need / 2**30:.2f} GiB, "
                           f"{free / 2**30:.2f} GiB free on {dev.type}: lower --max-num-seqs or --ctx-size")
    return need


def _rows(rows: list[int], device) -> torch.Tensor | slice:
    # contiguous rows are a slice (a view of the cache); others are gathered
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, device=device)


__all__ = ["CapacityError", "EngineCore", "QueueFull", "RequestOutput"]
