"""float8 products for the "fp8" precision policy: a Dense layer's matmul with float8 operands, e4m3 in the forward
product and e5m2 for the gradient that flows back (its wider range, as in NVIDIA's Transformer Engine recipe).

Each operand is scaled per tensor from its own absolute maximum in the same step ("current scaling"): the largest
magnitude maps to the format's largest finite value, and the product's f32 result is multiplied back by both
scales. Scaling from the step's own maximum needs no state in the TrainState and cannot overflow on a step whose
activations grew, at the cost of one max-reduction per operand; delayed scaling (a history of past maxima) saves
that reduction but lags by a step. On Hopper GPUs XLA rewrites this pattern (float8 operands, f32 result, scalar
scales) into one cuBLASLt fp8 GEMM; on CPUs it runs emulated (the operands upcast), with the same rounding.

What stays in bf16: attention's score and value products (cuDNN's fused kernel), convolutions, and products whose
inner or outer width is not a multiple of 16 (cuBLASLt's fp8 kernels need it; LoRA's rank-8 adapters, say).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import DTypeLike

FORWARD_DTYPE = jnp.float8_e4m3fn  # 4 exponent bits, 3 mantissa: precision for weights and activations
GRADIENT_DTYPE = jnp.float8_e5m2  # 5 exponent bits, 2 mantissa: range for gradients
ALIGNMENT = 16  # cuBLASLt's fp8 GEMMs take widths that are multiples of 16


def fits(inner: int, outer: int) -> bool:
    """Whether a (m, inner) @ (inner, outer) product runs in fp8 (else it stays in the compute dtype)."""
    return inner % ALIGNMENT == 0 and outer % ALIGNMENT == 0


def quantize(x: jax.Array, dtype: DTypeLike) -> tuple[jax.Array, jax.Array]:
    """`x` as float8 `dtype` and the f32 scale one unit of it stands for: `x ~= q.astype(f32) * scale`.

    The scale maps `x`'s largest magnitude to the format's largest finite value; an all-zero `x` gets scale 1. A
    NaN or Inf in `x` makes every element NaN, so that a diverging step shows in its loss instead of being clipped.
    """
    top = float(jnp.finfo(dtype).max)
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    scale = jnp.where(amax > 0, amax / top, 1.0)
    scale = jnp.where(jnp.isfinite(amax), scale, jnp.nan)
    scaled = x.astype(jnp.float32) / scale
    return jnp.clip(scaled, -top, top).astype(dtype), scale


def _scaled_product(a, b, scale, contracting):
    """`a . b` over the `contracting` axes in f32, times `scale` (the product of both operands' scales)."""
    out = lax.dot_general(a, b, (contracting, ((), ())), preferred_element_type=jnp.float32)
    return out * scale


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x @ w` for a (m, k) `x` and a (k, n) `w` of one dtype, both operands in e4m3; an f32 (m, n) result. The
    gradients take the cotangent in e5m2 and the saved e4m3 operands, and come back in the operands' dtype."""
    if x.dtype != w.dtype:
        raise TypeError(f"fp8.matmul: operands of one dtype, got {x.dtype} and {w.dtype}")
    return _matmul(x, w, jnp.dtype(x.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul(x, w, dtype):
    return _forward(x, w, dtype)[0]


def _forward(x, w, dtype):
    qx, sx = quantize(x, FORWARD_DTYPE)
    qw, sw = quantize(w, FORWARD_DTYPE)
    # The float8 operands are what the backward pass keeps: a quarter of f32's bytes, half of bf16's.
    return _scaled_product(qx, qw, sx * sw, ((1,), (0,))), (qx, sx, qw, sw)


def _backward(dtype, residuals, g):
    qx, sx, qw, sw = residuals
    qg, sg = quantize(g, GRADIENT_DTYPE)
    dx = _scaled_product(qg, qw, sg * sw, ((1,), (1,)))  # (m, n) . (k, n) over n -> (m, k)
    dw = _scaled_product(qx, qg, sx * sg, ((0,), (0,)))  # (m, k) . (m, n) over m -> (k, n)
    return dx.astype(dtype), dw.astype(dtype)


_matmul.defvjp(_forward, _backward)

__all__ = ["ALIGNMENT", "FORWARD_DTYPE", "GRADIENT_DTYPE", "fits", "matmul", "quantize"]
