"""Tests of the SparseSplitConv2D op, its filter-gradient op and gradients,
against float64 references that use no convolution kernel
(tf_sparse_split.testing: im2col by tf.image.extract_patches)."""

import numpy as np
import pytest
import tensorflow as tf

import tf_sparse_split as tfss
from tf_sparse_split.tuning import stats as S
from tf_sparse_split import testing as T
from _helpers import conv_shape_args as _args, conv_shape_id as _ids

LIB = None  # the op library; set by the fixture below


@pytest.fixture(autouse=True, scope="module")
def _library(op_library):
    global LIB
    LIB = op_library

# (n, h, w, c_in, c_out, kh, kw, strides, dilations, padding, explicit)
SHAPES = [
    (3, 9, 7, 5, 19, 3, 3, 1, 1, "SAME", None),
    (2, 8, 8, 3, 33, 5, 5, 2, 1, "VALID", None),
    (2, 11, 10, 4, 7, 3, 3, 2, 2, "SAME", None),          # stride + dilation
    (2, 11, 10, 4, 7, 3, 3, 1, 2, "EXPLICIT", [0, 0, 1, 2, 3, 0, 0, 0]),
    (4, 6, 6, 2, 16, 1, 1, 1, 1, "VALID", None),          # 1x1
    (1, 13, 13, 17, 1, 3, 3, 1, 1, "SAME", None),         # C_out = 1
    (5, 7, 9, 6, 40, 2, 3, (1, 2), 1, "SAME", None),      # non-square
    (2, 12, 12, 8, 64, 5, 5, 1, 1, "SAME", None),         # 5x5, wide C_out
]




def _tol(dtype):
    return 1e-5 if dtype == np.float32 else 1e-12


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
@pytest.mark.parametrize("sparsity", [0.0, 0.7, 1.0])
def test_forward_matches_reference(shape, sparsity, device):
    with tf.device(device):
        rng = np.random.default_rng(hash((_ids(shape), sparsity)) % 2**32)
        xs, fs, kw = _args(shape)
        x = T.random_sparse_images(xs, sparsity, rng, np.float64, zero_channels=0.25)
        f = rng.normal(size=fs)
        ref = T.reference_conv2d(x, f, **kw)
        fn = tf.function(lambda a, b, t: tfss.sparse_split_conv2d(a, b, threshold=t, **kw))
        for dtype in (np.float32, np.float64):
            for thr in (0.0, 1.0, -1.0):
                y = tfss.sparse_split_conv2d(x.astype(dtype), f.astype(dtype),
                                             threshold=thr, **kw)
                assert y.dtype == dtype and y.shape == ref.shape
                assert T.relative_error(y, ref) <= _tol(dtype), (dtype, thr)
                y2 = fn(x.astype(dtype), f.astype(dtype), tf.constant(thr))
                assert T.relative_error(y2, ref) <= _tol(dtype), (dtype, thr)


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_filter_gradient_op_matches_reference(shape, device):
    with tf.device(device):
        rng = np.random.default_rng(hash(_ids(shape)) % 2**32)
        xs, fs, kw = _args(shape)
        x = T.random_sparse_images(xs, 0.6, rng, np.float64, zero_channels=0.25)
        ref_y = T.reference_conv2d(x, np.zeros(fs), **kw)
        dy = rng.normal(size=ref_y.shape)
        ref = T.reference_conv2d_filter_grad(x, fs, dy, **kw)
        s, d = kw["strides"], kw["dilations"]
        s = [1, *((s, s) if isinstance(s, int) else s), 1]
        d = [1, d, d, 1]
        for dtype in (np.float32, np.float64):
            for thr in (0.0, 1.0, -1.0):
                g, st = LIB.tf_sparse_split_sparse_split_conv2d_backprop_filter(
                    x.astype(dtype), fs, dy.astype(dtype), thr, strides=s,
                    padding=kw["padding"], dilations=d,
                    explicit_paddings=kw["explicit_paddings"] or [])
                assert T.relative_error(g, ref) <= _tol(dtype), (dtype, thr)
                st = st.numpy()
                assert st[S.ROWS_DENSE] + st[S.ROWS_SPARSE] == xs[0]
                assert st[S.NNZ] == np.count_nonzero(x)


def test_stats_layout_and_split(device):
    with tf.device(device):
        rng = np.random.default_rng(1)
        # Images of very different densities: a threshold in between splits them.
        x = np.zeros((6, 10, 10, 8), np.float32)
        for i in range(6):
            x[i] = T.random_sparse_images((10, 10, 8), 0.95 if i % 2 else 0.1, rng)
        x[..., 3] = 0  # one all-zero channel
        f = rng.normal(size=(3, 3, 8, 12)).astype(np.float32)
        y, st = tfss.sparse_split_conv2d(x, f, 1, "SAME", threshold=0.5,
                                         return_stats=True)
        st = st.numpy()
        assert st.shape == (S.NUM_STATS,)
        assert st[S.ROWS_DENSE] == 3 and st[S.ROWS_SPARSE] == 3
        assert st[S.NNZ] == np.count_nonzero(x)
        sparse_imgs = [1, 3, 5]
        assert st[S.NNZ_SPARSE] == np.count_nonzero(x[sparse_imgs])
        assert st[S.M] == 6 and st[S.K] == 10 * 10 * 8 and st[S.N] == 9 * 12
        assert st[S.ZERO_COLS_SKIPPED] == 100  # one channel = H*W columns
        assert st[S.THRESHOLD] == pytest.approx(0.5)
        assert st[S.HISTOGRAM].sum() == 6
        d = S.as_dict(st)
        assert d["sparsity"] == pytest.approx(1 - np.count_nonzero(x) / x.size)
        assert T.relative_error(y, T.reference_conv2d(x, f, 1, "SAME")) <= 1e-5


def test_deterministic_bits(device):
    with tf.device(device):
        rng = np.random.default_rng(2)
        x = T.random_sparse_images((4, 15, 15, 16), 0.8, rng)
        f = rng.normal(size=(3, 3, 16, 48)).astype(np.float32)
        dy = rng.normal(size=(4, 15, 15, 48)).astype(np.float32)
        a = tfss.sparse_split_conv2d(x, f, 1, "SAME", threshold=1.0).numpy()
        b = tfss.sparse_split_conv2d(x, f, 1, "SAME", threshold=1.0).numpy()
        assert np.array_equal(a, b)
        kw = dict(strides=[1, 1, 1, 1], padding="SAME")
        g1 = LIB.tf_sparse_split_sparse_split_conv2d_backprop_filter(x, f.shape, dy, 1.0, **kw)[0]
        g2 = LIB.tf_sparse_split_sparse_split_conv2d_backprop_filter(x, f.shape, dy, 1.0, **kw)[0]
        assert np.array_equal(g1.numpy(), g2.numpy())


def test_nan_in_input_propagates():
    x = np.zeros((1, 5, 5, 2), np.float32)
    x[0, 2, 2, 1] = np.nan
    f = np.ones((3, 3, 2, 4), np.float32)
    for thr in (0.0, 1.0):
        y = tfss.sparse_split_conv2d(x, f, 1, "SAME", threshold=thr).numpy()
        assert np.isnan(y[0, 1:4, 1:4]).all()
        assert not np.isnan(y[0, 0]).any()


def test_empty_batch_and_gradient(device):
    with tf.device(device):
        x = tf.zeros([0, 7, 7, 3])
        f = tf.ones([3, 3, 3, 5])
        with tf.GradientTape() as tape:
            tape.watch([x, f])
            y, st = tfss.sparse_split_conv2d(x, f, 2, "SAME", return_stats=True)
            loss = tf.reduce_sum(y)
        assert y.shape == (0, 4, 4, 5)
        assert st.numpy()[S.M] == 0
        gx, gf = tape.gradient(loss, [x, f])
        assert gx.shape == (0, 7, 7, 3)
        assert np.array_equal(gf.numpy(), np.zeros((3, 3, 3, 5), np.float32))


GRAD_CASES = [
    ((2, 5, 5, 2), (3, 3, 2, 3), dict(strides=1, padding="SAME")),
    ((1, 6, 5, 2), (2, 3, 2, 2), dict(strides=2, padding="VALID")),
    ((1, 7, 7, 2), (3, 3, 2, 2), dict(strides=1, padding="SAME", dilations=2)),
    ((1, 5, 6, 2), (3, 3, 2, 2), dict(strides=1, padding="EXPLICIT",
                                      explicit_paddings=[0, 0, 1, 0, 2, 1, 0, 0])),
]


@pytest.mark.parametrize("case", range(len(GRAD_CASES)))
@pytest.mark.parametrize("thr", [0.0, 1.0])
def test_gradients_numerically(case, thr, device):
    with tf.device(device):
        xs, fs, kw = GRAD_CASES[case]
        rng = np.random.default_rng(case)
        x = tf.constant(T.random_sparse_images(xs, 0.5, rng, np.float64))
        f = tf.constant(rng.normal(size=fs))
        theo, num = tf.test.compute_gradient(
            lambda a, b: tfss.sparse_split_conv2d(a, b, threshold=thr, **kw),
            [x, f], delta=1e-6)
        for t_, n_ in zip(theo, num):
            np.testing.assert_allclose(t_, n_, rtol=1e-6, atol=1e-6)


def test_gradient_matches_tf_conv2d_under_tf_function():
    rng = np.random.default_rng(7)
    x = tf.constant(T.random_sparse_images((3, 9, 9, 4), 0.7, rng))
    f = tf.constant(rng.normal(size=(3, 3, 4, 6)).astype(np.float32))

    @tf.function
    def grads(conv):
        with tf.GradientTape() as tape:
            tape.watch([x, f])
            y = conv(x, f)
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, [x, f])

    ours = grads(lambda a, b: tfss.sparse_split_conv2d(a, b, 2, "SAME",
                                                       threshold=-1.0))
    ref = grads(lambda a, b: tf.nn.conv2d(a, b, 2, "SAME"))
    for o, r in zip(ours, ref):
        assert T.relative_error(o, r) <= 1e-5


X4 = np.ones((2, 6, 6, 3), np.float32)
F4 = np.ones((3, 3, 3, 4), np.float32)


@pytest.mark.parametrize("kwargs, match", [
    (dict(input=np.ones((6, 6, 3), np.float32)), "rank 4"),
    (dict(filters=np.ones((3, 3, 4), np.float32)), "rank 4"),
    (dict(filters=np.ones((3, 3, 2, 4), np.float32)), "channels"),
    (dict(strides=0), "positive"),
    (dict(strides=[1, -1]), "positive"),
    (dict(strides=[2, 1, 1, 1]), "batch and channel"),
    (dict(strides=[1, 1, 1, 1, 1]), "1, 2 or 4"),
    (dict(dilations=0), "positive"),
    (dict(dilations=[1, 1, 1, 2]), "batch and channel"),
    (dict(padding="FULL"), "padding"),
    (dict(padding="EXPLICIT"), "explicit_paddings"),
    (dict(padding="EXPLICIT", explicit_paddings=[0, 0, 1, 1]), "8 entries"),
    (dict(padding="EXPLICIT", explicit_paddings=[0, 0, -1, 1, 1, 1, 0, 0]), ">= 0"),
    (dict(padding="EXPLICIT", explicit_paddings=[1, 0, 1, 1, 1, 1, 0, 0]), "batch and channel"),
    (dict(padding=[[0, 0], [1, 1], [1, 1]]), "4 pairs"),
    (dict(padding="SAME", explicit_paddings=[0] * 8), "empty unless"),
    # A filter one larger than the input gives an empty output (as
    # tf.nn.conv2d, test_conv2d_empty_output.py); two larger is an error.
    (dict(padding="VALID", filters=np.ones((8, 8, 3, 4), np.float32)), "smaller"),
    (dict(padding="VALID", dilations=4), "smaller"),
    (dict(threshold=1.5), "threshold"),
    (dict(threshold=float("nan")), "threshold"),
    (dict(threshold=[0.1, 0.2]), "scalar"),
    (dict(input=np.ones((2, 6, 6, 3), np.int32)), "float32, float64, bfloat16 or float16"),
    (dict(filters=tf.constant(np.ones((3, 3, 3, 4), np.float64))), "dtype"),
])
def test_bad_input_raises_invalid_argument(kwargs, match):
    args = dict(input=X4, filters=F4, strides=1, padding="SAME")
    args.update(kwargs)
    with pytest.raises(tf.errors.InvalidArgumentError, match=match):
        tfss.sparse_split_conv2d(**args)


@pytest.mark.parametrize("attrs, inputs, match", [
    (dict(strides=[1, 0, 1, 1], padding="SAME"), None, "positive"),
    (dict(strides=[1, 1, 1, 1], padding="SAME", dilations=[2, 1, 1, 1]),
     None, "batch and channel"),
    (dict(strides=[1, 1], padding="SAME"), None, "4 entries"),
    (dict(strides=[1, 1, 1, 1], padding="SAME"),
     (np.ones((2, 6, 6, 3), np.float32), np.ones((3, 3, 5, 4), np.float32)),
     "channels"),
])
def test_raw_op_validation(attrs, inputs, match):
    """The C++ kernel checks on its own (raw op, eager)."""
    x, f = inputs or (X4, F4)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match=match):
        LIB.tf_sparse_split_sparse_split_conv2d(x, f, -1.0, [], **attrs)


def test_raw_backprop_filter_validation():
    kw = dict(strides=[1, 1, 1, 1], padding="SAME")
    with pytest.raises(tf.errors.InvalidArgumentError, match="out_backprop"):
        LIB.tf_sparse_split_sparse_split_conv2d_backprop_filter(
            X4, [3, 3, 3, 4], np.ones((2, 5, 5, 4), np.float32), -1.0, **kw)
    with pytest.raises(tf.errors.InvalidArgumentError, match="filter_sizes"):
        LIB.tf_sparse_split_sparse_split_conv2d_backprop_filter(
            X4, [3, 3, 3], np.ones((2, 6, 6, 4), np.float32), -1.0, **kw)
    with pytest.raises(tf.errors.InvalidArgumentError, match="channels"):
        LIB.tf_sparse_split_sparse_split_conv2d_backprop_filter(
            X4, [3, 3, 2, 4], np.ones((2, 6, 6, 4), np.float32), -1.0, **kw)


def test_graph_mode_shape_inference():
    @tf.function(input_signature=[tf.TensorSpec([None, 28, 28, 1], tf.float32)])
    def fn(x):
        y = tfss.sparse_split_conv2d(x, tf.ones([3, 3, 1, 8]), 2, "SAME")
        assert y.shape.as_list() == [None, 14, 14, 8]
        return y

    assert fn(tf.zeros([2, 28, 28, 1])).shape == (2, 14, 14, 8)


def test_explicit_padding_as_pairs_matches_tf():
    rng = np.random.default_rng(3)
    x = T.random_sparse_images((2, 8, 7, 3), 0.5, rng)
    f = rng.normal(size=(3, 3, 3, 5)).astype(np.float32)
    pad = [[0, 0], [2, 1], [0, 3], [0, 0]]
    ref = tf.nn.conv2d(x, f, 1, pad).numpy()
    y = tfss.sparse_split_conv2d(x, f, 1, pad, threshold=1.0)
    assert T.relative_error(y, ref) <= 1e-5


@pytest.mark.parametrize("c_in", [1, 2, 3, 5, 6, 7, 9, 12, 15, 16])
def test_full_count_of_few_channel_inputs(c_in, device):
    """The full count of an input with under 16 channels (vectorised in
    chunks of lcm(16, C_in) values in float32) gives the exact nnz, the
    images' nonzeros (a threshold between two densities splits them) and
    the all-zero channels, with pixels left over after the last chunk."""
    with tf.device(device):
        rng = np.random.default_rng(c_in)
        n, h, w = 4, 7, 5 + c_in  # h * w * c_in: not a multiple of lcm(16, c_in)
        x = np.zeros((n, h, w, c_in), np.float32)
        for i in range(n):
            x[i] = T.random_sparse_images((h, w, c_in),
                                          0.9 if i % 2 else 0.15, rng)  # zeros
        x[0, -1, -1, 0] = 3.0  # the last pixel: in the tail
        x[1, 0, 0, 0] = np.nan        # NaN counts as a nonzero
        dead = c_in // 2 if c_in > 1 else None
        if dead is not None:
            x[..., dead] = 0
        f = rng.normal(size=(3, 3, c_in, 8)).astype(np.float32)
        y, st = tfss.sparse_split_conv2d(x, f, 1, "SAME", threshold=0.3,
                                         return_stats=True, full_stats=True)
        st = st.numpy()
        assert st[S.ANALYSIS] == S.ANALYSIS_FULL
        assert st[S.NNZ] == np.count_nonzero(x)
        assert st[S.ROWS_DENSE] == 2 and st[S.ROWS_SPARSE] == 2
        assert st[S.NNZ_SPARSE] == np.count_nonzero(x[[1, 3]])  # 90% zeros
        assert st[S.ZERO_COLS_SKIPPED] == (h * w if dead is not None else 0)
        ok = ~np.isnan(x).any(axis=(1, 2, 3))
        ref = T.reference_conv2d(x, f, 1, "SAME")
        assert T.relative_error(y.numpy()[ok], ref[ok]) <= 1e-5
