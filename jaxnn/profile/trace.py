"""A `jax.profiler` trace of a few training steps after warm-up, for TensorBoard's profile plugin or Perfetto.

`jaxnn.fit(..., profile_dir=DIR)` (and `jaxnn train --profile-dir DIR`) adds a `TraceSteps(DIR)`. The trace lands in
DIR/plugins/profile/<time>/ as `<host>.xplane.pb` (open DIR with `tensorboard --logdir DIR`, Profile tab) and
`perfetto_trace.json.gz` (drop it on https://ui.perfetto.dev); DIR/kernel_table.txt says where the traced steps'
device time went, operation by operation (`python -m jaxnn.profile.kernel_table DIR` reads it again).
"""

from __future__ import annotations

import logging
import os

import jax

from jaxnn.callbacks import Callback, RunInfo

log = logging.getLogger(__name__)


class TraceSteps(Callback):
    """Traces `steps` training steps after `warmup` steps of this call (at least 2; the first compiles).

    `on_step(s)` runs once step s + 1 is dispatched: the trace starts after waiting for it (so no warm-up step is in
    it) and stops, after waiting again, once the last traced step is dispatched, so every traced step is complete
    in the file. A run that ends sooner stops the trace at its end.
    """

    def __init__(self, log_dir: str | os.PathLike, *, warmup: int = 2, steps: int = 3):
        if warmup < 1 or steps < 1:
            raise ValueError(f"TraceSteps: warmup and steps must be >= 1, got {warmup} and {steps}")
        self.log_dir, self.warmup, self.steps = os.fspath(log_dir), warmup, steps
        self.active = False
        self.first: int | None = None
        self.done = False

    def on_step(self, run: RunInfo, step: int, metrics: dict) -> None:
        if not run.is_main or self.done:
            return
        if not self.active and step + 1 >= run.start_step + self.warmup:
            jax.block_until_ready(run.state)  # the warm-up steps stay out of the trace
            jax.profiler.start_trace(self.log_dir, create_perfetto_trace=True)
            self.active, self.first = True, step + 2  # step + 1 ran before the trace started
        elif self.active and self.first is not None and step + 1 >= self.first + self.steps - 1:
            self._stop(run)

    def on_end(self, run: RunInfo, summary: dict) -> None:
        if self.active:
            self._stop(run)

    def _stop(self, run: RunInfo) -> None:
        jax.block_until_ready(run.state)
        jax.profiler.stop_trace()
        self.active, self.done = False, True
        log.info("profiler trace of steps %s.. written to %s", self.first, self.log_dir)
        self._summarise()

    def _summarise(self) -> None:
        """Where the traced steps' device time went (`jaxnn.profile.kernel_table`), in the log and in
        DIR/kernel_table.txt; a trace it cannot read is said in one line, and the run goes on."""
        from jaxnn.profile.kernel_table import format_kernel_table, kernel_table

        try:
            table = format_kernel_table(kernel_table(self.log_dir), top=10)
        except (OSError, ValueError) as err:
            log.warning("profiler trace in %s: no kernel table (%s)", self.log_dir, err)
            return
        with open(os.path.join(self.log_dir, "kernel_table.txt"), "w") as f:
            f.write(table + "\n")
        log.info("device time of the traced steps:\n%s", table)
