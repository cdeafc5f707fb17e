"""Attention in causal query blocks: the "blocked" implementation of MultiHeadAttention, and what "auto" runs for
float32 where the computation is lowered for the CPU.

Why not jax's XLA path on CPUs: under a causal mask, the queries of the first block see only the first block's
keys, so computing every block against only the keys it can see skips up to half of the products (with at most
`MAX_BLOCKS` blocks of at least `MIN_BLOCK` queries, 5/8 of them are left at T = 128, 9/16 at T >= 256), and the
smaller logits of each block stay within XLA's scratch blocks (`jaxnn._src.malloc`). The products run on (B, N, T,
H) copies of q, k and v. Plain jax functions, so every transformation applies (forward and reverse mode, vmap); a
hand-written gradient (flash attention's) was tried and was no faster. The GPT of `make bench-peers`:
docs/performance.md, "Attention on CPUs".

Shape suffixes as in `jaxnn.layers.attention`; here N is the number of heads of q, k and v alike.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

MIN_BLOCK = 32  # queries per block at least: smaller products lose more to overhead than the skipped keys save
MAX_BLOCKS = 8  # at T = 1024, 16 blocks were slower than 8 (docs/performance.md)


def query_blocks(T: int, S: int, causal: bool) -> tuple[tuple[int, int], ...]:
    """(start, end) of each query block. Several only for causal self-attention (T == S), where block
    [start, end) sees keys [0, end) only; otherwise one block that sees every key."""
    if not causal or T != S or T < 2 * MIN_BLOCK:
        return ((0, T),)
    return even_blocks(T, min(MAX_BLOCKS, T // MIN_BLOCK))


def attention(
    q_BTNH: jax.Array,
    k_BSNH: jax.Array,
    v_BSNH: jax.Array,
    valid: jax.Array | None,
    causal: bool,
    skip_hidden_keys: bool = True,
    blocks: tuple[tuple[int, int], ...] | None = None,
) -> jax.Array:
    """Softmax attention, the same function as `jax.nn.dot_product_attention(q, k, v, mask=valid,
    is_causal=causal)`: `valid` None or bool broadcasting to (B, 1, T, S); causal masks are aligned at the first
    position. A query that sees no key attends to every key equally, as in jax's path; so that this holds under
    a padding mask too, `skip_hidden_keys=False` keeps one block (no key is skipped). Products accumulate and the
    softmax runs in float32 (float64 for float64 inputs). `blocks`: (start, end) query blocks covering 0..T in
    place of `query_blocks`' (for causal self-attention; `benchmarks.attention_cpu` sweeps them)."""
    T, S = q_BTNH.shape[1], k_BSNH.shape[1]
    if blocks is None:
        blocks = query_blocks(T, S, causal) if skip_hidden_keys else ((0, T),)
    elif not _covers(blocks, T) or (len(blocks) > 1 and not (causal and T == S)):
        raise ValueError(f"blocked attention: blocks {blocks} must cover 0..{T} in order (several: causal, T == S)")
    return _blocked(tuple(blocks), causal, q_BTNH, k_BSNH, v_BSNH, valid)


def even_blocks(T: int, n: int) -> tuple[tuple[int, int], ...]:
    """`n` query blocks of (nearly) equal length covering 0..T."""
    edges = [round(i * T / n) for i in range(n + 1)]
    return tuple(zip(edges[:-1], edges[1:]))


def _covers(blocks, T: int) -> bool:
    ordered = all(start < end for start, end in blocks) and all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
    return ordered and blocks[0][0] == 0 and blocks[-1][1] == T


def _wide(dtype) -> jnp.dtype:
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


def _product(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum(spec, a, b, precision=lax.Precision.HIGHEST, preferred_element_type=_wide(a.dtype))


def _keys_seen(block: tuple[int, int], causal: bool, S: int) -> int:
    return block[1] if causal else S


def _keep(block, causal, valid, S) -> jax.Array | None:
    """Which logits of a block count: the block's rows of `valid`, and the causal mask."""
    start, end = block
    seen = _keys_seen(block, causal, S)
    keep = None if valid is None else valid[:, :, start:end, :seen] if valid.shape[2] > 1 else valid[..., :seen]
    if causal:
        below = ((start + jnp.arange(end - start))[:, None] >= jnp.arange(seen)[None, :])[None, None]
        keep = below if keep is None else keep & below
    return keep


def _large_negative(dtype) -> float:
    # As jax's path: finite, so that a row with every key masked gets equal weights rather than NaNs.
    return -0.7 * float(min(jnp.finfo(dtype).max, jnp.finfo(jnp.float32).max))


def _block_probs(q_BNtH, k_BNsH, keep) -> jax.Array:
    logits = _product("bnth,bnsh->bnts", q_BNtH, k_BNsH) / math.sqrt(q_BNtH.shape[-1])
    if keep is not None:
        logits = jnp.where(keep, logits, _large_negative(logits.dtype))
    return jax.nn.softmax(logits, axis=-1)


def _heads_first(x_BTNH: jax.Array) -> jax.Array:
    return jnp.transpose(x_BTNH, (0, 2, 1, 3))


def _blocked(blocks, causal, q_BTNH, k_BSNH, v_BSNH, valid) -> jax.Array:
    q, k, v = (_heads_first(x) for x in (q_BTNH, k_BSNH, v_BSNH))
    S = k.shape[2]
    outs = []
    for block in blocks:
        start, end = block
        seen = _keys_seen(block, causal, S)
        p = _block_probs(q[:, :, start:end], k[:, :, :seen], _keep(block, causal, valid, S))
        outs.append(_product("bnts,bnsh->bnth", p.astype(v.dtype), v[:, :, :seen]))
    o_BNTH = jnp.concatenate(outs, axis=2) if len(outs) > 1 else outs[0]
    return _heads_first(o_BNTH).astype(q_BTNH.dtype)
