"""Fine-tuning text as users have it: JSON Lines of `{"text": ...}` documents or `{"prompt": ..., "completion":
...}` pairs, tokenised with a checkpoint's tokenizer (or read as bytes), as a `TextCorpus` whose completions alone
count in the loss.

    corpus = load_text_records("train.jsonl", tokenizer)     # or a folder of *.jsonl files
    jaxnn.fit(model, corpus, loss=jaxnn.train.lm_loss, ...)    # batches carry a `loss_mask` for prompts

Each record ends with a separator (the tokenizer's end-of-text token, or a newline for bytes), which counts as a
target: the model learns where a completion stops. The last `test_fraction` of the records (at least one) is the
test split. Windows are cut from the records' concatenation, as for any text corpus.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from jaxnn.data.datasets import TEXT_SUFFIXES, DataError, TextCorpus
from jaxnn.interop.tokenizer import END_TOKENS, end_token

RECORD_SUFFIX = ".jsonl"


def is_record_source(path: str | os.PathLike) -> bool:
    """A .jsonl file, or a folder holding one."""
    path = pathlib.Path(path)
    if path.is_file():
        return path.suffix == RECORD_SUFFIX
    return path.is_dir() and any(path.rglob(f"*{RECORD_SUFFIX}"))


def _files(path: pathlib.Path) -> list[pathlib.Path]:
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


def read_records(path: str | os.PathLike) -> Iterator[tuple[str, str]]:
    """(prompt, completion) per record in file order; a `text` record is ("", text). Anything else is one
    DataError naming the file and line."""
    for file in _files(pathlib.Path(path)):
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


def _record(obj: Any, file: pathlib.Path, number: int) -> tuple[str, str]:
    where = f"{file}:{number}"
    if isinstance(obj, dict) and isinstance(obj.get("text"), str) and not {"prompt", "completion"} & set(obj):
        return "", obj["text"]
    if isinstance(obj, dict) and isinstance(obj.get("prompt"), str) and isinstance(obj.get("completion"), str):
        return obj["prompt"], obj["completion"]
    keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
    raise DataError(f'{where}: expected {{"text": str}} or {{"prompt": str, "completion": str}}, got {keys}')


def _encoder(tokenizer: Any, end_id: int | None) -> tuple[Any, list[int]]:
    if tokenizer is None:
        return (lambda text: list(text.encode())), [ord("\n")]
    end = end_id if end_id is not None else end_token(tokenizer)
    return (lambda text: tokenizer.encode(text, add_special_tokens=False).ids), ([] if end is None else [end])


def load_text_records(
    path: str | os.PathLike, tokenizer: Any = None, *, test_fraction: float = 0.1, end_id: int | None = None
) -> TextCorpus:
    """The records under `path` (a .jsonl file or a folder of them) as token ids with per-token loss weights:
    prompts weigh 0, completions, `text` records and each record's end token 1. `tokenizer`: a
    `tokenizers.Tokenizer` (None: UTF-8 bytes, vocabulary 256); `end_id`: the separator (default: the
    tokenizer's end-of-text token)."""
    encode, separator = _encoder(tokenizer, end_id)
    pieces = []
    for prompt, completion in read_records(path):
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

    return TextCorpus(name, joined(train, 0), joined(test, 0), len(_files(pathlib.Path(path))), vocab,
                      train_targets=joined(train, 1).astype(np.float32),
                      test_targets=joined(test, 1).astype(np.float32),
                      train_starts=starts(train), test_starts=starts(test))  # fmt: skip


__all__ = ["END_TOKENS", "end_token", "is_record_source", "load_text_records", "read_records"]
