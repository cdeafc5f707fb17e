"""jaxnn.scores: metrics summed over the whole evaluation equal scikit-learn's on the whole set, with batch sizes
that do not divide it, over several devices, in `fit` (watched by keep_best), and bad requests are one line."""

import math

import jax
import numpy as np
import pytest

import jaxnn
from jaxnn.errors import ConfigError
from jaxnn.layers import Dense, init_model, serial
from jaxnn.scores import Score, get_scores

metrics = pytest.importorskip("sklearn.metrics")

N, D, C = 203, 6, 4  # 203 rows: no batch size below divides them


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, D)).astype(np.float32)
    y = (x[:, 0] * 2 + x[:, 1] + rng.normal(size=N) > 0).astype(np.int32) + 2 * (x[:, 2] > 0.8)
    return x, y.astype(np.int32)


def _model(classes=C):
    model = serial(Dense(classes))
    return model, init_model(model, jax.random.key(1), (1, D))[1]


def _reference(model, params, x, y):
    logits = np.asarray(jaxnn.predict(model, params, x))
    probs = np.asarray(jax.nn.softmax(logits, -1))
    pred = logits.argmax(-1)
    return logits, probs, pred


@pytest.mark.parametrize("batch_size", [7, 64, 256])
def test_whole_set_metrics_equal_sklearn(batch_size):
    x, y = _data()
    model, params = _model()
    _, probs, pred = _reference(model, params, x, y)
    names = ["accuracy", "f1", "f1_micro", "precision", "recall", "precision_micro", "recall_micro",
             "confusion_matrix", "roc_auc", "top5_accuracy", "perplexity"]  # fmt: skip
    got = jaxnn.evaluate(model, params, (x, y), batch_size=batch_size, metrics=names)
    labels = sorted(set(y) | set(pred))
    assert got["accuracy"] == pytest.approx(metrics.accuracy_score(y, pred), abs=1e-12)
    for kind in ("f1", "precision", "recall"):
        score = getattr(metrics, f"{kind}_score")
        assert got[kind] == pytest.approx(score(y, pred, average="macro", labels=labels, zero_division=0), abs=1e-9)
        assert got[f"{kind}_micro"] == pytest.approx(score(y, pred, average="micro", zero_division=0), abs=1e-9)
    assert got["confusion_matrix"] == metrics.confusion_matrix(y, pred, labels=range(C)).tolist()
    auc = metrics.roc_auc_score(y, probs, multi_class="ovr", average="macro")
    assert got["roc_auc"] == pytest.approx(auc, abs=2e-3)  # 1000 bins
    assert got["top5_accuracy"] == 1.0  # 4 classes: always within the top 5
    nll = -np.log(probs[np.arange(N), y]).mean()
    assert got["perplexity"] == pytest.approx(math.exp(nll), rel=1e-5)


def test_binary_auc_and_regression_errors_equal_sklearn():
    x, y = _data(1)
    y = (y > 1).astype(np.int32)
    model, params = _model(2)
    _, probs, _ = _reference(model, params, x, y)
    got = jaxnn.evaluate(model, params, (x, y), batch_size=50, metrics=["roc_auc"])
    assert got["roc_auc"] == pytest.approx(metrics.roc_auc_score(y, probs[:, 1]), abs=2e-3)
    reg, reg_params = _model(1)
    target = x[:, 0].astype(np.float32)
    out = np.asarray(jaxnn.predict(reg, reg_params, x))[:, 0]
    loss = lambda logits, batch: (((logits[:, 0] - batch["y"]) ** 2).mean(), {})  # noqa: E731
    got = jaxnn.evaluate(reg, reg_params, (x, target), batch_size=32, loss=loss, metrics=["mae", "mse"])
    assert got["mae"] == pytest.approx(metrics.mean_absolute_error(target, out), rel=1e-5)
    assert got["mse"] == pytest.approx(metrics.mean_squared_error(target, out), rel=1e-5)


def test_a_per_batch_average_would_be_wrong_and_this_is_not():
    # the failure these sums fix: F1 of each batch, averaged, is far from the F1 of the set
    x, y = _data()
    model, params = _model()
    _, _, pred = _reference(model, params, x, y)
    labels = sorted(set(y) | set(pred))
    whole = metrics.f1_score(y, pred, average="macro", labels=labels, zero_division=0)
    got = jaxnn.evaluate(model, params, (x, y), batch_size=5, metrics=["f1"])["f1"]
    assert got == pytest.approx(whole, abs=1e-9)


def test_several_devices_give_the_same_values():
    if jax.device_count() < 2:
        pytest.skip("one device")
    x, y = _data()
    model, params = _model()
    one = jaxnn.evaluate(model, params, (x, y), batch_size=30, metrics=["f1", "roc_auc"])
    many = jaxnn.evaluate(model, params, (x, y), batch_size=30, devices=2, metrics=["f1", "roc_auc"])
    assert many["f1"] == pytest.approx(one["f1"], abs=1e-9)
    assert many["roc_auc"] == pytest.approx(one["roc_auc"], abs=1e-9)


def test_fit_reports_and_keeps_the_best_by_a_whole_set_metric(tmp_path):
    x, y = _data()
    model, _ = _model()
    evaluation = {"eval_data": (x[:101], y[:101]), "eval_metrics": ["f1", "roc_auc"], "eval_every": 3}
    result = jaxnn.fit(model, (x, y), **evaluation, steps=6, keep_best="f1", batch_size=32,
                       run_dir=str(tmp_path / "run"), progress=False)  # fmt: skip
    evals = [row for row in result.history if "f1" in row]
    assert len(evals) == 2 and all(0 <= row["f1"] <= 1 and "roc_auc" in row for row in evals)


def test_a_users_own_metric_with_the_same_contract():
    x, y = _data()
    model, params = _model()
    positives = Score("positives", lambda logits, batch, w: {"n": (batch["y"] > 0) @ w, "all": w.sum()},
                      lambda t: float(t["n"] / t["all"]))  # fmt: skip
    got = jaxnn.evaluate(model, params, (x, y), batch_size=17, metrics=[positives])
    assert got["positives"] == pytest.approx((y > 0).mean())


@pytest.mark.parametrize(
    "metrics_, match",
    [
        (["f2"], "unknown metric 'f2'"),
        ([object()], "is not a metric"),
        (["f1", "f1"], "repeat"),
    ],
)
def test_bad_metric_requests_are_one_line(metrics_, match):
    with pytest.raises(ConfigError, match=match):
        get_scores(metrics_, "evaluate")


def test_f1_on_a_regression_output_is_refused_naming_it():
    x, _ = _data()
    model, params = _model(1)
    loss = lambda logits, batch: (((logits[:, 0] - batch["y"]) ** 2).mean(), {})  # noqa: E731
    with pytest.raises(ConfigError, match="metric 'f1': needs integer class labels"):
        jaxnn.evaluate(model, params, (x, x[:, 0]), loss=loss, metrics=["f1"])
    with pytest.raises(ConfigError, match="not one number"):
        jaxnn.fit(model, (x, x[:, 0]), loss=loss, eval_data=(x, x[:, 0]), eval_metrics=["confusion_matrix"], steps=1)
