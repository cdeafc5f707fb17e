"""`jaxnn predict`, `jaxnn evaluate` and `jaxnn export` on a saved model (and on a `jaxnn train` run): the same
numbers as the Python calls, stored images normalised as in training, bad input one line and nothing written."""

import json

import numpy as np
import pytest

import jaxnn
from jaxnn import cli
from jaxnn import layers as L
from jaxnn.data import load_dataset


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli") / "cnn"
    digits = load_dataset("digits")
    model = L.serial(L.Conv(4, 3, activation="relu"), L.Flatten, L.Dense(10))
    result = jaxnn.fit(model, digits, steps=30, batch_size=32, progress=False, plots=False)
    jaxnn.save_model(folder, model, result)
    return folder, model, result, digits


def refused(capsys, argv, match):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxnn: error: ") and "\n" not in err and match in err, err


def test_predict_writes_the_outputs_fit_would_give_for_stored_images(saved, tmp_path, capsys):
    folder, model, result, digits = saved
    np.save(tmp_path / "x.npy", digits.x_test[:50])  # stored uint8 images, as the data set keeps them
    assert cli.main(["predict", "--model", str(folder), "--input", str(tmp_path / "x.npy"),
                     "--out", str(tmp_path / "y.npy")]) == 0  # fmt: skip
    assert "normalised as in training" in capsys.readouterr().err
    want = jaxnn.predict(model, result, digits)[:50]
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), want, rtol=1e-5, atol=1e-5)
    assert cli.main(["predict", "--model", str(folder), "--input", str(tmp_path / "x.npy"),
                     "--out", str(tmp_path / "c.npy"), "--classes"]) == 0  # fmt: skip
    assert np.array_equal(np.load(tmp_path / "c.npy"), want.argmax(-1))


def test_evaluate_prints_the_metrics_of_jaxnn_evaluate(saved, tmp_path, capsys):
    folder, model, result, digits = saved
    want = jaxnn.evaluate(model, result, digits)
    capsys.readouterr()
    assert cli.main(["evaluate", "--model", str(folder), "--out", str(tmp_path / "m.json")]) == 0
    got = json.loads(capsys.readouterr().out.strip())
    assert got == pytest.approx(want, abs=1e-5)
    assert json.loads((tmp_path / "m.json").read_text()) == got
    np.savez(tmp_path / "xy.npz", x=digits.x_test, y=digits.y_test)
    assert cli.main(["evaluate", "--model", str(folder), "--arrays", str(tmp_path / "xy.npz")]) == 0
    assert json.loads(capsys.readouterr().out.strip()) == pytest.approx(want, abs=1e-5)


def test_export_of_a_saved_model_runs_without_jaxnn_code(saved, tmp_path):
    import jax
    import safetensors.numpy

    folder, model, result, digits = saved
    assert cli.main(["export", "--run-dir", str(folder), "--out", str(tmp_path / "e")]) == 0
    info = json.loads((tmp_path / "e" / "export.json").read_text())
    assert info["input"]["shape"][1:] == [8, 8, 1] and info["config"]["input"]["normalise"]["scale"] == 16
    exported = jax.export.deserialize((tmp_path / "e" / "model.jaxexport").read_bytes())
    weights = safetensors.numpy.load_file(tmp_path / "e" / "weights.safetensors")
    x = np.random.default_rng(0).normal(size=(3, 8, 8, 1)).astype(np.float32)
    np.testing.assert_allclose(exported.call(weights, x), jaxnn.predict(model, result, x), rtol=1e-5, atol=1e-6)


def test_a_saved_model_without_an_input_record_exports_with_input_shape(saved, tmp_path, capsys):
    folder, model, result, _ = saved
    jaxnn.save_model(tmp_path / "bare", model, result.state.params)
    refused(capsys, ["export", "--run-dir", str(tmp_path / "bare"), "--out", str(tmp_path / "e")],
            "records no input shape")  # fmt: skip
    assert not (tmp_path / "e").exists()
    assert cli.main(["export", "--run-dir", str(tmp_path / "bare"), "--out", str(tmp_path / "e"),
                     "--input-shape", "8,8,1"]) == 0  # fmt: skip


def test_bad_input_is_one_line_and_writes_nothing(saved, tmp_path, capsys):
    folder = str(saved[0])
    np.save(tmp_path / "big.npy", np.zeros((2, 28, 28, 1), np.float32))
    (tmp_path / "junk.npy").write_text("not an array")
    np.save(tmp_path / "taken.npy", np.zeros(1))
    out = str(tmp_path / "y.npy")
    refused(capsys, ["predict", "--model", folder, "--input", str(tmp_path / "big.npy"), "--out", out],
            "examples of shape (28, 28, 1)")  # fmt: skip
    refused(capsys, ["predict", "--model", folder, "--input", str(tmp_path / "junk.npy"), "--out", out],
            "not a .npy or .npz array file")  # fmt: skip
    refused(capsys, ["predict", "--model", folder, "--input", str(tmp_path / "big.npy"),
                     "--out", str(tmp_path / "taken.npy")], "exists; pass --overwrite")  # fmt: skip
    refused(capsys, ["predict", "--model", str(tmp_path), "--input", str(tmp_path / "big.npy"), "--out", out], "")
    refused(capsys, ["evaluate", "--model", folder, "--arrays", str(tmp_path / "big.npy")], "needs a .npz file")
    refused(capsys, ["evaluate", "--model", folder, "--dataset", "mnist"], "needs a data directory")
    refused(capsys, ["export", "--run-dir", folder, "--out", out, "--format", "hf"], "writes GPT models")
    refused(capsys, ["predict", "--model", folder, "--step", "3", "--input", str(tmp_path / "big.npy"),
                     "--out", out], "holds one state")  # fmt: skip
    assert not (tmp_path / "y.npy").exists()


@pytest.mark.slow
def test_predict_and_evaluate_read_a_run_of_jaxnn_train(tmp_path, capsys):
    run = tmp_path / "run"
    assert cli.main(["train", "--size", "small", "--steps", "8", "--batch-size", "16", "--no-progress",
                     "--no-summary", "--run-dir", str(run)]) == 0  # fmt: skip
    capsys.readouterr()
    digits = load_dataset("digits")
    np.save(tmp_path / "x.npy", digits.x_test[:5])
    assert cli.main(["predict", "--model", str(run), "--input", str(tmp_path / "x.npy"),
                     "--out", str(tmp_path / "y.npy")]) == 0  # fmt: skip
    assert np.load(tmp_path / "y.npy").shape == (5, 10)
    assert cli.main(["evaluate", "--model", str(run)]) == 0
    metrics = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    summary = json.loads((run / "summary.json").read_text())
    assert metrics["accuracy"] == pytest.approx(summary["eval_accuracy"], abs=1e-6)
