"""Metric writers for tracking services: Weights & Biases ("wandb") and MLflow ("mlflow"), each through its own
library, imported only when a run asks for it (`pip install 'jaxnn[wandb]'`, `'jaxnn[mlflow]'`).

Both log what the other writers do: one value per numeric metric of a row, named `<split>/<metric>` as in
TensorBoard, at the row's step; the run's config.json goes to the service as its config (W&B) or its flattened
parameters (MLflow). Settings come from the services' own environment variables (see docs/training.md):

- W&B: `WANDB_PROJECT` (else "jaxnn"), `WANDB_ENTITY`, `WANDB_MODE` ("offline" writes `<run_dir>/wandb/` for
  `wandb sync` later); the W&B run's id is the jaxnn run's id, so a resumed run directory continues its W&B run.
- MLflow: `MLFLOW_TRACKING_URI` (else a SQLite store, `<run_dir>/mlflow.db`: MLflow's file store now refuses to
  start unless `MLFLOW_ALLOW_FILE_STORE` is set), `MLFLOW_EXPERIMENT_NAME` (else "jaxnn"); the MLflow run carries
  the jaxnn run's id as its tag `jaxnn_run_id`, which a resumed run directory finds and continues.
"""

from __future__ import annotations

import os
import pathlib
import re
import sys
import time
from typing import Any

from jaxnn._src.storage import PathLike

# The files these writers put in a run directory by default (an overwrite removes them with the run's other files).
SERVICE_FILES = ("wandb", "mlflow.db", "mlartifacts")
RUN_ID_TAG = "jaxnn_run_id"
# MLflow's limits: a parameter's name is at most 250 characters of letters, digits, "_", "-", ".", " " and "/"; its
# value at most 6000 characters; a batch holds at most 100 parameters.
_PARAM_KEY_CHARS, _PARAM_VALUE_CHARS, _PARAMS_PER_BATCH = 250, 6000, 100
_NOT_IN_A_PARAM_KEY = re.compile(r"[^\w\-. /]")


def scalars(row: dict) -> dict[str, float]:
    """The row's numeric metrics as `{"<split>/<metric>": value}` (booleans, strings and the step left out)."""
    split = row.get("split", "train")
    return {
        f"{split}/{name}": float(value)
        for name, value in row.items()
        if name not in ("split", "step") and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def flat_params(config: dict, prefix: str = "") -> dict[str, str]:
    """A nested config as `{"a.b": "value"}` strings for MLflow's `log_params`: a character MLflow refuses in a
    name (a sharding rule's `*`) becomes "_", and names and values are cut to MLflow's lengths."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{_NOT_IN_A_PARAM_KEY.sub('_', str(key))}"
        if isinstance(value, dict) and value:
            for inner, text in flat_params(value, f"{name}.").items():
                flat.setdefault(inner, text)
        else:
            flat.setdefault(name[:_PARAM_KEY_CHARS], str(value)[:_PARAM_VALUE_CHARS])
    return flat


def _require(module: str, writer: str):
    from jaxnn._src.optional import require

    try:
        return require(module, f"metric writer {writer!r}")
    except ImportError as err:  # a ValueError, as the other writers' bad settings
        raise ValueError(str(err)) from None


def _failing() -> bool:
    # close() runs in the loop's `finally`: an exception on its way out marks the service's run as failed.
    return sys.exc_info()[0] is not None


class WandbWriter:
    """A W&B run (`wandb.init`) whose files go under `<run_dir>/wandb`; its id is the jaxnn run's, resumed."""

    def __init__(self, run_dir: PathLike, *, run_id: str | None, name: str, config: dict):
        wandb = _require("wandb", "wandb")
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "jaxnn",
            name=name,
            config=config,
            dir=str(run_dir),
            id=run_id,
            resume="allow" if run_id else None,
        )

    def write(self, row: dict) -> None:
        """The row's metrics at its step (W&B merges a step's train and eval rows into one)."""
        self._run.log(scalars(row), step=int(row["step"]))

    def close(self) -> None:
        """Finish the W&B run: exit code 1 when an exception ends the run, else 0."""
        self._run.finish(exit_code=1 if _failing() else 0)


class MlflowWriter:
    """An MLflow run in the experiment `MLFLOW_EXPERIMENT_NAME` (else "jaxnn"), through `MlflowClient` alone
    (MLflow's module-level API keeps a process-wide active run; the client changes nothing outside itself)."""

    def __init__(self, run_dir: PathLike, *, run_id: str | None, name: str, config: dict):
        tracking = _require("mlflow.tracking", "mlflow")
        self._entities = _require("mlflow.entities", "mlflow")
        run_dir = pathlib.Path(run_dir).absolute()
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run_dir / 'mlflow.db'}"
        self._client = tracking.MlflowClient(tracking_uri=uri)
        experiment = self._experiment_id(os.environ.get("MLFLOW_EXPERIMENT_NAME") or "jaxnn", run_dir, uri)
        self.run_id = self._continued(experiment, run_id)
        if self.run_id is None:
            tags = {RUN_ID_TAG: run_id} if run_id else {}
            self.run_id = self._client.create_run(experiment, run_name=name, tags=tags).info.run_id
            self._log_params(flat_params(config))
        else:  # its parameters were logged when it began; MLflow refuses to change one (a resume's longer steps)
            self._client.update_run(self.run_id, status="RUNNING")

    def _experiment_id(self, name: str, run_dir: pathlib.Path, uri: str) -> str:
        found = self._client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        # In the run directory's own store, artifacts stay beside it rather than in ./mlruns of the working directory.
        location = (run_dir / "mlartifacts").as_uri() if not os.environ.get("MLFLOW_TRACKING_URI") else None
        return self._client.create_experiment(name, artifact_location=location)

    def _continued(self, experiment: str, run_id: str | None) -> str | None:
        """The MLflow run tagged with this jaxnn run's id (a resumed run directory), else None."""
        if not run_id:
            return None
        runs = self._client.search_runs([experiment], filter_string=f"tags.`{RUN_ID_TAG}` = '{run_id}'", max_results=1)
        return runs[0].info.run_id if runs else None

    def _log_params(self, params: dict[str, str]) -> None:
        items = [self._entities.Param(k, v) for k, v in params.items()]
        for start in range(0, len(items), _PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, params=items[start : start + _PARAMS_PER_BATCH])

    def write(self, row: dict) -> None:
        """The row's metrics at its step, in one batch (NaN and Inf as MLflow stores them)."""
        now, step = int(time.time() * 1000), int(row["step"])
        metrics = [self._entities.Metric(k, v, now, step) for k, v in scalars(row).items()]
        if metrics:
            self._client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        """End the MLflow run: FAILED when an exception ends the run, else FINISHED."""
        self._client.set_terminated(self.run_id, status="FAILED" if _failing() else "FINISHED")


def make_service_writer(name: str, run_dir: PathLike, *, run_id: str | None, run_name: str, config: dict) -> Any:
    """The writer `name` ("wandb" or "mlflow") for `run_dir`; a ValueError naming the extra when its library is
    missing."""
    kind = {"wandb": WandbWriter, "mlflow": MlflowWriter}[name]
    return kind(run_dir, run_id=run_id, name=run_name, config=config)
