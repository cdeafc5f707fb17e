"""The public training loop: `jaxnn.fit(model, data, ...)` trains any Layer with any loss and optax optimizer.

- `fit.py`: `fit`, the keyword API: its keywords become one `FitConfig` and one `FitInputs` for `run_fit`;
- `rundir.py`: the run directory: config.json, metrics, summary.json and the records they hold (`RunFiles`,
  `fresh_run_dir`; its lock is `jaxnn._src.run_lock`'s);
- `plots.py`: the training curves as PNG files at the end of a run;
- `lr_range.py`: `lr_find`, the learning-rate range test.

Internal to the package: `_run.py` (`run_fit` and the loop: steps, evaluation, checkpoints, signals),
`_setup.py` (the checks made before anything is written, and the one probe of the model's output), `_start.py`
(where a run starts: given params, LoRA adapters, another run's state),
`_preference.py` (fit's `objective`: `preference_start`),
`_bookkeeping.py` (metrics one step late, the progress bar, callbacks, the summary), `_levers.py` (the block a
run starts with: what its levers do), `_keywords.py` (fit's Keras-style data keywords: validation_split,
class and sample weights) and `_ema.py` (fit's `ema`: the weights' moving average).
"""

from jaxnn.loop.fit import (
    FitInputs,
    FitInterrupted,
    FitResult,
    TrainData,
    fit,
    fresh_run_dir,
    preference_start,
    run_fit,
)

__all__ = [
    "FitInputs",
    "FitInterrupted",
    "FitResult",
    "TrainData",
    "fit",
    "fresh_run_dir",
    "preference_start",
    "run_fit",
]
