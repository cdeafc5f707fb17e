"""Multi-head self-attention and the pre-norm transformer block.

Shape suffixes: B batch, T query positions, S key positions, D model width, N heads, H head width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.nn import initializers

from jaxnn import precision
from jaxnn.layers.activation import Dropout, Gelu
from jaxnn.layers.core import Layer, check_positive, residual, serial, shape_error
from jaxnn.layers.linear import Dense
from jaxnn.layers.norm import LayerNorm

IMPLEMENTATIONS = ("auto", "xla", "cudnn", "f32acc")


def _attention_f32acc(q_BTNH, k_BSNH, v_BSNH, mask_B11S, causal, policy):
    """Attention with both products accumulated in float32 and softmax in float32.

    jax.nn.dot_product_attention's XLA path returns the probs @ values product in the input dtype, which XLA's CPU
    backend runs as a slow bf16 -> bf16 dot instead of on the AMX units; this path keeps every product
    bf16 x bf16 -> f32.
    """
    scale = 1.0 / jnp.sqrt(q_BTNH.shape[-1])
    logits_BNTS = precision.einsum("BTNH,BSNH->BNTS", q_BTNH, k_BSNH, policy) * scale
    valid = jnp.ones((1, 1, q_BTNH.shape[1], k_BSNH.shape[1]), bool)
    if causal:
        valid = jnp.tril(valid)
    if mask_B11S is not None:
        valid = valid & mask_B11S
    logits_BNTS = jnp.where(valid, logits_BNTS, jnp.finfo(logits_BNTS.dtype).min)
    probs_BNTS = jax.nn.softmax(logits_BNTS, axis=-1).astype(v_BSNH.dtype)
    return precision.einsum("BNTS,BSNH->BTNH", probs_BNTS, v_BSNH, policy).astype(v_BSNH.dtype)


def _is_half(dtype) -> bool:
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _choose_implementation(implementation: str, dtype) -> str:
    """The implementation for every lowering platform but CUDA (where "auto" may take cuDNN, `_cudnn_traces`)."""
    if implementation != "auto":
        return implementation
    if _is_half(dtype) or jnp.dtype(dtype) == jnp.float64:
        return "f32acc"  # jax's XLA path would compute float64 softmax in float32, and half-precision p @ v in half
    return "xla"


def _cudnn_traces(q_BTNH, k_BSNH, v_BSNH, mask_B11S, causal) -> bool:
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
        jax.eval_shape(cudnn, spec(q_BTNH), spec(k_BSNH), spec(v_BSNH), spec(mask_B11S))
    except (RuntimeError, NotImplementedError, ValueError):
        return False
    return True


def _attention(
    impl: str,
    q_BTNH: jax.Array,
    k_BSNH: jax.Array,
    v_BSNH: jax.Array,
    mask_B11S: jax.Array | None,
    causal: bool,
    policy: precision.Policy | None,
) -> jax.Array:
    if impl == "f32acc":
        return _attention_f32acc(q_BTNH, k_BSNH, v_BSNH, mask_B11S, causal, policy)
    # jax's overloads take implementation as Literal["xla", "cudnn"] | None; impl is a str checked against
    # IMPLEMENTATIONS at construction, so no overload matches the plain str.
    return jax.nn.dot_product_attention(  # type: ignore[call-overload]
        q_BTNH, k_BSNH, v_BSNH, mask=mask_B11S, is_causal=causal, implementation=impl
    )


def MultiHeadAttention(
    num_heads: int,
    head_dim: int | None = None,
    *,
    causal: bool = False,
    implementation: str = "auto",
    name: str = "attention",
) -> Layer:
    """Self-attention over (B, T, D) inputs with `num_heads` heads of width `head_dim` (default D // num_heads).

    Params: `qkv` (one fused Dense producing queries, keys and values) and `out`. `apply(..., mask=)` takes a
    (B, T) boolean padding mask, True for real tokens; `causal=True` lets position t see positions <= t only.
    `implementation`: "auto" uses cuDNN's fused kernel for bf16/fp16 when the computation is lowered for CUDA and
    jax can trace cuDNN attention here (a CUDA jax with cuDNN, and shapes the kernel takes), the f32-accumulating
    path for half precision and float64 otherwise, and jax's XLA path for float32; "xla", "cudnn" and "f32acc" force
    one. The platform is the one jax lowers for (`lax.platform_dependent`), not the process's default backend.
    """
    check_positive("MultiHeadAttention", num_heads=num_heads)
    if head_dim is not None:
        check_positive("MultiHeadAttention", head_dim=head_dim)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"MultiHeadAttention: unknown implementation {implementation!r}; choose one of {IMPLEMENTATIONS}"
        )

    def dims(width):
        h = head_dim or width // num_heads
        return h, num_heads * h

    def init(key, in_shape):
        if len(in_shape) != 3:
            raise shape_error(name, "of rank 3 (batch, time, features)", in_shape)
        width = in_shape[-1]
        if head_dim is None and width % num_heads:
            raise shape_error(name, f"with features divisible by num_heads {num_heads}", in_shape)
        _, inner = dims(width)
        k_qkv, k_out = jax.random.split(key)
        _, qkv = Dense(3 * inner, w_init=initializers.lecun_normal()).init(k_qkv, in_shape)
        _, out = Dense(width).init(k_out, (*in_shape[:-1], inner))
        return tuple(in_shape), {"qkv": qkv, "out": out}

    def apply(params, x_BTD, *, mask=None, policy=None, **_):
        B, T, D = x_BTD.shape
        H, inner = dims(D)
        qkv = Dense(3 * inner).apply(params["qkv"], x_BTD, policy=policy)
        q_BTNH, k_BTNH, v_BTNH = (t.reshape(B, T, num_heads, H) for t in jnp.split(qkv, 3, axis=-1))
        mask_B11S = None if mask is None else mask.astype(bool)[:, None, None, :]
        impl = _choose_implementation(implementation, x_BTD.dtype)
        if (
            implementation == "auto"
            and _is_half(x_BTD.dtype)
            and _cudnn_traces(q_BTNH, k_BTNH, v_BTNH, mask_B11S, causal)
        ):
            # cuDNN's fused flash-attention kernel where the computation is lowered for CUDA; the choice follows the
            # platform jax lowers for (a program traced here can be exported for another), not the default backend.
            o_BTNH = lax.platform_dependent(
                q_BTNH,
                k_BTNH,
                v_BTNH,
                mask_B11S,
                cuda=lambda q, k, v, mask: _attention("cudnn", q, k, v, mask, causal, policy),
                default=lambda q, k, v, mask: _attention(impl, q, k, v, mask, causal, policy),
            )
        else:
            o_BTNH = _attention(impl, q_BTNH, k_BTNH, v_BTNH, mask_B11S, causal, policy)
        return Dense(D).apply(params["out"], o_BTNH.reshape(B, T, inner), policy=policy)

    return Layer(init, apply, name)


def TransformerBlock(
    num_heads: int,
    *,
    mlp_ratio: int = 4,
    drop_prob: float = 0.0,
    causal: bool = True,
    attention_implementation: str = "auto",
    name: str = "block",
) -> Layer:
    """Pre-norm transformer block: x + Attention(LN(x)), then x + MLP(LN(x)) with a GELU MLP of mlp_ratio * D."""
    check_positive("TransformerBlock", mlp_ratio=mlp_ratio)

    def init(key, in_shape):
        if len(in_shape) != 3:
            raise shape_error(name, "of rank 3 (batch, time, features)", in_shape)
        return build(in_shape[-1]).init(key, in_shape)

    def build(width):
        return serial(
            residual(
                LayerNorm(name="ln"),
                MultiHeadAttention(num_heads, causal=causal, implementation=attention_implementation),
                Dropout(drop_prob),
                name="attn",
            ),
            residual(
                LayerNorm(name="ln"),
                Dense(mlp_ratio * width, name="fc"),
                Gelu,
                Dense(width, name="proj"),
                Dropout(drop_prob),
                name="mlp",
            ),
            name=name,
        )

    def apply(params, x, **kwargs):
        return build(x.shape[-1]).apply(params, x, **kwargs)

    Dropout(drop_prob)  # refuse a bad drop_prob at construction, not at init
    return Layer(init, apply, name)
