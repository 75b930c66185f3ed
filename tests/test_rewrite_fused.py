"""Tests of the rewrite pass's look-through ops, fused forms (MatMul/Conv2D +
bias add + ReLU/ReLU6 -> one sparse-split op with epilogue) and masked input
gradients (MatMul feeding ReluGrad -> SparseSplitSddmm).

What the pass did is read from its log (``rewrite.log()``); every graph is
also run with the pass off (a separate ``tf.function`` traced and called
before ``enable()``) and the outputs compared.
"""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import op_def_registry

from tf_sparse_split import rewrite

pytestmark = pytest.mark.usefixtures("op_library")




def _records(action="rewritten"):
    return [r for r in rewrite.log() if r["action"] == action]


def _by_name(action="rewritten"):
    return {r["name"]: r for r in _records(action)}


def _assert_close(got, want, rtol=1e-5):
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = max(np.abs(want).max(), 1e-30)
    assert np.abs(got - want).max() / scale <= rtol, np.abs(got - want).max()


def _off_then_on(rw, body, *args):
    """Runs ``body`` as a new tf.function with the pass off, then as another
    with it on; returns both results (nested structures of numpy arrays)."""
    off = tf.nest.map_structure(np.asarray, tf.function(body)(*args))
    rw.log(clear=True)
    rw.reset_counters()
    rw._take_missed()   # the pass-off function: no warning wanted here
    rw.enable()
    on = tf.nest.map_structure(np.asarray, tf.function(body)(*args))
    return off, on


def _conv_has_epilogue():
    op = op_def_registry.get("TfSparseSplit>SparseSplitConv2D")
    return op is not None and any(a.name == "num_bias" for a in op.attr)


RNG = np.random.default_rng(20)
W16 = tf.constant(RNG.standard_normal((16, 5)).astype(np.float32))


def _signed(shape, seed):
    return tf.constant(np.random.default_rng(seed).standard_normal(shape)
                       .astype(np.float32))


# -- look-through ops ---------------------------------------------------------
# Each body puts a zero-preserving op between a ReLU and the MatMul "mm";
# the MatMul's activation is [*, 16].
LOOK_THROUGH = {
    "MaxPool": lambda x: tf.reshape(
        tf.nn.max_pool2d(tf.nn.relu(tf.reshape(x, [-1, 4, 8, 2])), 2, 2,
                         "VALID"), [-1, 16]),
    "AvgPool": lambda x: tf.reshape(
        tf.nn.avg_pool2d(tf.nn.relu(tf.reshape(x, [-1, 4, 8, 2])), 2, 2,
                         "VALID"), [-1, 16]),
    "Pad": lambda x: tf.pad(tf.nn.relu(x[:, :14]), [[0, 0], [1, 1]]),
    "PadV2": lambda x: tf.raw_ops.PadV2(
        input=tf.nn.relu(x[:, :12]), paddings=[[0, 0], [2, 2]],
        constant_values=tf.constant(0.0)),
    "ConcatV2": lambda x: tf.concat(
        [tf.nn.relu(x[:, :10]), tf.nn.relu6(x[:, 10:16])], axis=1),
    "Slice": lambda x: tf.slice(tf.nn.relu(x), [0, 3], [-1, 16]),
    "StridedSlice": lambda x: tf.nn.relu(x)[:, 1:33:2],
    "Reshape": lambda x: tf.reshape(tf.nn.relu(tf.reshape(x, [-1, 4, 16])),
                                    [-1, 16]),
    "Identity": lambda x: tf.identity(tf.nn.relu(x[:, :16])),
    "GatherV2": lambda x: tf.gather(tf.nn.relu(x), tf.range(16) * 2, axis=1),
    "Tile": lambda x: tf.tile(tf.nn.relu(x[:, :8]), [1, 2]),
}


@pytest.mark.parametrize("op", sorted(LOOK_THROUGH))
def test_look_through_op_is_rewritten_with_identical_output(rw, op):
    make = LOOK_THROUGH[op]

    def body(x):
        return tf.matmul(make(x), W16, name="mm")

    x = _signed((12, 32), 21)
    off, on = _off_then_on(rw, body, x)
    _assert_close(on, off)
    rec = _by_name()["mm"]
    assert rec["op"] == "MatMul" and rec["kind"] == "replace", rec
    assert op in rec["via"].split(","), rec
    assert set(rec["producer"].split("+")) <= {"Relu", "Relu6"}, rec
    if op == "ConcatV2":
        assert rec["producer"] == "Relu+Relu6"


@pytest.mark.parametrize("make,seen", [
    # Padding with a nonzero value, a concat with one dense input, MirrorPad.
    (lambda x: tf.raw_ops.PadV2(input=tf.nn.relu(x[:, :12]),
                                paddings=[[0, 0], [2, 2]],
                                constant_values=tf.constant(1.0)), "PadV2"),
    (lambda x: tf.concat([tf.nn.relu(x[:, :10]), tf.tanh(x[:, 10:16])],
                         axis=1), "Tanh"),
    (lambda x: tf.pad(tf.nn.relu(x[:, :14]), [[0, 0], [1, 1]], "REFLECT"),
     "MirrorPad"),
])
def test_ops_that_do_not_keep_zeros_stop_the_search(rw, make, seen):
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 32])
        tf.matmul(make(x), tf.ones([16, 5]), name="mm")
    (rec,) = [r for r in rewrite.dry_run(g) if r["name"] == "mm"]
    assert rec["action"] == "declined", rec
    assert rec["producer"] == seen, rec
    assert "not a listed sparse producer" in rec["reason"]


def test_dry_run_reports_look_through_path(rw):
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 8, 8, 3])
        h = tf.nn.max_pool2d(tf.nn.relu(x), 2, 2, "VALID")
        tf.matmul(tf.reshape(h, [2, -1]), tf.ones([48, 4]), name="dense")
    (rec,) = rewrite.dry_run(g)
    assert rec["action"] == "would_rewrite", rec
    assert rec["producer"] == "Relu" and rec["via"] == "Reshape,MaxPool", rec
    assert rw.counters() == {}


# -- fused forms ----------------------------------------------------------------
B5 = tf.constant(RNG.standard_normal(5).astype(np.float32))


@pytest.mark.parametrize("act,fused_ops", [
    (tf.nn.relu, "BiasAdd+Relu"), (tf.nn.relu6, "BiasAdd+Relu6"),
    (None, "BiasAdd")])
def test_matmul_bias_add_activation_fused(rw, act, fused_ops):
    def body(x):
        z = tf.nn.bias_add(tf.matmul(tf.nn.relu(x), W16 * 3.0, name="mm"), B5,
                           name="bias")
        return act(z, name="act") if act is not None else z

    x = _signed((9, 16), 22)
    off, on = _off_then_on(rw, body, x)
    _assert_close(on, off)
    rec = _by_name()["mm"]
    assert rec["kind"] == "fuse" and rec["fused"] == fused_ops, rec
    assert rec["new_op"] == "TfSparseSplit>SparseSplitMatMul"
    assert rec["new_name"] == ("act" if act is not None else "bias")
    assert rec["activation"] == {tf.nn.relu: "relu", tf.nn.relu6: "relu6",
                                 None: "none"}[act]


def test_add_with_bias_vector_is_fused_add_of_matrix_is_not(rw):
    w = tf.constant(RNG.standard_normal((16, 16)).astype(np.float32))
    b = tf.constant(RNG.standard_normal(16).astype(np.float32))
    b_row = tf.reshape(b, [1, 16])

    def body(x):
        h = tf.nn.relu(x)
        y1 = tf.nn.relu(tf.add(tf.matmul(h, w, name="vec"), b))
        y2 = tf.add(b_row, tf.matmul(h, w, name="row"))      # bias first
        y3 = tf.matmul(h, w, name="res") + x                 # residual: [M, N]
        return y1, y2, y3

    x = _signed((6, 16), 23)
    off, on = _off_then_on(rw, body, x)
    for a, b_ in zip(on, off):
        _assert_close(a, b_)
    rec = _by_name()
    assert rec["vec"]["kind"] == "fuse" and rec["vec"]["fused"] == "AddV2+Relu"
    assert rec["row"]["kind"] == "fuse" and rec["row"]["fused"] == "AddV2"
    assert rec["res"]["kind"] == "replace", rec["res"]
    assert "not a bias vector" in rec["res"]["unfused"], rec["res"]


def test_pre_activation_with_another_consumer_keeps_activation(rw):
    def body(x):
        z = tf.nn.bias_add(tf.matmul(tf.nn.relu(x), W16, name="mm"), B5,
                           name="bias")
        return tf.nn.relu(z, name="act"), z * 2.0

    x = _signed((7, 16), 24)
    off, on = _off_then_on(rw, body, x)
    for a, b in zip(on, off):
        _assert_close(a, b)
    rec = _by_name()["mm"]
    assert rec["kind"] == "fuse" and rec["fused"] == "BiasAdd", rec
    assert rec["activation"] == "none"
    assert "activation not fused" in rec["unfused"], rec


def test_product_with_another_consumer_is_not_fused(rw):
    def body(x):
        y = tf.matmul(tf.nn.relu(x), W16, name="mm")
        return tf.nn.relu(tf.nn.bias_add(y, B5)), y

    x = _signed((7, 16), 25)
    off, on = _off_then_on(rw, body, x)
    for a, b in zip(on, off):
        _assert_close(a, b)
    rec = _by_name()["mm"]
    assert rec["kind"] == "replace" and rec["fused"] == "", rec


def _mlp(seed, act="relu"):
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((20,)),
        keras.layers.Dense(48, activation="relu"),
        keras.layers.Dense(32, activation=act),
        keras.layers.Dense(3)])


def _convnet(seed):
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((12, 12, 3)),
        keras.layers.Conv2D(6, 3, activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Conv2D(8, 3, activation="relu", padding="same"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(4)])


@pytest.mark.parametrize("pre", [tf.identity, tf.nn.relu])
def test_grouped_conv2d_is_left_to_tensorflow(rw, pre):
    """A grouped Conv2D (input channels a multiple of the filter's) runs in
    TF; SparseSplitConv2D does not take it, so the pass declines it (on
    the function's input and on a ReLU output alike)."""
    rng = np.random.default_rng(44)
    x = rng.random((2, 7, 6, 4)).astype(np.float32)
    x[x < 0.5] = 0.0
    k = rng.standard_normal((3, 3, 2, 6)).astype(np.float32)

    def body(x, k):
        return tf.nn.conv2d(pre(x), k, 1, "SAME")

    off, on = _off_then_on(rw, body, x, k)
    assert on.shape == (2, 7, 6, 6)
    _assert_close(on, off)
    assert _records() == []
    (rec,) = [r for r in _records("declined") if r["op"] == "Conv2D"]
    assert "grouped convolution (input channels 4, filter input channels 2)" \
        in rec["reason"], rec


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("act", [tf.nn.relu, tf.nn.relu6])
def test_fused_matmul_nan_rows_match_the_fused_graph(rw, dtype, act):
    """A NaN in the input of act(x @ w + b): the rewritten graph gives what
    the graph without the pass gives -- float32: Grappler's oneDNN fused
    kernel, whose relu/relu6 map NaN to 0; float64: unfused ops, NaN."""
    x = np.ones((6, 8), dtype)
    x[1, 2] = np.nan
    x[3, :5] = 0.0
    w = np.linspace(-1, 1, 24).reshape(8, 3).astype(dtype)
    b = np.array([0.5, -0.5, 7.0], dtype)

    def body(x, w, b):
        return act(tf.nn.bias_add(tf.matmul(x, w), b))

    off, on = _off_then_on(rw, body, x, w, b)
    np.testing.assert_array_equal(on, off)
    assert np.isnan(off[1]).any() == (dtype == np.float64)
    (rec,) = _records()
    assert rec["kind"] == "fuse" and rec["producer"] == "Input", rec


@pytest.mark.parametrize("act", ["relu", "relu6"])
def test_keras_mlp_inference_graph_is_fused(rw, act):
    x = tf.constant(np.random.default_rng(26).standard_normal((10, 20))
                    .astype(np.float32))
    m = _mlp(1, act)
    want = tf.function(lambda t: m(t, training=False))(x)
    rw.enable()
    got = tf.function(lambda t: m(t, training=False))(x)
    _assert_close(got, want)
    fused = [r for r in _records() if r["kind"] == "fuse"]
    # Layer 1 (ReLU whatever `act` is) reads the model input ("Input"),
    # layer 2 layer 1's ReLU, layer 3 layer 2's activation: all three are
    # fused. Keras 3 writes its bias add as BiasAdd (TF backend's add()).
    act_op = {"relu": "Relu", "relu6": "Relu6"}[act]
    assert sorted(r["fused"] for r in fused) == sorted(
        ["BiasAdd+Relu", "BiasAdd+" + act_op, "BiasAdd"])
    assert sorted(r["producer"] for r in fused) == sorted(
        ["Input", "Relu", act_op])
    assert rw.counters() == {"MatMul": 3}


def test_keras_convnet_inference_and_saved_model(rw, tmp_path):
    """Conv->ReLU->MaxPool->Conv->ReLU->MaxPool->Flatten->Dense: the first
    conv (the model's input), the second (input from MaxPool) and the dense
    layer (Flatten of MaxPool) are rewritten, each with its bias (and ReLU)
    when the op can take them."""
    m = _convnet(2)
    x = tf.constant(np.random.default_rng(27).standard_normal((5, 12, 12, 3))
                    .astype(np.float32))
    want = tf.function(lambda t: m(t, training=False))(x)
    path = str(tmp_path / "convnet")
    m.export(path, format="tf_saved_model", verbose=False)
    rw.enable()
    got = tf.function(lambda t: m(t, training=False))(x)
    _assert_close(got, want)
    conv_fused = _conv_has_epilogue()

    def check(via_input):
        recs = _records()
        dense = [r for r in recs if r["op"] == "MatMul"]
        conv = [r for r in recs if r["op"] == "Conv2D"]
        assert len(dense) == 1 and dense[0]["kind"] == "fuse", recs
        assert dense[0]["fused"] == "BiasAdd", dense
        assert dense[0]["via"] == "Reshape,MaxPool", dense
        assert len(conv) == 2, recs
        assert sorted((r["producer"], r["via"]) for r in conv) == [
            ("Input", via_input), ("Relu", "MaxPool")], conv
        for r in conv:
            if conv_fused:
                assert r["kind"] == "fuse", conv
                assert r["fused"] == "BiasAdd+Relu", conv
            else:
                assert r["kind"] == "replace", conv
                assert "has no bias input" in r["unfused"], conv

    check("")
    rw.log(clear=True)
    loaded = tf.saved_model.load(path)
    _assert_close(loaded.serve(x), want)
    check("Identity")  # the serving signature reads its input through one


def test_conv2d_bias_relu_fused(rw):
    if not _conv_has_epilogue():
        pytest.skip("SparseSplitConv2D has no num_bias attribute in this build")
    rng = np.random.default_rng(28)
    k = tf.constant(rng.standard_normal((3, 3, 4, 5)).astype(np.float32))
    b = tf.constant(rng.standard_normal(5).astype(np.float32))

    def body(x):
        h = tf.nn.relu(x)
        y1 = tf.nn.relu6(tf.nn.bias_add(
            tf.nn.conv2d(h, k, 1, "SAME", name="c1"), b))
        y2 = tf.nn.conv2d(h, k, 2, "VALID", name="c2") + tf.reshape(b, [1, 1, 1, 5])
        return y1, y2

    x = tf.constant(rng.standard_normal((2, 9, 9, 4)).astype(np.float32))
    off, on = _off_then_on(rw, body, x)
    for a, b_ in zip(on, off):
        _assert_close(a, b_)
    rec = _by_name()
    assert rec["c1"]["kind"] == "fuse" and rec["c1"]["fused"] == "BiasAdd+Relu6"
    assert rec["c2"]["kind"] == "fuse" and rec["c2"]["fused"] == "AddV2"


# -- training graphs ------------------------------------------------------------
def test_input_gradient_feeding_relu_grad_becomes_sddmm(rw):
    rng = np.random.default_rng(29)
    w1 = tf.constant(rng.standard_normal((24, 40)).astype(np.float32) * 0.3)
    w2 = tf.constant(rng.standard_normal((40, 33)).astype(np.float32) * 0.3)
    w3 = tf.constant(rng.standard_normal((33, 6)).astype(np.float32) * 0.3)
    b2 = tf.constant(rng.standard_normal(33).astype(np.float32) * 0.1)

    def body(x):
        ws = [w1, w2, w3, b2]
        with tf.GradientTape() as tape:
            tape.watch(ws)
            h1 = tf.nn.relu(tf.matmul(x, w1, name="l1"))
            h2 = tf.nn.relu6(tf.matmul(h1, w2, name="l2") + b2)
            y = tf.matmul(h2, w3, name="l3")
            loss = tf.reduce_sum(y * y)
        return y, tape.gradient(loss, ws)

    x = _signed((17, 24), 30) * 3.0
    off, on = _off_then_on(rw, body, x)
    _assert_close(on[0], off[0])
    for a, b in zip(on[1], off[1]):
        _assert_close(a, b)
    recs = _records()
    sddmm = [r for r in recs if r["kind"] == "sddmm"]
    # dH2 = dY W3^T feeds Relu6Grad(., h2); dH1 = dZ2 W2^T feeds ReluGrad.
    assert len(sddmm) == 2, recs
    assert {r["new_op"] for r in sddmm} == {"TfSparseSplit>SparseSplitSddmm"}
    assert {r["producer"] for r in sddmm} == {"Relu", "Relu6"}
    fused = [r for r in recs if r["kind"] == "fuse"]
    assert [r["name"] for r in fused] == ["l2"] and fused[0]["fused"] == "AddV2+Relu6"


def test_input_gradient_with_other_consumer_is_not_sddmm(rw):
    rng = np.random.default_rng(31)
    w = tf.constant(rng.standard_normal((16, 12)).astype(np.float32))

    def body(x, dy):
        h = tf.nn.relu(x)
        dh = tf.matmul(tf.nn.relu(dy), w, transpose_b=True, name="dh")
        return tf.raw_ops.ReluGrad(gradients=dh, features=h), dh

    x = _signed((8, 16), 32)
    dy = _signed((8, 12), 33)
    off, on = _off_then_on(rw, body, x, dy)
    for a, b in zip(on, off):
        _assert_close(a, b)
    rec = _by_name()["dh"]
    assert rec["kind"] == "replace" and rec["producer"] == "Relu", rec


def test_keras_training_matches_unrewritten(rw):
    """train_on_batch on the MLP and the convnet: losses and weights after a
    few steps equal those of the unrewritten models; the train graph has the
    fused forward layers and the SDDMM input gradient."""
    import keras

    rng = np.random.default_rng(34)
    data = {
        _mlp: (rng.standard_normal((32, 20)).astype(np.float32),
               rng.integers(0, 3, 32)),
        _convnet: (rng.standard_normal((16, 12, 12, 3)).astype(np.float32),
                   rng.integers(0, 4, 16)),
    }

    def train(build, on):
        m = build(3)
        m.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
        if on:
            rw.enable()
        x, y = data[build]
        losses = [float(m.train_on_batch(x, y)) for _ in range(3)]
        rw.disable()
        return losses, m.get_weights()

    for build in (_mlp, _convnet):
        l0, w0 = train(build, False)
        rw.log(clear=True)
        l1, w1 = train(build, True)
        np.testing.assert_allclose(l1, l0, rtol=1e-5)
        for a, b in zip(w1, w0):
            _assert_close(a, b, 1e-5)
        kinds = [r["kind"] for r in _records()]
        assert "fuse" in kinds, kinds
        if build is _mlp:
            assert "sddmm" in kinds, kinds
        else:
            # The first conv's filter gradient reads the model's input, the
            # second's the first MaxPool.
            dws = sorted((r for r in _records()
                          if r["op"] == "Conv2DBackpropFilter"),
                         key=lambda r: r["producer"])
            assert [(r["producer"], r["via"]) for r in dws] == [
                ("Input", ""), ("Relu", "MaxPool")], dws
            for dw in dws:
                assert dw["new_op"] == (
                    "TfSparseSplit>SparseSplitConv2DBackpropFilter")


def test_input_producer_counts_graph_inputs(rw):
    """The default producers count a graph input (here a Placeholder) as
    sparse ("Input"); without "Input" it is not."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 16])
        tf.matmul(x, tf.ones([16, 5]), name="from_input")
    assert "Input" in rewrite.DEFAULT_PRODUCERS
    (rec,) = rewrite.dry_run(g)
    assert rec["action"] == "would_rewrite" and rec["producer"] == "Input"
    relu_only = tuple(p for p in rewrite.DEFAULT_PRODUCERS if p != "Input")
    (rec,) = rewrite.dry_run(g, producers=relu_only)
    assert rec["action"] == "declined" and rec["producer"] == "Placeholder"


def test_fused_and_sddmm_nodes_inside_a_while_loop(rw):
    """A loop body with ReLU -> MatMul + bias -> ReLU and its gradient: the
    replacements (and their Consts) live in the loop's frame; values and
    gradients equal the unrewritten loop's."""
    rng = np.random.default_rng(35)
    w = tf.constant(rng.standard_normal((12, 12)).astype(np.float32) * 0.4)
    b = tf.constant(rng.standard_normal(12).astype(np.float32) * 0.1)

    def body(x):
        with tf.GradientTape() as tape:
            tape.watch([w, b])

            def step(i, h):
                z = tf.nn.bias_add(tf.matmul(tf.nn.relu(h), w, name="mm"), b)
                return i + 1, tf.nn.relu(z) - 0.05

            _, h = tf.while_loop(lambda i, h: i < 4, step, [0, x])
            loss = tf.reduce_sum(h * h)
        return h, tape.gradient(loss, [w, b])

    x = _signed((5, 12), 36)
    off, on = _off_then_on(rw, body, x)
    _assert_close(on[0], off[0])
    for a, b_ in zip(on[1], off[1]):
        _assert_close(a, b_)
    recs = _records()
    assert any(r["kind"] == "fuse" and "while" in r["name"] for r in recs), recs
    # In the gradient loop the ReLU output arrives through a
    # TensorListPopBack: the ReluGrad consumer alone makes it an SDDMM.
    (sddmm,) = [r for r in recs if r["kind"] == "sddmm"]
    assert "while_grad" in sddmm["name"] and sddmm["producer"] == "ReluGrad"
    assert sddmm["via"] == "features:TensorListPopBack", sddmm


def test_conv_filter_gradient_entry_and_its_flops(rw):
    g = tf.Graph()
    with g.as_default():
        x = tf.nn.relu(tf.compat.v1.placeholder(tf.float32, [2, 8, 8, 3]))
        dy = tf.compat.v1.placeholder(tf.float32, [2, 8, 8, 4])
        tf.raw_ops.Conv2DBackpropFilter(
            input=x, filter_sizes=[3, 3, 3, 4], out_backprop=dy,
            strides=[1, 1, 1, 1], padding="SAME", name="dw")
    flops = 2.0 * (2 * 8 * 8 * 4) * (3 * 3 * 3)
    (rec,) = rewrite.dry_run(g, min_flops=flops)
    assert rec["action"] == "would_rewrite", rec
    assert rec["new_op"] == "TfSparseSplit>SparseSplitConv2DBackpropFilter"
    (rec,) = rewrite.dry_run(g, min_flops=flops + 1)
    assert rec["action"] == "declined" and "min_flops" in rec["reason"], rec
    assert rewrite.dry_run(g, ops=("MatMul", "Conv2D")) == []  # not listed


def _session_partition_ops(build, feed_shape):
    """Runs the v1 graph ``build(x)`` once in a session (the pass and
    Grappler act as in a tf.function) and returns ``{node name: (op,
    fused_ops)}`` of the graph that ran, and the output."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, feed_shape, name="x")
        y = build(x)
    opts = tf.compat.v1.RunOptions(output_partition_graphs=True)
    meta = tf.compat.v1.RunMetadata()
    feed = np.random.default_rng(41).standard_normal(feed_shape).astype(
        np.float32)
    with tf.compat.v1.Session(graph=g) as sess:
        out = sess.run(y, {x: feed}, options=opts, run_metadata=meta)
    ran = {}
    for pg in meta.partition_graphs:
        for n in pg.node:
            fused = [s.decode() for s in n.attr["fused_ops"].list.s]
            ran[n.name] = (n.op, fused)
    return ran, out


def test_replaced_consumer_leaves_producer_relu_fusable(rw):
    """relu(x @ w1 + b1) feeding a replaced MatMul: outside loops the
    pass's threshold Const gets no control edge from that ReLU, so
    Grappler's remapper still fuses MatMul + BiasAdd + Relu of the first
    layer into one kernel (it declines activations with control fan-outs)
    -- as in the graph without the pass."""
    rng = np.random.default_rng(40)
    w1 = rng.standard_normal((24, 32)).astype(np.float32)
    b1 = rng.standard_normal(32).astype(np.float32)
    w2 = rng.standard_normal((32, 8)).astype(np.float32)
    b2 = rng.standard_normal(8).astype(np.float32)

    def build(x):
        h = tf.nn.relu(tf.nn.bias_add(tf.matmul(x, w1, name="mm1"), b1),
                       name="h1")
        return tf.nn.relu(tf.nn.bias_add(tf.matmul(h, w2, name="mm2"), b2),
                          name="h2")

    off, want = _session_partition_ops(build, [6, 24])
    rw.log(clear=True)
    rw._take_missed()   # the pass-off session graph: no warning wanted
    # mm1 reads the graph's input: keep it TF's (producers without "Input").
    rw.enable(producers=tuple(p for p in rewrite.DEFAULT_PRODUCERS
                              if p != "Input"))
    on, got = _session_partition_ops(build, [6, 24])
    _assert_close(got, want)
    (rec,) = _records()
    assert rec["name"] == "mm2" and rec["kind"] == "fuse", rec
    assert rec["threshold_anchor"] == "", rec
    # The first layer ran as the same fused kernel with and without the pass.
    assert "Relu" in off["h1"][1], off["h1"]
    assert on["h1"] == off["h1"], (on["h1"], off["h1"])
    assert on["h2"][0] == "TfSparseSplit>SparseSplitMatMul", on["h2"]


def test_consts_anchored_in_loop_frames_only(rw):
    """Inside a while loop the threshold Const keeps its control edge from
    the activation's producer (its frame); the loop's rewrite is exact."""
    rng = np.random.default_rng(42)
    w = tf.constant(rng.standard_normal((12, 12)).astype(np.float32) * 0.4)

    def body(x):
        def step(i, h):
            return i + 1, tf.matmul(tf.nn.relu(h, name="act"), w, name="mm")
        return tf.while_loop(lambda i, h: i < 3, step, [0, x])[1]

    x = _signed((5, 12), 43)
    off, on = _off_then_on(rw, body, x)
    _assert_close(on, off)
    (rec,) = _records()
    assert rec["threshold_anchor"].endswith("act"), rec
