"""Options shared by several commands, as Annotated types (llama.cpp / transformers names)."""
from __future__ import annotations

import json
from enum import Enum
from typing import Annotated, Optional

import typer

MODEL_HELP = "local directory, HF repo id (org/name) or alias (demo, mixtral-8x7b, qwen3-30b-a3b, …)"

Model = Annotated[str, typer.Argument(help=MODEL_HELP, show_default=True, metavar="MODEL")]
RequiredModel = Annotated[str, typer.Argument(help=MODEL_HELP, metavar="MODEL")]

# engine construction
Lynx = Annotated[str, typer.Option("--lynx", help="expert selection: off (exact) | on | budget:M | lynx-mass:T")]
# boolean options are plain flags: help shows `--int4`, not `--int4 <bool>` (cli/main.py, for every flag)
Offload = Annotated[bool, typer.Option("--offload", help="keep experts in host memory, cache hot ones on the GPU")]
Int4 = Annotated[bool, typer.Option("--int4", help="INT4 experts (quantized at load time or from a GPTQ checkpoint)")]
Int4Attn = Annotated[bool, typer.Option("--int4-attn", help="CPU: attention (also MLA, LFM2 short-conv) and dense projections INT4 "
                                         "too, quantized at load (RTN; approximate, like llama.cpp's Q4_0)")]
Int8Head = Annotated[bool, typer.Option("--int8-head", help="CPU: the output head int8 with a scale per "
                                        "row, quantized at load (half of bf16's bytes per token; approximate)")]
NoRepack = Annotated[bool, typer.Option("--no-repack", help="CPU: keep bf16 experts row-major (by default those "
                                        "streamed from memory with short rows are repacked: faster decode, "
                                        "prefill ~5% slower)")]
SwaFull = Annotated[bool, typer.Option("--swa-full", help="keep the full-context KV of sliding-window layers "
                                       "(by default a ring of window + 64 positions: gpt-oss's KV about halves, "
                                       "but a chat turn that rewrites the past recomputes the conversation)")]


class Int4ActChoice(str, Enum):
    f32 = "f32"
    q16 = "q16"
    q8 = "q8"


Int4Act = Annotated[Optional[Int4ActChoice], typer.Option(
    "--int4-act", help="CPU INT4 and MXFP4 kernels' activations: f32 (exact) | q16 (int16 per weight group, within 2^-16 "
    "of the group's largest input: integer dot products, 128x finer than bf16's rounding) | q8 (int8 like llama.cpp's "
    "Q4_0: fastest, approximate) [default: $LYNX_EDGE_INT4_ACT, else q16 on AVX2 without AVX-512 and on AMD AVX-512, else f32]")]
class Bf16ActChoice(str, Enum):
    f32 = "f32"
    bf16 = "bf16"


Bf16Act = Annotated[Optional[Bf16ActChoice], typer.Option(
    "--bf16-act", help="CPU bf16 weights' activations (the routers stay fp32): f32 (exact) | bf16 (rounded to bf16 as "
    "llama.cpp's BF16 rows do: 32 multiply-adds an AVX512-BF16 instruction, approximate) [default: $LYNX_EDGE_BF16_ACT, "
    "else bf16 on AMD AVX512-BF16 for a model that fits the last-level cache, else f32]")]
Profile = Annotated[Optional[str], typer.Option("--profile", help="hardware profile (TOML) for placement")]
Dtype = Annotated[Optional[str], typer.Option("--dtype", help="float32 | bfloat16 | float16 (default: bf16 on CUDA; on a CPU a bf16 or big fp16 checkpoint runs bf16 where the native kernels build or the CPU has native bf16, else fp32 up to 2 GiB; $LYNX_EDGE_CPU_DTYPE)")]
Device = Annotated[Optional[str], typer.Option("--device", help="cuda | cpu (default: cuda when present)")]
Threads = Annotated[Optional[int], typer.Option(
    "--threads", "-t", min=1, help="CPU threads for torch [default: the idle physical cores, ≥ 1]")]
SchedulerSteps = Annotated[int, typer.Option(
    "--num-scheduler-steps", min=1, help="greedy decode steps per native call on a CPU (vLLM's multi-step "
    "scheduling; fewer when a step is slow, a burst stays within ~20 ms); 1 = one step per call")]
SCHEDULER_STEPS = 64  # engine.EngineConfig.num_scheduler_steps' default (this module stays torch-free)
CtxSize = Annotated[Optional[int], typer.Option("--ctx-size", "-c", help="context length in tokens")]

# sampling (llama.cpp names); None = the model's generation_config.json, else CHAT_FALLBACK
Temp = Annotated[Optional[float], typer.Option("--temp", help="temperature; 0 = greedy [default: model's, else 0.7]")]
TopP = Annotated[Optional[float], typer.Option("--top-p", help="nucleus sampling; 1.0 = off [default: model's, else 0.95]")]
TopK = Annotated[Optional[int], typer.Option("--top-k", help="top-k sampling; 0 = off [default: model's, else 40]")]
Seed = Annotated[Optional[int], typer.Option("--seed", "-s", help="sampling seed")]
MaxTokens = Annotated[Optional[int], typer.Option("--max-tokens", "-n", help="tokens to generate per answer [default: model's, else 512]")]
RepeatPenalty = Annotated[Optional[float], typer.Option("--repeat-penalty", help="repetition penalty; 1.0 = off [default: model's, else 1.0]")]

# chat prompt (llama.cpp names)
ChatTemplateKwargs = Annotated[Optional[str], typer.Option(
    "--chat-template-kwargs", help='JSON object passed to the chat template, e.g. \'{"enable_thinking": false}\'')]
VerbosePrompt = Annotated[bool, typer.Option("--verbose-prompt", help="print each rendered prompt (stderr) before the answer")]

# bench / eval
BatchSizes = Annotated[str, typer.Option("--batch-size", "-b", help="comma-separated batch sizes, e.g. 1,4,16")]


class TableJson(str, Enum):
    table = "table"
    json = "json"


class TableJsonCsv(str, Enum):
    table = "table"
    json = "json"
    csv = "csv"


LYNX_VALUES = "off, on, lynx, budget:M, lynx-mass:TAU (knobs after a comma, e.g. lynx,j=2)"


def check_lynx(text: str, extra: tuple[str, ...] = ()) -> str:
    """Validate a --lynx value before any weights load → the value (lower-case). `extra`: values a
    command adds (bench: both). A bad one is one line that lists the valid values."""
    value = text.strip().lower()
    if value in extra:
        return value
    from ..lynx import LynxConfig

    try:
        LynxConfig.parse(value)
    except ValueError as exc:
        valid = ", ".join(extra) + ", " + LYNX_VALUES if extra else LYNX_VALUES
        raise typer.BadParameter(f"{exc}. Valid: {valid}", param_hint="--lynx") from None
    return value


def parse_sizes(text: str) -> list[int]:
    """"1,4,16" → [1, 4, 16]."""
    try:
        sizes = [int(s) for s in text.replace(" ", "").split(",") if s]
    except ValueError:
        raise typer.BadParameter(f"{text!r}: expected comma-separated integers such as 1,4,16") from None
    if not sizes or min(sizes) < 1:
        raise typer.BadParameter(f"{text!r}: batch sizes must be ≥ 1")
    return sizes


CHAT_FALLBACK = {"temperature": 0.7, "top_p": 0.95, "top_k": 40, "repetition_penalty": 1.0, "max_new_tokens": 512}


def sampling_kwargs(temp: float | None, top_p: float | None, top_k: int | None, seed: int | None,
                    max_tokens: int | None, repeat_penalty: float | None = None,
                    model_defaults: dict | None = None) -> tuple[dict, dict]:
    """llama.cpp flags → transformers' generation names. A flag left out takes the model's
    generation_config.json value, else CHAT_FALLBACK (as llama.cpp reads a model's sampling
    defaults). --temp 0 → greedy; a model that says do_sample=false is greedy unless --temp is given.
    → (kwargs for Engine.stream, {name: value} of what came from the model)."""
    model = dict(model_defaults or {})
    flags = {"temperature": temp, "top_p": top_p, "top_k": top_k, "repetition_penalty": repeat_penalty,
             "max_new_tokens": max_tokens}
    kw, used = {"seed": seed}, {}
    for name, flag in flags.items():
        if flag is not None:
            kw[name] = flag
        elif name in model:
            kw[name] = used[name] = model[name]
        else:
            kw[name] = CHAT_FALLBACK[name]
    if temp is not None and temp < 0:
        raise typer.BadParameter("--temp must be ≥ 0")
    if max_tokens is not None and max_tokens < 0:
        raise typer.BadParameter("--max-tokens must be ≥ 0")
    greedy = temp == 0 if temp is not None else (model.get("do_sample") is False or kw["temperature"] == 0)
    if temp is None and "do_sample" in model:
        used["do_sample"] = model["do_sample"]
    kw["do_sample"] = not greedy
    if greedy:  # sampling knobs are meaningless (and unchecked) without sampling
        for name in ("temperature", "top_p", "top_k"):
            kw.pop(name)
            used.pop(name, None)
    return kw, used


def parse_json_object(text: str | None, flag: str) -> dict:
    """A JSON-object option (e.g. --chat-template-kwargs) → dict; anything else is one clear line."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(f"{flag}: not valid JSON ({exc.msg} at column {exc.colno}): {text}") from None
    if not isinstance(value, dict):
        raise typer.BadParameter(f"{flag}: expected a JSON object such as {{\"enable_thinking\": false}}, got {text}")
    return value
