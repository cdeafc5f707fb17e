"""`jaxnn.fit`: a model of the user's own learns the digits, survives SIGKILL bitwise, writes TensorBoard files
TensorBoard reads; every data form; callbacks; bad input refused before anything is written; the README's
"bring your own model" section runs as written."""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import custom_model
import jax
import numpy as np
import optax
import pytest

from jaxnn import fit
from jaxnn import layers as L
from jaxnn.callbacks import Callback, EarlyStopping, LearningRateLogger, NonFiniteError
from jaxnn.config import ConfigError
from jaxnn.data import DataError, load_digits
from jaxnn.train import make_schedule

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = {"steps": 12, "batch_size": 16, "log_every": 4, "progress": False, "plots": False}


def mlp():
    return L.serial(L.Flatten(), L.Dense(32), L.Relu, L.Dense(10))


@pytest.fixture(scope="module")
def digits():
    return custom_model.digits()


@pytest.mark.system
def test_custom_model_learns_digits_and_tensorboard_reads_its_events(tmp_path, digits):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = custom_model.run(tmp_path / "run", metrics=("tensorboard", "csv"))
    assert result.summary["eval_accuracy"] >= 0.95, result.summary
    train_rows = [r for r in result.history if r["split"] == "train"]
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    losses = events.Scalars("train/loss")
    assert [e.step for e in losses] == [r["step"] for r in train_rows]
    np.testing.assert_allclose([e.value for e in losses], [r["loss"] for r in train_rows], rtol=1e-6)
    assert events.Scalars("eval/accuracy")[-1].value == pytest.approx(result.summary["eval_accuracy"], rel=1e-6)
    header = (tmp_path / "run" / "metrics-train.csv").read_text().splitlines()[0].split(",")
    assert header[:2] == ["step", "accuracy"] and "examples_per_s" in header


def start(run_dir, *extra):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device, as a user's run
    return subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "custom_model.py"), str(run_dir), "--steps", "120", *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def checkpoints(run_dir):
    d = pathlib.Path(run_dir) / "ckpt"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def kill_after(proc, run_dir, min_step, sig, timeout=120):
    """Sends `sig` once a checkpoint at `min_step` or later exists (the run is mid-way, possibly mid-save)."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            pytest.fail(f"training ended before the kill point: {proc.communicate()[1][-2000:]}")
        if checkpoints(run_dir) and checkpoints(run_dir)[-1] >= min_step:
            proc.send_signal(sig)
            return proc.communicate(timeout=60)
        time.sleep(0.02)
    proc.kill()
    pytest.fail("no checkpoint appeared in time")


@pytest.mark.system
def test_custom_model_killed_and_resumed_matches_uninterrupted(tmp_path):
    reference = start(tmp_path / "ref")
    run = tmp_path / "run"
    proc = start(run)
    kill_after(proc, run, 40, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    assert (run / "run.lock").exists()  # left behind by the killed process: the next run takes it over
    final = start(run, "--resume")  # (SIGTERM and resume: tests/system/test_faults.py)
    out, err = final.communicate(timeout=180)
    assert final.returncode == 0, err[-2000:]
    assert "taking over the lock left by process" in err
    ref_out, ref_err = reference.communicate(timeout=180)
    assert reference.returncode == 0, ref_err[-2000:]
    assert out.split() == ref_out.split()  # final step and SHA-256 of the parameters: bitwise equal
    assert not (run / "run.lock").exists()


@pytest.mark.slow
def test_every_data_form_trains(digits):
    (x, y), test = digits
    batches = [{"x": x[i : i + 16], "y": y[i : i + 16]} for i in range(0, 16 * 12, 16)]
    for data in ((x, y), {"x": x, "y": y}, batches, load_digits()):
        result = fit(mlp(), data, eval_data=test, **TINY)
        assert result.summary["step"] == 12 and np.isfinite(result.summary["eval_loss"])
        assert [r["step"] for r in result.history if r["split"] == "train"] == [4, 8, 12]
    # Eval arrays are padded and masked: every example counts once (100 examples, batches of 16).
    from jaxnn.train import make_predict

    result = fit(mlp(), (x, y), eval_data=(test[0][:100], test[1][:100]), **TINY)
    logits = make_predict(mlp())(result.state.params, result.state.model_state, test[0][:100])
    direct = float(np.mean(np.argmax(np.asarray(logits), -1) == test[1][:100]))
    assert result.summary["eval_accuracy"] == pytest.approx(direct, abs=1e-6)


def test_array_batches_are_a_function_of_seed_and_step(digits):
    from jaxnn.data.sources import ArrayBatches

    (x, y), _ = digits
    one, two = ArrayBatches({"x": x, "y": y}, 32, seed=3), ArrayBatches({"x": x, "y": y}, 32, seed=3, start=40)
    np.testing.assert_array_equal(one[45]["y"], two[5]["y"])
    epoch = np.concatenate([one.batch(i)["y"] for i in range(one.steps_per_epoch)])
    assert len(epoch) == (len(y) // 32) * 32
    seen = np.concatenate([np.sort(one.permutation(0)[i * 32 : (i + 1) * 32]) for i in range(one.steps_per_epoch)])
    np.testing.assert_array_equal(epoch, y[seen])  # each example at most once per epoch
    # A new order every epoch: epoch 1 starts with other examples than epoch 0.
    assert not np.array_equal(one.batch(0)["y"], one.batch(one.steps_per_epoch)["y"])


@pytest.mark.parametrize(
    "data, settings, match",
    [
        ("x", {}, DataError("expected (x, y) arrays")),
        ({"x": np.zeros((10, 8, 8, 1)), "y": np.zeros(9)}, {}, DataError("must share their first")),
        (
            (np.zeros((10, 8, 8, 1)), np.zeros(10, np.int32)),
            {"batch_size": 64},
            DataError("batch size 64 is larger than the 10 training examples"),
        ),
        ((np.zeros((32, 8, 8, 1)), np.zeros(32, np.int32)), {"stesp": 3}, ConfigError("unknown setting(s) ['stesp']")),
        ((np.zeros((32, 8, 8, 1)), np.zeros(32, np.int32)), {"precision": "fp4"}, ConfigError("unknown precision")),
        ((np.zeros((32, 8, 8, 1)), np.zeros((32, 3), np.int32)), {}, ConfigError("the model and loss cannot run")),
        ((np.zeros((32, 5)), np.zeros(32, np.int32)), {"devices": 3}, ValueError("not divisible by the 3 devices")),
        ((np.zeros((32, 5)), np.zeros(32, np.int32)), {"resume": True, "overwrite": True}, ConfigError("exclude")),
    ],
)
def test_bad_input_refused_before_anything_is_written(tmp_path, data, settings, match):
    with pytest.raises(type(match), match=re.escape(str(match))):
        fit(mlp(), data, **{**TINY, "batch_size": 16, "run_dir": str(tmp_path / "run"), **settings})
    assert not (tmp_path / "run").exists()


def test_nonfinite_loss_stops_naming_the_step_and_never_checkpoints_it(tmp_path, digits):
    (x, y), _ = digits
    with pytest.raises(NonFiniteError, match=r"the loss became (nan|inf) at step \d+; stopped"):
        fit(mlp(), (x, y), optimizer=optax.sgd(1e12), run_dir=str(tmp_path / "a"), **{**TINY, "steps": 30})
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["error"].startswith("the loss became") and not (tmp_path / "a" / "ckpt" / "30").exists()
    # Checkpointing every step: the save refuses non-finite parameters even before the loss is read.
    with pytest.raises(NonFiniteError, match=r"(the loss became|the parameters are not finite at) \w+"):
        fit(
            mlp(), (x, y), optimizer=optax.sgd(1e12), run_dir=str(tmp_path / "b"), ckpt_every=1, **{**TINY, "steps": 30}
        )
    from jaxnn.checkpoint import Checkpointer
    from jaxnn.train import create_train_state

    like = create_train_state(mlp(), optax.sgd(1e12), jax.random.key(0), (16, 8, 8, 1))
    restored = Checkpointer(tmp_path / "b" / "ckpt").restore(
        like, json.loads((tmp_path / "b" / "config.json").read_text())
    )
    if restored is not None:
        assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(restored[0].params))


@pytest.mark.filterwarnings("ignore:precision fp16 on a CPU")  # the skipped steps are the subject here
def test_fp16_skipped_steps_are_counted(digits):
    (x, y), _ = digits

    class Overflow(Callback):
        def on_log(self, run, row):
            self.last = row

    spy = Overflow()
    # A loss scale of 2^15 on a large loss overflows fp16 gradients for the first steps, until it has halved enough.
    big = L.serial(L.Flatten(), L.Dense(32), L.Relu, L.Lambda(lambda h: h * 300.0, name="amplify"), L.Dense(10))
    result = fit(big, (x, y), precision="fp16", callbacks=[spy], **{**TINY, "log_every": 12})
    assert result.summary["skipped_steps"] >= 1 and spy.last["skipped_steps"] == result.summary["skipped_steps"]


def test_callbacks_early_stopping_and_learning_rate(digits):
    (x, y), test = digits
    schedule = make_schedule(1e-3, total_steps=40)
    stopper = EarlyStopping("accuracy", mode="max", patience=1, min_delta=2.0)  # no evaluation can improve by 2
    result = fit(
        mlp(),
        (x, y),
        eval_data=test,
        eval_every=4,
        callbacks=[stopper, LearningRateLogger(schedule)],
        optimizer=optax.adam(schedule),
        **{**TINY, "steps": 40},
    )
    assert result.summary["step"] == 8 and result.summary["stopped_by"].startswith("early stopping: eval accuracy")
    rows = [r for r in result.history if r["split"] == "train"]
    assert rows[0]["lr"] == pytest.approx(float(schedule(4)))


def test_multi_device_fit_equals_one_device(digits):
    (x, y), test = digits
    one = fit(mlp(), (x, y), eval_data=test, **TINY)
    four = fit(mlp(), (x, y), eval_data=test, devices=4, **TINY)
    assert abs(one.summary["eval_loss"] - four.summary["eval_loss"]) < 1e-5
    assert four.state.params["1_dense"]["w"].sharding.mesh.size == 4


def readme_code(title: str) -> tuple[str, str]:
    """The README section under `## title` and its Python block."""
    section = (REPO / "README.md").read_text().split(f"## {title}", 1)[1].split("\n## ", 1)[0]
    return section, section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.system
def test_readme_bring_your_own_model_runs_as_written(tmp_path):
    section, code = readme_code("Bring your own model")
    assert len(section.strip().splitlines()) <= 20, "the section promises at most 20 lines"
    code += readme_code("Train on, by epochs, keep the best")[1]  # "continuing the block above"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    accuracy = float(re.search(r"test accuracy ([0-9.]+)", out.stdout).group(1))
    assert accuracy >= 0.9, out.stdout
    trained_on = re.search(r"trained on to step (\d+); best at step (\d+); \((\d+), 10\)", out.stdout)
    assert trained_on and trained_on.group(1) == str(4 * (1500 // 64)) and trained_on.group(3) == "297", out.stdout
