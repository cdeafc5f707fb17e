"""The loop's bookkeeping: metrics read one step late, interval averages, skipped fp16 steps, the rows of the
history and metrics files, the progress bar, the callbacks' hooks and the summary. Internal to `jaxnn.loop`."""

from __future__ import annotations

import logging
import time
from typing import Any

import jax
import numpy as np

from jaxnn._src.optional import available
from jaxnn.callbacks import Callback, RunInfo
from jaxnn.checkpoint import state_digest
from jaxnn.config import FitConfig
from jaxnn.loop.rundir import RunFiles

log = logging.getLogger("jaxnn.loop")


class History(list):
    """Every row fit wrote, in order (a list of dicts: {"split": "train" or "eval", "step": ..., metrics}), that
    also reads by name as Keras' `history.history` does: `history["loss"]` is the training loss of each logged
    row, `history["eval_accuracy"]` the accuracy of each evaluation, `history["step"]` / `["eval_step"]` their
    steps; `history.as_dict()` gives every column."""

    def __getitem__(self, key):
        if not isinstance(key, str):
            return super().__getitem__(key)
        columns = self.as_dict()
        if key not in columns:
            raise KeyError(f"history has no {key!r}; it has {sorted(columns)}")
        return columns[key]

    def keys(self) -> list[str]:
        return sorted(self.as_dict())

    def as_dict(self) -> dict[str, list]:
        """{name: values in order}: training columns by their names, evaluation columns prefixed "eval_"."""
        columns: dict[str, list] = {}
        for row in self:
            prefix = "eval_" if row.get("split") == "eval" else ""
            for name, value in row.items():
                if name != "split":
                    columns.setdefault(prefix + name, []).append(value)
        return columns


class _NoBar:
    """Stands in for tqdm's bar when there is none to show."""

    def update(self, n: int) -> None: ...

    def set_postfix(self, *args: Any, **kwargs: Any) -> None: ...

    def close(self) -> None: ...


def _progress_bar(show: bool, total: int, initial: int, desc: str) -> Any:
    if not show:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, desc=desc)


class Tracker:
    """Metrics one step late, interval averages, skipped fp16 steps, rows, progress bar and callbacks."""

    def __init__(self, cfg: FitConfig, files: RunFiles, callbacks: list[Callback], run: RunInfo, batch_size: int):
        self.cfg, self.files, self.callbacks, self.run, self.batch_size = cfg, files, callbacks, run, batch_size
        self.pending: tuple[int, dict] | None = None
        self.sums: dict[str, float] = {}
        self.n = self.steps_done = self.skipped = self.skipped_total = 0
        self.wait_total = 0.0
        self.history = History()
        self.eval_postfix: dict[str, str] = {}  # the latest evaluation, kept in the bar beside the train numbers
        self.t_start = self.t_interval = time.perf_counter()
        show = cfg.progress and files.is_main and available("tqdm", "the progress bar")
        self.bar = _progress_bar(show, cfg.steps, run.start_step, cfg.name)

    def after_step(self, step: int, metrics) -> None:
        self._absorb()
        self.pending = (step, metrics)
        self.steps_done += 1
        self.bar.update(1)

    def _absorb(self) -> None:
        if self.pending is None:
            return
        step, metrics = self.pending
        self.pending = None
        m = {k: float(np.asarray(v)) for k, v in jax.device_get(metrics).items() if np.ndim(v) == 0}
        if "grads_finite" in m and not m["grads_finite"]:
            self.skipped += 1
            self.skipped_total += 1
        for k, v in m.items():
            if k not in ("grads_finite", "count"):
                self.sums[k] = self.sums.get(k, 0.0) + v
        self.n += 1
        for c in self.callbacks:
            c.on_step(self.run, step, m)
        self.bar.set_postfix(
            loss=f"{m['loss']:.4f}",
            **({"skipped": self.skipped_total} if "grads_finite" in m else {}),
            **self.eval_postfix,
            refresh=False,
        )

    def finish_steps(self) -> None:
        self._absorb()

    def log(self, step: int, wait: float) -> None:
        self._absorb()
        now = time.perf_counter()
        dt = now - self.t_interval
        self.wait_total += wait
        row: dict[str, Any] = {
            "split": "train",
            "step": step,
            **{k: v / max(self.n, 1) for k, v in self.sums.items()},
            "examples_per_s": self.n * self.batch_size / dt,
            "input_wait_s": wait,
            "input_wait_frac": wait / dt,
            "time_s": now - self.t_start,
        }
        if self.run.uses_loss_scaling:
            row["skipped_steps"] = self.skipped
        for c in self.callbacks:
            c.on_log(self.run, row)
        self._write(row)
        self.bar.set_postfix(
            loss=f"{row['loss']:.4f}",
            ex_s=f"{row['examples_per_s']:.0f}",
            wait=f"{100 * row['input_wait_frac']:.1f}%",
            **({"skipped": self.skipped_total} if self.run.uses_loss_scaling else {}),
            **self.eval_postfix,
        )
        self.sums, self.n, self.skipped = {}, 0, 0
        self.t_interval = time.perf_counter()

    def eval(self, step: int, metrics: dict) -> dict:
        self._write({"split": "eval", "step": step, **metrics})
        self.eval_postfix = {f"eval_{k}": f"{v:.4f}" for k, v in metrics.items()}
        self.bar.set_postfix(**self.eval_postfix)
        log.info("eval at step %d: %s", step, " ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
        for c in self.callbacks:
            c.on_eval(self.run, step, metrics)
        return metrics

    def checkpointed(self, step: int) -> None:
        for c in self.callbacks:
            c.on_checkpoint(self.run, step)

    def _write(self, row: dict) -> None:
        self.history.append(row)
        self.files.write(row)

    def summary(self, step, start, state, eval_metrics, stop, failure, wait) -> dict:
        self.bar.close()
        elapsed = time.perf_counter() - self.t_start
        self.wait_total += wait
        summary = {
            "name": self.cfg.name,
            "step": step,
            "steps": self.cfg.steps,
            "resumed_from": start,
            "interrupted_by": stop.received,
            "signals_ignored": stop.ignored,
            "stopped_by": self.run.stop_reason,
            "error": str(failure) if failure else None,
            "time_s": elapsed,
            "examples_per_s": self.steps_done * self.batch_size / elapsed if elapsed else 0.0,
            "input_wait_frac": self.wait_total / elapsed if elapsed else 0.0,
            "run_dir": self.cfg.run_dir,
            **{f"eval_{k}": v for k, v in eval_metrics.items()},
        }
        if self.run.uses_loss_scaling:
            summary["skipped_steps"] = self.skipped_total
        for c in self.callbacks:
            c.on_end(self.run, summary)
        # Of the state fit returns: a callback may have put another (e.g. the best) in its place.
        summary["param_digest"] = state_digest((self.run.result_state or state).params)
        return summary
