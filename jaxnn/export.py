"""Parameters as safetensors files, and models as serialized `jax.export` programs that run without jaxnn.

`jaxnn export --run-dir R --out DIR` writes both for a `jaxnn train` run (`export_run`).

An output folder holds one export: writing into a folder that holds another one (another config or step, as its
weights header and export.json record them) or files that are not an export is refused before anything is
written; the same export again (e.g. `--safetensors-only` beside its own full export) replaces its files.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxnn._src import pytree
from jaxnn._src.ownership import check_export_dir
from jaxnn._src.storage import check_writable, make_dirs, pid_alive, write_bytes_atomic, write_json_atomic

if TYPE_CHECKING:
    from jaxnn.layers import Layer
    from jaxnn.precision import Policy

# Model state (e.g. BatchNorm statistics) shares the file with the parameters under this prefix. Layer names
# start with their index ("0_conv"), so no parameter name can begin with it.
STATE_PREFIX = "state."
# The safetensors header key that holds the run config as JSON (header metadata values must be strings).
CONFIG_KEY = "jaxnn_config"
EXPORT_FILE = "model.jaxexport"
WEIGHTS_FILE = "weights.safetensors"
INFO_FILE = "export.json"
# Channels-last image shape of each built-in image data set; run configs name the data set, not its shape.
IMAGE_SHAPES: dict[str, tuple[int, ...]] = {
    "digits": (8, 8, 1),
    "synthetic": (8, 8, 1),
    "mnist": (28, 28, 1),
    "fashion_mnist": (28, 28, 1),
    "cifar10": (32, 32, 3),
}
CALL = (
    "import jax, safetensors.numpy; "
    f"exported = jax.export.deserialize(open('{EXPORT_FILE}', 'rb').read()); "
    f"weights = safetensors.numpy.load_file('{WEIGHTS_FILE}'); "
    "logits = exported.call(weights, x)  # x: input.shape with any batch size b, input.dtype"
)

# The platforms `jax.export` lowers for, by the names it takes.
EXPORT_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")

NameMap = Mapping[str, str | None] | Callable[[str], str | None]


# --- safetensors ------------------------------------------------------------------------------------------------


def flat_weights(params: Any, model_state: Any = None) -> dict[str, np.ndarray]:
    """Params and model state as one flat dict of host arrays: `"0_conv.w"`, and `"state.1_batch_norm.mean"`.

    These are the names `save_safetensors` writes and the exported inference function takes.
    """
    import jax

    flat = dict(pytree.flatten(params))
    clash = [name for name in flat if name.startswith(STATE_PREFIX)]
    if clash:
        raise ValueError(f"parameter names {clash[:3]} start with {STATE_PREFIX!r}, the prefix kept for model state")
    flat.update({STATE_PREFIX + name: leaf for name, leaf in pytree.flatten(model_state or {}).items()})
    out = {}
    for name, leaf in flat.items():
        array = np.ascontiguousarray(jax.device_get(leaf))
        # jnp's notion of a number includes bfloat16 and the float8 types, which numpy's dtype kinds do not.
        if not (array.dtype == np.bool_ or jax.numpy.issubdtype(array.dtype, np.number)):
            raise ValueError(f"{name}: cannot store dtype {array.dtype} in a safetensors file")
        out[name] = array
    return out


def split_weights(flat: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The inverse of `flat_weights`: nested `(params, model_state)` from flat names."""
    params = {name: v for name, v in flat.items() if not name.startswith(STATE_PREFIX)}
    state = {name[len(STATE_PREFIX) :]: v for name, v in flat.items() if name.startswith(STATE_PREFIX)}
    return pytree.unflatten(params), pytree.unflatten(state)


def save_safetensors(
    params: Any, path: str | os.PathLike[str], *, model_state: Any = None, config: dict | None = None
) -> None:
    """Writes params (and model state, under "state.") to a safetensors file, with `config` as JSON in its header.

    The file is written whole to a temporary name and renamed, so `path` never holds a partial file.
    """
    from safetensors.numpy import save

    metadata: dict[str, str] = {}
    if config is not None:
        try:
            metadata[CONFIG_KEY] = json.dumps(config, sort_keys=True)
        except TypeError as err:
            raise ValueError(f"save_safetensors: config is not JSON-serializable ({err})") from None
    tensors = flat_weights(params, model_state)
    # Serialized here and written by `_write_atomic`, because safetensors' own `save_file` makes owner-only files.
    write_bytes_atomic(pathlib.Path(path), save(tensors, metadata=metadata or None))


def load_safetensors(
    path: str | os.PathLike[str], *, name_map: NameMap | None = None
) -> tuple[dict[str, Any], dict[str, Any], dict | None]:
    """`(params, model_state, config)` from a safetensors file; numpy arrays, bit for bit as stored.

    `name_map` renames a foreign file's tensors to jaxnn names ("features.0.weight" -> "0_conv.w"; a name under
    "state." goes to the model state): a dict that must name every tensor in the file, or a callable; either
    maps a tensor to None to drop it. Only names change: layouts (e.g. PyTorch's OIHW kernels against jaxnn's
    HWIO) are the caller's to convert. `config` is the JSON a jaxnn file was saved with, else None.
    """
    from safetensors import safe_open
    from safetensors.numpy import load_file

    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such safetensors file")
    try:
        with safe_open(str(path), framework="np") as f:
            metadata = f.metadata() or {}
        tensors = load_file(path)
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types for a damaged header
        raise ValueError(f"{path}: not a readable safetensors file ({type(err).__name__}: {err})") from None
    if name_map is not None:
        tensors = _rename(tensors, name_map, path)
    params, model_state = split_weights(tensors)
    config = json.loads(metadata[CONFIG_KEY]) if CONFIG_KEY in metadata else None
    return params, model_state, config


def _rename(tensors: dict[str, np.ndarray], name_map: NameMap, path: pathlib.Path) -> dict[str, np.ndarray]:
    rename: Callable[[str], str | None]
    if isinstance(name_map, Mapping):
        # Strict for a dict: a tensor it forgot would otherwise land in the tree under its foreign name.
        missing = sorted(set(tensors) - set(name_map))
        if missing:
            raise ValueError(f"{path}: name_map does not name {missing[:5]} (map a name to None to drop it)")
        rename = name_map.get
    else:
        rename = name_map
    out: dict[str, np.ndarray] = {}
    for name, array in tensors.items():
        new = rename(name)
        if new is None:
            continue
        if new in out:
            raise ValueError(f"{path}: name_map maps two tensors to {new!r}")
        out[new] = array
    return out


# --- jax.export -------------------------------------------------------------------------------------------------


def export_inference(
    model: Layer,
    params: Any,
    model_state: Any,
    example_shape: Sequence[int],
    *,
    dtype: Any,
    policy: Policy | str = "fp32",
    platforms: str | Sequence[str] = ("cpu",),
) -> bytes:
    """The serialized `jax.export` of `fn(weights, x) -> logits`, the model in eval mode under `policy`.

    `weights` is the flat dict of `flat_weights(params, model_state)` (what `safetensors.numpy.load_file` returns
    for the file `save_safetensors` writes); `x` has shape `(b, *example_shape)` and `dtype`, for any batch size
    b. `params` and `model_state` fix only the names, shapes and dtypes the function takes. Load it with
    `jax.export.deserialize(data)` and call `.call(weights, x)`; jaxnn is not needed for that.
    """
    return bytes(_export(model, params, model_state, example_shape, dtype, policy, platforms).serialize())


def _export(
    model: Layer,
    params: Any,
    model_state: Any,
    example_shape: Sequence[int],
    dtype: Any,
    policy: Policy | str,
    platforms: str | Sequence[str],
) -> Any:
    import jax

    from jaxnn.kernels import onednn
    from jaxnn.train import make_predict

    platforms = check_platforms(platforms)
    x_dtype = _check_dtype(dtype)
    predict = make_predict(model, policy)
    # The trees are rebuilt from the flat names inside the function, so that its argument is the plain dict a
    # consumer reads from the safetensors file, without jaxnn's tree layout.
    param_names = list(pytree.flatten(params))
    state_names = list(pytree.flatten(model_state or {}))
    param_def = jax.tree_util.tree_structure(params)
    state_def = jax.tree_util.tree_structure(model_state or {})

    def fn(weights: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        p = jax.tree_util.tree_unflatten(param_def, [weights[n] for n in param_names])
        s = jax.tree_util.tree_unflatten(state_def, [weights[STATE_PREFIX + n] for n in state_names])
        return predict(p, s, x)

    weights_spec = {
        name: jax.ShapeDtypeStruct(a.shape, a.dtype) for name, a in flat_weights(params, model_state).items()
    }
    (batch,) = jax.export.symbolic_shape("b")
    x_spec = jax.ShapeDtypeStruct((batch, *example_shape), x_dtype)
    # An exported program runs without jaxnn, so it never calls jaxnn's optional oneDNN kernels.
    with onednn.use(False):
        return jax.export.export(jax.jit(fn), platforms=platforms)(weights_spec, x_spec)


def check_platforms(platforms: Any) -> tuple[str, ...]:
    """`platforms` as a tuple of distinct known platform names; one name may be given as a plain string."""
    # A plain string is a sequence of its letters: "cuda" would otherwise export for "c", "u", "d" and "a".
    names = tuple(platforms) if isinstance(platforms, Iterable) and not isinstance(platforms, str) else (platforms,)
    unknown = [p for p in names if not isinstance(p, str) or p not in EXPORT_PLATFORMS]
    if unknown or not names:
        raise ValueError(
            f"export: platforms must name one or more of {list(EXPORT_PLATFORMS)}, got {platforms!r}"
            + (f" (unknown: {unknown})" if unknown else "")
        )
    return tuple(dict.fromkeys(names))


def _check_dtype(dtype: Any) -> np.dtype:
    try:
        return np.dtype(dtype)
    except TypeError:
        raise ValueError(f"export: dtype {dtype!r} is not a numpy dtype name (e.g. 'float32', 'int32')") from None


def write_export(
    out_dir: str | os.PathLike[str],
    model: Layer,
    params: Any,
    model_state: Any,
    example_shape: Sequence[int],
    *,
    dtype: Any,
    policy: Policy | str = "fp32",
    platforms: str | Sequence[str] = ("cpu",),
    config: dict | None = None,
) -> pathlib.Path:
    """Writes `model.jaxexport`, `weights.safetensors` and `export.json` (shapes, dtypes, how to call) to
    `out_dir`; returns it. `config` is kept in the weights file's header and in export.json."""
    import jax

    out = pathlib.Path(out_dir)
    check_platforms(platforms)
    check_out_dir(out, config)
    exported = _export(model, params, model_state, example_shape, dtype, policy, platforms)
    make_dirs(out)
    data = bytes(exported.serialize())
    write_bytes_atomic(out / EXPORT_FILE, data)
    save_safetensors(params, out / WEIGHTS_FILE, model_state=model_state, config=config)
    info = {
        "call": CALL,
        "export_file": EXPORT_FILE,
        "weights_file": WEIGHTS_FILE,
        "input": _aval_json(exported.in_avals[-1]),
        "output": _aval_json(exported.out_avals[0]),
        "platforms": list(exported.platforms),
        "policy": policy if isinstance(policy, str) else policy.name,
        "jax_version": jax.__version__,
        "calling_convention_version": exported.calling_convention_version,
        "num_weights": len(exported.in_avals) - 1,
        "config": config,
    }
    write_json_atomic(out / INFO_FILE, info)  # last: a directory with export.json is complete
    return out


def check_out_dir(out: pathlib.Path, config: dict | None) -> None:
    """Refuses (RunDirError) an output folder holding another export or foreign files; see the module doc. A
    temporary file a killed export left (`.<name>.tmp-<pid>` of a process that is gone) is removed."""
    check_writable(out)
    files = (EXPORT_FILE, WEIGHTS_FILE, INFO_FILE)
    check_export_dir(out, config, files, info_file=INFO_FILE, config_key=CONFIG_KEY)
    for name in files:
        for leftover in out.glob(f".{name}.tmp-*") if out.is_dir() else ():
            pid = leftover.name.rpartition("-")[2]
            if pid.isdigit() and not pid_alive(int(pid)):
                leftover.unlink(missing_ok=True)


def _aval_json(aval: Any) -> dict[str, Any]:
    # A symbolic dimension prints as its name ("b").
    return {"shape": [d if isinstance(d, int) else str(d) for d in aval.shape], "dtype": str(aval.dtype)}


# --- jaxnn train runs -------------------------------------------------------------------------------------------


def example_input(config: dict, run_dir: str | os.PathLike[str] | None = None) -> tuple[tuple[int, ...], str]:
    """`(shape without the batch axis, dtype)` of one model input for a `jaxnn train` run's config.

    gpt: `(seq_len,)` int32 byte ids. Images: float32 channels-last, by data set; for `--dataset auto` with a data
    directory, the name recorded in the run's summary.json, else the format of that directory if it still exists.
    """
    if config.get("model") == "gpt":
        from jaxnn.models.factory import model_from_record

        return (model_from_record(config)[1].seq_len,), "int32"
    name = _dataset_name(config, run_dir)
    if name not in IMAGE_SHAPES:
        raise ValueError(f"cannot tell the input shape of data set {name!r}; known: {sorted(IMAGE_SHAPES)}")
    return IMAGE_SHAPES[name], "float32"


def _dataset_name(config: dict, run_dir: str | os.PathLike[str] | None) -> str:
    dataset, data_dir = config.get("dataset", "auto"), config.get("data_dir")
    if dataset != "auto":
        return str(dataset)
    if not data_dir:
        return "digits"  # what `auto` trains on without a data directory
    # jaxnn.fit names the run "<model>/<data set>" in summary.json.
    summary = pathlib.Path(run_dir) / "summary.json" if run_dir is not None else None
    if summary is not None and summary.is_file():
        with open(summary) as f:
            name = str(json.load(f).get("name", "")).rpartition("/")[2]
        if name in IMAGE_SHAPES:
            return name
    from jaxnn.data import detect_format

    return detect_format(data_dir)  # a DataError (ValueError) names a directory that is gone


def export_run(
    run_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    platforms: str | Sequence[str] = ("cpu",),
    step: int | None = None,
    safetensors_only: bool = False,
) -> pathlib.Path:
    """Exports the newest (or `step`'s) checkpoint of a `jaxnn train` run: `write_export`, or with
    `safetensors_only` just `weights.safetensors`; LoRA adapters are merged into their weights. Bad input (no run,
    not a built-in model) raises ValueError."""
    from jaxnn.checkpoint import load_params
    from jaxnn.lora import merge
    from jaxnn.models.factory import model_from_record

    loaded = load_params(run_dir, step=step)
    loaded = loaded._replace(params=merge(loaded.params))
    config = {**loaded.config, "step": loaded.step}  # the run config, and which checkpoint this is
    out = pathlib.Path(out_dir)
    check_out_dir(out, config)
    if safetensors_only:  # needs no model, so it also serves runs of `jaxnn.fit` with a custom one
        make_dirs(out)
        save_safetensors(loaded.params, out / WEIGHTS_FILE, model_state=loaded.model_state, config=config)
        return out
    model, _ = model_from_record(loaded.config)
    shape, dtype = example_input(loaded.config, run_dir)
    check_fits(model, loaded.params, shape)
    return write_export(
        out,
        model,
        loaded.params,
        loaded.model_state,
        shape,
        dtype=dtype,
        policy=loaded.config.get("precision", "fp32"),
        platforms=platforms,
        config=config,
    )


def check_fits(model: Layer, params: Any, example_shape: tuple[int, ...]) -> None:
    """Refuses a checkpoint whose parameter shapes differ from the model's for this input (a wrong image shape)."""
    import jax

    from jaxnn.layers.core import init_model

    expected = jax.eval_shape(lambda key: init_model(model, key, (1, *example_shape))[1], jax.random.key(0))
    if pytree.shapes(expected) != pytree.shapes(params):
        raise ValueError(
            f"the checkpoint's parameters do not fit the rebuilt model for inputs of shape {example_shape}"
        )
