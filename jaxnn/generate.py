"""Autoregressive generation for causal models built from jaxnn layers: a KV cache, greedy and sampled decoding,
batches of prompts of different lengths, stop tokens. The decoding engine (sampler, compiled programs, buckets) is
`jaxnn.decoding`; its public names are importable from here too.

`generate_batch` left-pads the prompts to a common length, runs them through the model once (prefill, filling
every attention layer's cache; the padding mask and each row's own positions travel as side inputs), then decodes
one position per step inside one compiled `lax.while_loop` that ends when every row has met its stop token or
its own maximum, the cache donated to it. Prompt and output lengths are rounded up to buckets (powers of two, at
least 8), so a new prompt length reuses the program of its bucket: one compile per (batch, bucket).
`use_cache=False` is the simple reference: one full forward pass over the sequence per new token. Greedy decoding
gives the same tokens both ways. `generate` is the rectangular call (prompt plus continuation).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxnn.decoding import (  # noqa: F401 (the engine's public names, also importable from here)
    MIN_BUCKET,
    Decoder,
    Sampler,
    as_key,
    compiled_programs,
    decode_step,
    positions_of,
    prefill,
)
from jaxnn.layers.core import Layer, Params, PRNGKey, State, run
from jaxnn.precision import Policy

log = logging.getLogger(__name__)


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
        raise ValueError(
            "generate: prompt rows must all have the same length; generate_batch takes prompts of different lengths"
        ) from None
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


def _vocabulary(model: Layer, params: Params, state: State, policy: Policy) -> int:
    """The width of the model's logits, found by tracing one position; remembered per model and parameter shapes,
    because tracing a model costs more than decoding a short reply."""
    leaves, treedef = jax.tree.flatten((params, state))
    return _traced_vocabulary(model, policy, treedef, tuple((np.shape(a), jnp.result_type(a)) for a in leaves))


@functools.lru_cache(maxsize=64)
def _traced_vocabulary(model: Layer, policy: Policy, treedef: Any, specs: tuple) -> int:
    params, state = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in specs])
    one = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    logits = jax.eval_shape(
        lambda p, s, x: run(model, p, x, state=s, train=False, policy=policy)[0], params, state, one
    )
    return int(logits.shape[-1])


def _check_ids(rows: Sequence[np.ndarray], vocab: int) -> None:
    """Refuses ids outside [0, vocab): under jit an embedding turns them into NaN rows and greedy decoding into
    token 0, silently."""
    for i, row in enumerate(rows):
        bad = np.flatnonzero((row < 0) | (row >= vocab))
        if bad.size:
            raise ValueError(
                f"generate: prompt token ids must be in [0, {vocab}) (the model's vocabulary), got {row[bad[0]]} at "
                f"index {(i, int(bad[0]))}"
            )


class Generation(NamedTuple):
    """What `generate_batch` returns, on the host: row i's new tokens are `tokens[i, :lengths[i]]` (its stop token
    included when it met one), then `pad_id` up to the longest row's maximum."""

    tokens: np.ndarray  # (B, N) int32, N = the largest max_new_tokens
    lengths: np.ndarray  # (B,) int32


def generate_batch(
    model: Layer,
    params: Params,
    prompts: Any,
    max_new_tokens: int | Sequence[int],
    *,
    stop_tokens: int | Sequence[int | None] | None = None,
    pad_id: int = 0,
    key: PRNGKey | int | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    model_state: State = None,
    policy: Policy | str = "fp32",
    use_cache: bool = True,
) -> Generation:
    """Continues each of `prompts` (rows of token ids, of any lengths >= 1; or a (B, T) array) until it produces
    its stop token or its maximum of new tokens.

    `max_new_tokens`: one maximum for every row, or one per row. `stop_tokens`: None (no stop), one id for every
    row, or one per row (None: that row has none). Prompts are left-padded with `pad_id` (masked out: it never
    changes a row's tokens), so the model must take the `mask` and `positions` side inputs (the built-in GPT does)
    unless the prompts are of one length. Sampling settings, `key`, `policy` and `use_cache` are those of
    `generate`; the j-th new token of every row uses `fold_in(key, j)`.
    """
    rows = _check_rows(prompts)
    limits = _per_row("max_new_tokens", max_new_tokens, len(rows), lambda v: _is_int(v) and v >= 1)
    stops = _per_row("stop_tokens", stop_tokens, len(rows), lambda v: v is None or _is_int(v))
    if not _is_int(pad_id):
        raise ValueError(f"generate_batch: pad_id must be an integer token id, got {pad_id!r}")
    decoder = Decoder.build(model, params, model_state, policy, use_cache, key, temperature, top_k, top_p)
    vocab = _vocabulary(model, decoder.params, model_state, decoder.policy)
    for name, value in [("pad_id", pad_id)] + [(f"stop_tokens[{i}]", t) for i, t in enumerate(stops) if t is not None]:
        if not 0 <= value < vocab:
            raise ValueError(f"generate_batch: {name} {value} is outside the model's vocabulary [0, {vocab})")
    _check_ids(rows, vocab)
    ids, mask, lengths = decoder.pad(rows, pad_id, max(limits))
    stop_ids = np.array([-1 if t is None else t for t in stops])
    tokens, counts = decoder(ids, mask, lengths, np.array(limits), stop_ids, pad_id)
    n = max(limits)
    return Generation(np.asarray(tokens)[:, :n].astype(np.int32), np.asarray(counts).astype(np.int32))


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
    Prompts of different lengths, stop tokens and per-row maxima: `generate_batch`.
    """
    ids = _check_prompt(prompt, max_new_tokens)
    decoder = Decoder.build(model, params, model_state, policy, use_cache, key, temperature, top_k, top_p)
    _check_ids(list(ids), _vocabulary(model, decoder.params, model_state, decoder.policy))
    B, T = ids.shape
    padded, mask, lengths = decoder.pad(list(ids), 0, max_new_tokens)
    limits = np.full(B, max_new_tokens)
    tokens, _ = decoder(padded, mask, lengths, limits, np.full(B, -1), 0)
    return jnp.concatenate([jnp.asarray(ids, jnp.int32), jnp.asarray(tokens)[:, :max_new_tokens]], axis=1)


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_rows(prompts: Any) -> list[np.ndarray]:
    """The prompts as a list of 1-D integer arrays of length >= 1, checked on the host."""
    if isinstance(prompts, (str, bytes, bytearray)):
        raise TypeError(
            f"generate_batch: prompts must be rows of integer token ids, got {type(prompts).__name__} "
            f"{prompts[:20]!r}; use generate_bytes for text"
        )
    if isinstance(prompts, (np.ndarray, jax.Array)):
        prompts = np.asarray(prompts)
        prompts = list(prompts[None] if prompts.ndim == 1 else prompts) if prompts.ndim in (1, 2) else [prompts]
    rows = []
    for i, row in enumerate(prompts):
        if isinstance(row, (str, bytes, bytearray)):
            raise TypeError(f"generate_batch: prompt {i} is {type(row).__name__}, not token ids; use list(...) of it")
        ids = np.asarray(row)
        if ids.ndim != 1 or ids.size < 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(
                f"generate_batch: prompt {i} must be integer token ids of length >= 1, got {ids.dtype} "
                f"{tuple(ids.shape)}"
            )
        rows.append(ids)
    if not rows:
        raise ValueError("generate_batch: prompts is empty; give at least one row of token ids")
    return rows


def _per_row(name: str, value: Any, batch: int, ok: Any) -> list[Any]:
    """One setting per row, from one value for all rows or a sequence of `batch` values, each checked by `ok`."""
    one = value is None or isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray))
    values = [value] * batch if one else list(value)
    if len(values) != batch:
        raise ValueError(f"generate_batch: {name} has {len(values)} values for {batch} prompts")
    bad = [v for v in values if not ok(v)]
    if bad:
        what = "a positive integer" if name == "max_new_tokens" else "an integer token id or None"
        raise ValueError(f"generate_batch: each of {name} must be {what}, got {bad[0]!r}")
    return [None if v is None else int(v) for v in values]


def generate_tokens(
    model: Layer,
    params: Params,
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    context_len: int | None = None,
    stop: int | None = None,
    key: PRNGKey | int | None = None,
    temperature: float = 0.8,
    top_k: int | None = None,
    top_p: float | None = None,
    model_state: State = None,
    policy: Policy | str = "fp32",
    empty_prompt: int = 0,
) -> list[int]:
    """Continues one row of token ids by up to `max_new_tokens` ids, or up to and including the id `stop`; returns
    the new ids only.

    `context_len`: the longest sequence the model takes (a learned position table's length; None: unlimited). A
    longer text is generated in windows: when the window is full, generation restarts from its last half. An empty
    prompt starts from `empty_prompt` (e.g. a tokenizer's beginning-of-text id).
    """
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"generate: the number of new tokens must be an integer >= 0, got {max_new_tokens!r}")
    if context_len is not None and context_len < 2:
        raise ValueError(f"generate: context_len must be >= 2, got {context_len!r}")
    key = as_key(key)
    tokens = [int(t) for t in prompt] or [empty_prompt]
    out: list[int] = []
    while len(out) < max_new_tokens and not (out and out[-1] == stop):
        context = tokens[-(context_len // 2) :] if context_len and len(tokens) >= context_len else tokens
        room = max_new_tokens - len(out) if context_len is None else context_len - len(context)
        new = generate_batch(
            model,
            params,
            [context],
            min(max_new_tokens - len(out), room),
            stop_tokens=stop,
            key=jax.random.fold_in(key, len(out)),
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            model_state=model_state,
            policy=policy,
        )
        chunk = [int(t) for t in new.tokens[0, : new.lengths[0]]]
        out += chunk
        tokens += chunk
    return out


def generate_bytes(
    model: Layer,
    params: Params,
    prompt: bytes,
    num_bytes: int,
    *,
    context_len: int | None = None,
    stop: int | None = None,
    key: PRNGKey | int | None = None,
    temperature: float = 0.8,
    top_k: int | None = None,
    top_p: float | None = None,
    model_state: State = None,
    policy: Policy | str = "fp32",
) -> bytes:
    """Continues a byte string with a byte-level model (vocabulary 256), e.g. the built-in GPT, by `num_bytes`
    bytes or up to and including the byte `stop`; returns the continuation only (`generate_tokens` on bytes)."""
    if isinstance(prompt, str):
        raise TypeError(f"generate_bytes: prompt must be bytes, got str {prompt[:20]!r}; encode it, e.g. .encode()")
    if not isinstance(num_bytes, int) or isinstance(num_bytes, bool) or num_bytes < 0:
        raise ValueError(f"generate_bytes: num_bytes must be an integer >= 0, got {num_bytes!r}")
    new = generate_tokens(
        model, params, list(prompt), num_bytes, context_len=context_len, stop=stop, key=key,
        temperature=temperature, top_k=top_k, top_p=top_p, model_state=model_state, policy=policy,
    )  # fmt: skip
    return bytes(new)


def generate_text(
    model: Layer,
    params: Params,
    prompt: str,
    max_new_tokens: int,
    *,
    tokenizer: Any = None,
    stop: str | None = None,
    bos_id: int | None = None,
    end_id: int | None = None,
    **sampling: Any,
) -> str:
    """The prompt and its continuation as text: encoded and decoded with `tokenizer` (a `tokenizers.Tokenizer`,
    e.g. the one a fine-tuned checkpoint recorded), else as UTF-8 bytes for a byte-level model. `stop`: one
    token's text (a single byte without a tokenizer) that ends generation; without it, the id `end_id` (e.g. the
    checkpoint's end-of-text id) does. Other keywords: `generate_tokens`'."""
    if tokenizer is None:
        stop_id = None if stop is None else _one_byte(stop)
        ids = list(prompt.encode())
    else:
        stop_id = None if stop is None else tokenizer.token_to_id(stop)
        if stop is not None and stop_id is None:
            raise ValueError(f"generate: stop {stop!r} is not one token of the tokenizer")
        ids = tokenizer.encode(prompt).ids
    stop_id = end_id if stop is None else stop_id
    new = generate_tokens(model, params, ids, max_new_tokens, stop=stop_id, empty_prompt=bos_id or 0, **sampling)
    if tokenizer is None:
        return bytes(ids + new).decode("utf-8", "replace")
    vocab = tokenizer.get_vocab_size()
    unknown = sum(t >= vocab for t in new)
    if unknown:
        log.warning("generate: %d of %d new ids are outside the tokenizer's %d tokens; they print as nothing",
                    unknown, len(new), vocab)  # fmt: skip
    return tokenizer.decode(ids + new)


def _one_byte(stop: str) -> int:
    encoded = stop.encode()
    if len(encoded) != 1:
        raise ValueError(f"generate: stop must be one byte (a character such as a newline), got {stop!r}")
    return encoded[0]
