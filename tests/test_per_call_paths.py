"""The ops' per-call paths that depend on how the graph uses them, and the
recalibration rule of the cost model.

* A graph that drops the statistics output (a gradient product, a caller
  without ``return_stats``) lets the op skip allocating it
  (``OpKernelContext::output_required``): the product must be the same, in
  every path (skipped analysis, full count, forced dense, forced sparse,
  fused bias/activation), for the matmul, SDDMM and convolution ops.
* ``recalibration_due`` (``RecalibrationDue`` of ``cc/core/cost_model.h``)
  decides when a calibrated family times its paths again; checked on
  recorded densities and call counts (nothing timed).
"""

import numpy as np
import pytest
import tensorflow as tf
from _helpers import kernels_or_skip, sparse_normal

import tf_sparse_split as tfss
from tf_sparse_split.tuning import stats as S


@pytest.mark.parametrize("threshold", [-1.0, 0.0, 1.0, 0.5])
@pytest.mark.parametrize("zeros", [0.0, 0.6, 0.97])
@pytest.mark.parametrize("transpose_a", [False, True])
def test_matmul_without_stats_consumer_matches_reference(threshold, zeros,
                                                         transpose_a):
    rng = np.random.default_rng(7)
    m, k, n = 37, 129, 10
    a = sparse_normal(rng, (k, m) if transpose_a else (m, k), zeros)
    b = rng.standard_normal((k, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    op_a = a.T if transpose_a else a
    ref = op_a.astype(np.float64) @ b.astype(np.float64)

    @tf.function
    def product(x, w):  # the statistics output has no consumer
        return tfss.sparse_split_matmul(x, w, threshold,
                                        transpose_a=transpose_a)

    @tf.function
    def with_stats(x, w):
        return tfss.sparse_split_matmul(x, w, threshold,
                                        transpose_a=transpose_a,
                                        return_stats=True)

    for _ in range(3):  # first call calibrates; later ones may skip the count
        got = product(tf.constant(a), tf.constant(b)).numpy()
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)
    got, stats = with_stats(tf.constant(a), tf.constant(b))
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-5, atol=1e-4)
    stats = stats.numpy()
    assert stats.shape == (S.NUM_STATS,)
    assert (stats[S.M], stats[S.K], stats[S.N]) == (m, k, n)
    assert stats[S.ROWS_DENSE] + stats[S.ROWS_SPARSE] == m

    if not transpose_a:
        @tf.function
        def fused(x, w, c):
            return tfss.sparse_split_matmul(x, w, threshold, bias=c,
                                            activation="relu")

        got = fused(tf.constant(a), tf.constant(b), tf.constant(bias))
        np.testing.assert_allclose(got.numpy(), np.maximum(ref + bias, 0),
                                   rtol=1e-5, atol=1e-4)


def test_gradients_drop_the_statistics_of_their_products():
    """The gradient's products (threshold -1, statistics unused) give TF's
    gradients."""
    rng = np.random.default_rng(3)
    a = tf.constant(np.maximum(sparse_normal(rng, (64, 96), 0.5), 0))
    b = tf.constant(rng.standard_normal((96, 80)).astype(np.float32))

    @tf.function
    def grads(f):
        with tf.GradientTape() as tape:
            tape.watch([a, b])
            loss = tf.reduce_sum(tf.sin(f(a, b)))
        return tape.gradient(loss, [a, b])

    ours = grads(lambda x, y: tfss.sparse_split_matmul(x, y, -1.0))
    ref = grads(tf.matmul)
    for o, r in zip(ours, ref):
        np.testing.assert_allclose(o.numpy(), r.numpy(), rtol=1e-4,
                                   atol=1e-4)


def test_sddmm_and_conv_without_stats_consumer_match_reference():
    rng = np.random.default_rng(5)
    x = sparse_normal(rng, (33, 70), 0.7)
    dy = rng.standard_normal((33, 20)).astype(np.float32)
    w = rng.standard_normal((70, 20)).astype(np.float32)
    from tf_sparse_split.ops.sddmm import sparse_split_sddmm

    @tf.function
    def sddmm(m, g, b):
        return sparse_split_sddmm(m, g, b, -1.0)

    ref = (x != 0) * (dy.astype(np.float64) @ w.T.astype(np.float64))
    for _ in range(2):
        got = sddmm(tf.constant(x), tf.constant(dy), tf.constant(w))
        np.testing.assert_allclose(got.numpy(), ref, rtol=1e-5, atol=1e-4)

    img = sparse_normal(rng, (3, 9, 9, 5), 0.6)
    f = rng.standard_normal((3, 3, 5, 4)).astype(np.float32)
    from tf_sparse_split.ops.conv2d import sparse_split_conv2d

    @tf.function
    def conv(v, k):
        return sparse_split_conv2d(v, k, strides=[1, 1, 1, 1],
                                   padding="SAME", threshold=-1.0)

    ref = tf.nn.conv2d(tf.constant(img, tf.float64), tf.constant(f, tf.float64),
                       1, "SAME").numpy()
    for _ in range(2):
        got = conv(tf.constant(img), tf.constant(f))
        np.testing.assert_allclose(got.numpy(), ref, rtol=1e-5, atol=1e-4)


K = kernels_or_skip()


@pytest.mark.parametrize("cal, now, calls, recals, due", [
    (0.5, 0.12, 32, 0, True),     # 50% -> 88% zeros, long enough: re-time
    (0.12, 0.5, 32, 0, True),     # and back
    (0.5, 0.12, 31, 0, False),    # too soon after the calibration
    (0.5, 0.3, 500, 0, False),    # moved, but less than 2x
    (0.02, 0.009, 500, 0, False),  # 2x, but by less than 0.05
    (0.5, 0.1, 500, 8, False),    # recalibrated often enough already
    (-1.0, 0.1, 500, 0, False),   # calibrated elsewhere: no record
    (0.5, float("nan"), 500, 0, False),
])
def test_recalibration_due(cal, now, calls, recals, due):
    assert K.recalibration_due(cal, now, calls, recals) is due
