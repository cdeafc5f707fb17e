"""Mixed precision: a Policy of three dtypes (parameters, compute, output) and dynamic loss scaling.

The policy casts parameters and inputs to the compute dtype once, at the step boundary (as in jmp/Haiku and
levanter); layers then follow the dtype of their input. Every forward matmul, convolution and attention product
is computed with `preferred_element_type=float32`: a bf16 x bf16 -> f32 product is the form tensor cores and
Intel's AMX units execute fast (~1070 GFLOP/s at 2048^3 on an AMX Xeon, against ~190 for bf16 x bf16 -> bf16).
Backward matmuls take the same form; the backward products of XLA's convolution op are bf16 x bf16 -> bf16
(docs/precision.md). Normalisation statistics and softmax are computed in float32.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import DTypeLike

from jaxnn import fp8
from jaxnn._src import widened_products
from jaxnn.kernels import onednn

Tree = TypeVar("Tree")  # a pytree of arrays; the casts below keep its structure and change leaf dtypes only

# The float32 matmul precisions a policy can ask for, by name. "highest" is exact fp32; "tensorfloat32" lets GPUs
# use TF32 tensor cores (a 10-bit mantissa); the CPU computes both exactly.
MATMUL_PRECISIONS = {
    "highest": lax.Precision.HIGHEST,
    "tensorfloat32": lax.Precision.HIGH,
    "default": lax.Precision.DEFAULT,
}


def _is_half(dtype: DTypeLike) -> bool:
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class Policy:
    """Which dtype parameters are stored in, computed in, and returned in; and how fp32 products are computed."""

    param_dtype: jnp.dtype = jnp.float32
    compute_dtype: jnp.dtype = jnp.float32
    output_dtype: jnp.dtype = jnp.float32
    matmul_precision: str = "highest"
    loss_scaling: bool = False
    name: str = "fp32"
    # Dense products in float8 (e4m3 forward, e5m2 gradients, per-tensor current scaling: `jaxnn.fp8`); needs a
    # half-precision compute dtype, whose products everything else (attention, convolutions) keeps.
    fp8_products: bool = False
    # With fp8_products: 0 scales each operand from its own maximum in the step ("current scaling"); N > 0 from the
    # largest of the last N steps' maxima, kept beside each kernel in the parameters ("delayed scaling",
    # `jaxnn.fp8.with_histories`), so that quantising needs no pass over the operand first.
    fp8_history: int = 0

    def __post_init__(self) -> None:
        if self.fp8_products and not _is_half(self.compute_dtype):
            raise ValueError(
                f"Policy: fp8_products needs a bf16 or fp16 compute_dtype, got {jnp.dtype(self.compute_dtype)}"
            )
        history = self.fp8_history
        if not isinstance(history, int) or isinstance(history, bool) or history < 0:
            raise ValueError(f"Policy: fp8_history must be a non-negative integer, got {history!r}")
        if history and not self.fp8_products:
            raise ValueError("Policy: fp8_history (delayed scaling) needs fp8_products=True")
        if not isinstance(self.matmul_precision, str) or self.matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(
                f"Policy: unknown matmul_precision {self.matmul_precision!r}; choose one of {sorted(MATMUL_PRECISIONS)}"
            )

    def cast_to_compute(self, tree: Tree) -> Tree:
        """Casts the floating-point leaves of `tree` to the compute dtype (integers, e.g. token ids, stay)."""
        return _cast_floats(tree, self.compute_dtype)

    def cast_to_param(self, tree: Tree) -> Tree:
        """The tree's floating-point leaves in `param_dtype` (other leaves unchanged)."""
        return _cast_floats(tree, self.param_dtype)

    def cast_to_output(self, tree: Tree) -> Tree:
        """The tree's floating-point leaves in `output_dtype` (other leaves unchanged)."""
        return _cast_floats(tree, self.output_dtype)

    def dot_precision(self, dtype: DTypeLike) -> lax.Precision | None:
        """The `precision=` argument for a product whose operands have `dtype`."""
        return MATMUL_PRECISIONS[self.matmul_precision] if jnp.dtype(dtype) == jnp.float32 else None


def _cast_floats(tree: Tree, dtype: DTypeLike) -> Tree:
    """The floating-point leaves of `tree` in `dtype`; fp8 amax histories stay float32 (a scale is a float32)."""

    def cast(path: Any, x: Any) -> Any:
        if fp8.is_history(path) or not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            return x
        return x.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, tree)


FP32 = Policy()
TF32 = Policy(matmul_precision="tensorfloat32", name="tf32")
BF16 = Policy(compute_dtype=jnp.bfloat16, name="bf16")
FP16 = Policy(compute_dtype=jnp.float16, loss_scaling=True, name="fp16")
FP8 = Policy(compute_dtype=jnp.bfloat16, fp8_products=True, name="fp8")
FP8_DELAYED = Policy(compute_dtype=jnp.bfloat16, fp8_products=True, fp8_history=fp8.HISTORY_LENGTH, name="fp8-delayed")

PRESETS = {p.name: p for p in (FP32, TF32, BF16, FP16, FP8, FP8_DELAYED)}


def get_policy(policy: Policy | str | None) -> Policy:
    """A Policy from a preset name ('fp32', 'tf32', 'bf16', 'fp16', 'fp8', 'fp8-delayed'), a Policy, or None
    (fp32)."""
    if policy is None:
        return FP32
    if isinstance(policy, Policy):
        return policy
    if not isinstance(policy, str) or policy not in PRESETS:
        raise ValueError(f"unknown precision {policy!r}; choose one of {sorted(PRESETS)} or pass a Policy")
    return PRESETS[policy]


def accumulation_dtype(dtype: DTypeLike) -> jnp.dtype:
    """The dtype products, sums and statistics are computed in: float32, or wider if the input is (float64)."""
    return jnp.promote_types(dtype, jnp.float32)


def product_kwargs(x_dtype: DTypeLike, policy: Policy | None) -> dict[str, Any]:
    """Keyword arguments for lax products: fp32 (or wider) accumulation always, and the policy's fp32 precision."""
    policy = policy or FP32
    return {"precision": policy.dot_precision(x_dtype), "preferred_element_type": accumulation_dtype(x_dtype)}


class LossScale(NamedTuple):
    """Dynamic loss scaling for fp16: skip an overflowing step and halve the scale; double it after
    `period` finite steps in a row. Defaults as in the common libraries (initial 2^15, period 2000).

    Written here rather than imported because optax has no loss scaling and jmp is not maintained; it is a
    pytree of three scalars, so it lives in the TrainState and is checkpointed with it.
    """

    scale: jax.Array
    good_steps: jax.Array
    period: jax.Array

    @classmethod
    def create(cls, initial_scale: float = 2.0**15, period: int = 2000) -> LossScale:
        """A scale of `initial_scale`, doubled after `period` finite steps in a row and halved on a non-finite one."""
        if not initial_scale > 0 or not math.isfinite(initial_scale):
            raise ValueError(f"LossScale: initial_scale must be positive and finite, got {initial_scale!r}")
        if not isinstance(period, int) or isinstance(period, bool) or period < 1:
            raise ValueError(
                f"LossScale: period must be a positive integer (finite steps before doubling), got {period!r}"
            )
        return cls(jnp.asarray(initial_scale, jnp.float32), jnp.zeros((), jnp.int32), jnp.asarray(period, jnp.int32))

    def scale_loss(self, loss: jax.Array) -> jax.Array:
        """The loss times the scale, so that small fp16 gradients do not flush to zero."""
        return loss * self.scale.astype(loss.dtype)

    def unscale(self, grads: Tree) -> Tree:
        """The gradients in float32, divided by the scale: the true gradients of the unscaled loss."""
        return jax.tree.map(lambda g: g.astype(jnp.float32) / self.scale, grads)

    def adjust(self, grads_finite: jax.Array) -> LossScale:
        """The next scale given whether this step's gradients were all finite."""
        grown = self.good_steps + 1 >= self.period
        scale = jnp.where(grads_finite, jnp.where(grown, self.scale * 2, self.scale), jnp.maximum(self.scale / 2, 1.0))
        good = jnp.where(grads_finite & ~grown, self.good_steps + 1, 0)
        return LossScale(scale, good, self.period)


def all_finite(tree: Any) -> jax.Array:
    """One boolean array: whether every element of every leaf is finite (no NaN, no Inf)."""
    return jnp.all(jnp.asarray([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


# Half-precision products with half-precision gradients.
#
# A product computed as bf16 x bf16 -> f32 returns an f32 result, so autodiff hands its transpose an f32
# cotangent, and JAX then upcasts the bf16 operand and runs the backward products as f32 x f32 -> f32 (measured
# on this CPU: ~220 GFLOP/s instead of ~1070 on the AMX units). Mixed-precision training rounds the cotangent to
# the compute dtype instead, so that the backward products take the same bf16 x bf16 -> f32 form as the forward.


# By default (no switch set) only a plain matrix product of at least this many multiply-adds goes to oneDNN: each
# call has a fixed cost of tens of microseconds (OpenMP's fork and join, the weights' layout), and it is opaque to
# XLA, which then materialises the transposes it would fold into a batched product of its own. Measured on the
# benchmark models (docs/performance.md, "Defaults per CPU"): a tiny MLP's step took 10-16x as long with every
# product on oneDNN, and the GPT's fp32 step was no faster with its attention's batched products there.
ONEDNN_MIN_MACS = 1 << 22


def _onednn_product(a, b=None, spec: str | None = None) -> bool:
    """Whether a product of operands like `a` (float32 or bfloat16) runs on oneDNN's GEMM where it is lowered for
    the CPU: the optional kernels are built and switched on for the dtype (`jaxnn.kernels.onednn.enabled`, read when
    tracing). Switched on by default (where they measured faster than XLA's dot on this CPU), only for an unbatched
    product of `spec` of at least ONEDNN_MIN_MACS multiply-adds; a switch set by hand takes every product."""
    if a.dtype not in (jnp.float32, jnp.bfloat16) or not onednn.enabled("matmul", a.dtype):
        return False
    if onednn.forced() or spec is None:
        return True
    inputs, out = spec.replace(" ", "").split("->")
    spec_a, spec_b = inputs.split(",")
    sizes = {**dict(zip(spec_a, a.shape)), **dict(zip(spec_b, b.shape))}
    batched = any(c in spec_b and c in out for c in spec_a)
    return not batched and math.prod(sizes.values()) >= ONEDNN_MIN_MACS


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _half_einsum(spec: str, a, b):
    def xla(a, b):
        return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)

    if not _onednn_product(a, b, spec):
        # On a CPU without bf16 instructions, the same values as float32 products (`jaxnn._src.widened_products`)
        return widened_products.on_cpu(spec, a, b, xla) if widened_products.applies(a.dtype) else xla(a, b)
    return lax.platform_dependent(a, b, cpu=lambda a, b: onednn.einsum(spec, a, b), default=xla)


def _half_einsum_fwd(spec, a, b):
    return _half_einsum(spec, a, b), (a, b)


def _cpu_barrier(*arrays: jax.Array) -> tuple[jax.Array, ...]:
    """`arrays` behind an optimization barrier, on flattened copies, where the computation is lowered for the CPU;
    unchanged on every other platform (the choice follows the lowering platform, `lax.platform_dependent`)."""

    def barrier(*arrays):
        flat = lax.optimization_barrier(tuple(a.reshape(-1) for a in arrays))
        return tuple(f.reshape(a.shape) for f, a in zip(flat, arrays))

    return lax.platform_dependent(*arrays, cpu=barrier, default=lambda *arrays: arrays)


def _canonical_einsum(spec_x: str, spec_y: str, spec_out: str, x, y):
    """`einsum(spec_x,spec_y->spec_out)` with both operands first transposed to the canonical matmul layout,
    x as (batch, free, contracted) and y as (batch, contracted, free).

    Why: XLA's CPU backend runs a bf16 x bf16 -> f32 dot on its bf16 units (YNNPACK; AMX where the CPU has it)
    only in that layout; given, say, a weight gradient that contracts the leading axes, it folds the transpose
    into the dot, and then either fails at run time or (jax 0.10.2) upcasts both operands to f32. The optimization
    barrier keeps the transposes out of the dot. It acts on flattened copies: a barrier on the transposed 2-D
    array let XLA keep the transpose as a column-major layout, which the dot then read as the transposed form and
    upcast all the same (the bf16 weight gradient of a 2048x256 @ 2048x768 product: 6.5 ms in f32, 1.4 ms with the
    flat barrier on an AMX Xeon, docs/performance.md). The barriers apply only where the computation is lowered
    for the CPU (`_cpu_barrier`): on GPUs they would force every transpose to be materialised before its GEMM,
    where cuBLAS takes transposed operands for free.
    """
    batch = [c for c in spec_x if c in spec_y and c in spec_out]
    contracted = [c for c in spec_x if c in spec_y and c not in spec_out]
    order_x = batch + [c for c in spec_x if c not in spec_y] + contracted
    order_y = batch + contracted + [c for c in spec_y if c not in spec_x]
    x = jnp.transpose(x, [spec_x.index(c) for c in order_x])
    y = jnp.transpose(y, [spec_y.index(c) for c in order_y])
    x, y = _cpu_barrier(x, y)
    order_out = batch + [c for c in spec_x if c not in spec_y] + [c for c in spec_y if c not in spec_x]
    out = jnp.einsum(
        f"{''.join(order_x)},{''.join(order_y)}->{''.join(order_out)}", x, y, preferred_element_type=jnp.float32
    )
    if order_out == list(spec_out):
        return out
    # The same for the result: XLA would fold a transpose after the dot into it by swapping the operands, which
    # puts the contracted axis of the new left operand first (the attention's value gradient did).
    (out,) = _cpu_barrier(out)
    return jnp.transpose(out, [order_out.index(c) for c in spec_out])


def _half_einsum_bwd(spec, residuals, g):
    # Each index of a two-operand einsum used here appears in exactly two of (a, b, out), so the transposes are
    # einsums with the roles swapped.
    a, b = residuals
    inputs, out = spec.split("->")
    spec_a, spec_b = inputs.split(",")
    g = g.astype(a.dtype)
    da = _backward_product(out, spec_b, spec_a, g, b)
    db = _backward_product(spec_a, out, spec_b, a, g)
    return da.astype(a.dtype), db.astype(b.dtype)


def _backward_product(spec_x: str, spec_y: str, spec_out: str, x, y):
    """One of a half-precision einsum's gradient products: oneDNN's GEMM on the CPU where it is switched on (it
    reads transposed operands through strides, so none of `_canonical_einsum`'s copies), else the canonical form."""
    if not _onednn_product(x, y, f"{spec_x},{spec_y}->{spec_out}"):
        if widened_products.applies(x.dtype):
            canonical = lambda x, y: _canonical_einsum(spec_x, spec_y, spec_out, x, y)  # noqa: E731
            return widened_products.on_cpu(f"{spec_x},{spec_y}->{spec_out}", x, y, canonical)
        return _canonical_einsum(spec_x, spec_y, spec_out, x, y)
    return lax.platform_dependent(
        x,
        y,
        cpu=lambda x, y: onednn.einsum(f"{spec_x},{spec_y}->{spec_out}", x, y),
        default=lambda x, y: _canonical_einsum(spec_x, spec_y, spec_out, x, y),
    )


def _swapped_specs(spec: str) -> tuple[tuple[str, str, str], tuple[str, str, str]]:
    """The specs of a two-operand einsum's gradient products: (out, b -> a) and (a, out -> b). Each index of the
    einsums used here appears in exactly two of (a, b, out), so the transposes are einsums with the roles swapped."""
    inputs, out = spec.split("->")
    spec_a, spec_b = inputs.split(",")
    return (out, spec_b, spec_a), (spec_a, out, spec_b)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _onednn_f32_einsum(spec: str, kwargs: tuple, a, b):
    """A float32 einsum, and its two gradient products, on oneDNN's GEMM where the computation is lowered for the
    CPU; `jnp.einsum(..., **dict(kwargs))` on every other platform."""
    return _f32_product(spec, kwargs, a, b)


def _f32_product(spec: str, kwargs: tuple, x, y):
    return lax.platform_dependent(
        x, y, cpu=lambda x, y: onednn.einsum(spec, x, y), default=lambda x, y: jnp.einsum(spec, x, y, **dict(kwargs))
    )


def _onednn_f32_einsum_fwd(spec, kwargs, a, b):
    return _f32_product(spec, kwargs, a, b), (a, b)


def _onednn_f32_einsum_bwd(spec, kwargs, residuals, g):
    a, b = residuals
    (spec_ga, spec_b, spec_a), (spec_a2, spec_gb, spec_b2) = _swapped_specs(spec)
    g = g.astype(jnp.float32)
    da = _f32_product(f"{spec_ga},{spec_b}->{spec_a}", kwargs, g, b)
    db = _f32_product(f"{spec_a2},{spec_gb}->{spec_b2}", kwargs, a, g)
    return da, db


_onednn_f32_einsum.defvjp(_onednn_f32_einsum_fwd, _onednn_f32_einsum_bwd)


_half_einsum.defvjp(_half_einsum_fwd, _half_einsum_bwd)


def einsum(spec: str, a: jax.Array, b: jax.Array, policy: Policy | None = None) -> jax.Array:
    """A two-operand einsum (no ellipsis; every index in exactly two of the operands and output) that
    accumulates in float32 or wider; half-precision operands get half-precision gradient products too. Float32 and
    bf16 products (and their gradients) run on oneDNN's GEMM where the computation is lowered for the CPU and the
    optional kernels are switched on for the dtype (`jaxnn.kernels.onednn.enabled("matmul", dtype)`: by default
    where they measured faster on this CPU); on XLA's dot everywhere else."""
    if _is_half(a.dtype) and a.dtype == b.dtype:
        return _half_einsum(spec, a, b)
    kwargs = product_kwargs(a.dtype, policy)
    if a.dtype == b.dtype == jnp.float32 and _onednn_product(a, b, spec):
        return _onednn_f32_einsum(spec.replace(" ", ""), tuple(sorted(kwargs.items())), a, b)
    return jnp.einsum(spec, a, b, **kwargs)


def dense(x: jax.Array, w: jax.Array, policy: Policy | None = None, fp8_history: jax.Array | None = None) -> jax.Array:
    """`x @ w` over the last axis of `x` (any batch axes before it), `w` cast to `x`'s dtype, accumulated as
    `einsum` does: the product of Dense, the recurrent cells and every projection. Under a policy with
    `fp8_products`, in float8 where the widths allow (`jaxnn.fp8`): scaled from `fp8_history` where the kernel
    has one and the policy scales from past steps (`fp8_history` > 0), else from the operands themselves."""
    x2 = x.reshape(-1, x.shape[-1])
    if policy is not None and policy.fp8_products and _is_half(x.dtype) and fp8.fits(*w.shape):
        if fp8_history is not None and policy.fp8_history:  # only a step that writes the histories reads them
            y = fp8.delayed_matmul(x2, w.astype(x.dtype), fp8_history)
        else:
            y = fp8.matmul(x2, w.astype(x.dtype))
    else:
        y = einsum("mk,kn->mn", x2, w.astype(x.dtype), policy)
    return y.reshape(*x.shape[:-1], w.shape[-1])


def _half_conv_forward(lhs: jax.Array, rhs: jax.Array, conv_kwargs: dict[str, Any]) -> jax.Array:
    """A half-precision convolution's forward product, as an f32 result, in the form that reaches each platform's
    matrix units.

    On the CPU, bf16 x bf16 -> f32 (XLA's CPU convolution accepts it and runs at the same rate as bf16 -> bf16).
    On GPUs, XLA's compiler upcasts both operands of a convolution whose result is wider than them (they are no
    longer "the same type" cuDNN needs), so cuDNN would run an f32/TF32 convolution; asking for a half-precision
    result keeps the operands half precision, and cuDNN accumulates half-precision convolutions in f32 inside the
    kernel. Only the stored result is rounded, once, before the cast to f32.
    """

    def accelerator(lhs, rhs):
        return lax.conv_general_dilated(lhs, rhs, **conv_kwargs).astype(jnp.float32)

    def cpu(lhs, rhs):
        return lax.conv_general_dilated(lhs, rhs, **conv_kwargs, preferred_element_type=jnp.float32)

    return lax.platform_dependent(lhs, rhs, cpu=cpu, default=accelerator)


def conv(lhs: jax.Array, rhs: jax.Array, policy: Policy | None = None, **conv_kwargs: Any) -> jax.Array:
    """`lax.conv_general_dilated` accumulating in float32 or wider. For half-precision operands the backward
    convolutions take a half-precision cotangent and return half-precision gradients (cuDNN accumulates those in
    float32; XLA's CPU convolution runs at the same rate in either form), and the forward product takes each
    platform's fast form (`_half_conv_forward`)."""
    if not (_is_half(lhs.dtype) and lhs.dtype == rhs.dtype):
        return lax.conv_general_dilated(lhs, rhs, **conv_kwargs, **product_kwargs(lhs.dtype, policy))

    @jax.custom_vjp
    def half_conv(lhs, rhs):
        return _half_conv_forward(lhs, rhs, conv_kwargs)

    def fwd(lhs, rhs):
        return half_conv(lhs, rhs), (lhs, rhs)

    def bwd(residuals, g):
        lhs, rhs = residuals
        _, transpose = jax.vjp(lambda x, w: lax.conv_general_dilated(x, w, **conv_kwargs), lhs, rhs)
        return transpose(g.astype(lhs.dtype))

    half_conv.defvjp(fwd, bwd)
    return half_conv(lhs, rhs)
