"""Device prefetch: `jax.device_put` batches onto the step's input sharding N ahead, timing the input wait.

`device_put` returns at once and copies in the background, so keeping N batches in flight overlaps the copy and
the host's work for the next batch with the running step (N=2 is double buffering). The time `__next__` blocks is
the time the training loop, and so the device once its queue drains, waited for input.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np


class DevicePrefetch:
    """Wraps a host iterator of numpy batch dicts; yields device batches, `size` of them put ahead (0: none).

    Batches go to `sharding` with `jax.device_put`, or through `place(batch)` when given (e.g. a multi-process
    run's `parallel.shard_batch`, which builds each global array from every process's local rows).
    """

    def __init__(
        self,
        host_iter: Iterable[dict[str, np.ndarray]],
        sharding: jax.sharding.Sharding | None = None,
        size: int = 2,
        place: Callable[[dict[str, np.ndarray]], dict[str, Any]] | None = None,
    ) -> None:
        if size < 0:
            raise ValueError(f"DevicePrefetch: size must be >= 0, got {size}")
        self._host = iter(host_iter)
        self._place: Callable[[dict[str, np.ndarray]], dict[str, Any]] = place or (
            lambda batch: jax.device_put(batch, sharding)
        )
        self._size = size
        self._queue: collections.deque[dict[str, Any]] = collections.deque()
        self._done = False
        self.wait_s = 0.0  # accumulated since the last `take_wait()`
        self.batches = 0

    def __iter__(self) -> DevicePrefetch:
        return self

    def _fill(self, n: int) -> None:
        while not self._done and len(self._queue) < n:
            try:
                batch = next(self._host)
            except StopIteration:
                self._done = True
                return
            self._queue.append(self._place(batch))

    def __next__(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        self._fill(self._size + 1)
        if not self._queue:
            raise StopIteration
        batch = self._queue.popleft()
        self.wait_s += time.perf_counter() - t0
        self.batches += 1
        return batch

    def take_wait(self) -> float:
        """Seconds spent waiting for input since the previous call, and resets the count."""
        wait, self.wait_s = self.wait_s, 0.0
        return wait
