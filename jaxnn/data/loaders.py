"""Loaders of local data sets into `jaxnn.data.datasets`' containers: the bundled digits, MNIST/Fashion-MNIST IDX,
CIFAR-10 binary, a byte-level text corpus (the Python standard library's own source by default), and the choice
among them by format name or by what a folder holds.

Every loader reads local files only (no downloads) and never unpickles anything. A missing directory, a truncated
file, a wrong magic number or mismatched image/label counts raise one `DataError` naming the file and what was
expected; no record is silently dropped.
"""

from __future__ import annotations

import gzip
import logging
import pathlib
import sysconfig
import zlib
from typing import Any

import numpy as np

from jaxnn.data.datasets import (
    FORMATS,
    ImageDataset,
    StrPath,
    TextCorpus,
    make_image_dataset,
    split_dataset,
    synthetic,
)
from jaxnn.errors import DataError

log = logging.getLogger(__name__)

# The IDX dtype codes (third magic byte) this loader understands, mapped to big-endian numpy dtypes.
_IDX_DTYPES: dict[int, np.dtype[Any]] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
CIFAR_RECORD = 1 + 3 * 32 * 32  # one label byte, then the red, green and blue 32x32 planes


def load_digits() -> ImageDataset:
    """scikit-learn's 1,797 bundled 8x8 handwritten digits (values 0..16), split 80/20 with a fixed seed."""
    found = _digits_from_csv()
    if found is None:
        from jaxnn._src.optional import require

        try:
            bunch = require("sklearn.datasets", "the bundled digits data set").load_digits()
        except ImportError as err:
            raise DataError(str(err)) from None
        found = bunch.images, bunch.target
    images, target = found
    x = images.astype(np.uint8).reshape(-1, 8, 8, 1)
    return split_dataset("digits", x, target, num_classes=10, scale=16.0)


def _digits_from_csv() -> tuple[np.ndarray, np.ndarray] | None:
    """The digits read straight from the CSV file scikit-learn ships, as its `load_digits` reads it: importing
    scikit-learn took 1.1 s of a 5 s warm `make train` (docs/performance.md). None if the file is absent."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():
        return None
    data = np.loadtxt(path, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)


# --- IDX (MNIST, Fashion-MNIST) -------------------------------------------------------------------------------


def _read_bytes(path: pathlib.Path) -> bytes:
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    if path.suffix != ".gz":
        return path.read_bytes()
    try:
        with gzip.open(path, "rb") as f:
            return f.read()
    except (EOFError, OSError, zlib.error) as err:
        raise DataError(f"{path}: not a complete gzip file ({err})") from None


def read_idx(path: StrPath, *, expected_ndim: int | None = None) -> np.ndarray:
    """Reads one IDX file (gzipped or raw): magic `00 00 <dtype> <ndim>`, big-endian int32 dims, then the data."""
    path = pathlib.Path(path)
    raw = _read_bytes(path)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise DataError(
            f"{path}: bad IDX magic number {raw[:4].hex() or '(empty file)'}; expected 0000<dtype><ndim>"
            f" with dtype in {sorted(hex(k) for k in _IDX_DTYPES)}"
        )
    dtype, ndim = _IDX_DTYPES[raw[2]], raw[3]
    if expected_ndim is not None and ndim != expected_ndim:
        magic = int.from_bytes(raw[:4], "big")
        raise DataError(
            f"{path}: magic number {magic} says {ndim} dimensions; expected {expected_ndim} "
            f"(magic {0x800 + expected_ndim})"
        )
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path}: truncated header: {len(raw)} bytes, expected at least {header}")
    dims = tuple(int(d) for d in np.frombuffer(raw, ">i4", ndim, 4))
    expected = int(np.prod(dims)) * dtype.itemsize
    if len(raw) - header != expected:
        sizes: dict[int, str] = {}
        for d in _IDX_DTYPES.values():  # the first of each size: uint8 before int8
            sizes.setdefault(d.itemsize, d.newbyteorder("=").name)
        fits = [name for size, name in sizes.items() if int(np.prod(dims)) * size == len(raw) - header]
        code = f"0x{raw[2]:02x} ({dtype.newbyteorder('=').name})"
        hint = f"; the size fits {fits[0]}: is the dtype code {code} in its magic number wrong?" if fits else ""
        raise DataError(
            f"{path}: {len(raw) - header} bytes of data, expected {expected} for shape {dims} of "
            f"{dtype.newbyteorder('=').name} "
            f"({'truncated' if len(raw) - header < expected else 'trailing bytes'}){hint}"
        )
    return np.frombuffer(raw, dtype, offset=header).reshape(dims).astype(dtype.newbyteorder("="))


def _find_idx(directory: pathlib.Path, split: str, kind: str) -> pathlib.Path | None:
    ndim = 3 if kind == "images" else 1
    for sep in ("-", "."):
        for suffix in (".gz", ""):
            path = directory / f"{split}-{kind}{sep}idx{ndim}-ubyte{suffix}"
            if path.is_file():
                return path
    return None


def _missing_idx(directory: pathlib.Path, split: str, kind: str) -> DataError:
    ndim = 3 if kind == "images" else 1
    return DataError(f"{directory}: no {split}-{kind}-idx{ndim}-ubyte[.gz] file (MNIST/Fashion-MNIST IDX)")


def read_idx_split(directory: StrPath, split: str = "t10k") -> tuple[np.ndarray, np.ndarray]:
    """Images (N, 28, 28) uint8 and labels (N,) of one split ('train' or 't10k') of an IDX directory."""
    directory = _check_dir(directory)
    images_path = _find_idx(directory, split, "images")
    labels_path = _find_idx(directory, split, "labels")
    if images_path is None:
        raise _missing_idx(directory, split, "images")
    if labels_path is None:
        raise _missing_idx(directory, split, "labels")
    images = read_idx(images_path, expected_ndim=3)
    labels = read_idx(labels_path, expected_ndim=1)
    if len(images) != len(labels):
        raise DataError(f"{labels_path}: {len(labels)} labels, expected {len(images)} to match {images_path.name}")
    return images, labels


def load_mnist(directory: StrPath, name: str = "mnist") -> ImageDataset:
    """MNIST or Fashion-MNIST (same file names and format) from a directory of IDX files.

    A directory holding only the t10k split (like the shared MNIST test set) is split 8,000 / 2,000 with a
    logged warning, so that it can still be trained on.
    """
    directory = _check_dir(directory)
    x_test, y_test = read_idx_split(directory, "t10k")
    if _find_idx(directory, "train", "images") is None and _find_idx(directory, "train", "labels") is None:
        n_train = int(len(x_test) * 0.8)
        log.warning(
            "%s: no train-*-ubyte files; training on the first %d t10k images, testing on the other %d",
            directory,
            n_train,
            len(x_test) - n_train,
        )
        return make_image_dataset(
            name, x_test[:n_train], y_test[:n_train], x_test[n_train:], y_test[n_train:], num_classes=10, scale=255.0
        )
    x_train, y_train = read_idx_split(directory, "train")
    return make_image_dataset(name, x_train, y_train, x_test, y_test, num_classes=10, scale=255.0)


# --- CIFAR-10 binary --------------------------------------------------------------------------------------------


def read_cifar_batch(path: StrPath) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 binary batch: records of a label byte then 3x32x32 bytes (CHW); returns NHWC uint8, labels."""
    path = pathlib.Path(path)
    raw = _read_bytes(path)
    if len(raw) == 0 or len(raw) % CIFAR_RECORD:
        raise DataError(
            f"{path}: {len(raw)} bytes is not a whole number of {CIFAR_RECORD}-byte CIFAR-10 records "
            f"(truncated or not the binary version)"
        )
    records = np.frombuffer(raw, np.uint8).reshape(-1, CIFAR_RECORD)
    labels = records[:, 0].astype(np.int32)
    if labels.max() >= 10:
        bad = int(np.argmax(labels >= 10))
        raise DataError(f"{path}: record {bad} has label {labels[bad]}, expected 0..9 (not a CIFAR-10 binary file?)")
    images = records[:, 1:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(images), labels


def _cifar_dir(directory: pathlib.Path) -> pathlib.Path:
    # The official archive unpacks into cifar-10-batches-bin/; accept that folder or its parent.
    nested = directory / "cifar-10-batches-bin"
    return nested if nested.is_dir() else directory


def load_cifar10(directory: StrPath) -> ImageDataset:
    """CIFAR-10 from its binary version: data_batch_1..5.bin and test_batch.bin (never the pickled version)."""
    directory = _cifar_dir(_check_dir(directory))
    train_paths = sorted(directory.glob("data_batch_[0-9].bin"))
    if not train_paths:
        raise DataError(f"{directory}: no data_batch_N.bin files (CIFAR-10 binary version)")
    if len(train_paths) < 5:
        log.warning("%s: %d of the 5 CIFAR-10 training batches present", directory, len(train_paths))
    if not (directory / "test_batch.bin").is_file():
        raise DataError(f"{directory}: no test_batch.bin (the CIFAR-10 binary version's test split)")
    train = [read_cifar_batch(p) for p in train_paths]
    x_test, y_test = read_cifar_batch(directory / "test_batch.bin")
    return make_image_dataset(
        "cifar10",
        np.concatenate([x for x, _ in train]),
        np.concatenate([y for _, y in train]),
        x_test,
        y_test,
        num_classes=10,
        scale=255.0,
    )


# --- text -------------------------------------------------------------------------------------------------------

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


def stdlib_dir() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def load_text(directory: StrPath | None = None, *, max_bytes: int = 8 << 20, test_fraction: float = 0.05) -> TextCorpus:
    """Concatenated bytes of the text files under `directory` (default: the Python standard library's *.py).

    Files are read in sorted path order until `max_bytes`, so the corpus is the same on every run; the last
    `test_fraction` of the bytes is the test split.
    """
    suffixes: tuple[str, ...]
    if directory is None:
        root, suffixes, name = stdlib_dir(), (".py",), "stdlib"
    else:
        root, suffixes, name = _check_dir(directory), TEXT_SUFFIXES, "text"
    skip = {"site-packages", "dist-packages", "__pycache__"}
    paths = sorted(
        p
        for p in root.rglob("*")
        if p.suffix in suffixes and p.is_file() and not skip.intersection(p.relative_to(root).parts)
    )
    chunks: list[bytes] = []
    total = 0
    for path in paths:
        if total >= max_bytes:
            break
        data = path.read_bytes()[: max_bytes - total]
        chunks.append(data)
        total += len(data)
    if total < 1024:
        raise DataError(
            f"{root}: {total} bytes of text in {len(chunks)} files ({', '.join(suffixes)}); expected at least 1024"
        )
    corpus = np.frombuffer(b"".join(chunks), np.uint8)
    n_test = max(int(total * test_fraction), 513)
    train_starts, test_starts = _split_starts([len(c) for c in chunks], len(corpus) - n_test)
    return TextCorpus(name, corpus[:-n_test], corpus[-n_test:], len(chunks), train_starts=train_starts,
                      test_starts=test_starts)  # fmt: skip


def _split_starts(lengths: list[int], cut: int) -> tuple[np.ndarray, np.ndarray]:
    """Where each file (a document, for packing) starts in the train part (before `cut`) and the test part."""
    starts = np.cumsum([0, *lengths[:-1]]).astype(np.int64)
    test = starts[starts >= cut] - cut
    return starts[starts < cut], test if test.size and test[0] == 0 else np.r_[0, test].astype(np.int64)


def tokenize_corpus(corpus: TextCorpus, tokenizer_file: StrPath) -> TextCorpus:
    """`corpus` as the token ids of a Hugging Face `tokenizer.json` (the `tokenizers` package), int32, for
    fine-tuning a checkpoint on its own vocabulary; the train/test split stays where the bytes had it."""
    from jaxnn.interop.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_file)

    def ids(part: np.ndarray) -> np.ndarray:
        return np.asarray(tokenizer.encode(part.tobytes().decode("utf-8", "replace")).ids, np.int32)

    train, test = ids(corpus.train), ids(corpus.test)
    if len(test) < 2:
        raise DataError(f"{corpus.name}: its test split is {len(test)} token(s) long under {tokenizer_file}")
    return TextCorpus(f"{corpus.name}-tokens", train, test, corpus.num_files, tokenizer.get_vocab_size())


# --- dispatch ---------------------------------------------------------------------------------------------------


def _check_dir(directory: StrPath) -> pathlib.Path:
    path = pathlib.Path(directory).expanduser()
    if not path.is_dir():
        raise DataError(f"{path}: data directory not found")
    return path


def formats_in(directory: StrPath) -> list[str]:
    """The image formats whose files `directory` holds: "mnist" for IDX files, "cifar10" for CIFAR binary batches
    (none, one or both)."""
    directory = _check_dir(directory)
    found = []
    if _find_idx(directory, "t10k", "images") or _find_idx(directory, "train", "images"):
        found.append("mnist")
    if any(_cifar_dir(directory).glob("data_batch_[0-9].bin")) or any(_cifar_dir(directory).glob("test_batch.bin")):
        found.append("cifar10")
    return found


def detect_format(directory: StrPath) -> str:
    """'mnist' for IDX files, 'cifar10' for CIFAR binary batches, 'text' for text files or JSON Lines records (a
    .jsonl file too); else a DataError. A folder of image files is one too, even with a labels.txt beside them."""
    if pathlib.Path(directory).is_file() and pathlib.Path(directory).suffix == ".jsonl":
        return "text"
    directory = _check_dir(directory)
    found = formats_in(directory)
    if len(found) > 1:
        raise DataError(
            f"{directory}: holds both MNIST-format IDX files and CIFAR-10 batches; name one with --dataset "
            "(mnist, fashion_mnist or cifar10), or keep each data set in a folder of its own"
        )
    if found:
        return found[0]
    files = [p for p in directory.rglob("*") if p.is_file()]
    texts = [p for p in files if p.suffix in (*TEXT_SUFFIXES, ".jsonl")]
    images = [p for p in files if p.suffix.lower() in IMAGE_SUFFIXES]
    if texts and len(texts) >= len(images):  # a corpus may hold a figure or two; a labels file is not a corpus
        return "text"
    if images:
        kinds = ", ".join(sorted({p.suffix.lower() for p in images}))
        beside = f" (and {len(texts)} text file{'s' if len(texts) > 1 else ''}, e.g. {texts[0].name})" if texts else ""
        raise DataError(
            f"{directory}: holds {len(images)} image files ({kinds}){beside}, which jaxnn train does not read; it "
            "reads MNIST/Fashion-MNIST IDX files, CIFAR-10 binary batches or text. Load the images into arrays and "
            "pass them to jaxnn.fit as (x, y)"
        )
    raise DataError(f"{directory}: holds no MNIST/Fashion-MNIST IDX files, CIFAR-10 binary batches or text files")


def load_dataset(name: str, directory: StrPath | None = None) -> ImageDataset | TextCorpus:
    """An ImageDataset or TextCorpus by format name; `directory` is needed for mnist, fashion_mnist and cifar10."""
    if name not in FORMATS:
        raise DataError(f"unknown data set {name!r}; choose one of {list(FORMATS)}")
    if name == "digits":
        return load_digits()
    if name == "synthetic":
        return synthetic()
    if name == "text":
        return load_text(directory)
    if directory is None:  # mnist, fashion_mnist and cifar10 are read from files
        raise DataError(f"data set {name!r} needs a data directory (--data DIR)")
    if name == "cifar10":
        return load_cifar10(directory)
    return load_mnist(directory, name)
