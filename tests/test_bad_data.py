"""Bad data given to `jaxnn.fit`: NaN/Inf in float arrays (train or evaluation) is refused at setup with one line
naming the array and its first bad index, before anything is written; an fp16 run that skips most of its steps
stops with an error instead of finishing as if it had trained."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxnn
from jaxnn import layers as L
from jaxnn.callbacks import NonFiniteError, SkippedStepsError
from jaxnn.config import ConfigError
from jaxnn.data import DataError
from jaxnn.data.datasets import make_image_dataset

QUIET = {"steps": 2, "batch_size": 8, "progress": False, "plots": False}


@pytest.fixture(scope="module")
def clean():
    rng = np.random.default_rng(0)
    return rng.normal(size=(32, 4)).astype(np.float32), rng.integers(0, 3, 32).astype(np.int32)


def snapshot(root):
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def poisoned(x, index, value, dtype=np.float32):
    bad = x.astype(dtype)
    bad[index] = value
    return bad


@pytest.mark.parametrize(
    "value, dtype, shown",
    [(np.nan, np.float32, "nan"), (np.inf, np.float32, "inf"), (-np.inf, np.float16, "-inf")],
)
def test_non_finite_training_arrays_are_refused_naming_array_and_index(tmp_path, clean, value, dtype, shown):
    x, y = clean
    (tmp_path / "keep.txt").write_text("earlier work")
    before = snapshot(tmp_path)
    bad = poisoned(x, (5, 2), value, dtype)
    for data in ((bad, y), {"x": bad, "y": y}):
        with pytest.raises(DataError, match=rf"^data: array 'x' holds {shown} at index \(5, 2\); inputs must be"):
            jaxnn.fit(L.Dense(3), data, run_dir=str(tmp_path / "run"), **QUIET)
    assert snapshot(tmp_path) == before


def test_non_finite_evaluation_data_is_refused_not_reported_as_a_nan_metric(tmp_path, clean):
    x, y = clean
    before = snapshot(tmp_path)
    bad = poisoned(x, (30, 0), np.nan)
    with pytest.raises(DataError, match=r"^eval_data: array 'x' holds nan at index \(30, 0\)"):
        jaxnn.fit(L.Dense(3), (x, y), eval_data=(bad, y), run_dir=str(tmp_path / "run"), **QUIET)
    batches = [{"x": x[:8], "y": y[:8]}, {"x": bad[24:], "y": y[24:]}]
    with pytest.raises(DataError, match=r"^eval_data: batch 1: array 'x' holds nan at index \(6, 0\)"):
        jaxnn.fit(L.Dense(3), (x, y), eval_data=batches, run_dir=str(tmp_path / "run"), **QUIET)
    assert snapshot(tmp_path) == before


def test_non_finite_images_of_a_data_set_are_refused_for_training_and_evaluation():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 4, 4, 1)).astype(np.float32), np.arange(40) % 4
    model = L.serial(L.Flatten(), L.Dense(4))
    bad = make_image_dataset("mine", poisoned(x[:32], (3, 1, 2, 0), np.nan), y[:32], x[32:], y[32:])
    with pytest.raises(DataError, match=r"^data \(mine\): array 'x_train' holds nan at index \(3, 1, 2, 0\)"):
        jaxnn.fit(model, bad, **QUIET)
    good = make_image_dataset("mine", x[:32], y[:32], poisoned(x[32:], (7, 0, 0, 0), -np.inf), y[32:])
    with pytest.raises(DataError, match=r"^eval_data \(mine\): array 'x_test' holds -inf at index \(7, 0, 0, 0\)"):
        jaxnn.fit(model, good, eval_data=good, **QUIET)


def test_check_data_all_checks_each_streamed_batch_and_other_values_are_refused(clean):
    x, y = clean
    stream = [{"x": x[:8], "y": y[:8]}, {"x": poisoned(x[8:16], (3, 1), np.inf), "y": y[8:16]}]
    with pytest.raises(DataError, match=r"^data: training batch 1: array 'x' holds inf at index \(3, 1\)"):
        jaxnn.fit(L.Dense(3), stream, check_data="all", **QUIET)
    with pytest.raises(ConfigError, match=r"^fit: check_data must be one of \['arrays', 'all', 'off'\], got 'yes'"):
        jaxnn.fit(L.Dense(3), (x, y), check_data="yes", **QUIET)


def overflowing_loss(logits, batch):
    # The cotangent of the fp16 logits is 1e6 per element: infinite in fp16 at any loss scale >= 1.
    return jnp.sum(logits.astype(jnp.float32)) * 1e6, {}


@pytest.mark.filterwarnings("ignore:precision fp16 on a CPU")  # the loss scale is the subject here
def test_fp16_run_whose_loss_scale_collapses_stops_with_an_error(clean):
    x, y = clean
    settings = {**QUIET, "steps": 20, "log_every": 20}
    with pytest.raises(SkippedStepsError, match=r"^20 of the last 20 steps \(up to step 20\) were skipped") as err:
        jaxnn.fit(L.Dense(3), (x, y), loss=overflowing_loss, precision="fp16", **settings)
    assert isinstance(err.value, NonFiniteError)  # what `jaxnn train` maps to exit status 1
    assert "max_skipped_fraction 0.5" in str(err.value) and "loss scale 1" in str(err.value)


def _records(folder, pairs):
    import json

    folder.mkdir(exist_ok=True)
    (folder / "qa.jsonl").write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in pairs))
    return folder


def test_records_whose_completions_count_for_nothing_are_refused_before_training(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from jaxnn.data.records import load_text_records

    words = {"[UNK]": 0, "a": 1, "b": 2}  # no end-of-text token
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    folder = _records(tmp_path / "data", [("a b", "")] * 4)
    with pytest.raises(DataError, match="no token of the training records counts in the loss") as err:
        load_text_records(folder, tok)
    assert "\n" not in str(err.value)


def test_a_folder_mixing_records_and_plain_text_is_refused_naming_both(tmp_path):
    from jaxnn.data.records import load_text_records

    folder = _records(tmp_path / "data", [("q", "a")] * 4)
    (folder / "notes.txt").write_text("plain text the records loader would leave out")
    with pytest.raises(DataError, match=r"records \(qa.jsonl\) and plain text \(notes.txt\)"):
        load_text_records(folder)
