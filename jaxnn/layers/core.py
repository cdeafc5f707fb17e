"""The Layer type and the combinators that make whole models out of layers.

A layer is a pair of pure functions (stax-style) plus a name:

    init(key, in_shape) -> (out_shape, params)
    apply(params, x, *, key=None, train=False, state=None, policy=None) -> y            (stateless layer)
    apply(params, x, *, key=None, train=False, state=...,  policy=None) -> (y, state)   (stateful layer)

How state and randomness travel (the one uniform rule of this module):
- `params` are what the optimiser updates: a dict with stable, readable names (`{"w": ..., "b": ...}`).
- `state` is what a layer updates itself in training (BatchNorm's running statistics). A layer is stateful when
  `layer.init_state` is not None; then `init_state(in_shape)` builds its state, and `apply` takes `state=` and
  returns `(y, new_state)`. Stateless layers return `y` alone. `run()` gives every layer the `(y, state)` form.
- `key` is an explicit PRNG key for stochastic layers (Dropout); combinators derive one key per child with
  `jax.random.fold_in(key, child_index)`, so adding a layer never changes the randomness of the others.
- `policy` (a `jaxnn.precision.Policy`) says how float32 products are computed; the compute dtype itself is the
  dtype of `x`, because the policy casts inputs and parameters once at the step boundary.
- Combinators store their children's params and state under the keys `"<index>_<name>"`, and leave out children
  that have none, so checkpoints and weight-decay masks can name every array.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, TypeAlias

import jax

from jaxnn.precision import Policy

Shape: TypeAlias = tuple[int, ...]
Params: TypeAlias = Any  # a pytree of arrays: nested dicts with stable names, e.g. {"0_conv": {"w": ..., "b": ...}}
State: TypeAlias = Any  # a pytree of arrays a layer updates itself in training (BatchNorm statistics); {} if none
PRNGKey: TypeAlias = jax.Array  # a typed key (`jax.random.key`) or raw key data


class InitFn(Protocol):
    """`init(key, in_shape) -> (out_shape, params)`: parameters for an input of `in_shape` (batch axis first)."""

    def __call__(self, key: PRNGKey, in_shape: Shape, /) -> tuple[Shape, Params]: ...


class ApplyFn(Protocol):
    """`apply(params, x, *, key, train, state, policy) -> y`, or `(y, state)` for a stateful layer."""

    def __call__(
        self,
        params: Params,
        x: Any,
        /,
        *,
        key: PRNGKey | None = ...,
        train: bool = ...,
        state: State = ...,
        policy: Policy | None = ...,
    ) -> Any: ...


InitStateFn: TypeAlias = Callable[[Shape], State]


class Layer(NamedTuple):
    """A neural-network layer as pure functions; see the module docstring for the calling convention."""

    init: InitFn
    apply: ApplyFn
    name: str
    init_state: InitStateFn | None = None
    children: tuple[Layer, ...] = ()  # a combinator's child layers in order; params keys are "<index>_<name>"

    @property
    def stateful(self) -> bool:
        return self.init_state is not None


def run(
    layer: Layer,
    params: Params,
    x: Any,
    *,
    state: State = None,
    key: PRNGKey | None = None,
    train: bool = False,
    policy: Policy | None = None,
) -> tuple[Any, State]:
    """Applies any layer and returns `(y, state)`, whether or not the layer is stateful."""
    if layer.stateful:
        return layer.apply(params, x, state=state, key=key, train=train, policy=policy)
    return layer.apply(params, x, key=key, train=train, policy=policy), state


def init_model(layer: Layer, key: PRNGKey, in_shape: Shape) -> tuple[Shape, Params, State]:
    """Returns `(out_shape, params, state)` for any layer; `state` is `{}` for stateless models."""
    out_shape, params = layer.init(key, tuple(in_shape))
    state = layer.init_state(tuple(in_shape)) if layer.init_state is not None else {}
    return out_shape, params, state


def output_shape(layer: Layer, in_shape: Shape) -> Shape:
    """The output shape of `layer` for `in_shape`, computed abstractly (no parameter memory is allocated)."""
    shapes: list[Shape] = []

    def init_only(key: PRNGKey) -> Params:
        out_shape, params = layer.init(key, tuple(in_shape))
        shapes.append(out_shape)
        return params

    jax.eval_shape(init_only, jax.random.key(0))
    return shapes[0]


def along_last_axis(v: jax.Array, ndim: int) -> jax.Array:
    """Reshapes a per-feature vector to broadcast explicitly against a rank-`ndim` array (no rank promotion)."""
    return v.reshape((1,) * (ndim - 1) + (-1,))


def shape_error(layer_name: str, expected: str, in_shape: Shape) -> ValueError:
    """The one-line error every layer raises at init for an input shape it cannot take."""
    return ValueError(f"{layer_name}: expected input {expected}, got shape {tuple(in_shape)}")


def check_positive(layer_name: str, **values: int) -> None:
    """Refuses non-positive sizes at construction, naming the argument."""
    for arg, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{layer_name}: {arg} must be a positive integer, got {value!r}")


def _child_keys(layers: Sequence[Layer]) -> list[str]:
    return [f"{i}_{layer.name}" for i, layer in enumerate(layers)]


# The init functions of the layers `parallel` built, held weakly: see `splits_input`.
_PARALLEL_INITS: weakref.WeakSet[InitFn] = weakref.WeakSet()


def splits_input(layer: Layer) -> bool:
    """Whether `layer.children` read the elements of a tuple input (`parallel`) rather than each the output of the
    child before it (`serial`, `residual`)."""
    return bool(layer.children) and layer.init in _PARALLEL_INITS


def _fold(key: PRNGKey | None, i: int) -> PRNGKey | None:
    return None if key is None else jax.random.fold_in(key, i)


def Lambda(fn: Callable[[Any], Any], name: str = "lambda", shape_fn: Callable[[Shape], Shape] | None = None) -> Layer:
    """A parameter-free layer applying `fn(x)`; `shape_fn` maps the input shape (identity by default)."""

    def init(key, in_shape):
        return (shape_fn(in_shape) if shape_fn else tuple(in_shape)), {}

    def apply(params, x, **_):
        return fn(x)

    return Layer(init, apply, name)


def serial(*layers: Layer, name: str = "serial") -> Layer:
    """Composes layers left to right: `serial(f, g)(x) = g(f(x))`. Stateful when any child is."""
    if not layers:
        raise ValueError("serial: needs at least one layer")
    names = _child_keys(layers)

    def init(key, in_shape):
        params, shape = {}, tuple(in_shape)
        for i, (child_name, layer) in enumerate(zip(names, layers)):
            shape, child_params = layer.init(jax.random.fold_in(key, i), shape)
            if jax.tree.leaves(child_params):
                params[child_name] = child_params
        return shape, params

    def init_state(in_shape):
        state, shape = {}, tuple(in_shape)
        for child_name, layer in zip(names, layers):
            if layer.init_state is not None:
                state[child_name] = layer.init_state(shape)
            shape = output_shape(layer, shape)
        return state

    def apply(params, x, *, state=None, key=None, train=False, policy=None):
        new_state = {}
        for i, (child_name, layer) in enumerate(zip(names, layers)):
            child_state = state.get(child_name) if state is not None else None
            x, child_state = run(
                layer, params.get(child_name, {}), x, state=child_state, key=_fold(key, i), train=train, policy=policy
            )
            if layer.stateful:
                new_state[child_name] = child_state
        return (x, new_state) if stateful else x

    stateful = any(layer.stateful for layer in layers)
    return Layer(init, apply, name, init_state if stateful else None, tuple(layers))


def parallel(*layers: Layer, name: str = "parallel") -> Layer:
    """Applies the i-th layer to the i-th element of a tuple input; returns the tuple of outputs."""
    if not layers:
        raise ValueError("parallel: needs at least one layer")
    names = _child_keys(layers)

    def init(key, in_shapes):
        if len(in_shapes) != len(layers) or not all(isinstance(s, (tuple, list)) for s in in_shapes):
            raise ValueError(f"parallel: expected a tuple of {len(layers)} input shapes, got {in_shapes!r}")
        params, out_shapes = {}, []
        for i, (child_name, layer, shape) in enumerate(zip(names, layers, in_shapes)):
            out_shape, child_params = layer.init(jax.random.fold_in(key, i), tuple(shape))
            out_shapes.append(out_shape)
            if jax.tree.leaves(child_params):
                params[child_name] = child_params
        return tuple(out_shapes), params

    def init_state(in_shapes):
        return {
            n: layer.init_state(tuple(s))
            for n, layer, s in zip(names, layers, in_shapes)
            if layer.init_state is not None
        }

    def apply(params, xs, *, state=None, key=None, train=False, policy=None):
        outs, new_state = [], {}
        for i, (child_name, layer, x) in enumerate(zip(names, layers, xs)):
            child_state = state.get(child_name) if state is not None else None
            y, child_state = run(
                layer, params.get(child_name, {}), x, state=child_state, key=_fold(key, i), train=train, policy=policy
            )
            outs.append(y)
            if layer.stateful:
                new_state[child_name] = child_state
        return (tuple(outs), new_state) if stateful else tuple(outs)

    stateful = any(layer.stateful for layer in layers)
    _PARALLEL_INITS.add(init)
    return Layer(init, apply, name, init_state if stateful else None, tuple(layers))


def residual(*layers: Layer, name: str = "residual") -> Layer:
    """`x + serial(*layers)(x)`; the inner layers must keep the shape of `x`."""
    body = serial(*layers, name=name)

    def init(key, in_shape):
        out_shape, params = body.init(key, in_shape)
        if tuple(out_shape) != tuple(in_shape):
            raise ValueError(
                f"{name}: the residual branch maps {tuple(in_shape)} to {tuple(out_shape)}; "
                "it must keep the input shape"
            )
        return out_shape, params

    def apply(params, x, *, state=None, key=None, train=False, policy=None):
        y, new_state = run(body, params, x, state=state, key=key, train=train, policy=policy)
        out = x + y.astype(x.dtype)
        return (out, new_state) if body.stateful else out

    # residual returns the body's params unnested, so the body's children and their keys are its own.
    return Layer(init, apply, name, body.init_state, body.children)
