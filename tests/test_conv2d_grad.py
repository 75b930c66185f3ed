"""Gradients of SparseSplitConv2D against TensorFlow's: the input gradient
computed by SparseSplitConv2DBackpropInput on the original filter (stride
1), TensorFlow's Conv2DBackpropInput elsewhere."""

import numpy as np
import pytest
import tensorflow as tf

import tf_sparse_split as tfss
from tf_sparse_split import testing as T
from tf_sparse_split.ops import conv2d as conv_ops

pytestmark = pytest.mark.usefixtures("op_library")

# (x shape, filter shape, strides, padding, dilations)
CASES = [
    ((3, 9, 11, 4), (3, 3, 4, 6), 1, "SAME", 1),
    ((2, 9, 11, 3), (3, 2, 3, 5), 1, "VALID", 1),
    ((2, 10, 9, 5), (5, 5, 5, 17), 1, "SAME", 1),             # 5x5, odd C_out
    ((2, 9, 11, 3), (3, 3, 3, 5), 1, [[0, 0], [1, 0], [2, 1], [0, 0]], 1),
    ((2, 8, 8, 3), (2, 2, 3, 4), 1, "SAME", 1),                # even filter
    ((2, 12, 10, 3), (3, 3, 3, 4), 1, "SAME", 2),              # dilated
    ((2, 12, 10, 3), (3, 3, 3, 4), 1, [[0, 0], [4, 1], [0, 3], [0, 0]], 2),
    ((2, 9, 11, 4), (3, 3, 4, 6), 2, "SAME", 1),               # stride 2
    ((2, 9, 11, 4), (3, 3, 4, 6), (1, 2), "VALID", 1),         # stride 1x2
    ((2, 7, 7, 2), (3, 3, 2, 3), 1, [[0, 0], [3, 0], [0, 2], [0, 0]], 1),  # pad > KH-1
    ((3, 7, 9, 8), (1, 1, 8, 6), 1, "SAME", 1),                # 1x1: a matmul
    ((2, 6, 5, 5), (1, 1, 5, 7), 1, "VALID", 2),               # 1x1 dilated
    ((2, 9, 9, 4), (1, 1, 4, 6), 2, "SAME", 1),                # 1x1 stride 2
]


def _ids(case):
    xs, fs, s, pad, d = case
    pad = pad if isinstance(pad, str) else "EXPLICIT"
    return f"{xs[1]}x{xs[2]}x{xs[3]}-{fs[0]}x{fs[1]}x{fs[3]}-s{s}-d{d}-{pad}"


def _dense_grads(x, f, dy, strides, padding, dilations):
    """Reference (dX, dF) in float64: TensorFlow's tf.nn.conv2d gradient,
    or an im2col formulation where TF's CPU kernels refuse the case
    (dilations > 1 in float64)."""
    x64 = tf.constant(x, tf.float64)
    f64 = tf.constant(f, tf.float64)
    d = dilations if isinstance(dilations, int) else max(dilations)
    with tf.GradientTape() as tape:
        tape.watch([x64, f64])
        if d == 1:
            y = tf.nn.conv2d(x64, f64, strides, padding, dilations=dilations)
        else:
            pad, ex = conv_ops._conv_padding(padding, None)
            s = conv_ops._conv_list(strides, "strides")
            dl = conv_ops._conv_list(dilations, "dilations")
            p = T._patches(x64, f.shape[0], f.shape[1], s[1:3], pad, dl[1:3], ex)
            y = tf.einsum("nhwk,ko->nhwo", p, tf.reshape(f64, [-1, f.shape[3]]))
    return [g.numpy() for g in tape.gradient(y, [x64, f64], output_gradients=dy)]


def _sparse_dy(shape, sparsity, rng):
    dy = T.random_sparse_images(shape, sparsity, rng, np.float64)
    dy.flat[rng.integers(dy.size)] = 0.75  # never all zero
    return dy


@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize("dy_sparsity", [0.0, 0.9, 0.99])
def test_gradients_match_tf(case, dy_sparsity):
    xs, fs, strides, padding, dilations = case
    rng = np.random.default_rng(hash((_ids(case), dy_sparsity)) % 2**32)
    x = T.random_sparse_images(xs, 0.6, rng, np.float64)
    f = rng.normal(size=fs)
    pad, explicit = conv_ops._conv_padding(padding, None)
    y_shape = T.reference_conv2d(x, f, strides, pad, dilations,
                                 explicit or None).shape
    dy = _sparse_dy(y_shape, dy_sparsity, rng)
    ref_x, ref_f = _dense_grads(x, f, dy, strides, padding, dilations)
    for dtype, tol in ((tf.float32, 1e-5), (tf.float64, 1e-12)):
        for thr in (-1.0, 0.0, 1.0):
            xt, ft = tf.constant(x, dtype), tf.constant(f, dtype)

            @tf.function
            def grads(a, b, dyt):
                with tf.GradientTape() as tape:
                    tape.watch([a, b])
                    y = tfss.sparse_split_conv2d(a, b, strides, padding,
                                                 dilations, threshold=thr)
                return tape.gradient(y, [a, b], output_gradients=dyt)

            gx, gf = grads(xt, ft, tf.constant(dy, dtype))
            assert gx.dtype == dtype and gx.shape == xs
            assert T.relative_error(gx, ref_x) <= tol, (dtype.name, thr)
            assert T.relative_error(gf, ref_f) <= tol, (dtype.name, thr)


def _grad_graph_ops(strides, padding, dilations=1):
    x = tf.TensorSpec([2, 9, 9, 3], tf.float32)
    f = tf.TensorSpec([3, 3, 3, 4], tf.float32)

    @tf.function
    def grads(a, b):
        with tf.GradientTape() as tape:
            tape.watch(a)
            y = tf.nn.relu(tfss.sparse_split_conv2d(a, b, strides, padding,
                                                    dilations))
        return tape.gradient(y, a)

    graph = grads.get_concrete_function(x, f).graph
    return [op.type for op in graph.get_operations()]


def test_stride_one_input_gradient_is_the_backprop_input_op():
    """No rotated filter in the graph: the op takes the original filter."""
    for padding in ("SAME", "VALID", [[0, 0], [1, 2], [2, 0], [0, 0]]):
        for dilations in (1, 2):
            types = _grad_graph_ops(1, padding, dilations)
            assert types.count("TfSparseSplit>SparseSplitConv2D") == 1, padding
            assert types.count(
                "TfSparseSplit>SparseSplitConv2DBackpropInput") == 1, padding
            assert "Conv2DBackpropInput" not in types, padding
            for op in ("ReverseV2", "Transpose", "GatherV2"):
                assert op not in types, (padding, dilations, op)


def test_one_by_one_input_gradient_is_a_matmul():
    """A 1x1 convolution's stride-1 input gradient is grad @ f^T, run by
    the matmul op (no rotated filter, no convolution)."""
    x = tf.TensorSpec([2, 5, 5, 3], tf.float32)
    f = tf.TensorSpec([1, 1, 3, 4], tf.float32)

    @tf.function
    def grads(a, b):
        with tf.GradientTape() as tape:
            tape.watch(a)
            y = tf.nn.relu(tfss.sparse_split_conv2d(a, b, 1, "SAME"))
        return tape.gradient(y, a)

    types = [op.type for op in
             grads.get_concrete_function(x, f).graph.get_operations()]
    assert types.count("TfSparseSplit>SparseSplitConv2D") == 1
    assert "TfSparseSplit>SparseSplitMatMul" in types
    assert "Conv2DBackpropInput" not in types
    assert "GatherV2" not in types


@pytest.mark.parametrize("n", [0, 1])
def test_one_by_one_gradients_small_and_empty_batch(n):
    rng = np.random.default_rng(7 + n)
    x = T.random_sparse_images((n, 4, 3, 5), 0.5, rng, np.float64)
    f = rng.normal(size=(1, 1, 5, 2))
    dy = rng.normal(size=(n, 4, 3, 2))
    ref_x, ref_f = _dense_grads(x, f, dy, 1, "SAME", 1)
    xt, ft = tf.constant(x, tf.float32), tf.constant(f, tf.float32)
    with tf.GradientTape() as tape:
        tape.watch([xt, ft])
        y = tfss.sparse_split_conv2d(xt, ft, 1, "SAME")
    gx, gf = tape.gradient(y, [xt, ft],
                           output_gradients=tf.constant(dy, tf.float32))
    assert gx.shape == x.shape and gf.shape == f.shape
    np.testing.assert_allclose(gx, ref_x, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gf, ref_f, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("strides, padding", [
    (2, "SAME"), ((1, 2), "VALID"),
    (1, [[0, 0], [3, 0], [0, 0], [0, 0]]),  # padding beyond the filter
])
def test_input_gradient_falls_back_to_tf(strides, padding):
    types = _grad_graph_ops(strides, padding)
    assert types.count("TfSparseSplit>SparseSplitConv2D") == 1
    assert "Conv2DBackpropInput" in types
    assert "TfSparseSplit>SparseSplitConv2DBackpropInput" not in types


@pytest.mark.parametrize("k, d, padding, explicit, expected", [
    (3, 1, "SAME", [], [0, 0, 1, 1, 1, 1, 0, 0]),
    (3, 1, "VALID", [], [0, 0, 2, 2, 2, 2, 0, 0]),
    (2, 1, "SAME", [], [0, 0, 1, 0, 1, 0, 0, 0]),      # SAME puts 1 after
    (3, 2, "SAME", [], [0, 0, 2, 2, 2, 2, 0, 0]),
    (3, 1, "EXPLICIT", [0, 0, 2, 0, 1, 2, 0, 0], [0, 0, 0, 2, 1, 0, 0, 0]),
    (3, 1, "EXPLICIT", [0, 0, 3, 0, 0, 0, 0, 0], None),  # 3 > KH - 1
])
def test_transposed_paddings(k, d, padding, explicit, expected):
    assert conv_ops._transposed_paddings(k, k, [1, d, d, 1], padding,
                                         explicit) == expected


@pytest.mark.parametrize("padding", ["SAME", "VALID",
                                     [[0, 0], [2, 1], [0, 1], [0, 0]]])
@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
def test_filter_gradient_both_formulations(padding, dtype):
    """conv2d_filter_grad over x's zeros and over the output gradient's
    zeros (the transposed formulation) give TensorFlow's filter gradient;
    the nonzero counts passed in pick the branch."""
    rng = np.random.default_rng(5)
    x = T.random_sparse_images((3, 8, 9, 5), 0.5, rng, np.float64)
    f = rng.normal(size=(3, 3, 5, 7))
    pad, explicit = conv_ops._conv_padding(padding, None)
    y_shape = T.reference_conv2d(x, f, 1, pad, 1, explicit or None).shape
    dy = _sparse_dy(y_shape, 0.95, rng)
    _, ref_f = _dense_grads(x, f, dy, 1, padding, 1)
    xt, ft, dyt = (tf.constant(v, dtype) for v in (x, f, dy))
    one = [1, 1, 1, 1]
    tol = 1e-5 if dtype == tf.float32 else 1e-12
    # (nnz_x, nnz_grad): (0, true) takes the x branch, (true, true) the
    # grad branch (dy is sparser), None skips the choice.
    nx, ng = int(np.count_nonzero(x)), int(np.count_nonzero(dy))
    for nnz in ((0, ng), (nx, ng), (nx, None), (None, None)):
        args = [None if v is None else tf.constant(v, tf.float64) for v in nnz]
        gf = conv_ops.conv2d_filter_grad(
            xt, ft, dyt, tf.constant(-1.0), one, pad, explicit, one, *args)
        assert gf.dtype == dtype and gf.shape == f.shape
        assert T.relative_error(gf, ref_f) <= tol, nnz


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (1, 1, 6, 3), (3, 3, 100, 80)],
                         ids=["gather", "1x1-transpose", "large-reverse"])
def test_rotated_filter(shape):
    f = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    want = f[::-1, ::-1].transpose(0, 1, 3, 2)
    got = conv_ops._rotated_filter(tf.constant(f))
    np.testing.assert_array_equal(got, want)
    if shape == (3, 3, 100, 80):  # beyond the gather's size
        assert f.size > conv_ops._GATHER_ROTATION_MAX

    @tf.function(input_signature=[tf.TensorSpec(None, tf.float32)])
    def unknown_shape(t):
        return conv_ops._rotated_filter(t)

    np.testing.assert_array_equal(unknown_shape(tf.constant(f)), want)


def test_first_layer_input_gradient_is_pruned():
    """Only the filter gradient of a layer fed by a model input is needed:
    the input-gradient convolution must not be kept alive by it."""
    x = tf.constant(T.random_sparse_images((2, 9, 9, 3), 0.5,
                                           np.random.default_rng(0)))
    f = tf.Variable(np.random.default_rng(1).normal(size=(3, 3, 3, 4))
                    .astype(np.float32))

    @tf.function
    def grad_f():
        with tf.GradientTape() as tape:
            y = tf.nn.relu(tfss.sparse_split_conv2d(x, f, 1, "SAME"))
        return tape.gradient(y, f)

    graph = grad_f.get_concrete_function().graph
    dx_ops = [op for op in graph.get_operations()
              if op.type == "TfSparseSplit>SparseSplitConv2DBackpropInput"]
    assert len(dx_ops) == 1
    # No consumers: the executor prunes it (for a graph input x the filter
    # gradient's choice does not read this op's statistics).
    assert all(not out.consumers() for out in dx_ops[0].outputs)


def test_hidden_layer_filter_gradient_chooses_at_run_time():
    """For an input computed in the graph, the filter gradient's tf.cond
    reads nnz(grad) from the input-gradient convolution's statistics."""
    rng = np.random.default_rng(2)
    x0 = tf.constant(rng.normal(size=(2, 9, 9, 3)).astype(np.float32))
    f = tf.Variable(rng.normal(size=(3, 3, 3, 4)).astype(np.float32))

    @tf.function
    def grad_f():
        with tf.GradientTape() as tape:
            y = tfss.sparse_split_conv2d(tf.nn.relu(x0), f, 1, "SAME")
            loss = tf.reduce_sum(tf.nn.relu(y))
        return tape.gradient(loss, f)

    types = [op.type for op in grad_f.get_concrete_function().graph
             .get_operations()]
    assert "StatelessIf" in types or "If" in types
    with tf.GradientTape() as tape:
        y = tf.nn.conv2d(tf.nn.relu(x0), f, 1, "SAME")
        loss = tf.reduce_sum(tf.nn.relu(y))
    assert T.relative_error(grad_f(), tape.gradient(loss, f)) <= 1e-5


def test_is_graph_input():
    @tf.function(input_signature=[tf.TensorSpec([2, 3], tf.int32)])
    def check(a):
        ds = iter(tf.data.Dataset.from_tensors(tf.ones([2, 3])))
        cast = tf.cast(a, tf.float32)
        flags = [conv_ops._is_graph_input(t) for t in (
            a, tf.reshape(cast, [3, 2]), next(ds), tf.constant(1.0),
            tf.nn.relu(cast), cast * 2.0)]
        assert flags == [True, True, True, True, False, False], flags
        return cast

    check(tf.ones([2, 3], tf.int32))
    assert not conv_ops._is_graph_input(tf.ones([2]))  # eager
