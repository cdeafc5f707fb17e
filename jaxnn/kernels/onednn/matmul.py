"""oneDNN's matrix product (float32 operands and result, or bfloat16 operands with a float32 or bfloat16 result),
and two-operand einsums on it.

oneDNN reads a transposed operand through strides, so an einsum whose operands hold their contracted axes first
(the weight gradients: "mk,mn->kn") needs no copy, where XLA's CPU dot needs the canonical layout to reach its bf16
units (`jaxnn.precision._canonical_einsum`). Not differentiable by itself: `jaxnn.precision.einsum` writes the
gradients as einsums and runs each of them here.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from jaxnn.kernels.onednn.library import call, check_dtype

OPERAND_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def matmul(
    a: jax.Array, b: jax.Array, *, trans_a: bool = False, trans_b: bool = False, dtype: DTypeLike = jnp.float32
) -> jax.Array:
    """`a @ b` over the last two axes (leading axes are a batch, equal in both), `trans_*` reading an operand as
    the transpose of its last two axes; f32 accumulation. Float32 operands give a float32 result; bf16 operands
    a result in `dtype` (float32 or bfloat16)."""
    if a.dtype not in OPERAND_DTYPES or a.dtype != b.dtype or a.ndim != b.ndim or a.shape[:-2] != b.shape[:-2]:
        raise TypeError(
            "onednn matmul: float32 or bfloat16 operands of one dtype with equal batch axes, "
            f"got {a.dtype}{a.shape} and {b.dtype}{b.shape}"
        )
    check_dtype(a.dtype, "matmul")
    if a.dtype == jnp.float32:
        dtype = jnp.float32
    m = a.shape[-1] if trans_a else a.shape[-2]
    n = b.shape[-2] if trans_b else b.shape[-1]
    if (a.shape[-2] if trans_a else a.shape[-1]) != (b.shape[-1] if trans_b else b.shape[-2]):
        raise ValueError(f"onednn matmul: contracted sizes differ, {a.shape} (trans {trans_a}) and {b.shape}")
    # Under vmap every operand gets the mapped axis first, which the kernel folds into the batch.
    return call(
        "matmul",
        (*a.shape[:-2], m, n),
        dtype,
        a,
        b,
        vmap_method="broadcast_all",
        trans_a=int(trans_a),
        trans_b=int(trans_b),
    )


def _as_matrices(x: jax.Array, spec: str, lead: list[str], first: list[str], second: list[str]):
    """`x` as (batch, first, second) with each group of axes folded into one, and whether it was read transposed:
    stored in that order, or as (batch, second, first), costs nothing; any other order is transposed first."""
    sizes = dict(zip(spec, x.shape))

    def folded(groups):
        return x.reshape(*(math.prod(sizes[c] for c in g) for g in groups))

    if list(spec) == lead + second + first and first and second:
        return folded([lead, second, first]), True
    order = lead + first + second
    if list(spec) != order:
        x = jnp.transpose(x, [spec.index(c) for c in order])
    return folded([lead, first, second]), False


def einsum(spec: str, a: jax.Array, b: jax.Array, dtype: DTypeLike = jnp.float32) -> jax.Array:
    """A two-operand einsum (no ellipsis; every index in exactly two of a, b and the output) of float32 or bf16
    operands as one batched oneDNN product; bf16 operands give a result in `dtype`, float32 ones a float32 one."""
    inputs, spec_out = spec.replace(" ", "").split("->")
    spec_a, spec_b = inputs.split(",")
    batch = [c for c in spec_a if c in spec_b and c in spec_out]
    contracted = [c for c in spec_a if c in spec_b and c not in spec_out]
    free_a = [c for c in spec_a if c not in spec_b]
    free_b = [c for c in spec_b if c not in spec_a]
    x, trans_a = _as_matrices(a, spec_a, batch, free_a, contracted)
    y, trans_b = _as_matrices(b, spec_b, batch, contracted, free_b)
    out = matmul(x, y, trans_a=trans_a, trans_b=trans_b, dtype=dtype)
    sizes = {**dict(zip(spec_a, a.shape)), **dict(zip(spec_b, b.shape))}
    order = batch + free_a + free_b
    out = out.reshape([sizes[c] for c in order])
    return out if order == list(spec_out) else jnp.transpose(out, [order.index(c) for c in spec_out])
