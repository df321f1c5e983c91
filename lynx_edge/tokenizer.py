"""Tokenizer: tokenizer.json through `tokenizers`, special tokens from tokenizer_config.json, the
chat template rendered in a sandboxed jinja2 environment as transformers does, and an
incremental detokenizer that never emits half a UTF-8 character.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


class TokenizerError(ValueError):
    """Missing or unusable tokenizer files."""


def _token_str(v) -> str | None:
    # tokenizer_config.json writes special tokens as strings or as AddedToken dicts
    if isinstance(v, dict):
        return v.get("content")
    return v


def _raise(msg):
    raise TemplateError(msg)


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
        self.add_bos = bool(cfg.get("add_bos_token", False))
        template = cfg.get("chat_template")
        jinja_file = model_dir / "chat_template.jinja"  # transformers ≥ 4.43 may save it apart
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        if isinstance(template, list):  # named templates: take "default"
            template = {t["name"]: t["template"] for t in template}.get("default")
        self.chat_template = template
        self._compiled = None

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

    # chat -----------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise TokenizerError("this model has no chat template; pass a plain prompt string instead")
        if self._compiled is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
                x, indent=indent, ensure_ascii=ensure_ascii
            )
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._compiled = env.from_string(self.chat_template)
        return self._compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            pad_token=self.pad_token or "",
            tools=None,
        )

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        # As transformers' apply_chat_template(tokenize=True): the template writes the specials.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)


class Detokenizer:
    """Incremental decode: re-decodes a short window and emits only completed characters."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # start of the window that is re-decoded
        self.read = 0  # end of what has been emitted

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
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
