"""`jaxnn train --lr-find`: the learning-rate range test (`jaxnn.lr_find`) on the model, data and settings the
flags name, instead of training: 100 steps from 1e-7 to 1, the curve in `<run-dir>/lr_find.png`, the suggestion
printed (then train with `--lr` at it)."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

STEPS, MIN_LR, MAX_LR = 100, 1e-7, 1.0


def lr_find_main(cfg: Any, callbacks: list) -> int:
    """Runs the range test for the `TrainConfig` `cfg` (its run directory holds the test's own run) and prints
    the suggestion and the plot's path."""
    import optax

    from jaxnn._src.optional import installed
    from jaxnn.cli.recipes import train
    from jaxnn.loop.lr_range import StopWhenDiverged, found_from_rows, sweep
    from jaxnn.metrics import read_jsonl

    schedule = sweep(MIN_LR, MAX_LR, STEPS)
    adamw = optax.adamw(schedule, weight_decay=cfg.weight_decay)
    clip = cfg.fit.clip_norm
    tx = optax.chain(optax.clip_by_global_norm(clip), adamw) if clip else adamw
    fit = dataclasses.replace(cfg.fit, steps=STEPS, epochs=None, log_every=1, guard_nonfinite=False, plots=False)
    train(dataclasses.replace(cfg, fit=fit), callbacks=[*callbacks, StopWhenDiverged()], optimizer=tx)
    run_dir = pathlib.Path(str(fit.run_dir))
    plot = str(run_dir / "lr_find.png") if installed("matplotlib") else None
    found = found_from_rows(read_jsonl(run_dir / "metrics.jsonl"), schedule, plot)
    print(f"lr_find: {len(found.losses)} steps from {MIN_LR:g}; suggested --lr {found.suggestion:.3g} (the steepest "
          f"fall of the smoothed loss){f'; plot -> {plot}' if plot else ''}")  # fmt: skip
    return 0
