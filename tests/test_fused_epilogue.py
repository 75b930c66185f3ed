"""The fused bias + activation epilogue of SparseSplitMatMul:
``sparse_split_matmul(a, b, bias=..., activation=...)`` against
``tf.nn.relu(tf.matmul(a, b) + bias)`` (and relu6, none), its gradients
against TF's, bad inputs, and SparseSplitDense against keras Dense."""

import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sparse_split as tfss
from tf_sparse_split.ops.matmul import sparse_split_matmul

ACTS = ("none", "relu", "relu6")
THRESHOLDS = (0.0, 0.5, 1.0, -1.0)
# (m, k, n): odd sizes, a single row/column, wider than a vector.
SHAPES = ((1, 1, 1), (7, 13, 5), (13, 7, 33), (64, 40, 17), (5, 1000, 3))


def _activation_ref(x, act):
    if act == "relu":
        return np.maximum(x, 0.0)
    if act == "relu6":
        return np.minimum(np.maximum(x, 0.0), 6.0)
    return x


def _tf_reference(a, b, bias, act, ta, tb):
    y = tf.matmul(a, b, transpose_a=ta, transpose_b=tb)
    if bias is not None:
        y = y + bias
    if act == "relu":
        y = tf.nn.relu(y)
    elif act == "relu6":
        y = tf.nn.relu6(y)
    return y


def _operands(rng, m, k, n, dtype, ta, tb, zero_fraction=0.6):
    """op(a) [m, k] with real zeros (random ones, an all-zero row and an
    all-zero column when there is room), b, and a bias scaled so that the
    pre-activation crosses both 0 and 6."""
    a = rng.standard_normal((m, k)) * 2.0
    a[rng.random((m, k)) < zero_fraction] = 0.0
    if m > 2:
        a[1] = 0.0
    if k > 2:
        a[:, 2] = 0.0
    b = rng.standard_normal((k, n)) * (3.0 / np.sqrt(max(k, 1)))
    bias = rng.standard_normal(n) * 3.0
    a = (a.T if ta else a).astype(dtype)
    b = (b.T if tb else b).astype(dtype)
    return np.ascontiguousarray(a), np.ascontiguousarray(b), bias.astype(dtype)


def _expected(a, b, bias, act, ta, tb):
    a64 = a.astype(np.float64)
    b64 = b.astype(np.float64)
    y = (a64.T if ta else a64) @ (b64.T if tb else b64)
    if bias is not None:
        y = y + bias.astype(np.float64)
    return _activation_ref(y, act)


def _check_close(got, want, dtype):
    rtol = 1e-5 if dtype == np.float32 else 1e-12
    scale = max(1.0, float(np.max(np.abs(want))) if want.size else 1.0)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("act", ACTS)
def test_forward_matches_reference(act, dtype, mode, op_library):
    rng = np.random.default_rng(hash((act, np.dtype(dtype).name, mode)) % 2**32)

    def run(a, b, bias, thr, ta, tb):
        return sparse_split_matmul(a, b, threshold=thr, transpose_a=ta,
                                   transpose_b=tb, bias=bias, activation=act)

    if mode == "function":
        run = tf.function(run)
    checked = 0
    for (m, k, n), thr, ta, tb in itertools.product(
            SHAPES, THRESHOLDS, (False, True), (False, True)):
        a, b, bias = _operands(rng, m, k, n, dtype, ta, tb)
        got = run(a, b, bias, tf.constant(thr, tf.float32), ta, tb).numpy()
        assert got.dtype == dtype and got.shape == (m, n)
        want = _expected(a, b, bias, act, ta, tb)
        _check_close(got, want, dtype)
        # And against TF's own (fused, in a graph) op.
        ref = tf.function(_tf_reference)(a, b, bias, act, ta, tb).numpy()
        _check_close(got, ref, dtype)
        checked += 1
    assert checked == len(SHAPES) * len(THRESHOLDS) * 4


@pytest.mark.parametrize("act", ACTS)
def test_activation_without_bias_and_clipping_happens(act, op_library):
    rng = np.random.default_rng(3)
    a, b, _ = _operands(rng, 40, 30, 20, np.float32, False, False)
    b *= 4.0  # values well beyond 6 and below 0
    got = sparse_split_matmul(a, b, threshold=0.5, activation=act).numpy()
    want = _expected(a, b, None, act, False, False)
    _check_close(got, want, np.float32)
    if act == "relu":
        assert got.min() == 0.0 and got.max() > 6.0
    if act == "relu6":
        assert got.min() == 0.0 and got.max() == 6.0
    if act == "none":
        assert got.min() < 0.0


@pytest.mark.parametrize("act", ACTS)
def test_all_zero_and_empty_operands(act, op_library):
    bias = np.array([-1.0, 2.0, 7.0, 0.5], np.float32)
    # k = 0: the product is zero, the output is act(bias) on every row.
    got = sparse_split_matmul(np.zeros((3, 0), np.float32),
                              np.zeros((0, 4), np.float32), bias=bias,
                              activation=act).numpy()
    np.testing.assert_array_equal(got, np.tile(_activation_ref(bias, act), (3, 1)))
    # All-zero a (every row sparse, no nonzeros) at each threshold.
    for thr in THRESHOLDS:
        got = sparse_split_matmul(np.zeros((5, 6), np.float32),
                                  np.ones((6, 4), np.float32), threshold=thr,
                                  bias=bias, activation=act).numpy()
        np.testing.assert_array_equal(
            got, np.tile(_activation_ref(bias, act), (5, 1)))
    # m = 0: an empty product.
    got = sparse_split_matmul(np.zeros((0, 6), np.float32),
                              np.ones((6, 4), np.float32), bias=bias,
                              activation=act)
    assert got.shape == (0, 4)


def test_non_finite_values_through_the_epilogue(op_library):
    """NaN/Inf rows at every threshold: what TF's graph gives for
    act(matmul + bias) in the dtype -- float32: oneDNN's fused kernel,
    whose relu/relu6 post-op maps NaN to 0; float64: MatMul, BiasAdd and
    Relu, which keep it. The split plans' epilogue follows the fused
    kernel, so the threshold never changes the answer."""
    # 40 columns: the vectorised loop and its scalar tail both see them.
    a = np.array([[np.nan, 0.0], [1.0, 0.0], [np.inf, 0.0], [-np.inf, 0.0]],
                 np.float32)
    b = np.ones((2, 40), np.float32)
    bias = np.linspace(-8, 8, 40).astype(np.float32)
    tf_acts = {"none": lambda v: v, "relu": tf.nn.relu, "relu6": tf.nn.relu6}
    for dtype in (np.float32, np.float64):
        ad, bd, cd = a.astype(dtype), b.astype(dtype), bias.astype(dtype)
        for act in ACTS:
            tf_graph = tf.function(lambda x, w, c, f=tf_acts[act]: f(
                tf.nn.bias_add(tf.matmul(x, w), c)))(ad, bd, cd).numpy()
            for thr in THRESHOLDS:
                got = sparse_split_matmul(ad, bd, threshold=thr, bias=cd,
                                          activation=act).numpy()
                np.testing.assert_array_equal(got, tf_graph)
                nan_kept = act == "none" or dtype == np.float64
                assert np.isnan(got[0]).all() == nan_kept, (dtype, act, thr)
                assert not np.isnan(got[0]).any() or nan_kept
                np.testing.assert_array_equal(
                    got[1], _activation_ref(1.0 + cd, act))
                want_inf = {"none": np.inf, "relu": np.inf, "relu6": 6.0}[act]
                np.testing.assert_array_equal(got[2], want_inf)
                np.testing.assert_array_equal(
                    got[3], -np.inf if act == "none" else 0.0)


def test_deterministic_bits(op_library):
    rng = np.random.default_rng(4)
    a, b, bias = _operands(rng, 300, 200, 150, np.float32, False, False)
    outs = [sparse_split_matmul(a, b, threshold=0.5, bias=bias,
                                activation="relu6").numpy() for _ in range(3)]
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("act", ACTS)
def test_gradients_match_tf(act, dtype, op_library):
    rng = np.random.default_rng(5 + ACTS.index(act))
    rtol = 1e-4 if dtype == np.float32 else 1e-10
    for (m, k, n), thr, ta, tb in itertools.product(
            ((7, 13, 5), (33, 20, 9)), (0.0, 0.5, 1.0), (False, True),
            (False, True)):
        a, b, bias = _operands(rng, m, k, n, dtype, ta, tb)
        up = rng.standard_normal((m, n)).astype(dtype)
        av, bv, cv = (tf.Variable(v) for v in (a, b, bias))

        with tf.GradientTape() as tape:
            y = sparse_split_matmul(av, bv, threshold=thr, transpose_a=ta,
                                    transpose_b=tb, bias=cv, activation=act)
            loss = tf.reduce_sum(y * up)
        got = tape.gradient(loss, [av, bv, cv])
        with tf.GradientTape() as tape:
            y = _tf_reference(av, bv, cv, act, ta, tb)
            loss = tf.reduce_sum(y * up)
        want = tape.gradient(loss, [av, bv, cv])
        for g, w in zip(got, want):
            np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=rtol,
                                       atol=rtol * max(1.0, np.abs(w).max()))


def test_gradients_under_tf_function_and_without_bias(op_library):
    rng = np.random.default_rng(6)
    a, b, _ = _operands(rng, 20, 16, 11, np.float32, False, False)
    av, bv = tf.Variable(a), tf.Variable(b)

    @tf.function
    def grads(fn):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(fn(av, bv) ** 2)
        return tape.gradient(loss, [av, bv])

    got = grads(lambda x, y: sparse_split_matmul(x, y, threshold=0.5,
                                                 activation="relu6"))
    want = grads(lambda x, y: tf.nn.relu6(tf.matmul(x, y)))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-5)


def test_masked_input_grad_with_epilogue(op_library):
    # a with dead columns (all zero): the a-gradient is the exact one where
    # a is nonzero and 0 elsewhere (dead columns included); b and bias
    # gradients are exact.
    rng = np.random.default_rng(7)
    a, b, bias = _operands(rng, 30, 24, 10, np.float32, False, False)
    a[:, :12] = 0.0  # half the columns dead
    up = rng.standard_normal((30, 10)).astype(np.float32)
    for tb in (False, True):
        bb = np.ascontiguousarray(b.T) if tb else b
        av, bv, cv = tf.Variable(a), tf.Variable(bb), tf.Variable(bias)
        with tf.GradientTape() as tape:
            y = sparse_split_matmul(av, bv, threshold=0.5, transpose_b=tb,
                                    bias=cv, activation="relu",
                                    masked_input_grad=True)
            loss = tf.reduce_sum(y * up)
        got = tape.gradient(loss, [av, bv, cv])
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(_tf_reference(av, bv, cv, "relu", False, tb) * up)
        want = [w.numpy() for w in tape.gradient(loss, [av, bv, cv])]
        want[0] = np.where(a != 0, want[0], 0.0)
        assert np.abs(want[0][:, 12:]).max() > 0
        for g, w in zip(got, want):
            np.testing.assert_allclose(g.numpy(), w, rtol=1e-5, atol=1e-5)


def test_bad_inputs(op_library):
    a = np.ones((4, 3), np.float32)
    b = np.ones((3, 5), np.float32)
    # Wrong length: the kernel (eager) and shape inference (graph).
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"bias must be a vector \[n\] = \[5\]"):
        sparse_split_matmul(a, b, bias=np.ones(6, np.float32))
    with pytest.raises(ValueError):
        tf.function(lambda x: sparse_split_matmul(
            x, b, bias=np.ones(6, np.float32)))(a)
    # Wrong rank, wrong dtype.
    with pytest.raises(tf.errors.InvalidArgumentError, match="vector"):
        sparse_split_matmul(a, b, bias=np.ones((1, 5), np.float32))
    with pytest.raises(tf.errors.InvalidArgumentError, match="vector"):
        sparse_split_matmul(a, b, bias=np.float32(1.0))
    with pytest.raises(tf.errors.InvalidArgumentError, match="bias has dtype float64"):
        sparse_split_matmul(a, b, bias=np.ones(5, np.float64))
    # Unknown activations.
    for act in ("tanh", "RELU", "", 1, True):
        with pytest.raises(ValueError, match="activation"):
            sparse_split_matmul(a, b, activation=act)
    # The raw op refuses two biases and unknown activation attrs.
    lib = tfss.load_library()
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="num_bias"):
        lib.tf_sparse_split_sparse_split_mat_mul(
            a, b, -1.0, [np.ones(5, np.float32)] * 2)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)):
        lib.tf_sparse_split_sparse_split_mat_mul(a, b, -1.0, [], activation="gelu")


def test_three_input_node_keeps_working(op_library):
    # The rewrite pass creates 3-input nodes: defaults are no bias, 'none'.
    lib = tfss.load_library()
    a = np.abs(np.random.default_rng(8).standard_normal((6, 4))).astype(np.float32)
    b = np.ones((4, 3), np.float32)
    y, _ = lib.tf_sparse_split_sparse_split_mat_mul(a, b, 0.5, [])
    np.testing.assert_allclose(y.numpy(), a @ b, rtol=1e-6)


# -- SparseSplitDense -------------------------------------------------------

def _dense_pair(activation, use_bias=True, units=9, input_dim=14, seed=0):
    keras.utils.set_random_seed(seed)
    ours = tfss.SparseSplitDense(units, activation=activation,
                                 use_bias=use_bias, threshold=0.5)
    ref = keras.layers.Dense(units, activation=activation, use_bias=use_bias)
    ours.build((None, input_dim))
    ref.build((None, input_dim))
    rng = np.random.default_rng(seed)
    kernel = rng.standard_normal((input_dim, units)).astype(np.float32)
    weights = [kernel]
    if use_bias:
        weights.append(rng.standard_normal(units).astype(np.float32) * 2.0)
    ref.set_weights(weights)
    ours.set_weights(weights + [np.float32(0.5)])
    x = rng.standard_normal((23, input_dim)).astype(np.float32) * 2.0
    x[rng.random(x.shape) < 0.6] = 0.0
    return ours, ref, x


@pytest.mark.parametrize("activation,use_bias", [
    ("relu", True), ("relu6", True), (None, True), ("relu", False),
    ("tanh", True), ("sigmoid", False)])
def test_sparse_split_dense_equals_keras_dense(activation, use_bias, op_library):
    ours, ref, x = _dense_pair(activation, use_bias)
    xv = tf.Variable(x)
    grads = []
    for layer in (ours, ref):
        with tf.GradientTape() as tape:
            y = layer(xv)
            loss = tf.reduce_sum(y * tf.range(9, dtype=tf.float32))
        grads.append((y.numpy(), tape.gradient(
            loss, [xv] + list(layer.trainable_weights))))
    (y1, g1), (y2, g2) = grads
    np.testing.assert_allclose(y1, y2, rtol=1e-5, atol=1e-5)
    assert len(g1) == len(g2) == (3 if use_bias else 2)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-4)


def _op_attrs_in_graph(layer, x):
    graph = tf.function(lambda t: layer(t)).get_concrete_function(
        tf.TensorSpec(x.shape, tf.float32)).graph
    ops = graph.get_operations()
    mm = [op for op in ops if op.type == "TfSparseSplit>SparseSplitMatMul"]
    assert len(mm) == 1
    return mm[0], {op.type for op in ops}


def test_sparse_split_dense_fuses_bias_and_relu(op_library):
    ours, _, x = _dense_pair("relu")
    op, types = _op_attrs_in_graph(ours, x)
    assert op.get_attr("activation") in (b"relu", "relu")
    assert op.get_attr("num_bias") == 1
    assert not types & {"Relu", "BiasAdd", "AddV2", "Add"}
    # A non-fusable activation: the bias is still fused, tanh runs after.
    ours, _, x = _dense_pair("tanh")
    op, types = _op_attrs_in_graph(ours, x)
    assert op.get_attr("activation") in (b"none", "none")
    assert op.get_attr("num_bias") == 1 and "Tanh" in types
