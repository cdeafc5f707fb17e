"""Text in and out of a served model: prompts to ids, ids back to text as they arrive, and chat messages rendered
with the checkpoint's chat template (`jaxnn.interop.chat`, rendered as transformers renders it)."""

from __future__ import annotations

import codecs
import pathlib
from collections.abc import Sequence
from typing import Any

from jaxnn.errors import ChatTemplateError
from jaxnn.interop.chat import ChatTemplate
from jaxnn.interop.tokenizer import TOKENIZER_FILE, load_tokenizer


class Codec:
    """Encodes prompts and decodes new ids: with a `tokenizers.Tokenizer`, else as UTF-8 bytes (vocabulary 256);
    chat messages through the checkpoint's `ChatTemplate` (`jaxnn.interop.chat`)."""

    def __init__(self, tokenizer: Any = None, chat_template: ChatTemplate | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    @classmethod
    def from_folder(cls, folder: pathlib.Path | None, template_file: str | None = None) -> Codec:
        """The codec of a checkpoint's tokenizer folder (None: bytes); `template_file` replaces its template."""
        tokenizer = None
        if folder is not None and (folder / TOKENIZER_FILE).is_file():
            tokenizer = load_tokenizer(folder / TOKENIZER_FILE)
        try:
            return cls(tokenizer, ChatTemplate.from_folder(folder, template_file))
        except ChatTemplateError as err:  # a --chat-template file that cannot be read: the command's bad input
            raise ValueError(str(err)) from None

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode())
        return list(self.tokenizer.encode(text).ids)

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """The ids of `messages` rendered with the chat template, ending with the assistant's turn opened."""
        if self.chat_template is None:
            raise ChatTemplateError(
                "this model has no chat template; use /v1/completions, or serve it with --chat-template FILE"
            )
        text = self.chat_template.render(messages, add_generation_prompt=True)
        if self.tokenizer is None:
            return list(text.encode())
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

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
