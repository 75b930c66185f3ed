"""Products with a transposed second operand, run as is or swapped.

``SparseSplitMatMul`` with ``transpose_b`` (the input gradient ``dY W^T`` of
the Dense layers, the 1x1 convolutions' input gradient) and the SDDMM with
``b`` read transposed run TF's MatMul either on the operands as given or on
the operands swapped, transposing the result (cc/kernels/transposed_product.h).
``TFSS_TRANSPOSED_PRODUCT`` (read when an op's kernel is created) fixes the
way; unset, each op times both on the first call of a shape. Every way must
give TF's result on every plan: all dense (as given and compacted), a split
(gathered dense rows), all sparse, the calibration's first call.
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_sparse_split as tfss
from tf_sparse_split.ops.sddmm import sparse_split_sddmm

WAYS = ["as_is", "swapped", "auto"]


@pytest.fixture(params=WAYS)
def way(request, monkeypatch):
    if request.param == "auto":
        monkeypatch.delenv("TFSS_TRANSPOSED_PRODUCT", raising=False)
    else:
        monkeypatch.setenv("TFSS_TRANSPOSED_PRODUCT", request.param)
    return request.param


def _relu_like(rng, shape, zeros, dtype=np.float32):
    """Random values with a fraction ``zeros`` of exact zeros (never all)."""
    a = rng.standard_normal(shape).astype(dtype)
    a[rng.random(shape) < zeros] = 0
    a.flat[0] = 1.0
    return a


def _tol(dtype):
    return {np.float32: 2e-5, np.float64: 1e-12}[dtype]


# (M, K, N): product op(a) [M, K] times b^T, b [N, K]. The last shapes'
# b has over 2^17 values, so an automatic op times both ways there.
SHAPES = [(1, 7, 5), (16, 24, 40), (33, 70, 9), (64, 640, 256), (96, 512, 300)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("threshold", [-1.0, 0.0, 0.5, 1.0])
def test_matmul_transpose_b_matches_tf(way, shape, threshold):
    rng = np.random.default_rng(hash((shape, threshold)) % 2**32)
    m, k, n = shape
    a = tf.constant(_relu_like(rng, (m, k), 0.5))
    b = tf.constant(rng.standard_normal((n, k)).astype(np.float32))
    f = tf.function(lambda a, b: tfss.sparse_split_matmul(
        a, b, threshold, transpose_b=True, full_stats=False))
    want = tf.matmul(a, b, transpose_b=True).numpy()
    for _ in range(3):  # first call (calibration, timing), then steady
        got = f(a, b).numpy()
        np.testing.assert_allclose(got, want, rtol=_tol(np.float32),
                                   atol=_tol(np.float32) * np.sqrt(k))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_matmul_transpose_b_split_rows_and_dead_columns(way, dtype):
    """Rows of very different densities (a split: the dense rows are
    gathered) and all-zero columns (compaction), with a bias and relu."""
    rng = np.random.default_rng(7)
    m, k, n = 80, 384, 400
    a = _relu_like(rng, (m, k), 0.3, dtype)
    a[: m // 2] *= rng.random((m // 2, k)) < 0.05   # sparse rows
    a[:, ::3] = 0                                    # dead columns
    a[0, 0] = 1.0
    b = rng.standard_normal((n, k)).astype(dtype)
    bias = rng.standard_normal(n).astype(dtype)
    want = np.maximum(a.astype(np.float64) @ b.astype(np.float64).T + bias, 0)
    for threshold in (-1.0, 0.2, 0.0):
        f = tf.function(lambda a, b, c: tfss.sparse_split_matmul(
            a, b, threshold, transpose_b=True, bias=c, activation="relu"))
        for _ in range(3):
            got = f(tf.constant(a), tf.constant(b), tf.constant(bias)).numpy()
            np.testing.assert_allclose(got, want, rtol=_tol(dtype),
                                       atol=_tol(dtype) * np.sqrt(k))


@pytest.mark.parametrize("shape", [(16, 24, 40), (64, 256, 640)])
def test_sddmm_b_transposed_matches_masked_product(way, shape):
    """``(mask != 0) * (x @ b^T)`` with ``b`` [k, n] (``transpose_b`` False:
    TF's GEMM reads it transposed)."""
    rng = np.random.default_rng(3)
    m, k, n = shape
    mask = _relu_like(rng, (m, k), 0.5)
    x = rng.standard_normal((m, n)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    want = (mask != 0) * (x.astype(np.float64) @ b.astype(np.float64).T)
    for threshold in (-1.0, 0.0, 0.5):
        f = tf.function(lambda mask, x, b: sparse_split_sddmm(
            mask, x, b, threshold, transpose_b=False, full_stats=False))
        for _ in range(3):
            got = f(tf.constant(mask), tf.constant(x), tf.constant(b)).numpy()
            np.testing.assert_allclose(got, want, rtol=2e-5,
                                       atol=2e-5 * np.sqrt(n))


def test_dense_layer_input_gradient(way):
    """The input gradient of a Dense product (``dY W^T`` on the op with
    ``transpose_b``) equals TF's."""
    rng = np.random.default_rng(11)
    x = tf.constant(_relu_like(rng, (48, 512), 0.5))
    w = tf.constant(rng.standard_normal((512, 320)).astype(np.float32) * 0.05)
    dy = tf.constant(_relu_like(rng, (48, 320), 0.5))

    @tf.function
    def grads(x, w):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tfss.sparse_split_matmul(x, w)
        return tape.gradient(y, x, output_gradients=dy)

    want = tf.matmul(dy, w, transpose_b=True).numpy()
    for _ in range(3):
        np.testing.assert_allclose(grads(x, w).numpy(), want, rtol=2e-5,
                                   atol=2e-5 * np.sqrt(320))


@pytest.mark.parametrize("shape", [(0, 16, 8), (8, 0, 16), (8, 16, 0)])
def test_empty_products(way, shape):
    m, k, n = shape
    a = tf.zeros((m, k))
    b = tf.ones((n, k))
    for threshold in (-1.0, 0.0):
        got = tfss.sparse_split_matmul(a, b, threshold, transpose_b=True)
        assert got.shape == (m, n)
        assert not np.any(got.numpy())


def test_bfloat16_swapped(monkeypatch):
    monkeypatch.setenv("TFSS_TRANSPOSED_PRODUCT", "swapped")
    rng = np.random.default_rng(5)
    a = _relu_like(rng, (32, 256), 0.5)
    b = rng.standard_normal((200, 256)).astype(np.float32)
    want = a.astype(np.float64) @ b.astype(np.float64).T
    got = tfss.sparse_split_matmul(tf.constant(a, tf.bfloat16),
                                   tf.constant(b, tf.bfloat16), 0.0,
                                   transpose_b=True)
    scale = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64).T
    assert np.all(np.abs(got.numpy().astype(np.float64) - want)
                  <= 2 ** -7 * scale + 1e-6)
