"""Fine-tuning: load part of a parameter tree into a new model by path patterns, and freeze parameters by path.

loaded = jaxnn.checkpoint.load_params("runs/cnn")                    # params of any jaxnn checkpoint
params, report = load_into(new_params, loaded.params, exclude=["*logits*"])
print(report)                                                         # loaded, kept, unused, mismatched
tx = freeze(optax.adam(1e-3), params, ["0_conv.*"])                   # those parameters never change
jaxnn.fit(new_model, data, params=params, optimizer=tx, ...)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxnn._src.pytree import flatten, matches


class LoadReport(NamedTuple):
    """What `load_into` did, by dotted parameter name."""

    loaded: list[str]  # taken from the source
    kept: list[str]  # left as the target had them: excluded, or absent from the source
    unused: list[str]  # in the source but not wanted, or with no place in the target
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]]  # (name, source shape, target shape): kept

    def __str__(self) -> str:
        lines = [
            f"loaded {len(self.loaded)}, kept {len(self.kept)}, unused {len(self.unused)}, "
            f"shape mismatches {len(self.mismatched)}"
        ]
        lines += [f"  loaded     {name}" for name in self.loaded]
        lines += [f"  kept       {name}" for name in self.kept]
        lines += [f"  unused     {name}" for name in self.unused]
        lines += [f"  mismatched {name}: source {src}, target {dst}" for name, src, dst in self.mismatched]
        return "\n".join(lines)


def load_into(
    target: Any, source: Any, *, include: Iterable[str] = ("*",), exclude: Iterable[str] = (), strict: bool = False
) -> tuple[Any, LoadReport]:
    """`target` with every array whose dotted name matches `include` and not `exclude` taken from `source`.

    Names are the params keys joined by dots (`"0_conv.w"`, patterns like `"*logits*"`, `"3_conv.*"`). A source
    array of another shape is not loaded but reported with both shapes; with `strict=True` any mismatch, or a
    wanted target array missing from the source, raises ValueError instead. Loaded arrays take the target's dtype.
    """
    include, exclude = tuple(include), tuple(exclude)
    wanted = {name for name in flatten(target) if matches(name, include) and not matches(name, exclude)}
    src = flatten(source)
    out, loaded, kept, mismatched = {}, [], [], []
    for name, leaf in flatten(target).items():
        candidate = src.get(name) if name in wanted else None
        if candidate is not None and tuple(jnp.shape(candidate)) != tuple(jnp.shape(leaf)):
            mismatched.append((name, tuple(jnp.shape(candidate)), tuple(jnp.shape(leaf))))
            candidate = None
        if candidate is None:
            kept.append(name)
            out[name] = leaf
        else:
            loaded.append(name)
            out[name] = jnp.asarray(candidate, dtype=jnp.result_type(leaf))
    unused = [name for name in src if name not in loaded]
    report = LoadReport(loaded, kept, unused, mismatched)
    missing = [name for name in kept if name in wanted and name not in src]
    if strict and (mismatched or missing):
        raise ValueError(
            f"load_into: {len(mismatched)} shape mismatches, {len(missing)} wanted arrays missing "
            f"from the source\n{report}"
        )
    return jax.tree.unflatten(jax.tree.structure(target), [out[name] for name in flatten(target)]), report


def path_mask(params: Any, patterns: Iterable[str]) -> Any:
    """A tree of bools shaped like `params`: True where the dotted name matches one of `patterns`."""
    patterns = tuple(patterns)
    flat = {name: matches(name, patterns) for name in flatten(params)}
    return jax.tree.unflatten(jax.tree.structure(params), list(flat.values()))


def freeze(tx: optax.GradientTransformation, params: Any, frozen: Iterable[str]) -> optax.GradientTransformation:
    """`tx` for the parameters not matching `frozen`; those matching get zero updates and no optimizer state.

    An optax `multi_transform` over labels by parameter path, so frozen layers cost no optimizer memory.
    """
    frozen = tuple(frozen)
    if not any(matches(name, frozen) for name in flatten(params)):
        raise ValueError(f"freeze: no parameter matches {list(frozen)}; names look like {list(flatten(params))[:4]}")
    labels = jax.tree.map(lambda is_frozen: "frozen" if is_frozen else "trained", path_mask(params, frozen))
    return optax.multi_transform({"trained": tx, "frozen": optax.set_to_zero()}, labels)


__all__ = ["LoadReport", "freeze", "load_into", "path_mask"]
