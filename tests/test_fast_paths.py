"""Every fast path gives the numbers of the simple path it replaces, on fresh random inputs (values and gradients),
and keeps the bf16 x bf16 -> f32 product form in the lowered HLO."""

import dataclasses
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxnn.layers import Conv, MaxPool
from jaxnn.precision import BF16

CONV_CASES = [
    # kernel, strides, padding, dilation, input shape
    ((3, 3), 1, "SAME", 1, (2, 9, 8, 3)),
    ((3, 3), 2, "SAME", 1, (2, 9, 8, 4)),
    ((3, 2), (2, 1), "VALID", (1, 2), (1, 10, 9, 3)),
    ((5, 5), 1, [(1, 2), (0, 3)], 1, (2, 7, 7, 2)),
    ((1, 1), 1, "SAME", 1, (3, 4, 4, 5)),
    ((3,), 1, "CAUSAL", 2, (2, 11, 3)),
    ((4,), 3, "SAME", 1, (2, 13, 2)),
]


def _pair(case, key, features=6):
    kernel, strides, padding, dilation, shape = case
    kwargs = {"strides": strides, "padding": padding, "dilation": dilation}
    ref, fast = Conv(features, kernel, lowering="xla", **kwargs), Conv(features, kernel, lowering="im2col", **kwargs)
    k_init, k_x, k_b = jax.random.split(key, 3)
    out_shape, params = ref.init(k_init, shape)
    assert fast.init(k_init, shape)[0] == out_shape
    params = {**params, "b": jax.random.normal(k_b, params["b"].shape)}
    x = jax.random.normal(k_x, shape)
    return ref, fast, params, x


@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: f"k{c[0]}-s{c[1]}-{c[2]}-d{c[3]}")
@pytest.mark.slow
def test_conv_im2col_matches_xla(case, key):
    # crc32, not hash(): Python salts str hashes per process, so those seeds could not be reproduced.
    ref, fast, params, x = _pair(case, jax.random.fold_in(key, zlib.crc32(str(case).encode()) % 1000))
    y_ref = ref.apply(params, x)
    y_fast = jax.jit(fast.apply)(params, x)
    assert y_fast.shape == y_ref.shape
    np.testing.assert_allclose(y_fast, y_ref, rtol=1e-5, atol=1e-5)

    def loss(layer):
        return lambda p, x: jnp.sum(jnp.sin(layer.apply(p, x)))

    g_ref = jax.grad(loss(ref), argnums=(0, 1))(params, x)
    g_fast = jax.jit(jax.grad(loss(fast), argnums=(0, 1)))(params, x)
    for a, b in zip(jax.tree.leaves(g_fast), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_conv_im2col_bf16_matches_xla(key):
    ref, fast, params, x = _pair(CONV_CASES[0], key)
    xb = x.astype(jnp.bfloat16)
    pb = BF16.cast_to_compute(params)
    y_ref = ref.apply(pb, xb, policy=BF16).astype(jnp.float32)
    y_fast = fast.apply(pb, xb, policy=BF16).astype(jnp.float32)
    # Both accumulate exact bf16 products in float32; only the summation order and the final rounding differ.
    np.testing.assert_allclose(y_fast, y_ref, rtol=2e-2, atol=2e-2)


def test_conv_im2col_bf16_hlo_has_bf16_operands_f32_result(key):
    _, fast, params, x = _pair(CONV_CASES[0], key)
    text = (
        jax.jit(lambda p, x: fast.apply(p, x, policy=BF16))
        .lower(BF16.cast_to_compute(params), x.astype(jnp.bfloat16))
        .as_text()
    )
    dots = re.findall(r"stablehlo\.dot_general.*", text)
    assert dots, "the im2col lowering must contract with a dot_general"
    assert all(re.search(r"\(tensor<[^>]*bf16>, tensor<[^>]*bf16>\) -> tensor<[^>]*f32>", d) for d in dots), dots


def test_conv_im2col_refuses_feature_groups():
    with pytest.raises(ValueError, match="feature groups"):
        Conv(4, 3, feature_group_count=2, lowering="im2col")


POOL_CASES = [
    # window, input shape (odd sizes: VALID pooling crops what no window covers, SAME pads)
    (2, (3, 8, 8, 5)),
    (2, (2, 7, 9, 3)),
    (3, (2, 10, 11, 4)),
    ((2, 3), (2, 8, 7, 3)),
    ((2,), (3, 11, 4)),
]


@pytest.mark.parametrize("window,shape", POOL_CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("padding", ["VALID", "SAME"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.slow
def test_max_pool_reshape_matches_reduce_window(window, shape, padding, dtype, key):
    ref = MaxPool(window, padding=padding, lowering="reduce_window")
    fast = MaxPool(window, padding=padding, lowering="reshape")
    assert fast.init(None, shape)[0] == ref.init(None, shape)[0]
    seed = int(jax.random.key_data(jax.random.fold_in(key, len(shape) * 100 + shape[1])).ravel()[-1])
    x = jnp.asarray(_distinct_values(np.random.default_rng(seed), shape), dtype)
    y_ref = ref.apply({}, x)
    y_fast = jax.jit(fast.apply)({}, x)
    assert y_fast.dtype == dtype and y_fast.shape == y_ref.shape
    np.testing.assert_array_equal(np.asarray(y_fast, np.float32), np.asarray(y_ref, np.float32))
    cotangent = jax.random.normal(jax.random.key(seed), y_ref.shape, dtype=jnp.float32).astype(dtype)

    def grad(layer):
        return jax.grad(lambda x: jnp.vdot(layer.apply({}, x).astype(jnp.float32), cotangent))

    np.testing.assert_array_equal(np.asarray(jax.jit(grad(fast))(x), np.float32), np.asarray(grad(ref)(x), np.float32))


def _distinct_values(rng, shape):
    """Random values that bf16 represents exactly and that are all different: no window has a tied maximum, so
    both lowerings' gradients are the same (unique) derivative."""
    grid = np.linspace(-4, 4, 40001, dtype=np.float32).astype(jnp.bfloat16).astype(np.float32)
    return rng.choice(np.unique(grid), size=shape, replace=False)


def test_max_pool_ties_split_the_gradient():
    x = jnp.zeros((1, 2, 2, 1))  # one window, four equal maxima: the reshape form shares the gradient evenly
    g = jax.grad(lambda x: MaxPool(2, lowering="reshape").apply({}, x).sum())(x)
    np.testing.assert_array_equal(g, np.full((1, 2, 2, 1), 0.25))


def test_max_pool_reshape_is_refused_where_it_does_not_apply():
    with pytest.raises(ValueError, match=r"MaxPool: the reshape lowering needs non-overlapping windows"):
        MaxPool(3, strides=1, lowering="reshape")
    with pytest.raises(ValueError, match=r"MaxPool: unknown lowering 'im2col'"):
        MaxPool(2, lowering="im2col")


def test_conv_unknown_lowering():
    with pytest.raises(ValueError, match="unknown lowering"):
        Conv(4, 3, lowering="fft")


@pytest.mark.parametrize(
    "spec, shape_a, shape_b",
    [
        ("BTNH,BSNH->BNTS", (2, 5, 3, 8), (2, 6, 3, 8)),
        ("BNTS,BSNH->BTNH", (2, 3, 5, 6), (2, 6, 3, 8)),
    ],
)
@pytest.mark.slow
def test_half_attention_products_match_float32_and_run(spec, shape_a, shape_b, key):
    """The bf16 attention products (precision.einsum) give float32 einsum's values and gradients; their
    weight-side transposes once hit XLA's DotThunk on the CPU, which has no bf16 x bf16 -> f32."""
    from jaxnn import precision

    a = jax.random.normal(key, shape_a).astype(jnp.bfloat16)
    b = jax.random.normal(jax.random.fold_in(key, 1), shape_b).astype(jnp.bfloat16)

    def half_product(a, b):
        return precision.einsum(spec, a, b)

    def loss(f):
        return lambda a, b: jnp.sum(jnp.sin(f(a, b)))

    def exact(a, b):
        return jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32))

    np.testing.assert_allclose(jax.jit(half_product)(a, b), exact(a, b), rtol=1e-5, atol=1e-5)
    g_half = jax.jit(jax.grad(loss(half_product), argnums=(0, 1)))(a, b)
    g_exact = jax.grad(loss(exact), argnums=(0, 1))(a.astype(jnp.float32), b.astype(jnp.float32))
    for half, ref in zip(g_half, g_exact):
        assert half.dtype == jnp.bfloat16
        np.testing.assert_allclose(half.astype(jnp.float32), ref, rtol=3e-2, atol=3e-2)


@pytest.mark.slow
def test_bf16_gpt_step_runs_with_either_attention(key):
    import optax

    from jaxnn import train
    from jaxnn.models import GPT, GPTConfig

    tx = optax.adam(1e-3)
    batch = {"x": jnp.ones((2, 32), jnp.int32), "y": jnp.ones((2, 32), jnp.int32)}
    losses = {}
    for impl in ("f32acc", "xla"):
        model = GPT(dataclasses.replace(GPTConfig().small(), attention_implementation=impl))
        state = train.create_train_state(model, tx, key, (2, 32), "bf16")
        _, metrics = train.make_train_step(model, train.language_model_loss, tx, "bf16")(state, batch)
        losses[impl] = float(metrics["loss"])
    np.testing.assert_allclose(losses["f32acc"], losses["xla"], rtol=1e-2)
