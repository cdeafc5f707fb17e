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
