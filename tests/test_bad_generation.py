"""Bad input to generation: token ids outside the vocabulary, text given to the token API, decoding past the KV
cache and out-of-range seeds each get one line naming the value, checked on the host before anything compiles;
never zeros or overwritten cache entries passed off as tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxnn import layers as L
from jaxnn.config import ConfigError
from jaxnn.generate import generate, generate_batch, generate_bytes
from jaxnn.layers import LayerError, init_cache, run_cached
from jaxnn.layers.core import init_model
from jaxnn.models import GPT, GPTConfig


@pytest.fixture(scope="module")
def gpt():
    model = GPT(GPTConfig(seq_len=16, d_model=16, num_layers=1, num_heads=2))
    return model, jax.jit(lambda key: init_model(model, key, (1, 4))[1])(jax.random.key(0))


@pytest.mark.parametrize("bad", [300, 256, -1])
@pytest.mark.parametrize("use_cache", [True, False])
def test_prompt_ids_outside_the_vocabulary_are_refused(gpt, bad, use_cache):
    model, params = gpt
    with pytest.raises(
        ValueError, match=rf"^generate: prompt token ids must be in \[0, 256\) .*got {bad} at index \(1, 1\)"
    ):
        generate(model, params, [[1, 2, 3], [1, bad, 2]], 3, use_cache=use_cache)


def test_text_given_to_the_token_api_is_refused_with_the_way_to_pass_it(gpt):
    model, params = gpt
    for text, kind in ((b"hello", "bytes"), ("hello", "str")):
        with pytest.raises(
            TypeError, match=rf"^generate: prompt must be integer token ids, got {kind} .*generate_bytes"
        ):
            generate(model, params, text, 3)
    with pytest.raises(TypeError, match=r"^generate_bytes: prompt must be bytes, got str 'hello'"):
        generate_bytes(model, params, "hello", 3)
    with pytest.raises(ValueError, match=r"^generate: prompt rows must all have the same length"):
        generate(model, params, [[1, 2, 3], [4]], 3)


def test_decoding_past_the_cache_is_refused_eagerly_and_nan_under_jit(gpt):
    model, params = gpt
    prompt = jnp.array([[1, 2, 3, 4]])
    step = jax.jit(lambda p, x, c: run_cached(model, p, x, c))
    logits, cache = step(params, prompt, init_cache(model, (1, 4), 6, jnp.float32))
    assert np.isfinite(logits).all()
    with pytest.raises(
        LayerError,
        match=r"^gpt/2_block/0_attn/1_attention: decoding 3 position\(s\) from position 4 overruns the "
        r"cache of 6 positions; build it with max_len >= 7",
    ):
        run_cached(model, params, prompt[:, :3], cache)  # eager: the cache's index is a concrete 4
    logits, _ = step(params, prompt, cache)  # positions 4..7 of a 6-position cache
    assert np.isnan(logits).all()


@pytest.mark.parametrize("seed", [-1, 2**32, True])
def test_seeds_out_of_range_are_refused(gpt, seed):
    model, params = gpt
    with pytest.raises(
        ConfigError,
        match=rf"^generate: key \(a PRNG key or an integer seed\) must be an integer in \[0, 2\*\*32\), got {seed}$",
    ):
        generate(model, params, [[1, 2]], 2, key=seed, temperature=1.0)


def test_sampling_settings_that_are_not_numbers_are_refused(gpt):
    model, params = gpt
    with pytest.raises(ValueError, match=r"^generate: temperature must be >= 0 \(a number; 0 is greedy\), got 'hot'"):
        generate(model, params, [[1, 2]], 2, temperature="hot")
    with pytest.raises(ValueError, match=r"^generate: top_p must be in \(0, 1\], got '0.9'"):
        generate(model, params, [[1, 2]], 2, temperature=1.0, top_p="0.9", key=0)
    with pytest.raises(ValueError, match=r"^generate: max_new_tokens must be a positive integer, got True"):
        generate(model, params, [[1, 2]], True)


def test_bad_batches_are_refused_naming_the_row_or_setting(gpt):
    model, params = gpt
    ragged = [[1, 2, 3], [4]]
    cases = [
        (
            {"prompts": [[1, 2], [3, 256]]},
            r"^generate: prompt token ids must be in \[0, 256\) .*got 256 at index \(1, 1\)",
        ),
        (
            {"prompts": [[1], []]},
            r"^generate_batch: prompt 1 must be integer token ids of length >= 1, got float64 \(0,\)",
        ),
        ({"max_new_tokens": [3]}, r"^generate_batch: max_new_tokens has 1 values for 2 prompts"),
        ({"max_new_tokens": [3, 0]}, r"^generate_batch: each of max_new_tokens must be a positive integer, got 0"),
        ({"stop_tokens": [None, 300]}, r"^generate_batch: stop_tokens\[1\] 300 is outside the model's vocabulary"),
        ({"stop_tokens": "\n"}, r"^generate_batch: each of stop_tokens must be an integer token id or None, got '\\n'"),
        ({"pad_id": -1}, r"^generate_batch: pad_id -1 is outside the model's vocabulary \[0, 256\)"),
    ]
    for kwargs, message in cases:
        args = {"prompts": ragged, "max_new_tokens": 3, **kwargs}
        with pytest.raises(ValueError, match=message):
            generate_batch(model, params, args.pop("prompts"), args.pop("max_new_tokens"), **args)
    with pytest.raises(TypeError, match=r"^generate_batch: prompt 1 is bytes, not token ids"):
        generate_batch(model, params, [[1], b"hi"], 3)
    # Without the cache, a ragged batch past the 16-row position table is refused by the table, not read as NaN.
    with pytest.raises(
        ValueError,
        match=r"^gpt/1_pos_embed: expected input of rank 3 \(batch, time <= 16, features\), got shape \(1, 17, 16\)",
    ):
        generate_batch(model, params, ragged, 14, use_cache=False)
    plain = L.serial(L.Embedding(5, 4), L.Dense(5))
    with pytest.raises(ValueError, match=r"^generate_batch: prompts of different lengths need a model taking the mask"):
        generate_batch(plain, plain.init(jax.random.key(0), (1, 2))[1], [[1, 2], [3]], 2, use_cache=False)
