"""Numerical parity with Flax Linen given the same weights: an independent implementation of each layer."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxnn import layers as L

TOL = {"rtol": 2e-5, "atol": 2e-5}


def random_like(tree, key):
    """Fresh random values (not the initialisers' zeros and ones) so every parameter matters."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape, x.dtype) * 0.5 for k, x in zip(keys, leaves)])


def test_dense(key):
    x = jax.random.normal(key, (4, 3, 6))
    params = random_like(L.Dense(5).init(key, x.shape)[1], jax.random.key(1))
    flax_y = nn.Dense(5).apply({"params": {"kernel": params["w"], "bias": params["b"]}}, x)
    np.testing.assert_allclose(L.Dense(5).apply(params, x), flax_y, **TOL)


@pytest.mark.parametrize(
    "kwargs, shape",
    [
        ({"features": 4, "kernel_size": (3, 3), "strides": (2, 2), "padding": "SAME"}, (2, 9, 9, 3)),
        (
            {
                "features": 4,
                "kernel_size": (3, 3),
                "kernel_dilation": (2, 2),
                "padding": "VALID",
                "feature_group_count": 2,
            },
            (2, 9, 9, 4),
        ),
        ({"features": 5, "kernel_size": (3,), "padding": "CAUSAL"}, (2, 11, 3)),
        ({"features": 3, "kernel_size": (2, 3), "padding": ((1, 0), (2, 1))}, (2, 6, 7, 2)),
    ],
)
def test_conv(kwargs, shape, key):
    ours = L.Conv(
        kwargs["features"],
        kwargs["kernel_size"],
        strides=kwargs.get("strides", 1),
        padding=kwargs["padding"],
        dilation=kwargs.get("kernel_dilation", 1),
        feature_group_count=kwargs.get("feature_group_count", 1),
    )
    x = jax.random.normal(key, shape)
    params = random_like(ours.init(key, shape)[1], jax.random.key(1))
    flax_y = nn.Conv(**kwargs).apply({"params": {"kernel": params["w"], "bias": params["b"]}}, x)
    np.testing.assert_allclose(ours.apply(params, x), flax_y, **TOL)


def test_layer_norm_and_rms_norm(key):
    x = jax.random.normal(key, (3, 5, 8)) * 3 + 1
    params = random_like(L.LayerNorm().init(key, x.shape)[1], jax.random.key(1))
    flax_y = nn.LayerNorm().apply({"params": params}, x)
    np.testing.assert_allclose(L.LayerNorm().apply(params, x), flax_y, **TOL)
    rms = {"scale": params["scale"]}
    np.testing.assert_allclose(L.RMSNorm().apply(rms, x), nn.RMSNorm().apply({"params": rms}, x), **TOL)


@pytest.mark.parametrize("train", [True, False])
def test_batch_norm(train, key):
    x = jax.random.normal(key, (8, 4, 4, 3)) * 2 + 0.5
    ours = L.BatchNorm(momentum=0.9)
    _, params, state = L.init_model(ours, key, x.shape)
    params = random_like(params, jax.random.key(1))
    state = {
        "mean": jax.random.normal(jax.random.key(2), (3,)),
        "var": jax.random.uniform(jax.random.key(3), (3,)) + 0.5,
    }
    y, new_state = ours.apply(params, x, state=state, train=train)
    flax_y, updates = nn.BatchNorm(use_running_average=not train, momentum=0.9).apply(
        {"params": params, "batch_stats": state}, x, mutable=["batch_stats"]
    )
    np.testing.assert_allclose(y, flax_y, **TOL)
    expected_state = updates["batch_stats"] if train else state
    for name in ("mean", "var"):
        np.testing.assert_allclose(new_state[name], expected_state[name], **TOL)


@pytest.mark.parametrize("implementation", ["xla", pytest.param("f32acc", marks=pytest.mark.slow)])
def test_multi_head_attention(implementation, key):
    B, T, D, N = 2, 6, 8, 2
    H = D // N
    ours = L.MultiHeadAttention(N, causal=True, implementation=implementation)
    x = jax.random.normal(key, (B, T, D))
    params = random_like(ours.init(key, x.shape)[1], jax.random.key(1))
    w_q, w_k, w_v = jnp.split(params["qkv"]["w"], 3, axis=-1)
    b_q, b_k, b_v = jnp.split(params["qkv"]["b"], 3)
    flax_params = {
        "query": {"kernel": w_q.reshape(D, N, H), "bias": b_q.reshape(N, H)},
        "key": {"kernel": w_k.reshape(D, N, H), "bias": b_k.reshape(N, H)},
        "value": {"kernel": w_v.reshape(D, N, H), "bias": b_v.reshape(N, H)},
        "out": {"kernel": params["out"]["w"].reshape(N, H, D), "bias": params["out"]["b"]},
    }
    padding = jnp.array([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]], bool)
    mask = nn.make_causal_mask(jnp.ones((B, T))).astype(bool) & padding[:, None, None, :]
    flax_y = nn.MultiHeadDotProductAttention(N).apply({"params": flax_params}, x, x, mask=mask)
    np.testing.assert_allclose(ours.apply(params, x, mask=padding), flax_y, rtol=1e-4, atol=1e-4)
