"""Every layer: shape agreement, jit == eager, vmap == loop, float64 gradients vs finite differences, a bf16 run,
and clear errors for bad input."""

import cases_conv_norm
import cases_recurrent
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxnn import layers as L
from jaxnn.precision import BF16

# name -> (layer factory, input shape, input kind, needs train+key)
CASES = {
    "dense": (lambda: L.Dense(5), (3, 4), "float"),
    "dense_rank3": (lambda: L.Dense(5, use_bias=False), (2, 3, 4), "float"),
    "conv2d_strided": (lambda: L.Conv(4, 3, strides=2), (2, 7, 7, 3), "float"),
    "conv2d_dilated_grouped": (
        lambda: L.Conv(4, (3, 3), dilation=2, feature_group_count=2, padding="VALID"),
        (2, 9, 9, 4),
        "float",
    ),
    "conv2d_explicit_padding": (lambda: L.Conv(3, (2, 3), padding=((1, 0), (2, 1))), (2, 5, 6, 2), "float"),
    "conv1d_causal": (lambda: L.Conv(4, (3,), padding="CAUSAL", dilation=2), (2, 10, 3), "float"),
    "max_pool": (lambda: L.MaxPool(2), (2, 6, 6, 3), "float"),
    "avg_pool_same": (lambda: L.AvgPool(3, strides=2, padding="SAME"), (2, 7, 7, 3), "float"),
    "global_avg_pool": (lambda: L.GlobalAvgPool(), (2, 5, 5, 3), "float"),
    "flatten": (lambda: L.Flatten(), (2, 3, 4, 5), "float"),
    "embedding": (lambda: L.Embedding(11, 6), (2, 5), "int"),
    "pos_embed": (lambda: L.PositionEmbedding(8), (2, 5, 4), "float"),
    "layer_norm": (lambda: L.LayerNorm(), (2, 3, 8), "float"),
    "rms_norm": (lambda: L.RMSNorm(), (2, 3, 8), "float"),
    "batch_norm": (lambda: L.BatchNorm(momentum=0.9), (4, 5, 5, 3), "float"),
    "dropout": (lambda: L.Dropout(0.3), (3, 8), "float"),
    "relu": (lambda: L.Relu, (3, 8), "float"),
    "gelu": (lambda: L.Gelu, (3, 8), "float"),
    "silu": (lambda: L.Silu, (3, 8), "float"),
    "tanh": (lambda: L.Tanh, (3, 8), "float"),
    "softmax": (lambda: L.Softmax, (3, 8), "float"),
    "attention_causal": (lambda: L.MultiHeadAttention(2, causal=True), (2, 5, 8), "float"),
    "attention_xla": (lambda: L.MultiHeadAttention(2, causal=True, implementation="xla"), (2, 5, 8), "float"),
    "transformer_block": (lambda: L.TransformerBlock(2, drop_prob=0.1), (2, 5, 8), "float"),
    "attention_gqa_rope": (lambda: L.MultiHeadAttention(4, num_kv_heads=2, causal=True, rope=True), (2, 5, 8), "float"),
    "swiglu": (lambda: L.SwiGLU(12), (2, 5, 8), "float"),
    "llama_block": (
        lambda: L.TransformerBlock(
            4,
            num_kv_heads=2,
            rope=True,
            rope_base=5e5,
            norm="rms",
            norm_eps=1e-5,
            mlp="swiglu",
            mlp_hidden=12,
            bias=False,
        ),
        (2, 5, 8),
        "float",
    ),  # fmt: skip
    # The stack's machinery (stacked params, scan, per-layer dropout keys, remat); tests/test_transformer.py checks
    # it on transformer blocks against the flat model.
    "repeat_remat": (
        lambda: L.remat(L.Repeat(L.residual(L.RMSNorm(), L.Dense(8), L.Dropout(0.1)), 2)),
        (2, 5, 8),
        "float",
    ),
    "serial": (lambda: L.serial(L.Dense(6), L.Relu, L.Dropout(0.2), L.Dense(3)), (3, 4), "float"),
    "residual_with_batch_norm": (lambda: L.residual(L.Dense(4), L.BatchNorm(), L.Tanh), (3, 4), "float"),
    **cases_conv_norm.CASES,
    **cases_recurrent.CASES,
}


def make_input(key, shape, kind, dtype=jnp.float32):
    if kind == "int":
        return jax.random.randint(key, shape, 0, 11)
    return jax.random.normal(key, shape, dtype)


def setup(name, key, dtype=jnp.float32):
    factory, shape, kind = CASES[name]
    layer = factory()
    k_init, k_x = jax.random.split(key)
    out_shape, params, state = L.init_model(layer, k_init, shape)
    x = make_input(k_x, shape, kind, dtype)
    return layer, out_shape, params, state, x


# The cases whose three checks compile the largest programs (about 2-8 s each on 2 cores), and layers
# another case already covers (strided and padded conv2d, instance norm): `make test-all` runs them, the fast tier
# every other layer.
SLOW_CASES = {
    "attention_causal",
    "attention_gqa_rope",
    "bidirectional",
    "conv1d_causal",
    "conv2d_explicit_padding",
    "conv2d_strided",
    "conv3d",
    "conv_transpose2d",
    "conv_transpose3d",
    "gru",
    "instance_norm",
    "llama_block",
    "lstm",
    "repeat_remat",
    "residual_with_batch_norm",
    "serial",
    "transformer_block",
}
CASE_PARAMS = [pytest.param(name, marks=pytest.mark.slow) if name in SLOW_CASES else name for name in sorted(CASES)]


def forward(layer, params, state, x, key=jax.random.key(7), train=True, policy=None):
    return L.run(layer, params, x, state=state, key=key, train=train, policy=policy)


@pytest.mark.parametrize("name", CASE_PARAMS)
def test_shapes_jit_and_vmap(name, key):
    layer, out_shape, params, state, x = setup(name, key)
    y, _ = forward(layer, params, state, x)
    assert y.shape == tuple(out_shape)
    assert jnp.all(jnp.isfinite(y))

    y_jit, _ = jax.jit(lambda p, s, x: forward(layer, p, s, x))(params, state, x)
    np.testing.assert_allclose(y_jit, y, rtol=2e-5, atol=2e-5)

    xs = jnp.stack([make_input(k, x.shape, CASES[name][2]) for k in jax.random.split(jax.random.key(3), 3)])
    # Both jitted (eager == jit is checked above): one compile each instead of op-by-op dispatch per call.
    batched, _ = jax.jit(jax.vmap(lambda x: forward(layer, params, state, x)))(xs)
    one = jax.jit(lambda x: forward(layer, params, state, x)[0])
    looped = jnp.stack([one(x) for x in xs])
    np.testing.assert_allclose(batched, looped, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("name", CASE_PARAMS)
def test_gradients_match_finite_differences(name, key):
    with jax.enable_x64(True):
        layer, _, params, state, x = setup(name, key)
        params = jax.tree.map(lambda p: p.astype(jnp.float64), params)
        if CASES[name][2] == "float":
            x = x.astype(jnp.float64)

            # Jitted: check_grads evaluates f many times, and one compiled program beats op-by-op dispatch (~40%).
            @jax.jit
            def f(p, x):
                return forward(layer, p, state, x)[0]

            # jax's XLA attention computes softmax in float32 even for float64 inputs.
            tol = 2e-3 if name == "attention_xla" else 1e-5
            check_grads(f, (params, x), order=1, modes=("rev",), atol=tol, rtol=tol)
        else:
            check_grads(jax.jit(lambda p: forward(layer, p, state, x)[0]), (params,), order=1, modes=("rev",))


# bf16 keeps 8 significand bits, so rounding a value to bf16 moves it by at most U = 2^-8 of itself (~0.4%).
U_BF16 = 2.0**-8

# The bf16 run is compared with an fp32 run on the same bf16-rounded inputs and parameters, so that only the
# layer's arithmetic differs. A layer that computes in float32 (products, sums and statistics accumulate in f32) or
# in one bf16 op rounds once, at its output: each element within U of the fp32 result (rtol=U). The layers below
# also round intermediate values: an error U|v| in an intermediate v reaches the output times dy/dv, and |v dy/dv|
# is of the order of the output's scale (max |y|) for these layers, so each is held to (its number of roundings)
# * U * scale. Measured at key 0: every case within 1 U of its scale; the 6% allowed before was 15 U.
BF16_ROUNDINGS = {
    "silu": 2,  # x * sigmoid(x), two bf16 ops
    "gelu": 4,  # jax.nn.gelu's tanh form, evaluated op by op in bf16
    "serial": 4,  # dense, relu, dropout, dense: each output rounded
    "residual_with_batch_norm": 4,  # dense, batch norm, tanh, and the residual sum
    "attention_causal": 4,  # q/k/v, probabilities, attention output, output projection
    "attention_xla": 4,
    "transformer_block": 8,  # two layer norms, attention (4), gelu MLP, two residual sums
    "attention_gqa_rope": 6,  # attention (4) and the rotated queries and keys
    "repeat_remat": 6,  # two layers of norm, dense and the residual sum
    "swiglu": 6,  # gate and up, silu's two ops, their product, down
    "llama_block": 10,  # two RMS norms, rotary attention, the SwiGLU, two residual sums (cf. transformer_block)
    **cases_conv_norm.BF16_ROUNDINGS,
    **cases_recurrent.BF16_ROUNDINGS,
}


@pytest.mark.parametrize("name", CASE_PARAMS)
def test_bf16_run_tracks_fp32(name, key):
    layer, _, params, state, x = setup(name, key)
    cast = BF16.cast_to_compute
    y16, state16 = jax.jit(lambda p, s, x: forward(layer, cast(p), s, cast(x), policy=BF16))(params, state, x)
    if jnp.issubdtype(x.dtype, jnp.floating) or name == "embedding":
        assert y16.dtype == jnp.bfloat16
    for leaf in jax.tree.leaves(state16):  # normalisation statistics stay float32
        assert leaf.dtype == jnp.float32

    def widen(tree):
        return jax.tree.map(lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)

    y32, _ = forward(layer, widen(cast(params)), state, widen(cast(x)))
    y16, y32 = np.asarray(y16, np.float64), np.asarray(y32, np.float64)
    assert np.all(np.isfinite(y16))
    scale = np.max(np.abs(y32))
    if name in BF16_ROUNDINGS:
        np.testing.assert_allclose(y16, y32, rtol=0, atol=BF16_ROUNDINGS[name] * U_BF16 * scale)
    else:
        # One rounding: |y16 - y32| <= U |y32|; the atol covers float32 rounding (jit and eager order sums apart).
        np.testing.assert_allclose(y16, y32, rtol=U_BF16, atol=1e-5 * scale)


def test_dropout_eval_is_identity_and_train_keeps_expectation(key):
    layer = L.Dropout(0.25)
    x = jax.random.normal(key, (200, 200)) + 3.0
    assert jnp.array_equal(layer.apply({}, x, train=False), x)
    y = layer.apply({}, x, key=jax.random.key(1), train=True)
    dropped = float(jnp.mean(y == 0))
    assert abs(dropped - 0.25) < 0.01
    np.testing.assert_allclose(jnp.mean(y), jnp.mean(x), rtol=0.02)
    with pytest.raises(ValueError, match="dropout: train=True needs a PRNG key"):
        layer.apply({}, x, train=True)


def test_batch_norm_running_statistics_match_numpy(key):
    """Several train steps on different batches, checked against running averages computed here in float64.

    momentum 0.9 (not 0.5, where swapping momentum and 1 - momentum gives the same numbers); the batch variance is
    the biased one (divided by the count, as in flax.linen.BatchNorm), over every axis but the channels."""
    momentum, eps = 0.9, 1e-5
    layer = L.BatchNorm(momentum=momentum, eps=eps)
    rng = np.random.default_rng(20240)
    shape = (4, 3, 5, 3)  # (N, H, W, C): statistics over 60 values per channel
    _, params, state = L.init_model(layer, key, shape)
    params = {
        "scale": jnp.asarray(rng.uniform(0.5, 2.0, 3), jnp.float32),
        "bias": jnp.asarray(rng.normal(size=3), jnp.float32),
    }
    scale, bias = np.asarray(params["scale"], np.float64), np.asarray(params["bias"], np.float64)
    running_mean, running_var = np.zeros(3), np.ones(3)
    for step in range(4):
        x = (rng.normal(size=shape) * rng.uniform(0.5, 3.0, 3) + rng.uniform(-4.0, 4.0, 3)).astype(np.float32)
        y, state = layer.apply(params, jnp.asarray(x), state=state, train=True)
        x64 = x.astype(np.float64)
        mean, var = x64.mean(axis=(0, 1, 2)), x64.var(axis=(0, 1, 2))  # biased: ddof=0
        np.testing.assert_allclose(y, (x64 - mean) / np.sqrt(var + eps) * scale + bias, rtol=1e-5, atol=1e-5)
        running_mean = momentum * running_mean + (1 - momentum) * mean
        running_var = momentum * running_var + (1 - momentum) * var
        np.testing.assert_allclose(state["mean"], running_mean, rtol=1e-5, atol=1e-6, err_msg=f"step {step}")
        np.testing.assert_allclose(state["var"], running_var, rtol=1e-5, atol=1e-6, err_msg=f"step {step}")

    x = rng.normal(size=shape).astype(np.float32) * 2.0 + 1.0
    y_eval, same_state = layer.apply(params, jnp.asarray(x), state=state, train=False)
    assert same_state is state
    expected = (x.astype(np.float64) - running_mean) / np.sqrt(running_var + eps) * scale + bias
    np.testing.assert_allclose(y_eval, expected, rtol=1e-5, atol=1e-5)


def test_parallel_applies_each_layer_to_its_input(key):
    layer = L.parallel(L.Dense(3), L.serial(L.Conv(2, 3), L.Flatten()))
    shapes = ((4, 5), (4, 6, 6, 1))
    out_shapes, params = layer.init(key, shapes)
    xs = (jax.random.normal(key, shapes[0]), jax.random.normal(jax.random.key(1), shapes[1]))
    ys = layer.apply(params, xs)
    assert tuple(y.shape for y in ys) == tuple(tuple(s) for s in out_shapes) == ((4, 3), (4, 72))
    np.testing.assert_allclose(ys[0], L.Dense(3).apply(params["0_dense"], xs[0]))


def test_params_have_stable_readable_names(key):
    model = L.serial(L.Dense(4), L.Relu, L.residual(L.LayerNorm(), L.Dense(4)))
    _, params = model.init(key, (2, 3))
    paths = sorted(jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0])
    assert paths == [
        "['0_dense']['b']",
        "['0_dense']['w']",
        "['2_residual']['0_layer_norm']['bias']",
        "['2_residual']['0_layer_norm']['scale']",
        "['2_residual']['1_dense']['b']",
        "['2_residual']['1_dense']['w']",
    ]


def test_attention_padding_mask_hides_padded_keys(key):
    layer = L.MultiHeadAttention(2)
    _, params = layer.init(key, (2, 6, 8))
    x = jax.random.normal(key, (2, 6, 8))
    mask = jnp.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], bool)
    y = layer.apply(params, x, mask=mask)
    changed = x.at[0, 4:].set(jax.random.normal(jax.random.key(5), (2, 8)))
    y_changed = layer.apply(params, changed, mask=mask)
    np.testing.assert_allclose(y_changed[0, :4], y[0, :4], rtol=1e-5, atol=1e-5)  # padded keys ignored
    np.testing.assert_allclose(y_changed[1], y[1])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.slow
def test_f32acc_attention_matches_jax_dot_product_attention(dtype, key):
    fast, simple = (L.MultiHeadAttention(4, causal=True, implementation=impl) for impl in ("f32acc", "xla"))
    _, params = fast.init(key, (3, 7, 16))
    x = jax.random.normal(jax.random.key(2), (3, 7, 16)).astype(dtype)
    mask = jax.random.bernoulli(jax.random.key(4), 0.8, (3, 7)).at[:, 0].set(True)
    params = jax.tree.map(lambda p: p.astype(dtype), params)
    y_fast = np.asarray(fast.apply(params, x, mask=mask), np.float64)
    y_simple = np.asarray(simple.apply(params, x, mask=mask), np.float64)
    if dtype == jnp.float32:
        np.testing.assert_allclose(y_fast, y_simple, rtol=1e-5, atol=1e-5)
    else:
        # Both paths share the bf16 q, k, v and accumulate in f32; they may differ only in where the probabilities
        # and the attention output are rounded to bf16 (U = 2^-8 relative each), and then in the rounding of the
        # projected output: at most three roundings of the output's scale.
        np.testing.assert_allclose(y_fast, y_simple, rtol=0, atol=3 * U_BF16 * np.max(np.abs(y_simple)))


def test_causal_attention_ignores_the_future(key):
    layer = L.MultiHeadAttention(2, causal=True)
    _, params = layer.init(key, (1, 6, 8))
    x = jax.random.normal(key, (1, 6, 8))
    future_changed = x.at[0, 3:].set(jax.random.normal(jax.random.key(9), (3, 8)))
    np.testing.assert_allclose(
        layer.apply(params, future_changed)[0, :3], layer.apply(params, x)[0, :3], rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize(
    "layer, shape, message",
    [
        (L.Dense(3), (), r"dense: expected input of rank >= 1 .* got shape \(\)"),
        (L.Conv(3, 3), (2, 8, 8), r"conv: expected input of rank 4 \(NHWC\), got shape \(2, 8, 8\)"),
        (L.Conv(3, (3,)), (2, 8, 8, 1), r"conv: expected input of rank 3 \(NWC\), got shape \(2, 8, 8, 1\)"),
        (
            L.Conv(3, 5, padding="VALID"),
            (2, 3, 3, 1),
            r"conv: expected input large enough for kernel .* \(2, 3, 3, 1\)",
        ),
        (
            L.Conv(4, 3, feature_group_count=2),
            (2, 8, 8, 3),
            r"conv: .*divisible by feature_group_count 2.*\(2, 8, 8, 3\)",
        ),
        (L.MaxPool(2), (2, 8), r"max_pool: expected input of rank 4 .* got shape \(2, 8\)"),
        (L.MultiHeadAttention(3), (2, 5, 8), r"attention: .*divisible by num_heads 3.*\(2, 5, 8\)"),
        (L.PositionEmbedding(4), (2, 5, 8), r"pos_embed: expected input of rank 3 \(batch, time <= 4.*\(2, 5, 8\)"),
        (L.serial(L.Flatten(), L.Conv(2, 3)), (2, 4, 4, 1), r"conv: expected input of rank 4 .* got shape \(2, 16\)"),
    ],
)
def test_wrong_input_shape_at_init_names_layer_and_shape(layer, shape, message, key):
    with pytest.raises(ValueError, match=message):
        layer.init(key, shape)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: L.Conv(3, 3, padding="FULL"), r"Conv: unknown padding mode 'FULL'"),
        (lambda: L.MaxPool(2, padding="REFLECT"), r"MaxPool: unknown padding mode 'REFLECT'"),
        (lambda: L.Dense(0), r"Dense: features must be a positive integer, got 0"),
        (lambda: L.Conv(-2, 3), r"Conv: features must be a positive integer, got -2"),
        (lambda: L.Conv(4, (3, 0)), r"Conv: kernel_size\[1\] must be a positive integer, got 0"),
        (lambda: L.Embedding(10, 0), r"Embedding: features must be a positive integer"),
        (lambda: L.MultiHeadAttention(0), r"MultiHeadAttention: num_heads must be a positive integer"),
        (lambda: L.Dropout(1.0), r"Dropout: drop_prob must be in \[0, 1\), got 1.0"),
        (lambda: L.Dropout(-0.1), r"Dropout: drop_prob must be in \[0, 1\), got -0.1"),
        (lambda: L.TransformerBlock(2, drop_prob=1.5), r"Dropout: drop_prob must be in \[0, 1\)"),
        (lambda: L.BatchNorm(momentum=1.0), r"BatchNorm: momentum must be in \[0, 1\)"),
        (lambda: L.LayerNorm(eps=0), r"LayerNorm: eps must be positive"),
    ],
)
def test_bad_construction_is_refused(build, message):
    with pytest.raises(ValueError, match=message):
        build()
