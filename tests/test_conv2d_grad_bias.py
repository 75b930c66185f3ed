"""SparseSplitConv2DBackpropFilterWithBias: the filter and bias gradients of
a convolution with a bias in one op, against float64 references (im2col
filter gradient, numpy sum of dY) and against TensorFlow's own
``tf.nn.bias_add`` gradient; and the gradient of ``SparseSplitConv2D`` with
a bias, whose bias gradient comes from that op (no separate BiasAddGrad)."""

import numpy as np
import pytest
import tensorflow as tf

import tf_sparse_split as tfss
from tf_sparse_split._loader import load_library
from tf_sparse_split.testing import (random_sparse_images,
                                     reference_conv2d_filter_grad)
from tf_sparse_split.tuning import stats as S

pytestmark = pytest.mark.usefixtures("op_library")

DTYPES = [tf.float32, tf.float64, tf.bfloat16, tf.float16]
#: Unit roundoff of each dtype (float32 and float64: their own).
UNIT = {tf.float32: 2.0 ** -24, tf.float64: 2.0 ** -53,
        tf.bfloat16: 2.0 ** -8, tf.float16: 2.0 ** -11}
#: Unit roundoff of the accumulation (float64 for float64, else float32).
ACC = {tf.float32: 2.0 ** -24, tf.float64: 2.0 ** -53,
       tf.bfloat16: 2.0 ** -24, tf.float16: 2.0 ** -24}

# (N, H, W, C_in, KH, KW, C_out, strides, padding, dilations)
SHAPES = [
    (3, 9, 11, 4, 3, 3, 6, 1, "SAME", 1),
    (2, 9, 11, 3, 3, 2, 5, 1, "VALID", 1),
    (2, 9, 11, 4, 3, 3, 17, 2, "SAME", 1),           # stride 2, odd C_out
    (2, 9, 9, 4, 1, 1, 6, 2, "SAME", 1),             # 1x1 stride 2
    (3, 7, 9, 8, 1, 1, 33, 1, "VALID", 1),           # 1x1
    (2, 12, 10, 3, 3, 3, 4, 1, "SAME", 2),           # dilated
    (2, 8, 8, 6, 3, 3, 5, 1, [[0, 0], [1, 0], [2, 1], [0, 0]], 1),  # EXPLICIT
    (1, 13, 7, 1, 3, 3, 1, (2, 1), "VALID", 1),      # batch 1, one channel
]


def _explicit(padding):
    if isinstance(padding, list):
        return "EXPLICIT", [p for pair in padding for p in pair]
    return padding, []


def _four(v):
    return [1, v, v, 1] if isinstance(v, int) else [1, v[0], v[1], 1]


def _rounded(a, dtype):
    """``a`` rounded to ``dtype`` (a tensor) and its exact float64 value."""
    t = tf.cast(tf.constant(a, tf.float64), dtype)
    return t, tf.cast(t, tf.float64).numpy()


def _out_shape(shape):
    n, h, w, ci, kh, kw, co, strides, padding, dil = shape
    x = tf.zeros((n, h, w, ci))
    f = tf.zeros((kh, kw, ci, co))
    pad = padding if isinstance(padding, str) else padding
    return tuple(tf.nn.conv2d(x, f, strides, pad, dilations=dil).shape)


def _op(x, fshape, dy, thr, shape, **kw):
    strides, padding, dil = shape[7:]
    pad, ex = _explicit(padding)
    return load_library(
    ).tf_sparse_split_sparse_split_conv2d_backprop_filter_with_bias(
        x, fshape, dy, tf.constant(thr, tf.float32), strides=_four(strides),
        padding=pad, explicit_paddings=ex, dilations=_four(dil), **kw)


def _assert_bias(db, dy64, dtype):
    """db against the float64 sum of dY: one rounding to the dtype plus the
    accumulation's error over N*OH*OW values (and, for a split float32
    call, the sum of two partial sums)."""
    ref = dy64.sum(axis=(0, 1, 2))
    abs_sum = np.abs(dy64).sum(axis=(0, 1, 2))
    length = int(np.prod(dy64.shape[:3]))
    got = tf.cast(db, tf.float64).numpy()
    assert got.shape == ref.shape
    tol = UNIT[dtype] * np.abs(ref) + 2.0 * length * ACC[dtype] * abs_sum \
        + (2.0 ** -24 if dtype == tf.float16 else 0.0)
    np.testing.assert_array_less(np.abs(got - ref), tol + 1e-300)


def _tf_filter_grad(x, fshape, dy, shape):
    """TensorFlow's own Conv2DBackpropFilter in the dtype, or None where
    its CPU kernel refuses the case (dilations in Eigen's kernels)."""
    strides, padding, dil = shape[7:]
    pad, ex = _explicit(padding)
    try:
        return tf.raw_ops.Conv2DBackpropFilter(
            input=x, filter_sizes=fshape, out_backprop=dy,
            strides=_four(strides), padding=pad, explicit_paddings=ex,
            dilations=_four(dil))
    except tf.errors.InvalidArgumentError:
        return None


def _assert_filter(df, x64, fshape, dy64, shape, dtype, rounds,
                   tf_result=None):
    """dF within the float64 reference's bound (one rounding per
    intermediate, the accumulation's error over N*OH*OW terms), or within
    TensorFlow's own error for it plus one rounding (its Eigen kernels
    accumulate the 16-bit dtypes in the dtype: the op is never held to a
    tighter bound than the kernel its dense part runs)."""
    strides, padding, dil = shape[7:]
    pad, ex = _explicit(padding)
    ex = ex or None
    ref = reference_conv2d_filter_grad(x64, fshape, dy64, strides, pad, dil,
                                       ex)
    abs_sum = reference_conv2d_filter_grad(np.abs(x64), fshape, np.abs(dy64),
                                           strides, pad, dil, ex)
    length = int(np.prod(dy64.shape[:3]))
    got = tf.cast(df, tf.float64).numpy()
    tol = UNIT[dtype] * (np.abs(ref) + (rounds - 1) * abs_sum) + \
        2.0 * length * ACC[dtype] * abs_sum + 1e-7 * (dtype == tf.float16)
    if dtype in (tf.float32, tf.float64):
        # TF's own float32 kernels (oneDNN's) reach ~1e-6 relative error.
        tol = np.maximum(tol, (1e-5 if dtype == tf.float32 else 1e-12) *
                         (abs_sum + 1e-30))
    if tf_result is not None:
        tf_err = np.abs(tf.cast(tf_result, tf.float64).numpy() - ref)
        tol = np.maximum(tol, tf_err + UNIT[dtype] * (np.abs(ref) + abs_sum))
    err = np.abs(got - ref)
    assert (err <= tol).all(), (err.max(), (err - tol).max())


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_filter_and_bias_grad_match_float64_reference(dtype, shape):
    """Every plan: all-dense (threshold 0: TF's filter gradient plus the
    bias pass), all-sparse (threshold 1), a split (threshold 0.5, with an
    all-zero image of x whose dY still counts for the bias) and automatic;
    dY dense and 90% zeros."""
    rng = np.random.default_rng([len(str(shape)), dtype.size, 3])
    n, h, w, ci, kh, kw, co = shape[:7]
    fshape = [kh, kw, ci, co]
    ys = _out_shape(shape)
    for dy_sparsity in (0.0, 0.9):
        xn = random_sparse_images((n, h, w, ci), 0.6, rng, np.float64)
        xn[0] = 0.0          # an all-zero image: sparse in every split
        xn[-1, 0, 0, 0] = 0.75
        x, x64 = _rounded(xn, dtype)
        dyn = rng.uniform(-1, 1, ys) * (rng.random(ys) >= dy_sparsity)
        dyn[0, 0, 0, 0] = 0.5
        dy, dy64 = _rounded(dyn, dtype)
        tf_df = _tf_filter_grad(x, fshape, dy, shape)
        tf_db = tf.raw_ops.BiasAddGrad(out_backprop=tf.constant(dy64),
                                       data_format="NHWC").numpy()
        for thr in (0.0, 1.0, 0.5, -1.0):
            df, db, st = _op(x, fshape, dy, thr, shape)
            assert df.dtype == dtype and db.dtype == dtype
            assert db.shape == (co,)
            assert st.numpy()[S.NNZ] == np.count_nonzero(x64)
            _assert_filter(df, x64, fshape, dy64, shape, dtype,
                           rounds=1 if thr == 1.0 else 2,
                           tf_result=None if thr == 1.0 else tf_df)
            _assert_bias(db, dy64, dtype)
            # TensorFlow's bias_add gradient of the same dY (float64).
            _assert_bias(tf.constant(tf_db), dy64, tf.float64)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_onednn_fused_kernel_mode(shape, monkeypatch):
    """TFSS_CONV_BIAS_GRAD=fused (read when the op is created: a fresh
    tf.function): the dense images' dF and db from oneDNN's fused kernel
    where it exists (float32 SAME/VALID), the sparse images' db from the
    pass; every plan against the float64 references."""
    monkeypatch.setenv("TFSS_CONV_BIAS_GRAD", "fused")
    dtype = tf.float32
    rng = np.random.default_rng([len(str(shape)), 11])
    n, h, w, ci, kh, kw, co = shape[:7]
    fshape = [kh, kw, ci, co]
    xn = random_sparse_images((n, h, w, ci), 0.6, rng, np.float64)
    xn[0] = 0.0
    xn[-1, 0, 0, 0] = 0.75
    x, x64 = _rounded(xn, dtype)
    dy, dy64 = _rounded(rng.uniform(-1, 1, _out_shape(shape)), dtype)
    for thr in (0.0, 1.0, 0.5, -1.0):
        fn = tf.function(lambda a, b, t=thr: _op(a, fshape, b, t, shape))
        df, db, _ = fn(x, dy)
        _assert_filter(df, x64, fshape, dy64, shape, dtype,
                       rounds=1 if thr == 1.0 else 2,
                       tf_result=None if thr == 1.0 else
                       _tf_filter_grad(x, fshape, dy, shape))
        _assert_bias(db, dy64, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_filter_grad_equals_plain_op(dtype):
    """The filter gradient is the plain SparseSplitConv2DBackpropFilter's,
    bit for bit, at thresholds where neither runs oneDNN's fused kernel
    (all-sparse) and, in float32, the bias equals TF's BiasAddGrad to
    rounding; the op is deterministic."""
    rng = np.random.default_rng(5)
    shape = (4, 10, 10, 8, 3, 3, 16, 1, "SAME", 1)
    x, _ = _rounded(random_sparse_images((4, 10, 10, 8), 0.7, rng,
                                         np.float64), dtype)
    dy, dy64 = _rounded(rng.uniform(-1, 1, (4, 10, 10, 16)), dtype)
    lib = load_library()
    df, db, _ = _op(x, [3, 3, 8, 16], dy, 1.0, shape)
    plain, _ = lib.tf_sparse_split_sparse_split_conv2d_backprop_filter(
        x, [3, 3, 8, 16], dy, tf.constant(1.0, tf.float32),
        strides=[1, 1, 1, 1], padding="SAME")
    np.testing.assert_array_equal(tf.cast(df, tf.float64).numpy(),
                                  tf.cast(plain, tf.float64).numpy())
    for thr in (0.0, 0.5, 1.0):
        a = _op(x, [3, 3, 8, 16], dy, thr, shape)
        b = _op(x, [3, 3, 8, 16], dy, thr, shape)
        for u, v in zip(a[:2], b[:2]):
            np.testing.assert_array_equal(tf.cast(u, tf.float64).numpy(),
                                          tf.cast(v, tf.float64).numpy())
    if dtype == tf.float32:
        tf_db = tf.raw_ops.BiasAddGrad(out_backprop=dy, data_format="NHWC")
        np.testing.assert_allclose(db.numpy(), tf_db.numpy(), rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_empty_dimensions(dtype):
    """N = 0: zero gradients of the right shapes; C_in = 0: a zero filter
    gradient, and the bias gradient still sums dY."""
    rng = np.random.default_rng(9)
    shape = (0, 5, 5, 3, 3, 3, 4, 1, "SAME", 1)
    df, db, _ = _op(tf.zeros((0, 5, 5, 3), dtype), [3, 3, 3, 4],
                    tf.zeros((0, 5, 5, 4), dtype), -1.0, shape)
    assert df.shape == (3, 3, 3, 4) and db.shape == (4,)
    assert not tf.reduce_any(tf.cast(db, tf.float32) != 0)
    shape = (2, 5, 5, 0, 3, 3, 4, 1, "SAME", 1)
    dy, dy64 = _rounded(rng.uniform(-1, 1, (2, 5, 5, 4)), dtype)
    df, db, _ = _op(tf.zeros((2, 5, 5, 0), dtype), [3, 3, 0, 4], dy, -1.0,
                    shape)
    assert df.shape == (3, 3, 0, 4)
    _assert_bias(db, dy64, dtype)


def test_bad_inputs():
    x = tf.zeros((2, 6, 6, 3))
    dy = tf.ones((2, 6, 6, 4))
    shape = (2, 6, 6, 3, 3, 3, 4, 1, "SAME", 1)
    with pytest.raises(tf.errors.InvalidArgumentError, match="out_backprop"):
        _op(x, [3, 3, 3, 4], tf.ones((2, 6, 6, 5)), -1.0, shape)
    with pytest.raises(tf.errors.InvalidArgumentError, match="out_backprop"):
        _op(x, [3, 3, 3, 4], tf.ones((2, 5, 6, 4)), -1.0, shape)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError),
                       match="rank"):
        _op(tf.zeros((6, 6, 3)), [3, 3, 3, 4], dy, -1.0, shape)
    with pytest.raises(tf.errors.InvalidArgumentError, match="threshold"):
        _op(x, [3, 3, 3, 4], dy, 1.5, shape)
    with pytest.raises(tf.errors.InvalidArgumentError, match="threshold"):
        _op(x, [3, 3, 3, 4], dy, float("nan"), shape)
    with pytest.raises(tf.errors.InvalidArgumentError, match="filter_sizes"):
        _op(x, [3, 3, 3, -4], dy, -1.0, shape)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError),
                       match="channels|filter"):
        _op(x, [3, 3, 2, 4], dy, -1.0, shape)
    with pytest.raises((TypeError, tf.errors.InvalidArgumentError,
                        ValueError)):
        _op(x, [3, 3, 3, 4], tf.cast(dy, tf.float64), -1.0, shape)


def test_nan_in_dy_propagates_to_bias():
    x = tf.constant(random_sparse_images((2, 5, 5, 3), 0.5,
                                         np.random.default_rng(1)))
    dy = np.ones((2, 5, 5, 4), np.float32)
    dy[1, 2, 2, 1] = np.nan
    shape = (2, 5, 5, 3, 3, 3, 4, 1, "SAME", 1)
    for thr in (0.0, 1.0, -1.0):
        _, db, _ = _op(x, [3, 3, 3, 4], tf.constant(dy), thr, shape)
        db = db.numpy()
        assert np.isnan(db[1]) and np.isfinite(db[[0, 2, 3]]).all()


def _layer_grads(dtype, strides, padding, sparsity):
    rng = np.random.default_rng([strides, int(sparsity * 10), dtype.size])
    x, x64 = _rounded(random_sparse_images((3, 9, 9, 6), sparsity, rng,
                                           np.float64), dtype)
    f, f64 = _rounded(rng.uniform(-0.5, 0.5, (3, 3, 6, 10)), dtype)
    b, b64 = _rounded(rng.uniform(-0.2, 0.2, 10), dtype)

    def loss_of(fn, xx, ff, bb):
        with tf.GradientTape() as tape:
            tape.watch([xx, ff, bb])
            y = fn(xx, ff, bb)
            w = tf.cast(tf.reshape(tf.linspace(-1.0, 1.0, tf.size(y)),
                                   tf.shape(y)), y.dtype)
            loss = tf.reduce_sum(tf.cast(y * w, tf.float64))
        return tape.gradient(loss, [xx, ff, bb])

    def ours(xx, ff, bb):
        return tfss.sparse_split_conv2d(xx, ff, strides, padding, bias=bb)

    def theirs(xx, ff, bb):
        return tf.nn.bias_add(tf.nn.conv2d(xx, ff, strides, padding), bb)

    ref = loss_of(theirs, tf.constant(x64), tf.constant(f64),
                  tf.constant(b64))
    return [loss_of(fn, x, f, b) for fn in (ours, tf.function(ours))], ref


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("strides", [1, 2])
def test_layer_gradients_match_bias_add(dtype, strides):
    """d/dx, d/df, d/db of sparse_split_conv2d(..., bias=) against the
    float64 gradients of tf.nn.bias_add(tf.nn.conv2d(...)), eager and
    under tf.function."""
    tol = {tf.float32: 1e-5, tf.float64: 1e-12, tf.bfloat16: 3e-2,
           tf.float16: 4e-3}[dtype]
    runs, ref = _layer_grads(dtype, strides, "SAME", 0.6)
    for got in runs:
        for g, r in zip(got, ref):
            g = tf.cast(g, tf.float64).numpy()
            r = r.numpy()
            scale = np.abs(r).max() + 1e-30
            assert np.abs(g - r).max() <= tol * scale * 4, \
                (np.abs(g - r).max(), scale)


def _graph_ops(graph):
    """Op types of a graph and of every function its ops call (cond
    branches), keyed by function name ('' for the graph itself)."""
    gd = graph.as_graph_def()
    out = {"": [n.op for n in gd.node]}
    for fn in gd.library.function:
        out[fn.signature.name] = [n.op for n in fn.node_def]
    return out


@pytest.mark.parametrize("strides", [1, 2])
def test_no_separate_bias_add_grad_in_training_graph(strides):
    """A training step through a SparseSplitConv2D layer with a bias (after
    another layer, so the tf.cond between the two filter-gradient
    formulations is built at stride 1) holds the fused filter + bias
    gradient op and no BiasAddGrad outside the branch over dY's zeros."""
    import keras

    first = tfss.layers.SparseSplitConv2D(6, 3, padding="same",
                                          activation="relu")
    conv = tfss.layers.SparseSplitConv2D(8, 3, strides=strides,
                                         padding="same")
    x = tf.constant(random_sparse_images((2, 8, 8, 3), 0.5,
                                         np.random.default_rng(0)))
    first(x)
    conv(first(x))
    variables = first.trainable_variables + conv.trainable_variables

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(conv(first(x)) ** 2)
        return tape.gradient(loss, variables)

    graph = step.get_concrete_function(x).graph
    ops = _graph_ops(graph)
    fused = "TfSparseSplit>SparseSplitConv2DBackpropFilterWithBias"
    everywhere = [t for types in ops.values() for t in types]
    assert everywhere.count(fused) >= 2, ops
    # Only the branch over dY (stride 1) may sum the bias separately.
    for name, types in ops.items():
        if "BiasAddGrad" in types:
            assert strides == 1 and name, (name, types)
            assert fused not in types
    assert "BiasAddGrad" not in ops[""]
    grads = step(x)
    assert all(g is not None for g in grads)
    del keras
