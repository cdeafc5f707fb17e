"""Which attention product runs: jax's XLA path, cuDNN's fused kernel, the float32-accumulating path or the
blocked CPU path (`jaxnn.layers.blocked_attention`), chosen per lowering platform for "auto".

The layer (`jaxnn.layers.attention.MultiHeadAttention`) projects and masks; this module only computes
softmax(q k^T / sqrt(H)) v. Shape suffixes as in `jaxnn.layers.attention`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import DTypeLike

from jaxnn import precision
from jaxnn.layers.blocked_attention import attention as attention_in_blocks

IMPLEMENTATIONS = ("auto", "xla", "cudnn", "f32acc", "blocked")


def attention_f32acc(
    q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, valid: jax.Array | None, policy: Any
) -> jax.Array:
    """Attention with both products accumulated in float32 and softmax in float32; `valid` broadcasts to
    (B, 1, T, S) (None: every key). Grouped-query heads share their key/value head without copying it.

    jax.nn.dot_product_attention's XLA path returns the probs @ values product in the input dtype, which XLA's CPU
    backend runs as a slow bf16 -> bf16 dot instead of on the AMX units; this path keeps every product
    bf16 x bf16 -> f32.
    """
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    if K != N:
        return _grouped_attention_f32acc(q_BTNH, k_BSKH, v_BSKH, valid, policy)
    logits_BNTS = precision.einsum("BTNH,BSNH->BNTS", q_BTNH, k_BSKH, policy) / jnp.sqrt(H)
    if valid is not None:
        logits_BNTS = jnp.where(valid, logits_BNTS, jnp.finfo(logits_BNTS.dtype).min)
    probs_BNTS = jax.nn.softmax(logits_BNTS, axis=-1).astype(v_BSKH.dtype)
    return precision.einsum("BNTS,BSNH->BTNH", probs_BNTS, v_BSKH, policy).astype(v_BSKH.dtype)


def _grouped_attention_f32acc(q_BTNH, k_BSKH, v_BSKH, valid, policy):
    """`attention_f32acc` for K < N key/value heads. The G = N // K query heads of a key/value head are folded
    into the query axis (Q = G * T), so each product has one free axis per operand: the only bf16 x bf16 -> f32
    dot form XLA's CPU backend runs, and no key or value is copied G times."""
    B, T, N, H = q_BTNH.shape
    S, K = k_BSKH.shape[1:3]
    G = N // K
    q_BKQH = q_BTNH.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, H)
    logits_BKGTS = (precision.einsum("BKQH,BSKH->BKQS", q_BKQH, k_BSKH, policy) / jnp.sqrt(H)).reshape(B, K, G, T, S)
    if valid is not None:
        logits_BKGTS = jnp.where(valid[:, :, None], logits_BKGTS, jnp.finfo(logits_BKGTS.dtype).min)
    probs_BKQS = jax.nn.softmax(logits_BKGTS, axis=-1).astype(v_BSKH.dtype).reshape(B, K, G * T, S)
    o_BKQH = precision.einsum("BKQS,BSKH->BKQH", probs_BKQS, v_BSKH, policy)
    return o_BKQH.reshape(B, K, G, T, H).transpose(0, 3, 1, 2, 4).reshape(B, T, N, H).astype(v_BSKH.dtype)


def _is_half(dtype) -> bool:
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _choose_implementation(implementation: str, dtype) -> str:
    """The implementation for every lowering platform but CUDA (where "auto" may take cuDNN, `_cudnn_traces`) and
    the CPU (where "auto" takes the blocked path for float32, `dispatch`)."""
    if implementation != "auto":
        return implementation
    if _is_half(dtype) or jnp.dtype(dtype) == jnp.float64:
        return "f32acc"  # jax's XLA path would compute float64 softmax in float32, and half-precision p @ v in half
    return "xla"


def cpu_implementation(dtype: DTypeLike, grouped: bool = False) -> str:
    """The implementation "auto" runs where the computation is lowered for the CPU: the blocked path for float32
    with as many key/value heads as query heads (`jaxnn.layers.blocked_attention`, measured faster there), else as
    on every other platform but CUDA."""
    impl = _choose_implementation("auto", dtype)
    return "blocked" if impl == "xla" and not grouped else impl


def _cudnn_traces(q_BTNH, k_BSKH, v_BSKH, mask_B11S, causal) -> bool:
    """Whether jax's cuDNN attention can be traced for these operands in this process.

    jax checks for cuDNN (through its CUDA plugin) and the shape limits of the kernel (head width a multiple of 8,
    at most 128 or 256) when it traces, not when it lowers: on a CPU-only jax, even `jax.export(...,
    platforms=["cuda"])` of `implementation="cudnn"` fails with "cuDNN is not detected". So "auto" offers the cuDNN
    branch only where it can be traced; elsewhere the CUDA lowering gets the f32-accumulating path.
    """

    def spec(a):
        return None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype)

    def cudnn(q, k, v, mask):
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, implementation="cudnn")

    try:
        jax.eval_shape(cudnn, spec(q_BTNH), spec(k_BSKH), spec(v_BSKH), spec(mask_B11S))
    except (RuntimeError, NotImplementedError, ValueError):
        return False
    return True


def _attention(impl, q_BTNH, k_BSKH, v_BSKH, mask_B11S, causal, policy, padded):
    if impl == "f32acc":
        T, S = q_BTNH.shape[1], k_BSKH.shape[1]
        valid = jnp.tril(jnp.ones((1, 1, T, S), bool)) if causal else None
        if mask_B11S is not None:
            valid = mask_B11S if valid is None else valid & mask_B11S
        return attention_f32acc(q_BTNH, k_BSKH, v_BSKH, valid, policy)
    if impl == "blocked":
        G = q_BTNH.shape[2] // k_BSKH.shape[2]
        k_BSNH, v_BSNH = (jnp.repeat(x, G, axis=2) if G > 1 else x for x in (k_BSKH, v_BSKH))
        return attention_in_blocks(q_BTNH, k_BSNH, v_BSNH, mask_B11S, causal, skip_hidden_keys=not padded)
    return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, mask=mask_B11S, is_causal=causal, implementation=impl)


def dispatch(
    implementation: str,
    q_BTNH: jax.Array,
    k_BSKH: jax.Array,
    v_BSKH: jax.Array,
    mask_B11S: jax.Array | None,
    causal: bool,
    policy: Any,
    padded: bool,
) -> jax.Array:
    """Attention in the implementation asked for; "auto" picks per lowering platform (see MultiHeadAttention).
    `padded`: whether `mask_B11S` holds a padding mask (a query may then see no key at all)."""
    impl = _choose_implementation(implementation, q_BTNH.dtype)

    def run(impl):
        return lambda q, k, v, mask: _attention(impl, q, k, v, mask, causal, policy, padded)

    args = (q_BTNH, k_BSKH, v_BSKH, mask_B11S)
    if implementation == "auto" and _is_half(q_BTNH.dtype) and _cudnn_traces(*args, causal):
        # cuDNN's fused flash-attention kernel where the computation is lowered for CUDA; the choice follows the
        # platform jax lowers for (a program traced here can be exported for another), not the default backend.
        return lax.platform_dependent(*args, cuda=run("cudnn"), default=run(impl))
    grouped = k_BSKH.shape[2] != q_BTNH.shape[2]
    if implementation == "auto" and impl != (cpu := cpu_implementation(q_BTNH.dtype, grouped)):
        return lax.platform_dependent(*args, cpu=run(cpu), default=run(impl))
    return run(impl)(*args)
