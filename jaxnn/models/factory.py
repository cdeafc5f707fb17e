"""The one place that turns a built-in model's name and config fields into a model: the CLI, the recipes, the
profiler, export and the experiments all build models here, so a field is checked the same way everywhere.

    model, cfg = build_model("gpt", {"d_model": 128, "position": "rope"}, size="small")
    model, cfg = model_from_record(loaded.config)     # a saved run's config.json or checkpoint config
    model, cfg = build_model("gpt2", {"num_layers": 2})  # a preset (`jaxnn.models.presets`) as the base
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxnn._src.model_names import MODELS, SIZES
from jaxnn.errors import ConfigError
from jaxnn.layers import Layer
from jaxnn.models import CONFIGS, get_model
from jaxnn.models.presets import PRESETS

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


def family(name: str) -> str:
    """The built-in model family that builds `name`: the family of a preset ("gpt2" -> "gpt"), else `name`."""
    return PRESETS[name].family if name in PRESETS else name


def model_config(name: str, fields: Mapping[str, Any] | None = None, *, size: str = "base") -> Any:
    """The config dataclass of built-in model or preset `name`: its default (or `small()`) config with `fields`
    replaced.

    A field the model does not have, or a value of the wrong kind (text for a width), is one ConfigError naming
    it; JSON lists become tuples where the field is a tuple, since JSON has no tuples.
    """
    if name not in CONFIGS and name not in PRESETS:
        raise ConfigError(f"unknown model {name!r}; choose a family {sorted(CONFIGS)} or a preset {sorted(PRESETS)}")
    if size not in SIZES:
        raise ConfigError(f"unknown size {size!r}; choose one of {list(SIZES)}")
    default = PRESETS[name].config if name in PRESETS else CONFIGS[name]()
    fields = dict(fields or {})
    known = {f.name: getattr(default, f.name) for f in dataclasses.fields(default)}
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise ConfigError(f"model {name!r} has no config field(s) {unknown}; it has {sorted(known)}")
    values = {key: _checked_value(name, key, value, known[key]) for key, value in fields.items()}
    base = default.small() if size == "small" else default
    return dataclasses.replace(base, **values)


def _checked_value(model: str, field: str, value: Any, default: Any) -> Any:
    """`value` for `field`, refused when its kind cannot be the kind of the field's default."""
    if isinstance(default, tuple) and isinstance(value, list):
        value = tuple(value)
    if default is None:  # an optional field: any value the model's own checks accept
        return value
    if isinstance(default, bool):
        # `remat` also takes a policy's name, which the config itself checks
        ok = isinstance(value, bool) or (field == "remat" and isinstance(value, str))
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise ConfigError(
            f"model {model!r}: field {field!r} takes a {type(default).__name__} (default {default!r}), got {value!r}"
        )
    return value


def build_model(name: str, fields: Mapping[str, Any] | None = None, *, size: str = "base") -> tuple[Layer, Any]:
    """The built-in model or preset `name` with `model_config(name, fields, size=size)`, and that config."""
    cfg = model_config(name, fields, size=size)
    return get_model(family(name), cfg), cfg


def train_default_model(name: str, fields: Mapping[str, Any] | None = None, *, size: str = "base") -> tuple[Layer, Any]:
    """The built-in model as `jaxnn train` builds it when no flag says otherwise (its per-model cut-down widths
    and context length, `MODEL_DEFAULTS`), with `fields` on top; and its config."""
    overrides = default_model_overrides(name, size)
    if "seq_len" in MODEL_DEFAULTS.get(name, {}):
        overrides["seq_len"] = MODEL_DEFAULTS[name]["seq_len"]
    return build_model(name, {**overrides, **(fields or {})}, size=size)


def model_from_record(record: Mapping[str, Any]) -> tuple[Layer, Any]:
    """The built-in model and its config from a saved run config (`LoadedParams.config`, config.json).

    `record` needs "model" (a built-in model name) and "model_config" (the config dataclass's fields as JSON).
    """
    name, saved = record.get("model"), record.get("model_config")
    if not isinstance(name, str) or not isinstance(saved, dict):
        raise ConfigError(
            "the run config needs 'model' (a built-in model name) and 'model_config' (a dict); "
            f"got keys {sorted(record)}"
        )
    if family(name) == "gpt" and "logits_bias" not in saved:  # saved before the field: the bias followed `bias`
        saved = {**saved, "logits_bias": saved.get("bias", True)}
    return build_model(name, saved)


__all__ = [
    "MODELS",
    "MODEL_DEFAULTS",
    "SIZES",
    "build_model",
    "default_model_overrides",
    "family",
    "model_config",
    "model_from_record",
    "train_default_model",
]
