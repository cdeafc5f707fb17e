"""Data sets as in-memory numpy arrays: the containers every loader returns (`ImageDataset`, `TextCorpus`), their
checks, and a synthetic generator. The loaders of files (digits, IDX, CIFAR-10, text) are in
`jaxnn.data.loaders`."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, TypeAlias

import numpy as np

from jaxnn._src.checks import check_seed
from jaxnn.errors import DataError  # noqa: F401 (also importable from here)

StrPath: TypeAlias = str | os.PathLike[str]

IMAGE_FORMATS = ("digits", "mnist", "fashion_mnist", "cifar10", "synthetic")
FORMATS = IMAGE_FORMATS + ("text",)


@dataclasses.dataclass(frozen=True, eq=False)
class ImageDataset:
    """Channels-last images `x_*` (N, H, W, C) in their stored dtype, integer labels `y_*` (N,).

    `scale` maps stored values to [0, 1] (255 for bytes, 16 for the digits); `mean` and `std` are per-channel
    statistics of the scaled training images, used by the pipeline's normalisation.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    scale: float
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @property
    def image_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


@dataclasses.dataclass(frozen=True, eq=False)
class TextCorpus:
    """A text corpus: `train` and `test` are 1-D arrays of ids (the test part is the corpus's tail): uint8 bytes
    (vocabulary 256) as read, int32 token ids after `tokenize_corpus`."""

    name: str
    train: np.ndarray
    test: np.ndarray
    num_files: int
    vocab_size: int = 256
    # Per-token weights as prediction targets (1: its prediction counts in the loss), aligned with train and
    # test; None: every token counts. Prompt/completion records weigh only the completions (jaxnn.data.records).
    train_targets: np.ndarray | None = None
    test_targets: np.ndarray | None = None
    # Where each document starts in train and test (records: one document each); None for a plain stream.
    # Packing (jaxnn.data.packing) needs them.
    train_starts: np.ndarray | None = None
    test_starts: np.ndarray | None = None


def make_image_dataset(
    name: str,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    *,
    num_classes: int | None = None,
    scale: float = 1.0,
) -> ImageDataset:
    """Checks shapes and labels, adds a channel axis to (N, H, W) images, and computes channel statistics."""
    x_train, x_test = (x if x.ndim == 4 else x[..., None] for x in (x_train, x_test))
    for split, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
        if len(x) != len(y):
            raise DataError(f"{name}: {split} split has {len(x)} images but {len(y)} labels")
        if len(x) == 0:
            raise DataError(f"{name}: {split} split is empty")
    if x_train.shape[1:] != x_test.shape[1:]:
        raise DataError(f"{name}: train images are {x_train.shape[1:]} but test images are {x_test.shape[1:]}")
    y_train, y_test = y_train.astype(np.int32), y_test.astype(np.int32)
    num_classes = int(num_classes or max(y_train.max(), y_test.max()) + 1)
    for split, y in (("train", y_train), ("test", y_test)):
        if y.min() < 0 or y.max() >= num_classes:
            raise DataError(f"{name}: {split} labels must lie in [0, {num_classes}), found [{y.min()}, {y.max()}]")
    # Statistics from (at most) 10,000 training images: exact enough for normalisation, and fast for 60,000.
    sample = x_train[:10000].astype(np.float64) / scale
    mean = tuple(float(m) for m in sample.mean(axis=(0, 1, 2)))
    std = tuple(float(max(s, 1e-6)) for s in sample.std(axis=(0, 1, 2)))
    return ImageDataset(name, x_train, y_train, x_test, y_test, num_classes, float(scale), mean, std)


def split_dataset(
    name: str, x: np.ndarray, y: np.ndarray, *, test_fraction: float = 0.2, seed: int = 0, **kwargs: Any
) -> ImageDataset:
    """A fixed, seeded train/test split of one labelled array (for sets that ship without one)."""
    check_seed("split_dataset", seed)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = max(1, int(round(len(x) * test_fraction)))
    train, test = order[:-n_test], order[-n_test:]
    return make_image_dataset(name, x[train], y[train], x[test], y[test], **kwargs)


# --- synthetic --------------------------------------------------------------------------------------------------


def synthetic(
    shape: tuple[int, ...] = (8, 8, 1),
    *,
    num_classes: int = 10,
    n_train: int = 2048,
    n_test: int = 512,
    noise: float = 1.0,
    seed: int = 0,
) -> ImageDataset:
    """Float images of any channels-last `shape`: a random prototype per class plus Gaussian noise (learnable)."""
    check_seed("synthetic", seed)
    rng = np.random.default_rng(seed)
    prototypes = rng.normal(size=(num_classes, *shape)).astype(np.float32)
    y = rng.integers(0, num_classes, n_train + n_test)
    x = prototypes[y] + noise * rng.normal(size=(len(y), *shape)).astype(np.float32)
    return make_image_dataset("synthetic", x[:n_train], y[:n_train], x[n_train:], y[n_train:], num_classes=num_classes)
