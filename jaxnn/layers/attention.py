"""Multi-head attention (self, cross, grouped-query; rotary positions; a decoding cache). The transformer block
that holds it is in `jaxnn.layers.transformer`; which attention product runs, in `jaxnn.layers.attention_kernels`.

Shape suffixes: B batch, T query positions, S key positions, L cache length, D model width, N query heads,
K key/value heads (N a multiple of K), G = N // K query heads per key/value head, H head width.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.nn import initializers

from jaxnn import precision
from jaxnn.layers.attention_kernels import (  # noqa: F401 (cpu_implementation: also importable from here)
    IMPLEMENTATIONS,
    attention_f32acc,
    cpu_implementation,
    dispatch,
)
from jaxnn.layers.core import (
    Layer,
    LayerError,
    check_keywords,
    check_positive,
    describe,
    shape_error,
    with_name,
)
from jaxnn.layers.linear import Dense, check_positions


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
    return dispatch(implementation, q_BTNH, k_BSKH, v_BSKH, mask, causal, policy, padded=key_mask_B11S is not None)


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
    o = attention_f32acc(q_BTNH.astype(dtype), k_BLKH, v_BLKH, causal_B1TL & real_BL[:, None, None, :], policy)
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
