"""oneDNN's direct convolution, channels last, as a differentiable jax function (forward, backward-data and
backward-weights kernels; `jax.custom_vjp`).

Float32 and bfloat16. Products accumulate in float32: bf16 operands give a float32 result, as
`jaxnn.precision.conv` does; their gradients are computed from a bf16 cotangent and returned in bf16 (the weight
gradient is accumulated in float32 by oneDNN and rounded once). Runs only where the computation is lowered for the
CPU: callers choose it with `lax.platform_dependent`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jaxnn.kernels.onednn.library import call, check_dtype, like_primal, supports_bf16

DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def supports(x_dtype: DTypeLike, w_dtype: DTypeLike, feature_group_count: int = 1) -> bool:
    """Whether these kernels compute a convolution of these operand dtypes on this CPU (equal, float32 or bfloat16
    where oneDNN has bfloat16 kernels for it; no groups)."""
    dtype = jnp.dtype(x_dtype)
    return (
        feature_group_count == 1
        and dtype == jnp.dtype(w_dtype)
        and dtype in DTYPES
        and (dtype != jnp.bfloat16 or supports_bf16())
    )


def _attrs(strides, pads, dilation) -> dict:
    return {
        "strides": np.asarray(strides, np.int64),
        "dilation": np.asarray(dilation, np.int64),
        "pad_lo": np.asarray([lo for lo, _ in pads], np.int64),
        "pad_hi": np.asarray([hi for _, hi in pads], np.int64),
    }


def _call(target: str, shape, dtype, *operands, geometry):
    # vmap runs the kernel once per batch element (a loop); batching into N would need the axes moved.
    return call(target, shape, dtype, *operands, vmap_method="sequential", **_attrs(*geometry))


def _out_spatial(in_spatial, kernel, geometry) -> list[int]:
    strides, pads, dilation = geometry
    return [
        (n + lo + hi - (k - 1) * d - 1) // s + 1
        for n, k, s, (lo, hi), d in zip(in_spatial, kernel, strides, pads, dilation)
    ]


def _accumulated(dtype) -> jnp.dtype:
    return jnp.dtype(jnp.float32) if jnp.dtype(dtype) == jnp.bfloat16 else jnp.dtype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _conv(x, w, geometry):
    shape = (x.shape[0], *_out_spatial(x.shape[1:-1], w.shape[:-2], geometry), w.shape[-1])
    return _call("conv_fwd", shape, _accumulated(x.dtype), x, w, geometry=geometry)


def _conv_fwd(x, w, geometry):
    return _conv(x, w, geometry), (x, w)


def _conv_bwd(geometry, residuals, g):
    x, w = residuals
    g = g.astype(x.dtype)
    dx = _call("conv_bwd_data", x.shape, x.dtype, g, w, geometry=geometry)
    dw = _call("conv_bwd_weights", w.shape, _accumulated(w.dtype), x, g, geometry=geometry)
    return like_primal(dx, x), like_primal(dw.astype(w.dtype), w)


_conv.defvjp(_conv_fwd, _conv_bwd)


def conv(
    x: jax.Array,
    w: jax.Array,
    strides: Sequence[int],
    pads: Sequence[tuple[int, int]],
    dilation: Sequence[int],
) -> jax.Array:
    """The convolution of channels-last `x` (N, *spatial, C) with `w` (*kernel, C, features), explicit (low, high)
    `pads` per spatial axis; what `lax.conv_general_dilated` computes with ("NHWC", "HWIO", "NHWC") numbers and
    float32 accumulation (`preferred_element_type`), up to summation order. Raises where the kernels are not built.
    """
    if x.dtype != w.dtype or jnp.dtype(x.dtype) not in DTYPES:
        raise TypeError(f"onednn conv: operands must both be float32 or both bfloat16, got {x.dtype} and {w.dtype}")
    check_dtype(x.dtype, "conv")
    if x.ndim != w.ndim or not 3 <= x.ndim <= 5:
        raise ValueError(f"onednn conv: x and w need equal rank 3 to 5, got shapes {x.shape} and {w.shape}")
    geometry = (tuple(strides), tuple(tuple(p) for p in pads), tuple(dilation))
    return _conv(x, w, geometry)
