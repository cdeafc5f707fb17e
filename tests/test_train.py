"""The compiled training step: a golden step against numpy, scan == repeated steps, donation, eval mode,
weight-decay masks, and learning on a real data set."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from sklearn.datasets import load_digits

from jaxnn import layers as L
from jaxnn import train
from jaxnn.models import CNN, CNNConfig


def test_golden_sgd_step_matches_numpy(key):
    """Softmax regression, one SGD step, against the gradient written out by hand in float64 numpy."""
    model = L.Dense(3)
    tx = optax.sgd(0.5)
    state = train.create_train_state(model, tx, key, (6, 4))
    state = state._replace(
        params={"w": jax.random.normal(jax.random.key(1), (4, 3)), "b": jax.random.normal(jax.random.key(2), (3,))}
    )
    x = np.asarray(jax.random.normal(jax.random.key(3), (6, 4)), np.float64)
    y = np.array([0, 2, 1, 1, 0, 2])
    w, b = (np.asarray(state.params[k], np.float64) for k in ("w", "b"))

    logits = x @ w + b
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    loss = -np.mean(np.log(p[np.arange(6), y]))
    d_logits = (p - np.eye(3)[y]) / 6

    step = train.make_train_step(model, train.classification_loss, tx)
    new_state, metrics = step(state, {"x": jnp.asarray(x, jnp.float32), "y": jnp.asarray(y)})
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(new_state.params["w"], w - 0.5 * x.T @ d_logits, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new_state.params["b"], b - 0.5 * d_logits.sum(0), rtol=1e-5, atol=1e-6)
    assert int(new_state.step) == 1


def _batches(key, k, batch=8):
    kx, ky = jax.random.split(key)
    return {"x": jax.random.normal(kx, (k, batch, 8, 8, 1)), "y": jax.random.randint(ky, (k, batch), 0, 10)}


@pytest.mark.slow
def test_scan_of_k_steps_equals_k_single_steps(key):
    model = L.serial(L.Flatten(), L.Dense(16), L.Relu, L.Dropout(0.1), L.Dense(10))
    tx = train.make_optimizer(1e-2, total_steps=10, warmup_steps=2, weight_decay=1e-4)
    batches = _batches(key, 4)
    single = train.make_train_step(model, train.classification_loss, tx, donate=False)
    state = train.create_train_state(model, tx, key, (8, 8, 8, 1))
    losses = []
    for i in range(4):
        state, metrics = single(state, jax.tree.map(lambda b, i=i: b[i], batches))
        losses.append(metrics["loss"])
    multi = train.make_multi_step(model, train.classification_loss, tx)
    scanned, metrics = multi(train.create_train_state(model, tx, key, (8, 8, 8, 1)), batches)
    np.testing.assert_allclose(metrics["loss"], jnp.stack(losses), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(scanned.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert int(scanned.step) == 4


def test_train_step_donates_the_incoming_state(key):
    model = L.Dense(3)
    tx = optax.adam(1e-3)
    state = train.create_train_state(model, tx, key, (4, 5))
    step = train.make_train_step(model, train.classification_loss, tx)
    new_state, _ = step(state, {"x": jax.random.normal(key, (4, 5)), "y": jnp.array([0, 1, 2, 0])})
    assert state.params["w"].is_deleted()
    assert not new_state.params["w"].is_deleted()


@pytest.mark.slow
def test_batch_norm_statistics_travel_through_the_state(key):
    model = L.serial(L.Conv(4, 3), L.BatchNorm(), L.Relu, L.GlobalAvgPool(), L.Dense(4))
    tx = optax.adam(1e-3)
    state = train.create_train_state(model, tx, key, (4, 8, 8, 3))
    step = train.make_train_step(model, train.classification_loss, tx, donate=False)
    batch = {"x": jax.random.normal(key, (4, 8, 8, 3)) + 2.0, "y": jnp.array([0, 1, 2, 3])}
    new_state, _ = step(state, batch)
    changed = [
        not np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(state.model_state), jax.tree.leaves(new_state.model_state))
    ]
    assert changed and all(changed)
    evaluate = train.make_eval_step(model, train.classification_loss)
    # Eval mode uses the running statistics: the same input alone or inside a larger batch gives the same logits.
    predict = train.make_predict(model)
    alone = predict(new_state.params, new_state.model_state, batch["x"][:1])
    together = predict(new_state.params, new_state.model_state, batch["x"])[:1]
    np.testing.assert_allclose(alone, together, rtol=1e-4, atol=1e-5)
    assert jnp.isfinite(evaluate(new_state, batch)["loss"])


def test_weight_decay_mask_skips_biases_norm_scales_and_embeddings(key):
    model = L.serial(L.Embedding(10, 4), L.LayerNorm(), L.Dense(3))
    _, params = model.init(key, (2, 5))
    mask = train.weight_decay_mask(params)
    assert mask == {
        "0_embed": {"table": False},
        "1_layer_norm": {"scale": False, "bias": False},
        "2_dense": {"w": True, "b": False},
    }


def test_make_optimizer_refuses_bad_settings():
    with pytest.raises(ValueError, match="learning_rate must be positive, got 0"):
        train.make_optimizer(0)
    with pytest.raises(ValueError, match="total_steps must be positive, got -1"):
        train.make_optimizer(1e-3, total_steps=-1)


@pytest.mark.slow
def test_cnn_learns_the_bundled_digits(key):
    """A real data set shipped inside scikit-learn: >= 95% test accuracy within 300 steps."""
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    x_train, y_train, x_test, y_test = x[:1400], y[:1400], x[1400:], y[1400:]
    model = CNN(CNNConfig(widths=(16, 32)))
    tx = train.make_optimizer(3e-3, total_steps=300, warmup_steps=20)
    state = train.create_train_state(model, tx, key, (1, 8, 8, 1))
    step = train.make_train_step(model, train.classification_loss, tx)
    rng = np.random.default_rng(1)
    for _ in range(300):
        idx = rng.integers(0, len(x_train), 64)
        state, _ = step(state, {"x": x_train[idx], "y": y_train[idx]})
    accuracy = train.make_eval_step(model, train.classification_loss)(state, {"x": x_test, "y": y_test})["accuracy"]
    assert float(accuracy) >= 0.95


@pytest.mark.slow
def test_grad_norm_metric_is_the_global_norm_and_can_be_left_out(key):
    model = L.serial(L.Dense(8), L.Relu, L.Dense(3))
    tx = optax.sgd(0.1)
    k_x, k_y = jax.random.split(key)
    batch = {"x": jax.random.normal(k_x, (6, 5)), "y": jax.random.randint(k_y, (6,), 0, 3)}
    state = train.create_train_state(model, tx, key, (6, 5))
    with_norm, metrics = train.make_train_step(model, train.classification_loss, tx, donate=False)(state, batch)
    without, lean = train.make_train_step(model, train.classification_loss, tx, donate=False, grad_norm=False)(
        state, batch
    )

    def loss(params):
        return train.classification_loss(L.run(model, params, batch["x"])[0], batch)[0]

    grads = jax.grad(loss)(state.params)
    expected = np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64))) for g in jax.tree.leaves(grads)))
    np.testing.assert_allclose(metrics["grad_norm"], expected, rtol=1e-5)
    assert set(metrics) - set(lean) == {"grad_norm"}
    for a, b in zip(jax.tree.leaves(with_norm), jax.tree.leaves(without)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_train_state_key_drives_dropout_for_any_key_implementation(impl):
    model = L.serial(L.Dense(16), L.Dropout(0.5), L.Dense(3))
    tx = optax.sgd(0.1)
    state = train.create_train_state(model, tx, jax.random.key(0, impl=impl), (4, 5))
    # Default-implementation keys are kept as raw data (cheaper to dispatch); others stay typed.
    assert jax.dtypes.issubdtype(state.key.dtype, jax.dtypes.prng_key) == (impl != "threefry2x32")
    step = train.make_train_step(model, train.classification_loss, tx, donate=False)
    batch = {"x": jax.random.normal(jax.random.key(1), (4, 5)), "y": jnp.array([0, 1, 2, 0])}
    after_one, _ = step(state, batch)
    _, loss_a = step(after_one, batch)
    _, loss_b = step(after_one._replace(step=after_one.step + 1), batch)
    assert float(loss_a["loss"]) != float(loss_b["loss"])  # a different step draws a different dropout mask


@pytest.mark.parametrize("shape,classes", [((4,), 3), ((6, 5), 257), ((2, 3, 4), 10)])
def test_integer_label_cross_entropy_is_optaxs_bit_for_bit_without_a_scatter(shape, classes):
    rng = np.random.default_rng(classes)
    logits = jnp.asarray(rng.normal(size=(*shape, classes)) * 4, jnp.float32)
    labels = jnp.asarray(rng.integers(-classes, classes, size=shape))  # negative labels count from the end
    ours = jax.jit(train.integer_label_cross_entropy)
    theirs = jax.jit(optax.softmax_cross_entropy_with_integer_labels)
    assert np.array_equal(ours(logits, labels), theirs(logits, labels))

    def grad(fn):
        return jax.jit(jax.grad(lambda x: jnp.sum(fn(x, labels) * jnp.arange(1.0, 1 + labels.size).reshape(shape))))

    assert np.array_equal(grad(train.integer_label_cross_entropy)(logits), grad(theirs)(logits))
    assert " scatter(" not in grad(train.integer_label_cross_entropy).lower(logits).compile().as_text()
    assert " scatter(" in grad(theirs).lower(logits).compile().as_text()
    bf16 = logits.astype(jnp.bfloat16)  # computed in float32 whatever the logits' dtype
    assert np.array_equal(ours(bf16, labels), theirs(bf16.astype(jnp.float32), labels))


def test_integer_label_cross_entropy_of_a_label_out_of_range_is_nan_as_optaxs():
    logits, labels = jnp.ones((3, 4)), jnp.array([4, -5, 1])
    got = train.integer_label_cross_entropy(logits, labels)
    assert np.isnan(got[:2]).all() and np.isfinite(got[2])
    assert np.allclose(got[2], optax.softmax_cross_entropy_with_integer_labels(logits, labels)[2])
