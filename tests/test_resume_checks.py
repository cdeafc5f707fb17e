"""A resume continues only with the optimizer it was saved with: a saved model or run directory resumed with
another learning rate, another optimizer, or (the default optimizer) other steps is refused in one line naming the
difference; `check_optimizer=False` continues anyway; folders saved before the check resume unchecked."""

import json

import numpy as np
import optax
import pytest

import jaxnn
from jaxnn import layers as L
from jaxnn._src.optimizer_id import differences, fingerprint
from jaxnn.config import ConfigError
from jaxnn.train import make_optimizer

QUIET = {"batch_size": 16, "progress": False, "plots": False, "seed": 3}


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int32)


def _mlp():
    return L.serial(L.Dense(8, activation="relu"), L.Dense(2))


def _fingerprint(tx):
    params = {"w": np.zeros((3, 2), np.float32), "b": np.zeros(2, np.float32)}
    return fingerprint(tx, tx.init(params))


def test_fingerprints_tell_optimizers_apart_and_the_same_one_built_twice_alike():
    assert differences(_fingerprint(optax.adam(1e-3)), _fingerprint(optax.adam(1e-3))) == []
    assert differences(_fingerprint(optax.adam(1e-3)), _fingerprint(optax.adam(1e-2))) == [
        "scale.step_size: saved -0.001, now -0.01"
    ]
    assert differences(_fingerprint(optax.adam(1e-3)), _fingerprint(optax.adamw(1e-3)))[0].startswith("transforms:")
    cosine = [_fingerprint(make_optimizer(1e-3, total_steps=n)) for n in (100, 200)]
    assert differences(*cosine) == ["cosine_decay_schedule.decay_steps: saved 100, now 200"]
    injected = [_fingerprint(optax.inject_hyperparams(optax.adam)(learning_rate=lr)) for lr in (1e-3, 1e-2)]
    assert differences(*injected) == ["inject_hyperparams.numeric_hps.learning_rate: saved 0.001, now 0.01"]
    assert json.loads(json.dumps(cosine[0])) == cosine[0]
    assert differences({**cosine[0], "optax": "0.0.1"}, cosine[1]) == []  # another optax version: not compared


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two saved models of 4 steps: one trained with adam(1e-3), one with the default optimizer."""
    folder = tmp_path_factory.mktemp("saved")
    x, y = _data()
    adam = jaxnn.fit(_mlp(), (x, y), optimizer=optax.adam(1e-3), steps=4, **QUIET)
    jaxnn.save_model(folder / "adam", _mlp(), adam.state)
    default = jaxnn.fit(_mlp(), (x, y), steps=4, **QUIET)
    jaxnn.save_model(folder / "default", _mlp(), default)
    return folder


@pytest.mark.parametrize(
    ("tx", "match"),
    [
        (optax.adam(1e-2), r"trained with optimizer scale_by_adam\+scale .*scale.step_size: saved -0.001, now -0.01"),
        (optax.adamw(1e-3), r"differs \(transforms: saved 'scale_by_adam\+scale', now 'scale_by_adam\+add_decay"),
    ],
)
def test_a_saved_model_resumed_with_another_optimizer_is_refused_unless_told(saved, tx, match):
    with pytest.raises(ConfigError, match=match + r".*pass check_optimizer=False"):
        jaxnn.fit(_mlp(), _data(), optimizer=tx, steps=8, resume=saved / "adam", **QUIET)
    result = jaxnn.fit(_mlp(), _data(), optimizer=tx, steps=8, resume=saved / "adam", check_optimizer=False, **QUIET)
    assert result.summary["resumed_from"] == 4 and result.summary["step"] == 8


def test_the_same_optimizer_resumes_a_saved_model_bitwise(saved):
    whole = jaxnn.fit(_mlp(), _data(), optimizer=optax.adam(1e-3), steps=8, **QUIET)
    resumed = jaxnn.fit(_mlp(), _data(), optimizer=optax.adam(1e-3), steps=8, resume=saved / "adam", **QUIET)
    assert resumed.summary["resumed_from"] == 4
    assert resumed.summary["param_digest"] == whole.summary["param_digest"]


def test_the_default_optimizer_resumed_with_other_steps_is_refused_like_a_run_dir(saved):
    with pytest.raises(ConfigError, match=r"resume with steps 8, but the saved model .* was trained for 4, and the "):
        jaxnn.fit(_mlp(), _data(), steps=8, resume=saved / "default", **QUIET)
    result = jaxnn.fit(_mlp(), _data(), steps=8, resume=saved / "default", check_optimizer=False, **QUIET)
    assert result.summary["resumed_from"] == 4


def test_a_folder_saved_before_the_check_resumes_unchecked(saved, tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    for f in (saved / "adam").iterdir():
        (old / f.name).write_bytes(f.read_bytes())
    record = json.loads((old / "model.json").read_text())
    del record["training"]["optimizer"]
    (old / "model.json").write_text(json.dumps(record))
    result = jaxnn.fit(_mlp(), _data(), optimizer=optax.adam(1e-2), steps=8, resume=old, **QUIET)
    assert result.summary["resumed_from"] == 4


def test_a_run_dir_resumed_with_another_optimizer_is_refused_unless_told(tmp_path):
    run = str(tmp_path / "run")
    jaxnn.fit(_mlp(), _data(), optimizer=optax.adam(1e-3), steps=4, run_dir=run, **QUIET)
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())["optimizer"]
    assert recorded["transforms"] == "scale_by_adam+scale"
    with pytest.raises(ConfigError, match=r"the run in .* trained with .*scale.step_size: saved -0.001, now -0.01"):
        jaxnn.fit(_mlp(), _data(), optimizer=optax.adam(1e-2), steps=8, run_dir=run, resume=True, **QUIET)
    told = jaxnn.fit(
        _mlp(), _data(), optimizer=optax.adam(1e-2), steps=8, run_dir=run, resume=True, check_optimizer=False, **QUIET
    )
    assert told.summary["resumed_from"] == 4
    # The run now records the optimizer it went on with, and resumes with it unchecked by hand.
    again = jaxnn.fit(_mlp(), _data(), optimizer=optax.adam(1e-2), steps=12, run_dir=run, resume=True, **QUIET)
    assert again.summary["resumed_from"] == 8


def test_a_run_dir_from_before_the_check_resumes(tmp_path):
    run = tmp_path / "run"
    jaxnn.fit(_mlp(), _data(), optimizer=optax.adam(1e-3), steps=4, run_dir=str(run), **QUIET)
    record = json.loads((run / "config.json").read_text())
    del record["optimizer"]
    (run / "config.json").write_text(json.dumps(record))
    result = jaxnn.fit(_mlp(), _data(), optimizer=optax.adam(1e-3), steps=8, run_dir=str(run), resume=True, **QUIET)
    assert result.summary["resumed_from"] == 4
