"""Whole-model save and load: the architecture, the parameters and the model state in one folder, loaded with no
user code (Keras' `model.save` / `keras.models.load_model`).

    jaxnn.save_model("saved/cnn", model, result.state)     # model.json + weights.safetensors
    model, params, model_state = jaxnn.load_model("saved/cnn")
    logits = jaxnn.predict(model, params, x, model_state=model_state)

The architecture is the call that built the model, recorded by every jaxnn layer constructor, combinator and
built-in model (`describe`): `serial(Conv(32, 3), Relu, ...)` is saved as those calls with their arguments, a
`GPT(GPTConfig(...))` as its config. Names inside the params follow from the calls, so a folder loads into the
same tree it was saved from. What no call describes is refused at save, naming it: a layer a user wrote as
`Layer(init, apply, ...)`, a `Lambda` of an anonymous function (a named function is saved by its import path,
`Lambda(jax.nn.relu)`), a layer changed afterwards with `_replace`, a function of the script being run
(`__main__`). Load checks the weights against the architecture. Initialisers are not saved (the parameters
are): a loaded model uses the constructors' defaults, which matters only if it is initialised again.

Versioned: `model.json` holds `"format": "jaxnn-model"` and `"version"`; a newer version is refused in one line.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxnn.errors import ModelSaveError  # noqa: F401 (also importable from here)
from jaxnn.layers.core import Layer

FORMAT = "jaxnn-model"
VERSION = 1
ARCHITECTURE_FILE = "model.json"
WEIGHTS_FILE = "weights.safetensors"
TRAINING_FILE = "training.safetensors"  # optimizer state, step, key: what resuming needs


# ------------------------------------------------------------------------------------------------- describing


def _path_of(obj: Any) -> str | None:
    """`module.qualname` when that import path leads back to `obj` itself, else None."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not qualname or "<" in qualname:
        return None
    try:
        return f"{module}.{qualname}" if _resolve(f"{module}.{qualname}") is obj else None
    except (ImportError, AttributeError):
        return None


# Layer constructors and instances that moved to another module; folders saved before name them where they were.
_MOVED = {
    "jaxnn.layers.core.Lambda": "jaxnn.layers.combinators.Lambda",
    "jaxnn.layers.core.serial": "jaxnn.layers.combinators.serial",
    "jaxnn.layers.core.parallel": "jaxnn.layers.combinators.parallel",
    "jaxnn.layers.core.residual": "jaxnn.layers.combinators.residual",
    "jaxnn.layers.attention.SwiGLU": "jaxnn.layers.transformer.SwiGLU",
    "jaxnn.layers.attention.TransformerBlock": "jaxnn.layers.transformer.TransformerBlock",
    "jaxnn.layers.attention.HiddenGelu": "jaxnn.layers.transformer.HiddenGelu",
}


def _resolve(path: str) -> Any:
    """The object at an import path "package.module.Attr.attr" (or where it moved to, `_MOVED`)."""
    parts = _MOVED.get(path, path).split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"no module in {path!r}")


def _named_instances() -> dict[int, str]:
    """jaxnn's module-level layer instances (`Relu`, `Softmax`, ...) by id -> their import path."""
    import jaxnn.layers as layers_package

    found: dict[int, str] = {}
    for module_name in ("jaxnn.layers.activation", "jaxnn.layers.transformer", "jaxnn.layers"):
        module = importlib.import_module(module_name)
        for attr, value in vars(module).items():
            if isinstance(value, Layer):
                found.setdefault(id(value), f"{module_name}.{attr}")
    del layers_package
    return found


def encode(value: Any, where: str, instances: dict[int, str] | None = None) -> Any:
    """`value` (a layer, its arguments) as JSON; what cannot be described is a ModelSaveError naming `where`."""
    instances = _named_instances() if instances is None else instances
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    if isinstance(value, Layer):
        return _encode_layer(value, where, instances)
    if isinstance(value, tuple):
        return {"tuple": [encode(v, f"{where}[{i}]", instances) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, f"{where}[{i}]", instances) for i, v in enumerate(value)]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"dict": {k: encode(v, f"{where}.{k}", instances) for k, v in value.items()}}
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and _path_of(type(value)):
        kept = [f.name for f in dataclasses.fields(value) if f.init]
        kept = [name for name in kept if not _unsaved_initialiser(name, getattr(value, name))]
        fields = {name: encode(getattr(value, name), f"{where}.{name}", instances) for name in kept}
        return {"config": _path_of(type(value)), "fields": fields}
    if callable(value) and _path_of(value):
        _check_importable(value, where)
        return {"function": _path_of(value)}
    raise ModelSaveError(
        f"save_model: {where} is a {type(value).__name__} ({getattr(value, '__name__', value)!r}) that cannot be "
        "written down: use a named function or one of jaxnn's layers"
    )


def _check_importable(function: Any, where: str) -> None:
    """Refuses a function of the script being run: its path `__main__.name` leads nowhere in another process."""
    if function.__module__ != "__main__":
        return
    code = getattr(function, "__code__", None)
    defined = code.co_filename if code is not None else "the script being run"
    raise ModelSaveError(
        f"save_model: {where} is {function.__qualname__}, defined in {defined} (__main__), which no other process "
        "can import; define it in an importable module and load with load_model(path, trust=('that_module',))"
    )


def _changed_fields(layer: Layer, spec: Any) -> list[str]:
    """The fields of `layer` that differ from the layer its recorded call built (changed with `_replace`)."""
    made = getattr(spec, "made", None)
    if made is None:  # a Spec made by hand: nothing to compare with
        return []
    fields = [f for f in Layer._fields if f != "spec"]
    return [f for f in fields if getattr(layer, f) is not getattr(made, f) and getattr(layer, f) != getattr(made, f)]


def _encode_layer(layer: Layer, where: str, instances: dict[int, str]) -> Any:
    if id(layer) in instances:
        return {"instance": instances[id(layer)]}
    spec = getattr(layer, "spec", None)
    if spec is None:
        raise ModelSaveError(
            f"save_model: {where} (layer {layer.name!r}) was not made by a jaxnn constructor (a layer written as "
            "Layer(init, apply, ...), or changed with _replace), so no call describes it; build it from jaxnn's "
            "layers, or save its parameters alone (jaxnn.export.save_safetensors)"
        )
    call = spec.path.rsplit(".", 1)[-1]
    changed = _changed_fields(layer, spec)
    if changed:
        raise ModelSaveError(
            f"save_model: {where} (layer {layer.name!r}) had its {', '.join(changed)} replaced after {call}(...) "
            "built it (_replace), so its recorded call would load another layer; build it from jaxnn's layers, or "
            "save its parameters alone (jaxnn.export.save_safetensors)"
        )
    kept = {k: v for k, v in spec.kwargs.items() if not _unsaved_initialiser(k, v)}
    return {
        "call": spec.path,
        "args": [encode(a, f"{where}/{call}(argument {i})", instances) for i, a in enumerate(spec.args)],
        "kwargs": {k: encode(v, f"{where}/{call}({k}=)", instances) for k, v in kept.items()},
    }


def _unsaved_initialiser(name: str, value: Any) -> bool:
    """An initialiser argument that has no import path (`lecun_normal()` returns a closure): left out, since the
    weights are saved (see the module doc)."""
    return name.endswith("_init") and callable(value) and _path_of(value) is None


def decode(value: Any, trust: Sequence[str] = ()) -> Any:
    """The objects `encode` wrote, built again by the same calls. A folder is data from outside, so nothing in it
    runs but jaxnn's layer constructors (`describe`) and config dataclasses; functions it names (activations) come
    from jax or jaxnn, or from the modules in `trust` (a user's own, by top-level package name)."""
    roots = ("jaxnn", "jax", *trust)

    def again(v: Any) -> Any:
        return decode(v, trust)

    if isinstance(value, list):
        return [again(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "tuple" in value:
        return tuple(again(v) for v in value["tuple"])
    if "dict" in value:
        return {k: again(v) for k, v in value["dict"].items()}
    if "instance" in value:
        return _trusted(value["instance"], ("jaxnn",), lambda obj: isinstance(obj, Layer), "a jaxnn layer")
    if "function" in value:
        return _trusted(value["function"], roots, callable, "a function")
    if "config" in value:
        config = _trusted(value["config"], ("jaxnn",), dataclasses.is_dataclass, "a jaxnn config")
        return config(**{k: again(v) for k, v in value["fields"].items()})
    if "call" in value:
        build = _trusted(value["call"], ("jaxnn",), lambda obj: getattr(obj, "builds_layers", False), "a layer")
        return build(*again(value["args"]), **{k: again(v) for k, v in value["kwargs"].items()})
    raise ModelSaveError(f"load_model: unknown entry {sorted(value)} in the architecture")


def _trusted(path: Any, roots: Sequence[str], is_kind: Any, kind: str) -> Any:
    """The object at `path` when its top-level package is one of `roots` and it is of the kind expected; else a
    ModelSaveError, before anything outside those packages is imported."""
    if not isinstance(path, str) or path.split(".", 1)[0] not in roots:
        raise ModelSaveError(
            f"load_model: the architecture names {path!r}, outside {', '.join(roots)}; a model folder is data and "
            "runs only jaxnn's constructors (pass trust=('package',) to load_model for your own functions)"
        )
    obj = _resolve(path)
    if not is_kind(obj):
        raise ModelSaveError(f"load_model: the architecture names {path!r}, which is not {kind}")
    return obj


# --------------------------------------------------------------------------------------------------- save, load


def save_model(
    path: str | os.PathLike,
    model: Layer,
    params_or_state: Any,
    *,
    model_state: Any = None,
    include_optimizer: bool = True,
    input_spec: Any = None,
) -> str:
    """Writes `model` (its architecture) and its parameters and model state (a TrainState, a FitResult, a
    `load_params` result, or params with `model_state=`) into the folder `path`, whole: a new or empty folder, or
    an earlier save of the same kind (replaced once the new one is complete). Returns the folder.

    Given a TrainState or FitResult, the rest of the train state (optimizer state, step, random key, fp16 loss
    scale) goes into training.safetensors unless `include_optimizer=False`, so that `fit(..., resume=path)`
    continues the run. `input_spec`: one example's input (an array, or a `(shape, dtype)` pair without the batch
    axis) for `jaxnn export`; a FitResult brings its own."""
    from importlib.metadata import PackageNotFoundError, version

    from jaxnn._src.folders import write_folder
    from jaxnn.evaluation import params_and_state
    from jaxnn.export import save_safetensors

    architecture = encode(model, "the model")
    params, state = params_and_state(params_or_state, model_state)
    training = _training_tensors(params_or_state) if include_optimizer else None
    try:
        made_by = version("jaxnn")
    except PackageNotFoundError:  # a checkout on the path, not installed
        made_by = "unknown"
    record = {"format": FORMAT, "version": VERSION, "jaxnn": made_by, "architecture": architecture,
              "weights": _shapes(params, state)}  # fmt: skip
    example = _input_record(input_spec, params_or_state)
    if example is not None:
        record["input"] = example
    if training is not None:
        record["training"] = {"step": int(training["step"]), "entries": len(training), **_optimizer_of(params_or_state)}

    def fill(folder: pathlib.Path) -> None:
        save_safetensors(params, folder / WEIGHTS_FILE, model_state=state or None)
        if training is not None:  # serialised and written by jaxnn: safetensors' save_file makes owner-only files
            from safetensors.numpy import save

            from jaxnn._src.storage import write_bytes_atomic

            write_bytes_atomic(folder / TRAINING_FILE, save(training))
        (folder / ARCHITECTURE_FILE).write_text(json.dumps(record, indent=1) + "\n")

    return os.fspath(write_folder(path, fill, {"format": FORMAT}))


def _shapes(params: Any, state: Any) -> dict[str, list[int]]:
    """Each parameter's (and model state entry's, under "state.") shape by its dotted name: what `load_model`
    checks the weights file against, so that weights from another save are refused at load."""
    from jaxnn._src.pytree import flatten

    named = {**flatten(params), **{f"state.{k}": v for k, v in flatten(state or {}).items()}}
    return {name: [int(d) for d in np.shape(leaf)] for name, leaf in named.items()}


def _check_weights(folder: pathlib.Path, model: Layer, record: dict, params: Any, state: Any) -> None:
    """Refuses weights that do not fit the architecture (another save's, or an edited model.json), naming the
    first parameter that differs. Checked against the architecture's own init when the input is recorded, and
    against the shapes recorded at save (folders from before they were recorded have neither)."""
    from jaxnn.lora import ADAPTER_KEYS

    found = _shapes(params, state)
    wanted = [(f"the shapes {ARCHITECTURE_FILE} records", record.get("weights"))]
    if isinstance(record.get("input"), dict):
        # LoRA adapters ride beside the weights they adapt; the architecture's init has none.
        base = {k: v for k, v in found.items() if k.rsplit(".", 1)[-1] not in ADAPTER_KEYS}
        wanted.append((f"the architecture in {ARCHITECTURE_FILE}", _init_shapes(model, record["input"]["shape"])))
        found_for = [found, base]
    else:
        found_for = [found]
    for (source, expected), have in zip(wanted, found_for):
        if isinstance(expected, dict) and expected != have:
            name = next(n for n in sorted({*expected, *have}) if expected.get(n) != have.get(n))
            raise ModelSaveError(
                f"{folder / WEIGHTS_FILE}: parameter {name} is {_shown(have.get(name))} there and "
                f"{_shown(expected.get(name))} by {source}; the two files come from different saves"
            )


def _shown(shape: Any) -> str:
    return "missing" if shape is None else f"shape {tuple(shape)}"


def _init_shapes(model: Layer, example_shape: Sequence[int]) -> dict[str, list[int]]:
    """The shapes `model`'s init gives for one example (abstractly: no parameter memory is allocated)."""
    import jax

    from jaxnn.layers.core import init_model

    in_shape = (1, *(int(d) for d in example_shape))
    params, state = jax.eval_shape(lambda key: init_model(model, key, in_shape)[1:], jax.random.key(0))
    return _shapes(params, state)


def _input_record(input_spec: Any, params_or_state: Any) -> dict | None:
    """`{"shape": [...], "dtype": "..."}` of one example (no batch axis), from `input_spec` or a FitResult."""
    if input_spec is None:
        recorded = getattr(params_or_state, "summary", None)
        return recorded.get("input") if isinstance(recorded, dict) else None
    if isinstance(input_spec, tuple) and len(input_spec) == 2 and not hasattr(input_spec, "shape"):
        shape, dtype = input_spec
    else:
        shape, dtype = np.shape(input_spec), getattr(input_spec, "dtype", np.asarray(input_spec).dtype)
    try:
        return {"shape": [int(d) for d in shape], "dtype": np.dtype(dtype).name}
    except (TypeError, ValueError):
        raise ModelSaveError(
            f"save_model: input_spec must be an example array or (shape, dtype), got {input_spec!r}"
        ) from None


def _training_tensors(params_or_state: Any) -> dict[str, np.ndarray] | None:
    """The train state besides params and model state, as named host arrays; None for bare parameters."""
    import jax

    from jaxnn.train import TrainState

    state = getattr(params_or_state, "state", params_or_state)  # a FitResult's
    if not isinstance(state, TrainState):
        return None
    parts = {"opt_state": state.opt_state, "step": state.step, "key": state.key, "loss_scale": state.loss_scale}
    named = {}
    for part, tree in parts.items():
        for where, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            named[part + jax.tree_util.keystr(where)] = np.array(jax.device_get(leaf))  # 0-d stays 0-d
    return named


def _optimizer_of(params_or_state: Any) -> dict:
    """The optimizer fingerprint (and decaying schedule's steps) `fit` tied to the train state it returned, which
    a resume checks; {} for a state `fit` did not return (then nothing is checked, as for older folders)."""
    from jaxnn._src.optimizer_id import recalled

    return recalled(getattr(params_or_state, "state", params_or_state)) or {}


def load_training_state(path: str | os.PathLike, like_state: Any) -> Any:
    """`like_state` (a TrainState of the same model and optimizer, e.g. freshly made) with the optimizer state,
    step, key and loss scale of the `save_model` folder `path`, each placed as `like_state`'s is. A folder saved
    without them, or by another optimizer, is one ModelSaveError naming the first entry that differs."""
    import jax
    from safetensors.numpy import load_file

    folder = pathlib.Path(path)
    if not (folder / TRAINING_FILE).is_file():
        raise ModelSaveError(
            f"{folder}: saved without its optimizer state (parameters only, or include_optimizer=False), so "
            "it cannot be resumed; start a new run from it with params= and model_state="
        )
    saved = load_file(str(folder / TRAINING_FILE))
    parts = {"opt_state": like_state.opt_state, "step": like_state.step, "key": like_state.key,
             "loss_scale": like_state.loss_scale}  # fmt: skip
    restored, wanted = {}, set()
    for part, tree in parts.items():
        leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
        values = []
        for where, like in leaves:
            name = part + jax.tree_util.keystr(where)
            wanted.add(name)
            values.append(_placed(saved, name, like, folder))
        restored[part] = jax.tree_util.tree_unflatten(treedef, values)
    extra = sorted(set(saved) - wanted)
    if extra:
        raise ModelSaveError(
            f"{folder}: its optimizer state has entries this optimizer lacks ({', '.join(extra[:3])}); resume "
            "it with the optimizer it was saved with"
        )
    return like_state._replace(**restored)


def _placed(saved: dict, name: str, like: Any, folder: pathlib.Path) -> Any:
    import jax

    if name not in saved:
        raise ModelSaveError(
            f"{folder}: its optimizer state has no entry {name} that this optimizer keeps; resume it with the "
            "optimizer it was saved with"
        )
    value = saved[name]
    if value.shape != tuple(like.shape) or value.dtype != like.dtype:
        raise ModelSaveError(
            f"{folder}: optimizer entry {name} is {value.dtype}{list(value.shape)} there and "
            f"{like.dtype}{list(like.shape)} for this optimizer and model; resume it with the ones it was saved with"
        )
    return jax.device_put(value, like.sharding) if hasattr(like, "sharding") else value


def saved_record(path: str | os.PathLike) -> dict:
    """The checked `model.json` record of a `save_model` folder (format, version, architecture, input, training)."""
    folder = pathlib.Path(path)
    if not is_saved_model(folder):
        _check_interrupted(folder)
        raise ModelSaveError(f"{folder}: not a saved model (no {ARCHITECTURE_FILE} and {WEIGHTS_FILE})")
    try:
        record = json.loads((folder / ARCHITECTURE_FILE).read_text())
    except ValueError as err:
        raise ModelSaveError(f"{folder / ARCHITECTURE_FILE}: not JSON ({err}); cut short?") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        found = record.get("format") if isinstance(record, dict) else type(record).__name__
        raise ModelSaveError(f"{folder / ARCHITECTURE_FILE}: not a jaxnn model (format {found!r})")
    version = record.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ModelSaveError(
            f'{folder / ARCHITECTURE_FILE}: its "version" field is {version!r}, not a format version (a whole '
            f"number, 1 to {VERSION}); the file was edited or damaged"
        )
    if version > VERSION:
        raise ModelSaveError(
            f"{folder}: saved by a newer jaxnn (format version {record.get('version')}, this one reads up to "
            f"{VERSION}); upgrade jaxnn"
        )
    return record


def _check_interrupted(folder: pathlib.Path) -> None:
    """Names the folder a save killed between its two renames left (the earlier save, set aside beside an empty
    name; `jaxnn._src.folders`), rather than calling the missing folder not a saved model."""
    from jaxnn._src.folders import set_aside

    if folder.exists():
        return
    left = set_aside(folder)
    if left is not None:
        raise ModelSaveError(
            f"{folder}: an interrupted save (killed while replacing the folder): its files are in {left}; rerun "
            f"the save, or rename {left.name} to {folder.name}"
        )


def is_saved_model(path: str | os.PathLike) -> bool:
    """Whether `path` is a `save_model` folder (its architecture and weights files)."""
    return (pathlib.Path(path) / ARCHITECTURE_FILE).is_file() and (pathlib.Path(path) / WEIGHTS_FILE).is_file()


def load_model(path: str | os.PathLike, *, trust: Sequence[str] = ()) -> tuple[Layer, Any, Any]:
    """`(model, params, model_state)` of a `save_model` folder, built without the code that made the model;
    params and state as numpy arrays. A folder that is not one, or of a newer version, is one ModelSaveError.
    Only jaxnn's constructors run; functions named in it come from jax and jaxnn, or the packages in `trust`."""
    from jaxnn.export import load_safetensors

    folder = pathlib.Path(path)
    record = saved_record(folder)
    try:
        model = decode(record["architecture"], trust)
    except (ImportError, AttributeError, TypeError, KeyError) as err:
        raise ModelSaveError(f"{folder}: its architecture cannot be built by this jaxnn ({err})") from None
    params, state, _ = load_safetensors(folder / WEIGHTS_FILE)
    _check_weights(folder, model, record, params, state)
    return model, params, state


def export_saved_model(
    path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    platforms: str | Sequence[str] = ("cpu",),
    safetensors_only: bool = False,
    input_spec: tuple[Sequence[int], Any] | None = None,
) -> pathlib.Path:
    """Exports a `save_model` folder as `jaxnn.export.export_run` does a run: the input shape and dtype are the ones
    the folder records (saved from a FitResult, or with `input_spec=`), else `input_spec` `(shape, dtype)`."""
    from jaxnn._src.storage import make_dirs
    from jaxnn.export import WEIGHTS_FILE, check_fits, check_out_dir, save_safetensors, write_export
    from jaxnn.lora import merge

    record = saved_record(path)
    model, params, model_state = load_model(path)
    params = merge(params)
    example = record.get("input")
    config = {"saved_model": str(pathlib.Path(path).absolute()), "input": example,
              "step": record.get("training", {}).get("step")}  # fmt: skip
    out = pathlib.Path(out_dir)
    check_out_dir(out, config)
    if safetensors_only:
        make_dirs(out)
        save_safetensors(params, out / WEIGHTS_FILE, model_state=model_state, config=config)
        return out
    if input_spec is not None:
        shape, dtype = tuple(int(d) for d in input_spec[0]), str(np.dtype(input_spec[1]))
    elif example is not None:
        shape, dtype = tuple(example["shape"]), example["dtype"]
    else:
        raise ValueError(
            f"{path}: the saved model records no input shape (saved from parameters alone); give one "
            "(`jaxnn export --input-shape H,W,C`, or save_model(..., input_spec=(shape, dtype)))"
        )
    check_fits(model, params, shape)
    return write_export(out, model, params, model_state, shape, dtype=dtype, platforms=platforms, config=config)


__all__ = [
    "ModelSaveError",
    "decode",
    "encode",
    "export_saved_model",
    "is_saved_model",
    "load_model",
    "load_training_state",
    "save_model",
    "saved_record",
]
