"""Max, average and global average pooling over the spatial axes of channels-last inputs."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
from jax import lax

from jaxnn.layers.core import InitFn, Layer, Shape, check_keywords, check_positive, describe, shape_error
from jaxnn.precision import accumulation_dtype

# "SAME", "VALID", or one (low, high) pair per spatial axis (torch's symmetric padding=p is (p, p) per axis).
PoolPadding: TypeAlias = str | Sequence[tuple[int, int]]


def _pool_padding(kind: str, padding: PoolPadding, window: tuple[int, ...]) -> str | tuple[tuple[int, int], ...]:
    """The padding as a mode or checked (low, high) pairs. Each pad must be smaller than the window, so that every
    window holds at least one real element (a max over padding alone would be -inf, an average would divide by 0);
    torch refuses pads over half the window, which this allows."""
    if isinstance(padding, str):
        if padding not in ("SAME", "VALID"):
            raise ValueError(f"{kind}: unknown padding mode {padding!r}; choose 'SAME', 'VALID' or (low, high) pairs")
        return padding
    pairs = tuple(_int_pair(p) for p in padding) if isinstance(padding, Sequence) else ()
    if not pairs or None in pairs:
        raise ValueError(f"{kind}: padding must be 'SAME', 'VALID' or (low, high) pairs of ints, got {padding!r}")
    if len(pairs) != len(window):
        raise ValueError(f"{kind}: padding needs {len(window)} (low, high) pairs, one per axis, got {padding!r}")
    checked = tuple(p for p in pairs if p is not None)
    for axis, ((low, high), w) in enumerate(zip(checked, window)):
        if not (0 <= low < w and 0 <= high < w):
            raise ValueError(f"{kind}: padding {(low, high)} of axis {axis} must be >= 0 and < the window {w}")
    return checked


def _int_pair(pair: Any) -> tuple[int, int] | None:
    """`pair` as a (low, high) tuple when it is two ints (bools and floats are not), else None."""
    if not isinstance(pair, Sequence) or len(pair) != 2:
        return None
    if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in pair):
        return None
    return int(pair[0]), int(pair[1])


def _pool(
    kind: str,
    reducer: Callable[[Any, Any], Any],
    init_value: Callable[[Any], float],
    window: int | Sequence[int],
    strides: int | Sequence[int] | None,
    padding: PoolPadding,
    name: str,
) -> tuple[
    Callable[[jax.Array], jax.Array], InitFn, Callable[[Any, dict[str, Any]], None], tuple[int, ...], tuple[int, ...]
]:
    """The windowed reduction, its init, the check every apply makes first, and the window and strides."""
    window = (window, window) if isinstance(window, int) else tuple(window)
    strides = window if strides is None else ((strides,) * len(window) if isinstance(strides, int) else tuple(strides))
    check_positive(
        kind, **{f"window[{i}]": w for i, w in enumerate(window)}, **{f"strides[{i}]": s for i, s in enumerate(strides)}
    )
    pad = _pool_padding(kind, padding, window)
    rank = len(window)
    dims, steps = (1, *window, 1), (1, *strides, 1)
    window_pad = pad if isinstance(pad, str) else ((0, 0), *pad, (0, 0))

    def reduce(x):
        return lax.reduce_window(x, init_value(x.dtype), reducer, dims, steps, window_pad)

    def check_shape(in_shape: Shape) -> None:
        if len(in_shape) != rank + 2:
            raise shape_error(name, f"of rank {rank + 2} (batch, {rank} spatial axes, channels)", in_shape)
        if pad == "VALID" and any(d < w for d, w in zip(in_shape[1:-1], window)):
            raise shape_error(name, f"with spatial sizes >= window {window}", in_shape)
        if not isinstance(pad, str) and any(d + lo + hi < w for d, (lo, hi), w in zip(in_shape[1:-1], pad, window)):
            raise shape_error(name, f"with spatial sizes + padding {list(pad)} >= window {window}", in_shape)

    def init(key, in_shape):
        check_shape(tuple(in_shape))
        out = jax.eval_shape(reduce, jax.ShapeDtypeStruct(tuple(max(d, 1) for d in in_shape), jnp.float32))
        return (in_shape[0], *out.shape[1:]), {}

    def check_apply(x: Any, kwargs: dict[str, Any]) -> None:
        check_keywords(name, kwargs)
        check_shape(tuple(jnp.shape(x)))

    return reduce, init, check_apply, window, strides


MAX_POOL_LOWERINGS = ("auto", "reduce_window", "reshape")


def _max_over_tiles(x, window, padding):
    """Non-overlapping max pool as a reshape and a max: (N, H, W, C) -> (N, H/2, 2, W/2, 2, C) -> max over the 2s.

    VALID crops the rows/columns no window covers; SAME pads with -inf the way XLA's SAME does (the smaller half
    of the padding before, the rest after); explicit (low, high) pairs pad with -inf, then crop as VALID does. So
    both lowerings see the same windows.
    """
    if isinstance(padding, str) and padding == "SAME":
        total = [-d % w for d, w in zip(x.shape[1:-1], window)]
        x = jnp.pad(x, [(0, 0), *((t // 2, t - t // 2) for t in total), (0, 0)], constant_values=-jnp.inf)
    elif not isinstance(padding, str):
        x = jnp.pad(x, [(0, 0), *padding, (0, 0)], constant_values=-jnp.inf)
    x = x[(slice(None), *(slice(0, d - d % w) for d, w in zip(x.shape[1:-1], window)), slice(None))]
    tiled = [x.shape[0]]
    for d, w in zip(x.shape[1:-1], window):
        tiled += [d // w, w]
    return x.reshape(*tiled, x.shape[-1]).max(axis=tuple(range(2, 2 * len(window) + 1, 2)))


@describe
def MaxPool(
    window: int | Sequence[int] = 2,
    strides: int | Sequence[int] | None = None,
    padding: PoolPadding = "VALID",
    lowering: str = "auto",
    name: str = "max_pool",
) -> Layer:
    """Maximum over windows (strides default to the window: non-overlapping).

    `padding`: "VALID", "SAME", or one (low, high) pair per spatial axis, padded with -inf (as torch pads):
    torch's `MaxPool2d(3, 2, padding=1)` is `MaxPool(3, 2, ((1, 1), (1, 1)))`.

    `lowering`: "reduce_window" is XLA's windowed reduction, whose gradient is a select-and-scatter; "reshape"
    (non-overlapping windows only: strides == window) tiles the input with a reshape and takes a plain max, whose
    gradient is an elementwise mask: 3-5x faster gradients on the CPU (docs/performance.md). The two agree
    wherever a window has a single maximum; on ties the reshape form splits the gradient evenly between the tied
    elements, reduce_window gives it all to one (both are subgradients). "auto" is "reshape" when the computation
    is lowered for the CPU and it applies, "reduce_window" otherwise (not yet measured on GPUs); the platform is the
    one jax lowers for (`lax.platform_dependent`), not the process's default backend.
    """
    if lowering not in MAX_POOL_LOWERINGS:
        raise ValueError(f"MaxPool: unknown lowering {lowering!r}; choose one of {MAX_POOL_LOWERINGS}")
    reduce, init, check_apply, window, strides = _pool(
        "MaxPool", lax.max, lambda dt: -jnp.inf, window, strides, padding, name
    )
    tiles = strides == window
    pad = _pool_padding("MaxPool", padding, window)
    if lowering == "reshape" and not tiles:
        raise ValueError(
            "MaxPool: the reshape lowering needs non-overlapping windows (strides == window); got "
            f"window={window}, strides={strides}"
        )

    def apply(params, x, **kwargs):
        check_apply(x, kwargs)
        if lowering == "reshape":
            return _max_over_tiles(x, window, pad)
        if lowering == "reduce_window" or not tiles:
            return reduce(x)
        # "auto" on tiling windows: the reshape form where the computation is lowered for the CPU, reduce_window on
        # every other platform. The choice follows the platform jax lowers for, not this process's default backend
        # (a program traced here can be exported for a GPU); only the lowering platform's branch is lowered.
        return lax.platform_dependent(x, cpu=lambda x: _max_over_tiles(x, window, pad), default=reduce)

    return Layer(init, apply, name)


@describe
def AvgPool(
    window: int | Sequence[int] = 2,
    strides: int | Sequence[int] | None = None,
    padding: PoolPadding = "VALID",
    name: str = "avg_pool",
) -> Layer:
    """Mean over windows; `padding` as in `MaxPool`. Border windows of a padded input average only the real
    elements (torch's `count_include_pad=False`, flax's default)."""
    reduce, init, check_apply, _, _ = _pool("AvgPool", lax.add, lambda dt: 0.0, window, strides, padding, name)

    def apply(params, x, **kwargs):
        check_apply(x, kwargs)
        acc = accumulation_dtype(x.dtype)
        sums = reduce(x.astype(acc))
        counts = reduce(jnp.ones((1, *x.shape[1:-1], 1), acc))
        return (sums / counts).astype(x.dtype)

    return Layer(init, apply, name)


@describe
def GlobalAvgPool(name: str = "global_avg_pool") -> Layer:
    """Mean over every spatial axis: (N, ..., C) -> (N, C), summed in float32."""

    def check_shape(in_shape: Shape) -> None:
        if len(in_shape) < 3:
            raise shape_error(name, "of rank >= 3 (batch, spatial..., channels)", in_shape)

    def init(key, in_shape):
        check_shape(tuple(in_shape))
        return (in_shape[0], in_shape[-1]), {}

    def apply(params, x, **kwargs):
        check_keywords(name, kwargs)
        check_shape(tuple(jnp.shape(x)))
        return jnp.mean(x, axis=tuple(range(1, x.ndim - 1)), dtype=accumulation_dtype(x.dtype)).astype(x.dtype)

    return Layer(init, apply, name)
