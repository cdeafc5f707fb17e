"""The KV-cache decoding engine behind `jaxnn.generate`: how the next token is picked (`Sampler`), the compiled
programs (`prefill` over a left-padded batch, `decode_step` and the decode loop, the uncached reference) and the
buckets that let a new prompt length reuse a compiled program.

Prompt and output lengths are rounded up to buckets (powers of two, at least `MIN_BUCKET`), so a new prompt length
reuses the program of its bucket: one compile per (batch, bucket); `compiled_programs` counts them. `Decoder` holds
one call's checked settings and runs the programs; `jaxnn.serve` and `jaxnn.decoding_export` build their own
programs from `prefill`'s parts (`positions_of`, `decode_step`).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxnn._src.checks import check_seed
from jaxnn.layers.core import Layer, LayerError, Params, PRNGKey, State, run, run_cached
from jaxnn.precision import Policy, get_policy

MIN_BUCKET = 8


class Sampler(NamedTuple):
    """How the next token is picked from its logits: greedy when `temperature` is 0, else sampled from the
    softmax of logits / temperature restricted to the `top_k` most likely tokens and to the smallest set whose
    probability reaches `top_p` (nucleus sampling)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def check(self) -> None:
        """Refuses settings that sample nothing: a negative temperature, top_k < 1, top_p outside (0, 1]."""
        if not (_is_real(self.temperature) and self.temperature >= 0):
            raise ValueError(f"generate: temperature must be >= 0 (a number; 0 is greedy), got {self.temperature!r}")
        top_k_ok = isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= 1
        if self.top_k is not None and not top_k_ok:
            raise ValueError(f"generate: top_k must be a positive integer, got {self.top_k!r}")
        if self.top_p is not None and not (_is_real(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"generate: top_p must be in (0, 1], got {self.top_p!r}")

    def __call__(self, logits_BV: jax.Array, key: PRNGKey) -> jax.Array:
        """The next token of each row, (B,) int32."""
        logits_BV = logits_BV.astype(jnp.float32)
        if self.temperature == 0:
            return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
        logits_BV = logits_BV / self.temperature
        if self.top_k is not None:
            if self.top_k > logits_BV.shape[-1]:
                raise ValueError(f"generate: top_k {self.top_k} exceeds the vocabulary size {logits_BV.shape[-1]}")
            kth_largest = lax.top_k(logits_BV, self.top_k)[0][:, -1:]
            logits_BV = jnp.where(logits_BV < kth_largest, -jnp.inf, logits_BV)
        if self.top_p is not None:
            logits_BV = _nucleus(logits_BV, self.top_p)
        return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)


def _nucleus(logits_BV: jax.Array, top_p: float) -> jax.Array:
    """Keeps the most likely tokens whose probabilities sum to top_p (the first token that crosses it included)."""
    sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    kept = jnp.where(mass_before_BV < top_p, sorted_BV, jnp.inf)
    threshold_B1 = jnp.min(kept, axis=-1, keepdims=True)
    return jnp.where(logits_BV < threshold_B1, -jnp.inf, logits_BV)


def _is_real(value: Any) -> bool:
    """Whether `value` is a number (a Python, numpy or 0-d jax scalar); text and booleans are not."""
    if isinstance(value, (str, bytes, bool)):
        return False
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def as_key(key: PRNGKey | int | None) -> PRNGKey:
    """A PRNG key, from a key or an integer seed (None: seed 0)."""
    if key is None:
        return jax.random.key(0)
    if isinstance(key, (int, np.integer)):
        check_seed("generate", key, "key (a PRNG key or an integer seed)")
        return jax.random.key(int(key))
    return key


def _bucket(n: int) -> int:
    """The padded size of n positions: the next power of two, at least MIN_BUCKET."""
    return max(MIN_BUCKET, 1 << (n - 1).bit_length())


@functools.lru_cache(maxsize=256)
def _bucketed_sizes(model: Layer, dtype: Any, batch: int, T: int, n: int) -> tuple[int, int]:
    """Buckets for the prompt width and the new-token slots, or the exact sizes where a cache that long is refused
    (a learned position table shorter than the buckets)."""
    for width, slots in ((_bucket(T), _bucket(n)), (T, _bucket(n)), (_bucket(T), n)):
        if _cache_fits(model, batch, width, width + slots, dtype):
            return width, slots
    return T, n  # init_cache refuses this one too, naming the table it overruns


def _cache_fits(model: Layer, batch: int, length: int, cache_len: int, dtype: Any) -> bool:
    """Whether the model builds a cache of `cache_len` positions (a learned position table may be shorter)."""
    try:
        jax.eval_shape(lambda: model.init_cache((batch, length), cache_len, dtype))  # type: ignore[misc]
    except LayerError:
        return False
    return True


class Decoder(NamedTuple):
    """The checked settings of one generation call, and the compiled programs it runs."""

    model: Layer
    params: Params
    state: State
    policy: Policy
    sampler: Sampler
    key: PRNGKey
    use_cache: bool

    @classmethod
    def build(cls, model, params, state, policy, use_cache, key, temperature, top_k, top_p) -> Decoder:
        """The settings of one call, checked in one line each: the sampler's, a key when sampling, a cache."""
        sampler = Sampler(temperature, top_k, top_p)
        sampler.check()
        # Plain floats: the sampler is a static argument of the compiled decoder: it must hash and compare by value.
        sampler = sampler._replace(temperature=float(temperature), top_p=None if top_p is None else float(top_p))
        if sampler.temperature > 0 and key is None:
            raise ValueError("generate: sampling (temperature > 0) needs key=jax.random.key(...) or an integer seed")
        if use_cache and model.init_cache is None:
            raise ValueError(
                f"generate: model {model.name!r} has no decoding cache (no causal attention layer); "
                "pass use_cache=False"
            )
        policy = get_policy(policy)
        return cls(model, policy.cast_to_compute(params), state, policy, sampler, as_key(key), use_cache)

    def pads(self) -> bool:
        """Whether the model can be given left-padded prompts: it takes a padding mask and explicit positions."""
        return {"mask", "positions"} <= self.model.side_inputs

    def pad(self, rows: list[np.ndarray], pad_id: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The rows left-padded to the prompt bucket: ids (B, T), mask (B, T) and the real lengths (B,)."""
        lengths = np.array([len(r) for r in rows])
        T = int(lengths.max())
        if (lengths != T).any() and not self.pads():
            raise ValueError(
                f"generate_batch: prompts of different lengths need a model taking the mask and positions side "
                f"inputs; {self.model.name!r} takes {sorted(self.model.side_inputs) or 'none'}"
            )
        width = self.sizes(len(rows), T, n)[0]
        ids = np.full((len(rows), width), pad_id, np.int64)
        mask = np.zeros((len(rows), width), bool)
        for i, row in enumerate(rows):
            ids[i, width - len(row) :], mask[i, width - len(row) :] = row, True
        return ids, mask, lengths

    def sizes(self, batch: int, T: int, n: int) -> tuple[int, int]:
        """The compiled prompt width and number of new-token slots: buckets where the model allows them."""
        if not (self.use_cache and self.pads()):
            return T, n
        return _bucketed_sizes(self.model, self.policy.compute_dtype, batch, T, n)

    def __call__(self, ids, mask, lengths, limits, stops, pad_id):
        """The new tokens (B, slots) and their counts (B,), as device arrays."""
        n = int(limits.max())
        width, slots = self.sizes(ids.shape[0], int(lengths.max()), n)
        m, s, p = self.model, self.sampler, self.policy
        rows = (jnp.asarray(lengths, jnp.int32), jnp.asarray(limits, jnp.int32), jnp.asarray(stops, jnp.int32))
        ids_j, mask_j, pad_j = jnp.asarray(ids, jnp.int32), jnp.asarray(mask), jnp.int32(pad_id)
        if not self.use_cache:
            # Traced once without positions, so that a sequence longer than a learned position table is refused
            # by the table itself: with explicit positions it would read past its end (NaN rows) under jit.
            whole = jax.ShapeDtypeStruct((1, width + slots), jnp.int32)
            jax.eval_shape(lambda prm, x: run(m, prm, x, state=self.state, policy=p)[0], self.params, whole)
            return _decode_uncached(m, s, p, slots, self.params, self.state, ids_j, mask_j, *rows[1:], pad_j, self.key)
        first, cache = prefill(m, s, p, width + slots, self.params, self.state, ids_j, mask_j, self.key)
        out, counts, _ = _decode_loop(m, s, p, slots, self.params, self.state, cache, first, *rows, pad_j, self.key)
        return out, counts


def compiled_programs() -> int:
    """How many decoding programs this process has compiled (prefill, decode loop, uncached reference): a new
    prompt length or maximum in a bucket already seen adds none."""
    return sum(f._cache_size() for f in (prefill, _decode_loop, _decode_uncached))  # type: ignore[attr-defined]


def positions_of(mask_BT: jax.Array) -> jax.Array:
    """Each slot's position in its own row of a left-padded batch: 0 at the first real token (0 on padding)."""
    return jnp.maximum(jnp.cumsum(mask_BT, axis=1, dtype=jnp.int32) - 1, 0)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def prefill(model, sampler, policy, cache_len, params, state, ids_BT, mask_BT, key):
    """The first new token of each left-padded row (sampled with `fold_in(key, 0)`) and the filled cache."""
    B, T = ids_BT.shape
    cache = model.init_cache((B, T), cache_len, policy.compute_dtype)
    side = {"mask": mask_BT, "positions": positions_of(mask_BT)}
    logits_BTV, cache = run_cached(model, params, ids_BT, cache, state=state, policy=policy, **side)
    return sampler(logits_BTV[:, -1], jax.random.fold_in(key, 0)), cache


def decode_step(
    model: Layer,
    params: Params,
    state: State,
    policy: Policy,
    token_B: jax.Array,
    position_B: jax.Array,
    cache: Any,
) -> tuple[jax.Array, Any]:
    """One new position per row against the cache: the next-token logits (B, vocab) and the updated cache."""
    side = {"mask": jnp.ones((token_B.shape[0], 1), bool), "positions": position_B[:, None]}
    logits_B1V, cache = run_cached(model, params, token_B[:, None], cache, state=state, policy=policy, **side)
    return logits_B1V[:, -1], cache


class _Rows(NamedTuple):
    """The decode loop's per-row bookkeeping: the new tokens so far, their counts, and which rows are finished."""

    out_BN: jax.Array
    count_B: jax.Array
    done_B: jax.Array

    @classmethod
    def start(cls, batch: int, slots: int, pad: jax.Array) -> _Rows:
        zeros = jnp.zeros((batch,), jnp.int32)
        return cls(jnp.full((batch, slots), pad, jnp.int32), zeros, zeros.astype(bool))

    def record(self, token_B, j, limit_B, stop_B, pad) -> _Rows:
        """Writes new token j of the unfinished rows; a row finishes on its stop token or at its limit."""
        live_B = ~self.done_B
        column = jnp.where(live_B, token_B, pad)[:, None]
        out_BN = lax.dynamic_update_slice_in_dim(self.out_BN, column, j, axis=1)
        count_B = self.count_B + live_B.astype(jnp.int32)
        done_B = self.done_B | (live_B & (token_B == stop_B)) | (count_B >= limit_B)
        return _Rows(out_BN, count_B, done_B)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), donate_argnums=(6,))
def _decode_loop(model, sampler, policy, slots, params, state, cache, first_B, length_B, limit_B, stop_B, pad, key):
    rows = _Rows.start(first_B.shape[0], slots, pad).record(first_B, 0, limit_B, stop_B, pad)

    def unfinished(carry):
        j, _, _, rows = carry
        return (j < slots) & ~jnp.all(rows.done_B)

    def step(carry):
        j, token_B, cache, rows = carry
        logits_BV, cache = decode_step(model, params, state, policy, token_B, length_B + j - 1, cache)
        token_B = sampler(logits_BV, jax.random.fold_in(key, j))
        return j + 1, token_B, cache, rows.record(token_B, j, limit_B, stop_B, pad)

    _, _, cache, rows = lax.while_loop(unfinished, step, (jnp.int32(1), first_B, cache, rows))
    return rows.out_BN, rows.count_B, cache  # the cache returned, so that its donated buffers can be reused


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _decode_uncached(model, sampler, policy, slots, params, state, ids_BT, mask_BT, limit_B, stop_B, pad, key):
    B, T = ids_BT.shape
    tokens_BS = jnp.concatenate([ids_BT, jnp.zeros((B, slots), jnp.int32)], axis=1)
    mask_BS = jnp.concatenate([mask_BT, jnp.ones((B, slots), bool)], axis=1)
    side = {"mask": mask_BS, "positions": positions_of(mask_BS)}

    def next_token(tokens_BS, j):
        logits_BSV, _ = run(model, params, tokens_BS, state=state, train=False, policy=policy, **side)
        logits_BV = lax.dynamic_index_in_dim(logits_BSV, T + j - 1, axis=1, keepdims=False)
        token_B = sampler(logits_BV, jax.random.fold_in(key, j))
        return token_B, lax.dynamic_update_slice_in_dim(tokens_BS, token_B[:, None], T + j, axis=1)

    def unfinished(carry):
        j, _, rows = carry
        return (j < slots) & ~jnp.all(rows.done_B)

    def step(carry):
        j, tokens_BS, rows = carry
        token_B, tokens_BS = next_token(tokens_BS, j)
        return j + 1, tokens_BS, rows.record(token_B, j, limit_B, stop_B, pad)

    rows = _Rows.start(B, slots, pad)
    _, _, rows = lax.while_loop(unfinished, step, (jnp.int32(0), tokens_BS, rows))
    return rows.out_BN, rows.count_B
