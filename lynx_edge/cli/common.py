"""What the commands share: building the Engine from options, finding optional library parts
(offload, int4, eval, quant) that other builds may lack, and turning exceptions into one line."""
from __future__ import annotations

import dataclasses
import importlib

from . import ui


class CliError(Exception):
    """A user-facing failure: one line and a hint."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


def need(candidates: list[tuple[str, str]], what: str, hint: str = "this build lacks it; update lynx-edge"):
    """The first (module, attribute) that exists → the attribute; else a CliError saying this
    build lacks `what`. A module that exists but fails to import raises its real error."""
    for module, attr in candidates:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and module.startswith(exc.name):
                continue
            raise
        if hasattr(mod, attr):
            return getattr(mod, attr)
    names = " or ".join(f"{m}.{a}" for m, a in candidates)
    raise CliError(f"{what} is not available in this build (no {names})", hint)


def lynx_mode(text: str) -> str:
    """--lynx values pass through: "on" is lynx.RECOMMENDED, "lynx" the paper's rule."""
    return text.strip().lower()


def engine_options(lynx: str = "off", offload: bool = False, int4: bool = False, profile: str | None = None,
                   ctx_size: int | None = None, record_routing: bool = True, int4_act=None,
                   int4_attn: bool = False, int8_head: bool = False, no_repack: bool = False,
                   swa_full: bool = False, bf16_act=None) -> dict:
    """Options → Engine.from_pretrained keywords; offload/int4/profile only where this build's
    EngineConfig has them (an `offload` field typed OffloadOptions gets the profile inside)."""
    from ..engine import EngineConfig

    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    as_options = offload and "offload" in fields and "OffloadOptions" in str(fields["offload"].type)
    opts = {"lynx": lynx_mode(lynx), "record_routing": record_routing, "ctx_size": ctx_size}
    for name, value, flag in (("offload", offload, "--offload"), ("int4", int4, "--int4"),
                              ("profile", profile, "--profile")):
        if value in (False, None) or (name == "profile" and as_options):
            continue
        if name not in fields:
            raise CliError(f"{flag} is not available in this build", "run without it")
        opts[name] = value
    if int4_act is not None:
        opts["int4_act"] = getattr(int4_act, "value", int4_act)
    if bf16_act is not None:
        opts["bf16_act"] = getattr(bf16_act, "value", bf16_act)
    if int4_attn:
        opts["int4_attn"] = True
    if int8_head:
        opts["int8_head"] = True
    if no_repack:
        opts["repack"] = False
    if swa_full:
        opts["swa_full"] = True
    if as_options:
        from ..offload import OffloadOptions

        opts["offload"] = OffloadOptions(profile=profile)
    return opts


def load_engine(model: str, dtype: str | None = None, device: str | None = None, **options):
    """Engine.from_pretrained with a loading progress bar (bytes of weights read)."""
    from ..engine import Engine

    with ui.progress("loading") as progress:
        engine = Engine.from_pretrained(model, dtype=dtype, device=device, progress=progress, **options)
    line = int4_bytes_note(engine)
    if line:
        ui.note(line, stderr=True)
    return engine


def int4_bytes_note(engine) -> str | None:
    """On a CPU with 4-bit experts: when the weights every token reads whatever the routing
    (attention, output head) are still 16-bit and most of the bytes, a line saying so and naming
    the flags that shrink them. A CPU decode step is bound by the bytes it reads, and on a real
    model (Qwen3-30B-A3B: ~2.4 GB of bf16 attention and head against ~0.9 GB of 4-bit active
    experts per token) --int4 alone leaves most of them 16-bit. None otherwise."""
    from ..modelinfo import bytes_per_param, dense_decode_bytes, param_counts

    pl = engine.model.placement
    flags = [f for f, done in (("--int4-attn", pl.packed_linears), ("--int8-head", pl.int8_head)) if not done]
    if pl.device != "cpu" or pl.experts != "int4" or not flags:
        return None
    counts = param_counts(engine.cfg)
    experts = counts["moe_layers"] * engine.cfg.top_k * counts["params_per_expert"] * bytes_per_param("int4")
    dense = dense_decode_bytes(engine.model)
    share = dense / (dense + experts)
    if share < 0.3:
        return None
    what = {2: "attention and output head", 1: "output head" if pl.packed_linears else "attention"}[len(flags)]
    # the 4-bit rows' activations: int16 by default (near-exact), fp32 when asked; int8 ones are the
    # fastest at several tokens (on Qwen3-30B-A3B's shapes, a Zen3, 1-2 threads, over fp32: 1.14-1.24x at
    # B=1, 1.25-1.50x at B=16; vs_llamacpp_a3b_s23.md; the demo's checkpoint over int16: 1.12x at B=16)
    q8 = "" if getattr(pl, "int4_act", None) == "q8" else \
        "; --int4-act q8 runs the 4-bit rows on int8 activations, integer dot products as Q4_0 x Q8_0"
    return (f"experts 4-bit: {experts / 1e6:.3g} MB per decode token; the other weights every token reads: "
            f"{dense / 1e6:.3g} MB ({share:.0%} of those bytes), {what} still {pl.dtype}. On a CPU {' '.join(flags)} "
            f"read {'them' if len(flags) > 1 else 'it'} in fewer bits, as llama.cpp's Q4_0 does{q8} (approximate)")


def explain(exc: BaseException) -> tuple[str, str | None]:
    """An exception → (one-line message, hint)."""
    from ..config import ConfigError
    from ..hub import ALIASES, ModelNotFound

    msg = " ".join(str(exc).split()) or type(exc).__name__
    name = type(exc).__name__
    if isinstance(exc, CliError):
        return msg, exc.hint
    if isinstance(exc, ModelNotFound):
        hint = "MODEL is a local directory, an HF repo id (org/name) or an alias"
        return msg, hint if "alias" in msg or "hf download" in msg else hint + ": " + ", ".join(["demo", *ALIASES])
    if name == "ProfileError":
        return msg, "`lynx-edge profile -o FILE` measures this machine"
    if name == "PlanError":
        return msg, "`lynx-edge info MODEL` with the same options shows the whole memory plan"
    if name == "TokenizerError" or (isinstance(exc, ConfigError) and ("config.json" in msg or "model_type" in msg)):
        return msg, "lynx-edge reads stock HF checkpoints of mixtral, qwen2_moe, qwen3_moe and olmoe"
    if name == "ContextError":
        return msg, "raise --ctx-size or shorten the prompt"
    if name == "OutOfMemoryError":
        return f"out of memory: {msg[:160]}", "try --offload, --int4 or a smaller --ctx-size / batch"
    if isinstance(exc, (ValueError, TypeError)):
        return msg, "check the option values (--help)"
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError)):
        return msg, "check the path"
    return f"{name}: {msg}", "rerun with LYNX_DEBUG=1 for the traceback"
