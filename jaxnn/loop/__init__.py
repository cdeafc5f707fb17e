"""The public training loop: `jaxnn.fit(model, data, ...)` trains any Layer with any loss and optax optimizer.

- `fit.py`: `fit` (the keyword API) and the loop itself: steps, evaluation, checkpoints, signals;
- `rundir.py`: the run directory: its lock, config.json, metrics, summary.json (`RunFiles`, `fresh_run_dir`);
- `plots.py`: the training curves as PNG files at the end of a run.
"""

from jaxnn.loop.fit import FitInterrupted, FitResult, TrainData, fit, fresh_run_dir

__all__ = ["FitInterrupted", "FitResult", "TrainData", "fit", "fresh_run_dir"]
