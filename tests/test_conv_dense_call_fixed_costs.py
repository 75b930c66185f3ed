"""The all-dense convolution call's own path, which runs with no per-call
set-up beyond TF's kernel and the decision:

* every image dense and nothing compacted runs TF's kernel on the op's own
  inputs: ``Conv2D`` (no bias, or no fused kernel: float64) and
  ``Conv2DBackpropInput`` / ``Conv2DBackpropFilter`` on the op's own
  context (``TfKernel::RunOnContext``: the op's inputs 0..2 are TF's
  kernel's, its output 0 the op's output 0), the epilogue in place on that
  output; TF's fused convolution (bias at its input 2, the op's threshold)
  on a sub-context. Each must equal the float64 reference in every dtype
  and epilogue, whether or not a node reads the statistics, with the
  statistics (the op's other output) intact;
* one op instance keeps the cost-model family and sparse-kernel choice of
  its last call's geometry (``ConvFamilyCache``): a graph with dynamic
  N / H / W that changes shape from call to call must still compute each
  call right and describe it in its statistics.

Nothing here is timed. Which analysis an automatic call takes depends on
the calibration, so those calls are checked for their results only; the
deterministic all-dense path is forced by ``threshold=0.0`` on inputs with
zeros but no all-zero image or channel.
"""

import numpy as np
import pytest
import tensorflow as tf
from _helpers import sparse_normal

import tf_sparse_split as tfss
from tf_sparse_split import load_library
from tf_sparse_split.tuning import stats as S

DTYPES = [tf.float32, tf.float64, tf.bfloat16, tf.float16]
TOL = {tf.float32: (1e-5, 1e-4), tf.float64: (1e-12, 1e-10),
       tf.bfloat16: (2e-2, 1e-1), tf.float16: (4e-3, 2e-2)}


def _images(rng, shape, zeros=0.5):
    """NHWC values with zeros but no all-zero image or channel."""
    x = sparse_normal(rng, shape, zeros)
    x[:, 0, 0, :] = np.where(x[:, 0, 0, :] == 0, 1.0, x[:, 0, 0, :])
    return x


def _as(dtype, a):
    """a rounded to dtype (a tensor) and its exact float64 values."""
    t = tf.cast(tf.constant(a), dtype)
    return t, tf.cast(t, tf.float64)


def _check_stats(stats, x_shape, k_shape, c_out, out_hw, threshold, nnz):
    n, h, w, c_in = x_shape
    kh, kw = k_shape
    assert stats.shape == (S.NUM_STATS,)
    assert (stats[S.M], stats[S.K], stats[S.N]) == (n, h * w * c_in,
                                                    kh * kw * c_out)
    assert stats[S.ROWS_DENSE] + stats[S.ROWS_SPARSE] == n
    if threshold == 0.0:
        # Every image has a nonzero, no channel is zero in every image:
        # the plain all-dense call, exactly counted.
        assert stats[S.ROWS_DENSE] == n
        assert stats[S.ZERO_COLS_SKIPPED] == 0
        assert stats[S.ANALYSIS] == S.ANALYSIS_FULL
        assert stats[S.NNZ] == nnz
    # The cost problem is written for a consumed vector.
    assert stats[S.K_LIVE] == h * w * c_in
    assert stats[S.DENSE_FLOPS_PER_ELEM] == pytest.approx(
        2.0 * out_hw[0] * out_hw[1] * kh * kw * c_out / (h * w))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("epilogue", ["none", "relu", "bias", "bias_relu",
                                      "bias_relu6"])
def test_all_dense_forward_matches_reference(dtype, epilogue):
    rng = np.random.default_rng(17)
    shape, c_out = (3, 7, 6, 5), 6
    x, x64 = _as(dtype, _images(rng, shape))
    f, f64 = _as(dtype, rng.standard_normal((3, 3, 5, c_out)) / np.sqrt(45))
    has_bias = epilogue.startswith("bias")
    activation = {"relu": "relu", "bias_relu": "relu",
                  "bias_relu6": "relu6"}.get(epilogue)
    b, b64 = _as(dtype, rng.standard_normal(c_out))
    want = tf.nn.conv2d(x64, f64, 1, "SAME")
    if has_bias:
        want = want + b64
    if activation == "relu":
        want = tf.nn.relu(want)
    elif activation == "relu6":
        want = tf.nn.relu6(want)
    want = want.numpy()
    kw = dict(bias=b if has_bias else None, activation=activation)

    @tf.function
    def conv(x, f, threshold):  # nothing reads the statistics
        return tfss.sparse_split_conv2d(x, f, 1, "SAME", threshold=threshold,
                                        **kw)

    @tf.function
    def with_stats(x, f, threshold, full_stats):
        return tfss.sparse_split_conv2d(x, f, 1, "SAME", threshold=threshold,
                                        return_stats=True,
                                        full_stats=full_stats, **kw)

    rtol, atol = TOL[dtype]
    nnz = np.count_nonzero(x64.numpy())
    for threshold in (0.0, -1.0):
        for _ in range(3):  # automatic: calibrates, then may skip the count
            got = conv(x, f, tf.constant(threshold))
            assert got.dtype == dtype and got.shape == (3, 7, 6, c_out)
            np.testing.assert_allclose(tf.cast(got, tf.float64).numpy(),
                                       want, rtol=rtol, atol=atol)
            for full_stats in (True, False):
                got, stats = with_stats(x, f, tf.constant(threshold),
                                        full_stats)
                np.testing.assert_allclose(tf.cast(got, tf.float64).numpy(),
                                           want, rtol=rtol, atol=atol)
                _check_stats(stats.numpy(), shape, (3, 3), c_out, (7, 6),
                             threshold, nnz)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_dense_input_gradient_matches_reference(dtype):
    rng = np.random.default_rng(23)
    x_shape, c_out = (3, 6, 7, 4), 5
    f, f64 = _as(dtype, rng.standard_normal((3, 3, 4, c_out)) / 6.0)
    dy, dy64 = _as(dtype, _images(rng, (3, 6, 7, c_out)))
    want = tf.raw_ops.Conv2DBackpropInput(
        input_sizes=x_shape, filter=f64, out_backprop=dy64,
        strides=[1, 1, 1, 1], padding="SAME").numpy()

    @tf.function
    def grad(f, dy, threshold):
        return tfss.sparse_split_conv2d_backprop_input(
            tf.constant(x_shape, tf.int32), f, dy, "SAME",
            threshold=threshold, return_stats=True, full_stats=False)

    rtol, atol = TOL[dtype]
    for threshold in (0.0, 0.0, -1.0, -1.0, -1.0):
        got, stats = grad(f, dy, tf.constant(threshold))
        assert got.dtype == dtype and got.shape == x_shape
        np.testing.assert_allclose(tf.cast(got, tf.float64).numpy(), want,
                                   rtol=rtol, atol=atol)
        stats = stats.numpy()
        # The op splits the images of dY (the transposed convolution).
        assert stats[S.M] == 3 and stats[S.K] == 6 * 7 * c_out
        assert stats[S.ROWS_DENSE] + stats[S.ROWS_SPARSE] == 3
        if threshold == 0.0:
            assert stats[S.ROWS_DENSE] == 3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_all_dense_filter_gradient_matches_reference(dtype, with_bias):
    rng = np.random.default_rng(29)
    x_shape, f_shape = (3, 6, 5, 4), (3, 3, 4, 5)
    x, x64 = _as(dtype, _images(rng, x_shape))
    dy, dy64 = _as(dtype, rng.standard_normal((3, 6, 5, 5)))
    want = tf.raw_ops.Conv2DBackpropFilter(
        input=x64, filter_sizes=f_shape, out_backprop=dy64,
        strides=[1, 1, 1, 1], padding="SAME").numpy()
    want_db = tf.reduce_sum(dy64, axis=[0, 1, 2]).numpy()
    lib = load_library()
    attrs = dict(strides=[1, 1, 1, 1], padding="SAME",
                 explicit_paddings=[], dilations=[1, 1, 1, 1],
                 full_stats=False)

    @tf.function
    def grad(x, dy, threshold):
        sizes = tf.constant(f_shape, tf.int32)
        if with_bias:
            return lib.tf_sparse_split_sparse_split_conv2d_backprop_filter_with_bias(
                x, sizes, dy, threshold, **attrs)
        return lib.tf_sparse_split_sparse_split_conv2d_backprop_filter(
            x, sizes, dy, threshold, **attrs)

    rtol, atol = TOL[dtype]
    atol *= 4  # sums over N * H * W = 90 products per entry
    for threshold in (0.0, 0.0, -1.0, -1.0, -1.0):
        out = grad(x, dy, tf.constant(threshold))
        got, stats = out[0], out[-1].numpy()
        assert got.dtype == dtype and got.shape == f_shape
        np.testing.assert_allclose(tf.cast(got, tf.float64).numpy(), want,
                                   rtol=rtol, atol=atol)
        if with_bias:
            np.testing.assert_allclose(tf.cast(out[1], tf.float64).numpy(),
                                       want_db, rtol=rtol, atol=atol)
        assert stats[S.M] == 3 and stats[S.K] == 6 * 5 * 4
        if threshold == 0.0:
            assert stats[S.ROWS_DENSE] == 3
            assert stats[S.NNZ] == np.count_nonzero(x64.numpy())


@pytest.mark.parametrize("epilogue", ["none", "bias_relu"])
def test_one_forward_op_instance_changing_shapes(epilogue):
    """One op instance (dynamic N, H, W) called with batches in different
    batch buckets and different image sizes: each call right, its
    statistics its own sizes."""
    rng = np.random.default_rng(31)
    c_in, c_out = 3, 4
    f = rng.standard_normal((3, 3, c_in, c_out)).astype(np.float32) / 5.0
    b = rng.standard_normal(c_out).astype(np.float32)
    has_bias = epilogue == "bias_relu"

    @tf.function(input_signature=[
        tf.TensorSpec([None, None, None, c_in], tf.float32),
        tf.TensorSpec([], tf.float32)])
    def conv(x, threshold):
        return tfss.sparse_split_conv2d(
            x, tf.constant(f), 1, "SAME", threshold=threshold,
            bias=tf.constant(b) if has_bias else None,
            activation="relu" if has_bias else None, return_stats=True,
            full_stats=False)

    for n, h, w, thr in [(1, 8, 8, -1.0), (5, 8, 8, -1.0), (40, 8, 8, 0.0),
                         (5, 8, 8, 0.0), (5, 11, 6, -1.0), (1, 11, 6, 0.0),
                         (40, 8, 8, -1.0), (5, 6, 11, -1.0)]:
        x = _images(rng, (n, h, w, c_in))
        got, stats = conv(tf.constant(x), tf.constant(thr))
        want = tf.nn.conv2d(x.astype(np.float64), f.astype(np.float64), 1,
                            "SAME")
        if has_bias:
            want = tf.nn.relu(want + b.astype(np.float64))
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5,
                                   atol=1e-5)
        stats = stats.numpy()
        _check_stats(stats, (n, h, w, c_in), (3, 3), c_out, (h, w), thr,
                     np.count_nonzero(x))
        if thr < 0:  # automatic: the family (batch bucket) calibrated
            assert stats[S.CALIBRATED] == 1.0


def test_one_input_gradient_op_instance_changing_shapes():
    rng = np.random.default_rng(37)
    c_in, c_out = 3, 4
    f = rng.standard_normal((3, 3, c_in, c_out)).astype(np.float32) / 5.0

    @tf.function(input_signature=[
        tf.TensorSpec([4], tf.int32),
        tf.TensorSpec([None, None, None, c_out], tf.float32)])
    def grad(sizes, dy):
        return tfss.sparse_split_conv2d_backprop_input(
            sizes, tf.constant(f), dy, "SAME", threshold=-1.0,
            return_stats=True, full_stats=False)

    for n, h, w in [(1, 8, 8), (6, 8, 8), (40, 8, 8), (6, 9, 5), (1, 9, 5),
                    (6, 8, 8)]:
        dy = _images(rng, (n, h, w, c_out))
        got, stats = grad(tf.constant([n, h, w, c_in], tf.int32),
                          tf.constant(dy))
        want = tf.raw_ops.Conv2DBackpropInput(
            input_sizes=[n, h, w, c_in], filter=f.astype(np.float64),
            out_backprop=dy.astype(np.float64), strides=[1, 1, 1, 1],
            padding="SAME")
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5,
                                   atol=1e-5)
        stats = stats.numpy()
        assert stats[S.M] == n and stats[S.K] == h * w * c_out
        assert stats[S.ROWS_DENSE] + stats[S.ROWS_SPARSE] == n
