"""Run configurations, validated when they are built, with every default in one place.

`FitConfig` holds how `jaxnn.fit` runs (steps, cadence, run directory, devices); `TrainConfig` is what
`jaxnn train` runs: a built-in model on a built-in or local data set. Both are frozen dataclasses whose
construction refuses an impossible value with a `ConfigError` naming the field, before anything is written.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from typing import Any

MODELS = ("mlp", "cnn", "resnet", "gpt")
SIZES = ("small", "base")
FORMS = ("jit", "shard_map")
METRIC_WRITERS = ("jsonl", "csv", "tensorboard")
CHECK_DATA = ("arrays", "all", "off")
# numpy's and jax's seeding take 32-bit unsigned seeds; a larger or negative one fails deep inside them.
SEED_LIMIT = 2**32


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the field."""


def _check_mesh(cfg: TrainConfig) -> None:
    from jaxnn.sharding import BATCH_AXES, parse_mesh

    try:
        sizes = parse_mesh(cfg.mesh or "")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    split = math.prod(sizes.get(axis, 1) for axis in BATCH_AXES)
    if cfg.batch_size % split:
        raise ConfigError(f"batch size {cfg.batch_size} is not divisible by the {split} devices of the batch axes")


def check_seed(owner: str, value: Any) -> None:
    """Refuses a seed that is not an integer in [0, 2**32), naming the owner and the value."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or not 0 <= int(value) < SEED_LIMIT:
        raise ConfigError(f"{owner}: seed must be an integer in [0, 2**32), got {value!r}")


def _check_compile_cache(owner: str, value) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{owner}: compile_cache must be 'auto', 'off' or a directory, got {value!r}")


def _positive_int(owner: str, name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{owner}: {name} must be a positive integer, got {value!r}")


def _non_negative(owner: str, name: str, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
        raise ConfigError(f"{owner}: {name} must be >= 0, got {value!r}")


@dataclasses.dataclass(frozen=True)
class FitConfig:
    """How `jaxnn.fit` runs. Fields marked (run) may change when a run is resumed; the others fix its results.

    steps: total optimizer steps of the run (a resumed run continues to this number).
    batch_size: global batch size for arrays and jaxnn data sets (None for an iterable of ready batches).
    precision: a `jaxnn.precision` preset name ("fp32", "tf32", "bf16", "fp16").
    seed: initialisation, shuffling and per-step randomness.
    eval_every: (run) evaluate every N steps; 0 means five times per run.
    log_every: (run) write a metrics row every N steps.
    ckpt_every: (run) checkpoint every N steps; 0 means at the end and on a signal only.
    keep: (run) checkpoints kept.
    run_dir: (run) where config.json, metrics, plots, checkpoints and summary.json go; None writes nothing.
    ckpt_dir: (run) checkpoints elsewhere than `<run_dir>/ckpt`.
    resume / overwrite: (run) continue the run in `run_dir`, or replace it; by default a used run dir is refused.
    metrics: (run) writers besides JSON lines: "csv", "tensorboard".
    progress / plots: (run) a progress bar; loss and accuracy PNGs at the end.
    devices: (run) data-parallel devices of this process (ignored when a mesh is given or with many processes).
    form: (run) data-parallel form, "jit" or "shard_map" (see jaxnn.parallel).
    prefetch: (run) batches placed on the devices ahead of the step.
    guard_nonfinite: (run) stop at the first NaN/Inf loss (fp16: report long runs of skipped steps instead).
    async_checkpoints: (run) write checkpoints in the background while training goes on (orbax's async save).
    name: (run) label for the progress bar and summary.
    profile_dir: (run) write a `jax.profiler` trace of a few steps after warm-up here (see jaxnn.trace).
    compile_cache: (run) JAX's persistent compilation cache: "auto" ($JAXNN_COMPILE_CACHE, else
      ~/.cache/jaxnn/xla), "off", or a directory (see jaxnn.compile_cache).
    check_data: (run) refuse NaN/Inf in float inputs before anything runs: "arrays" checks in-memory arrays (an
      image data set's too) and evaluation batches at setup (one pass on the host), "all" also every training batch of a stream or data set
      as it is drawn, "off" checks nothing.
    """

    steps: int = 1000
    batch_size: int | None = 64
    precision: str = "fp32"
    seed: int = 0
    eval_every: int = 0
    log_every: int = 50
    ckpt_every: int = 0
    keep: int = 3
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
        from jaxnn.precision import PRESETS

        owner = "fit"
        for name in ("steps", "log_every", "keep", "devices"):
            _positive_int(owner, name, getattr(self, name))
        if self.batch_size is not None:
            _positive_int(owner, "batch_size", self.batch_size)
        for name in ("eval_every", "ckpt_every", "prefetch"):
            _non_negative(owner, name, getattr(self, name))
        check_seed(owner, self.seed)
        if not isinstance(self.precision, str) or self.precision not in PRESETS:
            raise ConfigError(f"{owner}: unknown precision {self.precision!r}; choose one of {sorted(PRESETS)}")
        if not isinstance(self.check_data, str) or self.check_data not in CHECK_DATA:
            raise ConfigError(f"{owner}: check_data must be one of {list(CHECK_DATA)}, got {self.check_data!r}")
        if not isinstance(self.form, str) or self.form not in FORMS:
            raise ConfigError(f"{owner}: form must be one of {list(FORMS)}, got {self.form!r}")
        if isinstance(self.metrics, str):
            object.__setattr__(self, "metrics", (self.metrics,))
        unknown = [m for m in self.metrics if m not in METRIC_WRITERS]
        if unknown:
            raise ConfigError(f"{owner}: unknown metric writer(s) {unknown}; choose from {list(METRIC_WRITERS)}")
        if self.resume and self.overwrite:
            raise ConfigError(f"{owner}: resume and overwrite exclude each other")
        if self.run_dir is None and (self.resume or self.ckpt_dir):
            raise ConfigError(f"{owner}: resume and ckpt_dir need a run_dir")
        _check_compile_cache(owner, self.compile_cache)

    @classmethod
    def from_settings(cls, settings: dict[str, Any]) -> FitConfig:
        """A FitConfig from keyword arguments; a misspelt name is refused with the list of known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ConfigError(f"fit: unknown setting(s) {unknown}; known: {sorted(known)}")
        return cls(**settings)

    def record(self) -> dict:
        """The fields that fix a run's results, as saved in config.json and compared on resume."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in self.RUN_ONLY}

    def eval_interval(self) -> int:
        """Steps between evaluations: `eval_every`, or a fifth of the run when it is 0."""
        return self.eval_every or max(self.steps // 5, 1)


# Per-model defaults of `jaxnn train`: each finishes in about a minute (cnn, mlp) or a few minutes (gpt) on a 2-core
# CPU. The gpt is cut from GPTConfig (width 256, 4 blocks, 128 bytes) to width 128, 2 blocks and 64 bytes of
# context for that reason: about 16x fewer FLOPs per step.
MODEL_DEFAULTS: dict[str, dict[str, Any]] = {
    "cnn": {"steps": 600, "batch_size": 64, "lr": 3e-3},
    "mlp": {"steps": 1000, "batch_size": 64, "lr": 1e-3},
    "resnet": {"steps": 600, "batch_size": 64, "lr": 3e-3},
    "gpt": {
        "steps": 500,
        "batch_size": 32,
        "lr": 3e-3,
        "warmup": 30,
        "seq_len": 64,
        "model_overrides": (("d_model", 128), ("num_layers", 2)),
    },
}

# TrainConfig fields that do not change what a run computes: a checkpoint may be resumed with them changed.
RUN_ONLY_FIELDS = (
    "mesh",
    "run_dir",
    "ckpt_dir",
    "resume",
    "overwrite",
    "devices",
    "eval_every",
    "log_every",
    "ckpt_every",
    "keep",
    "prefetch",
    "backend",
    "workers",
    "progress",
    "plots",
    "sample_bytes",
    "metrics",
    "profile_dir",
    "compile_cache",
)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One `jaxnn train` run. `dataset` "auto": text for gpt, else the format found in `data_dir`, else digits.

    `model_overrides` replaces fields of the model's config, as ((field, value), ...), e.g. (("d_model", 128),).
    """

    model: str = "cnn"
    dataset: str = "auto"
    data_dir: str | None = None
    size: str = "base"
    model_overrides: tuple = ()
    steps: int = 600
    batch_size: int = 64
    precision: str = "fp32"
    lr: float = 3e-3
    warmup: int = 0
    weight_decay: float = 0.0
    seed: int = 0
    crop_pad: int = 0
    flip: bool = False
    seq_len: int = 128
    run_dir: str = "runs/default"
    ckpt_dir: str | None = None
    resume: bool = False
    overwrite: bool = False
    devices: int = 1
    mesh: str | None = None  # e.g. "data=2,fsdp=4" (jaxnn.sharding); replaces `devices`
    eval_every: int = 0  # 0: five evaluations over the run
    log_every: int = 50
    ckpt_every: int = 0  # 0: only at the end (and on a signal)
    keep: int = 3
    prefetch: int = 2
    backend: str = "grain"
    workers: int = 0
    progress: bool = True
    plots: bool = True
    sample_bytes: int = 300
    metrics: tuple[str, ...] = ()
    profile_dir: str | None = None  # a jax.profiler trace of a few steps (jaxnn.trace)
    compile_cache: str = "auto"  # "auto", "off" or a directory (jaxnn.compile_cache)

    def __post_init__(self):
        validate(self)

    def small(self) -> TrainConfig:
        """The same run at the smallest size (model, steps, batch, context), for tests and smoke runs."""
        return dataclasses.replace(
            self,
            size="small",
            steps=30,
            batch_size=16,
            seq_len=32,
            log_every=10,
            plots=False,
            progress=False,
            sample_bytes=32,
        )

    def as_dict(self) -> dict:
        """A JSON-ready dict of every field (tuples as lists): what `config.json` and the checkpoints hold."""
        d = dataclasses.asdict(self)
        d["model_overrides"] = [list(kv) for kv in self.model_overrides]
        d["metrics"] = list(self.metrics)
        return d

    def trajectory(self) -> dict:
        """The fields that determine the computed parameters (what a resumed run must share)."""
        # Through JSON, so that it compares equal to a saved copy (tuples come back as lists).
        return json.loads(json.dumps({k: v for k, v in self.as_dict().items() if k not in RUN_ONLY_FIELDS}))


def validate(cfg: TrainConfig) -> None:
    """Refuses impossible values up front, one field per message."""
    from jaxnn.precision import PRESETS

    if cfg.model not in MODELS:
        raise ConfigError(f"unknown model {cfg.model!r}; choose one of {list(MODELS)}")
    if cfg.size not in SIZES:
        raise ConfigError(f"unknown size {cfg.size!r}; choose one of {list(SIZES)}")
    check_seed("seed", cfg.seed)
    if not isinstance(cfg.precision, str) or cfg.precision not in PRESETS:
        raise ConfigError(f"unknown precision {cfg.precision!r}; choose one of {sorted(PRESETS)}")
    for name in ("steps", "batch_size", "devices", "log_every", "seq_len", "keep"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if not (isinstance(cfg.lr, (int, float)) and math.isfinite(cfg.lr) and cfg.lr > 0):
        raise ConfigError(f"lr must be a positive number, got {cfg.lr!r}")
    for name in (
        "warmup",
        "eval_every",
        "ckpt_every",
        "prefetch",
        "workers",
        "crop_pad",
        "weight_decay",
        "sample_bytes",
    ):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{name} must be >= 0, got {getattr(cfg, name)!r}")
    if cfg.batch_size % cfg.devices:
        raise ConfigError(f"batch size {cfg.batch_size} is not divisible by the {cfg.devices} devices")
    if cfg.mesh is not None:
        _check_mesh(cfg)
    if cfg.resume and cfg.overwrite:
        raise ConfigError("--resume and --overwrite exclude each other")
    unknown = [m for m in cfg.metrics if m not in METRIC_WRITERS]
    if unknown:
        raise ConfigError(f"unknown metric writer(s) {unknown}; choose from {list(METRIC_WRITERS)}")
    _check_compile_cache("--compile-cache", cfg.compile_cache)
