"""LayerNorm, RMSNorm and BatchNorm. Statistics are always computed in float32, whatever the compute dtype."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxnn.layers.core import Layer, along_last_axis, shape_error
from jaxnn.precision import accumulation_dtype


def _check_eps(layer: str, eps: float) -> None:
    if not eps > 0:
        raise ValueError(f"{layer}: eps must be positive, got {eps!r}")


def _feature_init(name: str, with_bias: bool):
    def init(key, in_shape):
        if len(in_shape) < 1 or in_shape[-1] <= 0:
            raise shape_error(name, "of rank >= 1 with a positive last (feature) axis", in_shape)
        params = {"scale": jnp.ones((in_shape[-1],), jnp.float32)}
        if with_bias:
            params["bias"] = jnp.zeros((in_shape[-1],), jnp.float32)
        return tuple(in_shape), params

    return init


def LayerNorm(eps: float = 1e-6, name: str = "layer_norm") -> Layer:
    """Normalises each feature vector (last axis) to zero mean and unit variance, then scales and shifts."""
    _check_eps("LayerNorm", eps)

    def apply(params, x, **_):
        x32 = x.astype(accumulation_dtype(x.dtype))
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * lax.rsqrt(var + eps) * along_last_axis(params["scale"], x.ndim) + along_last_axis(
            params["bias"], x.ndim
        )
        return y.astype(x.dtype)

    return Layer(_feature_init(name, True), apply, name)


def RMSNorm(eps: float = 1e-6, name: str = "rms_norm") -> Layer:
    """Divides each feature vector by its root mean square, then scales (no mean, no shift)."""
    _check_eps("RMSNorm", eps)

    def apply(params, x, **_):
        x32 = x.astype(accumulation_dtype(x.dtype))
        y = x32 * lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
        return (y * along_last_axis(params["scale"], x.ndim)).astype(x.dtype)

    return Layer(_feature_init(name, False), apply, name)


def BatchNorm(
    momentum: float = 0.99, eps: float = 1e-5, axis_name: str | None = None, name: str = "batch_norm"
) -> Layer:
    """Normalises each channel (last axis) over the batch and spatial axes.

    State: `{"mean", "var"}` running averages, updated in train mode as
    `running = momentum * running + (1 - momentum) * batch_stat`; eval mode normalises with them.
    `axis_name`: inside `shard_map`/`pmap`, average the batch statistics across that device axis
    (cross-replica BatchNorm); None keeps them per device. Under `jax.jit` with a sharded batch the statistics
    are global anyway, because jit computes the mean of the whole logical batch.
    """
    _check_eps("BatchNorm", eps)
    if not 0 <= momentum < 1:
        raise ValueError(f"BatchNorm: momentum must be in [0, 1), got {momentum!r}")

    def init_state(in_shape):
        channels = in_shape[-1]
        return {"mean": jnp.zeros((channels,), jnp.float32), "var": jnp.ones((channels,), jnp.float32)}

    def apply(params, x, *, state=None, train=False, **_):
        if state is None:
            raise ValueError(f"{name}: apply needs state= (from init_state or the previous apply)")
        x32 = x.astype(accumulation_dtype(x.dtype))
        if train:
            axes = tuple(range(x.ndim - 1))
            mean = jnp.mean(x32, axis=axes)
            mean_sq = jnp.mean(jnp.square(x32), axis=axes)
            if axis_name is not None:
                mean, mean_sq = lax.pmean((mean, mean_sq), axis_name)
            var = jnp.maximum(mean_sq - jnp.square(mean), 0.0)
            state = {
                "mean": momentum * state["mean"] + (1 - momentum) * mean,
                "var": momentum * state["var"] + (1 - momentum) * var,
            }
        else:
            mean, var = state["mean"], state["var"]
        scale = lax.rsqrt(var + eps) * params["scale"]
        y = (x32 - along_last_axis(mean, x.ndim)) * along_last_axis(scale, x.ndim) + along_last_axis(
            params["bias"], x.ndim
        )
        return y.astype(x.dtype), state

    return Layer(_feature_init(name, True), apply, name, init_state)
