"""The contract of `jaxnn.fit`, `jaxnn.evaluate` and `jaxnn.predict` that users of Keras, Lightning and Flax
expect: exact evaluation for any loss, training on past a finished run, epochs, data that runs out, callbacks
checked up front, one-line refusals of bad data, Ctrl-C, gradient accumulation. Tiny models, a few steps."""

import dataclasses
import functools
import inspect
import json
import os
import pathlib
import re
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxnn
from jaxnn import layers as L
from jaxnn.callbacks import Callback, EarlyStopping
from jaxnn.config import ConfigError, FitConfig
from jaxnn.data import DataError
from jaxnn.train import create_train_state, lm_loss, make_predict, masked_classification_loss, train_step_fn

REPO = pathlib.Path(__file__).resolve().parents[1]
QUIET = {"progress": False, "plots": False}
TINY = {"steps": 6, "batch_size": 16, "log_every": 3, **QUIET}


def mlp(out=3):
    return L.serial(L.Dense(8), L.Relu, L.Dense(out))


def mse(out, batch):  # reads no mask, returns no count: the loop alone must make it exact
    return jnp.mean((out - batch["y"]) ** 2), {}


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(100, 5)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0).astype(np.int32)
    return x, y


@pytest.fixture(scope="module")
def state():
    return create_train_state(mlp(), optax.adam(1e-2), jax.random.key(1), (16, 5))


def log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


# ------------------------------------------------------------------------------------------ exact evaluation


def _reference(kind, model, params, batch):
    out = np.asarray(make_predict(model)(params, {}, batch["x"]), np.float64)
    if kind == "regression":
        return {"loss": np.mean((out - batch["y"]) ** 2)}
    ce = -np.take_along_axis(log_softmax(out), batch["y"][..., None], -1)[..., 0]
    ref = {"loss": ce.mean()}
    if kind == "classification":
        ref["accuracy"] = np.mean(out.argmax(-1) == batch["y"])
    else:
        ref["bits_per_token"] = ce.mean() / np.log(2)
    return ref


def _case(kind, rows):
    rng = np.random.default_rng(3)
    if kind == "language model":
        model = L.serial(L.Embedding(11, 6), L.Dense(11))
        x = rng.integers(0, 11, (rows, 7)).astype(np.int32)
        return model, lm_loss, {"x": x, "y": np.roll(x, -1, axis=1)}
    x = rng.normal(size=(rows, 5)).astype(np.float32)
    if kind == "regression":
        return mlp(1), mse, {"x": x, "y": x[:, :1] * 2.0}
    return mlp(), masked_classification_loss, {"x": x, "y": rng.integers(0, 3, rows).astype(np.int32)}


@pytest.mark.parametrize("devices", [1, 8])
@pytest.mark.parametrize("kind", ["classification", "language model", "regression"])
def test_evaluate_is_exact_for_any_loss_on_a_partial_last_batch(kind, devices):
    model, loss, batch = _case(kind, 100)  # 100 rows at batch 16 (or 64): the last batch is partial
    from jaxnn.layers.core import init_model

    _, params, _ = init_model(model, jax.random.key(0), batch["x"][:2].shape)
    got = jaxnn.evaluate(model, params, batch, loss=loss, batch_size=16, devices=devices)
    ref = _reference(kind, model, params, batch)
    assert got.keys() == ref.keys()
    for k in ref:
        assert got[k] == pytest.approx(ref[k], rel=2e-5), k


@pytest.mark.parametrize("devices", [1, 8])
def test_fit_evaluates_exactly_a_loss_that_reads_no_mask(devices):
    model, loss, batch = _case("regression", 164)
    train, test = {k: v[:64] for k, v in batch.items()}, {k: v[64:] for k, v in batch.items()}  # 100 eval rows
    result = jaxnn.fit(model, train, loss=loss, eval_data=test, devices=devices, **TINY)
    params = jax.device_get(result.state.params)
    assert result.summary["eval_loss"] == pytest.approx(_reference("regression", model, params, test)["loss"], 1e-5)


def test_predict_returns_every_row_in_order_on_one_or_many_devices(data, state):
    x, _ = data
    direct = np.asarray(make_predict(mlp())(state.params, state.model_state, x))
    for devices in (1, 8):
        for given in (state, state.params):
            out = jaxnn.predict(mlp(), given, x, batch_size=32, devices=devices)
            np.testing.assert_allclose(out, direct, rtol=1e-5, atol=1e-6)
    batches = [{"x": x[i : i + 30]} for i in range(0, 100, 30)]  # an iterable, ragged at the end
    np.testing.assert_allclose(jaxnn.predict(mlp(), state, batches), direct, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------- resuming, epochs


@pytest.mark.slow
def test_resume_with_more_steps_trains_on_bitwise(tmp_path, data):
    run = dict(optimizer=optax.adam(1e-2), **{**TINY, "ckpt_every": 3})
    straight = jaxnn.fit(mlp(), data, run_dir=str(tmp_path / "straight"), **{**run, "steps": 12})
    jaxnn.fit(mlp(), data, run_dir=str(tmp_path / "a"), **{**run, "steps": 6})
    longer = jaxnn.fit(mlp(), data, run_dir=str(tmp_path / "a"), resume=True, **{**run, "steps": 12})
    assert longer.summary["resumed_from"] == 6 and longer.summary["step"] == 12
    assert longer.summary["param_digest"] == straight.summary["param_digest"]
    # fit's own optimizer decays to `steps`: training on would not continue the run, and says why.
    jaxnn.fit(mlp(), data, run_dir=str(tmp_path / "b"), **TINY)
    with pytest.raises(ConfigError, match=r"resume with steps 12, but the run .* was made for 6, and the default"):
        jaxnn.fit(mlp(), data, run_dir=str(tmp_path / "b"), resume=True, **{**TINY, "steps": 12})


def test_init_from_starts_a_new_run_from_params_and_optimizer_state(tmp_path, data):
    old = jaxnn.fit(mlp(), data, optimizer=optax.adam(1e-2), run_dir=str(tmp_path / "old"), **TINY)

    class First(Callback):
        def on_start(self, run):
            self.state = jax.device_get(run.state)

    first = First()
    jaxnn.fit(mlp(), data, optimizer=optax.adam(1e-2), init_from=str(tmp_path / "old"), callbacks=[first], **TINY)
    for got, want in zip(jax.tree.leaves(first.state[:3]), jax.tree.leaves(jax.device_get(old.state)[:3])):
        np.testing.assert_array_equal(got, want)  # params, model state, optimizer state (adam's count 6)
    assert int(first.state.step) == 0


def test_epochs_cover_the_data_and_resume_mid_epoch_bitwise(tmp_path, data):
    run = dict(optimizer=optax.adam(1e-2), epochs=3, batch_size=16, log_every=2, **QUIET)  # 6 batches an epoch
    whole = jaxnn.fit(mlp(), data, run_dir=str(tmp_path / "whole"), **run)
    assert whole.summary["step"] == 18

    class StopAt(Callback):
        def on_step(self, run, step, metrics):
            if step == 8:
                run.request_stop("test")  # in the middle of the second epoch

    part = jaxnn.fit(mlp(), data, run_dir=str(tmp_path / "part"), callbacks=[StopAt()], **run)
    assert 6 < part.summary["step"] < 12
    resumed = jaxnn.fit(mlp(), data, run_dir=str(tmp_path / "part"), resume=True, **run)
    assert resumed.summary["param_digest"] == whole.summary["param_digest"]
    with pytest.raises(ConfigError, match="give steps or epochs, not both"):
        jaxnn.fit(mlp(), data, steps=4, epochs=1, **QUIET)
    with pytest.raises(ConfigError, match="epochs needs data of known length"):
        jaxnn.fit(mlp(), ({"x": data[0][:16], "y": data[1][:16]} for _ in range(3)), epochs=1, **QUIET)


def test_a_list_is_cycled_and_a_generator_that_runs_out_ends_the_run_cleanly(tmp_path, data):
    x, y = data
    batches = [{"x": x[i : i + 8], "y": y[i : i + 8]} for i in range(0, 64, 8)]  # 8 batches
    assert jaxnn.fit(mlp(), batches, **{**TINY, "steps": 20}).summary["step"] == 20
    result = jaxnn.fit(mlp(), iter(batches), run_dir=str(tmp_path / "gen"), **{**TINY, "steps": 20})
    summary = json.loads((tmp_path / "gen" / "summary.json").read_text())
    assert summary["step"] == result.summary["step"] == 8
    assert summary["stopped_by"] == "the data ran out after 8 steps"
    assert (tmp_path / "gen" / "ckpt" / "8").is_dir()


# --------------------------------------------------------------------------------------------------- callbacks


def test_early_stopping_restores_the_best_state(data):
    x, y = data
    stopper = EarlyStopping("loss", patience=2, restore_best=True)
    # A learning rate far too high: the evaluation loss jumps about, so the best is rarely the last.
    result = jaxnn.fit(
        mlp(), (x, y), eval_data=(x, y), eval_every=1, optimizer=optax.sgd(3.0), callbacks=[stopper], **TINY
    )
    best = jaxnn.evaluate(mlp(), result.state, (x, y))["loss"]
    assert best == pytest.approx(result.summary["best_loss"], rel=1e-5)
    evals = [r["loss"] for r in result.history if r["split"] == "eval"]
    assert best == pytest.approx(min(evals), rel=1e-5)


def test_keep_best_checkpoints_by_the_monitored_metric(tmp_path, data):
    x, y = data
    run = tmp_path / "run"
    result = jaxnn.fit(
        mlp(), (x, y), eval_data=(x, y), eval_every=1, keep_best="loss", keep=1, run_dir=str(run), **TINY
    )
    evals = {r["step"]: r["loss"] for r in result.history if r["split"] == "eval" and r["step"] < 6}
    kept = sorted(int(p.name) for p in (run / "ckpt").iterdir() if p.name.isdigit())
    assert kept == sorted({min(evals, key=evals.get), 6})  # the best, and the last (where a resume continues)


def test_reduce_on_plateau_from_optax_gets_the_training_loss(data):
    tx = optax.chain(optax.adam(1e-2), optax.contrib.reduce_on_plateau(patience=1, accumulation_size=2))
    result = jaxnn.fit(mlp(), data, optimizer=tx, **TINY)
    plateau = result.state.opt_state[1]
    assert np.isfinite(float(plateau.best_value))  # it starts at inf: only a `value` passed in changes it


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"callbacks": [EarlyStopping("acuracy")]}, "EarlyStopping monitors 'acuracy', but the evaluation reports"),
        ({"keep_best": "los"}, "keep_best monitors 'los', but the evaluation reports ['accuracy', 'loss']"),
        ({"callbacks": [EarlyStopping()], "eval_data": None}, "monitors the evaluation metric 'loss', but fit has no"),
        ({"callbacks": [object()]}, "callbacks[0]: object is not a jaxnn.callbacks.Callback"),
        ({"callbacks": [EarlyStopping]}, "callbacks[0]: the class EarlyStopping, not an instance"),
    ],
)
def test_callbacks_are_checked_before_anything_is_written(tmp_path, data, settings, match):
    with pytest.raises(ConfigError, match=re.escape(match)):
        jaxnn.fit(mlp(), data, **{"eval_data": data, "run_dir": str(tmp_path / "run"), **TINY, **settings})
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------- data contract


def bare_scalar(out, batch):
    return jnp.mean(out)


@pytest.mark.parametrize(
    "labels, settings, error, match",
    [
        (lambda y: y * 6, {}, DataError, "data: labels 'y' run from 0 to 12, outside the model's 3 classes (0..2)"),
        (lambda y: y[:, None], {}, ConfigError, "labels 'y' have shape (16, 1), the model's output (16, 3) wants"),
        (lambda y: y.astype(np.float32), {}, ConfigError, "labels 'y' are float32; the classification loss wants"),
        (lambda y: y, {"loss": bare_scalar}, ConfigError, "loss bare_scalar: must return (loss, metrics)"),
        (lambda y: y, {"eval_x": 4}, DataError, "eval_data: 'x' is float32[4] per example, the training data's"),
        (lambda y: y, {"eval_y": 7}, DataError, "eval_data: labels 'y' run from 0 to 14, outside the model's 3"),
    ],
)
def test_bad_data_is_one_line_naming_the_culprit_before_anything_is_written(
    tmp_path, data, labels, settings, error, match
):
    x, y = data
    settings = dict(settings)
    test_x = x[:, : settings.pop("eval_x", 5)]
    test_y = y * settings.pop("eval_y", 1)
    with pytest.raises(error, match=re.escape(match)):
        jaxnn.fit(mlp(), (x, labels(y)), eval_data=(test_x, test_y), run_dir=str(tmp_path / "run"), **TINY, **settings)
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------- Ctrl-C, run dirs


def test_ctrl_c_checkpoints_then_raises_keyboard_interrupt(tmp_path, data):
    class CtrlC(Callback):
        def on_step(self, run, step, metrics):
            if step == 2:
                os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt) as caught:
        jaxnn.fit(mlp(), data, run_dir=str(tmp_path / "run"), callbacks=[CtrlC()], **TINY)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["interrupted_by"] == signal.SIGINT and summary["step"] == caught.value.result.summary["step"]
    assert (tmp_path / "run" / "ckpt" / str(summary["step"])).is_dir()


def test_fresh_run_dir_lets_the_same_script_run_twice(tmp_path, data):
    runs = []
    for _ in range(2):  # the same script, twice (within one second: the second name gets a suffix)
        runs.append(jaxnn.fresh_run_dir(tmp_path / "mine"))
        jaxnn.fit(mlp(), data, run_dir=runs[-1], **{**TINY, "steps": 2})
    assert runs[0] != runs[1] and all((pathlib.Path(r) / "summary.json").is_file() for r in runs)
    assert {pathlib.Path(r).parent for r in runs} == {tmp_path / "mine"}


# ---------------------------------------------------------------------------- accumulation, label smoothing


def test_accumulated_micro_batches_update_as_the_big_batch(data, state):
    x, y = data
    batch = {"x": x[:32], "y": y[:32]}
    tx = optax.sgd(0.5)
    state = create_train_state(mlp(), tx, jax.random.key(1), (32, 5))
    big, _ = jax.jit(train_step_fn(mlp(), masked_classification_loss, tx))(state, batch)
    small, metrics = jax.jit(train_step_fn(mlp(), masked_classification_loss, tx, accumulate=4))(state, batch)
    for a, b in zip(jax.tree.leaves(big.params), jax.tree.leaves(small.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    one = jaxnn.fit(mlp(), data, optimizer=tx, **TINY)
    four = jaxnn.fit(mlp(), data, optimizer=tx, accumulate=2, devices=8, **TINY)  # micro-batches of 8 on 8 devices
    for a, b in zip(jax.tree.leaves(one.state.params), jax.tree.leaves(four.state.params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_label_smoothing_trains_against_smoothed_targets(data):
    x, y = data
    logits = np.random.default_rng(0).normal(size=(100, 3)).astype(np.float32)
    smooth = functools.partial(masked_classification_loss, label_smoothing=0.1)
    loss, metrics = smooth(jnp.asarray(logits), {"x": x, "y": y})
    targets = np.eye(3)[y] * 0.9 + 0.1 / 3
    assert float(loss) == pytest.approx(-(targets * log_softmax(logits.astype(np.float64))).sum(-1).mean(), 1e-5)
    assert float(metrics["accuracy"]) == pytest.approx(np.mean(logits.argmax(-1) == y))
    assert jaxnn.fit(mlp(), data, loss=smooth, **TINY).summary["step"] == 6


# ------------------------------------------------------------------------------------------- signature, docs


def test_fit_lists_every_setting_with_fit_configs_default():
    params = inspect.signature(jaxnn.fit).parameters
    for field in dataclasses.fields(FitConfig):
        assert field.name in params, field.name
        want = None if field.name == "steps" else field.default  # None: FitConfig's, or what epochs make
        assert params[field.name].default == want, field.name


def test_eval_metrics_are_in_the_log_line(data, caplog):
    with caplog.at_level("INFO", logger="jaxnn.loop"):
        jaxnn.fit(mlp(), data, eval_data=data, **TINY)
    assert re.search(r"eval at step 6: accuracy=[0-9.]+ loss=[0-9.]+", caplog.text)


@pytest.mark.slow
def test_the_migration_table_in_the_docs_runs(tmp_path, monkeypatch):
    text = (REPO / "docs" / "training.md").read_text()
    section = text.split("## From Keras, Lightning and Flax", 1)[1].split("\n## ", 1)[0]
    setup = section.split("```python\n", 1)[1].split("```", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "`jaxnn" in line]
    snippets = [re.findall(r"`([^`]+)`", row.split("|")[-2])[0] for row in rows]
    assert len(snippets) >= 7, snippets
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")  # the W&B row's run, written in its run directory for `wandb sync`
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the MLflow row's run, in its run directory
    namespace: dict = {}
    exec(setup, namespace)
    for snippet in snippets:
        exec(snippet, namespace)


def test_accumulation_benchmark_reports_falling_activation_memory():
    from benchmarks.accumulate_memory import main

    one, four = main(["--batch", "512", "--width", "64", "--k", "1", "4"])
    assert four["micro_batch"] == 128 and four["temp_bytes"] < 0.7 * one["temp_bytes"]
