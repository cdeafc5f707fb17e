"""A frozen base stored quantised, for LoRA over a base that would not fit in full precision (QLoRA's recipe):
`LoRA(base="int8")` or `LoRA(base="nf4")` stores every weight the adapters attach to as integer codes and scales,
and each product dequantises its weight in the compute dtype just before the matmul.

- int8: symmetric, one scale per output channel (absmax / 127.5): 1 byte a weight, about 0.6% relative error
  on normally distributed weights.
- nf4: 4-bit NormalFloat codes (the 16 quantiles of a normal distribution, as QLoRA defines them), one scale per
  block of up to 64 inputs of an output channel, two codes packed in a byte: 0.5 bytes a weight (+ 4 bytes per
  block), about 9% relative error on normally distributed weights, which the adapters train around.

A weight `w` (stack..., in, out) becomes `w_q` (int8 codes, or uint8 holding two nf4 codes along `in`) and
`w_scale` (float32) in the same params dict: plain arrays, so checkpoints, sharding rules and `Repeat` stacks need
nothing new. The codes and scales come from Qwix (`qwix.quantize`, `qwix.dequantize`), Google's JAX
quantisation library; the packing of two nf4 codes a byte is jaxnn's, so that memory is what the figures say on
every backend. The dequantised weight is never kept for the backward pass: the product is rematerialised
(`jax.checkpoint`), so activations saved per layer stay those of the full-precision model.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxnn import precision
from jaxnn._src.pytree import flatten, unflatten

BASES = ("int8", "nf4")
NF4_BLOCK = 64  # inputs per nf4 scale, QLoRA's block size


def _qwix() -> Any:
    from jaxnn._src.optional import require

    return require("qwix", "LoRA over a quantised base (base=int8 or nf4)")


def check_base(base: Any) -> str | None:
    """`base` if it names a known quantised base (or is None); otherwise a ValueError listing them."""
    if base is None or base in BASES:
        return base
    raise ValueError(f"LoRA: base={base!r} is not a quantised base; give one of {', '.join(BASES)}")


def _block(fan_in: int) -> int:
    """The largest block of inputs that divides `fan_in`, at most NF4_BLOCK, so every scale covers whole blocks."""
    return next(b for b in (NF4_BLOCK, 32, 16, 8, 4, 2, 1) if fan_in % b == 0)


def quantize_weight(w: Any, base: str, name: str = "w") -> tuple[jax.Array, jax.Array]:
    """`(codes, scale)` of a weight of shape (stack..., in, out): int8 codes with one scale per output channel, or
    nf4 codes packed two a byte along `in` with one scale per block of inputs. An nf4 weight with an odd number of
    inputs is a ValueError naming it (two codes share a byte along that axis)."""
    qwix = _qwix()
    w = jnp.asarray(w, jnp.float32)
    *stack, fan_in, _ = w.shape
    keep = [*range(len(stack)), w.ndim - 1]  # every stacked layer and output channel gets its own scales
    if base == "int8":
        q = qwix.quantize(w, jnp.int8, channelwise_axes=keep)
        return q.qvalue, q.scale.astype(jnp.float32)
    if fan_in % 2:
        raise ValueError(
            f"LoRA base=nf4: {name} has {fan_in} inputs; nf4 packs two codes a byte, so it needs an even count"
        )
    q = qwix.quantize(w, "nf4", channelwise_axes=keep, tiled_axes={w.ndim - 2: _block(fan_in)})
    codes = q.qvalue.astype(jnp.uint8).reshape(*stack, fan_in // 2, 2, -1)
    return codes[..., 0, :] | (codes[..., 1, :] << 4), q.scale.astype(jnp.float32)


def dequantize_weight(codes: jax.Array, scale: jax.Array, dtype: Any = jnp.float32) -> jax.Array:
    """The weight `quantize_weight` stored, in `dtype`: int8 codes times their channel scales, or nf4 codes
    (unpacked from their bytes) mapped to their quantiles times their block scales."""
    qwix = _qwix()
    if codes.dtype == jnp.int8:
        return qwix.dequantize(qwix.QArray(codes, scale.astype(dtype)))
    pairs = jnp.stack([codes & 0x0F, codes >> 4], axis=-2)  # (stack..., in/2, 2, out): low nibble first
    nibbles = pairs.reshape(*codes.shape[:-2], 2 * codes.shape[-2], codes.shape[-1]).astype(jnp.uint4)
    return qwix.dequantize(qwix.QArray(nibbles, scale.astype(dtype), qtype="nf4"))


def dense_product(x: jax.Array, codes: jax.Array, scale: jax.Array, policy: Any) -> jax.Array:
    """`x @ w` for a stored quantised `w`, dequantised in the compute dtype. Rematerialised: the backward pass
    dequantises again instead of keeping the full-precision weight of every layer alive."""
    compute = jnp.result_type(precision.get_policy(policy).compute_dtype)

    def product(x, codes, scale):
        return precision.dense(x, dequantize_weight(codes, scale, compute), policy)

    return jax.checkpoint(product)(x, codes, scale)


def weight_shape(codes: Any) -> tuple[int, ...]:
    """The (stack..., in, out) shape of the weight stored as `codes`."""
    *stack, rows, out = np.shape(codes)
    return (*stack, rows * (1 if np.dtype(codes.dtype) == np.int8 else 2), out)


def parameter_count(params: Any) -> int:
    """How many parameters `params` hold, a quantised weight counted by its weight's shape (two nf4 codes a byte
    are two parameters) and its scales, which only say how to read the codes, not at all."""
    count = 0
    for name, leaf in flatten(params).items():
        if name.endswith(".w_q"):
            count += int(np.prod(weight_shape(leaf)))
        elif not name.endswith(".w_scale"):
            count += int(np.size(leaf))
    return count


def is_quantized(params: Any) -> bool:
    """Whether `params` hold any weight stored quantised."""
    return any(name.endswith(".w_q") for name in flatten(params))


def quantize_params(params: Any, weights: list[str], base: str) -> Any:
    """`params` with each weight in `weights` (dotted names ending ".w") stored as `w_q` and `w_scale`."""
    flat = dict(flatten(params))
    for name in weights:
        stem = name[: -len(".w")]
        flat[f"{stem}.w_q"], flat[f"{stem}.w_scale"] = quantize_weight(flat.pop(name), base, name)
    return unflatten(flat)


def dequantize_params(params: Any) -> Any:
    """`params` with every quantised weight back as a float32 `w` (what merging and every export need)."""
    if not is_quantized(params):
        return params
    flat = dict(flatten(params))
    for name in [n for n in flat if n.endswith(".w_q")]:
        stem = name[: -len(".w_q")]
        flat[f"{stem}.w"] = dequantize_weight(flat.pop(name), flat.pop(f"{stem}.w_scale"))
    return unflatten(flat)


def stored_bytes(params: Any) -> int:
    """Bytes the arrays of `params` occupy as stored (codes, scales and every other leaf)."""
    return sum(int(np.size(leaf)) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(params))


__all__ = [
    "BASES",
    "NF4_BLOCK",
    "check_base",
    "dense_product",
    "dequantize_params",
    "dequantize_weight",
    "is_quantized",
    "quantize_params",
    "quantize_weight",
    "stored_bytes",
    "weight_shape",
]
