"""Convolution over 1-D (N, W, C) and 2-D (N, H, W, C) inputs, channels last."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.nn import initializers

from jaxnn.layers.core import Layer, along_last_axis, check_positive, shape_error
from jaxnn.precision import product_kwargs

_DIMENSION_NUMBERS = {1: ("NWC", "WIO", "NWC"), 2: ("NHWC", "HWIO", "NHWC")}
PADDING_MODES = ("SAME", "VALID", "CAUSAL")


def _as_tuple(value, rank: int, arg: str, layer: str) -> tuple[int, ...]:
    values = (value,) * rank if isinstance(value, int) else tuple(value)
    if len(values) != rank:
        raise ValueError(f"{layer}: {arg} needs {rank} values, got {value!r}")
    check_positive(layer, **{f"{arg}[{i}]": v for i, v in enumerate(values)})
    return values


def _normalise_padding(padding, rank: int, kernel: tuple[int, ...], dilation: tuple[int, ...], layer: str):
    """Returns padding in the form lax accepts: "SAME", "VALID", or a list of (low, high) pairs."""
    if isinstance(padding, str):
        mode = padding.upper()
        if mode not in PADDING_MODES:
            raise ValueError(f"{layer}: unknown padding mode {padding!r}; choose one of {PADDING_MODES}, "
                             "an int, or (low, high) pairs")
        if mode == "CAUSAL":
            if rank != 1:
                raise ValueError(f"{layer}: CAUSAL padding is for 1-D convolutions only")
            return [((kernel[0] - 1) * dilation[0], 0)]
        return mode
    if isinstance(padding, int):
        padding = [(padding, padding)] * rank
    pairs = [tuple(p) for p in padding]
    if len(pairs) != rank or any(len(p) != 2 or min(p) < 0 for p in pairs):
        raise ValueError(f"{layer}: padding must be {rank} non-negative (low, high) pairs, got {padding!r}")
    return pairs


def Conv(features: int, kernel_size: int | Sequence[int], *, strides=1, padding="SAME", dilation=1,
         feature_group_count: int = 1, use_bias: bool = True, w_init=initializers.lecun_normal(),
         b_init=initializers.zeros, name: str = "conv") -> Layer:
    """Convolution with channels last; the rank (1 or 2) is the length of `kernel_size` (an int means 2-D).

    `w` has shape kernel_size + (in_channels // feature_group_count, features); products accumulate in float32.
    """
    check_positive("Conv", features=features, feature_group_count=feature_group_count)
    kernel = (kernel_size, kernel_size) if isinstance(kernel_size, int) else tuple(kernel_size)
    rank = len(kernel)
    if rank not in _DIMENSION_NUMBERS:
        raise ValueError(f"Conv: kernel_size must have 1 or 2 entries, got {kernel_size!r}")
    kernel = _as_tuple(kernel, rank, "kernel_size", "Conv")
    strides = _as_tuple(strides, rank, "strides", "Conv")
    dilation = _as_tuple(dilation, rank, "dilation", "Conv")
    pad = _normalise_padding(padding, rank, kernel, dilation, "Conv")
    if features % feature_group_count:
        raise ValueError(f"Conv: features {features} is not divisible by feature_group_count {feature_group_count}")
    dimension_numbers = _DIMENSION_NUMBERS[rank]

    def conv(x, w, policy=None):
        return lax.conv_general_dilated(x, w, strides, pad, rhs_dilation=dilation,
                                        dimension_numbers=dimension_numbers,
                                        feature_group_count=feature_group_count, **product_kwargs(x.dtype, policy))

    def init(key, in_shape):
        expected = f"of rank {rank + 2} ({dimension_numbers[0]})"
        if len(in_shape) != rank + 2:
            raise shape_error(name, expected, in_shape)
        channels = in_shape[-1]
        if channels % feature_group_count:
            raise shape_error(name, f"with channels divisible by feature_group_count {feature_group_count}", in_shape)
        w_shape = (*kernel, channels // feature_group_count, features)
        x_spec = jax.ShapeDtypeStruct(tuple(max(d, 1) for d in in_shape), jnp.float32)
        try:
            out = jax.eval_shape(conv, x_spec, jax.ShapeDtypeStruct(w_shape, jnp.float32))
        except TypeError as err:
            raise shape_error(name, f"large enough for kernel {kernel} with dilation {dilation}", in_shape) from err
        if min(out.shape[1:-1]) <= 0:
            raise shape_error(name, f"large enough for kernel {kernel} with dilation {dilation}", in_shape)
        params = {"w": w_init(key, w_shape, jnp.float32)}
        if use_bias:
            params["b"] = b_init(key, (features,), jnp.float32)
        return (in_shape[0], *out.shape[1:]), params

    def apply(params, x, *, policy=None, **_):
        y = conv(x, params["w"].astype(x.dtype), policy)
        if use_bias:
            y = y + along_last_axis(params["b"].astype(y.dtype), y.ndim)
        return y.astype(x.dtype)

    return Layer(init, apply, name)
