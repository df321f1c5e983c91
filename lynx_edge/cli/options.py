"""Options shared by several commands, as Annotated types (llama.cpp / transformers names)."""
from __future__ import annotations

from enum import Enum
from typing import Annotated, Optional

import typer

MODEL_HELP = "local directory, HF repo id (org/name) or alias (demo, mixtral-8x7b, qwen3-30b-a3b, …)"

Model = Annotated[str, typer.Argument(help=MODEL_HELP, show_default=True)]
RequiredModel = Annotated[str, typer.Argument(help=MODEL_HELP)]

# engine construction
Lynx = Annotated[str, typer.Option("--lynx", help="expert selection: off (exact) | on | budget:M | lynx-mass:T")]
Offload = Annotated[bool, typer.Option("--offload", help="keep experts in host memory, cache hot ones on the GPU")]
Int4 = Annotated[bool, typer.Option("--int4", help="INT4 experts (quantized at load time or from a GPTQ checkpoint)")]
Profile = Annotated[Optional[str], typer.Option("--profile", help="hardware profile (TOML) for placement")]
Dtype = Annotated[Optional[str], typer.Option("--dtype", help="float32 | bfloat16 | float16 (default: bf16 on CUDA, fp32 on CPU)")]
Device = Annotated[Optional[str], typer.Option("--device", help="cuda | cpu (default: cuda when present)")]
CtxSize = Annotated[Optional[int], typer.Option("--ctx-size", "-c", help="context length in tokens")]

# sampling (llama.cpp names)
Temp = Annotated[float, typer.Option("--temp", help="temperature; 0 = greedy")]
TopP = Annotated[float, typer.Option("--top-p", help="nucleus sampling; 1.0 = off")]
TopK = Annotated[int, typer.Option("--top-k", help="top-k sampling; 0 = off")]
Seed = Annotated[Optional[int], typer.Option("--seed", "-s", help="sampling seed")]
MaxTokens = Annotated[int, typer.Option("--max-tokens", "-n", help="tokens to generate per answer")]
RepeatPenalty = Annotated[float, typer.Option("--repeat-penalty", help="repetition penalty; 1.0 = off")]

# bench / eval
BatchSizes = Annotated[str, typer.Option("--batch-size", "-b", help="comma-separated batch sizes, e.g. 1,4,16")]


class TableJson(str, Enum):
    table = "table"
    json = "json"


class TableJsonCsv(str, Enum):
    table = "table"
    json = "json"
    csv = "csv"


def parse_sizes(text: str) -> list[int]:
    """"1,4,16" → [1, 4, 16]."""
    try:
        sizes = [int(s) for s in text.replace(" ", "").split(",") if s]
    except ValueError:
        raise typer.BadParameter(f"{text!r}: expected comma-separated integers such as 1,4,16") from None
    if not sizes or min(sizes) < 1:
        raise typer.BadParameter(f"{text!r}: batch sizes must be ≥ 1")
    return sizes


def sampling_kwargs(temp: float, top_p: float, top_k: int, seed: int | None, max_tokens: int,
                    repeat_penalty: float = 1.0) -> dict:
    """llama.cpp flags → transformers' generation names (temp 0 → greedy)."""
    kw = {"max_new_tokens": max_tokens, "seed": seed, "repetition_penalty": repeat_penalty}
    if temp > 0:
        kw.update(do_sample=True, temperature=temp, top_p=top_p, top_k=top_k)
    elif temp < 0:
        raise typer.BadParameter("--temp must be ≥ 0")
    return kw
