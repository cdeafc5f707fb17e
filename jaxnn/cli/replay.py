"""`jaxnn train --config FILE`: a run's config.json as the flags' values, so that the same command line trains the
same run again (bitwise, on the same machine and data); flags given beside `--config` override the file's values.

Which flags were given is recorded while argparse reads them (`remember_given`), so a flag given at its default
value still overrides the file. config.json's keys are the run's record: the settings map back to flags, the facts
the run derived (parameter counts and shapes, the optimizer's identity, the model's full config) are checked by the
run itself, and any other key is refused in one line, naming it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any

from jaxnn.errors import ConfigError

# config.json key -> the `jaxnn train` flag's argparse dest that sets it (the same name where not listed).
_FLAGS = {"data_dir": "data"}
_SETTINGS = (
    "model", "dataset", "size", "lr", "warmup", "weight_decay", "crop_pad", "flip", "seq_len", "schedule",
    "label_smoothing", "pack", "chat_template", "accumulate", "batch_size", "precision", "seed", "steps", "clip_norm",
    "data_dir", "lora", "augment", "model_overrides",
)  # fmt: skip
# What the run derived and recorded: the replayed run records them again, and its resume checks compare them.
_FACTS = ("model_config", "num_params", "param_shapes", "optimizer", "tokenizer", "initial_params", "init_from")


def remember_given(parser: argparse.ArgumentParser) -> None:
    """Makes each of `parser`'s flags add its dest to the namespace's `given_flags` when it is given."""
    for action in parser._actions:
        if action.dest in ("help", argparse.SUPPRESS):
            continue
        cls = type(action)
        action.__class__ = type(cls.__name__, (cls,), {"__call__": _recording(cls.__call__)})


def _recording(call: Any) -> Any:
    def record(self, parser, namespace, values, option_string=None):
        call(self, parser, namespace, values, option_string)
        namespace.given_flags = {*getattr(namespace, "given_flags", set()), self.dest}

    return record


def replayed(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with the values of `--config`'s file for every flag not given on the command line."""
    path = pathlib.Path(args.config)
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"--config {path}: cannot read it as a run's config.json ({err})") from None
    if not isinstance(record, dict):
        raise ConfigError(f"--config {path}: expected a JSON object (a run's config.json)")
    unknown = sorted(set(record) - set(_SETTINGS) - set(_FACTS))
    if unknown:
        raise ConfigError(
            f"--config {path}: unknown key(s) {unknown}; a run's config.json holds {sorted(_SETTINGS)} and the "
            f"facts {sorted(_FACTS)}"
        )
    given: set[str] = getattr(args, "given_flags", set())
    started = [k for k in ("init_from", "initial_params") if k in record]
    if started and "init_from" not in given:
        raise ConfigError(
            f"--config {path}: the run started from other weights ({started[0]} in its record); pass the same "
            "--init-from to replay it"
        )
    values = vars(args).copy()
    for key in _SETTINGS:
        dest = "model_config" if key == "model_overrides" else _FLAGS.get(key, key)
        if key in record and dest not in given:
            values[dest] = _flag_value(key, record[key])
    if "model_config" not in given:  # the record's overrides are the whole model config, the shortcuts' values too
        values.update({flag: None for flag in ("d_model", "layers", "remat") if flag not in given})
    return argparse.Namespace(**values)


def _flag_value(key: str, value: Any) -> Any:
    """A record's value as its flag's parsed value."""
    if key == "model_overrides":
        return [f"{name}={json.dumps(v)}" for name, v in value]
    if key == "augment":
        from jaxnn.augment import Augment

        return Augment(**value) if isinstance(value, dict) else value
    if value is None and key in ("lora", "augment"):
        return ""
    return value
