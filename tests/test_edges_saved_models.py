"""Saved-model folders at their edges: a layer changed after its constructor, a function of the running script,
weights from another save, a damaged version field, a save killed between its two renames; each is one line
naming the culprit."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

import jaxnn
from jaxnn import layers as L
from jaxnn.layers import init_model
from jaxnn.saving import ModelSaveError, load_model, save_model


def _params(model, shape=(1, 4)):
    return init_model(model, jax.random.key(0), shape)[1]


def test_a_layer_changed_with_replace_is_refused_at_save_naming_the_field(tmp_path):
    dense = L.Dense(3)
    doubled = dense._replace(apply=lambda p, x, **kw: dense.apply(p, x, **kw) * 2)
    with pytest.raises(ModelSaveError, match=r"the model \(layer 'dense'\) had its apply replaced after Dense"):
        save_model(tmp_path / "a", doubled, _params(dense))
    renamed = L.serial(dense._replace(name="renamed"))
    with pytest.raises(ModelSaveError, match=r"serial\(argument 0\) \(layer 'renamed'\) had its name replaced"):
        save_model(tmp_path / "b", renamed, _params(renamed))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def _scripts_function(x):
    return x * 3


def test_a_function_of_the_running_script_is_refused_at_save_naming_it_and_its_file(tmp_path, monkeypatch):
    monkeypatch.setattr(_scripts_function, "__module__", "__main__")
    monkeypatch.setattr(__import__("__main__"), "_scripts_function", _scripts_function, raising=False)
    model = L.serial(L.Dense(3, activation=_scripts_function))
    with pytest.raises(ModelSaveError, match=r"Dense\(activation=\) is _scripts_function, defined in .*"
                       r"test_edges_saved_models.py \(__main__\).*importable module"):  # fmt: skip
        save_model(tmp_path / "m", model, _params(model))
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("with_input", [False, True])
def test_weights_from_another_save_are_refused_at_load_naming_the_file_and_parameter(tmp_path, with_input):
    small, large = L.serial(L.Dense(3)), L.serial(L.Dense(5))
    spec = ((4,), np.float32) if with_input else None
    save_model(tmp_path / "a", small, _params(small), input_spec=spec)
    save_model(tmp_path / "b", large, _params(large), input_spec=spec)
    shutil.copy(tmp_path / "b" / "weights.safetensors", tmp_path / "a" / "weights.safetensors")
    if with_input:  # only the architecture's own init can tell
        record = json.loads((tmp_path / "a" / "model.json").read_text())
        del record["weights"]
        (tmp_path / "a" / "model.json").write_text(json.dumps(record))
    source = "the architecture in model.json" if with_input else "the shapes model.json records"
    with pytest.raises(ModelSaveError, match=rf"a.weights\.safetensors: parameter 0_dense.b is shape \(5,\) there "
                       rf"and shape \(3,\) by {source}"):  # fmt: skip
        load_model(tmp_path / "a")
    model, params, state = load_model(tmp_path / "b")
    assert jaxnn.predict(model, params, np.ones((2, 4), np.float32)).shape == (2, 5)


@pytest.mark.parametrize("version", ["1", None, 0, True, 1.5])
def test_a_malformed_version_field_is_named_not_called_newer(tmp_path, version):
    model = L.serial(L.Dense(3))
    save_model(tmp_path / "m", model, _params(model))
    record = json.loads((tmp_path / "m" / "model.json").read_text())
    (tmp_path / "m" / "model.json").write_text(json.dumps({**record, "version": version}))
    with pytest.raises(ModelSaveError, match=rf"model.json: its \"version\" field is {version!r}, not a format"):
        load_model(tmp_path / "m")


def test_a_save_killed_between_its_renames_is_named_and_a_rerun_recovers_it(tmp_path):
    model = L.serial(L.Dense(3))
    params = _params(model)
    save_model(tmp_path / "m", model, params)
    os.rename(tmp_path / "m", tmp_path / ".m.old-123")  # what a kill after the first rename leaves
    with pytest.raises(ModelSaveError, match=r"m: an interrupted save .*its files are in .*\.m\.old-123"):
        load_model(tmp_path / "m")
    save_model(tmp_path / "m", model, params)
    assert load_model(tmp_path / "m")[0].name == model.name
    assert not list(tmp_path.glob(".m.*"))
