"""OpenAI request parsing and response shapes, as plain dicts (no model logic here).

Every bad field becomes an ApiError naming the field, which the app turns into OpenAI's error
body with the matching status. Sampling fields map to lynx-edge's transformers-style names:
max_tokens → max_new_tokens, stop → stop_strings, temperature 0 → greedy; fields left out take the
model's generation_config.json defaults (as vLLM does).
"""
from __future__ import annotations

import json
import time
import uuid

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


def _num(body: dict, name: str, lo: float | None = None, hi: float | None = None, integer: bool = False,
         lo_open: bool = False):
    v = body.get(name)
    if v is None:
        return None
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok:
        raise ApiError(400, f"'{name}' must be {'an integer' if integer else 'a number'}, got {v!r}", name)
    if (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
        rng = f"{'(' if lo_open else '['}{lo}, {hi if hi is not None else 'inf'}]"
        raise ApiError(400, f"'{name}' must be in {rng}, got {v!r}", name)
    return v


def sampling_kwargs(body: dict) -> dict:
    """OpenAI/vLLM sampling fields → Engine.sampling_params keywords (only those given)."""
    kw: dict = {}
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if mt is not None:
        kw["max_new_tokens"] = _num({name: mt}, name, 0, integer=True)
    else:
        kw["max_new_tokens"] = None  # OpenAI's default: until a stop or the context is full
    t = _num(body, "temperature", 0)
    if t is not None:
        kw["do_sample"] = t > 0
        if t > 0:
            kw["temperature"] = float(t)
    if (p := _num(body, "top_p", 0, 1, lo_open=True)) is not None:
        kw["top_p"] = float(p)
    if (k := _num(body, "top_k", -1, integer=True)) is not None:
        kw["top_k"] = max(0, k)  # vLLM: -1 (or 0) is off
    if (rp := _num(body, "repetition_penalty", 0, lo_open=True)) is not None:
        kw["repetition_penalty"] = float(rp)
    if (seed := _num(body, "seed", integer=True)) is not None:
        kw["seed"] = seed
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 16:
            raise ApiError(400, "'stop' must be a non-empty string or a list of at most 16 of them", "stop")
        kw["stop_strings"] = stops
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
            raise ApiError(400, "'stop_token_ids' must be a list of integers", "stop_token_ids")
        kw["stop_token_ids"] = ids
    if body.get("ignore_eos") is not None:
        kw["ignore_eos"] = bool(body["ignore_eos"])
    for name in ("frequency_penalty", "presence_penalty"):
        if _num(body, name, -2, 2) not in (None, 0):
            raise ApiError(400, f"'{name}' is not supported (use repetition_penalty)", name)
    if body.get("logprobs") or body.get("top_logprobs") or body.get("echo") or body.get("best_of", 1) not in (1, None):
        raise ApiError(400, "logprobs, echo and best_of are not supported", "logprobs")
    return kw


def choices_n(body: dict) -> int:
    n = _num(body, "n", 1, 16, integer=True)
    return 1 if n is None else n


def stream_flags(body: dict) -> tuple[bool, bool]:
    """→ (stream, include_usage)."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise ApiError(400, "'stream' must be a boolean", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options")
    return bool(stream), bool(opts.get("include_usage", False))


def chat_messages(body: dict) -> tuple[list[dict], dict]:
    """→ (messages, chat_template_kwargs). Content parts of type text are joined."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a 'role'", "messages")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": …}, …]
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(str(p.get("text", "")) for p in content)
        if content is not None and not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")
        out.append({**m, "content": content or ""})
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ApiError(400, "'chat_template_kwargs' must be an object", "chat_template_kwargs")
    if body.get("tools") is not None:
        kwargs = {**kwargs, "tools": body["tools"]}
    return out, kwargs


def completion_prompts(body: dict) -> list:
    """'prompt': a string, a list of strings, a list of token ids or a list of such lists."""
    p = body.get("prompt")
    is_ids = lambda x: isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)  # noqa: E731
    if isinstance(p, str) or is_ids(p):
        return [p]
    if isinstance(p, list) and p and all(isinstance(x, str) or is_ids(x) for x in p):
        return p
    raise ApiError(400, "'prompt' must be a string, a list of strings or a list of token ids", "prompt")


# responses --------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def finish(reason: str | None) -> str | None:
    return None if reason is None else "stop" if reason in ("stop", "abort") else reason


def chat_response(rid: str, model: str, texts: list[str], reasons: list, use: dict,
                  reasoning: list[str] | None = None) -> dict:
    """reasoning: per choice, the model's reasoning (Harmony analysis) as vLLM's `reasoning_content`."""
    msg = lambda i, t: {"role": "assistant", "content": t,  # noqa: E731
                        **({"reasoning_content": reasoning[i] or None} if reasoning is not None else {})}
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": i, "message": msg(i, t), "logprobs": None,
                         "finish_reason": finish(r)} for i, (t, r) in enumerate(zip(texts, reasons))],
            "usage": use}


def completion_response(rid: str, model: str, texts: list[str], reasons: list, use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": i, "text": t, "logprobs": None, "finish_reason": finish(r)}
                        for i, (t, r) in enumerate(zip(texts, reasons))],
            "usage": use}


def chat_chunk(rid: str, model: str, index: int, delta: dict, reason=None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish(reason)}]}


def completion_chunk(rid: str, model: str, index: int, text: str, reason=None) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish(reason)}]}


def usage_chunk(rid: str, model: str, obj: str, use: dict) -> dict:
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [], "usage": use}


def sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n".encode()
