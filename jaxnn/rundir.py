"""Run directories that survive faults: one writer at a time, files that are whole or absent, clear disk errors.

- `RunLock`: a lock file held for a run's life (`fcntl.flock`, released by the kernel if the process dies); it
  records the holder's host and process id, so a second run is refused with one line naming the holder, and a
  lock left by a crashed run is recognised and taken over with a warning.
- `write_json_atomic`: temporary file + fsync + rename, so config.json and summary.json are never half-written.
- `repair_jsonl`: a metrics file whose last line was cut short by a crash gets that fragment set aside (never
  appended to); `append_line` writes one whole line or, on an OS error, leaves the file as it was.
- `StorageError`: an OS error while writing, as one line naming the path, the operation and the free space.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import pathlib
import shutil
import socket
import time
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

if TYPE_CHECKING:
    from jaxnn.config import FitConfig
    from jaxnn.metrics import MetricWriter

log = logging.getLogger(__name__)

PathLike: TypeAlias = str | os.PathLike[str]

LOCK_NAME = "run.lock"


class RunDirError(ValueError):
    """A run directory that cannot be used as asked: held by another run, not a directory, not writable."""


class StorageError(OSError):
    """Writing to the run directory failed (disk full, permissions, ...); the message says where and why."""


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
    space: the save reports it as one StorageError line."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += str(record.exc_info[1])
        return not any(mark in text for mark in _DISK_FULL_MARKS)


_NOISE_FILTER = _DropStorageNoise()


def quiet_storage_noise() -> None:
    """Installs the filter above on the absl and asyncio loggers (once)."""
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if _NOISE_FILTER not in logger.filters:
            logger.addFilter(_NOISE_FILTER)


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


# -------------------------------------------------------------------------------------------------------- the lock


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """Exclusive use of a run directory by one process; use as a context manager (or `acquire`/`release`)."""

    def __init__(self, run_dir: PathLike):
        self.path = pathlib.Path(run_dir) / LOCK_NAME
        self._fd: int | None = None

    def _holder(self) -> dict:
        try:
            return json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}

    def acquire(self) -> RunLock:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                h = self._holder()
                raise RunDirError(
                    f"run dir {self.path.parent} is in use by process {h.get('pid', '?')} on host "
                    f"{h.get('host', '?')} (since {h.get('since', '?')}); wait for it, stop it, or "
                    "choose another --run-dir"
                ) from None
            # The holder may have released and removed the file between our open and our flock: lock the file
            # that is at the path now, not an orphan.
            if os.path.exists(self.path) and os.path.samestat(os.fstat(fd), os.stat(self.path)):
                break
            os.close(fd)
        previous = self._holder()
        me = {"host": socket.gethostname(), "pid": os.getpid()}
        if previous.get("pid") and (previous.get("host"), previous.get("pid")) != (me["host"], me["pid"]):
            if previous.get("host") == me["host"] and _pid_alive(int(previous["pid"])):
                # flock says free but the recorded process lives: a file system without working locks.
                os.close(fd)
                raise RunDirError(
                    f"run dir {self.path.parent} is in use by process {previous['pid']} on this host "
                    f"({LOCK_NAME} names it); stop it or remove {self.path}"
                )
            log.warning(
                "run dir %s: taking over the lock left by process %s on host %s, which ended without releasing it",
                self.path.parent,
                previous.get("pid"),
                previous.get("host"),
            )
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({**me, "since": time.strftime("%Y-%m-%dT%H:%M:%S")}).encode())
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # while still holding it, so no one locks an orphan
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> Literal[False]:
        self.release()
        return False


# ---------------------------------------------------------------------------------------------------- whole files


def write_json_atomic(path: PathLike, obj: Any) -> None:
    """Writes `obj` as JSON so that `path` holds either its old contents or the whole new file, never a part."""
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(obj, indent=1, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise storage_error("writing", path, err) from err


def read_json(path: PathLike) -> dict:
    """A JSON file written by `write_json_atomic`; a damaged one raises RunDirError naming it."""
    path = pathlib.Path(path)
    try:
        return json.loads(path.read_text())
    except ValueError as err:
        raise RunDirError(f"{path} is damaged ({err}); move it aside or pass --overwrite") from None


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


# ------------------------------------------------------------------------------------------------- a run's files

RUN_FILES = ("config.json", "summary.json", "metrics.jsonl", "loss.png", "accuracy.png", "tensorboard")


class RunFiles:
    """The files of one run directory: checked and locked by `open`, written by process 0, released by `close`.

    Without a run directory (`cfg.run_dir` None) every method does nothing, and nothing is checkpointed.
    """

    def __init__(self, cfg: FitConfig, record: dict, *, is_main: bool = True):
        self.cfg, self.record, self.is_main = cfg, record, is_main
        self.run_dir = pathlib.Path(cfg.run_dir) if cfg.run_dir else None
        self.ckpt_dir = (
            (pathlib.Path(cfg.ckpt_dir) if cfg.ckpt_dir else self.run_dir / "ckpt") if self.run_dir else None
        )
        self._lock = RunLock(self.run_dir) if self.run_dir else None
        self._writers: list[MetricWriter] = []
        self._created = False

    @property
    def _root(self) -> pathlib.Path:
        assert self.run_dir is not None, "only called with a run directory"
        return self.run_dir

    @property
    def _ckpt(self) -> pathlib.Path:
        assert self.ckpt_dir is not None, "only called with a run directory"
        return self.ckpt_dir

    @property
    def _held(self) -> RunLock:
        assert self._lock is not None, "only called with a run directory"
        return self._lock

    def open(self) -> None:
        """Checks, creates and locks the run directory and writes config.json (process 0); no-op without one."""
        if self.run_dir is None:
            return
        error = None
        if self.is_main:
            try:
                self._open_main()
            except (RunDirError, StorageError, ValueError) as err:
                error = err
        if not _all_processes_agree(error is None):
            raise error or RunDirError(f"process 0 refused the run directory {self.run_dir} (see its output)")

    def _open_main(self) -> None:
        check_writable(self._root)
        check_writable(self._ckpt)
        self._created = not self._root.exists()
        self._root.mkdir(parents=True, exist_ok=True)
        try:
            self._held.acquire()
        except RunDirError:
            self._remove_if_created()
            raise
        try:
            self._check_use()
            if self.cfg.overwrite:
                self._clear()
            self._write_config()
            from jaxnn.metrics import make_writers

            self._writers = make_writers(self.cfg.metrics, self._root)
        except BaseException:
            self._held.release()
            self._remove_if_created()
            raise

    def _remove_if_created(self) -> None:
        if self._created and self._root.is_dir() and not any(self._root.iterdir()):
            self._root.rmdir()

    def _saved_config(self) -> dict | None:
        path = self._root / "config.json"
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except ValueError:
            return None

    def precheck(self) -> None:
        """The checks `open` makes, read-only and on the record known so far, so that a run directory in use is
        refused before the model is compiled; `open` repeats them under the lock with the whole record."""
        if self.run_dir is None or not self.is_main:
            return
        check_writable(self.run_dir)
        check_writable(self._ckpt)
        if self.run_dir.is_dir():
            self._check_use(partial=True)

    def _check_use(self, partial: bool = False) -> None:
        """Refuses a run directory holding another run, unless resume or overwrite says what to do with it."""
        from jaxnn.checkpoint import config_differences

        used = [p for p in self._root.iterdir() if p.name != LOCK_NAME]
        if not used or self.cfg.overwrite:
            return
        saved = self._saved_config()
        if saved is not None and partial:
            saved = {k: v for k, v in saved.items() if k in self.record}
        diffs = config_differences(saved, self.record, saved_as="saved") if saved is not None else []
        if diffs:
            raise RunDirError(
                f"run dir {self._root} belongs to a different config ({'; '.join(diffs)}); "
                "resume it with the same settings, overwrite it, or choose another run dir"
            )
        if not self.cfg.resume:
            raise RunDirError(
                f"run dir {self._root} already holds a run; pass --resume (resume=True) to continue "
                "it, --overwrite (overwrite=True) to replace it, or another run dir"
            )

    def _clear(self) -> None:
        targets = [self._root / name for name in RUN_FILES] + [self._ckpt]
        targets += list(self._root.glob("metrics-*.csv")) + list(self._root.glob("*.partial-*"))
        for path in targets:
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()

    def _write_config(self) -> None:
        path = self._root / "config.json"
        if path.is_file() and self._saved_config() is None:
            aside = path.with_name(f"config.json.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
            path.rename(aside)
            log.warning("%s was damaged (not JSON); set aside as %s and written again", path, aside.name)
        write_json_atomic(path, self.record)

    def write(self, row: dict) -> None:
        for writer in self._writers:
            writer.write(row)

    def resumed_from(self, step: int) -> None:
        log.info("resuming %s from step %d", self.run_dir, step)

    def previous_summary(self) -> dict:
        path = self.run_dir / "summary.json" if self.run_dir else None
        try:
            return json.loads(path.read_text()) if path and path.is_file() else {}
        except ValueError:
            return {}

    def finish(self, summary: dict, *, plots: bool) -> None:
        """summary.json (atomically) and the plots; process 0 only."""
        if not (self.run_dir and self.is_main):
            return
        write_json_atomic(self.run_dir / "summary.json", summary)
        metrics = self.run_dir / "metrics.jsonl"
        from jaxnn.optional import available

        if plots and metrics.is_file() and available("matplotlib", "the loss and accuracy plots"):
            from jaxnn.plots import write_plots

            summary["plots"] = write_plots(metrics, self.run_dir)
            write_json_atomic(self.run_dir / "summary.json", summary)

    def close(self) -> None:
        for writer in self._writers:
            writer.close()
        self._writers = []
        if self._lock:
            self._lock.release()


def _all_processes_agree(ok: bool) -> bool:
    """Whether process 0 says `ok` (every process must call this); trivially `ok` in a single process."""
    import jax

    if jax.process_count() == 1:
        return ok
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.int32(ok)))
