"""`jaxnn.lr_find`: the learning-rate range test (Smith 2015; fastai's `lr_find`, Lightning's `Tuner.lr_find`).

    found = jaxnn.lr_find(model, (x, y), min_lr=1e-6, max_lr=1.0, steps=100, plot="lr_find.png")
    found.suggestion  # where the smoothed loss falls fastest
    jaxnn.fit(model, (x, y), optimizer=jaxnn.train.make_optimizer(found.suggestion, total_steps=1000), ...)

A short run whose learning rate grows exponentially from `min_lr` to `max_lr`, one step each, through `jaxnn.fit`
(the same data order, precision and step as the training it prepares); it stops once the loss exceeds 4x its best.
The loss is smoothed by an exponential average (0.98, bias-corrected, as fastai does), and the suggestion is the
learning rate where the smoothed loss falls fastest against log(lr) (the most negative slope), before it diverged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import optax

from jaxnn.callbacks import Callback, RunInfo
from jaxnn.config import ConfigError

DIVERGED = 4.0  # the test stops once the loss exceeds this multiple of its best
SMOOTHING = 0.98


class LrFound(NamedTuple):
    lrs: np.ndarray  # the learning rate of each step run
    losses: np.ndarray  # each step's training loss (before its update)
    smoothed: np.ndarray  # the exponential average of `losses`, bias-corrected
    suggestion: float  # the learning rate where `smoothed` falls fastest against log(lr)
    plot: str | None  # the PNG written, if asked


class StopWhenDiverged(Callback):
    """Ends the range test once the loss is not finite or exceeds `DIVERGED` times its best."""

    def __init__(self) -> None:
        self.best = math.inf

    def on_step(self, run: RunInfo, step: int, metrics: dict) -> None:
        loss = metrics.get("loss", math.nan)
        if not math.isfinite(loss) or loss > DIVERGED * self.best:
            run.request_stop(f"lr_find: the loss diverged at step {step}")
        self.best = min(self.best, loss) if math.isfinite(loss) else self.best


def default_optimizer(schedule: optax.Schedule) -> optax.GradientTransformation:
    """fit's default optimizer on `schedule`: AdamW behind a clip of the gradients' global norm at 1.0."""
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.0))


def lr_find(
    model: Any,
    data: Any,
    *,
    min_lr: float = 1e-7,
    max_lr: float = 1.0,
    steps: int = 100,
    optimizer: Callable[[optax.Schedule], optax.GradientTransformation] = default_optimizer,
    plot: str | None = None,
    **fit_kwargs: Any,
) -> LrFound:
    """Runs the range test (see the module docstring) and returns `LrFound(lrs, losses, smoothed, suggestion,
    plot)`. `optimizer` builds the optimizer from a learning-rate schedule (default: AdamW clipped at global norm
    1.0, as fit's default); `plot` writes the loss against the learning rate there (a PNG; needs matplotlib);
    `fit_kwargs` go to `jaxnn.fit` (loss, batch_size, precision, seed, ...)."""
    if not (0 < min_lr < max_lr):
        raise ConfigError(f"lr_find: need 0 < min_lr < max_lr, got min_lr {min_lr!r} and max_lr {max_lr!r}")
    if not isinstance(steps, int) or steps < 3:
        raise ConfigError(f"lr_find: steps must be an integer of at least 3, got {steps!r}")
    refused = sorted(set(fit_kwargs) & {"optimizer", "steps", "epochs", "log_every", "resume", "eval_data"})
    if refused:
        raise ConfigError(f"lr_find: {refused} are the range test's own; pass the rest of fit's keywords")
    from jaxnn.loop.fit import fit

    schedule = sweep(min_lr, max_lr, steps)
    callbacks = [*fit_kwargs.pop("callbacks", ()), StopWhenDiverged()]
    fit_kwargs = {"progress": False, "plots": False, "guard_nonfinite": False, **fit_kwargs}
    result = fit(model, data, optimizer=optimizer(schedule), steps=steps, log_every=1, callbacks=callbacks,
                 **fit_kwargs)  # fmt: skip
    return found_from_rows(result.history, schedule, plot)


def sweep(min_lr: float, max_lr: float, steps: int) -> Callable[[Any], Any]:
    """The range test's schedule: `min_lr` at the first update, growing exponentially to `max_lr` at the last."""
    ratio = max_lr / min_lr
    return lambda count: min_lr * ratio ** (count / (steps - 1))


def found_from_rows(rows: Any, schedule: Callable[[Any], Any], plot: str | None) -> LrFound:
    """`LrFound` from a range test's train rows (one per step, as `log_every=1` writes them)."""
    rows = [row for row in rows if row.get("split") == "train"]
    losses = np.array([row["loss"] for row in rows], np.float64)
    lrs = np.array([float(schedule(row["step"] - 1)) for row in rows])
    smoothed = smooth(losses)
    found = LrFound(lrs, losses, smoothed, suggest(lrs, smoothed), None)
    return found._replace(plot=write_plot(found, plot)) if plot else found


def smooth(losses: np.ndarray, beta: float = SMOOTHING) -> np.ndarray:
    """The bias-corrected exponential average of `losses` (fastai's): avg_i / (1 - beta^(i+1))."""
    out, average = np.empty(len(losses)), 0.0
    for i, loss in enumerate(losses):
        average = beta * average + (1 - beta) * loss
        out[i] = average / (1 - beta ** (i + 1))
    return out


def suggest(lrs: np.ndarray, smoothed: np.ndarray) -> float:
    """The learning rate of the most negative slope of `smoothed` against log(lr), over the finite points before
    the loss passed its minimum by `DIVERGED`x; the smallest rate where fewer than 3 points remain."""
    finite = np.isfinite(smoothed)
    end = int(np.argmin(finite)) if not finite.all() else len(smoothed)
    best = np.minimum.accumulate(smoothed[:end]) if end else smoothed[:0]
    over = np.nonzero(smoothed[:end] > DIVERGED * best)[0]
    end = int(over[0]) if len(over) else end
    if end < 3:
        return float(lrs[0])
    slope = np.gradient(smoothed[:end], np.log(lrs[:end]))
    return float(lrs[int(np.argmin(slope))])


def write_plot(found: LrFound, path: str) -> str:
    """The losses (raw and smoothed) against the learning rate, on a log axis, with the suggestion marked."""
    from jaxnn._src.optional import require

    require("matplotlib", "the lr_find plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(found.lrs, found.losses, alpha=0.3, label="loss")
    ax.plot(found.lrs, found.smoothed, label="smoothed")
    ax.axvline(found.suggestion, color="red", linestyle="--", label=f"suggestion {found.suggestion:.2e}")
    ax.set(xscale="log", xlabel="learning rate", ylabel="training loss", title="lr_find")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)
