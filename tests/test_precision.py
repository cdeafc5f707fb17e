"""Mixed-precision policies: the lowered HLO has the tensor-core/AMX form, and dynamic loss scaling behaves."""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxnn import layers as L
from jaxnn import precision, train
from jaxnn.models import CNN, GPT, CNNConfig, GPTConfig

PRODUCT = re.compile(
    r"stablehlo\.(dot_general|convolution).*: \(tensor<[^>]*x(\w+)>, tensor<[^>]*x(\w+)>\) "
    r"-> tensor<[^>]*x(\w+)>"
)


def product_types(hlo_text: str) -> collections.Counter:
    """(op, lhs dtype, rhs dtype, result dtype) of every matmul and convolution in the StableHLO text."""
    return collections.Counter(m.groups() for m in map(PRODUCT.search, hlo_text.splitlines()) if m)


@pytest.mark.parametrize(
    "layer, shape, op",
    [
        (L.Dense(16), (4, 8), "dot_general"),
        (L.Conv(8, 3, lowering="xla"), (2, 8, 8, 3), "convolution"),
        (L.MultiHeadAttention(2, causal=True), (2, 6, 8), "dot_general"),
    ],
)
def test_bf16_products_have_bf16_operands_and_f32_results(layer, shape, op, key):
    _, params = layer.init(key, shape)
    x = jax.random.normal(key, shape)
    cast = precision.BF16.cast_to_compute
    hlo = jax.jit(lambda p, x: layer.apply(cast(p), cast(x), policy=precision.BF16)).lower(params, x).as_text()
    types = product_types(hlo)
    assert types and set(types) == {(op, "bf16", "bf16", "f32")}, types


@pytest.mark.parametrize("name", ["gpt", "cnn"])
def test_bf16_train_step_backward_products_are_bf16_too(name, key):
    model, shape, loss_fn, x = {
        "gpt": (GPT(GPTConfig().small()), (2, 32), train.language_model_loss, jnp.ones((2, 32), jnp.int32)),
        "cnn": (CNN(CNNConfig().small()), (2, 8, 8, 1), train.classification_loss, jnp.ones((2, 8, 8, 1))),
    }[name]
    y = jnp.ones((2, 32) if name == "gpt" else (2,), jnp.int32)
    tx = optax.adam(1e-3)
    state = train.create_train_state(model, tx, key, shape, "bf16")
    step = train.make_train_step(model, loss_fn, tx, "bf16", donate=False)
    types = product_types(step.lower(state, {"x": x, "y": y}).as_text())
    # Forward, input-gradient and weight-gradient products, all in the fast mixed form.
    assert sum(types.values()) >= 8 and {t[1:] for t in types} == {("bf16", "bf16", "f32")}, types
    # And XLA runs them: a weight gradient in a non-canonical layout once failed here at run time
    # ("Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32").
    _, metrics = step(state, {"x": x, "y": y})
    assert bool(jnp.isfinite(metrics["loss"])) and bool(jnp.isfinite(metrics["grad_norm"]))


def test_fp32_matmul_precision_is_explicit(key):
    layer = L.Dense(4)
    _, params = layer.init(key, (2, 3))
    x = jax.random.normal(key, (2, 3))
    exact = jax.jit(lambda p, x: layer.apply(p, x, policy=precision.FP32)).lower(params, x).as_text()
    tf32 = jax.jit(lambda p, x: layer.apply(p, x, policy=precision.TF32)).lower(params, x).as_text()
    assert "precision = [HIGHEST, HIGHEST]" in exact
    assert "precision = [HIGH, HIGH]" in tf32


def test_half_einsum_gradients_match_float32(key):
    a = jax.random.normal(key, (5, 7))
    b = jax.random.normal(jax.random.key(1), (7, 3))

    def loss(a, b):
        return jnp.sum(jnp.sin(precision.einsum("mk,kn->mn", a, b)))

    g32 = jax.grad(loss, argnums=(0, 1))(a, b)
    g16 = jax.grad(loss, argnums=(0, 1))(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16))
    for exact, half in zip(g32, g16):
        assert half.dtype == jnp.bfloat16
        np.testing.assert_allclose(half.astype(jnp.float32), exact, rtol=0.05, atol=0.05)


def test_unknown_policy_and_precision_are_refused():
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        precision.get_policy("fp8")
    with pytest.raises(ValueError, match="unknown matmul_precision 'fast'"):
        precision.Policy(matmul_precision="fast")


def test_loss_scale_halves_on_overflow_and_doubles_after_period():
    scale = precision.LossScale.create(initial_scale=8.0, period=3)
    assert float(scale.scale) == 8.0
    scale = scale.adjust(jnp.array(False))
    assert float(scale.scale) == 4.0 and int(scale.good_steps) == 0
    for _ in range(2):
        scale = scale.adjust(jnp.array(True))
    assert float(scale.scale) == 4.0 and int(scale.good_steps) == 2
    scale = scale.adjust(jnp.array(True))
    assert float(scale.scale) == 8.0 and int(scale.good_steps) == 0
    defaults = precision.LossScale.create()
    assert float(defaults.scale) == 2.0**15 and int(defaults.period) == 2000


def test_fp16_step_skips_overflow_and_keeps_params(key):
    model = L.serial(L.Dense(4), L.Relu, L.Dense(3))
    tx = optax.sgd(0.1)
    state = train.create_train_state(model, tx, key, (8, 5), "fp16")
    step = train.make_train_step(model, train.classification_loss, tx, "fp16", donate=False)
    x = jax.random.normal(key, (8, 5))
    y = jnp.arange(8) % 3
    overflow = state._replace(loss_scale=state.loss_scale._replace(scale=jnp.float32(6e4)))
    # fp16's largest value is 65504: a 6e4 scale makes the scaled gradients overflow to inf.
    skipped, metrics = step(overflow, {"x": x * 1e3, "y": y})
    assert not bool(metrics["grads_finite"])
    assert float(skipped.loss_scale.scale) == 3e4
    for old, new in zip(jax.tree.leaves(overflow.params), jax.tree.leaves(skipped.params)):
        np.testing.assert_array_equal(old, new)
    taken, metrics = step(state, {"x": x, "y": y})
    assert bool(metrics["grads_finite"])
    assert any(not np.array_equal(o, n) for o, n in zip(jax.tree.leaves(state.params), jax.tree.leaves(taken.params)))
