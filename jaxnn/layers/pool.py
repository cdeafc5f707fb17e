"""Max, average and global average pooling over the spatial axes of channels-last inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxnn.layers.core import Layer, check_positive, shape_error
from jaxnn.precision import accumulation_dtype


def _pool(kind: str, reducer, init_value, window, strides, padding, name):
    window = (window, window) if isinstance(window, int) else tuple(window)
    strides = window if strides is None else ((strides,) * len(window) if isinstance(strides, int) else tuple(strides))
    check_positive(kind, **{f"window[{i}]": w for i, w in enumerate(window)},
                   **{f"strides[{i}]": s for i, s in enumerate(strides)})
    if padding not in ("SAME", "VALID"):
        raise ValueError(f"{kind}: unknown padding mode {padding!r}; choose 'SAME' or 'VALID'")
    rank = len(window)
    dims, steps = (1, *window, 1), (1, *strides, 1)

    def reduce(x):
        return lax.reduce_window(x, init_value(x.dtype), reducer, dims, steps, padding)

    def init(key, in_shape):
        if len(in_shape) != rank + 2:
            raise shape_error(name, f"of rank {rank + 2} (batch, {rank} spatial axes, channels)", in_shape)
        if padding == "VALID" and any(d < w for d, w in zip(in_shape[1:-1], window)):
            raise shape_error(name, f"with spatial sizes >= window {window}", in_shape)
        out = jax.eval_shape(reduce, jax.ShapeDtypeStruct(tuple(max(d, 1) for d in in_shape), jnp.float32))
        return (in_shape[0], *out.shape[1:]), {}

    return reduce, init


def MaxPool(window=2, strides=None, padding: str = "VALID", name: str = "max_pool") -> Layer:
    """Maximum over windows (strides default to the window: non-overlapping)."""
    reduce, init = _pool("MaxPool", lax.max, lambda dt: -jnp.inf, window, strides, padding, name)
    return Layer(init, lambda params, x, **_: reduce(x), name)


def AvgPool(window=2, strides=None, padding: str = "VALID", name: str = "avg_pool") -> Layer:
    """Mean over windows; with SAME padding, border windows average only the real elements."""
    reduce, init = _pool("AvgPool", lax.add, lambda dt: 0.0, window, strides, padding, name)

    def apply(params, x, **_):
        acc = accumulation_dtype(x.dtype)
        sums = reduce(x.astype(acc))
        counts = reduce(jnp.ones((1, *x.shape[1:-1], 1), acc))
        return (sums / counts).astype(x.dtype)

    return Layer(init, apply, name)


def GlobalAvgPool(name: str = "global_avg_pool") -> Layer:
    """Mean over every spatial axis: (N, ..., C) -> (N, C), summed in float32."""

    def init(key, in_shape):
        if len(in_shape) < 3:
            raise shape_error(name, "of rank >= 3 (batch, spatial..., channels)", in_shape)
        return (in_shape[0], in_shape[-1]), {}

    def apply(params, x, **_):
        return jnp.mean(x, axis=tuple(range(1, x.ndim - 1)), dtype=accumulation_dtype(x.dtype)).astype(x.dtype)

    return Layer(init, apply, name)
