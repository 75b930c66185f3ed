"""SparseSplitConv2D and SparseSplitConv2DBackpropFilter in bfloat16 and
float16 against float64 references of the dtype-rounded inputs.

The contract is TensorFlow's CPU kernels' for those dtypes: values stored in
the dtype, products accumulated in float32, each output rounded once to the
dtype. For a result ``ref = sum_i a_i b_i`` over a reduction of length ``L``
(``KH*KW*C_in`` forward, ``N*OH*OW`` for the filter gradient) the bound is
``u_T * |ref| + 2 * L * u_32 * sum_i |a_i b_i|`` per element (``u`` the unit
roundoff, 2^-8 for bfloat16, 2^-11 for float16, 2^-24 for float32); each
further rounding of an intermediate (a split filter gradient's dense part,
an epilogue in the dtype) adds ``u_T * sum_i |a_i b_i|``. Where the
dense part is TensorFlow's own kernel in the dtype, an element may also be
as far from the reference as TensorFlow's own result for it (plus one
rounding): the ops are never held to a tighter bound than the kernel they
replace.
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_sparse_split as tfss
from tf_sparse_split._loader import load_library
from tf_sparse_split.testing import (random_sparse_images, reference_conv2d,
                                     reference_conv2d_filter_grad)
from tf_sparse_split.tuning import stats as S

pytestmark = pytest.mark.usefixtures("op_library")

DTYPES = [tf.bfloat16, tf.float16]
#: Unit roundoff (half the machine epsilon) of each dtype.
UNIT = {tf.bfloat16: 2.0 ** -8, tf.float16: 2.0 ** -11}
U32 = 2.0 ** -24
#: float16's subnormal spacing: an absolute floor for results near zero.
TINY = {tf.bfloat16: 1e-38, tf.float16: 2.0 ** -24}

# (N, H, W, C_in, KH, KW, C_out, strides, padding, dilations)
SHAPES = [
    (2, 9, 9, 8, 3, 3, 16, 1, "SAME", 1),
    (3, 8, 7, 5, 3, 3, 7, 2, "VALID", 1),
    (1, 12, 12, 16, 1, 1, 33, 1, "VALID", 1),
    (4, 10, 10, 3, 3, 3, 9, 1, "SAME", 2),
    (2, 7, 9, 13, 3, 2, 17, (2, 1), "SAME", 1),
    (2, 8, 8, 6, 3, 3, 5, 1, [[0, 0], [1, 0], [2, 1], [0, 0]], 1),
]


def _rounded(a, dtype):
    """``a`` rounded to ``dtype`` (a tensor) and its exact float64 value."""
    t = tf.cast(tf.constant(a, tf.float32), dtype)
    return t, tf.cast(t, tf.float64).numpy()


def _explicit(padding):
    if isinstance(padding, list):
        return "EXPLICIT", [p for pair in padding for p in pair]
    return padding, None


def _assert_within(got, ref, abs_sum, length, dtype, rounds=1, tf_result=None):
    """|got - ref| <= u_T |ref| + (rounds - 1) u_T sum|a b| + 2 L u_32
    sum|a b| (+ the float16 subnormal floor), or within TensorFlow's own
    error plus one rounding."""
    got = tf.cast(got, tf.float64).numpy()
    assert got.shape == ref.shape
    tol = (UNIT[dtype] * (np.abs(ref) + (rounds - 1) * abs_sum) +
           2.0 * length * U32 * abs_sum + TINY[dtype])
    if tf_result is not None:
        tf_err = np.abs(tf.cast(tf_result, tf.float64).numpy() - ref)
        tol = np.maximum(tol, tf_err + UNIT[dtype] * np.abs(ref) + TINY[dtype])
    err = np.abs(got - ref)
    bad = ~(err <= tol)
    assert not bad.any(), (
        f"{int(bad.sum())} of {bad.size} values off: worst err "
        f"{err[bad].max()} vs tol {tol[bad].min()}")


def _inputs(shape, sparsity, dtype, rng):
    n, h, w, ci, kh, kw, co = shape[:7]
    x = random_sparse_images((n, h, w, ci), sparsity, rng)
    x.reshape(-1)[rng.integers(x.size)] = 0.75  # a real nonzero
    f = rng.uniform(-1, 1, (kh, kw, ci, co)).astype(np.float32)
    return _rounded(x, dtype), _rounded(f, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("sparsity", [0.0, 0.6, 0.95])
def test_forward_matches_float64_reference(dtype, shape, sparsity):
    """All-sparse (threshold 1: the float32 sparse kernels, the strict
    bound), all-dense (threshold 0: TF's kernel in the dtype), a split and
    automatic calls."""
    rng = np.random.default_rng([len(str(shape)), int(sparsity * 100),
                                 dtype.size])
    strides, padding, dil = shape[7:]
    pad, explicit = _explicit(padding)
    (x, x64), (f, f64) = _inputs(shape, sparsity, dtype, rng)
    ref = reference_conv2d(x64, f64, strides, pad, dil, explicit)
    abs_sum = reference_conv2d(np.abs(x64), np.abs(f64), strides, pad, dil,
                               explicit)
    length = shape[4] * shape[5] * shape[3]
    tf_y = tf.nn.conv2d(x, f, strides, padding, dilations=dil)
    for thr in (0.0, 1.0, 0.5, -1.0):
        y, st = tfss.sparse_split_conv2d(x, f, strides, padding, dilations=dil,
                                         threshold=thr, return_stats=True)
        assert y.dtype == dtype
        st = st.numpy()
        assert st[S.ROWS_DENSE] + st[S.ROWS_SPARSE] == shape[0]
        assert st[S.NNZ] == np.count_nonzero(x64)
        _assert_within(y, ref, abs_sum, length, dtype,
                       tf_result=None if thr == 1.0 else tf_y)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("kernel", ["direct", "csr"])
def test_forward_both_sparse_kernels(dtype, kernel, monkeypatch):
    """The direct and the pixel-CSR kernel, both in float32 on the widened
    images, give the bound at several sparsities (with all-zero images)."""
    monkeypatch.setenv("TFSS_CONV_SPARSE_KERNEL", kernel)
    rng = np.random.default_rng(7)
    for sparsity in (0.3, 0.8, 0.99):
        x = random_sparse_images((5, 11, 10, 24), sparsity, rng)
        x[1] = 0.0  # an all-zero image
        x[0, 0, 0, 0] = 0.5
        (xt, x64) = _rounded(x, dtype)
        ft, f64 = _rounded(rng.uniform(-1, 1, (3, 3, 24, 40)), dtype)
        ref = reference_conv2d(x64, f64, 1, "SAME")
        abs_sum = reference_conv2d(np.abs(x64), np.abs(f64), 1, "SAME")
        y = tfss.sparse_split_conv2d(xt, ft, 1, "SAME", threshold=1.0)
        _assert_within(y, ref, abs_sum, 9 * 24, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("activation", [None, "relu", "relu6"])
def test_fused_bias_activation(dtype, activation):
    """act(conv + bias) in the dtype, every plan: the sparse images get the
    bias and activation in float32 before the one rounding (fused dense
    kernel) or in the dtype after it (Conv2D + epilogue), as the dense
    part; either way within the bound of one more rounding."""
    rng = np.random.default_rng(11)
    x = random_sparse_images((4, 9, 9, 12), 0.7, rng)
    x[0, 0, 0, 0] = 1.0
    (xt, x64) = _rounded(x, dtype)
    ft, f64 = _rounded(rng.uniform(-0.6, 0.6, (3, 3, 12, 20)), dtype)
    bt, b64 = _rounded(rng.uniform(-1, 1, 20) * 3.0, dtype)
    conv = reference_conv2d(x64, f64, 1, "SAME")
    abs_sum = reference_conv2d(np.abs(x64), np.abs(f64), 1, "SAME") + np.abs(b64)
    pre = conv + b64
    ref = pre if activation is None else np.maximum(pre, 0.0)
    if activation == "relu6":
        ref = np.minimum(ref, 6.0)
    tf_y = tf.nn.bias_add(tf.nn.conv2d(xt, ft, 1, "SAME"), bt)
    if activation == "relu":
        tf_y = tf.nn.relu(tf_y)
    elif activation == "relu6":
        tf_y = tf.nn.relu6(tf_y)
    for thr in (0.0, 1.0, 0.6, -1.0):
        y = tfss.sparse_split_conv2d(xt, ft, 1, "SAME", threshold=thr, bias=bt,
                                     activation=activation)
        assert y.dtype == dtype
        _assert_within(y, ref, abs_sum, 9 * 12 + 1, dtype, rounds=2,
                       tf_result=None if thr == 1.0 else tf_y)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_filter_grad_matches_float64_reference(dtype, shape):
    """SparseSplitConv2DBackpropFilter: reduction length N*OH*OW; all-sparse
    (threshold 1) rounds once, a split twice; TF's dense kernel (oneDNN's,
    or Eigen's where oneDNN is not used, e.g. EXPLICIT padding) is held to
    TF's own error for it."""
    lib = load_library()
    rng = np.random.default_rng([7, len(str(shape)), dtype.size])
    strides, padding, dil = shape[7:]
    pad, explicit = _explicit(padding)
    (x, x64), (f, _) = _inputs(shape, 0.7, dtype, rng)
    y = tf.nn.conv2d(tf.cast(x, tf.float32), tf.cast(f, tf.float32), strides,
                     padding, dilations=dil)
    dy, dy64 = _rounded(rng.uniform(-1, 1, y.shape) *
                        (rng.random(y.shape) > 0.3), dtype)
    fshape = list(f.shape)
    ref = reference_conv2d_filter_grad(x64, fshape, dy64, strides, pad, dil,
                                       explicit)
    abs_sum = reference_conv2d_filter_grad(np.abs(x64), fshape, np.abs(dy64),
                                           strides, pad, dil, explicit)
    length = int(np.prod(dy.shape[:3]))
    st4 = [1, strides, strides, 1] if isinstance(strides, int) else \
        [1, strides[0], strides[1], 1]
    d4 = [1, dil, dil, 1]
    ex = explicit or []
    try:
        tf_df = tf.raw_ops.Conv2DBackpropFilter(
            input=x, filter_sizes=fshape, out_backprop=dy, strides=st4,
            padding=pad, explicit_paddings=ex, dilations=d4)
    except tf.errors.InvalidArgumentError:
        # TF's Eigen kernel (oneDNN off) refuses dilations > 1; the op then
        # runs every call on its sparse path (the strict bound).
        tf_df = None
    for thr in (1.0, 0.0, 0.5, -1.0):
        df, st = lib.tf_sparse_split_sparse_split_conv2d_backprop_filter(
            x, fshape, dy, tf.constant(thr, tf.float32), strides=st4,
            padding=pad, explicit_paddings=ex, dilations=d4)
        assert df.dtype == dtype
        assert st.numpy()[S.NNZ] == np.count_nonzero(x64)
        _assert_within(df, ref, abs_sum, length, dtype,
                       rounds=1 if thr == 1.0 else 2,
                       tf_result=None if thr == 1.0 or tf_df is None
                       else tf_df)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("strides", [1, 2])
def test_gradients_through_tape(dtype, strides):
    """d/dx, d/dfilter, d/dbias of sum(w * relu(conv(x, f) + b)) in the
    dtype, eager and under tf.function, against float64 gradients of the
    rounded inputs masked where the op's own output is positive."""
    rng = np.random.default_rng(21 + strides)
    x = random_sparse_images((3, 10, 10, 8), 0.6, rng)
    x[0, 0, 0, 0] = 0.5
    (xt, x64) = _rounded(x, dtype)
    ft, f64 = _rounded(rng.uniform(-0.5, 0.5, (3, 3, 8, 12)), dtype)
    bt, b64 = _rounded(rng.uniform(-0.2, 0.2, 12), dtype)

    def ours(x, f, b):
        y = tfss.sparse_split_conv2d(x, f, strides, "SAME", bias=b,
                                     activation="relu")
        return y

    def grads(fn):
        with tf.GradientTape() as tape:
            tape.watch([xt, ft, bt])
            y = fn(xt, ft, bt)
            w = tf.cast(tf.constant(
                np.linspace(-1, 1, int(np.prod(y.shape))).reshape(y.shape),
                tf.float32), dtype)
            loss = tf.reduce_sum(tf.cast(y * w, tf.float32))
        return y, w, tape.gradient(loss, [xt, ft, bt])

    for fn in (ours, tf.function(ours)):
        y, w, (dx, df, db) = grads(fn)
        assert dx.dtype == dtype and df.dtype == dtype and db.dtype == dtype
        mask = tf.cast(y, tf.float64).numpy() > 0
        dy64 = tf.cast(w, tf.float64).numpy() * mask
        x64t, f64t, dy64t = (tf.constant(v) for v in (x64, f64, dy64))
        with tf.GradientTape() as tape:
            tape.watch([x64t, f64t])
            y64 = tf.nn.conv2d(x64t, f64t, strides, "SAME")
        rdx, rdf = tape.gradient(y64, [x64t, f64t], output_gradients=dy64t)
        ax, af = tf.abs(x64t), tf.abs(f64t)
        with tf.GradientTape() as tape:
            tape.watch([ax, af])
            y64 = tf.nn.conv2d(ax, af, strides, "SAME")
        adx, adf = tape.gradient(y64, [ax, af],
                                 output_gradients=tf.abs(dy64t))
        # TF's own gradient kernels in the dtype on the same masked dY (the
        # input gradient at stride 2 is TF's Conv2DBackpropInput).
        dyt = tf.cast(dy64t, dtype)
        st4 = [1, strides, strides, 1]
        tf_dx = tf.raw_ops.Conv2DBackpropInput(
            input_sizes=tf.shape(xt), filter=ft, out_backprop=dyt,
            strides=st4, padding="SAME")
        tf_df = tf.raw_ops.Conv2DBackpropFilter(
            input=xt, filter_sizes=tf.shape(ft), out_backprop=dyt,
            strides=st4, padding="SAME")
        _assert_within(dx, rdx.numpy(), adx.numpy(), 9 * 12, dtype, rounds=2,
                       tf_result=tf_dx)
        _assert_within(df, rdf.numpy(), adf.numpy(),
                       int(np.prod(y.shape[:3])), dtype, rounds=2,
                       tf_result=tf_df)
        rdb = dy64.sum(axis=(0, 1, 2))
        adb = np.abs(dy64).sum(axis=(0, 1, 2))
        length = int(np.prod(dy64.shape[:3]))
        # The bias gradient: summed in float32, rounded once.
        tol = UNIT[dtype] * np.abs(rdb) + 2.0 * length * U32 * adb + \
            TINY[dtype]
        np.testing.assert_array_less(
            np.abs(tf.cast(db, tf.float64).numpy() - rdb), tol + 1e-30)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_empty_and_nonfinite(dtype):
    """An empty batch gives an empty output; NaN/Inf in the input propagate
    on every path (the sparse part widens them exactly)."""
    f = tf.cast(tf.ones([3, 3, 4, 5]), dtype)
    y = tfss.sparse_split_conv2d(tf.zeros([0, 6, 6, 4], dtype), f, 1, "SAME")
    assert y.shape == (0, 6, 6, 5) and y.dtype == dtype
    x = np.zeros((2, 6, 6, 4), np.float32)
    x[0, 2, 2, 1] = np.nan
    x[1, 3, 3, 2] = np.inf
    xt = tf.cast(x, dtype)
    want = tf.cast(tf.nn.conv2d(tf.cast(xt, tf.float32), tf.ones([3, 3, 4, 5]),
                                1, "SAME"), tf.float64).numpy()
    for thr in (1.0, 0.0):
        got = tf.cast(tfss.sparse_split_conv2d(xt, f, 1, "SAME", threshold=thr),
                      tf.float64).numpy()
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        fin = np.isfinite(want)
        np.testing.assert_array_equal(got[~fin & ~np.isnan(want)],
                                      want[~fin & ~np.isnan(want)])
        np.testing.assert_array_equal(got[fin], want[fin])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_counts_on_the_bits(dtype):
    """The 16-bit counts: -0.0 is a zero, NaN/Inf and the smallest
    subnormals are nonzeros; the count covers pixels whose channels fill a
    32-value vector and a tail."""
    rng = np.random.default_rng(2)
    x = random_sparse_images((3, 5, 5, 37), 0.8, rng)
    x[0, 0, 0, :5] = -0.0
    x[1, 2, 2, 3] = np.nan
    x[2, 4, 4, 36] = np.inf
    xt = tf.cast(x, dtype)
    tiny = np.asarray(tf.cast(tf.constant(
        [np.finfo(np.float32).tiny if dtype == tf.bfloat16 else 2.0 ** -24],
        tf.float32), dtype))
    xt = tf.tensor_scatter_nd_update(xt, [[0, 1, 1, 33]], tiny)
    x64 = tf.cast(xt, tf.float64).numpy()
    assert x64[0, 1, 1, 33] != 0.0
    f = tf.cast(rng.uniform(-1, 1, (1, 1, 37, 4)), dtype)
    for thr in (1.0, 0.0, 0.5):
        _, st = tfss.sparse_split_conv2d(xt, f, 1, "VALID", threshold=thr,
                                         return_stats=True)
        st = st.numpy()
        assert st[S.NNZ] == np.count_nonzero(x64)
        assert st[S.HISTOGRAM].sum() == 3


def test_bad_dtypes():
    """Differing dtypes of input, filter and bias, and dtypes the op does
    not take, are InvalidArgumentError (never a silent cast)."""
    x = tf.ones([1, 4, 4, 2], tf.bfloat16)
    with pytest.raises(tf.errors.InvalidArgumentError, match="dtype"):
        tfss.sparse_split_conv2d(x, tf.ones([1, 1, 2, 3], tf.float32), 1,
                                 "VALID")
    with pytest.raises(tf.errors.InvalidArgumentError, match="dtype"):
        tfss.sparse_split_conv2d(tf.ones([1, 4, 4, 2], tf.float16),
                                 tf.ones([1, 1, 2, 3], tf.bfloat16), 1, "VALID")
    with pytest.raises(tf.errors.InvalidArgumentError, match="dtype"):
        tfss.sparse_split_conv2d(x, tf.ones([1, 1, 2, 3], tf.bfloat16), 1,
                                 "VALID", bias=tf.ones([3], tf.float32))
    with pytest.raises(tf.errors.InvalidArgumentError, match="int32"):
        tfss.sparse_split_conv2d(tf.ones([1, 4, 4, 2], tf.int32),
                                 tf.ones([1, 1, 2, 3], tf.int32), 1, "VALID")
    lib = load_library()
    with pytest.raises((tf.errors.InvalidArgumentError, TypeError)):
        lib.tf_sparse_split_sparse_split_conv2d_backprop_filter(
            x, [1, 1, 2, 3], tf.ones([1, 4, 4, 3], tf.float32),
            tf.constant(-1.0), strides=[1, 1, 1, 1], padding="VALID")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_rewrite_replaces_low_precision_conv2d(rw, dtype):
    """The rewrite pass replaces a bfloat16 / float16 Conv2D fed by a ReLU
    (the target op now takes the dtype); the result stays within the
    bound."""
    rw.enable(ops=("Conv2D",))
    rng = np.random.default_rng(5)
    xt, x64 = _rounded(rng.standard_normal((2, 9, 9, 6)), dtype)
    ft, f64 = _rounded(rng.uniform(-1, 1, (3, 3, 6, 8)), dtype)
    fn = tf.function(lambda x: tf.nn.conv2d(tf.nn.relu(x), ft, 1, "SAME",
                                            name="cv_low"))
    got = fn(xt)
    assert got.dtype == dtype
    assert rw.counters().get("Conv2D") == 1
    r64 = np.maximum(x64, 0.0)
    ref = reference_conv2d(r64, f64, 1, "SAME")
    abs_sum = reference_conv2d(r64, np.abs(f64), 1, "SAME")
    _assert_within(got, ref, abs_sum, 54, dtype,
                   tf_result=tf.nn.conv2d(tf.nn.relu(xt), ft, 1, "SAME"))
