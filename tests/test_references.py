"""Layers against references written here in float64 numpy (and Flax where its semantics are the same): pooling
windows and borders, GELU's formula, embedding lookups and their scatter-add gradients, position embeddings, and
normalisation statistics under the bf16 policy. Inputs use odd sizes and explicit seeds."""

import itertools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxnn import layers as L
from jaxnn.precision import BF16

U_BF16 = 2.0**-8  # bf16 keeps 8 significand bits: rounding to bf16 moves a value by at most 2^-8 of itself


def value_and_vjp(fn, g, *args):
    """fn(*args) and the gradients of sum(fn(*args) * g) with respect to each argument, compiled as one call
    (eager dispatch compiles every small op on its own: several times slower)."""

    def both(*args):
        y, vjp = jax.vjp(fn, *args)
        return y, vjp(jnp.asarray(g, y.dtype))

    return jax.jit(both)(*args)


def window_starts(size, window, stride, padding):
    """Where each window starts along one axis (negative inside the leading padding), as XLA places them: SAME
    pads (out - 1) * stride + window - size in all, the smaller half before; a (low, high) pair pads as given."""
    if not isinstance(padding, str):
        low, high = padding
        return [i * stride - low for i in range((size + low + high - window) // stride + 1)]
    if padding == "VALID":
        return [i * stride for i in range((size - window) // stride + 1)]
    out = -(-size // stride)
    before = max((out - 1) * stride + window - size, 0) // 2
    return [i * stride - before for i in range(out)]


def per_axis(padding, spatial):
    """The padding of each spatial axis: a mode applies to every axis, pairs are one per axis."""
    return [padding] * len(spatial) if isinstance(padding, str) else list(padding)


def pool_windows(spatial, window, strides, padding):
    """(output index, slices of the real input elements in that window) for every output position."""
    starts = [window_starts(n, w, s, p) for n, w, s, p in zip(spatial, window, strides, per_axis(padding, spatial))]
    for index in itertools.product(*(range(len(s)) for s in starts)):
        yield (
            index,
            tuple(slice(max(st[i], 0), min(st[i] + w, n)) for st, i, w, n in zip(starts, index, window, spatial)),
        )


def pool_reference(x, window, strides, padding, reduce):
    """`reduce` over the real (unpadded) elements of each window of x (N, *spatial, C), in float64."""
    spatial = x.shape[1:-1]
    pads = per_axis(padding, spatial)
    out_sizes = [len(window_starts(n, w, s, p)) for n, w, s, p in zip(spatial, window, strides, pads)]
    out = np.empty((x.shape[0], *out_sizes, x.shape[-1]))
    for index, box in pool_windows(spatial, window, strides, padding):
        block = x[(slice(None), *box, slice(None))].reshape(x.shape[0], -1, x.shape[-1])
        out[(slice(None), *index, slice(None))] = reduce(block, axis=1)
    return out


def avg_pool_grad_reference(shape, window, strides, padding, g):
    """The input gradient of the mean over real elements: each window hands g / count to each of its elements."""
    dx = np.zeros(shape)
    for index, box in pool_windows(shape[1:-1], window, strides, padding):
        count = np.prod([s.stop - s.start for s in box])
        dx[(slice(None), *box, slice(None))] += (
            g[(slice(None), *index, slice(None))][(slice(None),) + (None,) * len(box)] / count
        )
    return dx


def max_pool_grad_reference(x, window, strides, padding, g):
    """The input gradient of the max: each window hands its cotangent to its (unique) largest element."""
    dx = np.zeros(x.shape)
    n, c = x.shape[0], x.shape[-1]
    for index, box in pool_windows(x.shape[1:-1], window, strides, padding):
        block = x[(slice(None), *box, slice(None))]
        flat = block.reshape(n, -1, c).argmax(axis=1)
        local = np.unravel_index(flat, block.shape[1:-1])  # per (n, c): position inside the block
        for b in range(n):
            for ch in range(c):
                at = tuple(s.start + loc[b, ch] for s, loc in zip(box, local))
                dx[(b, *at, ch)] += g[(b, *index, ch)]
    return dx


# window, strides, padding, input shape. Odd sizes and windows that do not divide them, so that SAME pads unevenly
# (3 in all for window 4 / stride 3 on 7: 1 before, 2 after) and VALID drops a remainder.
POOL_CASES = [
    ((3,), (2,), "SAME", (2, 11, 3)),
    ((4,), (3,), "SAME", (2, 7, 2)),
    ((3,), (2,), "VALID", (2, 10, 3)),
    ((2,), (2,), "SAME", (1, 9, 2)),
    ((3, 3), (2, 2), "SAME", (2, 7, 5, 3)),
    ((3, 2), (2, 1), "SAME", (2, 7, 5, 2)),
    ((4, 4), (3, 3), "SAME", (1, 7, 8, 2)),
    ((3, 3), (2, 2), "VALID", (2, 9, 7, 2)),
    ((2, 3), (2, 3), "SAME", (2, 5, 7, 3)),
    ((2, 2), (2, 2), "VALID", (2, 7, 9, 1)),
    # Explicit (low, high) pairs: torch's MaxPool2d(3, 2, padding=1) (the ImageNet ResNet stem), asymmetric ones,
    # and tiling windows whose padding leaves rows no window covers.
    ((3, 3), (2, 2), ((1, 1), (1, 1)), (2, 8, 7, 3)),
    ((3, 2), (1, 2), ((0, 2), (1, 0)), (1, 5, 6, 2)),
    ((2, 2), (2, 2), ((1, 0), (1, 1)), (2, 6, 7, 2)),
]


def pool_id(case):
    window, strides, padding, shape = case
    pads = padding if isinstance(padding, str) else "p" + "x".join(f"{lo}{hi}" for lo, hi in padding)
    return f"w{'x'.join(map(str, window))}-s{'x'.join(map(str, strides))}-{pads}-{'x'.join(map(str, shape[1:-1]))}"


@pytest.mark.parametrize("case", POOL_CASES, ids=pool_id)
def test_avg_pool_matches_numpy_and_flax(case):
    window, strides, padding, shape = case
    rng = np.random.default_rng(11)
    x = rng.normal(size=shape).astype(np.float32)
    layer = L.AvgPool(window, strides, padding)
    out_shape, _ = layer.init(jax.random.key(0), shape)
    expected = pool_reference(x.astype(np.float64), window, strides, padding, np.mean)
    g = rng.normal(size=expected.shape)
    y, (dx,) = value_and_vjp(lambda x: layer.apply({}, x), g, jnp.asarray(x))
    assert y.shape == tuple(out_shape) == expected.shape
    # SAME border windows average only the real elements (count_include_pad=False in Flax's terms).
    np.testing.assert_allclose(y, expected, rtol=1e-6, atol=1e-6)
    flax_y = jax.jit(lambda x: nn.avg_pool(x, window, strides, padding, count_include_pad=False))(jnp.asarray(x))
    np.testing.assert_allclose(y, flax_y, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dx, avg_pool_grad_reference(shape, window, strides, padding, g), rtol=1e-5, atol=1e-6)


# The reshape lowering takes non-overlapping windows only (strides == window).
MAX_POOL_CASES = [
    pytest.param(case, lowering, id=f"{lowering}-{pool_id(case)}")
    for case in POOL_CASES
    for lowering in ("reduce_window", "reshape", "auto")
    if lowering != "reshape" or case[0] == case[1]
]


@pytest.mark.parametrize("case, lowering", MAX_POOL_CASES)
def test_max_pool_matches_numpy(case, lowering):
    window, strides, padding, shape = case
    rng = np.random.default_rng(12)
    # Negative values everywhere in one channel: a border window padded with zeros instead of -inf would show.
    x = rng.normal(size=shape).astype(np.float32)
    x[..., 0] = -np.abs(x[..., 0]) - 1.0
    layer = L.MaxPool(window, strides, padding, lowering=lowering)
    out_shape, _ = layer.init(jax.random.key(0), shape)
    expected = pool_reference(x.astype(np.float64), window, strides, padding, np.max)
    g = rng.normal(size=expected.shape)
    y, (dx,) = value_and_vjp(lambda x: layer.apply({}, x), g, jnp.asarray(x))
    assert y.shape == tuple(out_shape) == expected.shape
    np.testing.assert_array_equal(y, expected.astype(np.float32))  # a max is exact
    # Continuous random inputs have no ties, so the gradient is unique: every lowering must give this one.
    np.testing.assert_allclose(dx, max_pool_grad_reference(x, window, strides, padding, g), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "padding, message",
    [
        (((1, 1),), r"padding needs 2 \(low, high\) pairs"),
        (((1, 1), (3, 0)), r"padding \(3, 0\) of axis 1 must be >= 0 and < the window 3"),
        (((-1, 0), (0, 0)), r"padding \(-1, 0\) of axis 0 must be >= 0"),
        (1, r"padding must be 'SAME', 'VALID' or \(low, high\) pairs of ints, got 1"),
        (((1.5, 1), (1, 1)), r"padding must be 'SAME', 'VALID' or \(low, high\) pairs of ints"),
        (((1, 1, 1), (1, 1)), r"padding must be 'SAME', 'VALID' or \(low, high\) pairs of ints"),
        ("REFLECT", r"unknown padding mode 'REFLECT'"),
    ],
)
@pytest.mark.parametrize("pool", [L.MaxPool, L.AvgPool])
def test_pool_padding_pairs_are_checked(pool, padding, message):
    with pytest.raises(ValueError, match=rf"^{pool.__name__}: {message}"):
        pool(3, 2, padding)


def test_pool_padding_pairs_need_room_for_a_window():
    layer = L.MaxPool(4, 1, ((1, 1), (0, 0)))
    assert layer.init(None, (1, 2, 4, 1))[0] == (1, 1, 1, 1)
    with pytest.raises(L.LayerError, match=r"with spatial sizes \+ padding \[\(1, 1\), \(0, 0\)\] >= window"):
        layer.init(None, (1, 1, 4, 1))


def gelu_tanh_reference(x):
    """GELU's tanh approximation, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), and its derivative."""
    c = np.sqrt(2.0 / np.pi)
    t = np.tanh(c * (x + 0.044715 * x**3))
    return 0.5 * x * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t**2) * c * (1.0 + 3 * 0.044715 * x**2)


def test_gelu_is_the_tanh_approximation():
    # jaxnn's Gelu is the tanh form (GPT-2's, and Flax's default), which differs from the exact erf form by up to
    # ~5e-4: in float64 the two are told apart with a 1e-12 tolerance.
    x = np.concatenate([np.linspace(-6.0, 6.0, 121), np.random.default_rng(13).normal(scale=2.0, size=64)])
    y_ref, dy_ref = gelu_tanh_reference(x)
    with jax.enable_x64(True):
        xj = jnp.asarray(x, jnp.float64)
        y, (dy,) = value_and_vjp(lambda x: L.Gelu.apply({}, x), np.ones_like(x), xj)
        assert y.dtype == jnp.float64
        np.testing.assert_allclose(y, y_ref, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(dy, dy_ref, rtol=1e-12, atol=1e-12)
    # float32 inputs, float32 answers within float32 rounding.
    y32 = jax.jit(lambda x: L.Gelu.apply({}, x))(jnp.asarray(x, jnp.float32))
    assert y32.dtype == jnp.float32
    np.testing.assert_allclose(y32, y_ref, rtol=1e-6, atol=1e-6)


def test_embedding_looks_up_rows_and_scatter_adds_gradients():
    num, features = 5, 4
    layer = L.Embedding(num, features)
    rng = np.random.default_rng(14)
    ids = np.array([[0, 3, 3, 1, 4, 3, 0], [2, 2, 4, 0, 3, 1, 1], [4, 4, 4, 4, 2, 0, 3]], np.int32)  # repeats
    out_shape, params = layer.init(jax.random.key(0), ids.shape)
    assert tuple(out_shape) == (*ids.shape, features)
    table = rng.normal(size=(num, features)).astype(np.float32)
    g = rng.normal(size=(*ids.shape, features)).astype(np.float32)
    y, (grads,) = value_and_vjp(lambda p: layer.apply(p, jnp.asarray(ids)), g, {"table": jnp.asarray(table)})
    np.testing.assert_array_equal(y, table[ids])

    # d/dtable of sum(y * g): every occurrence of an id adds its cotangent row to that id's row.
    expected = np.zeros((num, features))
    np.add.at(expected, ids, g.astype(np.float64))
    np.testing.assert_allclose(grads["table"], expected, rtol=1e-6, atol=1e-6)


def test_position_embedding_adds_the_first_rows_and_their_gradients():
    max_len, (B, T, D) = 9, (3, 5, 4)
    layer = L.PositionEmbedding(max_len)
    rng = np.random.default_rng(15)
    out_shape, params = layer.init(jax.random.key(0), (B, T, D))
    assert tuple(out_shape) == (B, T, D) and params["table"].shape == (max_len, D)
    table = rng.normal(size=(max_len, D)).astype(np.float32)
    x = rng.normal(size=(B, T, D)).astype(np.float32)
    g = rng.normal(size=(B, T, D)).astype(np.float32)
    y, (d_params, dx) = value_and_vjp(layer.apply, g, {"table": jnp.asarray(table)}, jnp.asarray(x))
    np.testing.assert_allclose(y, x + table[None, :T], rtol=1e-6, atol=1e-6)  # position t gets row t

    # The table's gradient is the cotangent summed over the batch in rows 0..T-1, zero in the rows beyond T;
    # the input's gradient is the cotangent itself.
    expected = np.zeros((max_len, D))
    expected[:T] = g.astype(np.float64).sum(axis=0)
    np.testing.assert_allclose(d_params["table"], expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dx, g, rtol=0, atol=0)


def layer_norm_reference(x, scale, bias, eps):
    mean = x.mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(x.var(axis=-1, keepdims=True) + eps) * scale + bias


def rms_norm_reference(x, scale, eps):
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * scale


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_norm_statistics_are_float32_under_bf16(kind):
    """bf16 inputs with a large common offset (1000 + noise of scale 8, where bf16's spacing is 4): statistics
    computed in bf16 would round the mean to a multiple of 4 and lose most of the variance. Computed in float32,
    as they must be, the only bf16 error left is the rounding of the output (<= U = 2^-8 of each value)."""
    rng = np.random.default_rng(16)
    layer = L.LayerNorm() if kind == "layer_norm" else L.RMSNorm()
    shape = (4, 6, 96)
    _, params = layer.init(jax.random.key(0), shape)
    params = {
        k: jnp.asarray(rng.uniform(0.5, 1.5, v.shape) if k == "scale" else rng.normal(size=v.shape))
        for k, v in params.items()
    }
    x = 1000.0 + 8.0 * rng.normal(size=shape)
    x16, p16 = BF16.cast_to_compute(jnp.asarray(x, jnp.float32)), BF16.cast_to_compute(params)
    y = layer.apply(p16, x16, policy=BF16)
    assert y.dtype == jnp.bfloat16

    # The reference starts from the same bf16 values, so only the layer's arithmetic is tested.
    x64 = np.asarray(x16, np.float64)
    scale = np.asarray(p16["scale"], np.float64)
    if kind == "layer_norm":
        expected = layer_norm_reference(x64, scale, np.asarray(p16["bias"], np.float64), 1e-6)
    else:
        expected = rms_norm_reference(x64, scale, 1e-6)
    # rtol: the one rounding of the output to bf16 (<= U of each value). atol: float32 arithmetic on values near
    # 1000 (~1000 * 2^-24 per element, ~1e-5 of the output after dividing by a deviation of ~8; measured 3e-6).
    # Statistics computed in bf16 miss by up to 0.46 here (LayerNorm) and 2 U on 16% of the elements (RMSNorm).
    np.testing.assert_allclose(np.asarray(y, np.float64), expected, rtol=U_BF16, atol=1e-4)


def test_gelu_exact_is_the_erf_form():
    """GeluExact is x Phi(x) with Phi the standard normal CDF (PyTorch's default), derivative Phi(x) + x phi(x)."""
    x = np.concatenate([np.linspace(-6.0, 6.0, 121), np.random.default_rng(14).normal(scale=2.0, size=64)])
    cdf = np.array([0.5 * (1.0 + math.erf(v / math.sqrt(2.0))) for v in x])
    pdf = np.exp(-0.5 * x**2) / math.sqrt(2.0 * math.pi)
    with jax.enable_x64(True):
        y, (dy,) = value_and_vjp(lambda x: L.GeluExact.apply({}, x), np.ones_like(x), jnp.asarray(x, jnp.float64))
        np.testing.assert_allclose(y, x * cdf, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(dy, cdf + x * pdf, rtol=1e-12, atol=1e-12)
    assert np.max(np.abs(gelu_tanh_reference(x)[0] - x * cdf)) > 1e-4  # the two forms are told apart
