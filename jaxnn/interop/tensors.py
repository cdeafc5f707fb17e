"""Named tensors in and out of jaxnn parameter trees: reading checkpoint files, and a table of rules that says
which tensor of another library becomes which jaxnn parameter (and back).

A conversion is a list of `Rule`s. Each takes one or more source tensors (by name) to one jaxnn array (by its
path in the params or state tree), with the layout change both ways; `to_jaxnn` checks every source tensor is
there, none is left over and every shape is the one the jaxnn model expects, and names the first that is not.

    rules = [Rule(("fc.weight",), ("params", "3_logits", "w"), transpose, transpose)]
    tree = to_jaxnn(read_tensors("model.safetensors"), rules, expected, source="model.safetensors")
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from jaxnn._src.optional import require
from jaxnn.errors import TensorMismatchError  # noqa: F401 (also importable from here)

Path = tuple[str, ...]  # keys from the root of a nested dict: ("params", "0_embed", "table")


def _alone(array: np.ndarray) -> tuple[np.ndarray, ...]:
    return (array,)


@dataclasses.dataclass(frozen=True)
class Rule:
    """`sources` (tensor names in the other library) -> the jaxnn array at `target`.

    `to_jaxnn(*sources) -> array` and `from_jaxnn(array) -> tuple of sources` are inverse layout changes
    (a transpose, a concatenation of q, k and v, ...)."""

    sources: tuple[str, ...]
    target: Path
    to_jaxnn: Callable[..., np.ndarray] = np.asarray
    from_jaxnn: Callable[[np.ndarray], tuple[np.ndarray, ...]] = _alone

    def __post_init__(self) -> None:
        if not self.sources:
            raise ValueError(f"Rule for {'/'.join(self.target)}: needs at least one source tensor")


def transposed(sources: tuple[str, ...] | str, target: Path) -> Rule:
    """A 2-D weight stored (out, in), as torch.nn.Linear does, for a jaxnn Dense `w` of shape (in, out)."""
    names = (sources,) if isinstance(sources, str) else sources
    return Rule(names, target, lambda a: np.ascontiguousarray(a.T), lambda w: (np.ascontiguousarray(w.T),))


def same(source: str, target: Path) -> Rule:
    """A tensor with the same layout on both sides."""
    return Rule((source,), target)


def concatenated(sources: tuple[str, ...], target: Path, *, transpose: bool) -> Rule:
    """Several (out_i, in) torch weights (or (out_i,) biases) as one jaxnn array, concatenated along its output
    axis: q, k and v projections as jaxnn's fused `qkv` (or k and v as `kv`)."""

    def join(*arrays: np.ndarray) -> np.ndarray:
        return np.concatenate([a.T if transpose else a for a in arrays], axis=-1)

    def split(array: np.ndarray, sizes: list[int]) -> tuple[np.ndarray, ...]:
        parts = np.split(array, np.cumsum(sizes)[:-1], axis=-1)
        return tuple(np.ascontiguousarray(p.T if transpose else p) for p in parts)

    rule = Rule(sources, target, join)
    # The split sizes come from the target's width and the sources' count (q may be wider than k and v).
    return dataclasses.replace(rule, from_jaxnn=lambda a: split(a, _split_sizes(a.shape[-1], len(sources))))


def _split_sizes(total: int, parts: int) -> list[int]:
    if total % parts:
        raise TensorMismatchError(f"cannot split an axis of {total} into {parts} equal parts")
    return [total // parts] * parts


TENSOR_FILE_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")


def is_tensor_file(path: str | os.PathLike) -> bool:
    """Whether `path` is one file of tensors `read_tensors` reads (not a folder or a run directory)."""
    return os.path.isfile(path) and os.fspath(path).endswith(TENSOR_FILE_SUFFIXES)


def read_tensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint: a `.safetensors` file, a sharded Hugging Face folder
    (`model.safetensors.index.json`), a folder holding `model.safetensors`, or a PyTorch `.pt`/`.pth`/`.bin`
    state dict (read with torch, weights only; one wrapped in a training checkpoint or saved from
    `nn.DataParallel` too). bfloat16 tensors stay bfloat16 (ml_dtypes). A file that cannot be read (cut short, of
    another format) is one TensorMismatchError naming it."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return _read_folder(path)
    if not os.path.exists(path):
        raise TensorMismatchError(f"no checkpoint at {path}")
    if path.endswith(".safetensors"):
        from safetensors.numpy import load_file

        with _unreadable(path, "safetensors"):
            return dict(load_file(path))
    if path.endswith((".pt", ".pth", ".bin")):
        return _read_torch(path)
    raise TensorMismatchError(f"{path}: not a checkpoint jaxnn reads (.safetensors, .pt, .pth, .bin or a folder)")


@contextlib.contextmanager
def _unreadable(path: str, kind: str) -> Iterator[None]:
    """Turns a reader's failure on a damaged file (safetensors' and torch's own error types) into one line."""
    try:
        yield
    except TensorMismatchError:
        raise
    except Exception as err:  # noqa: BLE001 - each reader raises its own types for a damaged file
        detail = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
        raise TensorMismatchError(f"{path}: not a readable {kind} file ({detail}); cut short or damaged?") from None


def read_tensor_shapes(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor's name and shape, as zero-strided arrays of that shape (no memory; `np.shape` works),
    read from a checkpoint's headers rather than its data: what a config is inferred from before the weights are
    read once (`read_tensors`). A safetensors file or folder is read from its header; a PyTorch file is memory-mapped
    (its data pages are not read), or loaded whole where its format cannot be mapped."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return {name: t for file in _folder_files(path) for name, t in read_tensor_shapes(file).items()}
    if not path.endswith((".safetensors", ".pt", ".pth", ".bin")):
        raise TensorMismatchError(f"{path}: not a checkpoint jaxnn reads (.safetensors, .pt, .pth, .bin or a folder)")
    if not os.path.exists(path):
        raise TensorMismatchError(f"no checkpoint at {path}")
    if path.endswith(".safetensors"):
        with _unreadable(path, "safetensors"):
            return _safetensors_shapes(path)
    torch = require("torch", "reading a PyTorch .pt/.pth/.bin checkpoint")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # an old (non-zip) file cannot be mapped, or a damaged one: read it whole
        return {name: _shape_only(np.shape(t)) for name, t in _read_torch(path).items()}
    return {name: _shape_only(tuple(t.shape)) for name, t in _state_dict(state, path).items() if hasattr(t, "shape")}


def _safetensors_shapes(path: str) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    with safe_open(path, framework="numpy") as f:
        return {
            name: _shape_only(tuple(f.get_slice(name).get_shape()))
            for name in f.keys()  # noqa: SIM118 - a safetensors file, not a dict
        }


def _shape_only(shape: tuple[int, ...]) -> np.ndarray:
    """An array of `shape` that holds no memory (one zero, broadcast)."""
    return np.broadcast_to(np.zeros((), np.float32), shape)


def _read_folder(folder: str) -> dict[str, np.ndarray]:
    return {name: t for file in _folder_files(folder) for name, t in read_tensors(file).items()}


def _folder_files(folder: str) -> list[str]:
    """The tensor files of a checkpoint folder: a sharded index's shards, or its one weights file."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with _unreadable(index, "sharded index (JSON with a weight_map)"), open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, shard) for shard in shards]
    for candidate in ("model.safetensors", "pytorch_model.bin"):
        if os.path.exists(os.path.join(folder, candidate)):
            return [os.path.join(folder, candidate)]
    raise TensorMismatchError(
        f"{folder}: no weights (model.safetensors, model.safetensors.index.json or pytorch_model.bin)"
    )


def _read_torch(path: str) -> dict[str, np.ndarray]:
    torch = require("torch", "reading a PyTorch .pt/.pth/.bin checkpoint")
    with _unreadable(path, "PyTorch"):
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    state = _state_dict(loaded, path)
    return {name: torch_to_numpy(t) for name, t in state.items() if hasattr(t, "detach")}


# Where training scripts keep the model's state dict inside a checkpoint (Lightning, torchvision's references, ...).
_WRAPPERS = ("state_dict", "model_state_dict", "model", "module")
# Prefixes the wrappers around a model add to every name: nn.DataParallel / DistributedDataParallel, torch.compile.
_PREFIXES = ("module.", "_orig_mod.")


def _state_dict(state: Any, path: str) -> dict:
    """What torch.load gave, as the model's state dict: unwrapped from a training checkpoint ({"state_dict": ...,
    "optimizer": ...}) and without the prefix nn.DataParallel or torch.compile put on every name."""
    for key in _WRAPPERS:
        if isinstance(state, dict) and isinstance(state.get(key), dict) and not _is_tensor_dict(state):
            state = state[key]
    if not isinstance(state, dict) or not _is_tensor_dict(state):
        what = type(state).__name__ if not isinstance(state, dict) else f"dict with keys {sorted(state)[:5]}"
        raise TensorMismatchError(f"{path}: holds a {what}, not a state dict of tensors")
    for prefix in _PREFIXES:
        if state and all(name.startswith(prefix) for name in state):
            state = {name[len(prefix) :]: t for name, t in state.items()}
    return state


def _is_tensor_dict(state: dict) -> bool:
    return bool(state) and all(isinstance(k, str) for k in state) and any(hasattr(v, "shape") for v in state.values())


def torch_to_numpy(tensor: Any) -> np.ndarray:
    """A torch tensor as a numpy array of the same dtype (bfloat16 included, through ml_dtypes)."""
    import ml_dtypes
    import torch

    t = tensor.detach().cpu()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16 of its own: reinterpret the bits
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def to_jaxnn(
    tensors: Mapping[str, np.ndarray],
    rules: Iterable[Rule],
    expected: Mapping[str, Any],
    *,
    source: str,
    ignore: Callable[[str], bool] = lambda name: False,
    dtype: Any = None,
) -> dict[str, Any]:
    """The nested jaxnn tree built from `tensors` by `rules`, checked against `expected` (the same tree of arrays
    or `jax.ShapeDtypeStruct`s, e.g. from `jax.eval_shape` of the model's init). `ignore(name)` marks source
    tensors that are not parameters (buffers such as a causal mask). `dtype`: cast every array (None: keep)."""
    rules = list(rules)
    wanted = {name for rule in rules for name in rule.sources}
    missing = [name for rule in rules for name in rule.sources if name not in tensors]
    if missing:
        raise TensorMismatchError(f"{source}: missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    extra = sorted(name for name in tensors if name not in wanted and not ignore(name))
    if extra:
        raise TensorMismatchError(f"{source}: unexpected tensor {extra[0]!r} ({len(extra)} unexpected in all)")
    tree: dict[str, Any] = {}
    for rule in rules:
        array = rule.to_jaxnn(*(tensors[name] for name in rule.sources))
        want = _lookup(expected, rule.target, source)
        if tuple(array.shape) != tuple(want.shape):
            raise TensorMismatchError(
                f"{source}: {'+'.join(rule.sources)} has shape {tuple(array.shape)} as jaxnn's "
                f"{'/'.join(rule.target)}, which the model needs as {tuple(want.shape)}"
            )
        _store(tree, rule.target, array.astype(dtype or want.dtype))
    unfilled = sorted(set(_paths(expected)) - {rule.target for rule in rules})
    if unfilled:
        raise TensorMismatchError(f"{source}: nothing in the checkpoint fills jaxnn's {'/'.join(unfilled[0])}")
    return tree


def from_jaxnn(
    tree: Mapping[str, Any], rules: Iterable[Rule], *, target: str = "the checkpoint"
) -> dict[str, np.ndarray]:
    """The other library's named tensors from a jaxnn tree, by the same `rules` run backwards. Every array of
    `tree` must have a rule: one without is a TensorMismatchError naming it (`target` names the format), never
    silently left out of the export."""
    rules = list(rules)
    covered = {rule.target for rule in rules}
    orphans = ["/".join(path) for path in _paths(tree) if path not in covered]
    if orphans:
        raise TensorMismatchError(
            f"jaxnn parameter {orphans[0]} has no place in {target} (no conversion rule)"
            + (f", nor {len(orphans) - 1} more" if len(orphans) > 1 else "")
            + "; exporting without it would change the model's outputs"
        )
    out: dict[str, np.ndarray] = {}
    for rule in rules:
        parts = rule.from_jaxnn(np.asarray(_lookup(tree, rule.target, "jaxnn params")))
        out.update(zip(rule.sources, parts))
    return out


def _lookup(tree: Mapping[str, Any], path: Path, source: str) -> Any:
    node: Any = tree
    for depth, key in enumerate(path):
        if not isinstance(node, Mapping) or key not in node:
            raise TensorMismatchError(f"{source}: the jaxnn model has no {'/'.join(path[: depth + 1])}")
        node = node[key]
    return node


def _store(tree: dict[str, Any], path: Path, value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _paths(tree: Mapping[str, Any], prefix: Path = ()) -> list[Path]:
    paths: list[Path] = []
    for key, value in tree.items():
        if isinstance(value, Mapping):
            paths += _paths(value, (*prefix, key))
        else:
            paths.append((*prefix, key))
    return paths


__all__ = [
    "Rule",
    "TensorMismatchError",
    "concatenated",
    "from_jaxnn",
    "is_tensor_file",
    "read_tensor_shapes",
    "read_tensors",
    "same",
    "to_jaxnn",
    "torch_to_numpy",
    "transposed",
]
