"""A model summary table (like Flax's `tabulate` and Keras' `summary`): per layer, the output shape, parameter
count and bytes, and the forward-pass FLOPs that XLA's cost analysis reports; all computed abstractly."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from jaxnn._src.xla_cost import cost_counts
from jaxnn.layers.combinators import splits_input
from jaxnn.layers.core import Layer, Params, State, child_keys, run
from jaxnn.precision import Policy, get_policy

_COLUMNS = ("Layer", "Output shape", "Params", "Param bytes", "FLOPs")
_FOOTNOTE = (
    "FLOPs: XLA cost analysis of each layer compiled alone; the total compiles the whole model, "
    "so fusion can make it differ from the sum."
)


@dataclasses.dataclass(frozen=True)
class SummaryRow:
    """One layer: `path` is its params key ("<index>_<name>", dotted when nested); `flops` is None if unknown."""

    path: str
    out_shape: Any
    params: int
    param_bytes: int
    flops: int | None


@dataclasses.dataclass(frozen=True)
class ModelSummary:
    """The rows of `summary()` and the whole model's totals; `str()` gives the table."""

    name: str
    in_shape: Any
    in_dtype: str
    policy: str
    rows: tuple[SummaryRow, ...]
    out_shape: Any
    total_params: int
    total_bytes: int
    total_flops: int | None

    def __str__(self) -> str:
        return _table(self)


def summary(
    model: Layer,
    in_shape: Sequence[int] | Sequence[Sequence[int]],
    *,
    in_dtype: DTypeLike | None = None,
    policy: Policy | str | None = "fp32",
    depth: int = 1,
    flops: bool = True,
    print_fn: Callable[[str], Any] | None = print,
) -> ModelSummary:
    """Summarises `model` for inputs of `in_shape` (batch dimension included; a tuple of shapes for `parallel`).

    Rows: one per child (`layer.children`) of a `serial`/`residual`/`parallel` model, children that are
    combinators themselves expanded up to `depth` levels (dotted paths); a plain layer, or `depth=0`, gives one
    row. Layers run in eval mode (no key, running BatchNorm statistics). `in_dtype` defaults to the policy's compute
    dtype, or to int32 where the model (a `parallel` branch, for each of its inputs) fails on floats but runs on
    int32 (token ids for an Embedding). Per-row FLOPs come from XLA's cost analysis of that layer
    compiled alone, the total from the whole model compiled as one: fusion, and the additions of `residual`
    (in no row), make the total differ from the sum of the rows. `flops=False` skips the compilations.
    Nothing is allocated: shapes come from `jax.eval_shape`, FLOPs from compiling abstract inputs.
    The table goes through `print_fn` unless it is None.
    """
    _check_args(model, in_shape, depth)
    policy = get_policy(policy)
    in_shape = _as_shape(in_shape)
    params, state = _abstract_init(model, in_shape, policy)
    x = _input_spec(model, in_shape, in_dtype, params, state, policy)
    rows = _rows(model, "", x, params, state, depth, policy, flops)
    out = jax.eval_shape(_forward(model, policy), params, state, x)
    total_flops = _flops(model, params, state, x, policy) if flops else None
    result = ModelSummary(
        model.name,
        in_shape,
        _dtype_names(x),
        policy.name,
        tuple(rows),
        _shapes(out),
        _count(params),
        _nbytes(params),
        total_flops,
    )
    if print_fn is not None:
        print_fn(str(result))
    return result


def _check_args(model, in_shape, depth) -> None:
    if not isinstance(model, Layer):
        raise TypeError(f"summary: model must be a jaxnn Layer, got {type(model).__name__}")
    if not _valid_shape(in_shape):
        raise ValueError(
            f"summary: in_shape must be a tuple of positive ints (batch first), or a tuple of such "
            f"tuples for a parallel model; got {in_shape!r}"
        )
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
        raise ValueError(f"summary: depth must be a non-negative integer, got {depth!r}")


def _valid_shape(shape) -> bool:
    if not isinstance(shape, (tuple, list)) or not shape:
        return False
    if all(isinstance(d, (tuple, list)) for d in shape):
        return all(_valid_shape(s) for s in shape)
    return all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)


def _as_shape(shape):
    if all(isinstance(d, (tuple, list)) for d in shape):
        return tuple(_as_shape(s) for s in shape)
    return tuple(shape)


def named_children(layer: Layer) -> list[tuple[str, Layer]]:
    """`[(params_key, child), ...]` of a combinator, in order; empty for a plain layer."""
    return list(zip(child_keys(layer.children), layer.children))


def _is_shapes(shape) -> bool:
    return all(isinstance(d, tuple) for d in shape)


def _input_spec(model: Layer, in_shape, in_dtype, params, state, policy: Policy):
    """Abstract inputs; float inputs take the compute dtype, as the policy casts them at the step boundary.

    With `in_dtype=None` each input gets the compute dtype, or int32 where the layer that takes it (the model, or
    a `parallel` branch) fails on floats and runs on int32.
    """
    if _is_shapes(in_shape):
        # A tuple input: find the parallel layer that splits it (the first child of a serial takes its input).
        owner = model
        while owner.children and not splits_input(owner):
            params, state, owner = _first_child(owner, params, state)
        if splits_input(owner) and len(owner.children) == len(in_shape):
            return tuple(
                _input_spec(child, s, in_dtype, params.get(key, {}), (state or {}).get(key), policy)
                for (key, child), s in zip(named_children(owner), in_shape)
            )
        return tuple(_input_spec(owner, s, in_dtype or policy.compute_dtype, {}, None, policy) for s in in_shape)
    if in_dtype is None:
        return guess_input(model, in_shape, params, state, policy)
    try:
        dtype = jnp.dtype(in_dtype)
    except TypeError as e:
        raise TypeError(f"summary: in_dtype must be a dtype, got {in_dtype!r}") from e
    if jnp.issubdtype(dtype, jnp.floating):
        dtype = jnp.dtype(policy.compute_dtype)
    return jax.ShapeDtypeStruct(in_shape, dtype)


def _first_child(layer: Layer, params, state):
    key, child = named_children(layer)[0]
    return params.get(key, {}), (state.get(key) if child.stateful and state else None), child


def guess_input(layer: Layer, in_shape: Sequence[int], params: Params, state: State, policy: Policy) -> Any:
    """The compute dtype if `layer` runs on it, else int32 if it runs on that; the compute dtype when neither does
    (the caller's own evaluation then raises the model's error)."""
    candidates = [jax.ShapeDtypeStruct(in_shape, policy.compute_dtype), jax.ShapeDtypeStruct(in_shape, jnp.int32)]
    for x in candidates:
        try:
            jax.eval_shape(_forward(layer, policy), params, state, x)
        except Exception:  # any failure means "not this dtype"; if none fits, the caller re-raises it
            continue
        return x
    return candidates[0]


def _abstract_init(model: Layer, in_shape: Any, policy: Policy) -> tuple[Params, State]:
    params = jax.eval_shape(lambda key: policy.cast_to_param(model.init(key, in_shape)[1]), jax.random.key(0))
    init_state = model.init_state
    state = jax.eval_shape(lambda: init_state(in_shape)) if init_state is not None else {}
    return params, state


def _forward(layer: Layer, policy: Policy):
    def forward(params, state, x):
        return run(layer, policy.cast_to_compute(params), x, state=state, key=None, train=False, policy=policy)[0]

    return forward


def _rows(layer, path, x, params, state, depth, policy, with_flops):
    """The rows for `layer`, its combinator children (and the parts of a `Repeat` or `TransformerBlock`) expanded
    `depth` levels."""
    children = named_children(layer) if depth > 0 else []
    if not children and depth > 0 and layer.expands is not None and not isinstance(x, tuple):
        return _expanded_rows(layer, path, x, params, state, depth, policy, with_flops)
    if not children:
        out = jax.eval_shape(_forward(layer, policy), params, state, x)
        flops = _flops(layer, params, state, x, policy) if with_flops else None
        return [SummaryRow(path or layer.name, _shapes(out), _count(params), _nbytes(params), flops)]
    split = splits_input(layer)
    rows = []
    for i, (key, child) in enumerate(children):
        child_x = x[i] if split else x
        child_state = state.get(key) if child.stateful else None
        child_path = f"{path}.{key}" if path else key
        rows += _rows(child, child_path, child_x, params.get(key, {}), child_state, depth - 1, policy, with_flops)
        if not split:
            x = jax.eval_shape(_forward(child, policy), params.get(key, {}), child_state, x)
    return rows


def _expanded_rows(layer, path, x, params, state, depth, policy, with_flops):
    """The rows of what `layer.expands` says it runs: the same params (a TransformerBlock's sublayers), or one
    copy's of `copies` stacked ones (a Repeat), whose rows count all copies and say "(xN)"."""
    inner, copies = layer.expands(tuple(x.shape))
    if copies == 1:
        return _rows(inner, path, x, params, state, depth, policy, with_flops)
    one = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), tree)  # noqa: E731
    rows = _rows(inner, path or layer.name, x, one(params), one(state) if state else state, depth - 1, policy,
                 with_flops)  # fmt: skip
    return [
        SummaryRow(
            f"{row.path} (x{copies})",
            row.out_shape,
            row.params * copies,
            row.param_bytes * copies,
            None if row.flops is None else row.flops * copies,
        )
        for row in rows
    ]


def _flops(layer: Layer, params, state, x, policy: Policy) -> int | None:
    flops, _ = cost_counts(jax.jit(_forward(layer, policy)).lower(params, state, x).compile())
    return None if flops is None else round(flops)


def _count(tree) -> int:
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


def _nbytes(tree) -> int:
    return sum(math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


def _shapes(out):
    return jax.tree.map(lambda leaf: tuple(leaf.shape), out, is_leaf=lambda v: isinstance(v, jax.ShapeDtypeStruct))


def _dtype_names(x) -> str:
    names = [jnp.dtype(leaf.dtype).name for leaf in jax.tree.leaves(x)]
    return names[0] if len(set(names)) == 1 else str(tuple(names))


def format_bytes(n: int) -> str:
    """`n` bytes in B, KiB, MiB or GiB."""
    size: float = n
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _cells(path, out_shape, params, nbytes, flops) -> tuple[str, ...]:
    return (path, str(out_shape), f"{params:,}", format_bytes(nbytes), "-" if flops is None else f"{flops:,}")


def _table(s: ModelSummary) -> str:
    body = [_cells(r.path, r.out_shape, r.params, r.param_bytes, r.flops) for r in s.rows]
    total = _cells("Total", s.out_shape, s.total_params, s.total_bytes, s.total_flops)
    widths = [max(len(row[i]) for row in (_COLUMNS, *body, total)) for i in range(len(_COLUMNS))]

    def line(cells):
        # Names and shapes read left to right; numbers line up on their last digit.
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    rule = "  ".join("-" * w for w in widths)
    head = f"{s.name}: input {s.in_shape} {s.in_dtype}, policy {s.policy}"
    return "\n".join([head, line(_COLUMNS), rule, *map(line, body), rule, line(total), _FOOTNOTE])
