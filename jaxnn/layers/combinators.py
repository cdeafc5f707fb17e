"""The combinators that make whole models out of layers: `serial`, `parallel`, `residual` and `Lambda`.

Each follows `jaxnn.layers.core`'s convention: children's params, state and caches are stored under
`"<index>_<name>"` (children without any are left out), each child gets its own key
`jax.random.fold_in(key, index)`, and only the side inputs it reads.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import jax

from jaxnn.layers.core import (
    Cache,
    InitFn,
    Layer,
    LayerError,
    Params,
    PRNGKey,
    Shape,
    State,
    as_child,
    as_layers,
    check_keywords,
    child_keys,
    describe,
    output_shape,
    run,
    run_cached,
    side_inputs_of,
    with_name,
)

# The init functions of the layers `parallel` built, held weakly: see `splits_input`.
_PARALLEL_INITS: weakref.WeakSet[InitFn] = weakref.WeakSet()


def splits_input(layer: Layer) -> bool:
    """Whether `layer.children` read the elements of a tuple input (`parallel`) rather than each the output of the
    child before it (`serial`, `residual`)."""
    return bool(layer.children) and layer.init in _PARALLEL_INITS


def _fold(key: PRNGKey | None, i: int) -> PRNGKey | None:
    return None if key is None else jax.random.fold_in(key, i)


@describe
def Lambda(fn: Callable[[Any], Any], name: str = "lambda", shape_fn: Callable[[Shape], Shape] | None = None) -> Layer:
    """A parameter-free layer applying `fn(x)`; `shape_fn` maps the input shape (identity by default)."""

    def init(key, in_shape):
        return (shape_fn(in_shape) if shape_fn else tuple(in_shape)), {}

    def apply(params, x, **kwargs):
        check_keywords(name, kwargs)
        return fn(x)

    return Layer(init, apply, name)


def _child_params(name: str, params: Params, child_name: str) -> Params:
    if not isinstance(params, dict):
        raise LayerError(name, f"expected params as a dict keyed by child, got {type(params).__name__}")
    return params.get(child_name, {})


def _children(kind: str, layers: tuple) -> tuple[tuple[Layer, ...], list[str], frozenset[str]]:
    """A combinator's checked children, their params keys and the side inputs any of them reads."""
    if not layers:
        raise ValueError(f"{kind}: needs at least one layer")
    checked = as_layers(layers)
    return checked, child_keys(checked), side_inputs_of(checked)


def _init_child(
    params: dict[str, Params], child_name: str, layer: Layer, key: PRNGKey, i: int, in_shape: Shape
) -> Shape:
    """A child's output shape; its params, where it has any, go into `params` under its name."""
    with as_child(child_name, layer):
        out_shape, child_params = layer.init(jax.random.fold_in(key, i), in_shape)
    if jax.tree.leaves(child_params):
        params[child_name] = child_params
    return out_shape


def _apply_child(name, params, state, child_name, layer, i, x, key, train, policy, side) -> tuple[Any, State]:
    """A child's output and new state inside the combinator `name`'s apply: its own params, state and key."""
    child_state = state.get(child_name) if state is not None else None
    p = _child_params(name, params, child_name)
    with as_child(child_name, layer):
        return run(layer, p, x, state=child_state, key=_fold(key, i), train=train, policy=policy, **side)


def _cached_children(name, names, layers, params, x, cache, state, policy, side) -> tuple[Any, Cache]:
    """A serial pass in decoding mode: each child with a cache gets and returns its own; see the module docstring."""
    new_cache = {}
    for child_name, layer in zip(names, layers):
        child_state = state.get(child_name) if state else None
        p = _child_params(name, params, child_name)
        with as_child(child_name, layer):
            x, child_cache = run_cached(layer, p, x, cache.get(child_name), state=child_state, policy=policy, **side)
        if layer.init_cache is not None:
            new_cache[child_name] = child_cache
    return x, new_cache


def _init_children_cache(names, layers, in_shape, max_len, dtype) -> Cache:
    cache, shape = {}, tuple(in_shape)
    for child_name, layer in zip(names, layers):
        if layer.init_cache is not None:
            with as_child(child_name, layer):
                cache[child_name] = layer.init_cache(shape, max_len, dtype)
        shape = output_shape(layer, shape)
    return cache


@describe
def serial(*layers: Layer, name: str = "serial") -> Layer:
    """Composes layers left to right: `serial(f, g)(x) = g(f(x))`. Stateful when any child is; reads the side
    inputs any child reads, and decodes with a cache when any child does."""
    layers, names, side_inputs = _children("serial", layers)

    def init(key, in_shape):
        params: dict[str, Params] = {}
        shape = tuple(in_shape)
        for i, (child_name, layer) in enumerate(zip(names, layers)):
            shape = _init_child(params, child_name, layer, key, i, shape)
        return shape, params

    def init_state(in_shape):
        state, shape = {}, tuple(in_shape)
        for child_name, layer in zip(names, layers):
            if layer.init_state is not None:
                state[child_name] = layer.init_state(shape)
            shape = output_shape(layer, shape)
        return state

    def apply(params, x, *, state=None, key=None, train=False, policy=None, cache=None, **side):
        check_keywords(name, side, side_inputs)
        if cache is not None:
            return _cached_children(name, names, layers, params, x, cache, state, policy, side)
        new_state = {}
        for i, (child_name, layer) in enumerate(zip(names, layers)):
            x, child_state = _apply_child(name, params, state, child_name, layer, i, x, key, train, policy, side)
            if layer.stateful:
                new_state[child_name] = child_state
        return (x, new_state) if stateful else x

    def init_cache(in_shape, max_len, dtype):
        return _init_children_cache(names, layers, in_shape, max_len, dtype)

    stateful = any(layer.stateful for layer in layers)
    decodes = any(layer.init_cache is not None for layer in layers)
    return Layer(
        with_name(name, init),
        with_name(name, apply),
        name,
        init_state if stateful else None,
        tuple(layers),
        side_inputs,
        with_name(name, init_cache) if decodes else None,
    )


@describe
def parallel(*layers: Layer, name: str = "parallel") -> Layer:
    """Applies the i-th layer to the i-th element of a tuple input; returns the tuple of outputs."""
    layers, names, side_inputs = _children("parallel", layers)

    def init(key, in_shapes):
        if len(in_shapes) != len(layers) or not all(isinstance(s, (tuple, list)) for s in in_shapes):
            raise LayerError(name, f"expected a tuple of {len(layers)} input shapes, got {in_shapes!r}")
        params: dict[str, Params] = {}
        out_shapes = [
            _init_child(params, child_name, layer, key, i, tuple(shape))
            for i, (child_name, layer, shape) in enumerate(zip(names, layers, in_shapes))
        ]
        return tuple(out_shapes), params

    def init_state(in_shapes):
        return {
            n: layer.init_state(tuple(s))
            for n, layer, s in zip(names, layers, in_shapes)
            if layer.init_state is not None
        }

    def apply(params, xs, *, state=None, key=None, train=False, policy=None, **side):
        check_keywords(name, side, side_inputs)
        if not isinstance(xs, (tuple, list)) or len(xs) != len(layers):
            raise LayerError(name, f"expected a tuple of {len(layers)} inputs, got {type(xs).__name__}")
        outs, new_state = [], {}
        for i, (child_name, layer, x) in enumerate(zip(names, layers, xs)):
            y, child_state = _apply_child(name, params, state, child_name, layer, i, x, key, train, policy, side)
            outs.append(y)
            if layer.stateful:
                new_state[child_name] = child_state
        return (tuple(outs), new_state) if stateful else tuple(outs)

    stateful = any(layer.stateful for layer in layers)
    init, apply = with_name(name, init), with_name(name, apply)
    _PARALLEL_INITS.add(init)
    return Layer(init, apply, name, init_state if stateful else None, tuple(layers), side_inputs)


@describe
def residual(*layers: Layer, name: str = "residual") -> Layer:
    """`x + serial(*layers)(x)`; the inner layers must keep the shape of `x`."""
    body = serial(*layers, name=name)

    def init(key, in_shape):
        out_shape, params = body.init(key, in_shape)
        if tuple(out_shape) != tuple(in_shape):
            raise LayerError(
                name,
                f"the residual branch maps {tuple(in_shape)} to {tuple(out_shape)}; it must keep the input shape",
            )
        return out_shape, params

    def apply(params, x, *, state=None, cache=None, **kwargs):
        if cache is not None:
            y, cache = run_cached(body, params, x, cache, state=state, **kwargs)
            return x + y.astype(x.dtype), cache
        y, new_state = run(body, params, x, state=state, **kwargs)
        out = x + y.astype(x.dtype)
        return (out, new_state) if body.stateful else out

    # residual returns the body's params unnested, so the body's children and their keys are its own.
    return Layer(
        with_name(name, init),
        with_name(name, apply),
        name,
        body.init_state,
        body.children,
        body.side_inputs,
        body.init_cache,
    )
