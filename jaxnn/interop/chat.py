"""A checkpoint's chat template: conversations (`[{"role", "content"}, ...]`) rendered to text as transformers
renders them, for fine-tuning on chat records (`jaxnn.data.records`) and for `jaxnn serve`'s chat endpoint.

The template is the folder's (`chat_template` in tokenizer_config.json, or chat_template.jinja), or a file given
instead. It is rendered in a sandboxed Jinja environment with transformers' settings (`trim_blocks`,
`lstrip_blocks`, the `raise_exception` and `strftime_now` globals, a `tojson` that keeps non-ASCII text, the
special tokens of tokenizer_config.json as variables), and its text is tokenised without adding special tokens,
since a template writes them itself: the ids equal transformers' `apply_chat_template` for the same folder. The
sandbox keeps a template from reading files or running code.

    template = ChatTemplate.from_folder("tinyllama")           # None where the folder has none
    template.render(messages, add_generation_prompt=True)     # "<|user|>\\nHi</s>\\n<|assistant|>\\n"
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
from typing import Any

from jaxnn.errors import ChatTemplateError
from jaxnn.interop.tokenizer import json_object

TEMPLATE_FILE = "chat_template.jinja"


class ChatTemplate:
    """A chat template and the special-token variables it is rendered with."""

    def __init__(self, source: str, special: dict[str, str] | None = None):
        self.source = source
        self.special = special or {}
        self._compiled: Any = None

    @classmethod
    def from_folder(cls, folder: str | os.PathLike | None, template_file: str | None = None) -> ChatTemplate | None:
        """The template of a checkpoint's tokenizer folder, `template_file`'s instead where given (a Jinja file, or a
        JSON file holding `chat_template`); None where there is none."""
        config = json_object(pathlib.Path(folder) / "tokenizer_config.json") if folder is not None else {}
        source = config.get("chat_template")
        if isinstance(source, list):  # transformers' named form: [{"name": "default", "template": ...}, ...]
            source = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}.get("default")
        if source is None and folder is not None and (pathlib.Path(folder) / TEMPLATE_FILE).is_file():
            source = (pathlib.Path(folder) / TEMPLATE_FILE).read_text()
        if template_file is not None:
            source = read_template(template_file)
        if not isinstance(source, str):
            return None
        special = {k: _token_text(v) for k, v in config.items() if k.endswith("_token") and _token_text(v)}
        return cls(source, special)  # type: ignore[arg-type]

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """The conversation as text; a template's own refusal or failure is one ChatTemplateError."""
        if self._compiled is None:
            self._compiled = _environment().from_string(self.source)
        try:
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.special)
        except ChatTemplateError:
            raise
        except Exception as err:  # noqa: BLE001 - a template's own errors (undefined names, bad filters)
            detail = f"{type(err).__name__}: {err}"
            raise ChatTemplateError(f"the chat template failed on these messages: {detail}") from None


def read_template(path: str) -> str:
    """A template file's text: Jinja, or a JSON file (a tokenizer_config.json) holding `chat_template`."""
    file = pathlib.Path(path)
    if not file.is_file():
        raise ChatTemplateError(f"--chat-template {path}: no such file")
    text = file.read_text()
    if file.suffix == ".json":
        try:
            text = json.loads(text).get("chat_template", "")
        except (ValueError, AttributeError):
            raise ChatTemplateError(f"--chat-template {path}: not a JSON object holding chat_template") from None
    if not isinstance(text, str) or not text.strip():
        raise ChatTemplateError(f"--chat-template {path}: holds no template")
    return text


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


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


__all__ = ["ChatTemplate", "read_template"]
