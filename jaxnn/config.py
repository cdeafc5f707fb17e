"""How `jaxnn.fit` runs: `FitConfig`, validated when it is built, with every default of `fit` in one place.

`FitConfig` holds how `jaxnn.fit` runs (steps, cadence, run directory, devices): a frozen dataclass whose
construction refuses an impossible value with a `ConfigError` naming the field, before anything is written. Its
vocabularies (precision presets, remat policies, data-parallel forms) are their owners'; it checks against them.

`TrainConfig`, what `jaxnn train` runs, lives in `jaxnn.cli.config`, and the built-in models' names and defaults in
`jaxnn.models.factory`; both are still importable from here.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from jaxnn._src.checks import (  # noqa: F401 (config_differences, first_differences, check_seed: importable here too)
    SEED_LIMIT,
    check_compile_cache,
    check_seed,
    config_differences,
    first_differences,
    non_negative,
    positive_int,
)
from jaxnn._src.lazy import lazy_exports
from jaxnn.errors import ConfigError  # noqa: F401 (also importable from here)
from jaxnn.metrics import check_writer_names

CHECK_DATA = ("arrays", "all", "off")

# Names that moved to the modules that own them, still importable from here. They resolve on first access, by name:
# `jaxnn.cli.config` imports this module, and the other owners load jax, which importing this module does not.
_MOVED = {
    "TrainConfig": "jaxnn.cli.config",
    "parse_model_config": "jaxnn.cli.config",
    "RUN_ONLY_FIELDS": "jaxnn.cli.config",
    "LATER_DEFAULTS": "jaxnn.cli.config",
    "MODELS": "jaxnn.models.factory",
    "SIZES": "jaxnn.models.factory",
    "MODEL_DEFAULTS": "jaxnn.models.factory",
    "default_model_overrides": "jaxnn.models.factory",
    "SCHEDULES": "jaxnn.train.optim",
    "FIT_FORMS": "jaxnn.train.data_parallel",
    "BACKENDS": "jaxnn.data.pipeline",
}
__getattr__, __dir__ = lazy_exports("jaxnn.config", _MOVED, ())


@dataclasses.dataclass(frozen=True)
class FitConfig:
    """How `jaxnn.fit` runs. Fields marked (run) may change when a run is resumed; the others fix its results.

    steps: (run) total optimizer steps of the run (a resumed run continues to this number, so a finished run
      resumed with a larger one trains on). It fixes the results only through a schedule that decays to it:
      `fit`'s default optimizer does, so with it `steps` joins the record (see docs/training.md).
    epochs: (run) instead of `steps`: passes over the training data, converted by `fit` to steps from the
      data's batches per pass.
    batch_size: global batch size for arrays and jaxnn data sets (None for an iterable of ready batches).
    accumulate: micro-batches per optimizer step; their gradients are averaged (`batch_size` must divide by it).
    precision: a `jaxnn.precision` preset name ("fp32", "tf32", "bf16", "fp16", "fp8", "fp8-delayed").
    remat: recompute activations in the backward pass, layer by layer, under this `jaxnn.layers.REMAT_POLICIES`
      name ("nothing", "dots", "dots_no_batch", "everything", "offload"; see `jaxnn.layers.rematerialised`).
    clip_norm: the default optimizer's clip of the gradients' global norm (`optax.clip_by_global_norm`), 1.0 by
      default; 0 or None clips nothing. An optimizer given to `fit` clips as it says (chain the clip into it).
    ema: keep an exponential moving average of the weights with this decay (e.g. 0.999), from the starting
      params on (`ema_t = ema * ema_(t-1) + (1 - ema) * params_t`, no bias correction): evaluations use it, and the
      final state's params are it (what `jaxnn.save_model` then saves); the checkpoints keep the trained weights
      and the average (in the optimizer state), so a resume continues both bitwise.
    seed: initialisation, shuffling and per-step randomness.
    eval_every: (run) evaluate every N steps; 0 means five times per run.
    log_every: (run) write a metrics row every N steps.
    ckpt_every: (run) checkpoint every N steps; 0 means at the end and on a signal only.
    keep: (run) checkpoints kept.
    keep_best / keep_best_mode: (run) keep the `keep` checkpoints best by this evaluation metric ("min" or
      "max" is better) instead of the newest; checkpoints are then written at every evaluation.
    run_dir: (run) where config.json, metrics, plots, checkpoints and summary.json go; None writes nothing.
    ckpt_dir: (run) checkpoints elsewhere than `<run_dir>/ckpt`.
    resume / overwrite: (run) continue the run in `run_dir`, or replace it; by default a used run dir is refused.
    metrics: (run) writers besides JSON lines: "csv", "tensorboard", "wandb", "mlflow" (jaxnn.metric_services).
    progress / plots: (run) a progress bar; loss and accuracy PNGs at the end.
    devices: (run) data-parallel devices of this process (ignored when a mesh is given or with many processes).
    form: (run) data-parallel form, "jit" or "shard_map" (see jaxnn.train.data_parallel).
    prefetch: (run) batches placed on the devices ahead of the step.
    guard_nonfinite: (run) stop at the first NaN/Inf loss (fp16: report long runs of skipped steps instead).
    async_checkpoints: (run) write checkpoints in the background while training goes on (orbax's async save).
    name: (run) label for the progress bar and summary.
    profile_dir: (run) write a `jax.profiler` trace of a few steps after warm-up here (see jaxnn.profile.trace).
    compile_cache: (run) JAX's persistent compilation cache: "auto" ($JAXNN_COMPILE_CACHE, else
      ~/.cache/jaxnn/xla), "off", or a directory (see jaxnn._src.compile_cache).
    check_data: (run) refuse NaN/Inf in float inputs before anything runs: "arrays" checks in-memory arrays (an
      image data set's too) and evaluation batches at setup (one pass on the host), "all" also every training
      batch of a stream or data set as it is drawn, "off" checks nothing.
    """

    steps: int = 1000
    epochs: int | None = None
    batch_size: int | None = 64
    accumulate: int = 1
    precision: str = "fp32"
    remat: str | None = None
    clip_norm: float | None = 1.0
    ema: float | None = None
    seed: int = 0
    eval_every: int = 0
    log_every: int = 50
    ckpt_every: int = 0
    keep: int = 3
    keep_best: str | None = None
    keep_best_mode: str = "auto"
    run_dir: str | None = None
    ckpt_dir: str | None = None
    resume: bool = False
    overwrite: bool = False
    metrics: tuple[str, ...] = ()
    progress: bool = True
    plots: bool = True
    devices: int = 1
    form: str = "jit"
    prefetch: int = 2
    guard_nonfinite: bool = True
    async_checkpoints: bool = True
    name: str = "fit"
    profile_dir: str | None = None
    compile_cache: str = "auto"
    check_data: str = "arrays"

    RUN_ONLY = (
        "steps",
        "epochs",
        "keep_best",
        "keep_best_mode",
        "eval_every",
        "log_every",
        "ckpt_every",
        "keep",
        "run_dir",
        "ckpt_dir",
        "resume",
        "overwrite",
        "metrics",
        "progress",
        "plots",
        "devices",
        "form",
        "prefetch",
        "guard_nonfinite",
        "async_checkpoints",
        "name",
        "profile_dir",
        "compile_cache",
        "check_data",
    )

    def __post_init__(self):
        from jaxnn.layers.stack import REMAT_POLICIES
        from jaxnn.precision import PRESETS
        from jaxnn.train.data_parallel import FIT_FORMS

        owner = "fit"
        for name in ("steps", "log_every", "keep", "devices", "accumulate"):
            positive_int(owner, name, getattr(self, name))
        if self.epochs is not None:
            positive_int(owner, "epochs", self.epochs)
        if self.batch_size is not None:
            positive_int(owner, "batch_size", self.batch_size)
            if self.batch_size % self.accumulate:
                raise ConfigError(f"{owner}: accumulate {self.accumulate} does not divide batch_size {self.batch_size}")
        if self.keep_best_mode not in ("auto", "min", "max"):
            raise ConfigError(f"{owner}: keep_best_mode must be 'auto', 'min' or 'max', got {self.keep_best_mode!r}")
        if self.keep_best is not None and not (isinstance(self.keep_best, str) and self.keep_best):
            raise ConfigError(f"{owner}: keep_best must name an evaluation metric, got {self.keep_best!r}")
        for name in ("eval_every", "ckpt_every", "prefetch"):
            non_negative(owner, name, getattr(self, name))
        check_seed(owner, self.seed)
        if self.ema is not None and (
            isinstance(self.ema, bool) or not isinstance(self.ema, (int, float)) or not 0 < self.ema < 1
        ):
            raise ConfigError(f"{owner}: ema must be a decay in (0, 1), e.g. 0.999, got {self.ema!r}")
        if self.clip_norm is not None and not (
            isinstance(self.clip_norm, (int, float)) and not isinstance(self.clip_norm, bool) and self.clip_norm >= 0
        ):
            raise ConfigError(
                f"{owner}: clip_norm must be a number >= 0 (0 or None: no clipping), got {self.clip_norm!r}"
            )
        if not isinstance(self.precision, str) or self.precision not in PRESETS:
            raise ConfigError(f"{owner}: unknown precision {self.precision!r}; choose one of {sorted(PRESETS)}")
        if self.remat is not None and (not isinstance(self.remat, str) or self.remat not in REMAT_POLICIES):
            raise ConfigError(f"{owner}: unknown remat policy {self.remat!r}; choose one of {list(REMAT_POLICIES)}")
        if not isinstance(self.check_data, str) or self.check_data not in CHECK_DATA:
            raise ConfigError(f"{owner}: check_data must be one of {list(CHECK_DATA)}, got {self.check_data!r}")
        if not isinstance(self.form, str) or self.form not in FIT_FORMS:
            raise ConfigError(f"{owner}: form must be one of {list(FIT_FORMS)}, got {self.form!r}")
        if isinstance(self.metrics, str):
            object.__setattr__(self, "metrics", (self.metrics,))
        try:
            object.__setattr__(self, "metrics", check_writer_names(self.metrics))
        except ValueError as err:
            raise ConfigError(f"{owner}: {err}") from None
        if self.resume and self.overwrite:
            raise ConfigError(f"{owner}: resume and overwrite exclude each other")
        if self.run_dir is None and (self.resume or self.ckpt_dir or self.keep_best):
            raise ConfigError(f"{owner}: resume, ckpt_dir and keep_best need a run_dir")
        check_compile_cache(owner, self.compile_cache)

    @classmethod
    def from_settings(cls, settings: dict[str, Any]) -> FitConfig:
        """A FitConfig from keyword arguments; a misspelt name is refused with the list of known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ConfigError(f"fit: unknown setting(s) {unknown}; known: {sorted(known)}")
        return cls(**settings)

    def resolved(
        self, *, steps: int | None = None, batch_size: int | None = None, name: str | None = None
    ) -> FitConfig:
        """This config with what only the data can say filled in: the step count of `epochs`, an iterable's own
        batch size, a label naming the data. The other fields were checked when the config was built and are not
        checked again; these three are checked here."""
        fields: dict[str, Any] = {}
        if steps is not None:
            positive_int("fit", "steps", steps)
            fields["steps"] = steps
        if batch_size is not None:
            positive_int("fit", "batch_size", batch_size)
            if batch_size % self.accumulate:
                raise ConfigError(f"fit: accumulate {self.accumulate} does not divide batch_size {batch_size}")
            fields["batch_size"] = batch_size
        if name is not None:
            fields["name"] = str(name)
        new = copy.copy(self)
        for field, value in fields.items():
            object.__setattr__(new, field, value)
        return new

    def record(self) -> dict:
        """The fields that fix a run's results, as saved in config.json and compared on resume. A field added
        after runs were saved (`remat`, `clip_norm`, `ema`) joins only when not at its old value, so that those
        runs still resume."""
        fields = dataclasses.asdict(self).items()
        later = {"remat": None, "clip_norm": 1.0, "ema": None}  # their values in the runs saved before them
        return {k: v for k, v in fields if k not in self.RUN_ONLY and not (k in later and v == later[k])}

    def eval_interval(self) -> int:
        """Steps between evaluations: `eval_every`, or a fifth of the run when it is 0."""
        return self.eval_every or max(self.steps // 5, 1)
