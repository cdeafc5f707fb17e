"""Reuse: parameters of a `jaxnn train` checkpoint loaded alone, partly loaded into a new model by path patterns,
some frozen, and trained on with another optimizer through `jaxnn.fit`."""

import custom_model
import jax
import numpy as np
import optax
import pytest

from jaxnn import cli, fit
from jaxnn import layers as L
from jaxnn.checkpoint import CheckpointError, load_params
from jaxnn.data import load_digits
from jaxnn.finetune import freeze, load_into, path_mask
from jaxnn.models import CNN, CNNConfig

pytestmark = pytest.mark.xdist_group("finetune")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("pretrained") / "run"
    argv = [
        "train",
        "--model",
        "cnn",
        "--size",
        "small",
        "--steps",
        "300",
        "--batch-size",
        "32",
        "--no-progress",
        "--no-plots",
        "--no-summary",
        "--run-dir",
        str(run),
    ]
    assert cli.main(argv) == 0
    return run


def new_head_model():
    """The small CNN's body with a new head of its own name, so nothing of the old head can be loaded into it."""
    body = CNN(CNNConfig(num_classes=10).small()).children[:-1]
    return L.serial(*body, L.Dense(10, name="head"))


@pytest.mark.slow
def test_fine_tune_a_new_head_with_another_optimizer_and_a_frozen_body(trained_run):
    loaded = load_params(trained_run)
    assert loaded.step == 300 and loaded.config["model"] == "cnn" and "model_config" in loaded.config
    model = new_head_model()
    _, fresh, _ = L.init_model(model, jax.random.key(7), (32, 8, 8, 1))
    params, report = load_into(fresh, loaded.params, exclude=["*head*"])
    assert report.loaded == ["0_conv.b", "0_conv.w", "3_conv.b", "3_conv.w"]
    assert report.kept == ["7_head.b", "7_head.w"] and report.unused == ["7_logits.b", "7_logits.w"]
    assert "loaded     0_conv.w" in str(report)
    np.testing.assert_array_equal(params["0_conv"]["w"], loaded.params["0_conv"]["w"])

    tx = freeze(optax.adam(optax.cosine_decay_schedule(3e-3, 300)), params, ["0_conv.*"])
    digits = load_digits()  # the data set, so the inputs are normalised as they were in pre-training
    result = fit(
        model,
        digits,
        eval_data=digits,
        params=params,
        optimizer=tx,
        steps=300,
        batch_size=32,
        progress=False,
        plots=False,
    )
    assert result.summary["eval_accuracy"] >= 0.95, result.summary
    np.testing.assert_array_equal(result.state.params["0_conv"]["w"], loaded.params["0_conv"]["w"])  # frozen
    for name in ("3_conv", "7_head"):
        assert not np.array_equal(result.state.params[name]["w"], params[name]["w"])


@pytest.mark.slow
def test_shape_mismatches_are_reported_with_both_shapes_and_strict_refuses(trained_run):
    loaded = load_params(trained_run / "ckpt" / "300")  # a step folder works too
    five_classes = CNN(CNNConfig(num_classes=5).small())
    _, fresh, _ = L.init_model(five_classes, jax.random.key(0), (4, 8, 8, 1))
    params, report = load_into(fresh, loaded.params)
    assert report.mismatched == [("7_logits.b", (10,), (5,)), ("7_logits.w", (64, 10), (64, 5))]
    np.testing.assert_array_equal(params["7_logits"]["w"], fresh["7_logits"]["w"])  # kept, not half-loaded
    with pytest.raises(ValueError, match="2 shape mismatches"):
        load_into(fresh, loaded.params, strict=True)


def test_path_mask_and_bad_starting_params():
    params = {"0_conv": {"w": np.zeros((3, 3, 1, 8)), "b": np.zeros(8)}, "7_head": {"w": np.zeros((4, 2))}}
    assert path_mask(params, ["*.w"]) == {"0_conv": {"w": True, "b": False}, "7_head": {"w": True}}
    with pytest.raises(ValueError, match=r"freeze: no parameter matches \['nothing\*'\]"):
        freeze(optax.sgd(0.1), params, ["nothing*"])
    train, _ = custom_model.digits()
    with pytest.raises(ValueError, match=r"the params given do not fit the model \(.*7_head.w: given \(4, 2\)"):
        fit(new_head_model(), train, params=params, steps=2, batch_size=8, progress=False)


@pytest.mark.slow
def test_load_params_skips_a_damaged_newest_checkpoint_without_touching_it(trained_run, tmp_path, caplog):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    shutil.copytree(run / "ckpt" / "300", run / "ckpt" / "400")  # a copy whose parameter digest will not match
    for data in (p for p in (run / "ckpt" / "400" / "state").rglob("*") if p.is_file() and "/d/" in str(p)):
        raw = bytearray(data.read_bytes())  # one flipped byte in each data file: the parameters' one included
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    before = {p: p.read_bytes() for p in (run / "ckpt").rglob("*") if p.is_file()}
    assert load_params(run).step == 300
    assert "ckpt/400" in caplog.text and "trying the previous one" in caplog.text
    assert {p: p.read_bytes() for p in (run / "ckpt").rglob("*") if p.is_file()} == before
    with pytest.raises(CheckpointError, match="no such run or checkpoint directory"):
        load_params(tmp_path / "nope")
