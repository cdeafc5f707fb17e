"""Settings and inputs whose mistakes used to pass silently or be blamed elsewhere: each is one line naming the
culprit (exit 2 at the command line) before anything is written, or a documented acceptance."""

import functools
import gzip
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxnn
from jaxnn import cli
from jaxnn import layers as L
from jaxnn.augment import Augment, parse_augment
from jaxnn.callbacks import Callback
from jaxnn.config import ConfigError
from jaxnn.data import DataError, detect_format, load_cifar10
from jaxnn.data.loaders import read_idx
from jaxnn.layers import init_model
from jaxnn.models import CNN
from jaxnn.train import masked_classification_loss

X = np.zeros((6, 8, 8, 1), np.float32)


@pytest.fixture(scope="module")
def cnn():
    model = CNN()
    return model, init_model(model, jax.random.key(0), (1, 8, 8, 1))[1]


def test_evaluate_refuses_no_data_and_labels_outside_the_models_classes(cnn):
    model, params = cnn
    with pytest.raises(DataError, match="the data hold no examples"):
        jaxnn.evaluate(model, params, iter([]))
    with pytest.raises(DataError, match=r"labels 'y' run from 0 to 12, outside the model's 10 outputs"):
        jaxnn.evaluate(model, params, (X, np.array([0, 1, 2, 3, 4, 12])))
    assert set(jaxnn.evaluate(model, params, (X, np.arange(6)))) == {"accuracy", "loss"}


@pytest.mark.parametrize("smoothing", [1.0, 1.5, -0.1, float("nan"), "0.1"])
def test_label_smoothing_outside_zero_to_one_is_refused_by_the_loss(smoothing):
    with pytest.raises(ValueError, match=r"label_smoothing must be a number in \[0, 1\)"):
        masked_classification_loss(jnp.zeros((2, 3)), {"y": jnp.array([0, 1])}, label_smoothing=smoothing)


def test_a_bad_loss_setting_reaches_fit_as_one_line(cnn):
    model, _ = cnn
    loss = functools.partial(masked_classification_loss, label_smoothing=1.5)
    with pytest.raises(ValueError, match="label_smoothing must be"):
        jaxnn.fit(model, (X, np.arange(6)), loss=loss, steps=1, batch_size=2, progress=False)


@pytest.mark.parametrize("text", ["brightness=nan", "contrast=inf", "crop=nan", "mixup=-inf"])
def test_a_non_finite_augmentation_setting_is_refused_as_the_setting(text):
    with pytest.raises(ValueError, match=text.split("=")[0]):
        parse_augment(text)
    with pytest.raises(ValueError, match="brightness must be a number >= 0"):
        Augment(brightness=float("nan"))


@pytest.mark.slow
def test_one_callback_without_a_list_is_taken_and_a_non_list_named(cnn):
    model, _ = cnn

    class Count(Callback):
        steps = 0

        def on_step(self, run, step, metrics):
            Count.steps += 1

    jaxnn.fit(model, (X, np.arange(6)), steps=2, batch_size=2, progress=False, callbacks=Count())
    assert Count.steps == 2
    with pytest.raises(ConfigError, match="callbacks must be a list of jaxnn.callbacks.Callback, got int"):
        jaxnn.fit(model, (X, np.arange(6)), steps=1, batch_size=2, progress=False, callbacks=3)


@pytest.mark.parametrize(
    "child, message",
    [
        (L.LSTMCell(4), r"LSTMCell is a recurrent cell.*use RNN\(LSTMCell\(\.\.\.\)\)"),
        (L.Dense, r"Dense makes a Layer but is not one; call it: Dense\(\.\.\.\)"),
        (np.tanh, r"tanh is a plain function.*Lambda\(tanh\)"),
        (3, "a int is not a jaxnn Layer"),
    ],
)
def test_what_is_not_a_layer_is_named_when_the_model_is_built(child, message):
    with pytest.raises(TypeError, match=rf"^layer 1: {message}"):
        L.serial(L.Dense(3), child)


def test_rotary_attention_needs_an_even_head_width():
    with pytest.raises(ValueError, match="rotary embeddings need an even head_dim, got 5"):
        L.MultiHeadAttention(2, head_dim=5, rope=True)
    with pytest.raises(ValueError, match="head width .* must be even, got 5"):
        L.rotary_embedding(jnp.zeros((1, 2, 2, 5)), jnp.zeros((1, 2), jnp.int32))


def test_an_onednn_switch_that_cannot_take_effect_says_so_once(monkeypatch):
    from jaxnn.kernels.onednn import library

    monkeypatch.setenv(library.ENV_SWITCH, "1")
    monkeypatch.setattr(library, "_load", lambda: (None, "the kernels are not built (test)"))
    library._warn_switch_has_no_effect.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not library.enabled() and not library.enabled()
    assert [str(w.message) for w in caught] == ["JAXNN_ONEDNN=1 has no effect: the kernels are not built (test)"]
    library._warn_switch_has_no_effect.cache_clear()


def _idx(path, code, dims, data):
    header = bytes([0, 0, code, len(dims)]) + b"".join(d.to_bytes(4, "big") for d in dims)
    path.write_bytes(gzip.compress(header + data) if path.suffix == ".gz" else header + data)
    return path


def test_data_folders_that_hold_two_formats_images_or_half_a_data_set_are_one_line(tmp_path):
    both = tmp_path / "both"
    both.mkdir()
    _idx(both / "train-images-idx3-ubyte", 0x08, (1, 2, 2), bytes(4))
    (both / "data_batch_1.bin").write_bytes(bytes(3073))
    with pytest.raises(DataError, match="holds both MNIST-format IDX files and CIFAR-10 batches"):
        detect_format(both)
    pngs = tmp_path / "pngs" / "cat"
    pngs.mkdir(parents=True)
    (pngs / "a.png").write_bytes(b"\x89PNG")
    with pytest.raises(DataError, match=r"holds 1 image files \(\.png\), which jaxnn train does not read"):
        detect_format(tmp_path / "pngs")
    (pngs / "b.png").write_bytes(b"\x89PNG")
    (tmp_path / "pngs" / "labels.txt").write_text("cat\n")  # a labels file beside the images is not a corpus
    with pytest.raises(DataError, match=r"holds 2 image files \(\.png\) \(and 1 text file, e.g. labels.txt\)"):
        detect_format(tmp_path / "pngs")
    half = tmp_path / "half"
    half.mkdir()
    (half / "data_batch_1.bin").write_bytes(bytes(3073))
    with pytest.raises(DataError, match="no test_batch.bin"):
        load_cifar10(half)
    with pytest.raises(DataError, match=r"the size fits uint8: is the dtype code 0x0d \(float32\)"):
        read_idx(_idx(tmp_path / "x-idx1-ubyte", 0x0D, (4,), bytes(4)))


def test_the_command_line_names_a_class_count_below_the_labels_and_a_png_folder(capsys, tmp_path):
    argv = ["train", "--model", "cnn", "--model-config", "num_classes=5", "--steps", "1", "--run-dir"]
    assert cli.main([*argv, str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--model-config num_classes=5: the data set digits has 10 classes" in err and len(err.splitlines()) == 1
    (tmp_path / "pngs").mkdir()
    (tmp_path / "pngs" / "a.png").write_bytes(b"\x89PNG")
    assert cli.main(["train", "--data", str(tmp_path / "pngs"), "--run-dir", str(tmp_path / "r")]) == 2
    assert "holds 1 image files" in capsys.readouterr().err and not (tmp_path / "r").exists()


def test_a_named_dataset_is_read_from_a_folder_that_also_holds_another_format(tmp_path, capsys):
    both = tmp_path / "both"
    both.mkdir()
    _idx(both / "train-images-idx3-ubyte", 0x08, (1, 2, 2), bytes(4))
    (both / "data_batch_1.bin").write_bytes(bytes(3073))
    argv = ["train", "--data", str(both), "--dataset", "cifar10", "--steps", "1", "--run-dir", str(tmp_path / "r")]
    assert cli.main(argv) == 2  # a half CIFAR-10 set: refused for what it lacks, not for the IDX file beside it
    err = capsys.readouterr().err
    assert "no test_batch.bin" in err and "--dataset" not in err


def test_a_ctrl_c_outside_a_run_is_one_line_and_exit_130(capsys, monkeypatch):
    import importlib

    cli_main = importlib.import_module("jaxnn.cli.main")

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setitem(cli_main.COMMANDS, "summary", interrupted)
    assert cli.main(["summary", "--model", "cnn"]) == 130
    assert capsys.readouterr().err.strip() == "jaxnn: interrupted"


def test_predict_takes_a_list_of_examples_and_refuses_no_data_or_a_bad_batch_size(cnn):
    model, params = cnn
    examples = [np.zeros((8, 8, 1), np.float32)] * 3
    assert jaxnn.predict(model, params, examples).shape == (3, 10)
    with pytest.raises(DataError, match="predict: the data hold no examples"):
        jaxnn.predict(model, params, iter([]))
    for size in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="batch_size must be a positive integer"):
            jaxnn.predict(model, params, X, batch_size=size)
        with pytest.raises(ValueError, match="batch_size must be a positive integer"):
            jaxnn.evaluate(model, params, (X, np.arange(6)), batch_size=size)


def test_float_class_labels_are_named_and_a_users_regression_loss_is_left_alone(cnn):
    model, params = cnn
    with pytest.raises(DataError, match="labels 'y' are float64.*integer classes"):
        jaxnn.evaluate(model, params, (X, np.arange(6) * 1.0))
    regression = L.serial(L.Flatten(), L.Dense(1))
    _, weights = regression.init(jax.random.key(0), (1, 4))

    def mse(out, batch):
        return jnp.mean((out[:, 0] - batch["y"]) ** 2), {}

    got = jaxnn.evaluate(regression, weights, (np.ones((3, 4), np.float32), np.array([5, 6, 7])), loss=mse)
    assert np.isfinite(got["loss"])


def test_an_onednn_switch_value_that_is_neither_on_nor_off_is_said_and_ignored(monkeypatch):
    from jaxnn.kernels.onednn import choice, library

    monkeypatch.setenv(library.ENV_SWITCH, "maybe")
    monkeypatch.setattr(choice, "default_choices", lambda *_: dict.fromkeys(choice.KINDS, True))
    library._warn_unknown_switch.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert library.enabled() == library.available()  # this CPU's measured default, here "take every kernel"
    assert "JAXNN_ONEDNN='maybe' is not 1 or 0" in str(caught[0].message)


@pytest.mark.slow
def test_mixup_with_a_loss_that_never_reads_the_mixed_targets_is_refused():
    pytest.importorskip("dm_pix")
    images = np.random.default_rng(0).uniform(size=(8, 8, 8, 1)).astype(np.float32)

    def plain(logits, batch):  # reads the integer labels only
        labels = jax.nn.one_hot(batch["y"], logits.shape[-1])
        return -(labels * jax.nn.log_softmax(logits)).sum(-1).mean(), {}

    with pytest.raises(ConfigError, match=r"the loss plain never reads batch\['y_soft'\]"):
        jaxnn.fit(CNN(), (images, np.arange(8) % 10), loss=plain, augment="mixup", steps=1, batch_size=4,
                  progress=False)  # fmt: skip
    result = jaxnn.fit(CNN(), (images, np.arange(8) % 10), augment="mixup", steps=1, batch_size=4, progress=False)
    assert result.summary["step"] == 1


@pytest.mark.slow
def test_a_fit_that_leaves_devices_idle_says_so_once_at_the_users_line(cnn):
    from jaxnn.loop import _run

    model, _ = cnn
    _run._say_unused_devices.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            jaxnn.fit(model, (X, np.arange(6)), steps=1, batch_size=2, progress=False)
        many = np.zeros((8, 8, 8, 1), np.float32)
        jaxnn.fit(model, (many, np.arange(8)), steps=1, batch_size=8, devices=8, progress=False)
    said = [w for w in caught if issubclass(w.category, _run.UnusedDevicesWarning)]
    assert len(said) == 1 and "fit trains on 1 of the 8 cpu devices present" in str(said[0].message)
    assert said[0].filename == __file__
