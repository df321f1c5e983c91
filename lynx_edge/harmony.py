"""Harmony (the gpt-oss chat format) read from generated token ids: which channel each piece of
text belongs to. The detokenizer drops special tokens, so the markers that say "this is
reasoning, this is the answer" only exist at the token level; this parser works there.

A generation continues the prompt's `<|start|>assistant` and looks like
    <|channel|>analysis<|message|>…<|end|><|start|>assistant<|channel|>final<|message|>…<|return|>
(tool calls: `<|channel|>commentary to=functions.f <|constrain|>json<|message|>{…}<|call|>`).

    tokens = HarmonyTokens.of(engine.tokenizer)       # None: the model does not speak Harmony
    parser = HarmonyParser(engine.tokenizer, tokens)
    for chunk in engine.stream(messages):
        for channel, text in parser.feed(chunk.token_ids): ...
    parser.flush()

The parser is chosen from the tokenizer (its added tokens) and the chat template (it writes
<|channel|>), never from the model family.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .tokenizer import Detokenizer, Tokenizer

_TO = re.compile(r"\bto=(\S+)")


def is_answer(channel: str | None) -> bool:
    """The user-facing text: the final channel (or a message without a channel). Analysis (and
    commentary: tool calls and their preambles) is reasoning; the template drops it next turn."""
    return channel in (None, "final")


@dataclass(frozen=True)
class HarmonyTokens:
    start: int
    channel: int
    message: int
    end: int
    ret: int | None = None  # <|return|>: end of the answer (a stop id)
    call: int | None = None  # <|call|>: end of a tool call
    constrain: int | None = None  # <|constrain|>: the content type follows

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> "HarmonyTokens | None":
        """The marker ids when the tokenizer has them as added tokens and its chat template writes
        channels; None otherwise (other models keep plain text streaming)."""
        template = tokenizer.chat_template or ""
        if "<|channel|>" not in template and not any("<|channel|>" in t for t in tokenizer.chat_templates.values()):
            return None
        added = {t.content: i for i, t in tokenizer.tok.get_added_tokens_decoder().items()}
        ids = {n: added.get(f"<|{m}|>") for n, m in (("start", "start"), ("channel", "channel"), ("message", "message"),
                                                      ("end", "end"), ("ret", "return"), ("call", "call"),
                                                      ("constrain", "constrain"))}
        if any(ids[n] is None for n in ("start", "channel", "message", "end")):
            return None
        return cls(**ids)


@dataclass
class Message:
    role: str | None
    channel: str | None
    recipient: str | None  # to=functions.name (a tool call) or None
    content_type: str | None  # after <|constrain|> (e.g. json)
    text: str = ""
    ended_by: str | None = None  # end | return | call; None when the generation stopped inside it


class HarmonyParser:
    """Token ids → (channel, text) pieces, text streamed as it decodes; complete messages in
    `.messages`, content tokens per channel in `.tokens`.

    States: header (role, channel, recipient: from <|start|> or the prompt's `<|start|>assistant`
    to <|message|>), content (to <|end|>, <|return|> or <|call|>), between (after an end, waiting
    for <|start|>). Text outside any message (a model that breaks the format) comes out with
    channel None, so it is shown rather than lost."""

    def __init__(self, tokenizer: Tokenizer, tokens: HarmonyTokens, role: str | None = "assistant"):
        self.tok, self.t = tokenizer, tokens
        self._ends = {tokens.end: "end"}
        self._ends.update({i: n for i, n in ((tokens.ret, "return"), (tokens.call, "call")) if i is not None})
        self.messages: list[Message] = []
        self.tokens: dict[str | None, int] = {}
        self.current: Message | None = None
        self._header(role)

    # states -------------------------------------------------------------------------------
    def _header(self, role: str | None) -> None:
        self.state = "header"
        self._role = role  # known when the prompt ended with `<|start|>assistant`
        self._segments: list[tuple[str, list[int]]] = [("role", [])]  # header parts split at markers

    def _open(self) -> None:
        """<|message|>: the header is complete."""
        text = {}
        for name, ids in self._segments:
            text[name] = text.get(name, "") + " " + self.tok.decode(ids, skip_special_tokens=True)
        words = text.get("role", "").split()
        role = self._role or next((w for w in words if not w.startswith("to=")), None)
        chan = [w for w in text.get("channel", "").split() if not w.startswith("to=")]
        to = _TO.search(" ".join(text.values()))
        ctype = text.get("constrain", "").split() or chan[1:]
        self.current = Message(role, chan[0] if chan else None, to.group(1) if to else None,
                               ctype[0] if ctype else None)
        self._detok = Detokenizer(self.tok)
        self.state = "content"

    def _close(self, how: str | None) -> list[tuple[str | None, str]]:
        out = self._text(self._detok.flush())
        self.current.ended_by = how
        self.messages.append(self.current)
        self.current, self.state = None, "between"
        return out

    def _text(self, s: str) -> list[tuple[str | None, str]]:
        if not s:
            return []
        self.current.text += s
        return [(self.current.channel, s)]

    # public -------------------------------------------------------------------------------
    def push(self, token_id: int) -> list[tuple[str | None, str]]:
        t = self.t
        if self.state == "content":
            if token_id in self._ends:
                return self._close(self._ends[token_id])
            if token_id == t.start:  # a new message without an end marker
                out = self._close(None)
                self._header(None)
                return out
            ch = self.current.channel
            self.tokens[ch] = self.tokens.get(ch, 0) + 1
            return self._text(self._detok.push(token_id))
        if token_id == t.start:
            self._header(None)
        elif self.state == "header":
            if token_id == t.message:
                self._open()
            elif token_id == t.channel:
                self._segments.append(("channel", []))
            elif token_id == t.constrain:
                self._segments.append(("constrain", []))
            elif token_id in self._ends:  # a header with no message
                self.state = "between"
            else:
                self._segments[-1][1].append(token_id)
        elif token_id not in self._ends:  # between messages, text outside the format: a message of its own
            self.current, self._detok, self.state = Message(None, None, None, None), Detokenizer(self.tok), "content"
            return self.push(token_id)
        return []

    def feed(self, ids) -> list[tuple[str | None, str]]:
        return [p for i in ids for p in self.push(int(i))]

    def flush(self) -> list[tuple[str | None, str]]:
        """The generation ended: close an open message. A header that never reached <|message|>
        and has no channel (a model writing plain text after `<|start|>assistant`) is text."""
        if self.state == "header" and self._role is not None and len(self._segments) == 1 and self._segments[0][1]:
            ids = self._segments[0][1]
            self.current, self._detok, self.state = Message(None, None, None, None), Detokenizer(self.tok), "content"
            self.tokens[None] = self.tokens.get(None, 0) + len(ids)
            out = self._text("".join(self._detok.push(i) for i in ids))
            return out + self._close(None)
        if self.state == "content":
            return self._close(None)
        return []

    def split(self) -> tuple[str, str]:
        """(answer, reasoning) of the messages so far: what is_answer() says, joined."""
        msgs = self.messages + ([self.current] if self.current is not None else [])
        answer = "".join(m.text for m in msgs if is_answer(m.channel))
        reasoning = "\n".join(m.text for m in msgs if not is_answer(m.channel))
        return answer, reasoning
