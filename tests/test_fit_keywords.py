"""fit's and predict's conveniences for Keras users: probabilities from predict, validation_split, class and
sample weights, an EMA of the weights; each against numpy written here."""

import jax
import numpy as np
import optax
import pytest

import jaxnn
import jaxnn.layers as L
from jaxnn.config import ConfigError

QUICK = {"batch_size": 16, "progress": False, "plots": False}


def _data(n=64, seed=0):
    x = np.random.default_rng(seed).normal(size=(n, 5)).astype(np.float32)
    return x, (x[:, 0] + 0.3 * x[:, 1] > 0).astype(np.int32)


def _softmax(z):
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_predict_gives_probabilities_softmax_or_sigmoid():
    x, y = _data()
    model = L.serial(L.Dense(8), L.Relu, L.Dense(3))
    result = jaxnn.fit(model, (x, y), steps=3, optimizer=optax.adam(1e-2), **QUICK)
    logits = jaxnn.predict(model, result.state, x, batch_size=24)
    probs = jaxnn.predict(model, result.state, x, batch_size=24, probabilities=True)
    assert probs.dtype == np.float32 and probs.shape == (64, 3)
    np.testing.assert_allclose(probs, _softmax(np.asarray(logits, np.float64)), rtol=1e-5, atol=1e-7)
    one = L.Dense(1)
    params = one.init(jax.random.key(0), (1, 5))[1]
    z = np.asarray(jaxnn.predict(one, params, x))
    np.testing.assert_allclose(jaxnn.predict(one, params, x, probabilities=True), 1 / (1 + np.exp(-z)), rtol=1e-5)
    pair = L.serial(L.Dense(2), L.Lambda(lambda h: (h, h), shape_fn=lambda s: (s, s)))
    with pytest.raises(ValueError, match="probabilities=True needs a model whose output is one array"):
        jaxnn.predict(pair, pair.init(jax.random.key(0), (1, 5))[1], x, probabilities=True)


def test_validation_split_holds_out_the_last_examples_as_keras_does():
    x, y = _data(80)
    kw = {**QUICK, "steps": 4, "optimizer": optax.adam(1e-2), "eval_every": 4}
    split = jaxnn.fit(L.Dense(2), (x, y), validation_split=0.25, **kw)
    by_hand = jaxnn.fit(L.Dense(2), (x[:60], y[:60]), eval_data=(x[60:], y[60:]), **kw)
    assert split.summary["param_digest"] == by_hand.summary["param_digest"]
    assert split.summary["eval_accuracy"] == by_hand.summary["eval_accuracy"]
    with pytest.raises(ConfigError, match="validation_split and eval_data exclude each other"):
        jaxnn.fit(L.Dense(2), (x, y), validation_split=0.25, eval_data=(x, y), **kw)
    with pytest.raises(ConfigError, match=r"validation_split must be a fraction in \(0, 1\), got 1.5"):
        jaxnn.fit(L.Dense(2), (x, y), validation_split=1.5, **kw)


def _weighted_cross_entropy(logits, y, w):
    z = np.asarray(logits, np.float64)
    log_p = z - z.max(-1, keepdims=True) - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True))
    return float((w * -log_p[np.arange(len(y)), y]).sum() / w.sum())


def test_class_and_sample_weights_weight_each_examples_loss():
    x, y = _data(32)
    model = L.Dense(2)
    params = model.init(jax.random.key(3), (1, 5))[1]
    logits = np.asarray(model.apply(params, x))
    sample = np.random.default_rng(1).uniform(0.5, 2.0, 32).astype(np.float32)
    kw = {**QUICK, "batch_size": 32, "steps": 1, "log_every": 1, "params": params}
    run = jaxnn.fit(model, (x, y), class_weight={0: 1.0, 1: 4.0}, sample_weight=sample, **kw)
    expected = _weighted_cross_entropy(logits, y, sample * np.where(y == 1, 4.0, 1.0))
    assert run.history["loss"][0] == pytest.approx(expected, rel=1e-5)
    plain = jaxnn.fit(model, (x, y), **kw)
    assert plain.history["loss"][0] == pytest.approx(_weighted_cross_entropy(logits, y, np.ones(32)), rel=1e-5)
    with pytest.raises(ConfigError, match=r"class_weight has no weight for class\(es\) \[1\]"):
        jaxnn.fit(model, (x, y), class_weight={0: 1.0}, **kw)
    with pytest.raises(ConfigError, match="sample_weight must hold one finite weight >= 0 per example"):
        jaxnn.fit(model, (x, y), sample_weight=sample[:5], **kw)


def test_ema_is_the_average_of_the_weights_evaluated_and_returned(tmp_path):
    x, y = _data(48)
    model, decay = L.Dense(2), 0.5
    start = model.init(jax.random.key(0), (1, 5))[1]
    kw = {**QUICK, "optimizer": optax.sgd(0.5), "params": start, "batch_size": 16}
    # Reference: the raw weights after each step (runs of 1..4 steps share their data order), averaged in numpy.
    raw = [start] + [jaxnn.fit(model, (x, y), steps=k, **kw).state.params for k in range(1, 5)]
    average = jax.tree.map(np.asarray, start)
    for params in raw[1:]:
        average = jax.tree.map(lambda e, p: decay * e + (1 - decay) * np.asarray(p), average, params)
    run = jaxnn.fit(model, (x, y), steps=4, ema=decay, eval_data=(x, y), eval_every=4, **kw)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), run.state.params, average)
    assert not np.allclose(run.state.params["w"], raw[4]["w"])  # the average, not the last weights
    evaluated = jaxnn.evaluate(model, run.state.params, (x, y), batch_size=16)
    assert run.summary["eval_loss"] == pytest.approx(evaluated["loss"], rel=1e-6)
    jaxnn.save_model(tmp_path / "saved", model, run)
    np.testing.assert_array_equal(jaxnn.load_model(tmp_path / "saved")[1]["w"], run.state.params["w"])
    with pytest.raises(ConfigError, match=r"ema must be a decay in \(0, 1\), e.g. 0.999, got 1.5"):
        jaxnn.fit(model, (x, y), steps=1, ema=1.5, **kw)


def test_a_resumed_ema_run_continues_the_average_bitwise(tmp_path):
    x, y = _data(48)
    kw = {**QUICK, "optimizer": optax.sgd(0.5), "ema": 0.7}
    whole = jaxnn.fit(L.Dense(2), (x, y), steps=4, run_dir=str(tmp_path / "whole"), **kw)
    jaxnn.fit(L.Dense(2), (x, y), steps=2, run_dir=str(tmp_path / "parts"), **kw)
    resumed = jaxnn.fit(L.Dense(2), (x, y), steps=4, run_dir=str(tmp_path / "parts"), resume=True, **kw)
    jax.tree.map(np.testing.assert_array_equal, whole.state.params, resumed.state.params)
