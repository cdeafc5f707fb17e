"""What an optax optimizer is, as JSON, so that a resume can tell whether it continues with the optimizer it was
saved with: run directories keep it in config.json (`"optimizer"`), saved models in model.json (`"training"`).

An optax transformation is a pair of closures, so its identity is read from them: every function reachable from
`tx.init` and `tx.update` (`inject_hyperparams` keeps its numbers in init's) through closure cells, and the tuples,
lists and dicts in them, gives its name, and each number, string or small array in its cells a setting:
`scale_by_adam.b1`, `scale.step_size` (minus the learning rate), `cosine_decay_schedule.decay_steps` (a schedule's
length), `inject_hyperparams`' values alike. Functions outside optax, jax and jaxnn (a user's own schedule) add the
numbers of their code. The optimizer state's tree structure, shapes and dtypes join as a digest, which catches what
no closure shows. Cells name settings stably within one optax version, not across them, so records of another
optax version are not compared.
"""

from __future__ import annotations

import hashlib
import types
from typing import Any

import jax
import numpy as np

FIELD = "optimizer"  # its key in a run's record; compared by the resume check alone, never as a plain field
_OWN_MODULES = ("optax", "jax", "jaxnn")
_PLUMBING = {"chain", "named_chain", "with_extra_args_support", "init_empty_state"}
_NOT_A_SETTING = object()
_RATE_NAMES = ("step_size", "init_value", "learning_rate")  # the settings a description shows
_DEPTH = 16  # closures nest a few levels per transformation; deeper is a cycle the seen-set missed or not optax


def fingerprint(tx: Any, opt_state: Any) -> dict:
    """`tx`'s identity: optax version, transformation names, settings, and the digest of `opt_state`'s layout
    (arrays or `jax.eval_shape` structs)."""
    names: list[str] = []
    settings: dict[str, Any] = {}
    _walk((getattr(tx, "init", None), getattr(tx, "update", None)), names, settings, set(), 0)
    return {"optax": _optax_version(), "transforms": "+".join(names), "settings": settings,
            "state": _layout_digest(opt_state)}  # fmt: skip


def differences(saved: dict, now: dict) -> list[str]:
    """`what: saved X, now Y` for each way two fingerprints differ; none when either is unreadable or they come
    from different optax versions (see the module doc)."""
    from jaxnn._src.checks import config_differences

    if not isinstance(saved, dict) or saved.get("optax") != now.get("optax"):
        return []
    diffs = config_differences(_flat(saved), _flat(now), saved_as="saved", now_as="now")
    named = [d for d in diffs if not d.startswith("state:")]  # the layout's digest says only what they name
    return sorted(named, key=lambda d: not d.startswith("transforms:")) or diffs


def describe(record: dict) -> str:
    """One phrase naming an optimizer: its transformations and learning-rate-like settings."""
    settings = record.get("settings", {}) if isinstance(record, dict) else {}
    shown = [f"{k} {v}" for k, v in settings.items() if k.rsplit(".", 1)[-1] in _RATE_NAMES]
    return f"{record.get('transforms', '?')}" + (f" ({', '.join(shown[:3])})" if shown else "")


def _flat(record: dict) -> dict:
    return {"transforms": record.get("transforms"), "state": record.get("state"), **record.get("settings", {})}


def _walk(obj: Any, names: list[str], settings: dict, seen: set, depth: int) -> None:
    if id(obj) in seen or depth > _DEPTH:
        return
    seen.add(id(obj))
    if isinstance(obj, types.FunctionType):
        _function(obj, names, settings, seen, depth)
    elif isinstance(obj, dict):
        for value in obj.values():
            _walk(value, names, settings, seen, depth + 1)
    elif isinstance(obj, (tuple, list)):
        for value in obj:
            _walk(value, names, settings, seen, depth + 1)
    elif hasattr(obj, "func"):  # functools.partial
        _walk(obj.func, names, settings, seen, depth + 1)
        _walk(tuple(obj.args) + tuple(obj.keywords.values()), names, settings, seen, depth + 1)


def _function(fn: types.FunctionType, names: list[str], settings: dict, seen: set, depth: int) -> None:
    owner = fn.__qualname__.split(".<locals>", 1)[0]
    if owner not in _PLUMBING and owner not in names:
        names.append(owner)
    if not (fn.__module__ or "").startswith(_OWN_MODULES):  # a user's function: its constants say what it does
        _setting(settings, f"{owner}.constants", [c for c in fn.__code__.co_consts if _plain(c)])
    cells = zip(fn.__code__.co_freevars, fn.__closure__ or ())
    for name, cell in cells:
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell (a name bound later)
            continue
        _cell(f"{owner}.{name}", value, names, settings, seen, depth)


def _cell(key: str, value: Any, names: list[str], settings: dict, seen: set, depth: int) -> None:
    """A setting when `value` is one; a dict of them (`inject_hyperparams`' values) one per entry; else walked."""
    readable = _value(value)
    if readable is not _NOT_A_SETTING:
        _setting(settings, key, readable)
    elif isinstance(value, dict) and all(isinstance(k, str) for k in value):
        for k, v in value.items():
            _cell(f"{key}.{k}", v, names, settings, seen, depth + 1)
    else:
        _walk(value, names, settings, seen, depth + 1)


def _setting(settings: dict, key: str, value: Any) -> None:
    """Records `value` under `key`; the same key again (init and update closures share settings) with another
    value (a second transformation of the same kind) gets a numbered key."""
    if settings.get(key, value) == value:
        settings[key] = value
        return
    n = 2
    while f"{key}#{n}" in settings and settings[f"{key}#{n}"] != value:
        n += 1
    settings[f"{key}#{n}"] = value


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _value(value: Any) -> Any:
    """`value` as JSON when it is a setting (a number, string, small array or list of them)."""
    if _plain(value):
        return value
    if isinstance(value, (np.ndarray, np.generic, jax.Array)) and np.size(value) <= 16:
        return np.asarray(value).tolist()
    if isinstance(value, (tuple, list)) and value and all(_plain(v) for v in value):
        return list(value)
    return _NOT_A_SETTING


def _layout_digest(opt_state: Any) -> str:
    leaves, treedef = jax.tree.flatten(opt_state)
    layout = str(treedef) + "".join(f"{tuple(np.shape(x))}{getattr(x, 'dtype', type(x).__name__)}" for x in leaves)
    return hashlib.sha256(layout.encode()).hexdigest()[:16]


def _optax_version() -> str:
    import optax

    return str(getattr(optax, "__version__", "unknown"))


# A train state made by `fit` carries its optimizer's record to `save_model` here, keyed by the state's step array:
# a TrainState is a tuple (no attribute, no weak reference) and its step an array that fit's result alone holds.
# The step is kept (a scalar, so the id is never reused while the entry lives), and only the newest few.
_REMEMBERED: dict[int, tuple[Any, tuple[int, ...], dict]] = {}
_KEEP = 32


def remember(state: Any, record: dict) -> None:
    """Ties `record` (fingerprint, schedule length) to the train state `fit` returns."""
    step = getattr(state, "step", None)
    if not isinstance(step, jax.Array):
        return
    _REMEMBERED[id(step)] = (step, _leaf_ids(state), record)
    while len(_REMEMBERED) > _KEEP:
        del _REMEMBERED[next(iter(_REMEMBERED))]


def recalled(state: Any) -> dict | None:
    """The record `remember` tied to `state`, if it is that state (same step array, same optimizer arrays)."""
    entry = _REMEMBERED.get(id(getattr(state, "step", None)))
    if entry is None or entry[0] is not state.step or entry[1] != _leaf_ids(state):
        return None
    return entry[2]


def _leaf_ids(state: Any) -> tuple[int, ...]:
    return tuple(id(x) for x in jax.tree.leaves(state.opt_state))
