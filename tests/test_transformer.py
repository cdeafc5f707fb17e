"""The transformer pieces against independent references: grouped-query attention against numpy in float64,
cross-attention against Flax, rotary embeddings against the complex-number form; side inputs through combinators;
Repeat and remat against the flat model; KV-cache generation against repeated full forward passes."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxnn import layers as L
from jaxnn.decoding import compiled_programs
from jaxnn.generate import generate, generate_batch
from jaxnn.models import GPT, GPTConfig


def random_like(tree, key, scale=0.5):
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape, x.dtype) * scale for k, x in zip(keys, leaves)])


def numpy_attention(x, params, num_heads, num_kv_heads, mask, causal, positions=None, rope=False):
    """Grouped-query attention in float64 numpy: key/value head j // G serves query head j."""
    x = np.asarray(x, np.float64)
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    B, T, D = x.shape
    H = D // num_heads
    q = (x @ p["q"]["w"] + p["q"]["b"]).reshape(B, T, num_heads, H)
    kv = x @ p["kv"]["w"] + p["kv"]["b"]
    k, v = (a.reshape(B, T, num_kv_heads, H) for a in np.split(kv, 2, axis=-1))
    if rope:
        q, k = numpy_rope(q, positions), numpy_rope(k, positions)
    G = num_heads // num_kv_heads
    k, v = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
    logits = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
    valid = np.broadcast_to(mask[:, None, None, :], logits.shape)
    if causal:
        valid = valid & np.tril(np.ones((T, T), bool))
    logits = np.where(valid, logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    o = np.einsum("bnts,bsnh->btnh", probs, v).reshape(B, T, D)
    return o @ p["out"]["w"] + p["out"]["b"]


def numpy_rope(x, positions, base=10000.0):
    """RoPE as a complex rotation: the pair (x[i], x[i + H/2]) is the complex number x[i] + i x[i + H/2]."""
    H = x.shape[-1]
    z = x[..., : H // 2] + 1j * x[..., H // 2 :]
    freq = base ** (-np.arange(H // 2) * 2.0 / H)
    z = z * np.exp(1j * np.asarray(positions, np.float64)[:, :, None, None] * freq)
    return np.concatenate([z.real, z.imag], axis=-1)


@pytest.mark.parametrize(
    "num_kv_heads, causal, rope",
    [
        (2, True, False),
        pytest.param(1, False, True, marks=pytest.mark.slow),
        pytest.param(4, True, True, marks=pytest.mark.slow),
    ],
)
def test_grouped_query_attention_matches_numpy(num_kv_heads, causal, rope, key):
    layer = L.MultiHeadAttention(4, num_kv_heads=num_kv_heads, causal=causal, rope=rope)
    shape = (2, 6, 16)
    params = random_like(layer.init(key, shape)[1], jax.random.key(1))
    if num_kv_heads == 4:  # fused qkv: the same weights split into the q and kv parts the reference reads
        w, b = params["qkv"]["w"], params["qkv"]["b"]
        ref_params = {"q": {"w": w[:, :16], "b": b[:16]}, "kv": {"w": w[:, 16:], "b": b[16:]}, "out": params["out"]}
    else:
        ref_params = params
    x = jax.random.normal(jax.random.key(2), shape)
    mask = np.array([[1, 1, 1, 1, 0, 0], [1] * 6], bool)
    positions = np.array([[3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 5]])
    with jax.enable_x64(True):
        p64 = jax.tree.map(lambda a: a.astype(jnp.float64), params)
        y = layer.apply(p64, x.astype(jnp.float64), mask=mask, **({"positions": positions} if rope else {}))
    expected = numpy_attention(x, ref_params, 4, num_kv_heads, mask, causal, positions, rope)
    real = mask[:, :, None] if not causal else np.ones_like(mask)[:, :, None]
    np.testing.assert_allclose(np.where(real, y, 0), np.where(real, expected, 0), rtol=1e-10, atol=1e-10)


def test_cross_attention_matches_flax(key):
    layer = L.MultiHeadAttention(2, cross=True, context_features=6)
    x, context = jax.random.normal(key, (2, 5, 8)), jax.random.normal(jax.random.key(1), (2, 7, 6))
    context_mask = jnp.array([[1] * 7, [1, 1, 1, 0, 0, 0, 0]], bool)
    params = random_like(layer.init(key, x.shape)[1], jax.random.key(2))
    y = layer.apply(params, x, context=context, context_mask=context_mask)
    kw, kb = jnp.split(params["kv"]["w"], 2, axis=-1), jnp.split(params["kv"]["b"], 2)
    flax_params = {
        "query": {"kernel": params["q"]["w"].reshape(8, 2, 4), "bias": params["q"]["b"].reshape(2, 4)},
        "key": {"kernel": kw[0].reshape(6, 2, 4), "bias": kb[0].reshape(2, 4)},
        "value": {"kernel": kw[1].reshape(6, 2, 4), "bias": kb[1].reshape(2, 4)},
        "out": {"kernel": params["out"]["w"].reshape(2, 4, 8), "bias": params["out"]["b"]},
    }
    flax_y = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8, out_features=8).apply(
        {"params": flax_params}, x, context, mask=context_mask[:, None, None, :]
    )
    np.testing.assert_allclose(y, flax_y, rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match=r"attention: cross-attention needs the context= side input"):
        layer.apply(params, x)
    with pytest.raises(ValueError, match=r"attention: context_mask must be bool of shape \(2, 7\), got bool \(2, 5\)"):
        layer.apply(params, x, context=context, context_mask=context_mask[:, :5])


def test_rotary_embedding_matches_complex_rotation_and_is_relative(key):
    x = jax.random.normal(key, (2, 5, 3, 8))
    positions = jnp.array([[0, 1, 2, 3, 4], [7, 3, 9, 0, 2]])
    np.testing.assert_allclose(L.rotary_embedding(x, positions), numpy_rope(np.asarray(x), positions), atol=1e-5)
    q, k = x[:, :1], x[:, 1:2]

    def score(m, n):
        pm, pn = jnp.full((2, 1), m), jnp.full((2, 1), n)
        return jnp.sum(L.rotary_embedding(q, pm) * L.rotary_embedding(k, pn), axis=-1)

    np.testing.assert_allclose(score(3, 1), score(10, 8), rtol=1e-4, atol=1e-5)  # only m - n matters


@pytest.mark.slow
def test_mask_and_positions_travel_through_serial_and_blocks(key):
    model = L.serial(L.Dense(8), L.TransformerBlock(2, causal=False, rope=True), L.TransformerBlock(2, causal=False))
    assert model.side_inputs == {"mask", "positions", "segment_ids"}
    x = jax.random.normal(key, (2, 6, 4))
    _, params = model.init(key, x.shape)
    mask = jnp.array([[1, 1, 1, 1, 0, 0], [1] * 6], bool)
    y = model.apply(params, x, mask=mask)
    y_changed = model.apply(params, x.at[0, 4:].set(5.0), mask=mask)
    np.testing.assert_allclose(y_changed[0, :4], y[0, :4], rtol=1e-5, atol=1e-5)  # padding reaches every block
    assert not np.allclose(model.apply(params, x.at[0, 4:].set(5.0))[0, :4], y[0, :4], atol=1e-3)
    default_positions = jnp.broadcast_to(jnp.arange(6), (2, 6))
    np.testing.assert_allclose(model.apply(params, x, mask=mask, positions=default_positions), y, atol=1e-6)
    with pytest.raises(TypeError, match=r"serial: apply got unexpected keyword\(s\) context; it takes"):
        model.apply(params, x, context=x)
    with pytest.raises(ValueError, match=r"serial/1_block/0_attn/1_attention: mask must be bool of shape \(2, 6\)"):
        model.apply(params, x, mask=mask[:, :5])


def test_repeat_equals_the_flat_stack(key):
    block = L.TransformerBlock(2, drop_prob=0.2, num_kv_heads=1, norm="rms", mlp_ratio=1)
    flat, stacked = L.serial(block, block), L.Repeat(block, 2)
    x = jax.random.normal(key, (2, 5, 8))
    _, flat_params = flat.init(key, x.shape)
    _, params = stacked.init(key, x.shape)
    for i in range(2):  # layer i of the stack is the i-th child of the flat model, initialised alike
        jax.tree.map(
            np.testing.assert_array_equal, jax.tree.map(lambda a, i=i: a[i], params), flat_params[f"{i}_block"]
        )
    kwargs = {"key": jax.random.key(3), "train": True}
    y_stacked = jax.jit(lambda p: stacked.apply(p, x, **kwargs))(params)
    np.testing.assert_allclose(y_stacked, jax.jit(lambda p: flat.apply(p, x, **kwargs))(flat_params), atol=2e-6)
    # remat's gradients: the conformance table's "repeat_remat" case checks them against finite differences.


def test_repeat_threads_batch_norm_state(key):
    stacked = L.Repeat(L.residual(L.Dense(4), L.BatchNorm(momentum=0.5)), 2)
    x = jax.random.normal(key, (8, 4))
    _, params, state = L.init_model(stacked, key, x.shape)
    assert jax.tree.map(jnp.shape, state) == {"1_batch_norm": {"mean": (2, 4), "var": (2, 4)}}
    y, new_state = stacked.apply(params, x, state=state, train=True)
    h = x
    for i in range(2):  # the same two layers applied by hand, each with its own slice of params and state
        layer_state = jax.tree.map(lambda a, i=i: a[i], state)
        out, s = L.residual(L.Dense(4), L.BatchNorm(momentum=0.5)).apply(
            jax.tree.map(lambda a, i=i: a[i], params), h, state=layer_state, train=True
        )
        jax.tree.map(lambda a, b, i=i: np.testing.assert_allclose(a[i], b, atol=1e-6), new_state, s)
        h = out
    np.testing.assert_allclose(y, h, atol=1e-5)


GPTS = {
    "learned": GPTConfig(seq_len=40, d_model=32, num_layers=1, num_heads=4),
    "modern": GPTConfig(
        seq_len=8, d_model=32, num_layers=2, num_heads=4, position="rope", norm="rms", num_kv_heads=2, scan_layers=True
    ),
}


@pytest.fixture(scope="module", params=sorted(GPTS))
def peaked_gpt(request):
    model = GPT(GPTS[request.param])
    _, params = model.init(jax.random.key(0), (1, 8))
    return model, random_like(params, jax.random.key(1), scale=0.3)  # peaked logits: argmax ties are unlikely


@pytest.mark.slow
def test_ragged_greedy_generation_is_the_argmax_of_each_prompt_alone(peaked_gpt):
    """Left padding is invisible: each row of a ragged batch gets the tokens of full forward passes over its own
    unpadded prompt; stop tokens and per-row maxima end rows early, in the same compiled program."""
    model, params = peaked_gpt
    prompts = [[5, 200, 7, 1, 9], [42, 3], [17, 17, 250]]
    limits = [13, 13, 6]  # beyond seq_len for the rope model: no table limits it
    got = generate_batch(model, params, prompts, limits)
    # The reference: one row at a time, a full forward pass per new token over a fixed-size buffer (causal: later
    # slots do not matter), no padding, no cache.
    forward = jax.jit(model.apply)
    for row, (prompt, limit) in enumerate(zip(prompts, limits)):
        buffer = np.zeros((1, 18), np.int32)
        buffer[0, : len(prompt)] = prompt
        for t in range(len(prompt), len(prompt) + limit):
            buffer[0, t] = np.argmax(forward(params, jnp.asarray(buffer))[0, t - 1])
        np.testing.assert_array_equal(got.tokens[row, :limit], buffer[0, len(prompt) : len(prompt) + limit])
    assert got.tokens.shape == (3, 13) and got.tokens.dtype == np.int32 and list(got.lengths) == limits
    assert (got.tokens[2, 6:] == 0).all()  # pad_id after a row's end
    np.testing.assert_array_equal(generate_batch(model, params, prompts, limits, use_cache=False).tokens, got.tokens)

    # Row 0 stops at its third new token (first occurrence), row 1 at a token it never makes, row 2 has none.
    stop0 = int(got.tokens[0, 2])
    first0 = int(np.flatnonzero(got.tokens[0] == stop0)[0])
    unseen1 = min(set(range(256)) - set(got.tokens[1].tolist()))
    stopped = generate_batch(model, params, prompts, limits, stop_tokens=[stop0, unseen1, None])
    assert stopped.lengths[0] == first0 + 1 and stopped.tokens[0, first0] == stop0
    np.testing.assert_array_equal(stopped.tokens[0, : first0 + 1], got.tokens[0, : first0 + 1])
    assert (stopped.tokens[0, first0 + 1 :] == 0).all()
    np.testing.assert_array_equal(stopped.tokens[1:], got.tokens[1:])
    assert list(stopped.lengths[1:]) == limits[1:]
    # The rectangular call is the same program: prompt plus new tokens.
    same = generate(model, params, np.array([prompts[0]] * 2), 4)
    np.testing.assert_array_equal(same[:, 5:], np.stack([got.tokens[0, :4]] * 2))
    np.testing.assert_array_equal(same[:, :5], [prompts[0]] * 2)


@pytest.mark.slow
def test_sampling_cached_equals_uncached_and_respects_top_k_and_top_p(key):
    model = GPT(GPTS["learned"])
    _, params = model.init(key, (1, 8))
    prompt = jnp.zeros((4, 3), jnp.int32)
    kwargs = {"key": jax.random.key(9), "temperature": 1.3, "top_k": 50, "top_p": 0.95}
    ragged = [[0, 0, 0], [0], [0, 0], [0, 0, 0]]
    sampled = generate_batch(model, params, ragged, 8, **kwargs).tokens
    np.testing.assert_array_equal(sampled, generate_batch(model, params, ragged, 8, use_cache=False, **kwargs).tokens)
    assert len(np.unique(sampled)) > 4  # sampling, not greedy
    greedy = generate(model, params, prompt, 8)
    np.testing.assert_array_equal(
        generate(model, params, prompt, 8, key=jax.random.key(1), temperature=2, top_k=1), greedy
    )
    np.testing.assert_array_equal(
        generate(model, params, prompt, 8, key=jax.random.key(1), temperature=2, top_p=1e-6), greedy
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_new_tokens": 0}, r"max_new_tokens must be a positive integer, got 0"),
        ({"temperature": -1.0}, r"temperature must be >= 0"),
        ({"temperature": 1.0}, r"sampling \(temperature > 0\) needs key="),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"prompt": jnp.ones((2, 3))}, r"prompt must be integer token ids of shape \(batch, length >= 1\)"),
        ({"max_new_tokens": 40}, r"gpt/1_pos_embed: decoding 43 positions needs a table of >= 43, this has 40"),
    ],
)
def test_generate_refuses_bad_arguments(kwargs, message, key):
    model = GPT(GPTS["learned"])
    _, params = model.init(key, (1, 8))
    args = {"prompt": jnp.zeros((2, 3), jnp.int32), "max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        generate(model, params, args.pop("prompt"), args.pop("max_new_tokens"), **args)
    with pytest.raises(ValueError, match=r"has no decoding cache .* pass use_cache=False"):
        generate(L.serial(L.Embedding(5, 4), L.Dense(5)), {}, jnp.zeros((1, 2), jnp.int32), 3)


@pytest.mark.slow
def test_one_compile_per_bucket_and_decoding_under_x64(peaked_gpt):
    """Prompt lengths and maxima in the same buckets reuse one program; with jax_enable_x64 every dtype policy
    decodes (int64 literals once met the cache's int32 index), fp32 to the same tokens as without it."""
    model, params = peaked_gpt
    want = generate_batch(model, params, [[3, 1, 4], [1, 5, 9, 2, 6]], [9, 5])
    programs = compiled_programs()
    again = generate_batch(model, params, [[3, 1, 4, 1, 5, 9, 2], [6]], [11, 16], stop_tokens=7)
    assert compiled_programs() == programs and again.tokens.shape == (2, 16)
    with jax.enable_x64(True):
        for policy in ("fp32", "tf32", "bf16", "fp16"):
            out = generate_batch(model, params, [[3, 1, 4], [1, 5, 9, 2, 6]], [9, 5], policy=policy)
            assert list(out.lengths) == [9, 5] and ((out.tokens >= 0) & (out.tokens < 256)).all(), policy
            if policy == "fp32":
                np.testing.assert_array_equal(out.tokens, want.tokens)


@pytest.mark.parametrize("tied_rope", [True, False], ids=["tied-llama", "tied-gpt2"])
@pytest.mark.slow
def test_tied_and_swiglu_decoders_decode_with_a_cache_as_without(tied_rope, key):
    fields = {"position": "rope", "norm": "rms", "mlp": "swiglu", "bias": False, "num_kv_heads": 1} if tied_rope else {}
    cfg = dataclasses.replace(GPTConfig().small(), tie_embeddings=True, mlp_hidden=48, num_heads=2, **fields)
    model = GPT(cfg)
    _, params = model.init(key, (1, 8))
    assert "logits" not in " ".join(params)  # the output matrix is the embedding table
    ragged = [[5, 9, 2], [7], [1, 1]]
    cached = generate_batch(model, params, ragged, 6, key=jax.random.key(2), temperature=1.0)
    uncached = generate_batch(model, params, ragged, 6, key=jax.random.key(2), temperature=1.0, use_cache=False)
    np.testing.assert_array_equal(cached.tokens, uncached.tokens)
