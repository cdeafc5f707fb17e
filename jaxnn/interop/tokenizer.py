"""The tokenizer a run's text was read with: found in a transformers folder, kept with the run, used again by every
command that reads or prints the run's text.

    record = tokenizer_record("gpt2-folder")          # {"file": "tokenizer.json", "sha256": ...} or None
    copy_tokenizer("gpt2-folder", "runs/ft")           # runs/ft/tokenizer/: tokenizer.json and its side files
    tok = run_tokenizer(loaded.config, loaded.directory)   # the same tokenizer, checked by its digest

A run records the digest, not the path alone: a tokenizer.json edited or replaced after training would decode the
model's ids into other text without a word, so a copy that does not match is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
from typing import Any

from jaxnn._src.optional import require
from jaxnn.errors import TokenizerError  # noqa: F401 (also importable from here)

TOKENIZER_FILE = "tokenizer.json"
# What transformers' AutoTokenizer reads beside tokenizer.json (special tokens, padding side, chat template), and the
# checkpoint's generation settings (its begin, end and padding ids), kept with them so that an export can say where
# generation stops.
SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
GENERATION_FILE = "generation_config.json"
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
# End-of-text tokens of the tokenizers people fine-tune (GPT-2, Llama 2/3, Mistral, Qwen).
END_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<|im_end|>")
RUN_SUBDIR = "tokenizer"


def _sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tokenizer_record(folder: str | os.PathLike) -> dict[str, Any] | None:
    """What a run records of `folder`'s tokenizer.json (its digest, vocabulary size and where it came from), or
    None without one."""
    path = pathlib.Path(folder) / TOKENIZER_FILE
    if not path.is_file():
        return None
    return {
        "file": TOKENIZER_FILE,
        "sha256": _sha256(path),
        "vocab_size": load_tokenizer(path).get_vocab_size(),
        "source": str(pathlib.Path(folder).absolute()),
    }


def load_tokenizer(path: str | os.PathLike) -> Any:
    """A `tokenizers.Tokenizer` from a tokenizer.json; a file it cannot read is one TokenizerError naming it."""
    tokenizers = require("tokenizers", "reading a tokenizer.json")
    try:
        return tokenizers.Tokenizer.from_file(os.fspath(path))
    except Exception as err:  # noqa: BLE001 - the Rust reader raises a bare Exception for every kind of damage
        detail = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
        raise TokenizerError(f"{path}: not a readable tokenizer.json ({detail})") from None


def copy_tokenizer(folder: str | os.PathLike, destination: str | os.PathLike, subdir: str = RUN_SUBDIR) -> pathlib.Path:
    """Copies `folder`'s tokenizer.json and side files into `destination`/`subdir` (a run's tokenizer/ folder by
    default; "" for an export folder), each file written whole (a temporary name, then a rename), so a kill never
    leaves a half-written tokenizer behind; returns that folder."""
    target = pathlib.Path(destination) / subdir
    target.mkdir(parents=True, exist_ok=True)
    for name in (TOKENIZER_FILE, *SIDE_FILES):
        source = pathlib.Path(folder) / name
        if source.is_file():
            partial = target / f".{name}.partial-{os.getpid()}"
            shutil.copyfile(source, partial)
            os.replace(partial, target / name)
    return target


def tokenizer_files(folder: str | os.PathLike) -> list[pathlib.Path]:
    """The tokenizer files present in `folder` (tokenizer.json first)."""
    return [p for p in (pathlib.Path(folder) / n for n in (TOKENIZER_FILE, *SIDE_FILES)) if p.is_file()]


def run_tokenizer_folder(config: dict, checkpoint_dir: str | os.PathLike) -> pathlib.Path | None:
    """The folder holding the tokenizer files a run was trained with (its own copy, else the transformers folder
    it started from), checked against the recorded digest; None for a run on bytes. A TokenizerError says what
    is missing or changed."""
    recorded = config.get("tokenizer")
    if not recorded:
        return None
    ckpt = pathlib.Path(checkpoint_dir)
    candidates = [ckpt.parent / RUN_SUBDIR, ckpt / RUN_SUBDIR]
    if recorded.get("source"):
        candidates.append(pathlib.Path(recorded["source"]))
    for folder in candidates:
        path = folder / TOKENIZER_FILE
        if path.is_file() and _sha256(path) == recorded["sha256"]:
            return folder
    raise TokenizerError(
        f"{ckpt}: the run's text was tokenised with a tokenizer.json of digest {recorded['sha256'][:12]}, which is "
        f"neither in the run's {RUN_SUBDIR}/ folder nor, unchanged, in {recorded.get('source')}; put that file back"
    )


def run_tokenizer(config: dict, checkpoint_dir: str | os.PathLike) -> Any:
    """The `tokenizers.Tokenizer` a run was trained with (see `run_tokenizer_folder`), or None for bytes."""
    folder = run_tokenizer_folder(config, checkpoint_dir)
    return None if folder is None else load_tokenizer(folder / TOKENIZER_FILE)


def end_token(tokenizer: Any) -> int | None:
    """The tokenizer's end-of-text id, if it has one of the usual ones."""
    for token in END_TOKENS:
        found = tokenizer.token_to_id(token)
        if found is not None:
            return int(found)
    return None


def json_object(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON object in `path`; {} where the file is missing, unreadable or holds something else."""
    try:
        data = json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json or special_tokens_map.json writes it: text, or {"content": text}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _valid_id(value: Any, vocab_size: int) -> bool:
    ids = value if isinstance(value, list) else [value]
    return bool(ids) and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids)


def special_token_ids(folder: str | os.PathLike, vocab_size: int) -> dict[str, Any]:
    """The begin, end and padding ids (`bos_token_id`, `eos_token_id`, `pad_token_id`) of the checkpoint whose
    tokenizer files are in `folder`, for a model of `vocab_size` ids; each from the first of: the folder's
    generation_config.json, its config.json, the special tokens named in tokenizer_config.json or
    special_tokens_map.json (looked up in tokenizer.json), and for the end id the usual end-of-text tokens. An id
    outside the vocabulary is dropped; a missing one is left out. `eos_token_id` may be a list (Llama 3)."""
    folder = pathlib.Path(folder)
    found: dict[str, Any] = {}
    for name in (GENERATION_FILE, "config.json"):
        data = json_object(folder / name)
        for key in SPECIAL_IDS:
            if key not in found and _valid_id(data.get(key), vocab_size):
                found[key] = data[key]
    tokenizer = load_tokenizer(folder / TOKENIZER_FILE) if (folder / TOKENIZER_FILE).is_file() else None
    if tokenizer is not None:
        named = {**json_object(folder / "special_tokens_map.json"), **json_object(folder / "tokenizer_config.json")}
        for key in SPECIAL_IDS:
            text = _token_text(named.get(key.removesuffix("_id")))
            token = None if text is None or key in found else tokenizer.token_to_id(text)
            if token is not None and _valid_id(token, vocab_size):
                found[key] = token
        end = end_token(tokenizer)
        if "eos_token_id" not in found and end is not None and _valid_id(end, vocab_size):
            found["eos_token_id"] = end
    return {key: found[key] for key in SPECIAL_IDS if key in found}


def first_end_id(ids: dict[str, Any]) -> int | None:
    """The id generation stops at (the first of a list of end ids), or None."""
    end = ids.get("eos_token_id")
    return end[0] if isinstance(end, list) else end


__all__ = [
    "END_TOKENS",
    "GENERATION_FILE",
    "TokenizerError",
    "copy_tokenizer",
    "end_token",
    "json_object",
    "load_tokenizer",
    "run_tokenizer",
    "run_tokenizer_folder",
    "special_token_ids",
    "tokenizer_files",
    "tokenizer_record",
]
