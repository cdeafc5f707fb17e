"""A resume continues the run it resumes only with the optimizer that run trained with: a run directory's
config.json and a saved model's model.json record the optimizer's fingerprint (`jaxnn._src.optimizer_id`), and a
resume with another optimizer, or, under fit's default (decaying) optimizer, another `steps`, is refused in one
line naming the difference, before anything is written. `check_optimizer=False` continues anyway (a new learning
rate or optimizer on purpose). Records written before fingerprints existed are not checked.
"""

from __future__ import annotations

import json
import logging
import pathlib
from typing import Any

from jaxnn._src.checks import first_differences
from jaxnn._src.optimizer_id import FIELD, describe, differences
from jaxnn.config import ConfigError, FitConfig

log = logging.getLogger("jaxnn.loop")

OVERRIDE = "pass check_optimizer=False to fit to continue anyway"


def refuse_other_optimizer(cfg: FitConfig, resume_from: str | None, record: dict, default_optimizer: bool) -> None:
    """Refuses a resume (of `cfg.run_dir`, or of the saved model `resume_from`) whose optimizer differs from the
    one recorded there; `record` is this run's: {"optimizer": fingerprint, "steps": n when the schedule decays}."""
    if resume_from is not None:
        saved = _saved_model_training(resume_from)
        _refuse_other_steps(saved, record, default_optimizer, f"the saved model {resume_from}")
        _refuse_differences(saved.get(FIELD), record[FIELD], f"the saved model {resume_from}")
    if cfg.resume and cfg.run_dir and not cfg.overwrite:
        saved = _json(pathlib.Path(cfg.run_dir) / "config.json")
        _refuse_differences(saved.get(FIELD), record[FIELD], f"the run in {cfg.run_dir}")


def _refuse_other_steps(saved: dict, record: dict, default_optimizer: bool, where: str) -> None:
    """The run directory's rule (`refuse_resume_with_other_steps`) for a saved model: the default optimizer's
    learning rate decays to 0 at `steps`, so other steps would restart its schedule."""
    was, now = saved.get("steps"), record.get("steps")
    if not (default_optimizer and isinstance(was, int) and isinstance(now, int)) or was == now:
        return
    raise ConfigError(
        f"fit: resume with steps {now}, but {where} was trained for {was}, and the default optimizer's learning "
        f"rate decays to 0 at `steps`; resume with steps={was}, pass optimizer= with a schedule of your own, "
        f"or {OVERRIDE} (the schedule starts again)"
    )


def _refuse_differences(saved: Any, now: dict, where: str) -> None:
    if saved is None:  # recorded before fingerprints: nothing to compare
        log.info("resume: %s records no optimizer; not checked", where)
        return
    diffs = differences(saved, now)
    if diffs:
        raise ConfigError(
            f"resume: {where} was trained with optimizer {describe(saved)}; this run's differs "
            f"({first_differences(diffs, 3)}); {OVERRIDE}"
        )


def _saved_model_training(folder: str) -> dict:
    training = _json(pathlib.Path(folder) / "model.json").get("training")
    return training if isinstance(training, dict) else {}


def _json(path: pathlib.Path) -> dict:
    """A record's JSON, or {} when absent or damaged (its owner's checks report the damage)."""
    try:
        value = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
