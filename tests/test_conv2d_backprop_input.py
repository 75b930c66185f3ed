"""SparseSplitConv2DBackpropInput: the stride-1 input gradient of a
convolution on the original filter (TensorFlow's Conv2DBackpropInput for the
dense images of dY, the forward sparse kernels on a filter rotated inside
the kernel for the sparse ones), against a float64 numpy reference, and the
gradient graph of SparseSplitConv2D that uses it (no rotated filter)."""

import numpy as np
import pytest
import tensorflow as tf

import tf_sparse_split as tfss
from tf_sparse_split import testing as T
from tf_sparse_split._loader import load_library
from tf_sparse_split.ops import conv2d as conv_ops
from tf_sparse_split.tuning import stats as S

pytestmark = pytest.mark.usefixtures("op_library")

bpi = conv_ops.sparse_split_conv2d_backprop_input

# (x shape, filter shape, padding, dilations)
CASES = [
    ((3, 9, 11, 4), (3, 3, 4, 6), "SAME", 1),
    ((2, 9, 11, 3), (3, 2, 3, 5), "VALID", 1),
    ((2, 10, 9, 5), (5, 5, 5, 17), "SAME", 1),               # 5x5, odd C
    ((2, 9, 11, 3), (3, 3, 3, 5), [[0, 0], [1, 0], [2, 1], [0, 0]], 1),
    ((2, 8, 8, 3), (2, 2, 3, 4), "SAME", 1),                  # even filter
    ((2, 12, 10, 3), (3, 3, 3, 4), "SAME", 2),                # dilated
    ((2, 12, 10, 3), (3, 3, 3, 4), "VALID", (2, 1)),
    ((2, 12, 10, 3), (3, 3, 3, 4), [[0, 0], [4, 1], [0, 3], [0, 0]], 2),
    ((1, 7, 6, 8), (1, 1, 8, 9), "VALID", 1),                 # 1x1
    ((4, 6, 6, 16), (3, 3, 16, 32), "SAME", 1),               # wider C
]


def _ids(case):
    xs, fs, pad, d = case
    pad = pad if isinstance(pad, str) else "EXPLICIT"
    return f"{xs[1]}x{xs[2]}x{xs[3]}-{fs[0]}x{fs[1]}x{fs[3]}-d{d}-{pad}"


def _pads(xs, fs, padding, dilations):
    """(pad_top, pad_left, OH, OW) of the stride-1 convolution."""
    dh, dw = (dilations, dilations) if isinstance(dilations, int) else dilations
    ekh, ekw = (fs[0] - 1) * dh, (fs[1] - 1) * dw
    if isinstance(padding, list):
        (pt, pb), (pl, pr) = padding[1], padding[2]
    elif padding == "SAME":
        pt, pb, pl, pr = ekh // 2, ekh - ekh // 2, ekw // 2, ekw - ekw // 2
    else:
        pt = pb = pl = pr = 0
    return pt, pl, xs[1] + pt + pb - ekh, xs[2] + pl + pr - ekw, dh, dw


def reference_dx(xs, f, dy, padding, dilations):
    """dX[n, h, w, i] = sum dY[n, oh, ow, o] f[a, b, i, o] over h = oh -
    pad_top + a*d (likewise w), in float64 numpy."""
    f = np.asarray(f, np.float64)
    dy = np.asarray(dy, np.float64)
    pt, pl, oh, ow, dh, dw = _pads(xs, f.shape, padding, dilations)
    dx = np.zeros(xs, np.float64)
    for a in range(f.shape[0]):
        for b in range(f.shape[1]):
            # output rows r with 0 <= r - pt + a*dh < H
            r0, r1 = max(0, pt - a * dh), min(oh, xs[1] + pt - a * dh)
            c0, c1 = max(0, pl - b * dw), min(ow, xs[2] + pl - b * dw)
            if r0 >= r1 or c0 >= c1:
                continue
            h0, w0 = r0 - pt + a * dh, c0 - pl + b * dw
            dx[:, h0:h0 + r1 - r0, w0:w0 + c1 - c0, :] += np.einsum(
                "nhwo,io->nhwi", dy[:, r0:r1, c0:c1, :], f[a, b])
    return dx


def _dy(xs, fs, padding, dilations, sparsity, rng, zero_channels=0.0):
    _, _, oh, ow, _, _ = _pads(xs, fs, padding, dilations)
    dy = T.random_sparse_images((xs[0], oh, ow, fs[3]), sparsity, rng,
                                np.float64, zero_channels=zero_channels)
    if dy.size:
        dy.flat[rng.integers(dy.size)] = 0.75  # never all zero
    return dy


@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9, 0.99])
def test_matches_float64_reference(case, sparsity):
    xs, fs, padding, dil = case
    rng = np.random.default_rng([len(_ids(case)), int(sparsity * 100), xs[3]])
    f = rng.normal(size=fs)
    dy = _dy(xs, fs, padding, dil, sparsity, rng)
    ref = reference_dx(xs, f, dy, padding, dil)
    for dtype, tol in ((tf.float32, 1e-5), (tf.float64, 1e-12)):
        ft, dyt = tf.constant(f, dtype), tf.constant(dy, dtype)
        for thr in (-1.0, 0.0, 1.0, 0.5):
            dx, st = bpi(xs, ft, dyt, padding, dil, threshold=thr,
                         return_stats=True)
            assert dx.dtype == dtype and dx.shape == xs
            assert T.relative_error(dx, ref) <= tol, (dtype.name, thr)
            st = st.numpy()
            assert st[S.NNZ] == np.count_nonzero(dy), thr
            assert st[S.ROWS_DENSE] + st[S.ROWS_SPARSE] == xs[0]
            if thr == 1.0:
                assert st[S.ROWS_DENSE] == 0
            if thr == 0.0 and sparsity < 0.99 and (dil == 1 or
                                                    dtype == tf.float32
                                                    and isinstance(padding, str)):
                assert st[S.ROWS_SPARSE] == 0


@pytest.mark.parametrize("kernel", ["direct", "csr"])
def test_both_sparse_kernels_and_compaction(kernel, monkeypatch):
    """Either sparse kernel on the rotated filter; a split with input
    channels of dY zero in every image (compacted from the dense part's dY
    and filter) and all-zero images."""
    monkeypatch.setenv("TFSS_CONV_SPARSE_KERNEL", kernel)
    rng = np.random.default_rng(11)
    xs, fs = (6, 9, 8, 7), (3, 3, 7, 12)
    f = rng.normal(size=fs)
    dy = _dy(xs, fs, "SAME", 1, 0.0, rng, zero_channels=0.4)
    # Images of decreasing density: 0%, 50%, 90% ... zeros, one all zero.
    for i, s in enumerate((0.0, 0.5, 0.9, 0.97)):
        dy[i] *= rng.uniform(size=dy[i].shape) >= s
    dy[4] = 0.0
    ref = reference_dx(xs, f, dy, "SAME", 1)
    for thr in (0.3, 1.0, -1.0):
        dx, st = bpi(xs, tf.constant(f, tf.float32),
                     tf.constant(dy, tf.float32), "SAME", threshold=thr,
                     return_stats=True)
        assert T.relative_error(dx, ref) <= 1e-5, thr
        if thr == 0.3:
            st = st.numpy()
            assert 0 < st[S.ROWS_SPARSE] < xs[0]


def test_batch_zero_one_and_empty_dims():
    rng = np.random.default_rng(3)
    for xs, fs in (((0, 5, 5, 3), (3, 3, 3, 4)), ((1, 5, 5, 3), (3, 3, 3, 4)),
                   ((2, 5, 5, 0), (3, 3, 0, 4)), ((2, 5, 5, 3), (3, 3, 3, 0))):
        f = rng.normal(size=fs)
        dy = _dy(xs, fs, "SAME", 1, 0.5, rng)
        ref = reference_dx(xs, f, dy, "SAME", 1)
        for thr in (-1.0, 0.0, 1.0):
            dx, st = bpi(list(xs), tf.constant(f, tf.float32),
                         tf.constant(dy, tf.float32), "SAME", threshold=thr,
                         return_stats=True)
            assert dx.shape == xs and st.shape == (S.NUM_STATS,)
            np.testing.assert_allclose(dx, ref, rtol=1e-5, atol=1e-5)


def test_deterministic_bits():
    rng = np.random.default_rng(5)
    xs, fs = (4, 10, 10, 8), (3, 3, 8, 16)
    f = tf.constant(rng.normal(size=fs), tf.float32)
    dy = tf.constant(_dy(xs, fs, "SAME", 1, 0.8, rng), tf.float32)
    for thr in (1.0, 0.0, 0.5):
        a = bpi(xs, f, dy, "SAME", threshold=thr).numpy()
        b = bpi(xs, f, dy, "SAME", threshold=thr).numpy()
        np.testing.assert_array_equal(a, b)


def test_nonfinite_propagate():
    """NaN/Inf in dY propagate as in TensorFlow's kernel on every path."""
    xs, fs = (2, 6, 6, 4), (3, 3, 4, 5)
    dy = np.zeros((2, 6, 6, 5), np.float32)
    dy[0, 2, 2, 1] = np.nan
    dy[1, 3, 3, 2] = np.inf
    dy[1, 0, 0, 0] = 1.0
    f = tf.ones(fs)
    want = tf.raw_ops.Conv2DBackpropInput(
        input_sizes=xs, filter=f, out_backprop=dy, strides=[1, 1, 1, 1],
        padding="SAME").numpy()
    for thr in (1.0, 0.0):
        got = bpi(xs, f, dy, "SAME", threshold=thr).numpy()
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_array_equal(got[~np.isnan(want)],
                                      want[~np.isnan(want)])


def test_all_dense_call_is_tensorflows_kernel():
    """Threshold 0 runs TensorFlow's Conv2DBackpropInput on the op's
    inputs: the same bits."""
    rng = np.random.default_rng(8)
    xs, fs = (3, 8, 9, 6), (3, 3, 6, 10)
    f = tf.constant(rng.normal(size=fs), tf.float32)
    dy = tf.constant(_dy(xs, fs, "SAME", 1, 0.3, rng), tf.float32)

    @tf.function
    def both(f, dy):
        return (bpi(xs, f, dy, "SAME", threshold=0.0),
                tf.raw_ops.Conv2DBackpropInput(
                    input_sizes=xs, filter=f, out_backprop=dy,
                    strides=[1, 1, 1, 1], padding="SAME"))

    ours, theirs = both(f, dy)
    np.testing.assert_array_equal(ours, theirs)


# ---- 16-bit dtypes (bounds of tests/test_low_precision_conv2d.py) ----------
UNIT = {tf.bfloat16: 2.0 ** -8, tf.float16: 2.0 ** -11}
U32 = 2.0 ** -24
TINY = {tf.bfloat16: 1e-38, tf.float16: 2.0 ** -24}


@pytest.mark.parametrize("dtype", [tf.bfloat16, tf.float16],
                         ids=lambda d: d.name)
@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[5], CASES[9]],
                         ids=_ids)
def test_low_precision_within_bound(dtype, case):
    """|dX - ref| <= u_T |ref| + 2 L u_32 sum|dy f| (L = KH*KW*C_out), or
    within TensorFlow's own error plus one rounding where its kernel runs."""
    xs, fs, padding, dil = case
    rng = np.random.default_rng([dtype.size, xs[3], fs[3]])
    f = tf.cast(tf.constant(rng.uniform(-1, 1, fs), tf.float32), dtype)
    dy = tf.cast(tf.constant(_dy(xs, fs, padding, dil, 0.6, rng),
                             tf.float32), dtype)
    f64 = tf.cast(f, tf.float64).numpy()
    dy64 = tf.cast(dy, tf.float64).numpy()
    ref = reference_dx(xs, f64, dy64, padding, dil)
    abs_sum = reference_dx(xs, np.abs(f64), np.abs(dy64), padding, dil)
    length = fs[0] * fs[1] * fs[3]
    tol = UNIT[dtype] * np.abs(ref) + 2.0 * length * U32 * abs_sum + \
        TINY[dtype]
    pad, explicit = conv_ops._conv_padding(padding, None)
    try:
        tf_dx = tf.cast(tf.raw_ops.Conv2DBackpropInput(
            input_sizes=xs, filter=f, out_backprop=dy, strides=[1, 1, 1, 1],
            padding=pad, explicit_paddings=explicit,
            dilations=conv_ops._conv_list(dil, "d")), tf.float64).numpy()
        tf_tol = np.abs(tf_dx - ref) + UNIT[dtype] * np.abs(ref) + TINY[dtype]
    except tf.errors.InvalidArgumentError:  # TF refuses the case
        tf_tol = tol
    for thr in (1.0, 0.0, 0.5, -1.0):
        dx, st = bpi(xs, f, dy, padding, dil, threshold=thr, return_stats=True)
        assert dx.dtype == dtype
        assert st.numpy()[S.NNZ] == np.count_nonzero(dy64)
        err = np.abs(tf.cast(dx, tf.float64).numpy() - ref)
        bound = tol if thr == 1.0 else np.maximum(tol, tf_tol)
        assert (err <= bound).all(), (thr, float(err.max()))


# ---- bad inputs --------------------------------------------------------------
def _raw(sizes, f, dy, thr=-1.0, strides=(1, 1, 1, 1), padding="SAME",
         explicit=(), dilations=(1, 1, 1, 1)):
    return load_library().tf_sparse_split_sparse_split_conv2d_backprop_input(
        sizes, f, dy, tf.constant(thr, tf.float32), strides=list(strides),
        padding=padding, explicit_paddings=list(explicit),
        dilations=list(dilations))


@pytest.mark.parametrize("kwargs, match", [
    (dict(sizes=[2, 6, 6]), "input_sizes|rank|shape"),
    (dict(sizes=[2, 6, -6, 3]), "input_sizes must be >= 0|negative|>= 0"),
    (dict(sizes=[2, 6, 6, 4]), "channels"),
    (dict(f=tf.ones([3, 3, 3])), "rank"),
    (dict(dy=tf.ones([2, 6, 6])), "rank"),
    (dict(dy=tf.ones([2, 5, 6, 4])), "out_backprop has shape|Dimension|shape"),
    (dict(dy=tf.ones([2, 6, 6, 5])), "Dimension|out_backprop|shape"),
    (dict(strides=(1, 2, 2, 1)), "strides must be 1"),
    (dict(thr=2.0), "threshold"),
    (dict(thr=float("nan")), "threshold"),
    (dict(padding="EXPLICIT", explicit=(0, 0, 3, 0, 0, 0, 0, 0)),
     "exceed the dilated filter"),
    (dict(padding="EXPLICIT", explicit=(0, 0, 1, 1)), "explicit_paddings"),
])
def test_bad_inputs(kwargs, match):
    args = dict(sizes=[2, 6, 6, 3], f=tf.ones([3, 3, 3, 4]),
                dy=tf.ones([2, 6, 6, 4]))
    args.update(kwargs)
    sizes, f, dy = args.pop("sizes"), args.pop("f"), args.pop("dy")
    if "explicit" in args and args.get("padding") == "EXPLICIT" and \
            len(args["explicit"]) == 8 and args["explicit"][2] == 3:
        dy = tf.ones([2, 7, 4, 4])  # OH = 6 + 3 - 2, OW = 6 - 2
        args["padding"] = "EXPLICIT"
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError),
                       match=match):
        _raw(sizes, f, dy, **args)


def test_bad_dtypes_and_threshold_shape():
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)):
        bpi([1, 4, 4, 2], tf.ones([3, 3, 2, 2], tf.int32),
            tf.ones([1, 4, 4, 2], tf.int32), "SAME")
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)):
        bpi([1, 4, 4, 2], tf.ones([3, 3, 2, 2]),
            tf.ones([1, 4, 4, 2], tf.float64), "SAME")
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError),
                       match="threshold"):
        load_library().tf_sparse_split_sparse_split_conv2d_backprop_input(
            [1, 4, 4, 2], tf.ones([3, 3, 2, 2]), tf.ones([1, 4, 4, 2]),
            tf.constant([0.5, 0.5]), strides=[1, 1, 1, 1], padding="SAME")


def test_shape_function():
    @tf.function(input_signature=[tf.TensorSpec([None, 4, 4, 3]),
                                  tf.TensorSpec([3, 3, 3, 5]),
                                  tf.TensorSpec([None, 4, 4, 5])])
    def fn(x, f, dy):
        dx, st = load_library().tf_sparse_split_sparse_split_conv2d_backprop_input(
            tf.shape(x), f, dy, tf.constant(-1.0), strides=[1, 1, 1, 1],
            padding="SAME")
        assert dx.shape.as_list() == [None, 4, 4, 3], dx.shape
        assert st.shape.as_list() == [S.NUM_STATS]
        return dx

    fn.get_concrete_function()


# ---- the gradient graph ------------------------------------------------------
_ROTATION_OPS = ("ReverseV2", "Transpose", "GatherV2", "_MklTranspose")


@pytest.mark.parametrize("fs, padding, dil", [
    ((3, 3, 3, 4), "SAME", 1), ((3, 3, 64, 96), "SAME", 1),
    ((5, 5, 3, 4), "VALID", 1), ((3, 3, 3, 4), "SAME", 2),
    ((3, 3, 3, 4), [[0, 0], [1, 2], [2, 0], [0, 0]], 1),
])
def test_gradient_graph_has_no_rotated_filter(fs, padding, dil):
    x = tf.TensorSpec([2, 9, 9, fs[2]], tf.float32)
    f = tf.TensorSpec(fs, tf.float32)

    @tf.function
    def grads(a, b):
        with tf.GradientTape() as tape:
            tape.watch([a, b])
            y = tf.nn.relu(tfss.sparse_split_conv2d(tf.nn.relu(a), b, 1,
                                                    padding, dil))
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, [a, b])

    graph = grads.get_concrete_function(x, f).graph
    ops = graph.get_operations()
    types = [op.type for op in ops]
    assert types.count("TfSparseSplit>SparseSplitConv2DBackpropInput") == 1
    assert "Conv2DBackpropInput" not in types
    # No rotation of the filter: nothing that reorders a filter-shaped
    # tensor, outside the tf.cond branch of the filter gradient's
    # transposed formulation (a function of its own, not in this graph).
    for op in ops:
        if op.type in _ROTATION_OPS:
            shapes = [t.shape for t in op.inputs]
            assert not any(s.rank == 4 and s[:2] == fs[:2] for s in shapes), \
                (op.type, op.name, shapes)
    # And the gradient itself.
    rng = np.random.default_rng(1)
    xv = tf.constant(rng.normal(size=x.shape), tf.float32)
    fv = tf.constant(rng.normal(size=fs) * 0.2, tf.float32)
    gx, gf = grads(xv, fv)
    pad, explicit = conv_ops._conv_padding(padding, None)
    with tf.GradientTape() as tape:
        tape.watch([xv, fv])
        y = tf.nn.relu(tf.nn.conv2d(tf.nn.relu(xv), fv, 1, padding,
                                    dilations=dil))
        loss = tf.reduce_sum(y * y)
    rx, rf = tape.gradient(loss, [xv, fv])
    assert T.relative_error(gx, rx) <= 1e-5
    assert T.relative_error(gf, rf) <= 1e-5


# ---- strided 1x1 convolutions: products on the matmul op -------------------
@pytest.mark.parametrize("hw, strides, padding", [
    ((8, 8), 2, "SAME"), ((7, 9), 2, "SAME"), ((9, 7), 2, "VALID"),
    ((10, 11), 3, "VALID"), ((5, 6), (2, 3), "SAME"), ((6, 6), 2, "EXPLICIT"),
    ((1, 1), 2, "SAME"),
])
@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
@pytest.mark.parametrize("sparsity, fused", [(0.0, False), (0.7, False),
                                             (0.7, True)])
def test_strided_one_by_one_gradients(hw, strides, padding, dtype, sparsity,
                                      fused):
    """A 1x1 convolution with a stride and no padding: dX is the matmul of
    grad with the filter at the pixels the convolution read, zero
    elsewhere, and dF the product of those pixels with grad; against
    TensorFlow's gradients of tf.nn.conv2d (dX, dF, db and the second
    order through dX) on inputs with real zeros, and the graph runs the
    products instead of TensorFlow's strided backprop kernels."""
    rng = np.random.default_rng([hw[0], hw[1], int(sparsity * 10), fused])
    sh, sw = (strides, strides) if isinstance(strides, int) else strides
    pad = [[0, 0]] * 4 if padding == "EXPLICIT" else padding
    x = tf.constant(T.random_sparse((3 * hw[0] * hw[1], 5), sparsity, rng)
                    .reshape(3, *hw, 5), dtype)
    f = tf.constant(rng.normal(size=(1, 1, 5, 7)) * 0.3, dtype)
    b = tf.constant(rng.normal(size=(7,)) * 0.1, dtype)

    def ours(a, w, c):
        return tfss.sparse_split_conv2d(
            a, w, [sh, sw], pad, bias=c if fused else None,
            activation="relu" if fused else None)

    def ref(a, w, c):
        y = tf.nn.conv2d(a, w, [1, sh, sw, 1], pad)
        return tf.nn.relu(y + c) if fused else y

    def grads(conv):
        with tf.GradientTape() as outer:
            outer.watch(x)
            with tf.GradientTape() as tape:
                tape.watch([x, f, b])
                y = conv(x, f, b)
                loss = tf.reduce_sum(tf.sin(y) * y)
            gx, gf, gb = tape.gradient(loss, [x, f, b])
            s = tf.reduce_sum(gx * gx)
        return [gx, gf, outer.gradient(s, x)] + ([gb] if fused else [])

    got, want = grads(ours), grads(ref)
    tol = 1e-5 if dtype == tf.float32 else 1e-12
    for g, r in zip(got, want):
        assert g.shape == r.shape
        assert T.relative_error(g, r) <= tol
    # Rows and columns the convolution never read get no gradient.
    read = np.zeros(hw, bool)
    read[::sh, ::sw] = True
    assert np.all(got[0].numpy()[:, ~read, :] == 0)

    # Unknown spatial sizes: the strided pixels are gathered.
    spec = tf.TensorSpec([None, None, None, 5], dtype)

    @tf.function(input_signature=[spec])
    def both(a):
        with tf.GradientTape() as tape:
            tape.watch([a, f])
            y = ours(a, f, b)
        return tape.gradient(y, [a, f], output_gradients=tf.ones_like(y))

    with tf.GradientTape() as tape:
        tape.watch([x, f])
        y = ref(x, f, b)
    want = tape.gradient(y, [x, f], output_gradients=tf.ones_like(y))
    for g, r in zip(both(x), want):
        assert T.relative_error(g, r) <= tol
    # A known size survives the spread's slice, as in TensorFlow's gradient.
    @tf.function(input_signature=[tf.TensorSpec([3, None, hw[1], 5], dtype)])
    def dx_shape(a):
        with tf.GradientTape() as tape:
            tape.watch(a)
            y = ours(a, f, b)
        dx = tape.gradient(y, a, output_gradients=tf.ones_like(y))
        assert dx.shape.as_list() == [3, None, hw[1], 5], dx.shape
        return dx

    assert T.relative_error(dx_shape(x), want[0]) <= tol
    types = [op.type for op in both.get_concrete_function().graph
             .get_operations()]
    assert "Conv2DBackpropInput" not in types
    assert not [t for t in types if "BackpropFilter" in t]
    assert types.count("TfSparseSplit>SparseSplitMatMul") == 2


def test_strided_one_by_one_with_padding_keeps_tensorflows_kernel():
    """Explicit nonzero padding on a strided 1x1 convolution shifts the
    pixels it reads: TensorFlow's Conv2DBackpropInput (same values)."""
    rng = np.random.default_rng(3)
    x = tf.constant(rng.normal(size=(2, 6, 6, 3)), tf.float32)
    f = tf.constant(rng.normal(size=(1, 1, 3, 4)), tf.float32)
    pad = [[0, 0], [1, 0], [0, 1], [0, 0]]

    def dx(conv):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = conv(x, f)
        return tape.gradient(y, x, output_gradients=tf.ones_like(y) * 0.5)

    got = dx(lambda a, b: tfss.sparse_split_conv2d(a, b, 2, pad))
    want = dx(lambda a, b: tf.nn.conv2d(a, b, 2, pad))
    assert T.relative_error(got, want) <= 1e-6


# ---- the rewrite pass (opt-in "Conv2DBackpropInput") ------------------------
@pytest.mark.filterwarnings("ignore:.*already instantiated while the pass")
def test_rewrite_replaces_relu_masked_input_gradient(rw):
    """With ops + ("Conv2DBackpropInput",), a stride-1 input gradient whose
    dY is a ReluGrad output becomes SparseSplitConv2DBackpropInput; a
    stride-2 one is declined with its reason; the gradients equal the
    unrewritten graph's."""
    rng = np.random.default_rng(21)
    x = tf.constant(rng.normal(size=(4, 10, 10, 3)), tf.float32)
    w1 = tf.constant(rng.normal(size=(3, 3, 3, 8)) * 0.3, tf.float32)
    w2 = tf.constant(rng.normal(size=(3, 3, 8, 6)) * 0.3, tf.float32)
    w3 = tf.constant(rng.normal(size=(3, 3, 6, 5)) * 0.3, tf.float32)

    def make():
        @tf.function
        def step(x, w1, w2, w3):
            with tf.GradientTape() as tape:
                tape.watch([x, w1, w2, w3])
                h1 = tf.nn.relu(tf.nn.conv2d(x, w1, 1, "SAME"))
                h2 = tf.nn.relu(tf.nn.conv2d(h1, w2, 1, "VALID"))
                h3 = tf.nn.relu(tf.nn.conv2d(h2, w3, 2, "SAME"))
                loss = tf.reduce_sum(h3 * h3)
            return tape.gradient(loss, [x, w1, w2, w3])
        return step

    want = make()(x, w1, w2, w3)
    rw.enable(ops=rw.DEFAULT_OPS + ("Conv2DBackpropInput",))
    got = make()(x, w1, w2, w3)
    rw.disable()
    for a, b in zip(got, want):
        assert T.relative_error(a, b) <= 1e-5
    records = [r for r in rw.log() if r["op"] == "Conv2DBackpropInput"]
    done = [r for r in records if r["action"] == "rewritten"]
    declined = [r for r in records if r["action"] == "declined"]
    assert len(done) == 2, records
    assert {r["new_op"] for r in done} == {
        "TfSparseSplit>SparseSplitConv2DBackpropInput"}
    assert all(r["producer"] == "ReluGrad" for r in done), done
    assert any("strides other than 1" in r["reason"] for r in declined), \
        declined
    # Not in the default ops.
    assert "Conv2DBackpropInput" not in rw.DEFAULT_OPS
