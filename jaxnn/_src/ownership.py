"""Who owns a directory jaxnn writes into, so that a run never rotates, overwrites or deletes what it did not write.

- A run directory and its checkpoint directory each hold `jaxnn-owner.json`, naming the run (a random id) that
  created them; `RunFiles` writes both when it opens a run and checks them, read-only, before anything is written.
- A checkpoint directory is used only by the run it names; without an owner file it may hold nothing but jaxnn
  checkpoints, and those only of a run directory written before owner files existed (adopted on resume).
- An export folder holds one export: files of another export (another config or step) or foreign files refuse it.

The rules are written out in docs/run-directories.md ("Who owns what").
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import time
import uuid
from collections.abc import Iterable

from jaxnn._src.storage import PathLike, RunDirError, write_json_atomic

OWNER_FILE = "jaxnn-owner.json"


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


def read_owner(directory: PathLike) -> dict | None:
    """The owner record of `directory`, None without one; a damaged one reads as an owner nobody can match."""
    path = pathlib.Path(directory) / OWNER_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"run_id": "(unreadable owner file)"}
    return record if isinstance(record, dict) else {"run_id": "(unreadable owner file)"}


def write_owner(directory: PathLike, run_id: str, run_dir: PathLike) -> None:
    write_json_atomic(
        pathlib.Path(directory) / OWNER_FILE,
        {
            "run_id": run_id,
            "run_dir": str(pathlib.Path(run_dir).absolute()),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        },
    )


def owner_text(owner: dict) -> str:
    return f"run {owner.get('run_id', '?')} (run dir {owner.get('run_dir', '?')})"


def is_checkpoint_entry(path: pathlib.Path) -> bool:
    """A step folder orbax wrote (`12/`), or one it left half-written (`12.orbax-checkpoint-tmp-...`)."""
    return path.is_dir() and (path.name.isdigit() or ".orbax-checkpoint-tmp" in path.name)


def checkpoint_entries(ckpt_dir: pathlib.Path) -> tuple[list[pathlib.Path], list[pathlib.Path]]:
    """`(checkpoints, other files)` directly in `ckpt_dir`, the owner file aside."""
    if not ckpt_dir.is_dir():
        return [], []
    entries = sorted(p for p in ckpt_dir.iterdir() if p.name != OWNER_FILE)
    return [p for p in entries if is_checkpoint_entry(p)], [p for p in entries if not is_checkpoint_entry(p)]


def _names(paths: Iterable[pathlib.Path], limit: int = 3) -> str:
    names = [p.name for p in paths]
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_checkpoint_dir(ckpt_dir: pathlib.Path, run_id: str | None, *, legacy_ok: bool) -> None:
    """Refuses a checkpoint directory this run may not write into.

    `run_id`: the run whose checkpoints may be there (the run being resumed or overwritten; None for a new run).
    `legacy_ok`: unowned jaxnn checkpoints are this run's (its run directory predates owner files).
    """
    owner = read_owner(ckpt_dir)
    checkpoints, others = checkpoint_entries(ckpt_dir)
    if owner is not None:
        if run_id is not None and owner.get("run_id") == run_id:
            return
        raise RunDirError(
            f"checkpoint dir {ckpt_dir} belongs to {owner_text(owner)}; resume that run from its run dir, "
            "or choose another --ckpt-dir"
        )
    if others:
        raise RunDirError(
            f"checkpoint dir {ckpt_dir} holds files jaxnn did not write ({_names(others)}); "
            "choose an empty or new --ckpt-dir"
        )
    if checkpoints and not legacy_ok:
        raise RunDirError(
            f"checkpoint dir {ckpt_dir} holds checkpoints of another run (steps {_names(checkpoints)}, no owner "
            "recorded); resume that run from its run dir, or choose another --ckpt-dir"
        )


def export_identity(config: dict | None) -> str:
    """The config (with its step) an export was written from, as canonical JSON: equal text, same export."""
    return json.dumps(config, sort_keys=True)


def recorded_identity(path: pathlib.Path, info_file: str, config_key: str) -> str | None:
    """The config an export file records, as `export_identity` text: the info file's (`info_file`, JSON with a
    "config"), a safetensors weights header's (under `config_key`); None for a program (`.jaxexport`), which
    records none; "(unreadable)" for a damaged file, which no export matches."""
    if path.suffix == ".jaxexport":
        return None
    try:
        if path.name == info_file:
            return export_identity(json.loads(path.read_text()).get("config"))
        from safetensors import safe_open

        with safe_open(str(path), framework="np") as f:
            header = (f.metadata() or {}).get(config_key)
        return export_identity(json.loads(header) if header else None)
    except Exception:  # noqa: BLE001 - a damaged file records no config this export could match
        return "(unreadable)"


def check_export_dir(
    out: pathlib.Path, config: dict | None, files: Iterable[str], *, info_file: str, config_key: str
) -> None:
    """Refuses an export folder that holds another export (of another `config`) or foreign files, before anything
    is written.

    `files`: the names an export writes; each records the config it was written from (`recorded_identity`), or
    nothing (the program, which is judged by the files beside it). A set of this same export cut short by a crash
    is completed, never refused.
    """
    if not out.is_dir():
        return
    identity = export_identity(config)
    known = set(files)
    entries = [p for p in sorted(out.iterdir()) if not _is_temporary(p, known)]
    foreign = [p for p in entries if p.name not in known]
    if foreign:
        raise RunDirError(
            f"export folder {out} holds files that are not a jaxnn export ({_names(foreign)}); "
            "choose an empty or new --out"
        )
    recorded = {p.name: recorded_identity(p, info_file, config_key) for p in entries}
    if entries and all(v is None for v in recorded.values()):
        raise RunDirError(
            f"export folder {out} holds {_names(entries)} without the files that say which checkpoint it is "
            "from; choose an empty or new --out, or remove that export first"
        )
    for name, theirs in recorded.items():
        if theirs is not None and theirs != identity:
            raise RunDirError(
                f"export folder {out} holds the export of another checkpoint or config ({name} differs); "
                "choose an empty or new --out, or remove that export first"
            )


def _is_temporary(path: pathlib.Path, known: set[str]) -> bool:
    # jaxnn._src.storage's whole-file writes leave `.<name>.tmp-<pid>` only when a crash came between write and rename.
    return path.name.startswith(".") and path.name.partition(".tmp-")[0][1:] in known
