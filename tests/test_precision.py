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
@pytest.mark.slow
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


@pytest.mark.parametrize(
    "spec, shape_a, shape_b", [("mk,kn->mn", (64, 16), (16, 32)), ("BNTS,BSNH->BTNH", (2, 2, 8, 8), (2, 8, 2, 4))]
)
def test_compiled_bf16_backward_products_are_not_upcast(spec, shape_a, shape_b, key):
    # XLA's CPU backend upcasts a bf16 dot to f32 when an operand arrives transposed (as a column-major layout, or
    # by swapping the operands to absorb a transposed result): ~1.6x on the bf16 GPT step of an AMX CPU
    # (benchmarks/ab_bf16_layout.py).
    a = jax.random.normal(key, shape_a).astype(jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), shape_b).astype(jnp.bfloat16)
    grads = jax.jit(jax.grad(lambda a, b: precision.einsum(spec, a, b).sum(), argnums=(0, 1)))
    hlo = grads.lower(a, b).compile().as_text()
    dots = [line for line in hlo.splitlines() if " dot(" in line]
    converted = [line for line in hlo.splitlines() if "convert" in line and "dot_general" in line and "f32[" in line]
    assert len(dots) == 2 and not converted, converted


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
    with pytest.raises(ValueError, match="unknown precision 'fp4'"):
        precision.get_policy("fp4")
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


def _fp16_bn_run(key):
    """A BatchNorm model after three real Adam steps under fp16: non-zero moments, running statistics away from
    their initial values, step 3, and a loss scale of 2^10 with 3 good steps. A rollback to a fresh state (or to
    zeros, or to any initial value) would then show, where it would not from a freshly created state."""
    model = L.serial(L.Dense(8), L.BatchNorm(momentum=0.9), L.Relu, L.Dense(3))
    tx = optax.adam(1e-2)
    # One compiled program, not one per initialiser op.
    state = jax.jit(lambda key: train.create_train_state(model, tx, key, (8, 5), "fp16"))(key)
    state = state._replace(loss_scale=precision.LossScale.create(initial_scale=2.0**10, period=100))
    step = train.make_train_step(model, train.classification_loss, tx, "fp16", donate=False)
    rng = np.random.default_rng(1)
    batches = [
        {"x": rng.normal(size=(8, 5)).astype(np.float32), "y": rng.integers(0, 3, 8).astype(np.int32)} for _ in range(4)
    ]
    for batch in batches[:3]:
        state, metrics = step(state, batch)
        assert bool(metrics["grads_finite"])
    assert int(state.step) == 3 and int(state.loss_scale.good_steps) == 3 and float(state.loss_scale.scale) == 2**10
    return step, state, batches[3]


def _leaves_equal(a, b):
    return [np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)]


def test_fp16_overflow_rolls_back_params_optimizer_and_batch_norm_state(key):
    step, state, batch = _fp16_bn_run(key)
    # A 2^24 scale overflows fp16: the scaled loss is f32, but its cotangent (2^24 * (p - onehot) / batch) is
    # rounded to fp16 at the output cast and becomes inf. The forward pass is finite, so the BatchNorm statistics
    # it computes are finite and new: only the rollback keeps them out of the state.
    overflow = state._replace(loss_scale=state.loss_scale._replace(scale=jnp.float32(2.0**24)))
    skipped, metrics = step(overflow, batch)
    assert not bool(metrics["grads_finite"]) and bool(jnp.isfinite(metrics["loss"]))
    for part in ("params", "opt_state", "model_state"):
        equal = _leaves_equal(getattr(overflow, part), getattr(skipped, part))
        assert equal and all(equal), f"an overflowing step changed {part}"
    assert int(skipped.step) == 4  # the counter still advances (it keys the next step's randomness)
    assert float(skipped.loss_scale.scale) == 2.0**23 and int(skipped.loss_scale.good_steps) == 0
    assert int(skipped.loss_scale.period) == 100
    np.testing.assert_array_equal(skipped.key, overflow.key)

    # The same state with its own 2^10 scale takes the step: every part changes.
    taken, metrics = step(state, batch)
    assert bool(metrics["grads_finite"])
    assert not any(_leaves_equal(state.params, taken.params))
    assert not any(_leaves_equal(state.model_state, taken.model_state))
    changed = [not e for e in _leaves_equal(state.opt_state, taken.opt_state)]
    counts = [int(c) for _, c in optax.tree_utils.tree_get_all_with_path(taken.opt_state, "count")]
    assert any(changed) and counts and set(counts) == {4}
    assert int(taken.step) == 4 and float(taken.loss_scale.scale) == 2.0**10
    assert int(taken.loss_scale.good_steps) == 4


CONVOLUTION = re.compile(
    r"stablehlo\.convolution\(.*: \(tensor<([^>]*)x(\w+)>, tensor<([^>]*)x(\w+)>\) -> tensor<([^>]*)x(\w+)>"
)


def test_bf16_train_step_with_xla_convolutions(key):
    """What a bf16 CNN step lowers to with XLA's convolution op (`Conv(lowering="xla")`, which "auto" picks on
    accelerators): the forward convolutions are bf16 x bf16 -> f32, while the backward ones (the transposes in
    `precision.conv`) are bf16 x bf16 -> bf16: their cotangent is rounded to bf16, but the transpose does not ask
    for an f32 result. docs/precision.md says so; this test pins it either way."""
    model = L.serial(L.Conv(4, 3, lowering="xla"), L.Relu, L.Conv(8, 3, lowering="xla"), L.Flatten(), L.Dense(3))
    tx = optax.sgd(0.1)
    # Lowered from shapes only: initialising the parameters op by op would cost more than the lowering.
    state = jax.eval_shape(lambda: train.create_train_state(model, tx, key, (2, 6, 6, 1), "bf16"))
    step = train.make_train_step(model, train.classification_loss, tx, "bf16", donate=False)
    batch = {"x": jax.ShapeDtypeStruct((2, 6, 6, 1), jnp.float32), "y": jax.ShapeDtypeStruct((2,), jnp.int32)}
    lines = step.lower(state, batch).as_text().splitlines()
    convs = collections.Counter(
        (m[2], m[4], m[6], m[5]) for m in map(CONVOLUTION.search, lines) if m
    )  # (lhs dtype, rhs dtype, result dtype, result shape)
    assert convs == {
        # Forward: (2, 6, 6, 1) -> (2, 6, 6, 4) -> (2, 6, 6, 8).
        ("bf16", "bf16", "f32", "2x6x6x4"): 1,
        ("bf16", "bf16", "f32", "2x6x6x8"): 1,
        # Backward: both kernels' gradients (laid out as the kernels, 3x3xCinxCout) and the second convolution's
        # input gradient; the first convolution's input gradient (the data's) is never computed.
        ("bf16", "bf16", "bf16", "3x3x1x4"): 1,
        ("bf16", "bf16", "bf16", "3x3x4x8"): 1,
        ("bf16", "bf16", "bf16", "2x6x6x4"): 1,
    }, convs
    assert {t[1:] for t in product_types("\n".join(lines)) if t[0] == "dot_general"} == {("bf16", "bf16", "f32")}
