"""The OpenAI-compatible HTTP app (FastAPI): /v1/chat/completions, /v1/completions, /v1/models,
/health, /metrics, over one EngineCore run by a CoreWorker thread.

    app = create_app(engine, max_num_seqs=16)      # or serve(engine, host, port)

Streams are server-sent events; a client that disconnects has its request aborted (its KV row
is free at the next step). Errors are OpenAI error bodies (400/401/404/413/429/503).
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import signal
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..core import EngineCore, QueueFull, RequestOutput
from ..engine import ContextError, Engine
from ..harmony import HarmonyParser, HarmonyTokens, is_answer
from . import protocol as P
from .metrics import Metrics
from .worker import CoreWorker

RETRY_AFTER_S = 1
MAX_BODY_BYTES = 16 << 20  # a prompt far over any context still fits; a runaway upload does not


def create_app(engine: Engine, model_name: str | None = None, api_key: str | None = None, max_num_seqs: int = 16,
               prefill_budget: int = 256, max_waiting: int = 64, shutdown_timeout: float = 10.0,
               mixed_steps: bool = False, defaults: dict | None = None,
               template_kwargs: dict | None = None) -> FastAPI:
    """defaults: Engine.sampling_params keywords for fields a request leaves out (the serve
    command's --temp, --top-p, … flags; beneath them the model's generation_config.json);
    template_kwargs: chat template keywords every chat request gets (its own override them)."""
    defaults, template_kwargs = dict(defaults or {}), dict(template_kwargs or {})
    engine.sampling_params(**defaults)  # a bad default fails at start, not on every request
    core = EngineCore(engine, max_num_seqs=max_num_seqs, prefill_budget=prefill_budget, max_waiting=max_waiting,
                      mixed_steps=mixed_steps)
    metrics = Metrics()
    worker = CoreWorker(core, metrics)
    name = model_name or (engine.model_dir.name if engine.model_dir else "lynx-edge")
    lynx_on = engine.lynx is not None
    # Harmony (gpt-oss): the final channel is `content`, the rest `reasoning_content`, as vLLM does
    harmony = HarmonyTokens.of(engine.tokenizer)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, worker.stop, shutdown_timeout)

    app = FastAPI(title="lynx-edge", lifespan=lifespan)
    app.state.core, app.state.worker, app.state.metrics, app.state.model_name = core, worker, metrics, name

    def error(exc: P.ApiError) -> JSONResponse:
        metrics.errors.labels(str(exc.status)).inc()
        headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status in (429, 503) else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(P.ApiError)
    async def _api_error(request, exc: P.ApiError):
        return error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):  # unknown routes, wrong methods: OpenAI's body too
        return error(P.ApiError(exc.status_code, str(exc.detail)))

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        got = request.headers.get("authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {api_key}".encode()):
            raise P.ApiError(401, "invalid or missing API key (Authorization: Bearer …)", code="invalid_api_key")

    async def read_body(request: Request) -> dict:
        check_key(request)
        size = request.headers.get("content-length", "0")
        if not size.isdigit() or int(size) > MAX_BODY_BYTES:
            raise P.ApiError(413, f"request body over {MAX_BODY_BYTES >> 20} MiB")
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise P.ApiError(413, f"request body over {MAX_BODY_BYTES >> 20} MiB")
        body = P.parse_json(raw)
        model = body.get("model")
        if model is not None and model != name:
            raise P.ApiError(404, f"model '{model}' does not exist (this server serves '{name}')", "model",
                             "model_not_found")
        return body

    def sampling(body: dict, n: int):
        kw = P.sampling_kwargs(body)
        if kw.get("max_new_tokens") is None:
            del kw["max_new_tokens"]  # left out: the server's default, else until a stop or the context
        kw = {"max_new_tokens": None, **defaults, **kw}
        try:
            sps = []
            for i in range(n):  # n > 1 with a seed: seed, seed+1, … so the choices differ
                k = dict(kw, seed=kw["seed"] + i) if "seed" in kw and n > 1 else kw
                sps.append(engine.sampling_params(**k))
            return sps
        except (ValueError, TypeError) as exc:
            raise P.ApiError(400, str(exc)) from None

    def lynx_opt(body: dict) -> bool:
        v = body.get("lynx", True)  # extension: a request may opt out of LYNX ("lynx": false)
        if not isinstance(v, bool):
            raise P.ApiError(400, "'lynx' must be a boolean", "lynx")
        return v

    def submit_all(rid: str, prompts: list[list[int]], sps: list, lynx: bool) -> list[tuple[str, asyncio.Queue]]:
        if not worker.accepting or not worker.alive:
            raise P.ApiError(503, "the server is shutting down")
        subs = []
        try:
            for i, ids in enumerate(prompts):
                for j, sp in enumerate(sps):
                    sub = f"{rid}-{i * len(sps) + j}"
                    subs.append((sub, worker.submit(ids, sp, sub, lynx)))
        except QueueFull as exc:
            for sub, _ in subs:
                worker.abort(sub)
            raise P.ApiError(429, str(exc), code="queue_full") from None
        except ContextError as exc:
            for sub, _ in subs:
                worker.abort(sub)
            raise P.ApiError(413, str(exc), "prompt", "context_length_exceeded") from None
        return subs

    async def generate(request: Request, body: dict, prompts: list[list[int]], chat: bool):
        n = P.choices_n(body)
        stream, include_usage = P.stream_flags(body)
        sps = sampling(body, n)
        rid = P.new_id("chatcmpl" if chat else "cmpl")
        subs = submit_all(rid, prompts, sps, lynx_opt(body))
        if stream:
            return StreamingResponse(_stream(rid, subs, chat, include_usage, sum(map(len, prompts)) * n),
                                     media_type="text/event-stream")
        return await _collect(request, rid, subs, chat)

    def parsers(chat: bool, n: int) -> list | None:
        return [HarmonyParser(engine.tokenizer, harmony) for _ in range(n)] if chat and harmony else None

    def deltas(parse: list | None, i: int, out: RequestOutput) -> list[dict]:
        """One output → its chat deltas (Harmony pieces by channel, else its text); [{}] to carry a finish."""
        if parse is None:
            ds = [{"content": out.text}] if out.text else []
        else:
            pieces = parse[i].feed(out.token_ids) + (parse[i].flush() if out.finish_reason is not None else [])
            ds = [{"content" if is_answer(c) else "reasoning_content": t} for c, t in pieces]
        return ds or ([{}] if out.finish_reason is not None else [])

    async def _collect(request: Request, rid: str, subs, chat: bool):
        texts, reasons, ptok, ctok = [""] * len(subs), [None] * len(subs), 0, 0
        parse, thoughts = parsers(chat, len(subs)), [""] * len(subs)
        try:
            for i, (sub, q) in enumerate(subs):
                while True:
                    try:
                        out = await asyncio.wait_for(q.get(), timeout=0.5)
                    except asyncio.TimeoutError:
                        if await request.is_disconnected():
                            return Response(status_code=499)
                        continue
                    if isinstance(out, Exception):
                        raise P.ApiError(500, f"engine error: {out}")
                    if parse is None:
                        texts[i] += out.text
                    else:
                        for d in deltas(parse, i, out):
                            texts[i] += d.get("content", "")
                            thoughts[i] += d.get("reasoning_content", "")
                    if out.finish_reason is not None:
                        reasons[i], ptok, ctok = out.finish_reason, ptok + out.prompt_tokens, ctok + out.completion_tokens
                        break
        finally:
            for i, (sub, _) in enumerate(subs):
                if reasons[i] is None:
                    worker.abort(sub)  # client gone or error: free the rows now
        if parse is not None:
            return JSONResponse(P.chat_response(rid, name, texts, reasons, P.usage(ptok, ctok), thoughts))
        make = P.chat_response if chat else P.completion_response
        return JSONResponse(make(rid, name, texts, reasons, P.usage(ptok, ctok)))

    async def _stream(rid: str, subs, chat: bool, include_usage: bool, prompt_tokens: int):
        """SSE: all choices interleaved as their tokens come; usage chunk (optional); [DONE]."""
        done: dict[int, RequestOutput] = {}
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, q: asyncio.Queue):
            while True:
                out = await q.get()
                await merged.put((i, out))
                if isinstance(out, Exception) or out.finish_reason is not None:
                    return

        tasks = [asyncio.create_task(pump(i, q)) for i, (_, q) in enumerate(subs)]
        parse = parsers(chat, len(subs))
        try:
            if chat:
                for i in range(len(subs)):
                    yield P.sse(P.chat_chunk(rid, name, i, {"role": "assistant", "content": ""}))
            while len(done) < len(subs):
                i, out = await merged.get()
                if isinstance(out, Exception):
                    yield P.sse({"error": P.ApiError(500, f"engine error: {out}").body()["error"]})
                    return
                if out.finish_reason is not None:
                    done[i] = out
                if chat:
                    ds = deltas(parse, i, out)
                    for k, d in enumerate(ds):
                        yield P.sse(P.chat_chunk(rid, name, i, d, out.finish_reason if k == len(ds) - 1 else None))
                elif out.text or out.finish_reason is not None:
                    yield P.sse(P.completion_chunk(rid, name, i, out.text, out.finish_reason))
            if include_usage:
                ctok = sum(o.completion_tokens for o in done.values())
                obj = "chat.completion.chunk" if chat else "text_completion"
                yield P.sse(P.usage_chunk(rid, name, obj, P.usage(prompt_tokens, ctok)))
            yield P.sse("[DONE]")
        finally:  # normal end, client disconnect (cancellation) or error: free unfinished rows
            for t in tasks:
                t.cancel()
            for i, (sub, _) in enumerate(subs):
                if i not in done:
                    worker.abort(sub)

    def encode(prompt, kwargs=None) -> list[int]:
        try:
            return engine.encode_prompt(prompt, kwargs)
        except ContextError as exc:
            raise P.ApiError(400, str(exc), "prompt") from None
        except Exception as exc:  # template errors, bad token ids: the request's fault
            raise P.ApiError(400, f"cannot encode the prompt: {exc}", "prompt") from None

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_body(request)
        messages, kwargs = P.chat_messages(body)
        return await generate(request, body, [encode(messages, {**template_kwargs, **kwargs})], chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request)
        return await generate(request, body, [encode(p) for p in P.completion_prompts(body)], chat=False)

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(time.time()),
                                            "owned_by": "lynx-edge", "max_model_len": core.ctx}]}

    @app.get("/health")
    async def health():
        if not worker.alive or not worker.accepting:
            raise P.ApiError(503, "the engine core is not running")
        return {"status": "ok", **core.counts(), "max_num_seqs": core.max_num_seqs, "ctx": core.ctx,
                "kv_cache_bytes": core.kv_bytes, "lynx": lynx_on}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
          shutdown_timeout: float = 10.0, **options) -> None:
    """Run the app with uvicorn until SIGINT/SIGTERM; in-flight requests get `shutdown_timeout` s."""
    import uvicorn

    class _Server(uvicorn.Server):
        # uvicorn re-raises a captured SIGTERM/SIGINT after its graceful shutdown (exit status
        # -15/130); a server that shut down cleanly on request exits 0 instead
        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            before = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in before.items():
                    signal.signal(sig, handler)

    app = create_app(engine, shutdown_timeout=shutdown_timeout, **options)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=int(shutdown_timeout))
    _Server(config).run()
