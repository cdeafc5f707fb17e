"""`RunLock`: a lock file held for a run's life (`fcntl.flock`, released by the kernel if the process dies); it
records the holder's host and process id, so a second run is refused with one line naming the holder, and a lock
left by a crashed run is recognised and taken over with a warning. `jaxnn.loop.rundir.RunFiles` holds one per run
directory."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import pathlib
import socket
import time
from typing import Literal

from jaxnn._src.storage import PathLike, RunDirError, pid_alive

log = logging.getLogger("jaxnn.loop.rundir")  # the run directory's messages, wherever its lock is kept

LOCK_NAME = "run.lock"


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

    def _in_use(self) -> RunDirError:
        h = self._holder()
        return RunDirError(
            f"run dir {self.path.parent} is in use by process {h.get('pid', '?')} on host "
            f"{h.get('host', '?')} (since {h.get('since', '?')}); wait for it, stop it, or "
            "choose another --run-dir"
        )

    def check_free(self) -> None:
        """Refuses (naming the holder) a directory another live process holds, without taking the lock or
        writing anything: the first check of every caller, so that a run in use is never reported as
        anything else. A stale lock passes here; `acquire` takes it over."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return  # no lock file: nobody holds it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise self._in_use() from None
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
        self._refuse_live_holder(self._holder())

    def _refuse_live_holder(self, previous: dict) -> None:
        me = (socket.gethostname(), os.getpid())
        if not previous.get("pid") or (previous.get("host"), previous.get("pid")) == me:
            return
        if previous.get("host") == me[0] and pid_alive(int(previous["pid"])):
            # flock says free but the recorded process lives: a file system without working locks.
            raise RunDirError(
                f"run dir {self.path.parent} is in use by process {previous['pid']} on this host "
                f"({LOCK_NAME} names it); stop it or remove {self.path}"
            )

    def acquire(self) -> RunLock:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise self._in_use() from None
            # The holder may have released and removed the file between our open and our flock: lock the file
            # that is at the path now, not an orphan.
            if os.path.exists(self.path) and os.path.samestat(os.fstat(fd), os.stat(self.path)):
                break
            os.close(fd)
        previous = self._holder()
        me = {"host": socket.gethostname(), "pid": os.getpid()}
        try:
            self._refuse_live_holder(previous)
        except RunDirError:
            os.close(fd)
            raise
        if previous.get("pid") and (previous.get("host"), previous.get("pid")) != (me["host"], me["pid"]):
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
