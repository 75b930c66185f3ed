"""Data helpers shared by the tests: random arrays with real zeros, labelled
data sets of them, and where the MNIST IDX files are. Imported by the test
modules as ``from _helpers import ...`` (pytest puts ``tests/`` on
``sys.path`` because ``tests/conftest.py`` is not in a package)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest


def sparse_normal(rng, shape, zero_fraction, dtype=np.float32):
    """Standard-normal values with about ``zero_fraction`` of them set to
    exact zeros.

    Args:
      rng: ``numpy.random.Generator`` (draws the values, then the zeros).
      shape: tuple of ints.
      zero_fraction: fraction of zeros in ``[0, 1)``.
      dtype: numpy dtype of the result.

    Returns:
      numpy array of ``shape`` and ``dtype``. Never all zero; with
      ``zero_fraction > 0`` it has real zeros too (asserted).
    """
    x = rng.standard_normal(shape).astype(dtype)
    x[rng.random(shape) < zero_fraction] = 0.0
    nnz = np.count_nonzero(x)
    assert nnz > 0, "test input is all zero"
    assert zero_fraction == 0 or nnz < x.size, "test input has no zeros"
    return x


def sparse_dataset(n, k, zero_fraction, seed, classes=4):
    """A labelled data set ``(x, y)``: ``x`` float32 ``[n, k]`` from
    :func:`sparse_normal`, ``y`` int64 ``[n]`` uniform in
    ``[0, classes)``; both from ``numpy.random.default_rng(seed)``."""
    rng = np.random.default_rng(seed)
    x = sparse_normal(rng, (n, k), zero_fraction)
    return x, rng.integers(0, classes, n)


def mnist_dir():
    """Directory of the MNIST IDX files: ``$TFSS_MNIST_DIR``, else
    ``shared/data/mnist`` next to the checkout (it may not exist)."""
    env = os.environ.get("TFSS_MNIST_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist"


def import_benchmark(name):
    """The module ``benchmarks/<name>.py`` (the scripts import their shared
    ``_common`` from their own directory, which is on ``sys.path`` only
    while they are imported)."""
    import importlib

    path = str(Path(__file__).resolve().parents[1] / "benchmarks")
    sys.path.insert(0, path)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(path)


def kernels_or_skip():
    """The pybind11 module of the core kernels, for a test module's
    import: without a built library the whole module is skipped with the
    :class:`~tf_sparse_split.LibraryLoadError` message (the rebuild
    command)."""
    from tf_sparse_split._loader import LibraryLoadError, kernels

    try:
        return kernels()
    except LibraryLoadError as e:
        pytest.skip(f"core kernels not built: {e}", allow_module_level=True)


def run_python(code, cwd=None, env=None, timeout=240):
    """Runs ``code`` (dedented) in a fresh interpreter with
    ``TF_CPP_MIN_LOG_LEVEL=2`` and ``env`` added to the environment; returns
    the ``subprocess.CompletedProcess`` (text stdout/stderr). ``timeout`` in
    seconds."""
    full_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                          cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


def conv_dense_model():
    """The small model the reload tests save: input ``[None, 6, 6, 2]``
    float32, SparseSplitConv2D(3 filters, 3x3, relu, threshold 0.25),
    Flatten, SparseSplitDense(5, threshold 0.5). Weights come from Keras'
    seed (``keras.utils.set_random_seed`` before the call)."""
    import keras

    import tf_sparse_split as tfss

    return keras.Sequential([
        keras.Input((6, 6, 2)),
        tfss.SparseSplitConv2D(3, 3, activation="relu", threshold=0.25),
        keras.layers.Flatten(),
        tfss.SparseSplitDense(5, threshold=0.5)])


def cost_terms(**kw):
    """A family's cost terms (the dict the pybind cost model takes) of a
    plausible 2-core CPU, with ``kw`` overriding entries."""
    t = dict(dense_fixed_s=2e-5, dense_rate=2.0e11, sparse_fixed_s=2e-5,
             convert_s_per_elem=2.5e-10, sparse_rate=8.0e10,
             copy_s_per_elem=5e-10)
    t.update(kw)
    return t


def conv_shape_id(shape):
    """Test id of a convolution case ``(n, h, w, c_in, c_out, kh, kw,
    strides, dilations, padding, explicit_paddings)``."""
    n, h, w, ci, co, kh, kw, s, d, pad, _ = shape
    return f"{n}x{h}x{w}x{ci}-{kh}x{kw}x{co}-s{s}-d{d}-{pad}"


def conv_shape_args(shape):
    """``(input shape, filter shape, conv2d keyword arguments)`` of a
    convolution case (see :func:`conv_shape_id`)."""
    n, h, w, ci, co, kh, kw, s, d, pad, ep = shape
    return (n, h, w, ci), (kh, kw, ci, co), dict(
        strides=s, padding=pad, dilations=d, explicit_paddings=ep)
