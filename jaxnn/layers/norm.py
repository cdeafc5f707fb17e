"""LayerNorm, RMSNorm, BatchNorm, GroupNorm and InstanceNorm, channels (features) last. Statistics are always
computed in float32, whatever the compute dtype."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.nn import initializers

from jaxnn.layers.core import (
    InitFn,
    Layer,
    LayerError,
    Params,
    Shape,
    along_last_axis,
    check_keywords,
    check_params,
    check_positive,
    describe,
    shape_error,
)
from jaxnn.precision import accumulation_dtype

_FEATURES = "of rank >= 1 with a positive last (feature) axis"
_SPATIAL = "of rank >= 3 (batch, spatial..., channels) with a positive channel axis"
_GROUPED = "of rank >= 2 (batch, ..., channels) with a positive channel axis"


def _check_eps(layer: str, eps: float) -> None:
    if not eps > 0:
        raise ValueError(f"{layer}: eps must be positive, got {eps!r}")


def _check_shape(name: str, shape: Shape, min_rank: int, expected: str) -> None:
    if len(shape) < min_rank or shape[-1] <= 0:
        raise shape_error(name, expected, shape)


def _feature_init(
    name: str,
    scale_init: initializers.Initializer,
    bias_init: initializers.Initializer | None,
    min_rank: int = 1,
    expected: str = _FEATURES,
) -> InitFn:
    """Per-feature `scale` (and `bias` unless `bias_init` is None) over the last axis."""

    def init(key, in_shape):
        _check_shape(name, in_shape, min_rank, expected)
        features = (in_shape[-1],)
        key_scale, key_bias = jax.random.split(key)
        params = {"scale": scale_init(key_scale, features, jnp.float32)}
        if bias_init is not None:
            params["bias"] = bias_init(key_bias, features, jnp.float32)
        return tuple(in_shape), params

    return init


def _check_apply(
    name: str, params: Params, x: Any, kwargs: dict[str, Any], names: tuple[str, ...], min_rank: int, expected: str
) -> None:
    """Refuses unknown keywords, an input of the wrong rank, and params made for another number of features."""
    check_keywords(name, kwargs)
    shape = tuple(jnp.shape(x))
    _check_shape(name, shape, min_rank, expected)
    check_params(name, params, dict.fromkeys(names, (shape[-1],)))


def _scale_and_shift(y32: jax.Array, params: Params, dtype: Any) -> jax.Array:
    y32 = y32 * along_last_axis(params["scale"], y32.ndim)
    if "bias" in params:
        y32 = y32 + along_last_axis(params["bias"], y32.ndim)
    return y32.astype(dtype)


def _normalise(x32: jax.Array, axes: tuple[int, ...], eps: float) -> jax.Array:
    mean = jnp.mean(x32, axis=axes, keepdims=True)
    centred = x32 - mean
    return centred * lax.rsqrt(jnp.mean(jnp.square(centred), axis=axes, keepdims=True) + eps)


@describe
def LayerNorm(
    eps: float = 1e-6,
    name: str = "layer_norm",
    *,
    scale_init: initializers.Initializer = initializers.ones,
    bias_init: initializers.Initializer = initializers.zeros,
) -> Layer:
    """Normalises each feature vector (last axis) to zero mean and unit variance, then scales and shifts."""
    _check_eps("LayerNorm", eps)

    def apply(params, x, **kwargs):
        _check_apply(name, params, x, kwargs, ("scale", "bias"), 1, _FEATURES)
        return _scale_and_shift(_normalise(x.astype(accumulation_dtype(x.dtype)), (-1,), eps), params, x.dtype)

    return Layer(_feature_init(name, scale_init, bias_init), apply, name)


@describe
def RMSNorm(
    eps: float = 1e-6,
    name: str = "rms_norm",
    *,
    scale_init: initializers.Initializer = initializers.ones,
) -> Layer:
    """Divides each feature vector by its root mean square, then scales (no mean, no shift)."""
    _check_eps("RMSNorm", eps)

    def apply(params, x, **kwargs):
        _check_apply(name, params, x, kwargs, ("scale",), 1, _FEATURES)
        x32 = x.astype(accumulation_dtype(x.dtype))
        y = x32 * lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
        return (y * along_last_axis(params["scale"], x.ndim)).astype(x.dtype)

    return Layer(_feature_init(name, scale_init, None), apply, name)


@describe
def BatchNorm(
    momentum: float = 0.99,
    eps: float = 1e-5,
    axis_name: str | None = None,
    name: str = "batch_norm",
    *,
    scale_init: initializers.Initializer = initializers.ones,
    bias_init: initializers.Initializer = initializers.zeros,
) -> Layer:
    """Normalises each channel (last axis) over the batch and spatial axes.

    State: `{"mean", "var"}` running averages, updated in train mode as
    `running = momentum * running + (1 - momentum) * batch_stat`; eval mode normalises with them.
    Two conventions differ from PyTorch's (they are flax's and Keras'):
    - `momentum` is the weight of the old running value: PyTorch's momentum=0.1 is momentum=0.9 here;
    - the running variance is updated with the biased batch variance (divided by the count n, the same one the
      batch is normalised with); PyTorch updates its running estimate with the unbiased one (divided by n - 1).
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

    def apply(params, x, *, state=None, train=False, **kwargs):
        _check_apply(name, params, x, kwargs, ("scale", "bias"), 1, _FEATURES)
        if state is None:
            raise LayerError(name, "apply needs state= (from init_state or the previous apply)")
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

    return Layer(_feature_init(name, scale_init, bias_init), apply, name, init_state)


@describe
def GroupNorm(
    num_groups: int | None = 32,
    *,
    group_size: int | None = None,
    eps: float = 1e-6,
    scale_init: initializers.Initializer = initializers.ones,
    bias_init: initializers.Initializer = initializers.zeros,
    name: str = "group_norm",
) -> Layer:
    """Splits the channels (last axis) into groups and normalises each group of each sample over all its non-batch
    axes (as flax.linen.GroupNorm), then scales and shifts per channel. Takes any rank >= 2, channels last.

    `group_size`: channels per group instead of a number of groups (then leave `num_groups` at its default or None).
    The channels must divide into the groups; other inputs are refused at init and apply.
    """
    _check_eps("GroupNorm", eps)
    if group_size is not None:
        check_positive("GroupNorm", group_size=group_size)
        if num_groups not in (None, 32):
            raise ValueError(f"GroupNorm: give num_groups or group_size, not both (got {num_groups}, {group_size})")
        divisor, what = group_size, f"group_size {group_size}"
    else:
        if num_groups is None:
            raise ValueError("GroupNorm: give num_groups or group_size")
        check_positive("GroupNorm", num_groups=num_groups)
        divisor, what = num_groups, f"num_groups {num_groups}"
    feature_init = _feature_init(name, scale_init, bias_init, 2, _GROUPED)

    def check_groups(shape):
        if shape[-1] % divisor:
            raise shape_error(name, f"with channels divisible by {what}", shape)

    def init(key, in_shape):
        out_shape, params = feature_init(key, in_shape)
        check_groups(out_shape)
        return out_shape, params

    def apply(params, x, **kwargs):
        _check_apply(name, params, x, kwargs, ("scale", "bias"), 2, _GROUPED)
        check_groups(x.shape)
        channels = x.shape[-1]
        groups = channels // group_size if group_size is not None else num_groups
        grouped = x.astype(accumulation_dtype(x.dtype)).reshape(*x.shape[:-1], groups, channels // groups)
        axes = (*range(1, grouped.ndim - 2), grouped.ndim - 1)
        return _scale_and_shift(_normalise(grouped, axes, eps).reshape(x.shape), params, x.dtype)

    return Layer(init, apply, name)


@describe
def InstanceNorm(
    eps: float = 1e-6,
    *,
    scale_init: initializers.Initializer = initializers.ones,
    bias_init: initializers.Initializer = initializers.zeros,
    name: str = "instance_norm",
) -> Layer:
    """Normalises each channel of each sample over the spatial axes (as flax.linen.InstanceNorm), then scales and
    shifts per channel. Input (batch, spatial..., channels), rank >= 3."""
    _check_eps("InstanceNorm", eps)

    def apply(params, x, **kwargs):
        _check_apply(name, params, x, kwargs, ("scale", "bias"), 3, _SPATIAL)
        axes = tuple(range(1, x.ndim - 1))
        return _scale_and_shift(_normalise(x.astype(accumulation_dtype(x.dtype)), axes, eps), params, x.dtype)

    return Layer(_feature_init(name, scale_init, bias_init, 3, _SPATIAL), apply, name)
