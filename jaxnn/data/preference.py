"""Preference pairs as users have them: JSON Lines of `{"prompt", "chosen", "rejected"}`, plain text or chat form
(TRL's conversational form: `prompt` a list of messages, `chosen` and `rejected` the assistant's messages that
follow it), tokenised into the arrays `jaxnn.train.preference` trains on.

    train, test = load_preference_records("pairs.jsonl", tokenizer, window=128)
    jaxnn.fit(gpt, train, eval_data=test, objective="dpo", beta=0.1, lora="r=8", params=base, ...)

Each pair becomes `x` (2, window+1): the prompt followed by the chosen response, then by the rejected one, each
ended by the separator (the tokenizer's end-of-text token, or a newline for bytes) and padded with 0; `loss_mask`
(2, window) is 1 on the targets that belong to the response. A response longer than what the window leaves after
the prompt is cut (as TRL cuts it); a prompt that leaves no room for a response, a pair whose two responses are the
same, and a record that is no preference pair are each one DataError naming the file and line.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import numpy as np

from jaxnn.data.datasets import DataError
from jaxnn.data.records import chat_ids, files_of, json_line, message_list, text_encoder

PAIR_KEYS = ("prompt", "chosen", "rejected")


def read_preference_records(path: str | os.PathLike) -> list[tuple[str, Any, Any, Any]]:
    """(where, prompt, chosen, rejected) per record in file order, `where` being "file:line"; text fields stay
    text, chat fields become checked message lists. A record without the three keys is a DataError naming it."""
    out = []
    for file in files_of(pathlib.Path(path)):
        with open(file, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                obj, where = json_line(file, number, line), f"{file}:{number}"
                if not (isinstance(obj, dict) and all(k in obj for k in PAIR_KEYS)):
                    keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
                    raise DataError(
                        f'{where}: preference tuning needs {{"prompt", "chosen", "rejected"}} records (a prompt and '
                        f"two responses, the preferred first), got {keys}"
                    )
                fields = [obj[k] for k in PAIR_KEYS]
                if all(isinstance(v, str) for v in fields):
                    out.append((where, *fields))
                elif all(isinstance(v, list) for v in fields):
                    out.append((where, *(message_list(v, where, need_assistant=False) for v in fields)))
                else:
                    raise DataError(f"{where}: prompt, chosen and rejected must all be text or all message lists")
                if out[-1][2] == out[-1][3]:
                    raise DataError(f"{where}: chosen and rejected are the same; the pair prefers nothing")
    return out


def _pair_ids(record: tuple, encode: Any, separator: list[int], template: Any) -> tuple[list[int], list, list]:
    """The prompt's ids and each response's (separator included)."""
    where, prompt, chosen, rejected = record
    if isinstance(prompt, str):
        return encode(prompt), encode(chosen) + separator, encode(rejected) + separator
    asked = chat_ids(prompt, encode, template, where, opened=True)
    answers = []
    for response in (chosen, rejected):
        whole = chat_ids(prompt + response, encode, template, where, opened=False)
        if whole[: len(asked)] != asked:
            raise DataError(f"{where}: the chat template renders the prompt differently alone than with a response")
        answers.append(whole[len(asked) :])
    return asked, answers[0], answers[1]


def _arrays(records: list, encode: Any, separator: list[int], template: Any, window: int) -> dict[str, np.ndarray]:
    x = np.zeros((len(records), 2, window + 1), np.int32)
    mask = np.zeros((len(records), 2, window), np.float32)
    for i, record in enumerate(records):
        asked, chosen, rejected = _pair_ids(record, encode, separator, template)
        if not asked:
            raise DataError(f"{record[0]}: the prompt is empty; preference pairs answer a prompt")
        if len(asked) >= window:
            raise DataError(
                f"{record[0]}: the prompt is {len(asked)} tokens, which leaves no room for a response in the window "
                f"of {window + 1} (--seq-len {window}); shorten it or widen the window"
            )
        if chosen == rejected:
            raise DataError(f"{record[0]}: chosen and rejected give the same tokens; the pair prefers nothing")
        for row, response in enumerate((chosen, rejected)):
            ids = (asked + response)[: window + 1]
            x[i, row, : len(ids)] = ids
            mask[i, row, len(asked) - 1 : len(ids) - 1] = 1  # targets are the ids shifted by one
    return {"x": x, "loss_mask": mask}


def load_preference_records(
    path: str | os.PathLike,
    tokenizer: Any = None,
    *,
    window: int,
    test_fraction: float = 0.1,
    end_id: int | None = None,
    chat_template: Any = None,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The pairs under `path` (a .jsonl file or a folder of them) as (train, test) dicts of `x` (N, 2, window+1)
    int32 and `loss_mask` (N, 2, window); the last `test_fraction` of the pairs (at least one) is the test split.
    `tokenizer`, `end_id` and `chat_template` as in `jaxnn.data.records.load_text_records`."""
    records = read_preference_records(path)
    if len(records) < 2:
        raise DataError(f"{path}: {len(records)} preference pair(s); expected at least 2 (one for the test split)")
    encode, separator = text_encoder(tokenizer, end_id)
    arrays = _arrays(records, encode, separator, chat_template, window)
    n_test = min(max(1, round(len(records) * test_fraction)), len(records) - 1)
    return {k: v[:-n_test] for k, v in arrays.items()}, {k: v[-n_test:] for k, v in arrays.items()}


def is_preference_source(path: str | os.PathLike) -> bool:
    """Whether the first record under `path` has the preference keys (a cheap look, for choosing a reader)."""
    for file in files_of(pathlib.Path(path)):
        with open(file, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    obj = json_line(file, number, line)
                    return isinstance(obj, dict) and all(k in obj for k in PAIR_KEYS)
    return False


__all__ = ["PAIR_KEYS", "is_preference_source", "load_preference_records", "read_preference_records"]
