"""Multi-head attention (self, cross, grouped-query; rotary positions; a decoding cache) and the pre-norm
transformer block.

Shape suffixes: B batch, T query positions, S key positions, L cache length, D model width, N query heads,
K key/value heads (N a multiple of K), G = N // K query heads per key/value head, H head width.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.nn import initializers
from jax.typing import DTypeLike

from jaxnn import precision
from jaxnn.layers.activation import Dropout, Gelu
from jaxnn.layers.blocked_attention import attention as attention_in_blocks
from jaxnn.layers.combinators import Lambda, residual, serial
from jaxnn.layers.core import (
    Layer,
    LayerError,
    check_keywords,
    check_positive,
    describe,
    shape_error,
    with_name,
)
from jaxnn.layers.core import init_cache as init_cache_of
from jaxnn.layers.linear import Dense, check_positions
from jaxnn.layers.norm import LayerNorm, RMSNorm
from jaxnn.layers.stack import remat_layer, remat_policy
from jaxnn.parallel.activations import BATCH, HIDDEN, constrain

IMPLEMENTATIONS = ("auto", "xla", "cudnn", "f32acc", "blocked")


def rotary_embedding(x_BTNH: jax.Array, positions_BT: jax.Array, base: float = 10000.0) -> jax.Array:
    """Rotates each head vector by its position (RoPE, as in GPT-NeoX and Llama: the first and second halves of
    the head are the real and imaginary parts), so that q . k depends on the positions only through their
    difference. Computed in float32 (float64 for float64 inputs), returned in the input's dtype."""
    H = x_BTNH.shape[-1]
    if H % 2:
        raise ValueError(f"rotary_embedding: the head width (last axis) must be even, got {H} in {x_BTNH.shape}")
    wide = precision.accumulation_dtype(x_BTNH.dtype)
    inv_freq = base ** (-jnp.arange(0, H // 2, dtype=wide) * 2 / H)
    angle_BTH = positions_BT[..., None].astype(wide) * inv_freq[None, None, :]
    cos, sin = (f(angle_BTH)[:, :, None, :] for f in (jnp.cos, jnp.sin))
    x1, x2 = jnp.split(x_BTNH.astype(wide), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BTNH.dtype)


def _attention_f32acc(q_BTNH, k_BSKH, v_BSKH, valid, policy):
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
    """`_attention_f32acc` for K < N key/value heads. The G = N // K query heads of a key/value head are folded
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
    the CPU (where "auto" takes the blocked path for float32, `_dispatch`)."""
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
        return _attention_f32acc(q_BTNH, k_BSKH, v_BSKH, valid, policy)
    if impl == "blocked":
        G = q_BTNH.shape[2] // k_BSKH.shape[2]
        k_BSNH, v_BSNH = (jnp.repeat(x, G, axis=2) if G > 1 else x for x in (k_BSKH, v_BSKH))
        return attention_in_blocks(q_BTNH, k_BSNH, v_BSNH, mask_B11S, causal, skip_hidden_keys=not padded)
    return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, mask=mask_B11S, is_causal=causal, implementation=impl)


def _dispatch(implementation, q_BTNH, k_BSKH, v_BSKH, mask_B11S, causal, policy, padded):
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


def _check_mask(name: str, arg: str, mask: jax.Array | None, shape: tuple[int, int]) -> jax.Array | None:
    """A (B, S) padding mask as a (B, 1, 1, S) bool key mask, or a one-line error naming both shapes."""
    if mask is None:
        return None
    if tuple(mask.shape) != tuple(shape) or not (mask.dtype == bool or jnp.issubdtype(mask.dtype, jnp.integer)):
        raise LayerError(name, f"{arg} must be bool of shape {tuple(shape)}, got {mask.dtype} {tuple(mask.shape)}")
    return mask.astype(bool)[:, None, None, :]


def _check_config(num_heads, head_dim, num_kv_heads, implementation, cross, causal, rope) -> int:
    """Refuses a bad construction in one line; returns the number of key/value heads."""
    check_positive("MultiHeadAttention", num_heads=num_heads)
    if head_dim is not None:
        check_positive("MultiHeadAttention", head_dim=head_dim)
    kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    check_positive("MultiHeadAttention", num_kv_heads=kv_heads)
    if num_heads % kv_heads:
        raise ValueError(f"MultiHeadAttention: num_heads {num_heads} is not a multiple of num_kv_heads {kv_heads}")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"MultiHeadAttention: unknown implementation {implementation!r}; choose one of {IMPLEMENTATIONS}"
        )
    if cross and (causal or rope):
        raise ValueError("MultiHeadAttention: cross-attention takes neither causal=True nor rope=True")
    if rope and head_dim is not None and head_dim % 2:
        raise ValueError(f"MultiHeadAttention: rotary embeddings need an even head_dim, got {head_dim}")
    return kv_heads


class _Projections(NamedTuple):
    """Attention's input and output projections: a fused qkv Dense, or q (from x) and kv (from x or the context)."""

    num_heads: int
    kv_heads: int
    head_dim: int | None
    fused: bool
    context_features: int | None
    w_init: initializers.Initializer
    rope: bool
    bias: bool
    name: str

    def head_width(self, width: int) -> int:
        return self.head_dim or width // self.num_heads

    def dense(self, features: int, name: str = "dense") -> Layer:
        return Dense(features, use_bias=self.bias, w_init=self.w_init, name=name)

    def init(self, key: jax.Array, in_shape: tuple[int, ...]) -> dict:
        if len(in_shape) != 3:
            raise shape_error(self.name, "of rank 3 (batch, time, features)", in_shape)
        D, N, K = in_shape[-1], self.num_heads, self.kv_heads
        if self.head_dim is None and D % N:
            raise shape_error(self.name, f"with features divisible by num_heads {N}", in_shape)
        H = self.head_width(D)
        if self.rope and H % 2:
            raise shape_error(self.name, f"with an even head width for rotary embeddings (head width {H})", in_shape)
        # Two keys for the fused form (as jaxnn has always drawn them: a fixed seed keeps its initial weights).
        k_q, k_out, *k_kv = jax.random.split(key, 2 if self.fused else 3)
        if self.fused:
            params = {"qkv": self.dense(3 * N * H).init(k_q, in_shape)[1]}
        else:
            source = (in_shape[0], in_shape[1], self.context_features or D)
            params = {
                "q": self.dense(N * H).init(k_q, in_shape)[1],
                "kv": self.dense(2 * K * H).init(k_kv[0], source)[1],
            }
        params["out"] = self.dense(D).init(k_out, (*in_shape[:-1], N * H))[1]
        return params

    def project(self, params: dict, x_BTD: jax.Array, source_BSE: jax.Array, policy: Any) -> tuple:
        """Queries from x; keys and values from `source` (x itself, or the context)."""
        B, T, D = x_BTD.shape
        H, N, K = self.head_width(D), self.num_heads, self.kv_heads
        if self.fused:
            qkv = self.dense(3 * N * H, "qkv").apply(params["qkv"], x_BTD, policy=policy)
            return tuple(t.reshape(B, T, N, H) for t in jnp.split(qkv, 3, axis=-1))
        q = self.dense(N * H, "q").apply(params["q"], x_BTD, policy=policy)
        kv = self.dense(2 * K * H, "kv").apply(params["kv"], source_BSE, policy=policy)
        k, v = (t.reshape(B, source_BSE.shape[1], K, H) for t in jnp.split(kv, 2, axis=-1))
        return q.reshape(B, T, N, H), k, v


@describe
def MultiHeadAttention(
    num_heads: int,
    head_dim: int | None = None,
    *,
    num_kv_heads: int | None = None,
    causal: bool = False,
    cross: bool = False,
    context_features: int | None = None,
    rope: bool = False,
    rope_base: float = 10000.0,
    implementation: str = "auto",
    bias: bool = True,
    w_init: initializers.Initializer = initializers.lecun_normal(),
    name: str = "attention",
) -> Layer:
    """Attention over (B, T, D) inputs with `num_heads` query heads of width `head_dim` (default D // num_heads).

    - Self-attention by default; `cross=True` reads keys and values from the `context` side input (B, S, Dc),
      Dc = `context_features` (default D), with its padding mask `context_mask` (B, S).
    - `num_kv_heads` < num_heads: grouped-query attention (1: multi-query); each key/value head serves
      num_heads // num_kv_heads query heads.
    - `mask`: (B, T) bool padding mask of x's positions, True for real tokens; `causal=True` lets position t see
      positions <= t only. `segment_ids` (B, T) ints: a packed batch (`jaxnn.data.packing`), where a position sees
      only positions of its own segment (with `positions` restarting per segment for rotary attention).
      `rope=True` rotates queries and keys by their positions (`positions` side input, default 0..T-1;
      `rotary_embedding`).
    - Params: `qkv` (one fused Dense) for self-attention with num_kv_heads == num_heads, else `q` and `kv`; `out`;
      `bias=False` leaves out their biases (as Llama does).
    - Causal self-attention decodes with a cache (`init_cache`): keys, values and padding mask of every position
      seen so far (a left-padded batch decodes with `mask` and `positions` given per call). Decoding past the
      cache's length is refused in eager calls and gives NaN outputs under jit.
    `implementation`: "auto" takes cuDNN's fused kernel for bf16/fp16 lowered for CUDA where jax can trace it here,
    the f32-accumulating path for half precision and float64 otherwise, and for float32 the blocked path lowered for
    the CPU (`cpu_implementation`) and jax's XLA path elsewhere; "xla", "cudnn", "f32acc" and "blocked" force one.
    The platform is the one jax lowers for (`lax.platform_dependent`), not the process's default backend.
    """
    kv_heads = _check_config(num_heads, head_dim, num_kv_heads, implementation, cross, causal, rope)
    fused = not cross and kv_heads == num_heads
    side_inputs = frozenset(
        {"context", "context_mask"} if cross else {"mask", "segment_ids", *(("positions",) if rope else ())}
    )

    heads = _Projections(num_heads, kv_heads, head_dim, fused, context_features, w_init, rope, bias, name)

    def init(key, in_shape):
        return tuple(in_shape), heads.init(key, in_shape)

    def apply(params, x_BTD, *, policy=None, cache=None, **kwargs):
        check_keywords(name, kwargs, side_inputs)
        if x_BTD.ndim != 3:
            raise shape_error(name, "of rank 3 (batch, time, features)", x_BTD.shape)
        B, T, D = x_BTD.shape
        source, key_mask = _source_and_key_mask(name, cross, x_BTD, kwargs)
        positions = kwargs.get("positions")
        if positions is not None:
            check_positions(name, positions, x_BTD.shape)
        segments = _check_segments(name, kwargs.get("segment_ids"), x_BTD.shape[:2], cache)
        q, k, v = heads.project(params, x_BTD, source, policy)
        if cache is not None:
            o, cache = _decode(name, q, k, v, cache, positions, key_mask, rope_base if rope else None, policy)
        else:
            rotary = rope_base if rope else None
            o = _attend(implementation, q, k, v, positions, key_mask, segments, causal, rotary, policy)
        y = heads.dense(D, "out").apply(params["out"], o.reshape(B, T, -1), policy=policy)
        return y if cache is None else (y, cache)

    def init_cache(in_shape, max_len, dtype):
        if len(in_shape) != 3:
            raise shape_error(name, "of rank 3 (batch, time, features)", in_shape)
        zeros = jnp.zeros((in_shape[0], max_len, kv_heads, heads.head_width(in_shape[-1])), dtype)
        real = jnp.zeros((in_shape[0], max_len), bool)
        return {"k": zeros, "v": zeros, "mask": real, "index": jnp.zeros((), jnp.int32)}

    decodes = causal and not cross
    return Layer(
        init, with_name(name, apply), name, side_inputs=side_inputs, init_cache=init_cache if decodes else None
    )


def _attend(
    implementation, q_BTNH, k_BSKH, v_BSKH, positions_BT, key_mask_B11S, segments_BT, causal, rope_base, policy
):
    """Attention over a whole sequence (no cache): rotary positions (`rope_base` None: none), then the masks and
    the implementation's path."""
    if rope_base is not None:
        B, T = q_BTNH.shape[:2]
        positions_BT = jnp.broadcast_to(jnp.arange(T), (B, T)) if positions_BT is None else positions_BT
        q_BTNH, k_BSKH = (rotary_embedding(x, positions_BT, rope_base) for x in (q_BTNH, k_BSKH))
    mask = _with_segments(key_mask_B11S, segments_BT)
    return _dispatch(implementation, q_BTNH, k_BSKH, v_BSKH, mask, causal, policy, padded=key_mask_B11S is not None)


def _check_segments(name: str, segment_ids: Any, shape: tuple[int, int], cache: Any) -> jax.Array | None:
    """A packed batch's (B, T) integer segment ids (`jaxnn.data.packing`), checked; None when not given."""
    if segment_ids is None:
        return None
    if cache is not None:
        raise LayerError(name, "segment_ids are for packed training batches; decoding with a cache takes none")
    if tuple(segment_ids.shape) != tuple(shape) or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise LayerError(
            name, f"segment_ids must be integers of shape {tuple(shape)}, got {segment_ids.dtype} {segment_ids.shape}"
        )
    return segment_ids


def _with_segments(key_mask_B11S: jax.Array | None, segments_BT: jax.Array | None) -> jax.Array | None:
    """The key mask, narrowed to keys of the query's own segment: (B, 1, T, S), or the key mask unchanged."""
    if segments_BT is None:
        return key_mask_B11S
    same_B1TS = segments_BT[:, None, :, None] == segments_BT[:, None, None, :]
    return same_B1TS if key_mask_B11S is None else same_B1TS & key_mask_B11S


def _source_and_key_mask(name, cross, x_BTD, side):
    """The sequence keys and values come from, and its (B, 1, 1, S) padding mask (None: every key is real)."""
    if not cross:
        return x_BTD, _check_mask(name, "mask", side.get("mask"), x_BTD.shape[:2])
    context = side.get("context")
    if context is None:
        raise LayerError(name, "cross-attention needs the context= side input (B, S, features)")
    if context.ndim != 3 or context.shape[0] != x_BTD.shape[0]:
        raise LayerError(
            name, f"context must be (batch={x_BTD.shape[0]}, S, features), got shape {tuple(context.shape)}"
        )
    return context, _check_mask(name, "context_mask", side.get("context_mask"), context.shape[:2])


def _check_cache_room(name: str, index: jax.Array, T: int, L: int) -> None:
    """Refuses decoding past the cache's end when the index is concrete (eager calls); see `_decode` for jit."""
    if isinstance(index, jax.core.Tracer) or int(jnp.max(index)) + T <= L:
        return
    raise LayerError(
        name,
        f"decoding {T} position(s) from position {int(jnp.max(index))} overruns the cache of {L} positions; "
        f"build it with max_len >= {int(jnp.max(index)) + T}",
    )


def _decode(name, q_BTNH, k_BTKH, v_BTKH, cache, positions, key_mask_B11T, rope_base, policy):
    """The next T positions against the cache: their keys, values and padding mask are written at the cache's
    index, and each query attends to every real cached position up to its own.

    The cache keeps which of its slots are real (the `mask` side input of the call that wrote them), so that a
    left-padded batch of prompts of different lengths decodes in one program. Past the cache's end,
    `dynamic_update_slice` would clamp the index and overwrite the last entries, giving plausible but wrong
    outputs; an eager call is refused, a traced one returns NaN instead (in the rows that overran).

    The index is one for the whole batch (a scalar), or one per row ((B,): a server's slots, each at its own
    request's length, `init_cache_per_row`)."""
    B, T = q_BTNH.shape[:2]
    index = cache["index"]
    _check_cache_room(name, index, T, cache["k"].shape[1])
    index_B1 = jnp.reshape(index, (-1, 1))  # (1, 1) for a shared index: it broadcasts over the rows
    if positions is None:
        positions = jnp.broadcast_to(index_B1 + jnp.arange(T)[None, :], (B, T))
    if rope_base is not None:
        q_BTNH, k_BTKH = rotary_embedding(q_BTNH, positions, rope_base), rotary_embedding(k_BTKH, positions, rope_base)
    dtype = cache["k"].dtype
    real_BT = jnp.ones((B, T), bool) if key_mask_B11T is None else key_mask_B11T[:, 0, 0, :]
    k_BLKH, v_BLKH, real_BL = (
        _write_at(cache[name_], new, index)
        for name_, new in (("k", k_BTKH.astype(dtype)), ("v", v_BTKH.astype(dtype)), ("mask", real_BT))
    )
    L = k_BLKH.shape[1]
    causal_B1TL = (jnp.arange(L)[None, None, :] <= (index_B1 + jnp.arange(T)[None, :])[:, :, None])[:, None]
    o = _attention_f32acc(q_BTNH.astype(dtype), k_BLKH, v_BLKH, causal_B1TL & real_BL[:, None, None, :], policy)
    room_B111 = jnp.reshape(index + T <= L, (-1, 1, 1, 1))
    o = jnp.where(room_B111, o, jnp.nan)
    return o, {"k": k_BLKH, "v": v_BLKH, "mask": real_BL, "index": index + T}


def _write_at(cache_BL: jax.Array, new_BT: jax.Array, index: jax.Array) -> jax.Array:
    """`new_BT` written into the cache along its positions at `index` (shared, or one per row)."""
    # The _in_dim forms make the other start indices zeros of the index's own dtype: literal zeros would be int64
    # under jax_enable_x64 and dynamic_update_slice refuses mixed index types.
    if index.ndim == 0:
        return lax.dynamic_update_slice_in_dim(cache_BL, new_BT, index, axis=1)
    write_row = lambda row, new, i: lax.dynamic_update_slice_in_dim(row, new, i, axis=0)  # noqa: E731
    return jax.vmap(write_row)(cache_BL, new_BT, index)


NORMS = ("layer", "rms")
MLPS = ("gelu", "swiglu")


# Gelu with the MLP's hidden width pinned to `tensor` where a mesh is set (`jaxnn.parallel.activations`): the Megatron
# layout between the column- and row-parallel projections, which propagation alone does not always keep.
HiddenGelu = Lambda(lambda x: constrain(Gelu.apply({}, x), (BATCH, None, HIDDEN)), "gelu")


@describe
def SwiGLU(
    hidden_features: int,
    *,
    use_bias: bool = False,
    w_init: initializers.Initializer = initializers.lecun_normal(),
    name: str = "swiglu",
) -> Layer:
    """The gated MLP of Llama and PaLM: `down(silu(gate(x)) * up(x))`, back to the input's width.

    Params `gate` and `up` (D, hidden) and `down` (hidden, D), each a Dense (biases only with `use_bias`); the
    built-in sharding rules split gate and up by columns and down by rows, as for a GELU MLP's fc and proj."""
    check_positive("SwiGLU", hidden_features=hidden_features)

    def dense(features: int, part: str) -> Layer:
        return Dense(features, use_bias=use_bias, w_init=w_init, name=part)

    def init(key, in_shape):
        if len(in_shape) < 1:
            raise shape_error(name, "of rank >= 1", in_shape)
        k_gate, k_up, k_down = jax.random.split(key, 3)
        hidden_shape = (*in_shape[:-1], hidden_features)
        params = {
            "gate": dense(hidden_features, "gate").init(k_gate, in_shape)[1],
            "up": dense(hidden_features, "up").init(k_up, in_shape)[1],
            "down": dense(in_shape[-1], "down").init(k_down, hidden_shape)[1],
        }
        return tuple(in_shape), params

    def apply(params, x, *, policy=None, **kwargs):
        check_keywords(name, kwargs)
        gate = dense(hidden_features, "gate").apply(params["gate"], x, policy=policy)
        up = dense(hidden_features, "up").apply(params["up"], x, policy=policy)
        hidden = constrain(jax.nn.silu(gate) * up, (BATCH, None, HIDDEN)) if x.ndim == 3 else jax.nn.silu(gate) * up
        return dense(x.shape[-1], "down").apply(params["down"], hidden, policy=policy)

    return Layer(init, with_name(name, apply), name)


def _mlp(kind: str, hidden: int, bias: bool, w_init: initializers.Initializer, width: int) -> list[Layer]:
    """The block's MLP sublayers after its norm: a GELU MLP (fc, gelu, proj) or a SwiGLU."""
    if kind == "swiglu":
        return [SwiGLU(hidden, use_bias=bias, w_init=w_init)]
    return [
        Dense(hidden, use_bias=bias, w_init=w_init, name="fc"),
        HiddenGelu,
        Dense(width, use_bias=bias, w_init=w_init, name="proj"),
    ]


def _check_block(mlp_ratio, mlp_hidden, mlp, norm, norm_eps, drop_prob) -> None:
    """Refuses a bad TransformerBlock construction in one line, before any init."""
    check_positive("TransformerBlock", mlp_ratio=mlp_ratio)
    if mlp_hidden is not None:
        check_positive("TransformerBlock", mlp_hidden=mlp_hidden)
    if norm not in NORMS:
        raise ValueError(f"TransformerBlock: unknown norm {norm!r}; choose one of {NORMS}")
    if mlp not in MLPS:
        raise ValueError(f"TransformerBlock: unknown mlp {mlp!r}; choose one of {MLPS}")
    Dropout(drop_prob)  # each layer's own check of its argument
    (LayerNorm if norm == "layer" else RMSNorm)(norm_eps)


def _built_per_width(name: str, build: Callable[[int], Layer]) -> tuple[Callable, Callable, Callable]:
    """`init`, `apply` and `init_cache` of a (batch, time, features) layer that is `build(features)`."""

    def init(key, in_shape):
        if len(in_shape) != 3:
            raise shape_error(name, "of rank 3 (batch, time, features)", in_shape)
        return build(in_shape[-1]).init(key, in_shape)

    def apply(params, x, **kwargs):
        if x.ndim != 3:
            raise shape_error(name, "of rank 3 (batch, time, features)", x.shape)
        return build(x.shape[-1]).apply(params, constrain(x, (BATCH, None, None)), **kwargs)

    def init_cache(in_shape, max_len, dtype):
        return init_cache_of(build(in_shape[-1]), in_shape, max_len, dtype)

    return init, apply, init_cache


@describe
def TransformerBlock(
    num_heads: int,
    *,
    mlp_ratio: int = 4,
    mlp_hidden: int | None = None,
    mlp: str = "gelu",
    drop_prob: float = 0.0,
    causal: bool = True,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    rope: bool = False,
    rope_base: float = 10000.0,
    norm: str = "layer",
    norm_eps: float = 1e-6,
    bias: bool = True,
    cross_attention: bool = False,
    context_features: int | None = None,
    attention_implementation: str = "auto",
    w_init: initializers.Initializer = initializers.lecun_normal(),
    remat: Any = None,
    name: str = "block",
) -> Layer:
    """Pre-norm transformer block: x + Attention(Norm(x)), [x + CrossAttention(Norm(x), context)],
    then x + MLP(Norm(x)).

    The MLP: `mlp="gelu"` (fc, tanh-GELU, proj; GPT-2) or "swiglu" (`SwiGLU`; Llama), of hidden width
    `mlp_hidden` (default mlp_ratio * D). `norm`: "layer" (LayerNorm) or "rms" (RMSNorm), with epsilon
    `norm_eps`; `bias=False` leaves out every projection's bias; `num_kv_heads`, `head_dim`, `rope` and
    `rope_base` as in `MultiHeadAttention`; `w_init` initialises every projection (attention and MLP);
    `cross_attention=True` adds a cross-attention sublayer reading the `context` side input (an encoder-decoder
    block). Side inputs (mask, positions, context, context_mask) reach the sublayers that read them; a causal block
    decodes with a cache. `remat`: recompute the block's activations in the backward pass under this policy
    (`jaxnn.layers.remat`: "nothing", "dots", "dots_no_batch", "everything", "offload").
    """
    _check_block(mlp_ratio, mlp_hidden, mlp, norm, norm_eps, drop_prob)
    remat_policy(remat)  # an unknown name is refused here, not at the first call
    Norm = LayerNorm if norm == "layer" else RMSNorm

    def attention(cross: bool) -> Layer:
        return MultiHeadAttention(
            num_heads,
            head_dim,
            num_kv_heads=num_kv_heads,
            causal=causal and not cross,
            rope=rope and not cross,
            rope_base=rope_base,
            cross=cross,
            context_features=context_features,
            implementation=attention_implementation,
            bias=bias,
            w_init=w_init,
            name="cross_attention" if cross else "attention",
        )

    def pre_norm(layers: list[Layer], part: str) -> Layer:
        return residual(Norm(norm_eps, name="ln"), *layers, Dropout(drop_prob), name=part)

    def build(width: int) -> Layer:
        sublayers = [pre_norm([attention(False)], "attn")]
        if cross_attention:
            sublayers.append(pre_norm([attention(True)], "cross"))
        sublayers.append(pre_norm(_mlp(mlp, mlp_hidden or mlp_ratio * width, bias, w_init, width), "mlp"))
        block = serial(*sublayers, name=name)
        return block if remat is None else remat_layer(block, checkpoint_policy=remat)

    template = build(1)  # the sublayers' side inputs and cache do not depend on the width
    init, apply, init_cache = _built_per_width(name, build)
    decodes = template.init_cache is not None
    return Layer(
        init,
        apply,
        name,
        side_inputs=template.side_inputs,
        init_cache=init_cache if decodes else None,
        expands=lambda in_shape: (build(in_shape[-1]), 1),
    )
