"""`lynx-edge chat [MODEL]`: streaming terminal chat with the model's chat template.

The full message list is passed every turn; Engine.stream reuses the cached common prefix, so
earlier turns are never prefilled again. Ctrl-C stops an answer and keeps the session. Models
without a chat template, and any model with --raw (the embedded demo by default: a code-continuation
model never trained on chat), chat in plain text (the transcript is the prompt). Sampling flags left out
take the model's generation_config.json values (shown on stderr), as llama.cpp does. Models whose
tokenizer and template speak Harmony (gpt-oss) answer on channels: the final channel is the answer
(and what the next turn sends back), the analysis channel is reasoning, dimmed with
--show-reasoning, else hidden behind a one-line note.
"""
from __future__ import annotations

from typing import Annotated, Callable, Optional

import typer

from ..harmony import HarmonyParser, HarmonyTokens, is_answer
from . import ui
from .common import engine_options, load_engine
from .options import (SCHEDULER_STEPS, ChatTemplateKwargs, check_lynx, CtxSize, Device, Dtype, Bf16Act, Int4, Int4Act, Int4Attn, Int8Head, NoRepack, SwaFull, Lynx, MaxTokens, Model, Offload, Profile,
                      RepeatPenalty, SchedulerSteps, Seed, Temp, TopK, TopP, VerbosePrompt, parse_json_object, sampling_kwargs)

COMMANDS = {
    "/help": "show this help",
    "/reset": "forget the conversation (keeps --system)",
    "/stats": "statistics of the last answer and the session",
    "/exit": "quit (also Ctrl-D)",
}
_QUOTES = '"""'
EFFORTS = ("low", "medium", "high")


def read_message(read: Callable[[str], str] = ui.read_line) -> str:
    """One user message: a line; lines ending with \\ continue; \"\"\" … \"\"\" spans lines.
    Raises EOFError on Ctrl-D at the first prompt."""
    first = read("> ")
    if first.lstrip().startswith(_QUOTES):
        text, lines = first.lstrip()[3:], []
        while not text.rstrip().endswith(_QUOTES):
            lines.append(text)
            text = read("… ")
        lines.append(text.rstrip()[:-3])
        return "\n".join(lines).strip("\n")
    lines = [first]
    while lines[-1].endswith("\\"):
        lines[-1] = lines[-1][:-1]
        lines.append(read("… "))
    return "\n".join(lines)


class _Answer:
    """One answer streamed to the terminal → its text. Plain models: the chunks' text. Harmony:
    the answer channel's text; reasoning dimmed (show) or counted on one note line (hidden)."""

    def __init__(self, tok, harmony: HarmonyTokens | None, show_reasoning: bool, notes_to_stderr: bool):
        self.parser = HarmonyParser(tok, harmony) if harmony is not None else None
        self.show, self.stderr = show_reasoning, notes_to_stderr
        self.text, self.hidden, self.thinking = "", 0, False

    def add(self, chunk) -> None:
        if self.parser is None:
            ui.write(chunk.text)
            self.text += chunk.text
            return
        for channel, text in self.parser.feed(chunk.token_ids):
            self._piece(channel, text)
        if not self.show and self.thinking:
            self.hidden = sum(n for c, n in self.parser.tokens.items() if not is_answer(c))
            ui.hidden_reasoning(self.hidden, done=False, stderr=self.stderr)

    def _piece(self, channel, text: str) -> None:
        if is_answer(channel):
            self._end_reasoning()
            ui.write(text)
            self.text += text
        else:
            self.thinking = True
            if self.show:
                ui.reasoning(text)

    def _end_reasoning(self) -> None:
        if not self.thinking:
            return
        self.thinking = False
        if self.show:
            ui.write("\n")  # the answer starts on its own line, undimmed
        else:
            self.hidden = sum(n for c, n in self.parser.tokens.items() if not is_answer(c))
            ui.hidden_reasoning(self.hidden, done=True, stderr=self.stderr)

    def finish(self) -> None:
        """The generation ended or was stopped: what the parser still holds, the note if due."""
        if self.parser is not None:
            for channel, text in self.parser.flush():
                self._piece(channel, text)
            self._end_reasoning()


class ChatSession:
    """The conversation: messages, sampling, the engine, and the last turn's stats."""

    def __init__(self, engine, system: str | None, sampling: dict, chat_template_kwargs: dict | None = None,
                 verbose_prompt: bool = False, show_reasoning: bool = False, raw: bool = False):
        self.engine, self.sampling = engine, sampling
        self.template_kwargs = dict(chat_template_kwargs or {})
        self.verbose_prompt, self.show_reasoning = verbose_prompt, show_reasoning
        # no chat template (or raw completion asked for): plain-text chat, the running transcript is the prompt
        tok = getattr(engine, "tokenizer", None)
        self.no_template = tok is not None and not getattr(tok, "chat_template", None)
        self.plain = raw or self.no_template
        # a Harmony tokenizer and template (gpt-oss): the answer comes on channels
        self.harmony = HarmonyTokens.of(tok) if tok is not None and not self.plain else None
        self.system = [{"role": "system", "content": system}] if system else []
        self.messages = list(self.system)
        self.last: dict = {}
        self.failed = False  # the last turn ended in an error (chat -p then exits non-zero)
        self.turns = 0
        self.generated = 0

    def turn(self, text: str, stats_to_stderr: bool = False) -> str:
        """Stream one answer to `text`; Ctrl-C keeps what was said so far."""
        from ..engine import ContextError

        self.messages.append({"role": "user", "content": text})
        out = _Answer(self.engine.tokenizer if self.harmony else None, self.harmony, self.show_reasoning,
                      stats_to_stderr)
        stats, finish, stream = None, None, None
        self.failed = False
        try:
            prompt = self.prompt()
            if self.verbose_prompt:
                ui.note(prompt if isinstance(prompt, str) else self.rendered(), stderr=True)
            kwargs = {"chat_template_kwargs": self.template_kwargs} if self.template_kwargs and not self.plain else {}
            stream = self.engine.stream(prompt, **kwargs, **self.sampling)
            for chunk in stream:
                out.add(chunk)
                stats = chunk.stats or stats
                finish = chunk.finish_reason or finish
        except KeyboardInterrupt:
            if stream is not None:
                stream.close()  # the engine summarises what it did before the stop
                stats = stats or getattr(self.engine, "last_stats", None) or None
            out.finish()
            ui.write("\n")
            ui.note("(stopped)", stderr=stats_to_stderr)
        except ContextError as exc:
            self.messages.pop()
            ui.error(str(exc), "/reset to start a new conversation")
            self.failed = True
            return ""
        else:
            out.finish()
            ui.write("\n")
            if finish == "length":  # say so: a cut answer must not read as a finished one
                ui.note("(cut at the token limit: raise -n / --max-tokens)", stderr=stats_to_stderr)
        answer = out.text  # Harmony: the final channel only, as the template sends earlier turns back
        if not answer and stats is None:  # interrupted before the first token: forget the question
            self.messages.pop()
            return ""
        self.messages.append({"role": "assistant", "content": answer})
        self.turns += 1
        if stats:
            self.last = stats
            self.generated += stats.get("completion_tokens", 0)
            ui.stats_line(stats, stderr=stats_to_stderr)
        return answer

    def prompt(self):
        """What Engine.stream gets: the messages, or the plain-text transcript without a template."""
        if not self.plain:
            return self.messages
        text = ""
        for m in self.messages:  # the model's answers continue the text they answered
            text += m["content"] if m["role"] == "assistant" else ("\n" if text else "") + m["content"]
        return text

    def rendered(self) -> str:
        """The prompt text the model sees this turn (for --verbose-prompt)."""
        if self.plain:
            return self.prompt()
        return self.engine.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True,
                                                         **self.template_kwargs)

    def reset(self) -> None:
        self.messages = list(self.system)
        self.engine.reset()
        self.last = {}

    def show_stats(self) -> None:
        context = len(self.engine.encode_prompt(self.prompt(), None if self.plain else self.template_kwargs)) \
            if len(self.messages) > len(self.system) else 0
        rows = {"turns": self.turns, "context tokens": f"{context} / {self.engine.ctx}",
                "generated tokens": self.generated,
                "lynx mode": self.engine.config.lynx}
        if self.last:
            rows["last answer"] = " · ".join(ui.stats_parts(self.last))
            for part in ("lynx", "offload"):  # telemetry summaries, without per-layer detail
                if isinstance(self.last.get(part), dict):
                    rows[part] = {k: round(v, 3) if isinstance(v, float) else v
                                  for k, v in self.last[part].items() if k != "per_layer"}
        ui.kv_table("session", rows)

    def command(self, line: str) -> bool:
        """Handle a /command; → False to end the session."""
        cmd = line.strip().split()[0].lower()
        if cmd in ("/exit", "/quit", "/bye"):
            return False
        if cmd == "/reset":
            self.reset()
            ui.note("conversation cleared", stderr=False)
        elif cmd == "/stats":
            self.show_stats()
        elif cmd == "/help":
            ui.kv_table("commands", COMMANDS)
        else:
            ui.error(f"unknown command {cmd}", "/help lists the commands")
        return True

    def loop(self, read: Callable[[str], str] = ui.read_line) -> None:
        while True:
            try:
                text = read_message(read)
            except EOFError:
                ui.write("\n")
                return
            except KeyboardInterrupt:
                ui.write("\n")
                ui.note("(Ctrl-D or /exit to quit)", stderr=False)
                continue
            if not text.strip():
                continue
            if text.startswith("/") and "\n" not in text:
                if not self.command(text):
                    return
                continue
            self.turn(text)


def _ctrl_c_on_a_terminal() -> None:
    """Ctrl-C at an interactive prompt must stop the answer / clear the line, however the process
    was started: a shell without job control starts background commands with SIGINT ignored, and
    Python then installs no KeyboardInterrupt handler (found when a test ran under such a shell:
    ^C did nothing). On a terminal, take SIGINT back."""
    import signal
    import sys

    if sys.stdin.isatty() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def chat(
    model: Model = "demo",
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="answer one message and exit")] = None,
    system: Annotated[Optional[str], typer.Option("--system", help="system message")] = None,
    chat_template_kwargs: ChatTemplateKwargs = None,
    reasoning_effort: Annotated[Optional[str], typer.Option("--reasoning-effort", help="low | medium | high: the chat template's reasoning_effort (gpt-oss); short for --chat-template-kwargs '{\"reasoning_effort\": …}'")] = None,
    show_reasoning: Annotated[bool, typer.Option("--show-reasoning", help="show the model's reasoning (Harmony analysis channel), dimmed; hidden by default")] = False,
    verbose_prompt: VerbosePrompt = False,
    raw: Annotated[Optional[bool], typer.Option("--raw/--no-raw", help="raw completion: no chat template, the model continues what you type (llama.cpp's -no-cnv, ollama's raw); default: on for the embedded demo (a code-continuation model), off otherwise")] = None,
    temp: Temp = None,
    top_p: TopP = None,
    top_k: TopK = None,
    seed: Seed = None,
    max_tokens: MaxTokens = None,
    repeat_penalty: RepeatPenalty = None,
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
    ctx_size: CtxSize = None,
    dtype: Dtype = None,
    device: Device = None,
    num_scheduler_steps: SchedulerSteps = SCHEDULER_STEPS,
) -> None:
    """Chat in the terminal (streaming; the KV cache is reused across turns)."""
    template_kwargs = parse_json_object(chat_template_kwargs, "--chat-template-kwargs")
    if reasoning_effort is not None:
        if reasoning_effort not in EFFORTS:
            raise typer.BadParameter(f"{reasoning_effort!r}: use {', '.join(EFFORTS)}", param_hint="--reasoning-effort")
        template_kwargs["reasoning_effort"] = reasoning_effort
    lynx = check_lynx(lynx)  # a bad value fails now, not after the load
    opts = engine_options(lynx, offload, int4, profile, ctx_size, int4_act=int4_act, int4_attn=int4_attn, int8_head=int8_head,
                          no_repack=no_repack, swa_full=swa_full, bf16_act=bf16_act)
    engine = load_engine(model, dtype, device, num_scheduler_steps=num_scheduler_steps, **opts)
    gen = getattr(engine, "generation_config", None)
    sampling, from_model = sampling_kwargs(temp, top_p, top_k, seed, max_tokens, repeat_penalty,
                                           gen.defaults if gen is not None else None)
    if from_model:
        ui.note("sampling defaults from the model's generation_config.json: "
                + " ".join(f"{k}={v}" for k, v in from_model.items()) + " (flags override)", stderr=True)
    demo = ui.is_demo(str(engine.model_dir))  # never trained on chat data: it continues code (ui.DEMO_NOTE says so)
    session = ChatSession(engine, system, sampling, template_kwargs, verbose_prompt, show_reasoning,
                          demo if raw is None else raw)
    if session.plain and (session.no_template or raw or template_kwargs):
        ui.note(("this model has no chat template: plain-text chat" if session.no_template else
                 "raw completion: no chat template, the model continues your text")
                + (" (--chat-template-kwargs ignored)" if template_kwargs else ""), stderr=True)
    elif reasoning_effort is not None and "reasoning_effort" not in (engine.tokenizer.chat_template or ""):
        ui.note("this model's chat template does not read reasoning_effort (--reasoning-effort ignored)", stderr=True)
    if show_reasoning and session.harmony is None:
        ui.note("this model's output has no reasoning channel (--show-reasoning ignored)", stderr=True)
    if prompt is not None:
        ui.model_note(demo, session.plain)
        session.turn(prompt, stats_to_stderr=True)
        if session.failed:
            raise typer.Exit(1)
        return
    ui.chat_banner(str(engine.model_dir), opts["lynx"], COMMANDS, session.plain, demo)
    _ctrl_c_on_a_terminal()
    session.loop()
