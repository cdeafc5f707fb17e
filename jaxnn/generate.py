"""Autoregressive generation for causal models built from jaxnn layers: a KV cache, greedy and sampled decoding.

`generate` runs the prompt through the model once (prefill, filling every attention layer's cache), then one
position per step inside `lax.scan`, each step attending to the cached keys and values instead of recomputing the
whole context; the whole loop is one compiled program. `use_cache=False` is the simple reference: one full
forward pass over the (fixed-size) sequence per new token. Greedy decoding gives the same tokens both ways.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxnn.config import check_seed
from jaxnn.layers.core import Layer, Params, PRNGKey, State, run, run_cached
from jaxnn.precision import Policy, get_policy


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


def _check_prompt(prompt: Any, max_new_tokens: int) -> np.ndarray:
    """The prompt as (B, T) token ids on the host, checked before anything is traced or compiled."""
    if isinstance(prompt, (str, bytes, bytearray)):
        raise TypeError(
            f"generate: prompt must be integer token ids, got {type(prompt).__name__} {prompt[:20]!r}; use "
            "generate_bytes for text (bytes), or pass list(prompt) for its byte values as ids"
        )
    try:
        ids = np.asarray(prompt)
    except ValueError:  # numpy refuses rows of different lengths
        raise ValueError("generate: prompt rows must all have the same length") from None
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[1] < 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(
            "generate: prompt must be integer token ids of shape (batch, length >= 1), "
            f"got {ids.dtype} {tuple(ids.shape)}"
        )
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    return ids


def _check_vocabulary(model: Layer, params: Params, state: State, ids: np.ndarray, policy: Policy) -> None:
    """Refuses ids outside [0, vocab): under jit an embedding turns them into NaN rows and greedy decoding into
    token 0, silently. The vocabulary is the width of the model's logits, found by tracing one position."""
    one = jax.ShapeDtypeStruct((ids.shape[0], 1), jnp.int32)
    logits = jax.eval_shape(lambda p, x: run(model, p, x, state=state, train=False, policy=policy)[0], params, one)
    vocab = logits.shape[-1]
    bad = (ids < 0) | (ids >= vocab)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"generate: prompt token ids must be in [0, {vocab}) (the model's vocabulary), got {ids[where]} at "
            f"index {where}"
        )


def _as_key(key: PRNGKey | int | None) -> PRNGKey:
    """A PRNG key, from a key or an integer seed (None: seed 0)."""
    if key is None:
        return jax.random.key(0)
    if isinstance(key, (int, np.integer)):
        check_seed("generate", key)
        return jax.random.key(int(key))
    return key


def generate(
    model: Layer,
    params: Params,
    prompt: Any,
    max_new_tokens: int,
    *,
    key: PRNGKey | int | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    model_state: State = None,
    policy: Policy | str = "fp32",
    use_cache: bool = True,
) -> jax.Array:
    """Continues each row of `prompt` ((B, T) or (T,) token ids; rows of equal length) by `max_new_tokens` tokens.

    `model` maps (B, T) ids to (B, T, vocab) next-token logits and is causal (position t sees positions <= t).
    Returns (B, T + max_new_tokens) int32: the prompt, then the new tokens. Greedy by default; `temperature` > 0
    samples (needs `key`, a PRNG key or an integer seed in [0, 2**32)), optionally restricted by `top_k` and
    `top_p`; the j-th new token uses `fold_in(key, j)`, so the cached and uncached paths sample the same tokens
    from the same logits. Token ids outside the model's vocabulary (its logits' width) are refused.
    `use_cache=False` recomputes the whole sequence per token (the reference; also for models without a cache).
    """
    ids = _check_prompt(prompt, max_new_tokens)
    sampler = Sampler(temperature, top_k, top_p)
    sampler.check()
    # Plain floats: the sampler is a static argument of the compiled decoder, so it must hash and compare by value.
    sampler = sampler._replace(temperature=float(temperature), top_p=None if top_p is None else float(top_p))
    if sampler.temperature > 0 and key is None:
        raise ValueError("generate: sampling (temperature > 0) needs key=jax.random.key(...) or an integer seed")
    if use_cache and model.init_cache is None:
        raise ValueError(
            f"generate: model {model.name!r} has no decoding cache (no causal attention layer); pass use_cache=False"
        )
    key = _as_key(key)
    policy = get_policy(policy)
    params = policy.cast_to_compute(params)
    _check_vocabulary(model, params, model_state, ids, policy)
    decode = _decode_cached if use_cache else _decode_uncached
    return decode(model, sampler, policy, max_new_tokens, params, model_state, jnp.asarray(ids, jnp.int32), key)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _decode_cached(model, sampler, policy, n, params, state, prompt_BT, key):
    B, T = prompt_BT.shape
    cache = model.init_cache((B, T), T + n, policy.compute_dtype)
    logits_BTV, cache = run_cached(model, params, prompt_BT, cache, state=state, policy=policy)
    first_B = sampler(logits_BTV[:, -1], jax.random.fold_in(key, 0))

    def step(carry, j):
        token_B, cache = carry
        logits_B1V, cache = run_cached(model, params, token_B[:, None], cache, state=state, policy=policy)
        return (sampler(logits_B1V[:, -1], jax.random.fold_in(key, j)), cache), token_B

    (last_B, _), tokens_NB = lax.scan(step, (first_B, cache), jnp.arange(1, n))
    return jnp.concatenate([prompt_BT, tokens_NB.T, last_B[:, None]], axis=1)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _decode_uncached(model, sampler, policy, n, params, state, prompt_BT, key):
    B, T = prompt_BT.shape
    tokens = jnp.zeros((B, T + n), jnp.int32).at[:, :T].set(prompt_BT)

    def step(tokens, j):
        logits_BSV, _ = run(model, params, tokens, state=state, train=False, policy=policy)
        logits_BV = lax.dynamic_index_in_dim(logits_BSV, T + j - 1, axis=1, keepdims=False)
        token_B = sampler(logits_BV, jax.random.fold_in(key, j))
        return lax.dynamic_update_slice(tokens, token_B[:, None], (0, T + j)), None

    tokens, _ = lax.scan(step, tokens, jnp.arange(n))
    return tokens


def generate_bytes(
    model: Layer,
    params: Params,
    prompt: bytes,
    num_bytes: int,
    *,
    context_len: int | None = None,
    key: PRNGKey | int | None = None,
    temperature: float = 0.8,
    top_k: int | None = None,
    top_p: float | None = None,
    model_state: State = None,
    policy: Policy | str = "fp32",
) -> bytes:
    """Continues a byte string with a byte-level model (vocabulary 256), e.g. the built-in GPT.

    `context_len`: the longest sequence the model takes (a learned position table's length; None: unlimited). A
    longer text is generated in windows: when the window is full, generation restarts from its last half.
    """
    if isinstance(prompt, str):
        raise TypeError(f"generate_bytes: prompt must be bytes, got str {prompt[:20]!r}; encode it, e.g. .encode()")
    if not isinstance(num_bytes, int) or isinstance(num_bytes, bool) or num_bytes < 0:
        raise ValueError(f"generate_bytes: num_bytes must be an integer >= 0, got {num_bytes!r}")
    if context_len is not None and context_len < 2:
        raise ValueError(f"generate_bytes: context_len must be >= 2, got {context_len!r}")
    key = _as_key(key)
    tokens = list(prompt) or [0]
    out: list[int] = []
    while len(out) < num_bytes:
        context = tokens[-(context_len // 2) :] if context_len and len(tokens) >= context_len else tokens
        room = num_bytes - len(out) if context_len is None else context_len - len(context)
        n = min(num_bytes - len(out), room)
        new = generate(
            model,
            params,
            jnp.asarray([context], jnp.int32),
            n,
            key=jax.random.fold_in(key, len(out)),
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            model_state=model_state,
            policy=policy,
        )
        chunk = [int(t) for t in jax.device_get(new[0, len(context) :])]
        out += chunk
        tokens += chunk
    return bytes(out)
