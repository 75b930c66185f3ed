"""Small data sets for examples, tests and the ``tf-sparse-split`` CLI.

Nothing here downloads anything:

* :func:`load_digits` uses scikit-learn's 8x8 hand-written digits, which ship
  inside the scikit-learn package (1,797 images).
* :func:`load_mnist` reads MNIST-style IDX files from a directory the caller
  provides (plain or gzip-compressed).

Both return ``(x_train, y_train), (x_test, y_test)`` with ``x`` a float32
array ``[num_examples, num_pixels]`` scaled to ``[0, 1]`` (flattened images)
and ``y`` an int32 vector of class labels ``0..9``.
"""

import gzip
import os
import struct
from pathlib import Path

import numpy as np

__all__ = ["load_digits", "load_mnist", "read_idx"]

# IDX type codes (third byte of the magic number) -> big-endian numpy dtype.
_IDX_DTYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def _split(x, y, test_fraction, seed):
    """Deterministic shuffled split of (x, y) into train and test parts."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(
            f"test_fraction must be in (0, 1), got {test_fraction!r}")
    n = x.shape[0]
    perm = np.random.default_rng(seed).permutation(n)
    n_test = int(round(n * test_fraction))
    test, train = perm[:n_test], perm[n_test:]
    return (x[train], y[train]), (x[test], y[test])


def load_digits(test_fraction=0.2, seed=0):
    """scikit-learn's embedded 8x8 digits, split deterministically.

    Args:
      test_fraction: fraction of the 1,797 images put in the test set, in
        (0, 1). Default 0.2 (1,438 train / 359 test).
      seed: seed of the permutation used for the split; the same seed always
        gives the same split.

    Returns:
      ``(x_train, y_train), (x_test, y_test)``: ``x`` float32 ``[n, 64]`` in
      ``[0, 1]`` (pixel intensity / 16), ``y`` int32 ``[n]`` in ``0..9``.

    Raises:
      ValueError: if ``test_fraction`` is not in (0, 1).
      ImportError: if scikit-learn is not installed.
    """
    from sklearn.datasets import load_digits as _sk_load_digits

    bunch = _sk_load_digits()
    x = (np.asarray(bunch.data, dtype=np.float32) / 16.0).astype(np.float32)
    y = np.asarray(bunch.target, dtype=np.int32)
    return _split(x, y, test_fraction, seed)


def read_idx(path):
    """Reads one IDX file (as used by MNIST), plain or gzip-compressed.

    The format: a 4-byte magic number ``0x00 0x00 <type> <ndim>``, then
    ``ndim`` big-endian uint32 dimension sizes, then the data, row-major.

    Args:
      path: file path (str or ``os.PathLike``). A name ending in ``.gz`` is
        decompressed with gzip.

    Returns:
      numpy array of the stored shape, in native byte order.

    Raises:
      FileNotFoundError: if the file does not exist.
      ValueError: if the file is not a valid IDX file (bad magic number,
        unknown type code, or a size that does not match the header).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"IDX file not found: {path}")
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                data = f.read()
        else:
            data = path.read_bytes()
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError
        raise ValueError(f"cannot read IDX file {path}: {e}") from e
    if len(data) < 4:
        raise ValueError(f"{path}: too short to be an IDX file "
                         f"({len(data)} bytes)")
    zero0, zero1, type_code, ndim = data[0], data[1], data[2], data[3]
    if zero0 != 0 or zero1 != 0 or type_code not in _IDX_DTYPES or ndim < 1:
        raise ValueError(
            f"{path}: bad IDX magic number {data[:4].hex()} (expected "
            "00 00 <type in 08,09,0b,0c,0d,0e> <ndim >= 1>)")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(f"{path}: truncated IDX header")
    shape = struct.unpack(f">{ndim}I", data[4:header])
    dtype = _IDX_DTYPES[type_code]
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(data) - header != expected:
        raise ValueError(
            f"{path}: IDX header says shape {tuple(shape)} of {dtype} "
            f"({expected} bytes of data) but the file holds "
            f"{len(data) - header} bytes")
    arr = np.frombuffer(data, dtype=dtype, offset=header).reshape(shape)
    return arr.astype(dtype.newbyteorder("="))


def _find(directory, stem):
    """Returns the path of ``stem`` or ``stem.gz`` in directory, or None."""
    for name in (stem, stem + ".gz"):
        p = directory / name
        if p.is_file():
            return p
    return None


def _load_pair(directory, prefix):
    images_path = _find(directory, f"{prefix}-images-idx3-ubyte")
    labels_path = _find(directory, f"{prefix}-labels-idx1-ubyte")
    if images_path is None or labels_path is None:
        return None
    images = read_idx(images_path)
    labels = read_idx(labels_path)
    if images.ndim != 3:
        raise ValueError(f"{images_path}: expected 3-D images "
                         f"[n, rows, cols], got shape {images.shape}")
    if labels.ndim != 1:
        raise ValueError(f"{labels_path}: expected a 1-D label vector, got "
                         f"shape {labels.shape}")
    if images.shape[0] != labels.shape[0]:
        raise ValueError(
            f"{images_path} holds {images.shape[0]} images but "
            f"{labels_path} holds {labels.shape[0]} labels")
    if images.shape[0] == 0:
        raise ValueError(f"{images_path}: no images")
    x = images.reshape(images.shape[0], -1).astype(np.float32)
    if images.dtype == np.uint8:
        x /= 255.0
    y = labels.astype(np.int32)
    return x, y


def load_mnist(directory=None, test_fraction=0.2, seed=0):
    """MNIST (or any data set in MNIST's IDX layout) from a local directory.

    Looks for ``t10k-images-idx3-ubyte`` and ``t10k-labels-idx1-ubyte``
    (each optionally with a ``.gz`` suffix) and, if present, the matching
    ``train-*`` files. With both sets, returns them as they are; with only the
    test set (10,000 images), splits it deterministically into train and test
    (80/20 by default). Never downloads.

    Args:
      directory: folder holding the IDX files. ``None`` means the environment
        variable ``TFSS_MNIST_DIR``.
      test_fraction: fraction kept for testing when only the t10k files exist.
      seed: seed of that split's permutation.

    Returns:
      ``(x_train, y_train), (x_test, y_test)``: ``x`` float32 ``[n, 784]`` in
      ``[0, 1]`` (uint8 pixels / 255), ``y`` int32 ``[n]``.

    Raises:
      FileNotFoundError: if the directory or the t10k files are missing (the
        message lists the file names it needs).
      ValueError: if a file is corrupt, or images and labels disagree in
        count.
    """
    if directory is None:
        directory = os.environ.get("TFSS_MNIST_DIR")
        if not directory:
            raise FileNotFoundError(
                "no MNIST directory given and TFSS_MNIST_DIR is not set")
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"MNIST directory not found: {directory}")
    test = _load_pair(directory, "t10k")
    if test is None:
        raise FileNotFoundError(
            f"{directory} lacks the MNIST test set: need "
            "t10k-images-idx3-ubyte[.gz] and t10k-labels-idx1-ubyte[.gz] "
            "(this function never downloads)")
    train = _load_pair(directory, "train")
    if train is None:
        return _split(test[0], test[1], test_fraction, seed)
    if train[0].shape[1] != test[0].shape[1]:
        raise ValueError(
            f"train images have {train[0].shape[1]} pixels, test images "
            f"{test[0].shape[1]}")
    return train, test
