"""Callbacks: code that runs at the training loop's events, and the ones users expect built in.

A callback subclasses `Callback` and overrides any of its hooks. Each hook gets the `RunInfo` of the run (step,
steps, run directory, the latest train state, `request_stop`) and, where there is one, the host-side metrics:

    on_start(run)                 before the first step (after a restore)
    on_step(run, step, metrics)   each step's metrics, read one step late so the device never waits
    on_log(run, row)              a train row about to be written; a callback may add scalars to it
    on_eval(run, step, metrics)   after each evaluation
    on_checkpoint(run, step)      after a checkpoint is written
    on_end(run, summary)          once, with the summary about to be written (may add to it)

`run.request_stop(reason)` ends the run cleanly after the current step (with a checkpoint); raising an exception
ends it at once, without one. A callback that watches evaluation metrics names them in `monitors()`: `fit`
checks them against what the loss reports before anything is written. Setting `run.result_state` (e.g. in
`on_end`) makes that state the one `fit` returns; checkpoints keep the state training reached.

Because `on_step(run, s, ...)` runs once step s + 1 is dispatched, a stop asked for
there ends the run after step s + 1.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from jaxnn.errors import NonFiniteError, SkippedStepsError  # noqa: F401 (also importable from here)

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RunInfo:
    """What a callback may read about the run, and the one thing it may ask for: to stop."""

    steps: int
    run_dir: str | None
    is_main: bool = True
    step: int = 0
    start_step: int = 0
    state: Any = None
    uses_loss_scaling: bool = False
    stop_reason: str | None = None
    result_state: Any = None  # when set, the state `fit` returns instead of the last one

    def request_stop(self, reason: str) -> None:
        """End the run cleanly after the current step, with a checkpoint; the first reason asked for is kept."""
        if self.stop_reason is None:
            self.stop_reason = reason


class Callback:
    """Base class: every hook does nothing."""

    def monitors(self) -> tuple[str, ...]:
        """The evaluation metrics this callback reads; `fit` refuses a name the evaluation does not report."""
        return ()

    def on_start(self, run: RunInfo) -> None:
        """Before the first step, after any restore (`run.start_step` is where the run resumes)."""

    def on_step(self, run: RunInfo, step: int, metrics: dict) -> None:
        """Step `step`'s metrics as host numbers, read once step + 1 is dispatched so the device never waits."""

    def on_log(self, run: RunInfo, row: dict) -> None:
        """A train row about to be written to the metrics files; scalars added to `row` are written with it."""

    def on_eval(self, run: RunInfo, step: int, metrics: dict) -> None:
        """After each evaluation, with its metrics (`loss`, and `accuracy` for classification)."""

    def on_checkpoint(self, run: RunInfo, step: int) -> None:
        """After the checkpoint of `step` is written (or handed to orbax, with asynchronous checkpoints)."""

    def on_end(self, run: RunInfo, summary: dict) -> None:
        """Once, with the summary about to be written to `summary.json`; entries added to it are written too."""


class NonFiniteGuard(Callback):
    """Stops at the first non-finite loss with one line naming the step (on by default in `jaxnn.fit`).

    Under loss scaling (fp16) a non-finite step is skipped by the step itself (parameters unchanged, scale
    halved), so one is not an error. A run that skips more than `max_skipped_fraction` (default 0.5) of the last
    `window` (default 20) steps is not learning, though: it stops with a `SkippedStepsError` (a `NonFiniteError`,
    so `jaxnn train` exits 1), judged from its `window`-th step on. The skips of the scale's first calibration
    (from 2^15 down, usually a few) fit within that budget. `max_skipped_in_row` skipped steps in a row are
    also reported as a warning.
    """

    def __init__(self, max_skipped_in_row: int = 25, *, max_skipped_fraction: float = 0.5, window: int = 20):
        if not (isinstance(max_skipped_fraction, (int, float)) and 0 <= max_skipped_fraction <= 1):
            raise ValueError(f"NonFiniteGuard: max_skipped_fraction must be in [0, 1], got {max_skipped_fraction!r}")
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ValueError(f"NonFiniteGuard: window must be a positive integer, got {window!r}")
        self.max_skipped_in_row = max_skipped_in_row
        self.max_skipped_fraction, self.window = max_skipped_fraction, window
        self.skipped_in_row = 0
        self.recent: collections.deque[bool] = collections.deque(maxlen=window)

    def on_start(self, run: RunInfo) -> None:
        self.skipped_in_row = 0
        self.recent.clear()

    def on_step(self, run: RunInfo, step: int, metrics: dict) -> None:
        loss = float(metrics["loss"])
        if "grads_finite" in metrics:
            self._skipped(step, not metrics["grads_finite"], float(metrics.get("loss_scale", float("nan"))))
            return
        if not math.isfinite(loss):
            raise NonFiniteError(
                f"the loss became {loss} at step {step}; stopped without saving non-finite "
                "parameters (try a lower learning rate, gradient clipping, or bf16)"
            )

    def _skipped(self, step: int, skipped: bool, scale: float) -> None:
        self.recent.append(skipped)
        self.skipped_in_row = self.skipped_in_row + 1 if skipped else 0
        if self.skipped_in_row and self.skipped_in_row % self.max_skipped_in_row == 0:
            log.warning(
                "%d steps in a row skipped for non-finite gradients (up to step %d, loss scale %g): "
                "the run is not learning; try bf16 or a lower learning rate",
                self.skipped_in_row,
                step,
                scale,
            )
        count = sum(self.recent)
        if len(self.recent) == self.window and count > self.max_skipped_fraction * self.window:
            raise SkippedStepsError(
                f"{count} of the last {self.window} steps (up to step {step}) were skipped for non-finite fp16 "
                f"gradients (loss scale {scale:g}), more than NonFiniteGuard's max_skipped_fraction "
                f"{self.max_skipped_fraction:g}: the run is not learning; try bf16, a lower learning rate or "
                "gradient clipping"
            )


# Words in a metric's name that say which way is better (Keras infers the direction from the name the same way).
_HIGHER_IS_BETTER = ("acc", "auc", "f1", "precision", "recall", "iou", "dice", "map", "top", "r2", "bleu", "rouge")
_LOWER_IS_BETTER = ("loss", "error", "err", "perplexity", "ppl", "bits", "mse", "mae", "rmse", "nll", "wer", "cer")


def metric_mode(metric: str, mode: str = "auto") -> str:
    """ "min" or "max" for watching `metric`: `mode` itself when given, else inferred from the name ("accuracy",
    "eval_top5" -> max; "loss", "bits_per_token" -> min). A name that says neither is a ValueError asking for
    `mode`."""
    if mode in ("min", "max"):
        return mode
    if mode != "auto":
        raise ValueError(f"mode must be 'auto', 'min' or 'max', got {mode!r}")
    name = metric.lower()
    for prefix in ("eval_", "val_", "train_", "test_"):
        name = name.removeprefix(prefix)
    lower = any(word in name for word in _LOWER_IS_BETTER)
    higher = any(word in name for word in _HIGHER_IS_BETTER)
    if lower != higher:
        return "min" if lower else "max"
    raise ValueError(
        f"cannot tell from its name whether {metric!r} is better high or low; pass mode='max' or mode='min'"
    )


class EarlyStopping(Callback):
    """Stops when an evaluation metric has not improved by `min_delta` for `patience` evaluations in a row.

    `mode`: "auto" (the default) infers the direction from the metric's name (`metric_mode`: accuracy-like names
    are better high, losses low; another name asks for "min" or "max"); "min" or "max" says it.

    `restore_best=True`: `fit` returns the state of the best evaluation (a host copy is kept at each
    improvement); the summary names its step (`best_step`, `best_<metric>`).
    """

    def __init__(
        self,
        metric: str = "loss",
        *,
        mode: str = "auto",
        patience: int = 3,
        min_delta: float = 0.0,
        restore_best: bool = False,
    ):
        if mode not in ("auto", "min", "max"):
            raise ValueError(f"EarlyStopping: mode must be 'auto', 'min' or 'max', got {mode!r}")
        if patience < 1:
            raise ValueError(f"EarlyStopping: patience must be >= 1, got {patience!r}")
        self.metric, self.requested_mode, self.patience, self.min_delta = metric, mode, patience, min_delta
        self.restore_best = restore_best
        self.best: float | None = None
        self.best_step: int | None = None
        self.best_state: Any = None
        self.bad_evals = 0

    def monitors(self) -> tuple[str, ...]:
        return (self.metric,)

    @property
    def mode(self) -> str:
        """ "min" or "max": the requested mode, or the one the metric's name implies (`metric_mode`). fit checks
        it with the metric's name before training, so a name that implies neither is refused there."""
        return metric_mode(self.metric, self.requested_mode)

    def on_start(self, run: RunInfo) -> None:
        self.best = self.best_step = self.best_state = None
        self.bad_evals = 0

    def on_eval(self, run: RunInfo, step: int, metrics: dict) -> None:
        if self.metric not in metrics:
            raise ValueError(f"EarlyStopping: the evaluation reports {sorted(metrics)}, not {self.metric!r}")
        value = float(metrics[self.metric])
        better = self.best is None or (
            value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta
        )
        if better:
            self.best, self.best_step, self.bad_evals = value, step, 0
            if self.restore_best:
                self.best_state = _host_copy(run.state)  # the next step donates the device buffers
            return
        self.bad_evals += 1
        if self.bad_evals >= self.patience:
            run.request_stop(
                f"early stopping: eval {self.metric} has not improved on {self.best:.6g} (step "
                f"{self.best_step}) for {self.patience} evaluations"
            )

    def on_end(self, run: RunInfo, summary: dict) -> None:
        if self.best_step is not None:
            summary["best_step"], summary[f"best_{self.metric}"] = self.best_step, self.best
        if self.restore_best and self.best_state is not None:
            import jax

            like = run.state
            run.result_state = jax.tree.map(lambda h, x: jax.device_put(h, x.sharding), self.best_state, like)


def _host_copy(tree: Any) -> Any:
    import jax
    import numpy as np

    return jax.tree.map(np.asarray, jax.device_get(tree))


class LearningRateLogger(Callback):
    """Adds the learning rate (`lr`) to every train row, from an optax schedule `step -> lr`."""

    def __init__(self, schedule: Callable[[int], Any]):
        self.schedule = schedule

    def on_log(self, run: RunInfo, row: dict) -> None:
        row["lr"] = float(self.schedule(row["step"]))


class MetricLogger(Callback):
    """Logs each train row and each evaluation through `logging` (for runs without a progress bar)."""

    def __init__(self, level: int = logging.INFO):
        self.level = level

    @staticmethod
    def _fmt(metrics: dict) -> str:
        return " ".join(f"{k}={v:.4g}" for k, v in metrics.items() if isinstance(v, float))

    def on_log(self, run: RunInfo, row: dict) -> None:
        log.log(self.level, "step %d/%d %s", row["step"], run.steps, self._fmt(row))

    def on_eval(self, run: RunInfo, step: int, metrics: dict) -> None:
        log.log(self.level, "eval at step %d: %s", step, self._fmt(metrics))


class StepWatchdog(Callback):
    """Ends the process with a clear line if no step finishes for `timeout_s` (e.g. a peer process died).

    jax's coordination service normally ends the survivors of a multi-process run first; this bounds the rest.
    """

    def __init__(self, timeout_s: float = 300.0):
        self.timeout_s = timeout_s
        self.last = time.monotonic()
        self._started = False

    def on_start(self, run: RunInfo) -> None:
        self.last = time.monotonic()
        if not self._started:
            self._started = True
            threading.Thread(target=self._watch, daemon=True).start()

    def on_step(self, run: RunInfo, step: int, metrics: dict) -> None:
        self.last = time.monotonic()

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout_s / 4))
            if time.monotonic() - self.last > self.timeout_s:
                sys.stderr.write(
                    f"jaxnn: no training step finished in {self.timeout_s:.0f} s; another process "
                    "has probably died; stopping\n"
                )
                sys.stderr.flush()
                os._exit(3)


class ExitAt(Callback):
    """Fault injection for tests: the process (or only `process_index`) exits with `code` at `step`."""

    def __init__(self, step: int, *, process_index: int | None = None, code: int = 17):
        self.step, self.process_index, self.code = step, process_index, code

    def on_step(self, run: RunInfo, step: int, metrics: dict) -> None:
        import jax

        if step >= self.step and self.process_index in (None, jax.process_index()):
            sys.stderr.write(f"jaxnn: process {jax.process_index()} exiting at step {step} (fault injection)\n")
            sys.stderr.flush()
            os._exit(self.code)
