"""`lynx-edge serve [MODEL]`: the OpenAI-compatible server (lynx_edge.server) on the
continuous-batching core. Only parses options, loads the engine and hands it to the server."""
from __future__ import annotations

from typing import Annotated, Optional

import typer

from .. import hugepages
from . import ui
from .common import CliError, engine_options, load_engine
from .options import (ChatTemplateKwargs, CtxSize, Device, Dtype, Bf16Act, Int4, Int4Act, Int4Attn, Int8Head, NoRepack, SwaFull, Lynx, Model, Offload, Profile,
                      parse_json_object)

_DEFAULT = "[default: the model's generation_config.json, else OpenAI's]"


def serve(
    model: Model = "demo",
    host: Annotated[str, typer.Option("--host", help="address to listen on (loopback by default)")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="TCP port")] = 8000,
    max_num_seqs: Annotated[int, typer.Option("--max-num-seqs", min=1, help="sequences decoding together (KV rows)")] = 16,
    ctx_size: CtxSize = None,
    max_num_batched_tokens: Annotated[int, typer.Option(
        "--max-num-batched-tokens", min=1, help="prompt tokens prefilled per step (chunked prefill)")] = 256,
    mixed_steps: Annotated[bool, typer.Option(
        "--mixed-steps", help="prefill chunks share the decode forward (LYNX sees both phases in one batch)")] = False,
    max_queue: Annotated[int, typer.Option("--max-queue", min=0, help="requests waiting for a row; beyond: HTTP 429")] = 64,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="LYNX_API_KEY",
                                                   help="require Authorization: Bearer KEY on /v1")] = None,
    served_model_name: Annotated[Optional[str], typer.Option(
        "--served-model-name", help="the model id clients send [default: the model directory's name]")] = None,
    shutdown_timeout: Annotated[float, typer.Option(
        "--shutdown-timeout", min=0, help="seconds in-flight requests get on SIGTERM/Ctrl-C")] = 10.0,
    temp: Annotated[Optional[float], typer.Option("--temp", min=0, help=f"temperature of requests that send none; 0 = greedy {_DEFAULT}")] = None,
    top_p: Annotated[Optional[float], typer.Option("--top-p", min=0, max=1, help=f"top_p of requests that send none {_DEFAULT}")] = None,
    top_k: Annotated[Optional[int], typer.Option("--top-k", min=0, help=f"top_k of requests that send none; 0 = off {_DEFAULT}")] = None,
    repeat_penalty: Annotated[Optional[float], typer.Option("--repeat-penalty", min=0, help=f"repetition_penalty of requests that send none {_DEFAULT}")] = None,
    max_tokens: Annotated[Optional[int], typer.Option("--max-tokens", "-n", min=0, help="max_tokens of requests that send none [default: until a stop or the context]")] = None,
    chat_template_kwargs: ChatTemplateKwargs = None,
    lynx: Lynx = "off",
    offload: Offload = False,
    int4: Int4 = False,
    int4_act: Int4Act = None,
    bf16_act: Bf16Act = None,
    int4_attn: Int4Attn = False,
    int8_head: Int8Head = False,
    no_repack: NoRepack = False,
    swa_full: SwaFull = False,
    profile: Profile = None,
    dtype: Dtype = None,
    device: Device = None,
) -> None:
    """Serve MODEL over HTTP: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics."""
    try:
        from ..server import serve as run_server
    except ModuleNotFoundError as exc:
        raise CliError(f"the server needs {exc.name}", "pip install fastapi uvicorn prometheus_client") from None
    template_kwargs = parse_json_object(chat_template_kwargs, "--chat-template-kwargs")
    # server-wide defaults for fields a request leaves out (OpenAI's names → Engine.sampling_params')
    defaults = {k: v for k, v in (("temperature", temp or None), ("top_p", top_p), ("top_k", top_k),
                                  ("repetition_penalty", repeat_penalty), ("max_new_tokens", max_tokens)) if v is not None}
    if temp is not None:
        defaults["do_sample"] = temp > 0  # --temp 0: greedy
    opts = engine_options(lynx=lynx, offload=offload, int4=int4, profile=profile, ctx_size=ctx_size, int4_act=int4_act,
                          int4_attn=int4_attn, int8_head=int8_head, no_repack=no_repack, swa_full=swa_full, bf16_act=bf16_act)
    # the memory plan (and --offload's expert slots) count the KV cache of max_num_seqs rows
    # a server decodes for hours: its CPU weights go on huge pages, slower to load, faster to stream
    # (hugepages.py; $LYNX_EDGE_THP=0 turns them off)
    engine = load_engine(model, dtype=dtype, device=device, max_num_seqs=max_num_seqs,
                         huge_pages=hugepages.env_default(True), **opts)
    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        ui.line(f"warning: listening on {host} without --api-key")
    ui.line(f"starting {served_model_name or engine.model_dir.name} on http://{host}:{port}/v1 "
            f"(max-num-seqs {max_num_seqs}, ctx {engine.ctx}, lynx {lynx})")
    run_server(engine, host=host, port=port, model_name=served_model_name, api_key=api_key,
               max_num_seqs=max_num_seqs, prefill_budget=max_num_batched_tokens, max_waiting=max_queue,
               shutdown_timeout=shutdown_timeout, mixed_steps=mixed_steps, defaults=defaults,
               template_kwargs=template_kwargs)
