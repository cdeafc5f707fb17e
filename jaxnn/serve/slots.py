"""The device side of continuous batching: a fixed pool of decoding-cache slots, each at its own request's length.

Requests join the pool through a batched prefill (their prompts left-padded to one width, as `generate_batch` pads
them) whose cache rows are copied into free slots, then every slot advances one token per `decode` call, with its
own sampling settings and key. A slot's row never sees another's: attention is per row, and the cache keeps one
write index per row (`jaxnn.layers.attention`), so a request that joins or leaves changes no other's tokens.

Shape suffixes: S slots, P prefill rows, T prompt width, L cache length, V vocabulary.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxnn.decoding import decode_step, positions_of
from jaxnn.layers import Layer, run, run_cached
from jaxnn.precision import Policy


class RowSampling(NamedTuple):
    """Each row's sampling settings, as arrays: temperature 0 is greedy; top_k 0 and top_p 1 keep every token;
    the row's n-th new token is drawn with `fold_in(key, n)`, as `generate` draws it."""

    # Host (numpy) or device arrays: the engine keeps them on the host and hands them to each call.
    temperature: Any  # (R,) float32
    top_k: Any  # (R,) int32
    top_p: Any  # (R,) float32
    key_data: Any  # (R, 2) uint32: jax.random.key_data of each row's key
    count: Any  # (R,) int32: how many tokens the row has already produced


def sample_rows(logits_RV: jax.Array, rows: RowSampling) -> jax.Array:
    """The next token of each row (R,) int32, each by its own settings (those of `jaxnn.decoding.Sampler`)."""
    logits_RV = logits_RV.astype(jnp.float32)
    greedy_R = jnp.argmax(logits_RV, axis=-1).astype(jnp.int32)
    scaled_RV = logits_RV / jnp.maximum(rows.temperature, 1e-6)[:, None]
    filters = jnp.any((rows.top_k > 0) | (rows.top_p < 1))
    # Sorting the vocabulary costs more than the rest of sampling: only when some row restricts it.
    scaled_RV = lax.cond(filters, _restrict, lambda s, _k, _p: s, scaled_RV, rows.top_k, rows.top_p)
    keys_R = jax.random.wrap_key_data(rows.key_data)
    draw = lambda key, n, logits_V: jax.random.categorical(jax.random.fold_in(key, n), logits_V)  # noqa: E731
    # Drawing costs a random number per vocabulary entry and row: only when some row samples.
    sampled_R = lax.cond(
        jnp.any(rows.temperature > 0),
        lambda: jax.vmap(draw)(keys_R, rows.count, scaled_RV).astype(jnp.int32),
        lambda: greedy_R,
    )
    return jnp.where(rows.temperature > 0, sampled_R, greedy_R)


def _restrict(scaled_RV: jax.Array, top_k_R: jax.Array, top_p_R: jax.Array) -> jax.Array:
    """Top-k, then the nucleus of mass top_p (the first token that crosses it kept), per row."""
    V = scaled_RV.shape[-1]
    sorted_RV = jnp.sort(scaled_RV, axis=-1)[:, ::-1]
    k_R = jnp.where(top_k_R > 0, jnp.minimum(top_k_R, V), V)
    kth_R1 = jnp.take_along_axis(sorted_RV, (k_R - 1)[:, None], axis=-1)
    scaled_RV = jnp.where(scaled_RV < kth_R1, -jnp.inf, scaled_RV)
    sorted_RV = jnp.where(jnp.arange(V)[None, :] < k_R[:, None], sorted_RV, -jnp.inf)
    probs_RV = jax.nn.softmax(sorted_RV, axis=-1)
    mass_before_RV = jnp.cumsum(probs_RV, axis=-1) - probs_RV
    kept_RV = jnp.where(mass_before_RV < top_p_R[:, None], sorted_RV, jnp.inf)
    threshold_R1 = jnp.where(top_p_R[:, None] < 1, jnp.min(kept_RV, axis=-1, keepdims=True), -jnp.inf)
    return jnp.where(scaled_RV < threshold_R1, -jnp.inf, scaled_RV)


def vocabulary(model: Layer, params: Any, state: Any, policy: Policy) -> int:
    """The width of the model's logits, from its shapes alone."""
    ids = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    logits = jax.eval_shape(lambda p, x: run(model, p, x, state=state, policy=policy)[0], params, ids)
    return int(logits.shape[-1])


def empty_pool(model: Layer, slots: int, cache_len: int, dtype: Any) -> Any:
    """The decoding cache of `slots` rows and `cache_len` positions, with one write index per row."""
    cache = model.init_cache((slots, 1), cache_len, dtype)  # type: ignore[misc]
    # Copies: a model's cache may hold one zeros array twice (keys and values), and the pool's leaves are donated.
    return jax.tree.map(lambda leaf: jnp.zeros((slots,), leaf.dtype) if leaf.ndim == 0 else jnp.copy(leaf), cache)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def prefill(model: Layer, policy: Policy, cache_len: int, params, state, ids_PT, mask_PT, rows: RowSampling):
    """The first new token of each left-padded prompt and the rows' filled cache (one shared index: the width)."""
    P, T = ids_PT.shape
    cache = model.init_cache((P, T), cache_len, policy.compute_dtype)  # type: ignore[misc]
    side = {"mask": mask_PT, "positions": positions_of(mask_PT)}
    logits_PTV, cache = run_cached(model, params, ids_PT, cache, state=state, policy=policy, **side)
    return sample_rows(logits_PTV[:, -1], rows), cache


@functools.partial(jax.jit, donate_argnums=(0,))
def place(pool: Any, rows_cache: Any, row: jax.Array, slot: jax.Array) -> Any:
    """The pool with prefilled row `row` of `rows_cache` copied into slot `slot` (its index included)."""

    def copy(pool_leaf: jax.Array, rows_leaf: jax.Array) -> jax.Array:
        if rows_leaf.ndim == 0:  # the shared write index of the prefilled rows
            return pool_leaf.at[slot].set(rows_leaf)
        one = lax.dynamic_slice_in_dim(rows_leaf, row, 1, axis=0).astype(pool_leaf.dtype)
        return lax.dynamic_update_slice_in_dim(pool_leaf, one, slot, axis=0)

    return jax.tree.map(copy, pool, rows_cache)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(4,))
def decode(model: Layer, policy: Policy, params, state, pool, token_S, position_S, live_S, rows: RowSampling):
    """Every slot's next token (S,) and the advanced pool; a slot that is not live is reset to index 0, so that an
    idle slot never runs past the cache's end."""
    logits_SV, pool = decode_step(model, params, state, policy, token_S, position_S, pool)
    pool = jax.tree.map(lambda leaf: jnp.where(live_S, leaf, 0) if leaf.ndim == 1 else leaf, pool)
    return sample_rows(logits_SV, rows), pool
