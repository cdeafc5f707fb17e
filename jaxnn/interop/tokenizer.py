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
import os
import pathlib
import shutil
from typing import Any

from jaxnn._src.optional import require

TOKENIZER_FILE = "tokenizer.json"
# What transformers' AutoTokenizer reads beside tokenizer.json (special tokens, padding side, chat template).
SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json")
RUN_SUBDIR = "tokenizer"


class TokenizerError(ValueError):
    """A tokenizer that is missing, unreadable or not the one a run was trained with; one line naming the file."""


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


__all__ = [
    "TokenizerError",
    "copy_tokenizer",
    "load_tokenizer",
    "run_tokenizer",
    "run_tokenizer_folder",
    "tokenizer_files",
    "tokenizer_record",
]
