"""Tokenizer: tokenizer.json through `tokenizers`, special tokens from tokenizer_config.json, the
chat template rendered in a sandboxed jinja2 environment as transformers does (same globals,
filters, `{% generation %}` tag and keyword arguments), and an incremental detokenizer whose
joined output always equals the full decode.
"""
from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

# transformers passes the named special tokens that are set (its special_tokens_map) to the template
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# names a message's reasoning may come under; transformers copies it to reasoning_content and thinking
_REASONING = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class TokenizerError(ValueError):
    """Missing or unusable tokenizer files."""


def _token_str(v) -> str | None:
    # tokenizer_config.json writes special tokens as strings or as AddedToken dicts
    if isinstance(v, dict):
        return v.get("content")
    return v


def _raise(msg):
    raise TemplateError(msg)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # as transformers: no HTML escaping (jinja's own tojson escapes <>&'), options passed through
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Generation(Extension):
    """`{% generation %}…{% endgeneration %}` (transformers marks assistant text with it): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """namespace() that refuses underscore names (no reaching into CPython internals), as transformers."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates cannot store underscore attributes on a namespace ({name!r})")


def _plain(value):
    """A deep copy made of plain JSON types only (the template never sees the caller's objects)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    for base in (str, int, float):  # subclasses (enums…) back to the base type
        if isinstance(value, base):
            return base(value)
    return f"<{type(value).__name__}>"


def _normalise(messages: list[dict]) -> list[dict]:
    # as transformers: keys whose value is None are dropped; reasoning copied under its known names
    out = []
    for m in messages:
        if not isinstance(m, dict):
            raise TypeError(f"chat messages must be dicts, got {m!r}")
        m = {k: _plain(v) for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{path}: missing tokenizer file (lynx-edge needs tokenizer.json)")
        try:
            self.tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
            raise TokenizerError(f"{path}: cannot read tokenizer ({exc})") from None
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        self.pad_token = _token_str(cfg.get("pad_token"))
        self.special_tokens = {n: str(_token_str(cfg[n])) for n in _SPECIAL_NAMES if _token_str(cfg.get(n)) is not None}
        self.add_bos = bool(cfg.get("add_bos_token", False))
        template = cfg.get("chat_template")
        jinja_file = model_dir / "chat_template.jinja"  # transformers ≥ 4.43 may save it apart
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        # named templates (a list of {name, template}): "default", or "tool_use" when tools are given
        self.chat_templates = {t["name"]: t["template"] for t in template} if isinstance(template, list) else {}
        self.chat_template = self.chat_templates.get("default") if self.chat_templates else template
        self._compiled: dict[str, jinja2.Template] = {}
        self._byte_ids: frozenset[int] | None = None
        self.special_ids = frozenset(i for i, t in self.tok.get_added_tokens_decoder().items() if t.special)

    # ids ------------------------------------------------------------------------------
    @property
    def eos_token_id(self) -> int | None:
        return self.tok.token_to_id(self.eos_token) if self.eos_token else None

    @property
    def bos_token_id(self) -> int | None:
        return self.tok.token_to_id(self.bos_token) if self.bos_token else None

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=add_special_tokens).ids
        # Some tokenizer.json files lack the BOS post-processor that tokenizer_config.json asks for.
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def byte_ids(self) -> frozenset[int]:
        """Ids of SentencePiece byte-fallback tokens (<0x00>…<0xFF>); empty for byte-level BPE."""
        if self._byte_ids is None:
            ids: frozenset[int] = frozenset()
            if getattr(self.tok.model, "byte_fallback", False):
                ids = frozenset(i for t, i in self.tok.get_vocab(with_added_tokens=False).items()
                                if _BYTE_TOKEN.fullmatch(t))
            self._byte_ids = ids
        return self._byte_ids

    # chat -----------------------------------------------------------------------------
    def _template(self, chat_template: str | None, tools) -> str:
        if chat_template is not None and chat_template in self.chat_templates:
            return self.chat_templates[chat_template]
        if chat_template is not None:
            return chat_template
        if tools and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if not self.chat_template:
            raise TokenizerError("this model has no chat template; pass a plain prompt string instead")
        return self.chat_template

    def _compile(self, source: str) -> jinja2.Template:
        if source not in self._compiled:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[_Generation, "jinja2.ext.loopcontrols"])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.globals["namespace"] = _Namespace
            self._compiled[source] = env.from_string(source)
        return self._compiled[source]

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            documents: list[dict] | None = None, chat_template: str | None = None,
                            add_generation_prompt: bool = False, continue_final_message: bool | str = False,
                            **kwargs) -> str:
        """The rendered text, as transformers' `apply_chat_template(..., tokenize=False)`: same
        defaults (add_generation_prompt=False), every extra keyword (enable_thinking,
        reasoning_effort, …) reaches the template, special tokens are visible unless overridden."""
        if not messages:
            raise ValueError("cannot apply the chat template to an empty conversation")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible")
        template = self._template(chat_template, tools)
        chat = _normalise(messages)
        field = None
        if continue_final_message:
            # as transformers: tag the end of the final message, render, cut at the tag
            field = continue_final_message if isinstance(continue_final_message, str) else "content"
            if not isinstance(chat[-1].get(field), str):
                raise ValueError(f"continue_final_message: the final message has no text {field!r} to continue")
            final = chat[-1][field]
            for f in ([k for k in _REASONING if chat[-1].get(k) == final] if field in _REASONING else [field]):
                chat[-1][f] = final + _CONTINUE_TAG
        values = {**self.special_tokens, **_plain(kwargs)}
        text = self._compile(template).render(messages=chat, tools=_plain(tools), documents=_plain(documents),
                                              add_generation_prompt=add_generation_prompt, **values)
        if field is not None:
            at = text.rfind(_CONTINUE_TAG.strip())
            if at < 0:
                raise ValueError("continue_final_message: the template dropped the final message")
            text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
        return text

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool | None = None, **kwargs) -> list[int]:
        """Ids of the rendered chat, as transformers' apply_chat_template(tokenize=True): the template
        writes the special tokens. Adds the generation prompt unless continuing the final message."""
        if add_generation_prompt is None:
            add_generation_prompt = not kwargs.get("continue_final_message")
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)


class Detokenizer:
    """Incremental decode whose pieces join to exactly `decode(all ids)`, each emitted prefix a
    prefix of the final text.

    It re-decodes a short window (prefix..) and emits what the newest token added, holding back:
    - text ending in U+FFFD (a byte-level BPE character still incomplete; flush() gives it up);
    - any byte-fallback token (<0xNN>, SentencePiece): its run is decoded as a whole — valid UTF-8
      becomes text, otherwise every byte becomes U+FFFD — so a run's text is final only once a
      non-byte token ends it. The window always starts after a non-byte token, never inside a run.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.bytes = tokenizer.byte_ids
        # skipped special tokens vanish before the decoder runs, so they do not end a byte run
        self.silent = tokenizer.special_ids if skip_special_tokens and self.bytes else frozenset()
        self.ids: list[int] = []
        self.prefix = 0  # start of the window that is re-decoded
        self.read = 0  # end of what has been emitted

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        if token_id in self.bytes or token_id in self.silent:
            return ""  # inside a byte run: its text may still change
        before = self.tok.decode(self.ids[self.prefix : self.read], self.skip)
        after = self.tok.decode(self.ids[self.prefix :], self.skip)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""  # an incomplete UTF-8 sequence: wait for the next token

    def flush(self) -> str:
        before = self.tok.decode(self.ids[self.prefix : self.read], self.skip)
        after = self.tok.decode(self.ids[self.prefix :], self.skip)
        self.prefix = self.read = len(self.ids)
        return after[len(before) :]
