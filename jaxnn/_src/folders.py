"""Folders written as a whole (an export: a transformers folder, a LoRA adapter folder): the files go into a hidden
sibling, which then takes the target's place, so a reader or a rerun never meets half a folder.

- A target that is new or empty is written; one that holds this same kind of export from the same source (its
  marker file says so, and lists the files that export wrote) and nothing else is replaced; anything else is
  refused in one line (`RunDirError`) that names what is in the way, before anything is written there. Nothing a
  user put there is ever removed: a file the user added beside an earlier export (a README) stops the rerun.
- A kill at any moment leaves either the old folder or the new one: the next write removes the staging folder a
  killed write left, and puts back an old folder that was set aside when the kill came between the two renames.
- A write that fails (a full disk) is one `StorageError` line, the staging folder removed and the old folder intact.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from collections.abc import Callable
from typing import Any

from jaxnn._src.storage import PathLike, RunDirError, StorageError, check_writable, storage_error, write_json_atomic

MARKER = "jaxnn-export.json"


def write_folder(target: PathLike, fill: Callable[[pathlib.Path], Any], identity: dict[str, Any]) -> pathlib.Path:
    """Writes the folder `target` as a whole: `fill(folder)` writes its files into a staging folder, the marker
    (`identity`: what it is and where it came from, JSON) joins them, and the staging folder takes `target`'s
    place. Returns `target`."""
    target = pathlib.Path(target)
    recover(target)
    earlier = check_replaceable(target, identity)
    check_writable(target.parent if target.parent != pathlib.Path("") else pathlib.Path("."))
    staging = target.with_name(f".{target.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir(parents=True)
        fill(staging)
        written = sorted(p.name for p in staging.iterdir())
        # An earlier export's marker from before markers listed their files: what this export writes is its own.
        _check_only_export_files(target, earlier if earlier is not None else written)
        write_json_atomic(staging / MARKER, {**identity, "files": written})
    except BaseException as err:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(err, (StorageError, RunDirError)) or not _is_io_failure(err):
            raise
        raise storage_error("writing", target, err) from None
    _swap(staging, target)
    return target


def _check_only_export_files(target: pathlib.Path, ours: list[str]) -> None:
    """Refuses to replace a folder that holds files besides the export's own (and its marker)."""
    if not target.is_dir():
        return
    foreign = sorted(p.name for p in target.iterdir() if p.name not in {*ours, MARKER})
    if foreign:
        shown = ", ".join(foreign[:4]) + (", ..." if len(foreign) > 4 else "")
        raise RunDirError(
            f"{target} holds an earlier export and files it did not write ({shown}); move them out or choose "
            "another folder (nothing was changed)"
        )


def _is_io_failure(err: BaseException) -> bool:
    """An OSError, or a library's wrapper of one (safetensors' SafetensorError names the OS error in its text)."""
    return isinstance(err, OSError) or ("os error" in str(err).lower() or "ioerror" in str(err).lower())


def check_replaceable(target: pathlib.Path, identity: dict[str, Any]) -> list[str] | None:
    """Refuses a target that is a file, or a folder holding anything but an empty folder or this same export (and
    only the files its marker lists). Returns the files an earlier export recorded (None: none recorded)."""
    if not target.exists():
        return None
    if not target.is_dir():
        raise RunDirError(f"{target} is a file, not a folder to export into")
    entries = sorted(p.name for p in target.iterdir())
    if not entries:
        return None
    marker = target / MARKER
    if not marker.is_file():
        shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
        raise RunDirError(f"{target} holds files that are not a jaxnn export ({shown}); choose an empty or new folder")
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        recorded = None
    files = recorded.pop("files", None) if isinstance(recorded, dict) else None
    if recorded != identity:
        raise RunDirError(
            f"{target} holds another export ({MARKER}: {recorded}); choose an empty or new folder, or remove it first"
        )
    if isinstance(files, list):
        _check_only_export_files(target, files)
        return files
    return None


def recover(target: pathlib.Path) -> None:
    """Cleans up after a write that was killed: its staging folders go, and an old folder that was set aside comes
    back where the kill left no folder at `target` (else it goes too)."""
    parent = target.parent
    for staging in parent.glob(f".{target.name}.partial-*"):
        shutil.rmtree(staging, ignore_errors=True)
    set_aside = sorted(parent.glob(f".{target.name}.old-*"), key=lambda p: p.stat().st_mtime)
    if set_aside and not target.exists():
        os.rename(set_aside.pop(), target)
    for old in set_aside:
        shutil.rmtree(old, ignore_errors=True)


def set_aside(target: pathlib.Path) -> pathlib.Path | None:
    """The earlier folder a write killed between its two renames left beside `target` (newest first), if any:
    what `recover` puts back, for readers that must not change the folder themselves to name it."""
    left = sorted(target.parent.glob(f".{target.name}.old-*"), key=lambda p: p.stat().st_mtime)
    return left[-1] if left else None


def _swap(staging: pathlib.Path, target: pathlib.Path) -> None:
    if not target.exists():
        os.rename(staging, target)
        return
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    os.rename(target, old)  # a kill from here to the next line leaves `old`, which `recover` puts back
    os.rename(staging, target)
    shutil.rmtree(old, ignore_errors=True)


__all__ = ["MARKER", "check_replaceable", "recover", "set_aside", "write_folder"]
