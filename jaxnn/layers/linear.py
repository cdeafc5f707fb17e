"""Dense, Embedding and Flatten."""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax.nn import initializers

from jaxnn import precision
from jaxnn.layers.core import Layer, along_last_axis, check_positive, shape_error


def Dense(
    features: int,
    *,
    use_bias: bool = True,
    w_init: initializers.Initializer = initializers.lecun_normal(),
    b_init: initializers.Initializer = initializers.zeros,
    name: str = "dense",
) -> Layer:
    """Affine map over the last axis: `y = x @ w + b`, `w` of shape (in, features), accumulated in float32."""
    check_positive("Dense", features=features)

    def init(key, in_shape):
        if len(in_shape) < 1 or in_shape[-1] <= 0:
            raise shape_error(name, "of rank >= 1 with a positive last axis", in_shape)
        params = {"w": w_init(key, (in_shape[-1], features), jnp.float32)}
        if use_bias:
            params["b"] = b_init(key, (features,), jnp.float32)
        return (*in_shape[:-1], features), params

    def apply(params, x, *, policy=None, **_):
        w = params["w"]
        if x.shape[-1] != w.shape[0]:
            raise shape_error(name, f"with last axis {w.shape[0]}", x.shape)
        y = precision.einsum("mk,kn->mn", x.reshape(-1, w.shape[0]), w.astype(x.dtype), policy)
        y = y.reshape(*x.shape[:-1], w.shape[1])
        if use_bias:
            y = y + along_last_axis(params["b"].astype(y.dtype), y.ndim)
        return y.astype(x.dtype)

    return Layer(init, apply, name)


def Embedding(num_embeddings: int, features: int, *, init_scale: float = 1.0, name: str = "embed") -> Layer:
    """Looks up integer ids in a (num_embeddings, features) table; output shape is in_shape + (features,)."""
    check_positive("Embedding", num_embeddings=num_embeddings, features=features)
    table_init = initializers.normal(stddev=init_scale)

    def init(key, in_shape):
        return (*in_shape, features), {"table": table_init(key, (num_embeddings, features), jnp.float32)}

    def apply(params, ids, **_):
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"{name}: expected integer ids, got dtype {ids.dtype}")
        return jnp.take(params["table"], ids, axis=0)

    return Layer(init, apply, name)


def Flatten(name: str = "flatten") -> Layer:
    """Flattens every axis but the first (batch) one."""

    def init(key, in_shape):
        if len(in_shape) < 2:
            raise shape_error(name, "of rank >= 2 (batch, ...)", in_shape)
        return (in_shape[0], math.prod(in_shape[1:])), {}

    def apply(params, x, **_):
        return x.reshape(x.shape[0], -1)

    return Layer(init, apply, name)


def PositionEmbedding(max_len: int, *, init_scale: float = 0.02, name: str = "pos_embed") -> Layer:
    """Adds a learned embedding of each position to (B, T, D) inputs, T <= max_len."""
    check_positive("PositionEmbedding", max_len=max_len)

    def init(key, in_shape):
        if len(in_shape) != 3 or in_shape[1] > max_len:
            raise shape_error(name, f"of rank 3 (batch, time <= {max_len}, features)", in_shape)
        return tuple(in_shape), {"table": initializers.normal(init_scale)(key, (max_len, in_shape[-1]), jnp.float32)}

    def apply(params, x_BTD, **_):
        return x_BTD + params["table"][None, : x_BTD.shape[1]].astype(x_BTD.dtype)

    return Layer(init, apply, name)
