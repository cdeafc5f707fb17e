"""bf16 products computed as float32 products of the widened values, on CPUs without bf16 instructions.

A bf16 x bf16 -> f32 product is exactly the float32 product of the two operands widened to float32 (every bf16
value is a float32 value, and both forms accumulate in float32), so the two differ only in the order of the
additions. Where the CPU multiplies bf16 itself (`jaxnn._src.cpu.BF16_FLAGS`) the bf16 form is the fast one; on a
CPU without them, XLA's CPU library (YNNPACK) still takes the bf16 form and widens inside its kernel, which made
the GPT's bf16 step 1.27-1.34x Flax Linen's bf16 step on AVX2, against 0.84-0.86x widened first (docs/performance.md,
"bf16 on CPUs without bf16 instructions"). There the products are widened first, only where the computation is
lowered for the CPU: other platforms keep the bf16 form.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import DTypeLike

from jaxnn._src.cpu import host_bf16_products


def applies(dtype: DTypeLike) -> bool:
    """Whether a product of `dtype` operands is widened where it is lowered for this CPU: bf16 on a CPU without
    bf16 instructions (or held below AVX512_BF16 by XLA_FLAGS' `--xla_cpu_max_isa`)."""
    return jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) and not host_bf16_products()


def einsum(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """`einsum(spec, a, b)` in float32 of the widened operands: the values of a bf16 x bf16 -> f32 product."""
    wide = (x.astype(jnp.float32) for x in (a, b))
    return jnp.einsum(spec, *wide, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def on_cpu(spec: str, a: jax.Array, b: jax.Array, other: Callable[[jax.Array, jax.Array], jax.Array]) -> jax.Array:
    """The widened `einsum` where the computation is lowered for the CPU, `other(a, b)` on every other platform."""
    return lax.platform_dependent(a, b, cpu=lambda a, b: einsum(spec, a, b), default=other)
