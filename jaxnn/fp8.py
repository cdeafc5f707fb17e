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

Delayed scaling (the "fp8-delayed" policy, `Policy.fp8_history`): each Dense kernel that runs in fp8 gets an amax
history beside it in the parameters (`HISTORY_KEY`, shape (..., 3, N): the last N steps' maxima of the input, the
kernel and the gradient flowing back). Each operand is scaled from its row's maximum, known before the step starts,
so the quantisation depends on nothing computed in the step and can fuse into the operation that produces the
operand; the step's own maxima are still taken (a reduction the producer can emit beside its output) and come back
as the history's "gradient", which the train step writes over the history instead of handing to the optimizer
(`split_histories`, `put_histories`; accumulated and data-parallel steps combine them by maximum). An operand that
outgrew its history is clipped to the format's largest value for that step; a NaN or Inf in it still makes the
product NaN, so a diverging step shows in its loss.
"""

from __future__ import annotations

import functools
from typing import Any

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

HISTORY_KEY = "fp8_history"  # the amax history's name beside a Dense kernel "w"
HISTORY_LENGTH = 16  # steps of maxima a scale is taken from (Transformer Engine's recipes use 16 to 1024)


def with_histories(params: Any, length: int = HISTORY_LENGTH) -> Any:
    """`params` with a zero amax history (float32, (..., 3, length)) beside every kernel `w` a Dense layer would
    run in fp8: a 2-D kernel (or a stack of them under `Repeat`, 3-D) whose widths `fits`. Kernels that have one
    keep it. A zero history scales by 1 on the first step, which clips only values above 448."""
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise ValueError(f"fp8 history length must be a positive integer, got {length!r}")

    def visit(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        out = {k: visit(v) for k, v in node.items()}
        w: Any = node.get("w")
        if (
            HISTORY_KEY not in node
            and hasattr(w, "ndim")
            and w.ndim in (2, 3)
            and jnp.issubdtype(w.dtype, jnp.floating)
            and fits(*w.shape[-2:])
        ):
            out[HISTORY_KEY] = jnp.zeros((*w.shape[:-2], 3, length), jnp.float32)
        return out

    return visit(params)


def is_history(path: tuple) -> bool:
    """Whether a tree path (`jax.tree_util` keys) ends at an amax history."""
    return bool(path) and getattr(path[-1], "key", None) == HISTORY_KEY


def history_mask(tree: Any) -> Any:
    """True at the amax histories of `tree` (params, or gradients shaped like them), False elsewhere."""
    return jax.tree_util.tree_map_with_path(lambda path, _: is_history(path), tree)


def split_histories(grads: Any) -> tuple[Any, Any]:
    """(the new histories, `grads` with zeros in their place): the optimizer then leaves the histories as they
    were (no update from a zero gradient, no decay: they are not kernels), and `put_histories` writes them."""
    mask = history_mask(grads)
    fresh = jax.tree.map(lambda m, g: g if m else None, mask, grads)
    zeroed = jax.tree.map(lambda m, g: jnp.zeros_like(g) if m else g, mask, grads)
    return fresh, zeroed


def put_histories(params: Any, fresh: Any) -> Any:
    """`params` with each amax history replaced by its new value from `split_histories`."""
    mask = history_mask(params)
    return jax.tree.map(lambda m, p, f: f.astype(p.dtype) if m else p, mask, params, fresh, is_leaf=lambda x: x is None)


def without_histories(params: Any) -> Any:
    """`params` without amax histories: what an export or a model built without them expects."""
    if isinstance(params, dict):
        return {k: without_histories(v) for k, v in params.items() if k != HISTORY_KEY}
    return params


def _scale_from(history_row: jax.Array, dtype: DTypeLike) -> jax.Array:
    amax = jnp.max(history_row).astype(jnp.float32)
    return jnp.where(amax > 0, amax / float(jnp.finfo(dtype).max), 1.0)


def _quantize_scaled(x: jax.Array, scale: jax.Array, dtype: DTypeLike) -> tuple[jax.Array, jax.Array]:
    """`x` in float8 at a scale known beforehand, and `x`'s own absolute maximum (for the next steps' scales)."""
    top = float(jnp.finfo(dtype).max)
    q = jnp.clip(x.astype(jnp.float32) / scale, -top, top).astype(dtype)
    return q, jnp.max(jnp.abs(x)).astype(jnp.float32)


def _finite_or_nan(*amaxes: jax.Array) -> jax.Array:
    """1, or NaN when an operand held a NaN or an Inf (clipping would hide it): applied to the product's scale."""
    finite = jnp.all(jnp.isfinite(jnp.stack(amaxes)))
    return jnp.where(finite, 1.0, jnp.nan)


def delayed_matmul(x: jax.Array, w: jax.Array, history: jax.Array) -> jax.Array:
    """`matmul` with delayed scaling: each operand's scale comes from `history` (3, N: the input's, the kernel's
    and the gradient's last N maxima), not from the operand itself. Its gradient with respect to `history` is the
    updated history (this step's maxima first, the oldest dropped), for the train step to write over it."""
    if x.dtype != w.dtype:
        raise TypeError(f"fp8.delayed_matmul: operands of one dtype, got {x.dtype} and {w.dtype}")
    if history.ndim != 2 or history.shape[0] != 3:
        raise ValueError(f"fp8.delayed_matmul: history of shape (3, N), got {history.shape}")
    return _delayed(x, w, history, jnp.dtype(x.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _delayed(x, w, history, dtype):
    return _delayed_forward(x, w, history, dtype)[0]


def _delayed_forward(x, w, history, dtype):
    sx, sw = _scale_from(history[0], FORWARD_DTYPE), _scale_from(history[1], FORWARD_DTYPE)
    qx, ax = _quantize_scaled(x, sx, FORWARD_DTYPE)
    qw, aw = _quantize_scaled(w, sw, FORWARD_DTYPE)
    y = _scaled_product(qx, qw, sx * sw * _finite_or_nan(ax, aw), ((1,), (0,)))
    return y, (qx, sx, qw, sw, ax, aw, history)


def _delayed_backward(dtype, residuals, g):
    qx, sx, qw, sw, ax, aw, history = residuals
    sg = _scale_from(history[2], GRADIENT_DTYPE)
    qg, ag = _quantize_scaled(g, sg, GRADIENT_DTYPE)
    nan_if_bad = _finite_or_nan(ag)
    dx = _scaled_product(qg, qw, sg * sw * nan_if_bad, ((1,), (1,)))
    dw = _scaled_product(qx, qg, sx * sg * nan_if_bad, ((0,), (0,)))
    newest = jnp.stack([ax, aw, ag]).astype(history.dtype)[:, None]
    return dx.astype(dtype), dw.astype(dtype), jnp.concatenate([newest, history[:, :-1]], axis=1)


_delayed.defvjp(_delayed_forward, _delayed_backward)

__all__ = [
    "ALIGNMENT",
    "FORWARD_DTYPE",
    "GRADIENT_DTYPE",
    "HISTORY_KEY",
    "HISTORY_LENGTH",
    "delayed_matmul",
    "fits",
    "history_mask",
    "is_history",
    "matmul",
    "put_histories",
    "quantize",
    "split_histories",
    "with_histories",
    "without_histories",
]
