"""Files that survive faults: whole or absent, appended line by line, and OS errors as one line with the free space.

- `write_bytes_atomic` / `write_json_atomic`: temporary file + fsync + rename, never a half-written file.
- `repair_jsonl`: a JSON-lines file whose last line was cut short by a crash gets that fragment set aside (never
  appended to); `append_line` writes one whole line or, on an OS error, leaves the file as it was.
- `StorageError`: an OS error while writing, as one line naming the path, the operation and the free space;
  `quiet_storage_noise` keeps orbax's, asyncio's and tensorstore's background threads from repeating it (or a
  damaged checkpoint's read error, already reported) as tracebacks.
- `check_writable`: a path refused (`RunDirError`) before anything is written there.

The floor of the package: it imports nothing else from jaxnn.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import pathlib
import shutil
import sys
import time
from typing import Any, TypeAlias

from jaxnn.errors import RunDirError, StorageError  # noqa: F401 (also importable from here)

log = logging.getLogger(__name__)

PathLike: TypeAlias = str | os.PathLike[str]


def free_space(path: PathLike) -> str:
    """Free space of the file system holding `path` (or its nearest existing parent), human-readable."""
    path = pathlib.Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        free = float(shutil.disk_usage(path).free)
    except OSError:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if free < 1024 or unit == "TiB":
            return f"{free:.0f} {unit}" if unit == "B" else f"{free:.1f} {unit}"
        free /= 1024
    return "unknown"


def storage_error(operation: str, path: PathLike, err: BaseException) -> StorageError:
    """One line: what failed, where, why, and how much space is left there."""
    code = err.errno if isinstance(err, OSError) and err.errno else errno.EIO
    if isinstance(err, OSError) and err.strerror:
        reason = err.strerror
    elif any(mark in str(err) for mark in _DISK_FULL_MARKS):  # tensorstore's wording of ENOSPC
        code, reason = errno.ENOSPC, os.strerror(errno.ENOSPC)
    else:
        lines = str(err).strip().splitlines()
        reason = f"{type(err).__name__}: {lines[0][:200]}" if lines else type(err).__name__
    return StorageError(code, f"{operation} {path} failed: {reason} (free space there: {free_space(path)})")


_DISK_FULL_MARKS = ("No space left on device", "os_error_code='28'", "RESOURCE_EXHAUSTED")


class _DropStorageNoise(logging.Filter):
    """Drops the log records orbax's and asyncio's background threads emit for a write that failed for lack of
    space (the save reports it as one StorageError line), and the echoes of a failed checkpoint read: orbax reads
    a step's arrays concurrently, the first damaged one fails the read (jaxnn reports the step and falls back to
    the previous one), and the sibling reads' errors, which nothing awaits any more, get logged by asyncio."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += str(record.exc_info[1])
        if any(mark in text for mark in _DISK_FULL_MARKS):
            return False
        return not (record.name == "asyncio" and "exception was never retrieved" in text and "tensorstore" in text)


_NOISE_FILTER = _DropStorageNoise()
# orbax logs this for a step whose metadata file was cut short, then raises; the restore reports the step.
_DAMAGED_METADATA = "Failed to json parse Metadata file"


class _DropDamagedMetadata(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _DAMAGED_METADATA not in record.getMessage()


_METADATA_FILTER = _DropDamagedMetadata()


def _is_closed_loop_echo(unraisable: Any) -> bool:
    """Whether an unraisable error is tensorstore handing a read's result to the event loop of a restore that
    has already ended (it failed on a damaged file and was reported); nothing waits for that result."""
    err = unraisable.exc_value
    if not (isinstance(err, RuntimeError) and str(err) == "Event loop is closed"):
        return False
    tb = unraisable.exc_traceback
    names = set()
    while tb is not None:
        names.add(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    return "call_soon_threadsafe" in names


def _quiet_closed_loop_echoes() -> None:
    previous = sys.unraisablehook
    if getattr(previous, "_jaxnn_quiet", False):
        return

    def hook(unraisable: Any) -> None:
        if not _is_closed_loop_echo(unraisable):
            previous(unraisable)

    hook._jaxnn_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def quiet_storage_noise() -> None:
    """Installs the filters above on the absl and asyncio loggers, and the closed-loop filter on
    `sys.unraisablehook` (once; every other record and unraisable error passes through)."""
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if _NOISE_FILTER not in logger.filters:
            logger.addFilter(_NOISE_FILTER)
    if _METADATA_FILTER not in logging.getLogger("absl").filters:
        logging.getLogger("absl").addFilter(_METADATA_FILTER)
    _quiet_closed_loop_echoes()


def check_writable(path: PathLike) -> None:
    """Refuses a path that is a file where a directory is needed, or whose nearest existing parent is read-only."""
    path = pathlib.Path(path)
    if path.exists() and not path.is_dir():
        raise RunDirError(f"{path} is a file, not a directory")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise RunDirError(f"cannot create {path}: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RunDirError(f"cannot write to {existing} (permission denied)")


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists on this host (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_bytes_atomic(path: PathLike, data: bytes) -> None:
    """Writes `data` to a temporary name beside `path`, then renames it: readers never see a partial file."""
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it visible
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise storage_error("writing", path, err) from err


def write_json_atomic(path: PathLike, obj: Any) -> None:
    """Writes `obj` as JSON so that `path` holds either its old contents or the whole new file, never a part."""
    write_bytes_atomic(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def make_dirs(path: PathLike) -> None:
    """`mkdir -p`, with an OS error reported as one StorageError line."""
    try:
        pathlib.Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise storage_error("creating", path, err) from err


def repair_jsonl(path: PathLike) -> int:
    """Sets aside a partial last line (no trailing newline) of a JSON-lines file; returns the bytes moved.

    The fragment goes to `<name>.partial-<time>` beside the file, with a warning, so nothing is lost and the next
    appended line starts on a line of its own.
    """
    path = pathlib.Path(path)
    if not path.is_file() or path.stat().st_size == 0:
        return 0
    data = path.read_bytes()
    if data.endswith(b"\n"):
        return 0
    cut = data.rfind(b"\n") + 1
    aside = path.with_name(f"{path.name}.partial-{time.strftime('%Y%m%d-%H%M%S')}")
    aside.write_bytes(data[cut:])
    with open(path, "r+b") as f:
        f.truncate(cut)
    log.warning("%s: its last line was cut short (a crash while writing); set it aside in %s", path, aside.name)
    return len(data) - cut


def _write_all(fd: int, data: bytes) -> None:
    # Separate so tests can inject OS errors into the metrics writer alone.
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def append_line(path: PathLike, line: str) -> None:
    """Appends one line; on an OS error the file is cut back to its previous length and StorageError raised."""
    path = pathlib.Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            _write_all(fd, (line.rstrip("\n") + "\n").encode())
        except OSError as err:
            with contextlib.suppress(OSError):  # the write's error is the one to report
                os.ftruncate(fd, size)
            raise storage_error("appending to", path, err) from err
    finally:
        os.close(fd)
