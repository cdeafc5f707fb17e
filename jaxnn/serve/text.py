"""Text in and out of a served model: prompts to ids, ids back to text as they arrive, and chat messages rendered
with the checkpoint's chat template.

The template is rendered as transformers renders it (a sandboxed Jinja environment with `trim_blocks`,
`lstrip_blocks`, the `raise_exception` and `strftime_now` globals and a `tojson` that keeps non-ASCII text), and its
text is tokenised without adding special tokens, since a template writes them itself. The sandbox keeps a template
from reading files or running code.
"""

from __future__ import annotations

import codecs
import datetime
import json
import pathlib
from collections.abc import Sequence
from typing import Any

from jaxnn.errors import ChatTemplateError
from jaxnn.interop.tokenizer import TOKENIZER_FILE, json_object, load_tokenizer


class Codec:
    """Encodes prompts and decodes new ids: with a `tokenizers.Tokenizer`, else as UTF-8 bytes (vocabulary 256)."""

    def __init__(self, tokenizer: Any = None, chat_template: str | None = None, special: dict | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.special = special or {}  # bos_token, eos_token, ... as text, for the template

    @classmethod
    def from_folder(cls, folder: pathlib.Path | None, template_file: str | None = None) -> Codec:
        """The codec of a checkpoint's tokenizer folder (None: bytes); `template_file` replaces its template."""
        config = json_object(folder / "tokenizer_config.json") if folder is not None else {}
        tokenizer = None
        if folder is not None and (folder / TOKENIZER_FILE).is_file():
            tokenizer = load_tokenizer(folder / TOKENIZER_FILE)
        template = config.get("chat_template")
        if folder is not None and template is None and (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        if template_file is not None:
            template = _read_template(template_file)
        if isinstance(template, list):  # transformers' list form: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        special = {k: _token_text(v) for k, v in config.items() if k.endswith("_token") and _token_text(v)}
        return cls(tokenizer, template if isinstance(template, str) else None, special)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode())
        return list(self.tokenizer.encode(text).ids)

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """The ids of `messages` rendered with the chat template, ending with the assistant's turn opened."""
        text = self.render_chat(messages)
        if self.tokenizer is None:
            return list(text.encode())
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        if self.chat_template is None:
            raise ChatTemplateError(
                "this model has no chat template; use /v1/completions, or serve it with --chat-template FILE"
            )
        try:
            return (
                _environment()
                .from_string(self.chat_template)
                .render(messages=messages, add_generation_prompt=True, **self.special)
            )
        except ChatTemplateError:
            raise
        except Exception as err:  # noqa: BLE001 - a template's own errors (undefined names, bad filters)
            raise ChatTemplateError(
                f"the chat template failed on these messages: {type(err).__name__}: {err}"
            ) from None

    def decoder(self) -> IncrementalDecoder:
        return IncrementalDecoder(self.tokenizer)


class IncrementalDecoder:
    """Text of a growing list of ids, handed out as it becomes final: a character split across ids (a UTF-8
    sequence over several byte tokens) waits for its last piece."""

    def __init__(self, tokenizer: Any = None):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._bytes = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, ids: Sequence[int], final: bool = False) -> str:
        """The new text that `ids` complete."""
        if self.tokenizer is None:
            new = self._bytes.decode(bytes(i for i in ids if i < 256), final=final)
            self.text += new
            return new
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd") and not final:
            return ""  # an unfinished character: wait for the ids that finish it
        new, self.text = text[len(self.text) :], text
        return new


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_template(path: str) -> str:
    file = pathlib.Path(path)
    if not file.is_file():
        raise ValueError(f"--chat-template {path}: no such file")
    text = file.read_text()
    if file.suffix == ".json":  # a tokenizer_config.json, or {"chat_template": ...}
        text = json.loads(text).get("chat_template", "")
    if not text.strip():
        raise ValueError(f"--chat-template {path}: holds no template")
    return text


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _environment() -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env
