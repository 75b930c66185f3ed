"""SparseSplitConv2D's sparse images through the direct kernel with the
bias + activation fused into its last pass (cc/core/direct_conv2d.h,
DirectConvEpilogue): the values are exactly those of a separate pass
act(conv + bias) over the kernel's output (bitwise), on the sliding kernel
(3x3, stride 1; one and several passes; one filter row a pass and three),
the tiled kernel (stride 2, 5x5), the row scatter (thin inputs: C_in 1
and 2, 5x5 at stride 1), partial output vectors, all-zero images;
NaN follows TF's graph for the dtype (float32: oneDNN's post-op maps NaN to
0; float64: propagated). Also the nonzero counts of inputs with fewer than
16 channels (the count's register-mask path), NaN and -0.0 included."""

import numpy as np
import pytest
import tensorflow as tf

import tf_sparse_split as tfss
from tf_sparse_split import testing as T
from tf_sparse_split.tuning import stats as S


@pytest.fixture(autouse=True)
def _library(op_library):
    return op_library


# (x shape, filter shape, strides)
CASES = [
    ((3, 10, 28, 1), (3, 3, 1, 64), 1),     # sliding, C_in 1: one pass of 3 rows
    ((2, 9, 14, 16), (3, 3, 16, 40), 1),    # sliding, C_in 16, partial block
    ((2, 7, 14, 70), (3, 3, 70, 130), 1),   # sliding, one row a pass, 2 chunks, 3 blocks
    ((2, 8, 9, 20), (3, 3, 20, 24), 1),     # sliding, out_w 9: three rows, 2 chunks
    ((2, 11, 10, 6), (5, 5, 6, 19), 2),     # tiled kernel
    ((2, 6, 7, 80), (1, 1, 80, 256), 1),    # 1x1: 8-vector blocks, 2 passes
    ((3, 10, 28, 1), (3, 3, 1, 16), 1),     # row scatter, C_in 1
    ((2, 9, 12, 2), (3, 3, 2, 20), 1),      # row scatter, partial 2nd vector
    ((2, 11, 10, 6), (5, 5, 6, 19), 1),     # row scatter, 5x5
]


def _epilogue(y, b, activation, dtype):
    """act(y + b) as the op's separate pass computes it in `dtype`."""
    v = (y + b.astype(dtype)).astype(dtype)
    if activation == "none":
        return v
    if dtype == np.float32:  # oneDNN's post-op: max(v, 0), NaN -> 0
        v = np.where(v > 0, v, np.zeros_like(v))
        return np.where(v < 6, v, np.full_like(v, 6)) if activation == "relu6" else v
    v = np.where(v < 0, np.zeros_like(v), v)  # tf.nn.relu: NaN stays
    return np.where(v > 6, np.full_like(v, 6), v) if activation == "relu6" else v


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[0] + c[1][-1:])) + f"-s{c[2]}")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fused_epilogue_equals_separate_pass(case, dtype, monkeypatch):
    monkeypatch.setenv("TFSS_CONV_SPARSE_KERNEL", "direct")
    xs, fs, s = case
    rng = np.random.default_rng(sum(xs) + sum(fs) + s)
    x = T.random_sparse_images(xs, 0.6, rng, np.float64).astype(dtype)
    x[1] = 0.0  # an all-zero image: act(0 + bias)
    f = rng.normal(size=fs).astype(dtype)
    b = rng.normal(scale=2.0, size=fs[3]).astype(dtype)
    plain, st0 = tfss.sparse_split_conv2d(x, f, s, "SAME", threshold=1.0,
                                          return_stats=True)
    assert st0[S.ROWS_DENSE] == 0
    for activation in ("none", "relu", "relu6"):
        y, st = tfss.sparse_split_conv2d(x, f, s, "SAME", threshold=1.0,
                                         bias=b, activation=activation,
                                         return_stats=True)
        assert st[S.ROWS_DENSE] == 0 and st[S.ROWS_SPARSE] == xs[0]
        np.testing.assert_array_equal(
            y.numpy(), _epilogue(plain.numpy(), b, activation, dtype))
        ref = T.reference_conv2d_bias_act(x.astype(np.float64), f, b,
                                          activation, strides=s, padding="SAME")
        assert T.relative_error(y, ref) <= (1e-5 if dtype == np.float32 else 1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fused_epilogue_nan_follows_tf_graph(dtype, monkeypatch):
    monkeypatch.setenv("TFSS_CONV_SPARSE_KERNEL", "direct")
    rng = np.random.default_rng(11)
    x = T.random_sparse_images((2, 6, 16, 3), 0.5, rng, np.float64).astype(dtype)
    x[1, 2, 5, 1] = np.nan
    f = rng.normal(size=(3, 3, 3, 20)).astype(dtype)
    b = np.ones(20, dtype)
    for act, tf_act in (("relu", tf.nn.relu), ("relu6", tf.nn.relu6)):
        graph = tf.function(lambda a, w, c: tf_act(
            tf.nn.bias_add(tf.nn.conv2d(a, w, 1, "SAME"), c)))(x, f, b).numpy()
        y = tfss.sparse_split_conv2d(x, f, 1, "SAME", threshold=1.0, bias=b,
                                     activation=act).numpy()
        np.testing.assert_allclose(y, graph, rtol=1e-5, atol=1e-5,
                                   equal_nan=True)
        assert np.isnan(y[1, 2, 5]).all() == (dtype == np.float64)
        assert not np.isnan(y[0]).any()


@pytest.mark.parametrize("c_in", [1, 2, 3, 4, 8, 15, 16])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_counts_of_few_channels(c_in, dtype):
    rng = np.random.default_rng(c_in)
    x = T.random_sparse_images((3, 9, 11, c_in), 0.7, rng, np.float64).astype(dtype)
    x[0, 1, 2, 0] = np.nan  # counts as a nonzero
    x[2, 4, 4, c_in - 1] = -0.0  # counts as a zero
    if c_in > 1:
        x[..., c_in // 2] = 0.0  # an all-zero channel
    f = rng.normal(size=(3, 3, c_in, 5)).astype(dtype)
    nnz = np.count_nonzero(x != 0)
    for thr in (0.0, 1.0):
        y, st = tfss.sparse_split_conv2d(x, f, 1, "SAME", threshold=thr,
                                         return_stats=True, full_stats=True)
        assert st[S.NNZ] == nnz
        per_image = np.count_nonzero(x.reshape(3, -1) != 0, axis=1)
        hist = np.bincount(np.minimum((per_image / x[0].size * S.DENSITY_BINS)
                                      .astype(int), S.DENSITY_BINS - 1),
                           minlength=S.DENSITY_BINS)
        np.testing.assert_array_equal(st[S.HISTOGRAM], hist)
        ref = tf.nn.conv2d(np.nan_to_num(x, nan=0.0), f, 1, "SAME").numpy()
        ok = ~np.isnan(y.numpy())
        assert np.isnan(y.numpy()[0]).any() and not np.isnan(y.numpy()[1:]).any()
        np.testing.assert_allclose(y.numpy()[ok], ref[ok], rtol=1e-4, atol=1e-5)
