"""Data sets: each real format built small in a temp dir and read back; every kind of bad file refused by name."""

import gzip
import pathlib

import numpy as np
import pytest

from jaxnn.data import (
    DataError,
    detect_format,
    load_cifar10,
    load_dataset,
    load_digits,
    load_mnist,
    load_text,
    read_cifar_batch,
    read_idx,
    read_idx_split,
    synthetic,
)

MNIST_T10K = pathlib.Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "mnist-t10k"


def idx_bytes(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_idx_dir(root, n_train=50, n_test=20, gz=True, seed=0):
    rng = np.random.default_rng(seed)
    arrays = {
        "train": (rng.integers(0, 256, (n_train, 28, 28)), rng.integers(0, 10, n_train)),
        "t10k": (rng.integers(0, 256, (n_test, 28, 28)), rng.integers(0, 10, n_test)),
    }
    suffix = ".gz" if gz else ""
    for split, (images, labels) in arrays.items():
        for kind, arr, nd in (("images", images, 3), ("labels", labels, 1)):
            data = idx_bytes(arr)
            path = root / f"{split}-{kind}-idx{nd}-ubyte{suffix}"
            path.write_bytes(gzip.compress(data) if gz else data)
    return arrays


@pytest.mark.parametrize("gz", [True, False])
def test_mnist_idx_roundtrip(tmp_path, gz):
    arrays = write_idx_dir(tmp_path, gz=gz)
    ds = load_mnist(tmp_path)
    assert ds.x_train.shape == (50, 28, 28, 1) and ds.x_test.shape == (20, 28, 28, 1)
    np.testing.assert_array_equal(ds.x_train[..., 0], arrays["train"][0])
    np.testing.assert_array_equal(ds.y_test, arrays["t10k"][1])
    assert ds.scale == 255.0 and 0.3 < ds.mean[0] / 255 * 255 < 0.7  # uniform random bytes average ~0.5
    assert detect_format(tmp_path) == "mnist"
    assert load_dataset("fashion_mnist", tmp_path).name == "fashion_mnist"


def test_idx_errors_name_the_file(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_mnist(tmp_path / "missing")
    write_idx_dir(tmp_path, gz=False)
    images = tmp_path / "train-images-idx3-ubyte"
    raw = images.read_bytes()
    images.write_bytes(raw[:-100])
    with pytest.raises(DataError, match=r"train-images-idx3-ubyte: .*expected 39200 .*truncated"):
        load_mnist(tmp_path)
    images.write_bytes(b"\x00\x00\x08\x01" + raw[4:])  # claims 1 dimension
    with pytest.raises(DataError, match=r"train-images-idx3-ubyte: magic number 2049 .*expected 3"):
        load_mnist(tmp_path)
    images.write_bytes(b"\x12\x34" + raw[2:])
    with pytest.raises(DataError, match=r"train-images-idx3-ubyte: bad IDX magic number 1234"):
        load_mnist(tmp_path)
    images.write_bytes(raw)
    labels = tmp_path / "train-labels-idx1-ubyte"
    labels.write_bytes(idx_bytes(np.zeros(49, np.uint8)))
    with pytest.raises(DataError, match=r"train-labels-idx1-ubyte: 49 labels, expected 50"):
        load_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DataError, match=r"no t10k-labels-idx1-ubyte"):
        load_mnist(tmp_path)


def test_truncated_gzip_is_reported(tmp_path):
    write_idx_dir(tmp_path, gz=True)
    path = tmp_path / "t10k-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(DataError, match=r"t10k-images-idx3-ubyte.gz: not a complete gzip file"):
        read_idx_split(tmp_path, "t10k")


def write_cifar(path, n, seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n).astype(np.uint8)
    chw = rng.integers(0, 256, (n, 3, 32, 32)).astype(np.uint8)
    path.write_bytes(np.concatenate([labels[:, None], chw.reshape(n, -1)], axis=1).tobytes())
    return chw.transpose(0, 2, 3, 1), labels


def test_cifar_binary_roundtrip_and_errors(tmp_path, caplog):
    root = tmp_path / "cifar-10-batches-bin"
    root.mkdir()
    parts = [write_cifar(root / f"data_batch_{i}.bin", 6, i) for i in (1, 2)]
    x_test, y_test = write_cifar(root / "test_batch.bin", 4, 9)
    ds = load_cifar10(tmp_path)  # the archive's parent folder works too
    assert "2 of the 5" in caplog.text
    np.testing.assert_array_equal(ds.x_train, np.concatenate([parts[0][0], parts[1][0]]))
    np.testing.assert_array_equal(ds.y_test, y_test)
    assert ds.image_shape == (32, 32, 3) and detect_format(tmp_path) == "cifar10"
    bad = root / "test_batch.bin"
    bad.write_bytes(bad.read_bytes()[:-7])
    with pytest.raises(DataError, match=r"test_batch.bin: .* not a whole number of 3073-byte"):
        load_cifar10(root)
    raw = bytearray((root / "data_batch_1.bin").read_bytes())
    raw[3073] = 200
    (root / "data_batch_1.bin").write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"data_batch_1.bin: record 1 has label 200"):
        read_cifar_batch(root / "data_batch_1.bin")


def test_text_corpus_from_files_and_stdlib(tmp_path):
    rng = np.random.default_rng(0)
    texts = [bytes(rng.integers(32, 127, 3000).astype(np.uint8)) for _ in range(3)]
    for i, t in enumerate(texts):
        (tmp_path / f"f{i}.txt").write_bytes(t)
    corpus = load_text(tmp_path)
    assert corpus.num_files == 3
    assert bytes(np.concatenate([corpus.train, corpus.test])) == b"".join(texts)
    assert len(corpus.test) == 513  # 5% of 9000 is below the floor of one 512-byte window
    small = load_text(max_bytes=50_000)
    assert len(small.train) + len(small.test) == 50_000 and b"import" in bytes(small.train)
    (tmp_path / "f0.txt").write_bytes(b"x")
    for p in ("f1.txt", "f2.txt"):
        (tmp_path / p).unlink()
    with pytest.raises(DataError, match="1 bytes of text"):
        load_text(tmp_path)


def test_digits_and_synthetic():
    ds = load_digits()
    assert ds.x_train.shape == (1438, 8, 8, 1) and ds.x_test.shape == (359, 8, 8, 1)
    assert ds.scale == 16.0 and ds.x_train.max() == 16 and set(np.unique(ds.y_train)) == set(range(10))
    syn = synthetic((4, 4, 3), num_classes=5, n_train=64, n_test=16, seed=1)
    assert syn.x_train.shape == (64, 4, 4, 3) and syn.num_classes == 5 and syn.x_train.std() > 0.5
    with pytest.raises(DataError, match="unknown data set 'imagenet'"):
        load_dataset("imagenet")
    with pytest.raises(DataError, match="needs a data directory"):
        load_dataset("cifar10")


@pytest.fixture
def mnist_t10k():
    if not (MNIST_T10K / "t10k-images-idx3-ubyte.gz").is_file():
        pytest.skip(f"real MNIST test set not found at {MNIST_T10K.resolve()} (the shared data folder is absent)")
    return MNIST_T10K


def test_real_mnist_t10k_reads(mnist_t10k):
    images, labels = read_idx_split(mnist_t10k, "t10k")
    assert images.shape == (10000, 28, 28) and images.dtype == np.uint8
    np.testing.assert_array_equal(np.bincount(labels), [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009])
    assert read_idx(mnist_t10k / "t10k-labels-idx1-ubyte.gz").shape == (10000,)


@pytest.mark.slow
def test_learns_real_mnist(mnist_t10k, tmp_path):
    """Trains on the first 8,000 t10k images and reaches >= 97% on the last 2,000 (the loader's t10k-only split)."""
    from jaxnn.cli.config import TrainConfig
    from jaxnn.cli.recipes import train
    from jaxnn.config import FitConfig

    fit = FitConfig(steps=300, batch_size=64, run_dir=str(tmp_path / "run"), progress=False, plots=False, log_every=100)
    cfg = TrainConfig(model="cnn", size="small", data_dir=str(mnist_t10k), lr=3e-3, fit=fit)
    summary = train(cfg)
    assert summary["dataset"] == "mnist"
    assert summary["eval_accuracy"] >= 0.97, summary
