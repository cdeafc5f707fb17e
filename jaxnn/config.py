"""Run configurations, validated when they are built, with every default in one place.

`FitConfig` holds how `jaxnn.fit` runs (steps, cadence, run directory, devices); `TrainConfig` is what
`jaxnn train` runs: a built-in model on a built-in or local data set, with the `FitConfig` it hands to `fit`. Both
are frozen dataclasses whose construction refuses an impossible value with a `ConfigError` naming the field,
before anything is written; each field is checked once, by the dataclass that holds it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
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
from jaxnn.errors import ConfigError  # noqa: F401 (also importable from here)
from jaxnn.metrics import check_writer_names

MODELS = ("mlp", "cnn", "resnet", "gpt", "imagenet_resnet", "vit")
SIZES = ("small", "base")
# The data-parallel forms of `jaxnn.parallel` that `fit` runs: their state has the model's own shapes, where pmap's
# carries a device axis in front (kept in jaxnn.parallel for comparison, not for checkpointed runs).
FIT_FORMS = ("jit", "shard_map")
CHECK_DATA = ("arrays", "all", "off")


def _check_mesh(mesh: str, batch_size: int) -> None:
    from jaxnn.parallel.mesh import BATCH_AXES, parse_mesh

    try:
        sizes = parse_mesh(mesh)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    split = math.prod(sizes.get(axis, 1) for axis in BATCH_AXES)
    if batch_size % split:
        raise ConfigError(f"batch size {batch_size} is not divisible by the {split} devices of the batch axes")


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
    precision: a `jaxnn.precision` preset name ("fp32", "tf32", "bf16", "fp16", "fp8").
    remat: recompute activations in the backward pass, layer by layer, under this `jaxnn.layers.REMAT_POLICIES`
      name ("nothing", "dots", "dots_no_batch", "everything", "offload"; see `jaxnn.layers.rematerialised`).
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
    metrics: (run) writers besides JSON lines: "csv", "tensorboard".
    progress / plots: (run) a progress bar; loss and accuracy PNGs at the end.
    devices: (run) data-parallel devices of this process (ignored when a mesh is given or with many processes).
    form: (run) data-parallel form, "jit" or "shard_map" (see jaxnn.parallel).
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
        after runs were saved (`remat`) joins only when set, so that those runs still resume."""
        fields = dataclasses.asdict(self).items()
        return {k: v for k, v in fields if k not in self.RUN_ONLY and not (k == "remat" and v is None)}

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
    # The zoo's image families (presets resnet18..50, vit-b16/l16) train at their published shapes: fewer steps.
    "imagenet_resnet": {"steps": 200, "batch_size": 32, "lr": 1e-3},
    "vit": {"steps": 200, "batch_size": 32, "lr": 1e-3, "warmup": 20},
    "gpt": {
        "steps": 500,
        "batch_size": 32,
        "lr": 3e-3,
        "warmup": 30,
        "seq_len": 64,
        "model_overrides": (("d_model", 128), ("num_layers", 2)),
    },
}


def default_model_overrides(model: str, size: str) -> dict[str, Any]:
    """The model-config fields `jaxnn train` (and `jaxnn profile`) set for `model` at `size`: the base size's
    cut-down widths; the small size keeps the small config's own."""
    return dict(MODEL_DEFAULTS.get(model, {}).get("model_overrides", ())) if size == "base" else {}


def parse_model_config(items: list[str], flag: str = "--model-config") -> dict[str, Any]:
    """`["position=rope", "num_kv_heads=2"]` -> {"position": "rope", "num_kv_heads": 2}: JSON values, else text.

    A field named twice is refused rather than silently taking the last value."""
    fields: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name:
            raise ConfigError(f"{flag}: expected FIELD=VALUE, got {item!r}")
        if name in fields:
            raise ConfigError(f"{flag}: field {name!r} is given twice")
        try:
            fields[name] = json.loads(text)
        except json.JSONDecodeError:
            fields[name] = text
    return fields


# TrainConfig's own fields that do not change what a run computes: a checkpoint may be resumed with them changed
# (the FitConfig's are its RUN_ONLY).
RUN_ONLY_FIELDS = ("mesh", "sharding_rules", "backend", "workers", "sample_bytes", "init_from")
SCHEDULES = ("cosine", "constant")
LATER_DEFAULTS = {"schedule": "cosine", "label_smoothing": 0.0, "augment": "", "pack": False}
BACKENDS = ("grain", "inline")


def _quick_fit() -> FitConfig:
    return FitConfig(steps=600, batch_size=64, run_dir="runs/default")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One `jaxnn train` run: what to train, on what data, with which optimizer, and how `fit` runs it (`fit`).

    `dataset` "auto": text for gpt, else the format found in `data_dir`, else digits. `model_overrides` replaces
    fields of the model's config, as ((field, value), ...), e.g. (("d_model", 128),). `mesh` ("data=2,fsdp=4",
    see jaxnn.parallel.mesh) replaces `fit.devices`; `sharding_rules` is a JSON rule table's path
    (jaxnn.parallel.rules).
    `schedule`: the learning rate's cosine decay to 0 at the run's last step, or "constant" after the warm-up,
    which lets a finished run be trained on with a larger `steps`.
    `init_from`: start from another run's parameters and optimizer state (`jaxnn.fit`'s `init_from`), or from
    the weights of a transformers GPT-2/Llama folder (its tokenizer.json, where it has one, tokenises the text).
    `augment`: random augmentation in the train step on the device, as `jaxnn.augment.parse_augment` reads it
    ("crop,flip,mixup"); `crop_pad` and `flip` are the host pipeline's.
    `lora`: train LoRA adapters alone, as `jaxnn.lora.parse_lora` reads them ("r=8,alpha=16,targets=*qkv.w").
    `pack`: gpt on JSON Lines records: pack the records into windows with segment ids (`jaxnn.data.packing`)
    instead of cutting the joined stream into windows.
    """

    model: str = "cnn"
    dataset: str = "auto"
    data_dir: str | None = None
    size: str = "base"
    model_overrides: tuple = ()
    lr: float = 3e-3
    warmup: int = 0
    weight_decay: float = 0.0
    crop_pad: int = 0
    flip: bool = False
    seq_len: int = 128
    mesh: str | None = None
    sharding_rules: str | None = None
    backend: str = "grain"
    workers: int = 0
    sample_bytes: int = 300
    schedule: str = "cosine"
    label_smoothing: float = 0.0
    init_from: str | None = None
    augment: str = ""
    lora: str = ""
    pack: bool = False
    fit: FitConfig = dataclasses.field(default_factory=_quick_fit)

    def __post_init__(self):
        _validate(self)

    def small(self) -> TrainConfig:
        """The same run at the smallest size (model, steps, batch, context), for tests and smoke runs."""
        fit = dataclasses.replace(self.fit, steps=30, batch_size=16, log_every=10, plots=False, progress=False)
        return dataclasses.replace(self, size="small", seq_len=32, sample_bytes=32, fit=fit)

    def as_dict(self) -> dict:
        """A JSON-ready dict of every field (tuples as lists, the FitConfig as a dict)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def trajectory(self) -> dict:
        """This config's own fields that determine the computed parameters (what a resumed run must share);
        `fit` adds the FitConfig's (`FitConfig.record`). Fields added after runs were made are left out at their
        defaults, so that those runs' records still match and they can be resumed. The values are the fields' own
        (tuples stay tuples): the loop serialises the run's whole record once, this part with it."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "fit"}
        return {
            k: v
            for k, v in own.items()
            # `lora` is recorded by fit itself, as the parsed settings
            if k not in (*RUN_ONLY_FIELDS, "lora") and not (k in LATER_DEFAULTS and v == LATER_DEFAULTS[k])
        }


def _validate(cfg: TrainConfig) -> None:
    """Refuses impossible values of TrainConfig's own fields, one field per message (FitConfig checks its own)."""
    if cfg.model not in MODELS:
        raise ConfigError(f"unknown model {cfg.model!r}; choose one of {list(MODELS)}")
    if cfg.size not in SIZES:
        raise ConfigError(f"unknown size {cfg.size!r}; choose one of {list(SIZES)}")
    if not isinstance(cfg.fit, FitConfig):
        raise ConfigError(f"TrainConfig.fit must be a FitConfig, got {type(cfg.fit).__name__}")
    if cfg.fit.batch_size is None:
        raise ConfigError("batch_size must be a positive integer, got None")
    positive_int("train", "seq_len", cfg.seq_len)
    if not (isinstance(cfg.lr, (int, float)) and math.isfinite(cfg.lr) and cfg.lr > 0):
        raise ConfigError(f"lr must be a positive number, got {cfg.lr!r}")
    for name in ("warmup", "workers", "crop_pad", "weight_decay", "sample_bytes"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{name} must be >= 0, got {getattr(cfg, name)!r}")
    if cfg.schedule not in SCHEDULES:
        raise ConfigError(f"unknown schedule {cfg.schedule!r}; choose one of {list(SCHEDULES)}")
    if not (isinstance(cfg.label_smoothing, (int, float)) and 0 <= cfg.label_smoothing < 1):
        raise ConfigError(f"label_smoothing must be in [0, 1), got {cfg.label_smoothing!r}")
    if cfg.augment:
        from jaxnn.augment import parse_augment

        try:
            parse_augment(cfg.augment)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if cfg.model == "gpt":
            raise ConfigError(f"augment {cfg.augment!r}: augmentation is for the image models, not {cfg.model!r}")
    if cfg.lora:
        from jaxnn.lora import parse_lora

        try:
            parse_lora(cfg.lora)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    if cfg.pack and cfg.model != "gpt":
        raise ConfigError(f"pack: packing is for text (--model gpt), not {cfg.model!r}")
    if cfg.backend not in BACKENDS:
        raise ConfigError(f"unknown backend {cfg.backend!r}; choose one of {list(BACKENDS)}")
    if cfg.fit.batch_size % cfg.fit.devices:
        raise ConfigError(f"batch size {cfg.fit.batch_size} is not divisible by the {cfg.fit.devices} devices")
    if cfg.mesh is not None:
        _check_mesh(cfg.mesh, cfg.fit.batch_size)
