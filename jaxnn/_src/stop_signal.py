"""`StopSignal`: SIGTERM and SIGINT as a flag the training loop polls, so that a run stopped from outside writes its
checkpoint before it exits. Kept below the loop and `jaxnn.checkpoint` (which re-exports it, its old home) so both
may import it."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterable
from typing import Any


class StopSignal:
    """Turns SIGTERM and SIGINT into a flag the training loop polls, so it can checkpoint before exiting.

    The first signal sets the flag; later ones never interrupt the checkpoint being written: each is counted
    and acknowledged with one line on stderr (SIGKILL remains the way to stop at once). Use as a context
    manager; the previous handlers come back on exit. Outside the main thread (where Python forbids signal
    handlers) it installs nothing and the flag stays False.
    """

    def __init__(self, signals: Iterable[signal.Signals] = (signal.SIGTERM, signal.SIGINT)):
        self.signals = signals
        self.received: int | None = None
        self.ignored = 0
        self._previous: dict[int, Any] = {}

    def __bool__(self) -> bool:
        return self.received is not None

    def _handle(self, signum, frame):
        if self.received is None:
            self.received = signum
            return
        self.ignored += 1
        # os.write, not print: a handler may run in the middle of another write to stderr.
        os.write(
            2,
            f"jaxnn: signal {signum} received while stopping; finishing the checkpoint first "
            "(kill -9 stops at once, losing the steps since the last checkpoint)\n".encode(),
        )

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
        return False
