"""Whole-model save and load (jaxnn.save_model / load_model): the architecture from the calls that built it, the
weights beside it, loaded in a process without the model's code; a committed folder from this version loads."""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxnn
from jaxnn import layers as L
from jaxnn.layers import init_model
from jaxnn.models import GPT, GPTConfig
from jaxnn.saving import ModelSaveError, load_model, save_model

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "saved_model_v1"


def _custom():
    return L.serial(
        L.Conv(8, 3, activation="relu"),
        L.BatchNorm(),
        L.MaxPool(2),
        L.Flatten,
        L.Dense(16, activation=L.LeakyRelu(0.2)),
        L.Dropout(0.1),
        L.residual(L.Dense(16), L.Gelu),
        L.Dense(10),
        L.Softmax,
        name="mine",
    )


def _same_outputs(model, params, state, loaded, x):
    model2, params2, state2 = loaded
    want = jaxnn.predict(model, params, x, model_state=state)
    got = jaxnn.predict(model2, jax.tree.map(jnp.asarray, params2), x, model_state=jax.tree.map(jnp.asarray, state2))
    assert np.array_equal(want, got)


def test_a_model_of_jaxnn_layers_saves_and_loads_with_the_same_outputs(tmp_path):
    model = _custom()
    _, params, state = init_model(model, jax.random.key(0), (1, 8, 8, 1))
    x = np.random.default_rng(0).normal(size=(4, 8, 8, 1)).astype(np.float32)
    save_model(tmp_path / "m", model, params, model_state=state)
    assert json.loads((tmp_path / "m" / "model.json").read_text())["format"] == "jaxnn-model"
    _same_outputs(model, params, state, load_model(tmp_path / "m"), x)


@pytest.mark.slow
def test_built_in_models_and_recurrent_layers_save_by_their_calls(tmp_path):
    gpt = GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, num_layers=1, num_heads=2, scan_layers=True))
    rnn = L.serial(L.Bidirectional(L.RNN(L.LSTMCell(8)), L.RNN(L.GRUCell(8), reverse=True)), L.Dense(3))
    for name, model, x in [("gpt", gpt, np.arange(16).reshape(2, 8) % 32),
                           ("rnn", rnn, np.ones((2, 5, 4), np.float32))]:  # fmt: skip
        _, params, state = init_model(model, jax.random.key(1), x.shape)
        save_model(tmp_path / name, model, params, model_state=state)
        _same_outputs(model, params, state, load_model(tmp_path / name), x)


def test_what_no_call_describes_is_refused_at_save_naming_it(tmp_path):
    anonymous = L.serial(L.Dense(4), L.Lambda(lambda x: x * 2, "double"))
    with pytest.raises(ModelSaveError, match=r"'<lambda>'.*cannot be written down"):
        save_model(tmp_path / "a", anonymous, init_model(anonymous, jax.random.key(0), (1, 3))[1])
    handmade = L.Layer(lambda key, s: (s, {}), lambda p, x, **kw: x, "mine")
    with pytest.raises(
        ModelSaveError, match=r"serial\(argument 1\) \(layer 'mine'\) was not made by a jaxnn constructor"
    ):
        save_model(tmp_path / "b", L.serial(L.Dense(2), handmade), {})
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.slow
def test_a_saved_model_loads_in_a_process_without_the_code_that_made_it(tmp_path):
    model = _custom()
    _, params, state = init_model(model, jax.random.key(0), (1, 8, 8, 1))
    save_model(tmp_path / "m", model, params, model_state=state)
    x = np.random.default_rng(1).normal(size=(3, 8, 8, 1)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    code = (
        "import sys, numpy as np, jaxnn\n"
        "model, params, state = jaxnn.load_model(sys.argv[1])\n"
        "np.save(sys.argv[2], jaxnn.predict(model, params, np.load(sys.argv[3]), model_state=state))\n"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "m"), str(tmp_path / "y.npy"), str(tmp_path / "x.npy")],
                   check=True, timeout=300)  # fmt: skip
    assert np.array_equal(np.load(tmp_path / "y.npy"), jaxnn.predict(model, params, x, model_state=state))


def test_the_committed_folder_of_this_version_loads_and_a_newer_one_is_refused(tmp_path):
    model, params, state = load_model(FIXTURE)
    x = np.linspace(-1, 1, 2 * 8 * 8).reshape(2, 8, 8, 1).astype(np.float32)
    out = jaxnn.predict(model, params, x, model_state=state)
    want = np.load(FIXTURE.parent / "saved_model_v1_outputs.npy")
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    newer = tmp_path / "newer"
    newer.mkdir()
    for f in FIXTURE.iterdir():
        (newer / f.name).write_bytes(f.read_bytes())
    record = json.loads((newer / "model.json").read_text())
    (newer / "model.json").write_text(json.dumps({**record, "version": 99}))
    with pytest.raises(ModelSaveError, match="saved by a newer jaxnn"):
        load_model(newer)
    with pytest.raises(ModelSaveError, match="not a saved model"):
        load_model(tmp_path)


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 6)).astype(np.float32)
    return x, (x[:, :3].sum(1) > 0).astype(np.int32)


def _mlp():
    return L.serial(L.Dense(16, activation="relu"), L.Dropout(0.2), L.Dense(2))


_FIT = {"batch_size": 16, "progress": False, "plots": False, "seed": 5}


def _schedule_adamw():
    import optax

    return optax.adamw(optax.cosine_decay_schedule(3e-2, 30))


@pytest.mark.slow
def test_constructors_named_by_the_modules_they_moved_from_still_load():
    from jaxnn.saving import decode, encode

    old = {
        "call": "jaxnn.layers.core.residual",
        "args": [{"call": "jaxnn.layers.attention.TransformerBlock", "args": [2], "kwargs": {"mlp": "swiglu"}}],
        "kwargs": {"name": "r"},
    }
    model = decode(old)
    assert encode(model, "model")["call"] == "jaxnn.layers.combinators.residual"
    assert model.children[0].spec.path == "jaxnn.layers.transformer.TransformerBlock"


@pytest.mark.slow
def test_fit_resumes_a_saved_model_in_a_fresh_process_bitwise(tmp_path):
    x, y = _data()
    np.savez(tmp_path / "data.npz", x=x, y=y)
    whole = jaxnn.fit(_mlp(), (x, y), optimizer=_schedule_adamw(), steps=30, **_FIT)
    first = jaxnn.fit(_mlp(), (x, y), optimizer=_schedule_adamw(), steps=12, **_FIT)
    save_model(tmp_path / "m", _mlp(), first)
    assert json.loads((tmp_path / "m" / "model.json").read_text())["training"]["step"] == 12
    code = (  # no model code: the architecture comes from the folder, the optimizer is given again
        "import sys, numpy as np, optax, jaxnn\n"
        "model, _, _ = jaxnn.load_model(sys.argv[1])\n"
        "data = np.load(sys.argv[2])\n"
        "tx = optax.adamw(optax.cosine_decay_schedule(3e-2, 30))\n"
        "r = jaxnn.fit(model, (data['x'], data['y']), optimizer=tx, steps=30, resume=sys.argv[1], batch_size=16,\n"
        "              progress=False, plots=False, seed=5)\n"
        "np.savez(sys.argv[3], step=r.summary['resumed_from'], **jaxnn.export.flat_weights(r.state.params))\n"
    )
    args = [str(tmp_path / "m"), str(tmp_path / "data.npz"), str(tmp_path / "out.npz")]
    subprocess.run([sys.executable, "-c", code, *args], check=True, timeout=300)
    out = np.load(tmp_path / "out.npz")
    assert int(out["step"]) == 12
    for name, value in jaxnn.export.flat_weights(whole.state.params).items():
        assert np.array_equal(out[name], value), name


def test_a_saved_model_resumes_only_with_its_optimizer_and_from_a_train_state(tmp_path):
    import optax

    x, y = _data()
    first = jaxnn.fit(_mlp(), (x, y), optimizer=_schedule_adamw(), steps=4, **_FIT)
    save_model(tmp_path / "m", _mlp(), first)
    with pytest.raises(ValueError, match=r"trained with optimizer scale_by_adam\+add_decayed_weights.* differs"):
        jaxnn.fit(_mlp(), (x, y), optimizer=optax.sgd(0.1), steps=8, resume=tmp_path / "m", **_FIT)
    with pytest.raises(ModelSaveError, match=r"optimizer state has entries this optimizer lacks \(opt_state\[0\]"):
        jaxnn.fit(
            _mlp(), (x, y), optimizer=optax.sgd(0.1), steps=8, resume=tmp_path / "m", check_optimizer=False, **_FIT
        )
    with pytest.raises(ValueError, match="resume= a saved model and params exclude each other"):
        jaxnn.fit(_mlp(), (x, y), steps=8, resume=tmp_path / "m", params=first.state.params, **_FIT)
    save_model(tmp_path / "p", _mlp(), first.state.params)
    save_model(tmp_path / "q", _mlp(), first, include_optimizer=False)
    for folder in ("p", "q"):
        assert not (tmp_path / folder / "training.safetensors").exists()
        with pytest.raises(ValueError, match="saved without its optimizer state"):
            jaxnn.fit(_mlp(), (x, y), steps=8, resume=tmp_path / folder, **_FIT)
    with pytest.raises(ValueError, match="is not a jaxnn.save_model folder; to continue a run directory"):
        jaxnn.fit(_mlp(), (x, y), steps=8, resume=str(tmp_path), **_FIT)


@pytest.mark.slow
def test_a_resume_whose_learning_rate_is_zero_is_refused_for_any_optimizer(tmp_path):
    x, y = _data()
    run = tmp_path / "run"
    jaxnn.fit(_mlp(), (x, y), optimizer=_schedule_adamw(), steps=30, run_dir=str(run), **_FIT)
    before = sorted(p.name for p in (run / "ckpt").iterdir())
    with pytest.raises(
        ValueError, match=r"resumed from .* at step 30 would train to step 60 with a learning rate of 0"
    ):
        jaxnn.fit(_mlp(), (x, y), optimizer=_schedule_adamw(), steps=60, run_dir=str(run), resume=True, **_FIT)
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == before
    done = jaxnn.fit(_mlp(), (x, y), optimizer=_schedule_adamw(), steps=30, **_FIT)
    save_model(tmp_path / "m", _mlp(), done)
    with pytest.raises(ValueError, match="resumed from the saved model at step 30 .* learning rate of 0"):
        jaxnn.fit(_mlp(), (x, y), optimizer=_schedule_adamw(), steps=40, resume=tmp_path / "m", **_FIT)


def test_fit_records_the_input_and_its_normalisation_for_exports(tmp_path):
    from jaxnn.data import load_dataset

    digits = load_dataset("digits")
    model = L.serial(L.Flatten, L.Dense(10))
    result = jaxnn.fit(model, digits, steps=2, batch_size=16, progress=False, plots=False)
    recorded = result.summary["input"]
    assert recorded["shape"] == [8, 8, 1] and recorded["dtype"] == "float32"
    assert recorded["normalise"]["stored_dtype"] == str(digits.x_train.dtype) and recorded["normalise"]["scale"] == 16
    save_model(tmp_path / "m", model, result)
    assert json.loads((tmp_path / "m" / "model.json").read_text())["input"] == recorded
    save_model(tmp_path / "n", model, result.state.params, input_spec=((8, 8, 1), "float32"))
    assert json.loads((tmp_path / "n" / "model.json").read_text())["input"] == {"shape": [8, 8, 1], "dtype": "float32"}


def test_the_committed_train_state_of_this_version_resumes():
    import optax

    fixture = FIXTURE.parent / "saved_model_v1_trained"
    x, y = _data()
    model, _, _ = load_model(fixture)
    tx = optax.adamw(optax.cosine_decay_schedule(3e-2, 30))
    result = jaxnn.fit(model, (x, y), optimizer=tx, steps=10, resume=fixture, **_FIT)
    assert result.summary["resumed_from"] == 6
    want = np.load(FIXTURE.parent / "saved_model_v1_trained_step10.npz")
    for name, value in jaxnn.export.flat_weights(result.state.params).items():
        np.testing.assert_allclose(value, want[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_folder_is_data_and_runs_nothing_but_jaxnns_constructors(tmp_path):
    marker = tmp_path / "ran"
    evil = {"call": "os.system", "args": [f"touch {marker}"], "kwargs": {}}
    writer = {"call": "jaxnn._src.storage.write_bytes_atomic", "args": [str(marker), "x"], "kwargs": {}}
    activation = {"call": "jaxnn.layers.linear.Dense", "args": [2], "kwargs": {"activation": {"function": "os.getcwd"}}}
    for name, architecture, match in [
        ("a", evil, "names 'os.system', outside jaxnn;"),
        ("b", writer, "names 'jaxnn._src.storage.write_bytes_atomic', which is not a layer"),
        ("c", activation, "names 'os.getcwd', outside jaxnn, jax"),
    ]:
        folder = tmp_path / name
        folder.mkdir()
        for f in FIXTURE.iterdir():
            (folder / f.name).write_bytes(f.read_bytes())
        record = json.loads((folder / "model.json").read_text())
        (folder / "model.json").write_text(json.dumps({**record, "architecture": architecture}))
        with pytest.raises(ModelSaveError, match=match):
            load_model(folder)
    assert not marker.exists()
