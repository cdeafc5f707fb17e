"""What Keras and PyTorch users reach for without reading: layers with or without `()`, `activation=`, the
layers they look for first, the history by name, and callbacks whose direction follows the metric's name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxnn
from jaxnn import layers as L
from jaxnn.callbacks import EarlyStopping, metric_mode
from jaxnn.config import ConfigError
from jaxnn.models import CNN
from jaxnn.train import masked_classification_loss

torch = pytest.importorskip("torch")


def test_layers_work_with_or_without_parentheses_and_are_never_called_on_inputs():
    assert L.Relu() is L.Relu and L.Sigmoid() is L.Sigmoid
    with_parens = L.serial(L.Flatten(), L.Dense(4), L.Relu())
    without = L.serial(L.Flatten, L.Dense(4), L.Relu)
    x = jnp.ones((2, 3, 3))
    p = with_parens.init(jax.random.key(0), x.shape)[1]
    assert np.array_equal(with_parens.apply(p, x), without.apply(p, x))
    with pytest.raises(TypeError, match="relu: a Layer is not called on inputs; use layer.apply"):
        L.Relu(x)


@pytest.mark.parametrize(
    "activation, reference",
    [
        ("relu", torch.relu),
        (L.Sigmoid, torch.sigmoid),
        (L.LeakyRelu(0.2), lambda t: torch.nn.functional.leaky_relu(t, 0.2)),
        (L.LeakyRelu, lambda t: torch.nn.functional.leaky_relu(t, 0.01)),
        (jnp.tanh, torch.tanh),
        ("elu", torch.nn.functional.elu),
        ("softplus", torch.nn.functional.softplus),
    ],
)
def test_dense_and_conv_take_an_activation_without_new_parameters(activation, reference):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 5, 3)), jnp.float32)
    for plain, activated in [(L.Dense(4), L.Dense(4, activation=activation)),
                             (L.Conv(4, 3), L.Conv(4, 3, activation=activation))]:  # fmt: skip
        _, params = plain.init(jax.random.key(1), x.shape)
        assert jax.tree.structure(activated.init(jax.random.key(1), x.shape)[1]) == jax.tree.structure(params)
        want = reference(torch.from_numpy(np.array(plain.apply(params, x)))).numpy()
        assert np.allclose(activated.apply(params, x), want, atol=1e-6)
    with pytest.raises(ValueError, match="unknown activation 'rleu'"):
        L.Dense(3, activation="rleu")


def test_reshape_keeps_the_batch_axis_and_infers_one_size():
    layer = L.Reshape((2, -1))
    out, _ = layer.init(None, (4, 3, 4))
    assert out == (4, 2, 6) and layer.apply({}, jnp.arange(48.0).reshape(4, 3, 4)).shape == (4, 2, 6)
    with pytest.raises(ValueError, match="fit the shape"):
        layer.init(None, (4, 5))
    with pytest.raises(ValueError, match="at most one -1"):
        L.Reshape((-1, -1))


@pytest.mark.parametrize(
    "name, mode",
    [("loss", "min"), ("eval_loss", "min"), ("accuracy", "max"), ("val_accuracy", "max"), ("bits_per_token", "min"),
     ("top5_accuracy", "max"), ("perplexity", "min"), ("f1", "max")],
)  # fmt: skip
def test_the_direction_follows_the_metrics_name(name, mode):
    assert metric_mode(name) == mode and EarlyStopping(name).mode == mode
    assert metric_mode(name, "max") == "max"
    with pytest.raises(ValueError, match="pass mode='max' or mode='min'"):
        metric_mode("kappa")


@pytest.mark.slow
def test_early_stopping_on_accuracy_waits_while_it_rises_and_keep_best_infers_its_mode(tmp_path):
    digits = jaxnn.data.load_digits()
    data = (digits.x_train[:256] / 16.0, digits.y_train[:256])
    held = (digits.x_test[:128] / 16.0, digits.y_test[:128])
    stopper = EarlyStopping("accuracy", patience=1)
    result = jaxnn.fit(CNN(), data, eval_data=held, steps=40, eval_every=10, batch_size=32, progress=False,
                       callbacks=[stopper], run_dir=str(tmp_path / "a"), keep_best="accuracy")  # fmt: skip
    accuracies = result.history["eval_accuracy"]
    if result.summary.get("stopped_by"):  # stopped only after an evaluation that did not beat the best
        assert accuracies[-1] <= max(accuracies[:-1])
    else:
        assert len(accuracies) == 4
    assert stopper.mode == "max"

    def with_kappa(out, batch):
        loss, metrics = masked_classification_loss(out, batch)
        return loss, {**metrics, "kappa": metrics["accuracy"]}

    with pytest.raises(ConfigError, match="EarlyStopping: cannot tell from its name whether 'kappa'"):
        jaxnn.fit(CNN(), data, loss=with_kappa, eval_data=held, steps=2, batch_size=32, progress=False,
                  callbacks=[EarlyStopping("kappa")])  # fmt: skip


@pytest.mark.slow
def test_the_history_reads_by_name_and_keeps_its_rows():
    digits = jaxnn.data.load_digits()
    data = (digits.x_train[:64] / 16.0, digits.y_train[:64])
    result = jaxnn.fit(CNN(), data, eval_data=data, steps=4, log_every=2, eval_every=2, batch_size=32,
                       progress=False)  # fmt: skip
    history = result.history
    assert history["step"] == [2, 4] and len(history["loss"]) == 2 and history["eval_step"] == [2, 4]
    assert history[0]["split"] == "train" and "eval_accuracy" in history.as_dict()
    assert [row["loss"] for row in history if row["split"] == "train"] == history["loss"]
    with pytest.raises(KeyError, match="history has no 'val_loss'; it has"):
        history["val_loss"]


def test_a_sharded_fit_prints_its_layout_and_warns_at_the_users_line(capsys, request):
    import logging
    import warnings

    from jaxnn.models import MLP
    from jaxnn.parallel.report import ShardingWarning

    x, y = np.zeros((8, 64), np.float32), np.arange(8) % 10
    # A plain script's logging: not at INFO (another test in this process may have left the root logger there).
    report_log = logging.getLogger("jaxnn.parallel.report")
    request.addfinalizer(lambda level=report_log.level: report_log.setLevel(level))
    report_log.setLevel(logging.WARNING)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jaxnn.fit(MLP(), (x, y), steps=1, batch_size=8, mesh="tensor=8", plots=False)
    assert "tensor=8:" in capsys.readouterr().err  # the layout report, without configuring logging
    said = [w for w in caught if issubclass(w.category, ShardingWarning)]
    assert said and "mesh axis 'tensor' (8 devices) splits no parameter" in str(said[0].message)
    assert said[0].filename == __file__
