"""Dense, Embedding, Flatten and learned position embeddings."""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.nn import initializers

from jaxnn import fp8, precision
from jaxnn.layers.activation import activation_fn
from jaxnn.layers.core import (
    Layer,
    LayerError,
    LayerTypeError,
    along_last_axis,
    check_float_input,
    check_keywords,
    check_params,
    check_positive,
    describe,
    shape_error,
)
from jaxnn.quantized import dense_product, weight_shape

POSITIONS = frozenset({"positions"})


@describe
def Dense(
    features: int,
    *,
    use_bias: bool = True,
    w_init: initializers.Initializer = initializers.lecun_normal(),
    b_init: initializers.Initializer = initializers.zeros,
    activation: Any = None,
    name: str = "dense",
) -> Layer:
    """Affine map over the last axis: `y = x @ w + b`, `w` of shape (in, features), accumulated in float32;
    then `activation` (a name such as "relu", a parameter-free layer such as `L.Relu`, or a function), which
    adds no parameters.

    Inputs must be floating point: an integer input is refused (normalise images first; ids go to `Embedding`)."""
    check_positive("Dense", features=features)
    act = activation_fn(activation, "Dense")

    def init(key, in_shape):
        if len(in_shape) < 1 or in_shape[-1] <= 0:
            raise shape_error(name, "of rank >= 1 with a positive last axis", in_shape)
        params = {"w": w_init(key, (in_shape[-1], features), jnp.float32)}
        if use_bias:
            params["b"] = b_init(key, (features,), jnp.float32)
        return (*in_shape[:-1], features), params

    def apply(params, x, *, policy=None, **kwargs):
        check_keywords(name, kwargs)
        check_float_input(name, x)
        if x.ndim < 1:
            raise shape_error(name, "of rank >= 1", x.shape)
        bias = {"b": (features,)} if use_bias else {}
        if "w_q" in params:  # a base stored quantised under LoRA (jaxnn.quantized): dequantised for the product
            stored = {**params, "w": jax.ShapeDtypeStruct(weight_shape(params["w_q"]), jnp.float32)}
            check_params(name, stored, {"w": (x.shape[-1], features), **bias})
            y = dense_product(x, params["w_q"], params["w_scale"], policy)
        else:
            check_params(name, params, {"w": (x.shape[-1], features), **bias})
            y = precision.dense(x, params["w"], policy, params.get(fp8.HISTORY_KEY))
        if "lora_a" in params:  # LoRA adapters (jaxnn.lora): the low-rank update on the input's path
            y = y + _low_rank_update(x, params, policy).astype(y.dtype)
        if use_bias:
            y = y + along_last_axis(params["b"].astype(y.dtype), y.ndim)
        return (y if act is None else act(y)).astype(x.dtype)

    return Layer(init, apply, name)


# (dropout rate, PRNG key, counter) while a LoRA model trains with adapter dropout; see `adapter_dropout`.
_ADAPTER_DROPOUT: contextvars.ContextVar[tuple[float, jax.Array, Iterator[int]] | None] = contextvars.ContextVar(
    "jaxnn_adapter_dropout", default=None
)


@contextlib.contextmanager
def adapter_dropout(rate: float, key: jax.Array) -> Iterator[None]:
    """While tracing a model's apply inside this block, every Dense with LoRA adapters drops its adapter input
    with probability `rate` (each Dense its own key, folded from `key`); the base product is untouched.
    A context, not a keyword: the adapters sit inside layers (attention, MLPs) that pass no key to their Dense."""
    token = _ADAPTER_DROPOUT.set((rate, key, itertools.count()))
    try:
        yield
    finally:
        _ADAPTER_DROPOUT.reset(token)


def _low_rank_update(x: jax.Array, params: dict, policy) -> jax.Array:
    """`scale * (x @ a) @ b`: the adapters' share of a LoRA Dense (`a` (in, r), `b` (r, out)), never the
    (in, out) product `a @ b`, so the backward pass holds (batch, r) activations rather than a weight gradient."""
    dropout = _ADAPTER_DROPOUT.get()
    if dropout is not None:
        rate, key, counter = dropout
        keep = jax.random.bernoulli(jax.random.fold_in(key, next(counter)), 1.0 - rate, x.shape)
        x = jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))
    low = precision.dense(x, params["lora_a"], policy)
    update = precision.dense(low.astype(x.dtype), params["lora_b"], policy)
    return update * params["lora_scale"].astype(update.dtype)


def _check_ids(name: str, ids: jax.Array, num_embeddings: int) -> None:
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise LayerTypeError(name, f"expected integer ids, got dtype {ids.dtype}")
    if isinstance(ids, jax.core.Tracer) or ids.size == 0:
        return  # traced ids have no values to check; out-of-range ones give NaN rows (see Embedding)
    values = np.asarray(ids)  # numpy: ids closed over by a jitted function are concrete, jnp.min of them is not
    low, high = int(values.min()), int(values.max())
    if low < 0 or high >= num_embeddings:
        raise LayerError(name, f"ids must be in [0, {num_embeddings}), got values in [{low}, {high}]")


def _take(table: jax.Array, ids: jax.Array) -> jax.Array:
    # Ids past the table's end read NaN rows (the callers map every bad id there).
    return jnp.take(table, ids, axis=0, mode="fill", fill_value=jnp.nan)


def _take_accumulating_in_f32(table: jax.Array, ids: jax.Array) -> jax.Array:
    return _take(table.astype(jnp.float32), ids).astype(table.dtype)


def gather_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """`table[ids]` along the first axis, whose gradient (a scatter-add of the rows' cotangents into the table)
    is summed in float32 on GPUs.

    Why: GPUs add half-precision values to memory with compare-and-swap loops, which serialise on the rows that
    frequent ids hit (the byte of a space in text). Measured on an H200 (docs/performance.md, "GPU"): the bf16
    scatter of a GPT's embedding gradient took 0.41 ms against f32's 0.017 ms on uniformly random ids; on Python
    source, whose bytes repeat far more, the bf16 step of the same GPT took 2.1x fp32's time and 13x its own time
    on random ids, the contended scatter being the likely cause. Upcasting the table first makes the scatter an
    f32 one, for the price of converting the table; on CPUs, which add without atomics, the table stays as is.
    """
    if table.dtype not in (jnp.bfloat16, jnp.float16):
        return _take(table, ids)
    return jax.lax.platform_dependent(
        table, ids, cuda=_take_accumulating_in_f32, rocm=_take_accumulating_in_f32, default=_take
    )


@describe
def Embedding(
    num_embeddings: int,
    features: int,
    *,
    init_scale: float = 1.0,
    embedding_init: initializers.Initializer | None = None,
    name: str = "embed",
) -> Layer:
    """Looks up integer ids in a (num_embeddings, features) table; output shape is in_shape + (features,).

    Ids outside [0, num_embeddings): refused with a `LayerError` when the ids are concrete (eager calls); under
    `jit` the values are unknown at trace time and such an id gives a row of NaNs (jnp.take's fill mode), so a bad
    id shows as a NaN loss rather than silently reading another token's row. `embedding_init` defaults to a normal
    of standard deviation `init_scale`.
    """
    check_positive("Embedding", num_embeddings=num_embeddings, features=features)
    table_init = embedding_init or initializers.normal(stddev=init_scale)

    def init(key, in_shape):
        return (*in_shape, features), {"table": table_init(key, (num_embeddings, features), jnp.float32)}

    def apply(params, ids, **kwargs):
        check_keywords(name, kwargs)
        _check_ids(name, ids, num_embeddings)
        check_params(name, params, {"table": (num_embeddings, features)})
        # jnp.take reads a negative id from the end (numpy's rule) and fills ids >= num_embeddings with NaN; map
        # every out-of-range id to one past the table, so that all of them give NaN rows.
        ids = jnp.where((ids >= 0) & (ids < num_embeddings), ids, num_embeddings)
        return gather_rows(params["table"], ids)

    return Layer(init, apply, name)


@describe
def Reshape(shape: tuple[int, ...], name: str = "reshape") -> Layer:
    """Reshapes each example (every axis but the batch one) to `shape`; one entry may be -1 (inferred), as in
    Keras' Reshape and numpy."""
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
    if not all(isinstance(d, int) and not isinstance(d, bool) and (d > 0 or d == -1) for d in shape) or (
        shape.count(-1) > 1
    ):
        raise ValueError(f"Reshape: shape must be positive sizes with at most one -1, got {shape!r}")

    def target(in_shape):
        size = math.prod(in_shape[1:])
        known = math.prod(d for d in shape if d != -1)
        if (-1 in shape and size % known) or (-1 not in shape and size != known):
            raise shape_error(name, f"whose examples' {size} values fit the shape {shape}", in_shape)
        return tuple(size // known if d == -1 else d for d in shape)

    def init(key, in_shape):
        return (in_shape[0], *target(tuple(in_shape))), {}

    def apply(params, x, **kwargs):
        check_keywords(name, kwargs)
        return x.reshape(x.shape[0], *target(x.shape))

    return Layer(init, apply, name)


@describe
def Flatten(name: str = "flatten") -> Layer:
    """Flattens every axis but the first (batch) one."""

    def init(key, in_shape):
        if len(in_shape) < 2:
            raise shape_error(name, "of rank >= 2 (batch, ...)", in_shape)
        return (in_shape[0], math.prod(in_shape[1:])), {}

    def apply(params, x, **kwargs):
        check_keywords(name, kwargs)
        if x.ndim < 2:
            raise shape_error(name, "of rank >= 2 (batch, ...)", x.shape)
        return x.reshape(x.shape[0], -1)

    return Layer(init, apply, name)


def check_positions(name: str, positions: jax.Array, x_shape: tuple[int, ...]) -> None:
    """Refuses a `positions` side input that is not integer (B, T) for an input of shape (B, T, ...)."""
    if not jnp.issubdtype(positions.dtype, jnp.integer) or positions.shape != tuple(x_shape[:2]):
        raise LayerError(
            name,
            f"positions must be integer of shape {tuple(x_shape[:2])} (batch, time), "
            f"got {positions.dtype} {tuple(positions.shape)}",
        )


@describe
def PositionEmbedding(
    max_len: int,
    *,
    init_scale: float = 0.02,
    embedding_init: initializers.Initializer | None = None,
    name: str = "pos_embed",
) -> Layer:
    """Adds a learned embedding of each position to (B, T, D) inputs, T <= max_len.

    Positions are 0..T-1, or the `positions` side input ((B, T) ints). When decoding with a cache, the positions
    continue from what the cache has seen; a cache longer than the table is refused when it is built."""
    check_positive("PositionEmbedding", max_len=max_len)
    table_init = embedding_init or initializers.normal(init_scale)

    def init(key, in_shape):
        if len(in_shape) != 3 or in_shape[1] > max_len:
            raise shape_error(name, f"of rank 3 (batch, time <= {max_len}, features)", in_shape)
        return tuple(in_shape), {"table": table_init(key, (max_len, in_shape[-1]), jnp.float32)}

    def apply(params, x_BTD, *, positions=None, cache=None, **kwargs):
        check_keywords(name, kwargs)
        if x_BTD.ndim != 3 or (cache is None and positions is None and x_BTD.shape[1] > max_len):
            raise shape_error(name, f"of rank 3 (batch, time <= {max_len}, features)", x_BTD.shape)
        check_params(name, params, {"table": (max_len, x_BTD.shape[-1])})
        T = x_BTD.shape[1]
        if positions is not None:
            check_positions(name, positions, x_BTD.shape)
        elif cache is not None:
            positions = (cache["index"] + jnp.arange(T))[None]
        table = params["table"].astype(x_BTD.dtype)
        pos_emb = table[None, :T] if positions is None else gather_rows(table, positions)
        y = x_BTD + pos_emb
        return y if cache is None else (y, {"index": cache["index"] + T})

    def init_cache(in_shape, cache_len, dtype):
        if cache_len > max_len:
            raise LayerError(
                name, f"decoding {cache_len} positions needs a table of >= {cache_len}, this has {max_len}"
            )
        return {"index": jnp.zeros((), jnp.int32)}

    return Layer(init, apply, name, side_inputs=POSITIONS, init_cache=init_cache)
