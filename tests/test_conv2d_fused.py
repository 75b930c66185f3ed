"""SparseSplitConv2D with a fused bias + activation (the attrs num_bias /
activation, as TensorFlow's _FusedConv2D): forward and gradients (input,
filter, bias) against float64 references of act(conv2d(x, w) + b), at
forced thresholds and the automatic one, eagerly and under tf.function;
bad inputs; old GraphDefs (no bias, no new attrs) still load and run."""

import zlib

import numpy as np
import pytest
import tensorflow as tf

import tf_sparse_split as tfss
from tf_sparse_split import testing as T
from tf_sparse_split.tuning import stats as S

LIB = None  # the op library; set by the fixture below


@pytest.fixture(autouse=True, scope="module")
def _library(op_library):
    global LIB
    LIB = op_library
OP = "TfSparseSplit>SparseSplitConv2D"

# (x shape, filter shape, strides, padding, dilations, explicit paddings)
CASES = [
    ((3, 9, 7, 5), (3, 3, 5, 19), 1, "SAME", 1, None),        # odd sizes
    ((2, 11, 10, 4), (3, 3, 4, 7), 2, "VALID", 1, None),       # stride 2
    ((2, 12, 11, 3), (3, 3, 3, 16), 1, "SAME", 2, None),       # dilated
    ((2, 11, 10, 4), (3, 2, 4, 5), 2, "SAME", 2, None),        # stride + dilation
    ((2, 9, 8, 3), (3, 3, 3, 6), 1, "EXPLICIT", 1, [0, 0, 1, 2, 0, 1, 0, 0]),
    ((1, 7, 7, 1), (1, 1, 1, 1), 1, "VALID", 1, None),         # 1x1, 1 channel
    ((2, 11, 10, 4), (3, 3, 4, 7), 1, "EXPLICIT", 2, [0, 0, 1, 2, 3, 0, 0, 0]),
]
SPARSITIES = (0.0, 0.5, 0.9, 1.0)
# 0.0: every image with a nonzero dense; 1.0: every image sparse; -1: auto.
THRESHOLDS = (0.0, 1.0, -1.0)
ACTIVATIONS = ("none", "relu", "relu6")


def _ids(case):
    xs, fs, s, pad, d, _ = case
    return f"{xs[0]}x{xs[1]}x{xs[2]}x{xs[3]}-{fs[0]}x{fs[1]}x{fs[3]}-s{s}-d{d}-{pad}"


def _kw(case):
    _, _, s, pad, d, ep = case
    return dict(strides=s, padding=pad, dilations=d, explicit_paddings=ep)


def _tol(dtype):
    return 1e-5 if dtype in (np.float32, tf.float32) else 1e-12


def _inputs(case, sparsity, rng):
    xs, fs = case[0], case[1]
    x = T.random_sparse_images(xs, sparsity, rng, np.float64, zero_channels=0.2)
    f = rng.normal(size=fs)
    # Large enough that relu6 clips at 6 and relu at 0 in many places.
    b = rng.normal(scale=3.0, size=fs[3])
    return x, f, b


@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_forward_matches_reference(case, activation):
    kw = _kw(case)
    rng = np.random.default_rng(zlib.crc32(f"{_ids(case)}-{activation}".encode()))
    fns = {}
    for dtype in (np.float32, np.float64):
        fns[dtype] = tf.function(
            lambda a, b, c, t: tfss.sparse_split_conv2d(
                a, b, threshold=t, bias=c, activation=activation,
                return_stats=True, **kw),
            input_signature=[tf.TensorSpec(None, dtype)] * 3 +
            [tf.TensorSpec([], tf.float32)])
    for sparsity in SPARSITIES:
        x, f, b = _inputs(case, sparsity, rng)
        ref = T.reference_conv2d_bias_act(x, f, b, activation, **kw)
        for dtype in fns:
            xa, fa, ba = x.astype(dtype), f.astype(dtype), b.astype(dtype)
            for thr in THRESHOLDS:
                y, st = tfss.sparse_split_conv2d(
                    xa, fa, threshold=thr, bias=ba, activation=activation,
                    return_stats=True, **kw)
                assert y.dtype == dtype and y.shape == ref.shape
                err = T.relative_error(y, ref)
                assert err <= _tol(dtype), (sparsity, dtype, thr, err)
                if thr == 1.0:  # every image on the sparse path
                    assert st[S.ROWS_DENSE] == 0
                y2, _ = fns[dtype](xa, fa, ba, tf.constant(thr))
                assert T.relative_error(y2, ref) <= _tol(dtype), (sparsity, dtype, thr)


def test_split_call_applies_the_epilogue_to_both_parts(rng):
    """A threshold between the images' densities: dense images from TF's
    fused kernel, sparse ones from the sparse kernel + epilogue; both
    equal the reference."""
    x = np.concatenate([
        T.random_sparse_images((3, 10, 9, 6), 0.1, rng, np.float64),
        T.random_sparse_images((3, 10, 9, 6), 0.95, rng, np.float64)])
    x = x[rng.permutation(6)]
    f = rng.normal(size=(3, 3, 6, 11))
    b = rng.normal(scale=2.0, size=11)
    for activation in ACTIVATIONS:
        ref = T.reference_conv2d_bias_act(x, f, b, activation, padding="SAME")
        if activation == "relu6":
            assert (ref == 6).any() and (ref == 0).any()  # both clips hit
        for dtype in (np.float32, np.float64):
            y, st = tfss.sparse_split_conv2d(
                x.astype(dtype), f.astype(dtype), 1, "SAME", threshold=0.5,
                bias=b.astype(dtype), activation=activation, return_stats=True)
            assert st[S.ROWS_DENSE] == 3 and st[S.ROWS_SPARSE] == 3
            assert T.relative_error(y, ref) <= _tol(dtype), (activation, dtype)


def test_activation_without_bias_and_bias_without_activation(rng):
    x, f, b = _inputs(CASES[0], 0.5, rng)
    for dtype in (np.float32, np.float64):
        for thr in THRESHOLDS:
            y = tfss.sparse_split_conv2d(x.astype(dtype), f.astype(dtype), 1,
                                         "SAME", threshold=thr,
                                         activation="relu6")
            ref = T.reference_conv2d_bias_act(x, f, None, "relu6", padding="SAME")
            assert T.relative_error(y, ref) <= _tol(dtype)
            y = tfss.sparse_split_conv2d(x.astype(dtype), f.astype(dtype), 1,
                                         "SAME", threshold=thr,
                                         bias=b.astype(dtype))
            ref = T.reference_conv2d_bias_act(x, f, b, None, padding="SAME")
            assert T.relative_error(y, ref) <= _tol(dtype)


def test_all_dense_float32_equals_tf_fused_conv(rng):
    """Forced dense (every image has nonzeros): the op runs TF's own fused
    kernel, the one Grappler's remapper puts into tf.function graphs for
    relu(conv2d + bias); the results agree to float32 rounding of one
    kernel (in practice bit for bit)."""
    x = T.random_sparse_images((4, 14, 14, 8), 0.3, rng, np.float32)
    f = rng.normal(size=(3, 3, 8, 16)).astype(np.float32)
    b = rng.normal(size=16).astype(np.float32)
    tf_fused = tf.function(lambda a, w, c: tf.nn.relu(
        tf.nn.bias_add(tf.nn.conv2d(a, w, 1, "SAME"), c)))
    ours = tf.function(lambda a, w, c: tfss.sparse_split_conv2d(
        a, w, 1, "SAME", threshold=0.0, bias=c, activation="relu",
        return_stats=True))
    y, st = ours(x, f, b)
    assert st[S.ROWS_DENSE] == 4 and st[S.ROWS_SPARSE] == 0
    ref = tf_fused(x, f, b).numpy()
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-6, atol=1e-5)


def test_zero_input_channels_give_act_of_bias():
    x = np.zeros((2, 5, 5, 0), np.float32)
    f = np.zeros((3, 3, 0, 4), np.float32)
    b = np.array([-1.0, 0.5, 7.0, 2.0], np.float32)
    y = tfss.sparse_split_conv2d(x, f, 1, "SAME", bias=b, activation="relu6")
    assert y.shape == (2, 5, 5, 4)
    np.testing.assert_array_equal(y.numpy()[1, 3, 2], [0.0, 0.5, 6.0, 2.0])


# -- gradients ---------------------------------------------------------------

GRAD_CASES = [CASES[0], CASES[1], CASES[2], CASES[4]]


@pytest.mark.parametrize("case", GRAD_CASES, ids=_ids)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gradients_match_reference(case, activation):
    kw = _kw(case)
    rng = np.random.default_rng(zlib.crc32(f"grad-{_ids(case)}-{activation}".encode()))
    for sparsity in (0.0, 0.5, 0.9):
        x, f, b = _inputs(case, sparsity, rng)
        y_shape = T.reference_conv2d(x, f, **kw).shape
        dy = rng.normal(size=y_shape)
        ref = T.reference_conv2d_bias_act_grads(x, f, b, dy, activation, **kw)
        for dtype in (tf.float32, tf.float64):
            for thr in THRESHOLDS:
                def grads(a, w, c, g):
                    with tf.GradientTape() as tape:
                        tape.watch([a, w, c])
                        y = tfss.sparse_split_conv2d(
                            a, w, threshold=thr, bias=c,
                            activation=activation, **kw)
                    return tape.gradient(y, [a, w, c], output_gradients=g)

                args = [tf.constant(v, dtype) for v in (x, f, b, dy)]
                modes = [("graph", tf.function(grads))]
                if thr < 0 or sparsity == 0.5:
                    modes.append(("eager", grads))
                for mode, fn in modes:
                    got = fn(*args)
                    for name, g, r in zip("xfb", got, ref):
                        assert g.dtype == dtype and g.shape == r.shape
                        err = T.relative_error(g, r)
                        assert err <= 10 * _tol(dtype), (
                            name, mode, sparsity, dtype.name, thr, err)


def test_gradient_of_unfused_call_has_no_bias_output(rng):
    """The old call form: three inputs, three gradients (threshold None)."""
    x, f, _ = _inputs(CASES[0], 0.5, rng)
    xt, ft = tf.constant(x, tf.float32), tf.constant(f, tf.float32)
    with tf.GradientTape() as tape:
        tape.watch([xt, ft])
        y = tfss.sparse_split_conv2d(xt, ft, 1, "SAME")
    gx, gf = tape.gradient(y, [xt, ft])
    ref_x, ref_f, _ = T.reference_conv2d_bias_act_grads(
        x, f, None, np.ones(y.shape), None, padding="SAME")
    assert T.relative_error(gx, ref_x) <= 1e-5
    assert T.relative_error(gf, ref_f) <= 1e-5


def test_masked_gradient_goes_through_the_sparse_input_gradient():
    """The input gradient of a stride-1 fused call is the sparse-split
    input-gradient op (of the ReLU-masked dY), and the filter and bias
    gradients one sparse filter-gradient op (no separate BiasAddGrad)."""
    @tf.function
    def grads(a, w, c):
        with tf.GradientTape() as tape:
            tape.watch([a, w, c])
            y = tfss.sparse_split_conv2d(a, w, 1, "SAME", bias=c,
                                         activation="relu")
        return tape.gradient(y, [a, w, c])

    g = grads.get_concrete_function(
        tf.TensorSpec([2, 9, 9, 3], tf.float32),
        tf.TensorSpec([3, 3, 3, 4], tf.float32),
        tf.TensorSpec([4], tf.float32)).graph
    types = [op.type for op in g.get_operations()]
    assert types.count(OP) == 1
    assert "TfSparseSplit>SparseSplitConv2DBackpropInput" in types
    assert "TfSparseSplit>SparseSplitConv2DBackpropFilterWithBias" in types
    assert "BiasAddGrad" not in types
    assert "Conv2DBackpropInput" not in types
    fused = [op for op in g.get_operations() if op.type == OP and
             op.get_attr("num_bias") == 1]
    assert len(fused) == 1 and fused[0].get_attr("activation") == b"relu"


# -- bad inputs ----------------------------------------------------------------

def test_bad_bias_and_activation(rng):
    x = T.random_sparse_images((2, 6, 6, 3), 0.5, rng, np.float32)
    f = rng.normal(size=(3, 3, 3, 4)).astype(np.float32)
    conv = tfss.sparse_split_conv2d
    with pytest.raises(tf.errors.InvalidArgumentError, match="bias"):
        conv(x, f, 1, "SAME", bias=np.ones(5, np.float32))
    with pytest.raises(tf.errors.InvalidArgumentError, match="bias"):
        conv(x, f, 1, "SAME", bias=np.ones((1, 4), np.float32))
    with pytest.raises(tf.errors.InvalidArgumentError, match="dtype"):
        conv(x, f, 1, "SAME", bias=np.ones(4, np.float64))
    with pytest.raises(ValueError, match="activation"):
        conv(x, f, 1, "SAME", bias=np.ones(4, np.float32), activation="tanh")
    with pytest.raises(ValueError, match="activation"):
        conv(x, f, 1, "SAME", activation="Relu")
    # The kernel checks on its own: raw op, and a bias of unknown length.
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="bias"):
        LIB.tf_sparse_split_sparse_split_conv2d(
            x, f, -1.0, [np.ones(3, np.float32)], strides=[1, 1, 1, 1],
            padding="SAME")
    fn = tf.function(lambda a, c: conv(a, f, 1, "SAME", bias=c,
                                       activation="relu"),
                     input_signature=[tf.TensorSpec(None, tf.float32),
                                      tf.TensorSpec([None], tf.float32)])
    with pytest.raises(tf.errors.InvalidArgumentError, match="bias"):
        fn(x, np.ones(7, np.float32))
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError),
                       match="num_bias"):
        LIB.tf_sparse_split_sparse_split_conv2d(
            x, f, -1.0, [np.ones(4, np.float32)] * 2, strides=[1, 1, 1, 1],
            padding="SAME")
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)):
        LIB.tf_sparse_split_sparse_split_conv2d(
            x, f, -1.0, [], strides=[1, 1, 1, 1], padding="SAME",
            activation="sigmoid")


def test_nan_follows_tf_dense_kernel_at_every_threshold(rng):
    """NaN in the input: every threshold gives what TF's graph gives for
    act(conv2d + bias) in that dtype -- float32: oneDNN's fused kernel,
    whose relu/relu6 post-op maps NaN to 0; float64: Conv2D, BiasAdd and
    Relu, which propagate it. The sparse images' epilogue follows the
    dense kernel, so the threshold never changes the answer."""
    x = T.random_sparse_images((2, 6, 6, 3), 0.5, rng, np.float64)
    x[1, 2, 2, 1] = np.nan
    f = rng.normal(size=(3, 3, 3, 4))
    b = np.ones(4)
    for dtype in (np.float32, np.float64):
        xa, fa, ba = x.astype(dtype), f.astype(dtype), b.astype(dtype)
        for act, tf_act in (("relu", tf.nn.relu), ("relu6", tf.nn.relu6)):
            tf_graph = tf.function(lambda a, w, c, tf_act=tf_act: tf_act(
                tf.nn.bias_add(tf.nn.conv2d(a, w, 1, "SAME"), c)))(xa, fa, ba)
            for thr in THRESHOLDS:
                y = tfss.sparse_split_conv2d(xa, fa, 1, "SAME", threshold=thr,
                                             bias=ba, activation=act).numpy()
                np.testing.assert_allclose(y, tf_graph.numpy(), rtol=1e-5,
                                           atol=1e-5, equal_nan=True)
                assert not np.isnan(y[0]).any()
                assert np.isnan(y[1, 2, 2]).all() == (dtype == np.float64)
        # No activation: NaN + bias stays NaN on every path.
        for thr in THRESHOLDS:
            y = tfss.sparse_split_conv2d(xa, fa, 1, "SAME", threshold=thr,
                                         bias=ba).numpy()
            assert np.isnan(y[1, 2, 2]).all() and not np.isnan(y[0]).any()


# -- old graphs ----------------------------------------------------------------

def test_old_graphdef_without_bias_attrs_loads_and_runs(rng):
    """A GraphDef written before the op had `bias`, num_bias and activation
    (3 inputs, no such attrs) imports and runs: the defaults (no bias,
    'none') make it the plain convolution."""
    x = T.random_sparse_images((2, 7, 7, 3), 0.5, rng, np.float32)
    f = rng.normal(size=(3, 3, 3, 5)).astype(np.float32)
    g = tf.Graph()
    with g.as_default():
        xp = tf.compat.v1.placeholder(tf.float32, [2, 7, 7, 3], name="x")
        fp = tf.constant(f, name="f")
        tfss.sparse_split_conv2d(xp, fp, 1, "SAME", name="conv")
    gd = g.as_graph_def()
    nodes = [n for n in gd.node if n.op == OP]
    assert len(nodes) == 1
    node = nodes[0]
    assert len(node.input) == 3  # x, f, threshold: no bias input
    for attr in ("num_bias", "activation"):
        node.attr.pop(attr, None)
    g2 = tf.Graph()
    with g2.as_default():
        tf.graph_util.import_graph_def(gd, name="")
        op = g2.get_operation_by_name(node.name)
        assert op.get_attr("num_bias") == 0
        assert op.get_attr("activation") == b"none"
        with tf.compat.v1.Session(graph=g2) as sess:
            y = sess.run(op.outputs[0], {"x:0": x})
    ref = T.reference_conv2d(x, f, padding="SAME")
    assert T.relative_error(y, ref) <= 1e-5
