"""Tests of tf_sparse_split.layers.SparseSplitDense (needs the op library);
the contract shared by all sparse-split layers is in test_layer_contract.py."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf
from _helpers import sparse_normal

from tf_sparse_split.layers import SparseSplitDense

pytestmark = pytest.mark.usefixtures("op_library")


def _sparse_input(shape, zero_fraction, seed):
    return sparse_normal(np.random.default_rng(seed), shape, zero_fraction)


def _twin_dense(layer, input_dim):
    """A keras.layers.Dense with the same weights as ``layer``."""
    dense = keras.layers.Dense(layer.units, activation=layer.activation,
                               use_bias=layer.use_bias, dtype=layer.dtype)
    dense.build((None, input_dim))
    dense.set_weights(layer.get_weights())  # same list as Dense's
    return dense


@pytest.mark.parametrize("threshold", [0.0, 0.5, 1.0, -1.0])
@pytest.mark.parametrize("shape", [(37, 23), (5, 7, 23), (2, 3, 4, 23)])
def test_forward_matches_dense(shape, threshold):
    x = _sparse_input(shape, 0.7, seed=len(shape))
    layer = SparseSplitDense(13, activation="relu", threshold=threshold)
    y = layer(x)
    assert y.shape == shape[:-1] + (13,)
    ref = _twin_dense(layer, shape[-1])(x)
    np.testing.assert_allclose(y.numpy(), ref.numpy(), rtol=1e-5, atol=1e-5)
    # Against a float64 reference too.
    w, b = layer.get_weights()
    ref64 = np.maximum(x.astype(np.float64) @ w.astype(np.float64) + b, 0)
    np.testing.assert_allclose(y.numpy(), ref64, rtol=1e-5, atol=1e-5)


def test_forward_float64_and_no_bias():
    x = _sparse_input((19, 11), 0.5, seed=3).astype(np.float64)
    layer = SparseSplitDense(6, use_bias=False, dtype="float64",
                             threshold=0.25)
    y = layer(x)
    assert y.dtype == tf.float64
    assert len(layer.get_weights()) == 1  # kernel, as Dense(use_bias=False)
    np.testing.assert_allclose(y.numpy(), x @ layer.get_weights()[0],
                               rtol=1e-12, atol=1e-12)


def test_mixed_precision_computes_in_float32():
    x = _sparse_input((16, 32), 0.6, seed=4)
    layer = SparseSplitDense(8, dtype="mixed_float16")
    y = layer(x)
    assert y.dtype == tf.float16
    w, b = layer.get_weights()
    np.testing.assert_allclose(y.numpy().astype(np.float32), x @ w + b,
                               rtol=1e-2, atol=1e-2)


def test_rank1_input_is_rejected():
    layer = SparseSplitDense(4)
    with pytest.raises(ValueError):
        layer(np.ones((5,), np.float32))


def test_quantization_is_refused():
    layer = SparseSplitDense(4)
    layer.build((None, 3))
    with pytest.raises(NotImplementedError, match="quantization"):
        layer.quantize("int8")


def test_stats_are_readable_and_match_the_input():
    x = _sparse_input((48, 64), 0.9, seed=6)
    x[3] = 0.0  # an all-zero row
    x[:, 5] = 0.0  # an all-zero column
    layer = SparseSplitDense(10, threshold=1.0)
    with pytest.raises(RuntimeError):
        layer.latest_stats()
    layer(x)
    s = layer.latest_stats()
    assert s["nnz"] == np.count_nonzero(x)
    assert (s["m"], s["k"], s["n"]) == (48, 64, 10)
    assert s["rows_dense"] == 0 and s["rows_sparse"] == 48
    assert s["nnz_sparse"] == np.count_nonzero(x)
    assert s["zero_cols_skipped"] >= 1
    assert sum(s["histogram"]) == 48
    assert s["sparsity"] == pytest.approx(1 - np.count_nonzero(x) / x.size)
    assert s["threshold"] == 1.0
    assert s["time_sparse"] >= 0.0 and s["time_dense"] >= 0.0

    layer.set_threshold(0.0)
    layer(x)
    s = layer.latest_stats()
    nonzero_rows = int(np.count_nonzero(np.count_nonzero(x, axis=1)))
    # Threshold 0 sends the nonzero rows dense; a few (< 1/8) all-zero rows
    # go dense with them rather than forcing a gather (see the op's doc).
    zero_rows = 48 - nonzero_rows
    assert s["rows_dense"] == (48 if zero_rows * 8 < 48 else nonzero_rows)
    assert s["rows_dense"] + s["rows_sparse"] == 48

    acc = layer.accumulated_stats()
    assert acc["calls"] == 2
    assert acc["nnz"] == 2 * np.count_nonzero(x)
    assert acc["m"] == 96 and acc["k"] == 64
    assert acc["threshold"] == pytest.approx(0.5)
    assert acc["sparsity"] == pytest.approx(s["sparsity"])
    layer.reset_stats()
    acc = layer.accumulated_stats()
    assert acc["calls"] == 0 and acc["nnz"] == 0
    assert math.isnan(acc["sparsity"])
    assert layer.latest_stats()["nnz"] == np.count_nonzero(x)  # kept


def test_training_step_matches_dense():
    keras.utils.set_random_seed(1)
    x = _sparse_input((64, 24), 0.75, seed=9)
    y = np.random.default_rng(9).integers(0, 4, 64)

    def model(layer_cls, **kw):
        return keras.Sequential([
            keras.Input((24,)),
            layer_cls(16, activation="relu", **kw),
            layer_cls(4, activation="softmax", **kw),
        ])

    ours = model(SparseSplitDense, threshold=0.5)
    ref = model(keras.layers.Dense)
    ref.set_weights(ours.get_weights())
    for m in (ours, ref):
        m.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy",
                  jit_compile=False)
        m.fit(x, y, epochs=2, batch_size=16, shuffle=False, verbose=0)
    ours_w = ours.get_weights()
    for a, b in zip(ours_w, ref.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_other_keras_backend_is_refused(monkeypatch):
    # Only the TensorFlow backend can run the op; the check reads
    # keras.backend.backend() when a layer is made.
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    with pytest.raises(RuntimeError, match="TensorFlow backend.*'jax'"):
        SparseSplitDense(3)


@pytest.mark.parametrize("dtype", [np.uint8, np.int32])
def test_integer_inputs_give_float_outputs_like_dense(dtype):
    """Integer inputs are cast to the compute dtype, as Dense's matmul does."""
    x = (np.arange(24).reshape(4, 6) * 20 % 256).astype(dtype)
    layer = SparseSplitDense(3, threshold=1.0)
    y = layer(x)
    twin = _twin_dense(layer, 6)
    assert y.dtype == tf.float32
    np.testing.assert_allclose(y.numpy(), twin(x.astype(np.float32)).numpy(),
                               rtol=1e-5, atol=1e-4)
