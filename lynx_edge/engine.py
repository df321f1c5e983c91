"""Engine: owns all runtime state — model, tokenizer, KV cache, routing — and the one streaming call.

    engine = Engine.from_pretrained("demo")
    for chunk in engine.stream("def fib(n):", max_new_tokens=32):
        print(chunk.text, end="")

`stream` (one sequence) and `stream_batch` (B sequences decoded together, one batch per step)
share `_generate`, which runs the continuous-batching core (core.py, also under the server);
chat, bench, eval and the Python API all sit on them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from . import hugepages
from .config import GenerationConfig, ModelConfig
from .hub import resolve_model
from .kv_cache import KVCache
from .build import LoadOptions, load_model
from .loader import ProgressFn
from .models import MoEForCausalLM
from .routing import ExactRouter
from .sampling import SamplingParams
from .tokenizer import Detokenizer, Tokenizer

class ContextError(ValueError):
    """A prompt that does not fit the context."""


@dataclass
class EngineConfig:
    dtype: str | torch.dtype | None = None  # None: bf16 on CUDA; CPU: fp32 up to 2 GiB checkpoints (build.py)
    device: str | None = None  # None: cuda when present, else cpu
    ctx_size: int | None = None  # None: min(max_position_embeddings, 4096)
    max_num_seqs: int = 1  # KV rows the caller will allocate (serve: --max-num-seqs): the memory plan counts them
    lynx: str = "off"  # off | lynx | budget:m | … (see lynx.py)
    record_routing: bool = False  # keep expert ids per layer per step (routing stats)
    allow_pickle: bool = False  # load .bin checkpoints (unpickling: only for trusted files)
    # offload: experts in host memory, a device expert cache (see lynx_edge/offload)
    offload: bool = False
    gpu_budget_gib: float | None = None  # device memory for weights + KV + expert slots
    expert_slots: int | None = None  # or a fixed number of device expert slots
    policy: str | None = None  # lru | lynx (None: the profile's default)
    profile: str | None = None  # hardware profile name or TOML path (None: detect)
    # INT4 experts: RTN-quantised at load (GPTQ checkpoints are always loaded as INT4)
    int4: bool = False
    int4_group: int = 128
    int4_act: str | None = None  # CPU INT4 kernels: "f32" (exact) | "q16" (int16 activations, ~2^-16) | "q8" (int8, approximate)
    int4_attn: bool = False  # CPU: attention / dense projections INT4 too, RTN at load (approximate)
    # CPU bf16 weights (not the routers): "f32" (exact) | "bf16" (activations rounded to bf16, as
    # llama.cpp's BF16 rows: approximate) (None: $LYNX_EDGE_BF16_ACT, else bf16 where measured faster:
    # AMD AVX512-BF16, a model that fits the last-level cache)
    bf16_act: str | None = None
    int8_head: bool = False  # CPU: the output head int8 with row scales, at load (approximate; quant/int8.py)
    # CPU: weights on 2 MiB transparent huge pages (hugepages.py): faster decode, slower load
    # (None: $LYNX_EDGE_THP == "1"; lynx-edge serve: on unless $LYNX_EDGE_THP says otherwise)
    huge_pages: bool | None = None
    # CPU: bf16 experts streamed from DRAM keep matrices of short rows in packed rows for the native
    # kernels (native.pack_choice: decode 1.05-1.2x, a long prompt's prefill 0.94-0.96x); False keeps
    # them row-major (llama.cpp's --no-repack)
    repack: bool = True
    # sliding-window layers keep a ring of window + 64 positions of K/V, not the context (kv_cache.py;
    # llama.cpp's SWA cache); True keeps the full context (--swa-full)
    swa_full: bool = False
    threads: int | None = None  # torch CPU threads, set once at build (None: lynx_edge.threads default)
    # greedy decode steps per call (vLLM's multi-step scheduling; core.EngineCore._burst): with the
    # whole model in one native CPU call, up to this many steps run with no Python between them,
    # fewer when a step is slow (a burst stays within ~20 ms: the time, not this count, bounds a
    # chunk's delay); 1: one step per call. 64, not 16: the Python around each call (plan checks,
    # bookkeeping) costs the demo's B=1 tokens 3-5% at 16 (results/scheduler_steps_s41.json)
    num_scheduler_steps: int = 64


@dataclass
class Chunk:
    """One streamed piece of a sequence."""

    text: str  # new text (may be "" while a UTF-8 character or a stop string is incomplete)
    token_ids: list[int]  # new token ids
    index: int = 0  # which sequence of the batch
    finish_reason: str | None = None  # stop | length | None while running
    stats: dict | None = None  # the generation's summary, on the generation's last chunk


@dataclass
class _Seq:
    ids: list[int]  # prompt token ids
    detok: Detokenizer
    out: list[int] = field(default_factory=list)
    text: str = ""  # emitted so far
    pending: str = ""  # held back: may be the start of a stop string
    finish: str | None = None


class Engine:
    def __init__(self, model: MoEForCausalLM, tokenizer: Tokenizer, config: EngineConfig, model_dir: Path):
        self.model, self.tokenizer, self.config, self.model_dir = model, tokenizer, config, model_dir
        self.cfg: ModelConfig = model.cfg
        self.ctx = min(config.ctx_size or min(self.cfg.max_position_embeddings, 4096), self.cfg.max_position_embeddings)
        self.kv: KVCache | None = None
        self._session: list[int] = []  # tokens held in cache row 0 (reused across chat turns)
        # positions the last generation wrote into row 0 (at most): more than the session when its
        # answer was not kept (LYNX on, a stopped stream), which a window layer's ring has seen
        self._written = 0
        self.model.routing.stats.record = config.record_routing
        self.last_stats: dict = {}
        # eos ids and sampling defaults, as transformers reads them (GenerationConfig.from_dir)
        self.generation_config = GenerationConfig.from_dir(model_dir) if model_dir else GenerationConfig()
        self.set_lynx(config.lynx)

    # construction -------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path_or_repo: str | Path | None = "demo", dtype: str | torch.dtype | None = None,
                        device: str | None = None, progress: ProgressFn | None = None, **options) -> "Engine":
        """Plan placement, build the model without weights, stream the checkpoint into place
        (lynx_edge.build), in one pass; see EngineConfig for the options."""
        config = EngineConfig(dtype=dtype, device=device, **options)
        from .threads import set_threads

        config.threads = set_threads(config.threads)  # the count in use, recorded with every result
        model_dir = resolve_model(path_or_repo)
        cfg = ModelConfig.from_file(model_dir / "config.json")
        tokenizer = Tokenizer(model_dir)
        offload = None
        if config.offload:
            offload = dict(gpu_budget_gib=config.gpu_budget_gib, expert_slots=config.expert_slots,
                           policy=config.policy, profile=config.profile)
        huge_pages = hugepages.env_default() if config.huge_pages is None else config.huge_pages
        opts = LoadOptions(device=device, dtype=dtype, offload=config.offload, int4=config.int4,
                           int4_group=config.int4_group, int4_act=config.int4_act, int4_attn=config.int4_attn,
                           bf16_act=config.bf16_act, int8_head=config.int8_head, huge_pages=huge_pages, repack=config.repack,
                           swa_full=config.swa_full,
                           allow_pickle=config.allow_pickle,
                           ctx=config.ctx_size or min(cfg.max_position_embeddings, 4096), batch=config.max_num_seqs,
                           offload_options=offload)
        model = load_model(model_dir, cfg, opts, progress)
        return cls(model, tokenizer, config, model_dir)

    def set_lynx(self, mode) -> None:
        """Switch routing: "off" (exact), "lynx", "budget:m", … or a LynxConfig.

        A change of mode forgets the cached chat prefix, so the next turn prefills it again under
        the new routing (prefill stays exact for the whole conversation)."""
        key = "off" if mode in (None, "off") else repr(mode)
        if key != getattr(self, "_lynx_key", None):
            self._session = []
        self._lynx_key = key
        spec = self.model.routing.spec
        if mode in (None, "off"):
            self.model.routing.route = ExactRouter(spec)
            self.lynx = None
            if getattr(self.model, "offload", None) is not None:
                self.model.offload.set_lynx("off")
            return
        from .lynx import LynxConfig, LynxRouter

        cfg = mode if isinstance(mode, LynxConfig) else LynxConfig.parse(mode)
        self.lynx = LynxRouter(spec, cfg) if cfg.mode != "off" else None
        self.model.routing.route = self.lynx or ExactRouter(spec)
        rt = getattr(self.model, "offload", None)
        if rt is not None and self.lynx is not None:
            rt.set_lynx(None)  # residency-aware: resident experts count as free (keeps the telemetry)
            self.lynx = self.model.routing.route

    # public API ---------------------------------------------------------------------------
    def encode_prompt(self, prompt_or_messages, chat_template_kwargs: dict | None = None) -> list[int]:
        """Text, chat messages (rendered with the chat template and `chat_template_kwargs`) or
        token ids → ids; ids are checked against the vocabulary (a bad id is one clear error
        here, never an IndexError or a device assert in the embedding)."""
        p = prompt_or_messages
        if isinstance(p, str):
            return self.tokenizer.encode(p)
        if isinstance(p, (list, tuple)) and len(p) == 0:
            raise ContextError("empty prompt (no text, messages or token ids)")
        if isinstance(p, (list, tuple)) and all(isinstance(m, dict) for m in p):
            return self.tokenizer.encode_chat(list(p), **(chat_template_kwargs or {}))
        if isinstance(p, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            V = self.cfg.vocab_size
            for i, t in enumerate(p):
                if not 0 <= t < V:
                    raise ValueError(f"token id {t} at prompt position {i} is out of range (vocabulary of {V})")
            return list(p)
        raise TypeError("prompt must be a string, a list of chat messages, or a list of token ids")

    def sampling_params(self, **sampling) -> SamplingParams:
        """The caller's sampling keywords over the model's generation_config.json defaults."""
        return SamplingParams.from_kwargs(defaults=self.generation_config.defaults, **sampling)

    def stream(self, prompt_or_messages, truncate: bool = False, chat_template_kwargs: dict | None = None,
               **sampling) -> Iterator[Chunk]:
        """Generate for one prompt (text, chat messages or token ids), yielding Chunks as tokens come.

        The KV cache of the previous call is reused for the longest common token prefix, so a chat
        session never recomputes its history. Sampling keywords the caller omits come from the
        model's generation_config.json, then SamplingParams' defaults; `eos_token_id` (int or
        list) replaces the model's end-of-sequence ids, as in transformers."""
        sp = self.sampling_params(**sampling)
        ids = self._fit(self.encode_prompt(prompt_or_messages, chat_template_kwargs), sp, truncate)
        yield from self._generate([ids], sp, reuse=True)

    def generate(self, prompt_or_messages, **sampling) -> str:
        return "".join(c.text for c in self.stream(prompt_or_messages, **sampling))

    def stream_batch(self, prompts: list, truncate: bool = False, chat_template_kwargs: dict | None = None,
                     **sampling) -> Iterator[Chunk]:
        """Decode many sequences together, one batch per step; chunks carry their sequence's index."""
        sp = self.sampling_params(**sampling)
        if not prompts:
            return
        ids = [self._fit(self.encode_prompt(p, chat_template_kwargs), sp, truncate) for p in prompts]
        yield from self._generate(ids, sp, reuse=False)

    def generate_batch(self, prompts: list, **sampling) -> list[str]:
        texts = [""] * len(prompts)
        for c in self.stream_batch(prompts, **sampling):
            texts[c.index] += c.text
        return texts

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The model's end-of-sequence ids as transformers' generate uses them: generation_config.json,
        else config.json; the tokenizer's eos_token only when neither file names one."""
        ids = self.generation_config.eos_token_ids
        if ids is None:
            ids = self.cfg.eos_token_ids
        if not ids and self.tokenizer.eos_token_id is not None:
            ids = (self.tokenizer.eos_token_id,)
        return tuple(i for i in ids if 0 <= i < self.cfg.vocab_size)

    def reset(self) -> None:
        """Forget the cached conversation (the next stream() prefills from scratch)."""
        self._session = []

    # internals ----------------------------------------------------------------------------
    def _fit(self, ids: list[int], sp: SamplingParams, truncate: bool) -> list[int]:
        if not ids:
            raise ContextError("empty prompt")
        if len(ids) >= self.ctx:
            if not truncate:
                raise ContextError(f"prompt of {len(ids)} tokens does not fit the context of {self.ctx} "
                                   "(raise ctx_size / --ctx-size, or pass truncate=True to keep its end)")
            want = self.ctx // 2 if sp.max_new_tokens is None else min(sp.max_new_tokens, self.ctx // 2)
            keep = max(1, self.ctx - max(1, want))
            ids = ids[-keep:]
        return ids

    def _cache(self, batch: int) -> KVCache:
        if self.kv is None or self.kv.batch < batch:
            self.kv = None  # free the old one first
            self.kv = KVCache(self.cfg, batch, self.ctx, self.model.dtype, self.model.device,
                              swa_full=self.config.swa_full)
            self.ctx = self.kv.ctx  # may have fallen back to a shorter context
            self._session = []
        return self.kv

    def _stop_ids(self, sp: SamplingParams) -> set[int]:
        ids = set(sp.stop_token_ids)
        if not sp.ignore_eos:
            ids |= set(self.eos_token_ids if sp.eos_token_id is None else sp.eos_token_id)
        return ids

    def _generate(self, prompts: list[list[int]], sp: SamplingParams, reuse: bool) -> Iterator[Chunk]:
        if sp.do_sample and isinstance(sp.seed, (list, tuple)) and len(sp.seed) != len(prompts):
            raise ValueError(f"seed has {len(sp.seed)} entries for {len(prompts)} prompts")
        seqs = [_Seq(ids=p, detok=Detokenizer(self.tokenizer)) for p in prompts]
        if sp.max_new_tokens == 0:  # nothing to generate: no forward at all
            self._reused = 0
            for row in range(len(prompts)):
                last = row == len(prompts) - 1
                yield Chunk("", [], row, "length", self._summary(seqs, 0.0, 0.0, 0) if last else None)
            return
        from dataclasses import replace

        from .core import EngineCore

        self.model.routing.stats.clear()
        if self.lynx is not None:
            self.lynx.telemetry.clear()
        if getattr(self.model, "offload", None) is not None:
            self.model.offload.reset_stats()  # offload counters per generation
        t0 = time.perf_counter()
        # the continuous-batching core (core.py) runs every generation: all prompts prefilled in the
        # first step (one prefill call each), then one decode step per token for the live rows
        core = EngineCore(self, max_num_seqs=len(prompts), prefill_budget=sum(map(len, prompts)), session=True,
                          num_scheduler_steps=self.config.num_scheduler_steps)
        start = 0
        stateful = core.kv.stateful  # linear attention / conv state: a prefix is continued, never cut
        if reuse:  # longest common prefix with the cached session in row 0 (≥ 1 token left to run)
            ids, sess = prompts[0], self._session
            while start < min(len(ids) - 1, len(sess)) and ids[start] == sess[start]:
                start += 1
            if stateful and start < len(sess):
                start = 0  # the state holds all of the session: reuse only a prompt that extends it, else recompute
            held = max(len(sess), self._written)  # positions row 0's rings have seen
            if start < held:  # a window layer's ring may no longer hold the window before `start`
                start = core.kv.rewind(0, held, start)
        self._reused = start
        seeds = sp.seed if isinstance(sp.seed, (list, tuple)) else [sp.seed] * len(prompts)
        for b, p in enumerate(prompts):
            core.add_request(p, replace(sp, seed=seeds[b]), str(b), cached=start if b == 0 else 0)
        reqs = {r.id: r for _, r in core._inbox}  # the queued requests (their _Seq: text, output ids)
        self.last_stats, self._t_first = {}, None
        try:
            yield from self._run(core, reqs, prompts, reuse, stateful, t0)
        finally:
            first = reqs.get("0")
            self._written = len(prompts[0]) + (len(first.seq.out) if first is not None else 0)
            if not self.last_stats and self._t_first is not None:
                # the caller stopped the stream (closed it, e.g. Ctrl-C in chat): keep what was done
                seqs = [r.seq for r in reqs.values()]
                self.last_stats = {**self._summary(seqs, self._t_prefill, time.perf_counter() - self._t_first,
                                                   self._n_decode), "stopped": True}

    def _run(self, core, reqs: dict, prompts: list[list[int]], reuse: bool, stateful: bool, t0: float):
        """The step loop of _generate: chunks out, the summary on the last one."""
        self._t_prefill, self._n_decode, self._t_first = 0.0, 0, None
        while core.has_work():
            outs = core.step()
            if self._t_first is None:
                self._t_first = time.perf_counter()
                self._t_prefill = self._t_first - t0
                # a state advances with every decode step: its session is recorded only when the answer ends
                self._session = list(prompts[0]) if reuse and not stateful else []
                # the rings as the prompt left them: the next turn may cut back to about here (kv_cache.py)
                core.kv.snapshot(0 if self._session else None, len(self._session))
            else:
                self._n_decode += core.last_step["decode_steps"]
            for i, o in enumerate(outs):
                row = int(o.request_id)
                chunk = Chunk(o.text, o.token_ids, row, o.finish_reason)
                if o.finish_reason is not None and row == 0 and reuse and self.lynx is None:
                    # the last sampled token never ran through the model; with LYNX on, the answer's
                    # K/V came from approximate decode routing, so the next turn prefills it exactly
                    # (a stateful model then recomputes the whole conversation: its state has the answer)
                    self._session = list(prompts[0]) if stateful else self._session
                    self._session += reqs[o.request_id].seq.out[:-1]
                if i == len(outs) - 1 and not core.has_work():
                    seqs = [r.seq for r in reqs.values()]
                    chunk.stats = self._summary(seqs, self._t_prefill, time.perf_counter() - self._t_first,
                                                self._n_decode)
                    self.last_stats = chunk.stats
                yield chunk

    def _advance(self, s: _Seq, row: int, tok: int, stops: set[int], sp: SamplingParams) -> Chunk:
        """Account for one new token of a sequence; → the chunk to emit."""
        s.out.append(tok)
        if tok in stops:
            s.finish = "stop"
            text, s.pending = s.pending + s.detok.flush(), ""
            return Chunk(text, [tok], row, "stop")
        s.pending += s.detok.push(tok)
        if sp.stop_strings:
            full = s.text + s.pending
            # cut at the earliest match in the text, whatever the order of the list
            hits = [at for stop in sp.stop_strings if (at := full.find(stop, max(0, len(s.text) - len(stop)))) >= 0]
            if hits:
                s.finish = "stop"
                text = full[len(s.text):min(hits)]
                s.text += text
                return Chunk(text, [tok], row, "stop")
        limit = sp.max_new_tokens
        if (limit is not None and len(s.out) >= limit) or self.kv.lengths[row] + 1 >= self.ctx:
            s.finish = "length"
        emit = s.pending if s.finish else _safe_emit(s.pending, sp.stop_strings)
        s.pending = s.pending[len(emit):]
        if s.finish:
            emit += s.detok.flush()
        s.text += emit
        return Chunk(emit, [tok], row, s.finish)

    def _summary(self, seqs: list[_Seq], t_prefill: float, t_decode: float, n_decode: int) -> dict:
        n_prompt = sum(len(s.ids) for s in seqs)
        n_out = sum(len(s.out) for s in seqs)
        stats = {
            "batch": len(seqs),
            "prompt_tokens": n_prompt,
            "cached_prompt_tokens": self._reused,  # reused from the previous turn's KV cache
            "completion_tokens": n_out,
            "prefill_s": t_prefill,
            # tokens actually computed: the cached prefix of a chat turn costs nothing
            "prefill_tok_s": (n_prompt - self._reused) / t_prefill if t_prefill > 0 else 0.0,
            "decode_steps": n_decode,
            "decode_s": t_decode,
            "decode_tok_s": (n_out - len(seqs)) / t_decode if t_decode > 0 else 0.0,
            "tpot_ms": 1e3 * t_decode / n_decode if n_decode else 0.0,
        }
        rs = self.model.routing.stats
        if rs.record:
            stats["unique_experts_per_layer"] = rs.unique_per_layer(decode_only=True)
        if self.lynx is not None:
            stats["lynx"] = self.lynx.telemetry.summary()
        if getattr(self.model, "offload", None) is not None:
            stats["offload"] = self.model.offload.stats()
        return stats


def _safe_emit(pending: str, stop_strings: list[str]) -> str:
    """The part of `pending` that cannot be the start of a stop string."""
    if not stop_strings:
        return pending
    hold = 0
    for stop in stop_strings:
        for n in range(min(len(stop) - 1, len(pending)), 0, -1):
            if pending.endswith(stop[:n]):
                hold = max(hold, n)
                break
    return pending[: len(pending) - hold]


__all__ = ["Chunk", "ContextError", "Engine", "EngineConfig"]
