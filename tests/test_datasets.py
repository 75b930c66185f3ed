"""Tests of tf_sparse_split.tools.datasets (no op library, no network)."""

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
from _helpers import mnist_dir

from tf_sparse_split.tools import datasets


def _write_idx(path, array, type_code=0x08):
    array = np.asarray(array)
    header = bytes([0, 0, type_code, array.ndim]) + struct.pack(
        f">{array.ndim}I", *array.shape)
    payload = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
    if str(path).endswith(".gz"):
        with gzip.open(path, "wb") as f:
            f.write(payload)
    else:
        Path(path).write_bytes(payload)


def _tiny_set(directory, prefix, n, gz, seed):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(n, 4, 3), dtype=np.uint8)
    images[images < 128] = 0  # real zeros, as in MNIST
    labels = rng.integers(0, 10, size=n, dtype=np.uint8)
    ext = ".gz" if gz else ""
    _write_idx(directory / f"{prefix}-images-idx3-ubyte{ext}", images)
    _write_idx(directory / f"{prefix}-labels-idx1-ubyte{ext}", labels)
    return images, labels


def test_digits_shapes_range_and_determinism():
    (xtr, ytr), (xte, yte) = datasets.load_digits()
    assert xtr.shape == (1438, 64) and xte.shape == (359, 64)
    assert ytr.shape == (1438,) and yte.shape == (359,)
    assert xtr.dtype == np.float32 and ytr.dtype == np.int32
    assert 0.0 <= xtr.min() and xtr.max() <= 1.0 and xtr.max() == 1.0
    assert set(np.unique(ytr)) == set(range(10))
    assert 0.3 < float((xtr == 0).mean()) < 0.7  # real zeros, not all
    (xtr2, ytr2), (xte2, _) = datasets.load_digits()
    np.testing.assert_array_equal(xtr, xtr2)
    np.testing.assert_array_equal(ytr, ytr2)
    np.testing.assert_array_equal(xte, xte2)
    (xtr3, _), _ = datasets.load_digits(seed=1)
    assert not np.array_equal(xtr, xtr3)
    with pytest.raises(ValueError):
        datasets.load_digits(test_fraction=1.0)


@pytest.mark.parametrize("gz", [False, True])
def test_idx_test_set_only_is_split_80_20(tmp_path, gz):
    images, labels = _tiny_set(tmp_path, "t10k", 10, gz, seed=0)
    (xtr, ytr), (xte, yte) = datasets.load_mnist(tmp_path)
    assert xtr.shape == (8, 12) and xte.shape == (2, 12)
    assert xtr.dtype == np.float32 and ytr.dtype == np.int32
    # Together the split holds every example once, scaled by 1/255.
    x_all = np.concatenate([xtr, xte])
    y_all = np.concatenate([ytr, yte])
    flat = images.reshape(10, -1).astype(np.float32) / 255.0
    order = [int(np.flatnonzero((flat == row).all(axis=1))[0])
             for row in x_all]
    assert sorted(order) == list(range(10))
    np.testing.assert_array_equal(y_all, labels[order])
    # Deterministic.
    (xtr2, _), _ = datasets.load_mnist(tmp_path)
    np.testing.assert_array_equal(xtr, xtr2)


def test_idx_with_train_files_uses_them(tmp_path):
    tr_images, tr_labels = _tiny_set(tmp_path, "train", 6, False, seed=1)
    te_images, te_labels = _tiny_set(tmp_path, "t10k", 3, True, seed=2)
    (xtr, ytr), (xte, yte) = datasets.load_mnist(str(tmp_path))
    np.testing.assert_allclose(xtr, tr_images.reshape(6, -1) / 255.0,
                               rtol=1e-6)
    np.testing.assert_array_equal(ytr, tr_labels)
    np.testing.assert_array_equal(yte, te_labels)
    assert xte.shape == (3, 12)


def test_read_idx_other_dtype(tmp_path):
    arr = np.arange(6, dtype=np.int32).reshape(2, 3) - 3
    _write_idx(tmp_path / "x.idx", arr, type_code=0x0C)
    out = datasets.read_idx(tmp_path / "x.idx")
    np.testing.assert_array_equal(out, arr)


def test_missing_files_raise_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="t10k-images"):
        datasets.load_mnist(tmp_path)
    with pytest.raises(FileNotFoundError):
        datasets.load_mnist(tmp_path / "nope")
    with pytest.raises(FileNotFoundError):
        datasets.read_idx(tmp_path / "nope-idx1-ubyte")


def test_corrupt_files_raise_value_error(tmp_path):
    _tiny_set(tmp_path, "t10k", 5, False, seed=0)
    images = tmp_path / "t10k-images-idx3-ubyte"
    good = images.read_bytes()
    images.write_bytes(b"\x01\x02" + good[2:])  # bad magic
    with pytest.raises(ValueError, match="magic"):
        datasets.load_mnist(tmp_path)
    images.write_bytes(good[:-7])  # truncated data
    with pytest.raises(ValueError, match="bytes"):
        datasets.load_mnist(tmp_path)
    images.write_bytes(good)
    labels = tmp_path / "t10k-labels-idx1-ubyte"
    _write_idx(labels, np.zeros(4, np.uint8))  # 5 images, 4 labels
    with pytest.raises(ValueError, match="labels"):
        datasets.load_mnist(tmp_path)
    (tmp_path / "bad.gz").write_bytes(b"not gzip at all")
    with pytest.raises(ValueError):
        datasets.read_idx(tmp_path / "bad.gz")


def test_real_mnist_test_set():
    directory = mnist_dir()
    if not (directory / "t10k-images-idx3-ubyte.gz").exists() and \
            not (directory / "t10k-images-idx3-ubyte").exists():
        pytest.skip(f"no MNIST IDX files in {directory}")
    (xtr, ytr), (xte, yte) = datasets.load_mnist(directory)
    if (directory / "train-images-idx3-ubyte.gz").exists() or \
            (directory / "train-images-idx3-ubyte").exists():
        assert xte.shape == (10000, 784)
    else:
        assert xtr.shape == (8000, 784) and xte.shape == (2000, 784)
    assert xtr.dtype == np.float32 and 0.0 <= xtr.min() and xtr.max() <= 1.0
    assert set(np.unique(ytr)) == set(range(10))
    assert 0.7 < float((xtr == 0).mean()) < 0.9  # MNIST is ~81% zeros
