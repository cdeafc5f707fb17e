"""On-device augmentation (jaxnn.augment): each operation against a reference image under jit and vmap, mixed
labels that sum to one and match the pixels, keys that follow the global row, and an augmented run that resumes
bitwise. Tiny images, a few steps."""

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxnn
from jaxnn import layers as L
from jaxnn._src.storage import RunDirError
from jaxnn.augment import Augment, augment_batch, parse_augment
from jaxnn.augment import normalise as device_normalise
from jaxnn.callbacks import Callback
from jaxnn.config import ConfigError
from jaxnn.data.preprocess import normalise as host_normalise
from jaxnn.parallel import make_mesh
from jaxnn.train import masked_classification_loss

pytest.importorskip("dm_pix")

H = W = 8
N = 2000  # images per distribution check: each of 25 crop offsets expects 80


def _coded(n):
    """n copies of an image whose pixel (r, c) holds 1 + r * W + c in every channel: 0 marks padding."""
    img = 1.0 + np.arange(H * W, dtype=np.float32).reshape(H, W, 1) * np.ones(3, np.float32)
    return np.broadcast_to(img, (n, H, W, 3)).copy()


def _augmented(aug, x, y=None, step=3, offset=0):
    batch = {"x": jnp.asarray(x), **({"y": jnp.asarray(y)} if y is not None else {})}
    return jax.jit(functools.partial(augment_batch, aug), static_argnums=())(batch, jax.random.key(7), step, offset)


def test_flip_mirrors_and_crop_takes_a_uniform_window_of_the_padded_image():
    x = _coded(N)
    flipped = np.asarray(_augmented(Augment(flip=True), x)["x"])
    is_flip = np.all(flipped == x[:, :, ::-1], axis=(1, 2, 3))
    assert np.all(is_flip | np.all(flipped == x, axis=(1, 2, 3)))  # each image is itself or its mirror
    assert 0.45 < is_flip.mean() < 0.55
    up_down = np.asarray(_augmented(Augment(vflip=True), x[:200])["x"])
    assert np.all(np.all(up_down == x[:200, ::-1], axis=(1, 2, 3)) | np.all(up_down == x[:200], axis=(1, 2, 3)))

    pad = 2
    cropped = np.asarray(_augmented(Augment(crop_pad=pad), x)["x"])
    centre = cropped[:, H // 2, W // 2, 0].astype(int) - 1  # always inside the image: gives the offset
    dy, dx = centre // W - H // 2 + pad, centre % W - W // 2 + pad
    padded = np.pad(x[0], ((pad, pad), (pad, pad), (0, 0)))
    for i in range(50):  # the reference: the padded image's window at that offset, exactly
        np.testing.assert_array_equal(cropped[i], padded[dy[i] : dy[i] + H, dx[i] : dx[i] + W])
    counts = np.bincount(dy * (2 * pad + 1) + dx, minlength=(2 * pad + 1) ** 2)
    expected = N / (2 * pad + 1) ** 2
    assert ((counts - expected) ** 2 / expected).sum() < 52.6  # chi-square, 24 degrees of freedom, p = 0.001


def test_device_normalise_equals_the_hosts_on_raw_uint8_images():
    x = np.random.default_rng(3).integers(0, 256, (4, 5, 5, 3), dtype=np.uint8)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    want = host_normalise(x, 255.0, np.asarray(mean), np.asarray(std))
    got = jax.jit(lambda x: device_normalise(x, 255.0, mean, std))(x)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)


def test_colour_jitter_matches_dm_pix_per_example_and_stays_in_its_range():
    import dm_pix as pix

    x = np.random.default_rng(0).uniform(size=(64, H, W, 3)).astype(np.float32)
    out = np.asarray(_augmented(Augment(brightness=0.2), x)["x"])
    delta = (out - x).mean(axis=(1, 2, 3))
    np.testing.assert_allclose(out - x, np.broadcast_to(delta[:, None, None, None], x.shape), atol=1e-6)
    assert np.all(np.abs(delta) <= 0.2) and delta.std() > 0.05  # one delta per example, spread over [-0.2, 0.2)
    out = np.asarray(_augmented(Augment(contrast=0.5), x)["x"])
    mean = x.mean(axis=(1, 2), keepdims=True)
    factor = ((out - mean) / (x - mean)).mean(axis=(1, 2, 3))
    np.testing.assert_allclose(out, pix.adjust_contrast(x, factor[:, None, None, None]), atol=1e-5)
    assert np.all((factor >= 0.5 - 1e-4) & (factor <= 1.5 + 1e-4))
    gray = np.repeat(x[..., :1], 3, axis=-1)  # no saturation to scale: unchanged
    np.testing.assert_allclose(_augmented(Augment(saturation=0.5), gray)["x"], gray, atol=1e-5)


@pytest.mark.slow
def test_mixup_and_cutmix_labels_sum_to_one_and_match_the_pixels():
    B, classes = 64, 5
    y = np.arange(B) % classes
    # Even rows 0, odd rows 1: each pair's mix is readable from the pixels.
    x = np.broadcast_to((np.arange(B) % 2).astype(np.float32)[:, None, None, None], (B, H, W, 3)).copy()
    for aug in (Augment(mixup=0.4, num_classes=classes), Augment(cutmix=1.0, num_classes=classes)):
        out = _augmented(aug, x, y)
        soft, pixels = np.asarray(out["y_soft"]), np.asarray(out["x"])
        np.testing.assert_allclose(soft.sum(axis=1), 1.0, rtol=1e-6)
        partner = np.arange(B) ^ 1
        own = soft[np.arange(B), y]
        # The share of the row's own image in its pixels is the weight of its own label (own pixels: 0 even, 1 odd).
        share_of_ones = pixels.mean(axis=(1, 2, 3))
        own_pixels = np.where(np.arange(B) % 2 == 0, 1 - share_of_ones, share_of_ones)
        np.testing.assert_allclose(own, own_pixels, atol=1e-5)
        np.testing.assert_allclose(soft[np.arange(B), y[partner]], 1 - own, atol=1e-5)
        assert own.std() > 0.05  # a lambda per example
    both = _augmented(Augment(mixup=0.4, cutmix=1.0, num_classes=classes), x, y)
    np.testing.assert_allclose(np.asarray(both["y_soft"]).sum(axis=1), 1.0, rtol=1e-6)


@pytest.mark.slow
def test_an_example_is_augmented_by_its_global_row_on_any_number_of_devices():
    aug = Augment(crop_pad=2, flip=True, brightness=0.1, mixup=0.3, num_classes=4)
    x = np.random.default_rng(1).uniform(size=(16, H, W, 3)).astype(np.float32)
    y = np.arange(16) % 4
    whole = _augmented(aug, x, y)
    mesh = make_mesh(8)

    def local(batch):
        rows = batch["x"].shape[0]
        return augment_batch(aug, batch, jax.random.key(7), 3, jax.lax.axis_index("data") * rows)

    sharded = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("data"),), out_specs=P("data")))(
        {"x": jnp.asarray(x), "y": jnp.asarray(y)}
    )
    for k in ("x", "y_soft"):
        np.testing.assert_array_equal(np.asarray(sharded[k]), np.asarray(whole[k]))
    other_step = _augmented(aug, x, y, step=4)
    assert not np.array_equal(np.asarray(other_step["x"]), np.asarray(whole["x"]))


def test_soft_targets_train_the_loss_and_integer_labels_keep_their_loss():
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(6, 4)), jnp.float32)
    y = jnp.asarray([0, 1, 2, 3, 0, 1])
    mask = jnp.asarray([1, 1, 1, 1, 0, 0], jnp.float32)
    plain, plain_m = masked_classification_loss(logits, {"y": y, "mask": mask})
    soft, soft_m = masked_classification_loss(logits, {"y": y, "mask": mask, "y_soft": jax.nn.one_hot(y, 4)})
    np.testing.assert_allclose(soft, plain, rtol=1e-6)
    assert soft_m["accuracy"] == plain_m["accuracy"]
    half = 0.5 * jax.nn.one_hot(y, 4) + 0.5 * jax.nn.one_hot((y + 1) % 4, 4)
    mixed, _ = masked_classification_loss(logits, {"y": y, "y_soft": half})
    want = -(half * jax.nn.log_softmax(logits)).sum(axis=1).mean()
    np.testing.assert_allclose(mixed, want, rtol=1e-6)


def test_parse_augment_reads_the_command_line_and_names_a_bad_part():
    want = Augment(crop_pad="auto", flip=True, brightness=0.1, mixup=0.2)
    assert parse_augment("crop,flip,brightness=0.1,mixup") == want
    assert parse_augment("crop=2") == Augment(crop_pad=2)


def test_a_bare_crop_pads_an_eighth_of_the_image():
    from jaxnn.augment import crop_pad_for

    assert [crop_pad_for("auto", h) for h in (8, 28, 32, 224)] == [1, 4, 4, 28]
    assert crop_pad_for(3, 224) == 3
    x = np.random.default_rng(0).uniform(0.1, 1, size=(32, 8, 8, 1)).astype(np.float32)
    cropped = np.asarray(_augmented(Augment(crop_pad="auto"), jnp.asarray(x))["x"])
    padded = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    # Padded by one pixel on the 8x8 digits: each crop is its image shifted by at most one pixel, never more.
    for image, out in zip(padded, cropped, strict=True):
        assert any(np.array_equal(out, image[dy : dy + 8, dx : dx + 8]) for dy in range(3) for dx in range(3))
    with pytest.raises(ValueError, match="crop_pad must be a non-negative integer or 'auto'"):
        Augment(crop_pad="big")
    for text, culprit in (("crop,spin", "unknown 'spin'"), ("flip=1", "flip takes no value"), ("mixup=a", "mixup")):
        with pytest.raises(ValueError, match=culprit):
            parse_augment(text)
    with pytest.raises(ValueError, match="contrast must be a number >= 0 at most 1"):
        Augment(contrast=2.0)


def _images():
    rng = np.random.default_rng(3)
    x = rng.uniform(size=(48, H, W, 3)).astype(np.float32)
    return x, (x[:, :4].mean(axis=(1, 2, 3)) > x[:, 4:].mean(axis=(1, 2, 3))).astype(np.int32)


def _cnn():
    return L.serial(L.Conv(4, (3, 3)), L.Relu, L.Flatten(), L.Dense(2))


@pytest.mark.slow
def test_augmented_training_resumes_bitwise_and_evaluates_unaugmented(tmp_path):
    data = _images()
    aug = Augment(crop_pad=1, flip=True, mixup=0.4)
    run = {"optimizer": optax.adam(1e-2), "steps": 6, "batch_size": 16, "log_every": 3, "ckpt_every": 3}
    run |= {"progress": False, "plots": False, "augment": aug, "eval_data": data}
    straight = jaxnn.fit(_cnn(), data, run_dir=str(tmp_path / "straight"), **run)

    class StopAt(Callback):
        def on_step(self, run, step, metrics):
            if step == 3:
                run.request_stop("test")

    jaxnn.fit(_cnn(), data, run_dir=str(tmp_path / "part"), callbacks=[StopAt()], **run)
    resumed = jaxnn.fit(_cnn(), data, run_dir=str(tmp_path / "part"), resume=True, **run)
    assert resumed.summary["resumed_from"] == 3
    assert resumed.summary["param_digest"] == straight.summary["param_digest"]
    # Evaluation runs the model on the data as given: the same metrics as evaluating the final state directly.
    direct = jaxnn.evaluate(_cnn(), straight.state, data, batch_size=16)
    assert straight.summary["eval_loss"] == pytest.approx(direct["loss"], rel=1e-5)
    with pytest.raises(RunDirError, match="different config .augment: saved"):  # other augmentation, another run
        jaxnn.fit(_cnn(), data, run_dir=str(tmp_path / "part"), resume=True, **{**run, "augment": "flip"})
    with pytest.raises(ConfigError, match="fit: augment: unknown 'spin'"):
        jaxnn.fit(_cnn(), data, **{**run, "augment": "spin"})


@pytest.mark.slow
def test_the_placement_snippet_in_docs_data_md_runs():
    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "data.md").read_text()
    section = text[text.index("## Augmentation: which work goes where") :]
    snippet = section[section.index("```python\n") + 10 : section.index("```\n", section.index("```python"))]
    exec(compile(snippet, "docs/data.md", "exec"), {})


def test_without_dm_pix_the_step_augmentation_says_what_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "dm_pix", None)  # as on the GPU machine, which cannot install it
    want = r"^on-device augmentation \(jaxnn.augment\) needs dm_pix: pip install 'jaxnn\[augment\]'$"
    with pytest.raises(ImportError, match=want):
        augment_batch(Augment(flip=True), {"x": jnp.zeros((2, H, W, 3))}, jax.random.key(0), 0)
    with pytest.raises(ImportError, match=want):  # fit: before anything is compiled or written
        jaxnn.fit(_cnn(), _images(), augment="flip", steps=1, batch_size=16, progress=False, plots=False)
