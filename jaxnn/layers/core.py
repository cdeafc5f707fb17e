"""The Layer type and the calling convention every layer follows; the combinators that make whole models out of
layers (`serial`, `parallel`, `residual`, `Lambda`) are in `jaxnn.layers.combinators`.

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

Side inputs (the second uniform rule): arrays a layer reads besides `x` travel as further keywords of `apply`,
each with one meaning everywhere:
- `mask`: (B, T) bool, True for real positions of `x` (padding mask; attention, recurrent layers);
- `context`: (B, S, Dc) the sequence cross-attention reads keys and values from; `context_mask`: its (B, S) mask;
- `positions`: (B, T) int positions of `x`'s elements (position embeddings, rotary embeddings; default 0..T-1).
A layer lists the side inputs it reads in `layer.side_inputs`; `serial`, `residual`, `parallel` and the stacks
accept the union of their children's and hand each child only those it reads. Every `apply` refuses a keyword it
does not know (a misspelt `trian=True` raises instead of being ignored).

Decoding cache (the third): a layer that can run one position at a time against what it saw before (causal
attention's keys and values) has `init_cache(in_shape, max_len, dtype) -> cache`. `apply(..., cache=cache)` then
takes the next positions of `x` and returns `(y, new_cache)`, stateful or not (decoding is inference: state is read,
not updated). Combinators build and thread their children's caches under the same `"<index>_<name>"` keys.

Errors: a bad input raises `LayerError` (a ValueError; `LayerTypeError` for a wrong dtype) with one line naming the
layer's path in the model (`gpt/3_block/0_attn/1_attention: ...`) and both shapes or dtypes.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol, TypeAlias, TypeVar, cast

import jax

from jaxnn.errors import LayerError, LayerTypeError  # noqa: F401 (also importable from here)
from jaxnn.precision import Policy

Shape: TypeAlias = tuple[int, ...]
Params: TypeAlias = Any  # a pytree of arrays: nested dicts with stable names, e.g. {"0_conv": {"w": ..., "b": ...}}
State: TypeAlias = Any  # a pytree of arrays a layer updates itself in training (BatchNorm statistics); {} if none
PRNGKey: TypeAlias = jax.Array  # a typed key (`jax.random.key`) or raw key data


F = TypeVar("F", bound=Callable[..., Any])


class InitFn(Protocol):
    """`init(key, in_shape) -> (out_shape, params)`: parameters for an input of `in_shape` (batch axis first)."""

    def __call__(self, key: PRNGKey, in_shape: Shape, /) -> tuple[Shape, Params]: ...


class ApplyFn(Protocol):
    """`apply(params, x, *, key, train, state, policy) -> y`, or `(y, state)` for a stateful layer; a layer that
    reads side inputs or decodes with a cache takes those keywords too (see the module docstring)."""

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
Cache: TypeAlias = Any  # a pytree of arrays a decoding layer carries from one call to the next (keys, values, index)
InitCacheFn: TypeAlias = Callable[[Shape, int, Any], Cache]  # (in_shape, max_len, dtype) -> cache

# The keywords every `apply` takes (a layer may ignore some); side inputs come on top (see the module docstring).
STANDARD_KEYWORDS = frozenset({"key", "train", "state", "policy"})
SIDE_INPUTS = frozenset({"mask", "context", "context_mask", "positions"})


class Spec:
    """The call that made a layer: the constructor's import path and its arguments (`describe`). Compared and
    hashed by identity, so a layer stays usable as a static argument of jit whatever its arguments hold."""

    __slots__ = ("path", "args", "kwargs", "made")

    def __init__(self, path: str, args: tuple, kwargs: dict, made: Any = None):
        self.path, self.args, self.kwargs = path, args, kwargs
        # The layer the call returned: a layer changed afterwards (`_replace(apply=...)`) keeps this spec but no
        # longer matches it, and `jaxnn.save_model` refuses it rather than save the unchanged call.
        self.made = made

    def __repr__(self) -> str:
        return f"Spec({self.path})"


class Layer(NamedTuple):
    """A neural-network layer as pure functions; see the module docstring for the calling convention."""

    init: InitFn
    apply: ApplyFn
    name: str
    init_state: InitStateFn | None = None
    children: tuple[Layer, ...] = ()  # a combinator's child layers in order; params keys are "<index>_<name>"
    side_inputs: frozenset[str] = frozenset()  # the side-input keywords `apply` reads (mask, context, positions)
    init_cache: InitCacheFn | None = None  # set when `apply(..., cache=)` decodes position by position
    spec: Spec | None = None  # the call that made it (`describe`), which `jaxnn.save_model` writes down
    # For summaries of layers whose parts are not `children`: `in_shape -> (layer, copies)`, the layer this one
    # runs on that input with the same params (`copies` > 1: stacked on a leading axis, as `Repeat` keeps them).
    expands: Callable[[tuple[int, ...]], tuple[Layer, int]] | None = None

    @property
    def stateful(self) -> bool:
        return self.init_state is not None

    def __call__(self, *args: Any, **kwargs: Any) -> Layer:
        """`L.Relu()` is `L.Relu`: a layer written as if it were a constructor is the layer itself. A layer is
        applied with `layer.apply(params, x)` (or `jaxnn.layers.run`), never by calling it on inputs."""
        if args or kwargs:
            raise TypeError(
                f"{self.name}: a Layer is not called on inputs; use layer.apply(params, x), or init it first "
                "(params = jaxnn.layers.init_model(layer, key, shape)[1])"
            )
        return self


def describe(constructor: F) -> F:
    """Marks a layer constructor: each layer it returns records the call that made it (`Layer.spec`), so a model
    built from such calls can be written down and built again (`jaxnn.save_model`)."""
    path = f"{constructor.__module__}.{constructor.__qualname__}"

    @functools.wraps(constructor)
    def build(*args: Any, **kwargs: Any) -> Layer:
        layer = constructor(*args, **kwargs)
        return layer._replace(spec=Spec(path, args, kwargs, made=layer))

    build.builds_layers = True  # type: ignore[attr-defined]  # what jaxnn.load_model may call
    return build  # type: ignore[return-value]


def check_keywords(layer_name: str, kwargs: dict[str, Any], side_inputs: frozenset[str] = frozenset()) -> None:
    """Refuses keywords an `apply` does not take, naming the layer and what it does take."""
    unknown = sorted(set(kwargs) - STANDARD_KEYWORDS - side_inputs)
    if unknown:
        takes = ", ".join(sorted(STANDARD_KEYWORDS | side_inputs))
        raise LayerTypeError(layer_name, f"apply got unexpected keyword(s) {', '.join(unknown)}; it takes {takes}")


def side_inputs_of(layers: Sequence[Layer]) -> frozenset[str]:
    return frozenset().union(*(layer.side_inputs for layer in layers))


def _for_child(layer: Layer, side: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in side.items() if k in layer.side_inputs}


def run(
    layer: Layer,
    params: Params,
    x: Any,
    *,
    state: State = None,
    key: PRNGKey | None = None,
    train: bool = False,
    policy: Policy | None = None,
    **side: Any,
) -> tuple[Any, State]:
    """Applies any layer and returns `(y, state)`, whether or not the layer is stateful.

    `side` holds side inputs (mask, context, ...); the layer gets those it lists in `layer.side_inputs`."""
    side = _for_child(layer, side)
    if layer.stateful:
        return layer.apply(params, x, state=state, key=key, train=train, policy=policy, **side)
    return layer.apply(params, x, key=key, train=train, policy=policy, **side), state


def run_cached(
    layer: Layer,
    params: Params,
    x: Any,
    cache: Cache,
    *,
    state: State = None,
    policy: Policy | None = None,
    **side: Any,
) -> tuple[Any, Cache]:
    """One decoding call: `(y, new_cache)` from a layer with `init_cache`; a layer without one is applied as is
    (in eval mode) and `cache` comes back unchanged."""
    side = _for_child(layer, side)
    if layer.init_cache is not None:
        kwargs = {"state": state} if layer.stateful else {}
        decode: Callable[..., Any] = layer.apply  # ApplyFn types the standard keywords only; `cache` is the third rule
        return decode(params, x, cache=cache, policy=policy, **kwargs, **side)
    return run(layer, params, x, state=state, policy=policy, **side)[0], cache


def init_cache(layer: Layer, in_shape: Shape, max_len: int, dtype: Any) -> Cache:
    """The decoding cache of `layer` for inputs like `in_shape` (the prompt's) and up to `max_len` positions."""
    if layer.init_cache is None:
        raise LayerError(layer.name, "has no decoding cache (it holds no causal attention); decode without one")
    return layer.init_cache(tuple(in_shape), max_len, dtype)


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


def shape_error(layer_name: str, expected: str, in_shape: Shape) -> LayerError:
    """The one-line error every layer raises (at init and apply) for an input shape it cannot take."""
    return LayerError(layer_name, f"expected input {expected}, got shape {tuple(in_shape)}")


def check_float_input(layer_name: str, x: Any) -> None:
    """Refuses integer or bool inputs to layers whose weights are floats (Dense, Conv): computing in the input's
    dtype would cast the weights to integers and train nothing."""
    dtype = jax.numpy.result_type(x)
    if not jax.numpy.issubdtype(dtype, jax.numpy.inexact):
        raise LayerTypeError(
            layer_name,
            f"expected a floating-point input, got dtype {dtype}; normalise it first, "
            "e.g. x.astype(jnp.float32) / 255 for uint8 images (ids belong in an Embedding)",
        )


def check_params(layer_name: str, params: Params, expected: dict[str, Shape]) -> None:
    """Refuses parameters that are missing or of another shape than the layer (as built) computes with."""
    if not isinstance(params, dict):
        raise LayerError(layer_name, f"expected params as a dict with {sorted(expected)}, got {type(params).__name__}")
    for param_name, shape in expected.items():
        if param_name not in params:
            raise LayerError(
                layer_name, f"params have no {param_name!r} (found {sorted(params)}); were they made for another model?"
            )
        got = tuple(jax.numpy.shape(params[param_name]))
        if got != tuple(shape):
            raise LayerError(layer_name, f"parameter {param_name!r} has shape {got}, this layer needs {tuple(shape)}")


def check_positive(layer_name: str, **values: int) -> None:
    """Refuses non-positive sizes at construction, naming the argument."""
    for arg, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{layer_name}: {arg} must be a positive integer, got {value!r}")


def as_layer(layer: Any, where: str) -> Layer:
    """`layer` as a Layer: itself, or what one of jaxnn's layer constructors whose arguments all have defaults
    makes (`L.Flatten` for `L.Flatten()`); anything else is `check_is_layer`'s one-line TypeError."""
    if not isinstance(layer, Layer) and callable(layer) and is_layer_constructor(layer):
        return layer()
    check_is_layer(layer, where)
    return layer


def is_layer_constructor(fn: Any) -> bool:
    """Whether `fn` is one of jaxnn's layer constructors that can be called without arguments (`L.Flatten`)."""
    import inspect

    if isinstance(fn, type) or not getattr(fn, "__module__", "").startswith("jaxnn.layers"):
        return False
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return all(p.default is not inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               for p in parameters)  # fmt: skip


def as_layers(layers: Sequence[Any]) -> tuple[Layer, ...]:
    """A combinator's children as Layers (`as_layer`), each error naming its position."""
    return tuple(as_layer(layer, f"layer {i}") for i, layer in enumerate(layers))


def child_keys(layers: Sequence[Layer]) -> list[str]:
    """The params keys of a combinator's children, "<index>_<name>"; anything that is not a Layer is refused."""
    for i, layer in enumerate(layers):
        check_is_layer(layer, f"layer {i}")
    return [f"{i}_{layer.name}" for i, layer in enumerate(layers)]


def check_is_layer(layer: Any, where: str) -> None:
    """A TypeError in one line for what is not a `Layer`, with the usual mistakes named: a recurrent cell (it
    runs inside `RNN`), a layer's class or constructor not yet called, a plain function."""
    if isinstance(layer, Layer):
        return
    kind = type(layer).__name__
    if hasattr(layer, "step") and hasattr(layer, "initial_carry"):
        raise TypeError(f"{where}: {kind} is a recurrent cell, which runs one time step; use RNN({kind}(...))")
    name = getattr(layer, "__name__", kind)
    if isinstance(layer, type) or (callable(layer) and getattr(layer, "__module__", "").startswith("jaxnn.")):
        raise TypeError(f"{where}: {name} makes a Layer but is not one; call it: {name}(...)")
    if callable(layer):
        raise TypeError(f"{where}: {name} is a plain function, not a Layer; wrap it: jaxnn.layers.Lambda({name})")
    raise TypeError(f"{where}: a {kind} is not a jaxnn Layer")


@contextlib.contextmanager
def named(name: str) -> Iterator[None]:
    """A `LayerError` raised inside gets `name` in front of its path (unless it starts with it already)."""
    try:
        yield
    except LayerError as err:
        if err.path[0] != name:
            err.path.insert(0, name)
        raise


def with_name(name: str, fn: F) -> F:
    """`fn` (a composite layer's init, apply or init_cache) with its errors' paths starting at `name`."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with named(name):
            return fn(*args, **kwargs)

    return cast(F, wrapped)


@contextlib.contextmanager
def as_child(child_key: str, layer: Layer) -> Iterator[None]:
    """A combinator wraps each child's call: an error path starting with the child's own name starts with its key
    in the parent instead ("1_attention" for "attention"), so paths read like the params tree."""
    try:
        yield
    except LayerError as err:
        if err.path[0] == layer.name:
            err.path[0] = child_key
        else:
            err.path.insert(0, child_key)
        raise
