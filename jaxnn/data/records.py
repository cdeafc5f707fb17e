"""Fine-tuning text as users have it: JSON Lines of `{"text": ...}` documents, `{"prompt": ..., "completion":
...}` pairs or `{"messages": [{"role", "content"}, ...]}` conversations, tokenised with a checkpoint's tokenizer
(or read as bytes), as a `TextCorpus` whose completions (a conversation's assistant turns) alone count in the loss.

    corpus = load_text_records("train.jsonl", tokenizer)     # or a folder of *.jsonl files
    corpus = load_text_records("chat.jsonl", tokenizer, chat_template=ChatTemplate.from_folder(folder))
    jaxnn.fit(model, corpus, loss=jaxnn.train.lm_loss, ...)    # batches carry a `loss_mask` for prompts

Each text or prompt/completion record ends with a separator (the tokenizer's end-of-text token, or a newline for
bytes), which counts as a target: the model learns where a completion stops. A conversation is rendered whole with
the chat template (`jaxnn.interop.chat`: its ids are transformers' `apply_chat_template`'s) and needs no separator:
each assistant turn's tokens (what the template writes from the end of the turns before it, with the assistant's
turn opened, to the end of that turn, its end marker included) count, the rest does not. The last `test_fraction`
of the records (at least one) is the test split. Windows are cut from the records' concatenation, as for any text
corpus.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from jaxnn.data.datasets import DataError, TextCorpus
from jaxnn.data.loaders import TEXT_SUFFIXES
from jaxnn.interop.tokenizer import END_TOKENS, end_token

RECORD_SUFFIX = ".jsonl"


def is_record_source(path: str | os.PathLike) -> bool:
    """A .jsonl file, or a folder holding one."""
    path = pathlib.Path(path)
    if path.is_file():
        return path.suffix == RECORD_SUFFIX
    return path.is_dir() and any(path.rglob(f"*{RECORD_SUFFIX}"))


def files_of(path: pathlib.Path) -> list[pathlib.Path]:
    """The record files `path` names: itself, or the files of the folder (a DataError if neither exists)."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DataError(f"{path}: no such file or folder")
    records = sorted(path.rglob(f"*{RECORD_SUFFIX}"))
    # Plain text beside the records would be left out without a word: a folder is one kind of data or the other.
    text = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
    if records and text:
        raise DataError(
            f"{path}: holds JSON Lines records ({records[0].relative_to(path)}) and plain text "
            f"({text[0].relative_to(path)}); a data folder is one or the other: move the text out, or make it records"
        )
    return records


def read_records(path: str | os.PathLike) -> Iterator[tuple[str, str] | list[dict[str, str]]]:
    """(prompt, completion) per record in file order; a `text` record is ("", text); a conversation is its list of
    messages. Anything else is one DataError naming the file and line."""
    for file in files_of(pathlib.Path(path)):
        with open(file, encoding="utf-8", errors="strict") as f:
            try:
                lines = list(f)
            except UnicodeDecodeError as err:
                raise DataError(f"{file}: not UTF-8 text ({err.reason} at byte {err.start})") from None
        for number, line in enumerate(lines, 1):
            if line.strip():
                yield _record(json_line(file, number, line), file, number)


def json_line(file: pathlib.Path, number: int, line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{file}:{number}: not a JSON object ({err.msg})") from None


def _record(obj: Any, file: pathlib.Path, number: int) -> tuple[str, str] | list[dict[str, str]]:
    where = f"{file}:{number}"
    if isinstance(obj, dict) and isinstance(obj.get("text"), str) and not {"prompt", "completion"} & set(obj):
        return "", obj["text"]
    if isinstance(obj, dict) and isinstance(obj.get("prompt"), str) and isinstance(obj.get("completion"), str):
        return obj["prompt"], obj["completion"]
    if isinstance(obj, dict) and "messages" in obj:
        return message_list(obj["messages"], where)
    keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
    raise DataError(
        f'{where}: expected {{"text": str}}, {{"prompt": str, "completion": str}} or {{"messages": [{{"role": str, '
        f'"content": str}}, ...]}}, got {keys}'
    )


ROLES = ("system", "developer", "user", "assistant", "tool")


def message_list(messages: Any, where: str, *, need_assistant: bool = True) -> list[dict[str, str]]:
    """A conversation's messages, checked: roles among ROLES, text content, at least one assistant turn (unless
    `need_assistant` is False); anything else is a DataError naming `where`."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f'{where}: messages must be a non-empty list of {{"role", "content"}} objects')
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: messages[{i}] must have a role among {', '.join(ROLES)} and text content")
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: a conversation with no assistant turn has nothing to learn")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def chat_ids(messages: list, encode: Any, template: Any, where: Any, *, opened: bool) -> list[int]:
    """The ids of `messages` rendered with the chat template (`opened`: with the assistant's turn opened after
    them); no template, or one that fails, is a DataError naming `where`."""
    if template is None:
        raise DataError(
            f"{where}: chat records (messages), but the checkpoint's folder has no chat template; give one with "
            "--chat-template FILE (chat_template= in the API)"
        )
    return encode(_render(template, messages, opened, where))


def _conversation(messages: list, encode: Any, template: Any, path: Any) -> tuple[np.ndarray, np.ndarray]:
    """A conversation's ids and weights: 1 on each assistant turn (see the module docstring), 0 elsewhere."""
    ids = chat_ids(messages, encode, template, path, opened=False)
    weights = np.zeros(len(ids))
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = encode(_render(template, messages[:i], True, path))
        end = encode(_render(template, messages[: i + 1], False, path))
        if ids[: len(start)] != start or ids[: len(end)] != end:
            raise DataError(
                f"{path}: the chat template renders this conversation's turns differently alone than together "
                "(a turn's text is not a prefix of the whole), so its assistant turns cannot be found"
            )
        weights[len(start) : len(end)] = 1
    return np.asarray(ids, np.int32), weights


def _render(template: Any, messages: list, opened: bool, path: Any) -> str:
    from jaxnn.errors import ChatTemplateError

    try:
        return template.render(messages, add_generation_prompt=opened)
    except ChatTemplateError as err:
        raise DataError(f"{path}: {err}") from None


def text_encoder(tokenizer: Any, end_id: int | None) -> tuple[Any, list[int]]:
    """(text -> ids, the ids that end a document): the tokenizer's, or bytes and a newline without one."""
    if tokenizer is None:
        return (lambda text: list(text.encode())), [ord("\n")]
    end = end_id if end_id is not None else end_token(tokenizer)
    return (lambda text: tokenizer.encode(text, add_special_tokens=False).ids), ([] if end is None else [end])


def load_text_records(
    path: str | os.PathLike,
    tokenizer: Any = None,
    *,
    test_fraction: float = 0.1,
    end_id: int | None = None,
    chat_template: Any = None,
) -> TextCorpus:
    """The records under `path` (a .jsonl file or a folder of them) as token ids with per-token loss weights:
    prompts weigh 0, completions, `text` records and each record's end token 1, a conversation's assistant turns 1.
    `tokenizer`: a `tokenizers.Tokenizer` (None: UTF-8 bytes, vocabulary 256); `end_id`: the separator (default:
    the tokenizer's end-of-text token); `chat_template`: a `jaxnn.interop.chat.ChatTemplate`, needed for
    conversations."""
    encode, separator = text_encoder(tokenizer, end_id)
    pieces = []
    for record in read_records(path):
        if isinstance(record, list):
            pieces.append(_conversation(record, encode, chat_template, path))
            continue
        prompt, completion = record
        asked, answered = (encode(prompt) if prompt else []), encode(completion) + separator
        pieces.append((np.asarray(asked + answered, np.int32), np.r_[np.zeros(len(asked)), np.ones(len(answered))]))
    if len(pieces) < 2:
        raise DataError(f"{path}: {len(pieces)} record(s); expected at least 2 (one for the test split)")
    n_test = min(max(1, round(len(pieces) * test_fraction)), len(pieces) - 1)
    train, test = pieces[:-n_test], pieces[-n_test:]
    for split, part in (("training", train), ("test", test)):
        if not any(p[1].any() for p in part):
            raise DataError(
                f"{path}: no token of the {split} records counts in the loss (every completion is empty, and the "
                "tokenizer has no end-of-text token to learn); give the records completions or text"
            )

    def joined(part: list, k: int) -> np.ndarray:
        return np.concatenate([p[k] for p in part])

    vocab = 256 if tokenizer is None else tokenizer.get_vocab_size()
    name = pathlib.Path(path).stem + ("-tokens" if tokenizer is not None else "")

    def starts(part: list) -> np.ndarray:
        return np.cumsum([0] + [len(p[0]) for p in part[:-1]]).astype(np.int64)

    return TextCorpus(name, joined(train, 0), joined(test, 0), len(files_of(pathlib.Path(path))), vocab,
                      train_targets=joined(train, 1).astype(np.float32),
                      test_targets=joined(test, 1).astype(np.float32),
                      train_starts=starts(train), test_starts=starts(test))  # fmt: skip


__all__ = [
    "END_TOKENS",
    "chat_ids",
    "end_token",
    "files_of",
    "is_record_source",
    "load_text_records",
    "message_list",
    "read_records",
    "text_encoder",
]
