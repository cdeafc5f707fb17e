"""Host pipeline and device prefetch: batches are pure functions of their index, epochs cover the data once,
augmentation does what it says, Grain and inline agree, and prefetch keeps order, sharding and wait time."""

import time

import jax
import numpy as np
import pytest

from jaxnn.data import (
    DevicePrefetch,
    PipelineConfig,
    TrainBatches,
    eval_batches,
    host_iterator,
    iterator_state,
    steps_per_epoch,
)
from jaxnn.data.datasets import TextCorpus, make_image_dataset
from jaxnn.data.preprocess import normalise, random_crop, random_flip, text_windows
from jaxnn.parallel import batch_sharding, make_mesh


@pytest.fixture(scope="module")
def data():
    # Labels equal to the example index make coverage checks exact: 50 examples, 10 classes cycled.
    rng = np.random.default_rng(3)
    x = rng.integers(0, 256, (60, 6, 6, 3)).astype(np.uint8)
    y = np.arange(60) % 10
    return make_image_dataset("toy", x[:50], y[:50], x[50:], y[50:], num_classes=10, scale=255.0)


def find_rows(batch_x, data):
    """Index of each batch row in the normalised training set."""
    ref = normalise(data.x_train, data.scale, data.mean, data.std).reshape(len(data.x_train), -1)
    flat = batch_x.reshape(len(batch_x), -1)
    return [int(np.flatnonzero((ref == row).all(axis=1))[0]) for row in flat]


def test_epoch_covers_every_example_once(data):
    cfg = PipelineConfig(batch_size=8, seed=5)
    src = TrainBatches(data, cfg)
    assert src.steps_per_epoch == 6 == steps_per_epoch(50, 8, "drop")
    seen = [i for s in range(6) for i in find_rows(src[s]["x"], data)]
    assert len(set(seen)) == 48  # the ragged 2 of this epoch are dropped
    second = [i for s in range(6, 12) for i in find_rows(src[s]["x"], data)]
    assert second != seen  # reshuffled per epoch


def test_pad_mode_masks_the_ragged_batch(data):
    src = TrainBatches(data, PipelineConfig(batch_size=8, ragged="pad"))
    assert src.steps_per_epoch == 7
    masks = np.stack([src[s]["mask"] for s in range(7)])
    assert masks[:6].all() and masks[6].sum() == 2
    real = [i for s in range(7) for i, m in zip(find_rows(src[s]["x"], data), src[s]["mask"]) if m]
    assert sorted(real) == list(range(50))


def test_batches_are_pure_functions_of_index(data):
    cfg = PipelineConfig(batch_size=8, seed=1, crop_pad=2, flip=True)
    a, b = TrainBatches(data, cfg), TrainBatches(data, cfg)
    for s in (0, 7, 3):
        for k in ("x", "y", "mask"):
            np.testing.assert_array_equal(a[s][k], b[s][k])
    assert not np.array_equal(a[0]["x"], TrainBatches(data, PipelineConfig(batch_size=8, seed=2))[0]["x"])
    offset = TrainBatches(data, cfg, start=5, stop=9)
    assert len(offset) == 4
    np.testing.assert_array_equal(offset[0]["x"], a[5]["x"])


@pytest.mark.parametrize("workers", [0, pytest.param(1, marks=pytest.mark.system)])  # 1: a Grain worker process
def test_grain_matches_inline(data, workers):
    cfg = PipelineConfig(batch_size=8, seed=4, crop_pad=1, flip=True, workers=workers)
    src = TrainBatches(data, cfg, start=3, stop=13)
    grain_batches = list(host_iterator(src, cfg))
    inline = list(host_iterator(src, PipelineConfig(batch_size=8, seed=4, crop_pad=1, flip=True, backend="inline")))
    assert len(grain_batches) == len(inline) == 10
    for g, i in zip(grain_batches, inline):
        np.testing.assert_array_equal(g["x"], i["x"])
        np.testing.assert_array_equal(g["y"], i["y"])


def test_random_crop_and_flip():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 5, 7, 2)).astype(np.float32)
    crop = random_crop(x, np.random.default_rng(1), 2)
    dy, dx = np.random.default_rng(1).integers(0, 5, size=(2, 16))
    padded = np.pad(x, ((0, 0), (2, 2), (2, 2), (0, 0)))
    for b in range(16):
        np.testing.assert_array_equal(crop[b], padded[b, dy[b] : dy[b] + 5, dx[b] : dx[b] + 7])
    assert random_crop(x, rng, 0) is x
    flipped = random_flip(x, np.random.default_rng(2))
    which = np.random.default_rng(2).random(16) < 0.5
    assert 0 < which.sum() < 16
    np.testing.assert_array_equal(flipped[which], x[which][:, :, ::-1])
    np.testing.assert_array_equal(flipped[~which], x[~which])


def test_normalise_statistics(data):
    x = normalise(data.x_train, data.scale, data.mean, data.std)
    assert x.dtype == np.float32
    np.testing.assert_allclose(x.mean(axis=(0, 1, 2)), 0.0, atol=1e-5)
    np.testing.assert_allclose(x.std(axis=(0, 1, 2)), 1.0, atol=1e-4)


def test_text_windows_and_batches():
    rng = np.random.default_rng(0)
    corpus = rng.integers(0, 256, 5000).astype(np.uint8)
    x, y = text_windows(corpus, np.random.default_rng(1), 4, 16)
    assert x.shape == y.shape == (4, 16) and x.dtype == np.int32
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    text = TextCorpus("t", corpus[:4000], corpus[4000:], 1)
    src = TrainBatches(text, PipelineConfig(batch_size=4, seq_len=16, seed=2))
    np.testing.assert_array_equal(src[3]["x"], src[3]["x"])
    assert not np.array_equal(src[3]["x"], src[4]["x"])
    evals = eval_batches(text, 4, seq_len=16)
    assert len(evals) == 4 and all(b["x"].max() < 256 for b in evals)
    with pytest.raises(ValueError, match="too short"):
        text_windows(corpus[:10], rng, 2, 16)


def test_eval_batches_count_each_test_example_once(data):
    batches = eval_batches(data, 4)
    assert len(batches) == 3 and sum(b["mask"].sum() for b in batches) == 10
    labels = np.concatenate([b["y"][b["mask"] > 0] for b in batches])
    np.testing.assert_array_equal(labels, data.y_test)


def test_iterator_state(data):
    src = TrainBatches(data, PipelineConfig(batch_size=8, seed=9))
    state = iterator_state(17, src)
    assert state == {"next_step": 17, "dataset": "toy", "num_train": 50, "batch_size": 8, "seed": 9, "ragged": "drop"}


@pytest.mark.parametrize("size", [0, 1, 2])
def test_prefetch_keeps_order_and_sharding(size):
    mesh = make_mesh(4)
    sharding = batch_sharding(mesh)
    rng = np.random.default_rng(size)
    host = [{"x": rng.normal(size=(8, 3)).astype(np.float32)} for _ in range(5)]
    out = list(DevicePrefetch(iter(host), sharding, size))
    assert len(out) == 5
    for h, d in zip(host, out):
        assert d["x"].sharding == sharding
        np.testing.assert_array_equal(np.asarray(d["x"]), h["x"])


def test_prefetch_measures_input_wait():
    def slow():
        for i in range(5):
            time.sleep(0.05)
            yield {"x": np.full((2,), i, np.float32)}

    pre = DevicePrefetch(slow(), None, size=0)
    next(pre)
    assert pre.take_wait() >= 0.045
    assert pre.take_wait() == 0.0
    ahead = DevicePrefetch(slow(), None, size=2)
    next(ahead)  # fills the pipeline: waits for three host batches
    assert ahead.take_wait() >= 0.14
    assert float(next(ahead)["x"][0]) == 1.0  # already on the device; the call only tops the queue up again
    assert 0.045 <= ahead.take_wait() < 0.1
    with pytest.raises(ValueError, match="size must be >= 0"):
        DevicePrefetch(iter([]), None, -1)
    assert isinstance(jax.devices()[0], jax.Device)
