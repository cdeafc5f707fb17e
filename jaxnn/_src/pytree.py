"""Parameter trees as flat, readable names (`"0_conv.w"`) and back: the names checkpoints, safetensors files,
partial loads and optimizer masks share."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

SEPARATOR = "."


def is_prng_key(x: Any) -> bool:
    """Whether `x` is an array of typed PRNG keys (`jax.random.key`), which is stored and placed as its raw data."""
    return jnp.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key)


def key_name(key: Any) -> str:
    """One step of a pytree path as text: a dict key, a sequence index or an attribute name."""
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_name(path: Iterable[Any]) -> str:
    """A pytree path as dotted text, e.g. `("0_conv", "w") -> "0_conv.w"` (also how orbax names saved arrays)."""
    return SEPARATOR.join(key_name(k) for k in path)


def flatten(tree: Any) -> dict[str, Any]:
    """`{"0_conv.w": array, ...}` in tree order, for any pytree of arrays."""
    return {path_name(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    """Nested dicts from dotted names (the inverse of `flatten` for the dict trees jaxnn layers use)."""
    tree: dict[str, Any] = {}
    for name, value in flat.items():
        *parents, leaf = name.split(SEPARATOR)
        node = tree
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"unflatten: {name!r} puts an array under {part!r}, which is itself an array")
            node = child
        if leaf in node:
            raise ValueError(f"unflatten: {name!r} is given twice or is also a parent of other names")
        node[leaf] = value
    return tree


def matches(name: str, patterns: Iterable[str]) -> bool:
    """Whether a dotted name matches any shell-style pattern (`"*.w"`, `"0_conv.*"`, `"*logits*"`)."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    """The shape of every leaf by dotted name."""
    return {name: tuple(np.shape(leaf)) for name, leaf in flatten(tree).items()}
