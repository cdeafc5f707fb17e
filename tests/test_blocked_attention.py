"""The blocked attention path (`jaxnn.layers.blocked_attention`, "auto" for float32 on CPUs): values and all three
gradients against jax's XLA path and PyTorch's scaled_dot_product_attention, float64 gradients against finite
differences, and the blocks it takes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxnn import layers as L
from jaxnn.layers import blocked_attention as BA


def qkv_do(rng, B, T, S, N, H, dtype=np.float32):
    q, do = (jnp.asarray(rng.standard_normal((B, T, N, H)), dtype) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((B, S, N, H)), dtype) for _ in range(2))
    return q, k, v, do


def segments_mask(rng, B, T):
    segments = np.sort(rng.integers(0, 3, (B, T)), axis=1)
    return jnp.asarray(segments[:, None, :, None] == segments[:, None, None, :])


def value_and_grads(fn, q, k, v, do):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(do))


@pytest.mark.parametrize(
    "B, T, S, causal, mask",
    [
        (2, 128, 128, True, None),  # four blocks
        (2, 100, 100, True, "segments"),  # three blocks of unequal length, a packed batch
        (1, 300, 300, True, None),  # the most blocks
        (2, 50, 70, False, "keys"),  # cross-attention shapes with a padding mask: one block
        (2, 50, 70, True, None),  # causal with T != S: one block, the mask aligned at the first position
        (1, 6, 6, True, None),  # shorter than two blocks
    ],
)
def test_values_and_gradients_match_jax_xla_attention(B, T, S, causal, mask):
    rng = np.random.default_rng(T + S)
    q, k, v, do = qkv_do(rng, B, T, S, 2, 16)
    valid = {"keys": jnp.asarray(rng.random((B, 1, 1, S)) < 0.7), "segments": None, None: None}[mask]
    if mask == "segments":
        valid = segments_mask(rng, B, T)

    def reference(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, mask=valid, is_causal=causal, implementation="xla")

    got = value_and_grads(jax.jit(lambda q, k, v: BA.attention(q, k, v, valid, causal)), q, k, v, do)
    want = value_and_grads(reference, q, k, v, do)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


@pytest.mark.slow
def test_padded_rows_that_see_no_key_match_jax_when_blocks_are_off():
    # Under a padding mask a causal query can see no key at all; jax's path then weighs every key equally, which
    # only one block (every key present) reproduces, so MultiHeadAttention passes skip_hidden_keys=False there.
    rng = np.random.default_rng(0)
    q, k, v, do = qkv_do(rng, 2, 64, 64, 2, 8)
    valid = jnp.asarray(np.arange(64)[None, None, None, :] >= np.array([10, 40])[:, None, None, None])
    got = value_and_grads(lambda q, k, v: BA.attention(q, k, v, valid, True, skip_hidden_keys=False), q, k, v, do)
    want = value_and_grads(
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=valid, is_causal=True, implementation="xla"),
        q,
        k,
        v,
        do,
    )
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("causal", [pytest.param(True, marks=pytest.mark.slow), False])
def test_float64_gradients_match_finite_differences(causal):
    rng = np.random.default_rng(1)
    assert len(BA.query_blocks(70, 70, causal)) == (2 if causal else 1)
    with jax.enable_x64(True):
        q, k, v, _ = qkv_do(rng, 1, 70, 70, 2, 4, np.float64)
        assert q.dtype == jnp.float64
        valid = segments_mask(rng, 1, 70)
        check_grads(lambda q, k, v: BA.attention(q, k, v, valid, causal), (q, k, v), order=1, modes="rev")


@pytest.mark.slow
def test_forward_mode_matches_jax_xla_attention():
    # Plain jax functions, so jvp (and jacfwd, linearize) goes through, as through jax's path.
    rng = np.random.default_rng(5)
    q, k, v, _ = qkv_do(rng, 1, 96, 96, 2, 8)
    tangents = qkv_do(rng, 1, 96, 96, 2, 8)[:3]
    _, got = jax.jvp(lambda q, k, v: BA.attention(q, k, v, None, True), (q, k, v), tangents)
    _, want = jax.jvp(
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"), (q, k, v), tangents
    )
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.slow
def test_matches_pytorch_scaled_dot_product_attention():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    q, k, v, do = qkv_do(rng, 2, 96, 96, 3, 8)
    got = value_and_grads(lambda q, k, v: BA.attention(q, k, v, None, True), q, k, v, do)
    tq, tk, tv = (torch.tensor(np.asarray(x).transpose(0, 2, 1, 3), requires_grad=True) for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
    out.backward(torch.tensor(np.asarray(do).transpose(0, 2, 1, 3)))
    want = [t.detach().numpy().transpose(0, 2, 1, 3) for t in (out, tq.grad, tk.grad, tv.grad)]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("T", [1, 63, 64, 100, 128, 255, 256, 1000, 4096])
def test_query_blocks_cover_the_queries_in_at_most_max_blocks_of_at_least_min_block(T):
    blocks = BA.query_blocks(T, T, causal=True)
    assert blocks[0][0] == 0 and blocks[-1][1] == T
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
    assert len(blocks) <= BA.MAX_BLOCKS
    assert len(blocks) == 1 or min(end - start for start, end in blocks) >= BA.MIN_BLOCK
    assert BA.query_blocks(T, T, causal=False) == ((0, T),)


@pytest.mark.slow
def test_multi_head_attention_blocked_equals_xla_with_grouped_heads_and_padding():
    rng = np.random.default_rng(3)
    blocked, xla = (L.MultiHeadAttention(4, num_kv_heads=2, causal=True, implementation=i) for i in ("blocked", "xla"))
    _, params = xla.init(jax.random.key(0), (2, 80, 16))
    x = jnp.asarray(rng.standard_normal((2, 80, 16)), jnp.float32)
    mask = jnp.asarray(np.arange(80)[None, :] >= np.array([0, 30])[:, None])  # left padding: rows that see no key

    def loss(layer):
        return lambda p, x: jnp.sum(jnp.sin(layer.apply(p, x, mask=mask)))

    for g, w in zip(
        jax.tree.leaves(jax.value_and_grad(loss(blocked), argnums=(0, 1))(params, x)),
        jax.tree.leaves(jax.value_and_grad(loss(xla), argnums=(0, 1))(params, x)),
        strict=True,
    ):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5)


@pytest.mark.slow
def test_bf16_operands_give_bf16_outputs_close_to_float32():
    rng = np.random.default_rng(4)
    q, k, v, do = qkv_do(rng, 1, 64, 64, 2, 8)
    half = value_and_grads(
        lambda q, k, v: BA.attention(q, k, v, None, True), *(x.astype(jnp.bfloat16) for x in (q, k, v, do))
    )
    full = value_and_grads(lambda q, k, v: BA.attention(q, k, v, None, True), q, k, v, do)
    for h, f in zip(half, full, strict=True):
        assert h.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(h, np.float32), f, rtol=0, atol=0.05 * float(jnp.abs(f).max()))


def test_blocks_that_do_not_cover_the_queries_are_refused_in_one_line():
    q = jnp.zeros((1, 8, 1, 4))
    for blocks, causal in ((((0, 4), (5, 8)), True), (((0, 4), (4, 8)), False), (((0, 4),), True)):
        with pytest.raises(ValueError, match="must cover 0..8 in order"):
            BA.attention(q, q, q, None, causal, blocks=blocks)
    np.testing.assert_allclose(
        BA.attention(q + 1, q, q, None, True, blocks=BA.even_blocks(8, 2)), BA.attention(q + 1, q, q, None, True)
    )
