"""`TrainConfig`, what `jaxnn train` runs: a built-in model on a built-in or local data set, with the
`jaxnn.config.FitConfig` it hands to `fit`.

A frozen dataclass whose construction refuses an impossible value with a `ConfigError` naming the field, before
anything is written; each field is checked once, by the dataclass that holds it. It is built before jax starts
(the devices are set up after it), so what it checks against is imported when it is built, not with this module.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import TYPE_CHECKING, Any

from jaxnn._src.checks import positive_int
from jaxnn._src.model_names import MODELS, SIZES
from jaxnn.config import FitConfig
from jaxnn.errors import ConfigError

if TYPE_CHECKING:  # imported when a config is built, not with this module (see above)
    from jaxnn.augment import Augment
    from jaxnn.lora import LoRA
    from jaxnn.parallel.mesh import MeshShape

# TrainConfig's own fields that do not change what a run computes: a checkpoint may be resumed with them changed
# (the FitConfig's are its RUN_ONLY).
RUN_ONLY_FIELDS = ("mesh", "sharding_rules", "backend", "workers", "sample_bytes", "init_from", "adapters")
# Fields added after runs were saved, with the value those runs had: a field at it stays out of the record, so that
# those runs still resume.
LATER_DEFAULTS = {
    "schedule": "cosine",
    "label_smoothing": 0.0,
    "augment": "",
    "pack": False,
    "objective": None,
    "beta": 0.1,
}


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


def _quick_fit() -> FitConfig:
    return FitConfig(steps=600, batch_size=64, run_dir="runs/default")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One `jaxnn train` run: what to train, on what data, with which optimizer, and how `fit` runs it (`fit`).

    `dataset` "auto": text for gpt, else the format found in `data_dir`, else digits. `model_overrides` replaces
    fields of the model's config, as ((field, value), ...), e.g. (("d_model", 128),). `mesh`, a
    `jaxnn.parallel.mesh.MeshShape` (or its text, "data=2,fsdp=4", read once when the config is built), replaces
    `fit.devices`; `sharding_rules` is a JSON rule table's path (jaxnn.parallel.rules).
    `schedule`: the learning rate's cosine decay to 0 at the run's last step, or "constant" after the warm-up,
    which lets a finished run be trained on with a larger `steps`.
    `init_from`: start from another run's parameters and optimizer state (`jaxnn.fit`'s `init_from`), or from
    the weights of a transformers GPT-2/Llama folder (its tokenizer.json, where it has one, tokenises the text).
    `adapters`: with a transformers `init_from`, LoRA adapters trained on it (a PEFT folder, or a file of
    `jaxnn.lora.save_adapters`), put back beside the weights and trained on with their own settings.
    `augment`: random augmentation in the train step on the device, a `jaxnn.augment.Augment` (or its text, as
    `jaxnn.augment.parse_augment` reads it: "crop,flip,mixup"); `crop_pad` and `flip` are the host pipeline's.
    `lora`: train LoRA adapters alone, a `jaxnn.lora.LoRA` (or its text, as `jaxnn.lora.parse_lora` reads it:
    "r=8,alpha=16,targets=*qkv.w").
    Text given for `mesh`, `augment` and `lora` is converted once, when the config is built (a bad one is a
    ConfigError of one line); "" means none, as on the command line. The fields then hold the typed values.
    `pack`: gpt on JSON Lines records: pack the records into windows with segment ids (`jaxnn.data.packing`)
    instead of cutting the joined stream into windows.
    `chat_template`: a Jinja file (or JSON holding `chat_template`) for `{"messages": ...}` records, replacing
    (or standing in for) the template of `init_from`'s tokenizer folder.
    `objective`: "dpo" or "simpo", preference tuning of gpt on `{"prompt", "chosen", "rejected"}` records, with
    `beta` (`jaxnn.fit`'s `objective` and `beta`).
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
    mesh: MeshShape | None = None
    sharding_rules: str | None = None
    backend: str = "grain"
    workers: int = 0
    sample_bytes: int = 300
    schedule: str = "cosine"
    label_smoothing: float = 0.0
    init_from: str | None = None
    adapters: str | None = None
    augment: Augment | None = None
    lora: LoRA | None = None
    pack: bool = False
    chat_template: str | None = None
    objective: str | None = None
    beta: float = 0.1
    fit: FitConfig = dataclasses.field(default_factory=_quick_fit)

    def __post_init__(self):
        # The converters (as Equinox's `field(converter=...)`): text becomes a typed value here, once.
        for name, convert in (("mesh", _as_mesh), ("augment", _as_augment), ("lora", _as_lora)):
            object.__setattr__(self, name, convert(getattr(self, name)))
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
            # `augment` and `lora` are recorded by fit itself, as their settings' `record()`
            if k not in (*RUN_ONLY_FIELDS, "augment", "lora") and not (k in LATER_DEFAULTS and v == LATER_DEFAULTS[k])
        }


def _validate(cfg: TrainConfig) -> None:
    """Refuses impossible values of TrainConfig's own fields, one field per message (FitConfig checks its own)."""
    from jaxnn.data.pipeline import BACKENDS
    from jaxnn.train import SCHEDULES

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
    if cfg.augment is not None and cfg.model == "gpt":
        raise ConfigError(f"augment: augmentation is for the image models, not {cfg.model!r}")
    if cfg.objective is not None and (cfg.model != "gpt" or cfg.pack):
        raise ConfigError(f"objective: preference tuning is for --model gpt, unpacked, not {cfg.model!r}")
    if cfg.pack and cfg.model != "gpt":
        raise ConfigError(f"pack: packing is for text (--model gpt), not {cfg.model!r}")
    if cfg.backend not in BACKENDS:
        raise ConfigError(f"unknown backend {cfg.backend!r}; choose one of {list(BACKENDS)}")
    if cfg.fit.batch_size % cfg.fit.devices:
        raise ConfigError(f"batch size {cfg.fit.batch_size} is not divisible by the {cfg.fit.devices} devices")
    if cfg.mesh is not None:
        _check_mesh(cfg.mesh, cfg.fit.batch_size)


def _as_mesh(value: Any) -> MeshShape | None:
    from jaxnn.parallel.mesh import MeshShape

    try:
        return None if value is None else MeshShape.parse(value)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _as_augment(value: Any) -> Augment | None:
    from jaxnn.augment import as_augment

    return _parsed_spec(value, as_augment)


def _as_lora(value: Any) -> LoRA | None:
    from jaxnn.lora import as_lora

    return _parsed_spec(value, as_lora)


def _parsed_spec(value: Any, parse: Any) -> Any:
    """`parse(value)` for a flag's spec (a string or an object); None or "" (the flag left out) is None, and the
    parser's complaint becomes a ConfigError."""
    if value is None or value == "":
        return None
    try:
        return parse(value)
    except (TypeError, ValueError) as err:
        raise ConfigError(str(err)) from None


def _check_mesh(mesh: MeshShape, batch_size: int) -> None:
    if batch_size % mesh.batch_split:
        raise ConfigError(
            f"batch size {batch_size} is not divisible by the {mesh.batch_split} devices of the batch axes"
        )
