"""Tests of the graph-rewrite pass (cc/rewrite) and its switch (rewrite.py).

The pass changes graphs after Python traced them (a concrete function's
``.graph`` shows the pre-pass graph), so what it did is read from its
counters and its log (``rewrite.log()``: one record per rewritten or declined
node, with the new node's device, transposes and edges).
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from tf_sparse_split import rewrite

pytestmark = pytest.mark.usefixtures("op_library")
REPO = Path(__file__).resolve().parents[1]




def _records(action=None, name_part=None):
    out = []
    for r in rewrite.log():
        if action and r["action"] != action:
            continue
        if name_part and name_part not in r["name"]:
            continue
        out.append(r)
    return out


def _relu_input(rng, shape, dtype=np.float32, sparsity=0.7):
    x = rng.standard_normal(shape)
    x[rng.random(shape) < sparsity] = 0.0
    return x.astype(dtype)


def _assert_close(got, want, rtol):
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    scale = max(np.abs(want).max(), 1e-30)
    assert np.abs(got - want).max() / scale <= rtol, (got, want)


def _mlp3_step(dtype):
    """A tf.function: 3-layer ReLU MLP forward + GradientTape gradients."""
    rng = np.random.default_rng(0)
    ws = [tf.constant(rng.standard_normal(s).astype(dtype) * 0.3)
          for s in ((24, 40), (40, 33), (33, 5))]

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(ws)
            h1 = tf.nn.relu(tf.matmul(x, ws[0], name="l1"))
            h2 = tf.nn.relu(tf.matmul(h1, ws[1], name="l2"))
            y = tf.matmul(h2, ws[2], name="l3")
            loss = tf.reduce_sum(y * y)
        return y, tape.gradient(loss, ws)

    return step


@pytest.mark.parametrize("dtype,rtol", [(np.float32, 1e-5), (np.float64, 1e-12)])
def test_forward_and_gradients_match_unrewritten(rw, dtype, rtol):
    x = tf.constant(np.random.default_rng(1).standard_normal((17, 24)).astype(dtype))
    y0, g0 = _mlp3_step(dtype)(x)
    assert rw.counters() == {}
    assert _records("rewritten") == []
    with pytest.warns(RuntimeWarning, match="already instantiated"):
        rw.enable()  # the first step ran while the pass was off
    y1, g1 = _mlp3_step(dtype)(x)
    _assert_close(y1, y0, rtol)
    for a, b in zip(g1, g0):
        _assert_close(a, b, rtol)
    # Forward l1 and its dW1 = x^T dZ1 read the graph input x ("Input");
    # forward l2, l3 (ReLU inputs); backward dW2 = h1^T dZ2 and dW3 = h2^T dY
    # (transpose_a, ReLU outputs); dH2 = dY W3^T and dH1 = dZ2 W2^T feed
    # only ReluGrad(., h2) / ReluGrad(., h1): SDDMMs masked by h2 / h1.
    assert rw.counters() == {"MatMul": 8}
    done = _records("rewritten")
    assert len(done) == 8
    assert sorted(r["producer"] for r in done) == ["Input"] * 2 + ["Relu"] * 6
    assert sum(r["transpose_a"] == "1" for r in done) == 3
    sddmm = [r for r in done if r["kind"] == "sddmm"]
    assert len(sddmm) == 2
    assert {r["new_op"] for r in sddmm} == {"TfSparseSplit>SparseSplitSddmm"}
    assert {r["new_op"] for r in done if r["kind"] != "sddmm"} == {
        "TfSparseSplit>SparseSplitMatMul"}
    fwd = {r["name"] for r in done if "gradient" not in r["name"]}
    assert fwd == {"l1", "l2", "l3"}  # l1 reads the function argument
    assert _records("declined") == []


def test_pass_off_by_default():
    code = (
        "import tensorflow as tf\n"
        "from tf_sparse_split import rewrite\n"
        "assert not rewrite.is_enabled()\n"
        "w = tf.ones([8, 4])\n"
        "f = tf.function(lambda x: tf.matmul(tf.nn.relu(x), w))\n"
        "f(tf.ones([3, 8]))\n"
        "assert rewrite.counters() == {}, rewrite.counters()\n"
        "assert [r['action'] for r in rewrite.log()] == ['missed'], rewrite.log()\n"
        "rewrite.enable()\n"
        "f2 = tf.function(lambda x: tf.matmul(tf.nn.relu(x), w))\n"
        "f2(tf.ones([3, 8]))\n"
        "assert rewrite.counters() == {'MatMul': 1}, rewrite.counters()\n"
        "print('OK')\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="2")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "OK" in res.stdout


def test_control_dependencies_and_device_preserved(rw):
    v = tf.Variable(0.0)
    w = tf.constant(np.random.default_rng(2).standard_normal((8, 6)).astype(np.float32))

    @tf.function
    def f(x):
        with tf.device("/CPU:0"):
            h = tf.nn.relu(x)
            bump = v.assign_add(1.0, name="bump")
            with tf.control_dependencies([bump]):
                y = tf.matmul(h, w, transpose_b=False, name="mm")
            with tf.control_dependencies([y]):
                after = tf.identity(x, name="after")
        return y, after

    rw.enable()
    x = tf.constant(_relu_input(np.random.default_rng(3), (5, 8)) - 0.1)
    y, after = f(x)
    _assert_close(y, tf.matmul(tf.nn.relu(x), w), 1e-5)
    assert float(v.numpy()) == 1.0
    _assert_close(after, x, 0)
    (rec,) = _records("rewritten", "mm")
    assert rec["name"] == "mm"
    assert "CPU:0" in rec["device"], rec
    assert "bump" in rec["control_in"].split(","), rec
    assert "after" in rec["control_out"].split(","), rec
    assert rec["data_out"], rec  # y is still consumed (by the function output)
    assert rec["threshold_node"].startswith("mm/tfss_threshold")


def test_enable_disable_around_traced_functions(rw):
    w = tf.ones([8, 4])
    x = tf.constant(np.abs(np.random.default_rng(4).standard_normal((3, 8))), tf.float32)

    def body(x):
        return tf.matmul(tf.nn.relu(x), w, name="mmx")

    f = tf.function(body)
    f(x)                                   # instantiated while off
    concrete = tf.function(body).get_concrete_function(x)  # traced while off
    assert rw.counters() == {}
    rw.enable()
    f(x)                                   # keeps its already-optimized graph
    assert rw.counters() == {}
    concrete(x)                            # first call: instantiated now
    assert rw.counters() == {"MatMul": 1}
    tf.function(body)(x)                   # a new function is rewritten
    assert rw.counters() == {"MatMul": 2}
    rw.disable()
    tf.function(body)(x)
    assert rw.counters() == {"MatMul": 2}
    with rewrite.enabled(threshold=0.5):
        assert rewrite.is_enabled()
        tf.function(body)(x)
    assert not rewrite.is_enabled()
    assert rw.counters() == {"MatMul": 3}
    assert _records("rewritten")[-1]["threshold"] == "0.5"
    assert rw.counters(reset=True) == {"MatMul": 3}
    assert rw.counters() == {}


def test_enable_validates_arguments(rw):
    for kwargs in ({"threshold": 1.5}, {"threshold": "fast"}, {"min_flops": -1},
                   {"ops": ("Foo",)}, {"ops": ()}, {"producers": "some"},
                   {"producers": ()}):
        with pytest.raises(ValueError):
            rewrite.enable(**kwargs)
    assert not rewrite.is_enabled()
    assert "MatMul" in rewrite.active_ops()


def test_unknown_static_shapes_and_min_flops(rw):
    w = tf.constant(np.random.default_rng(5).standard_normal((16, 8)).astype(np.float32))

    def body(x):
        return tf.matmul(tf.nn.relu(x), w, name="mm_unknown")

    x = tf.constant(_relu_input(np.random.default_rng(6), (7, 16)))
    want = tf.matmul(tf.nn.relu(x), w)
    # Unknown batch dimension: never skipped by min_flops.
    rw.enable(min_flops=1e12)
    f = tf.function(body, input_signature=[tf.TensorSpec([None, None], tf.float32)])
    _assert_close(f(x), want, 1e-5)
    assert rw.counters() == {"MatMul": 1}
    # Fully known and small: skipped.
    g = tf.function(body, input_signature=[tf.TensorSpec([7, 16], tf.float32)])
    _assert_close(g(x), want, 1e-5)
    assert rw.counters() == {"MatMul": 1}
    (rec,) = _records("declined", "mm_unknown")
    assert "min_flops" in rec["reason"]
    # Same graph, threshold below its 2*7*16*8 flops: rewritten.
    rw.enable(min_flops=2 * 7 * 16 * 8)
    g2 = tf.function(body, input_signature=[tf.TensorSpec([7, 16], tf.float32)])
    _assert_close(g2(x), want, 1e-5)
    assert rw.counters() == {"MatMul": 2}


@pytest.mark.parametrize("dtype", [tf.int32, tf.complex64])
def test_declines_unsupported_dtypes(rw, dtype):
    rw.enable(producers="any")
    a = tf.cast(tf.constant([[1, 0, 2], [0, 0, 3]]), dtype)
    b = tf.cast(tf.constant([[1, 2], [3, 4], [5, 6]]), dtype)
    f = tf.function(lambda a, b: tf.matmul(tf.identity(a), b, name="mm_dtype"))
    np.testing.assert_array_equal(f(a, b).numpy(), tf.matmul(a, b).numpy())
    assert rw.counters() == {}
    (rec,) = _records("declined", "mm_dtype")
    assert "dtype" in rec["reason"] and dtype.name in rec["reason"], rec


def test_leaves_alone_graph_without_sparse_producer(rw):
    rw.enable()
    w = tf.ones([6, 3])
    f = tf.function(lambda x: tf.matmul(tf.sigmoid(x), w, name="mm_sig"))
    x = tf.ones([2, 6])
    _assert_close(f(x), tf.matmul(tf.sigmoid(x), w), 1e-6)
    assert rw.counters() == {}
    (rec,) = _records("declined", "mm_sig")
    assert "Sigmoid" in rec["reason"]


def test_declines_device_without_kernel(rw):
    """A MatMul pinned to a GPU stays a MatMul (we have no GPU kernel); on a
    CPU-only machine soft placement then runs it on the CPU."""
    rw.enable()
    w = tf.ones([6, 3])

    @tf.function
    def f(x):
        with tf.device("/device:GPU:0"):
            return tf.matmul(tf.nn.relu(x), w, name="mm_gpu")

    tf.config.set_soft_device_placement(True)
    x = tf.ones([2, 6])
    _assert_close(f(x), tf.matmul(tf.nn.relu(x), w), 1e-6)
    assert rw.counters() == {}
    (rec,) = _records("declined", "mm_gpu")
    assert "kernel" in rec["reason"] and "GPU" in rec["reason"], rec


def test_declines_jit_compiled_function(rw):
    rw.enable()
    w = tf.constant(np.random.default_rng(7).standard_normal((6, 3)).astype(np.float32))
    f = tf.function(lambda x: tf.matmul(tf.nn.relu(x), w, name="mm_xla"),
                    jit_compile=True)
    x = tf.constant(np.random.default_rng(8).standard_normal((4, 6)).astype(np.float32))
    _assert_close(f(x), tf.matmul(tf.nn.relu(x), w), 1e-5)
    assert rw.counters() == {}
    assert _records("rewritten") == []
    # If TF shows the pass the body at all, it is declined as XLA-compiled.
    for rec in _records("declined", "mm_xla"):
        assert "XLA" in rec["reason"], rec


def test_dropout_pattern(rw):
    rw.enable()
    w = tf.constant(np.random.default_rng(9).standard_normal((32, 4)).astype(np.float32))

    @tf.function
    def f(x):
        d = tf.nn.experimental.stateless_dropout(x, 0.5, seed=[1, 2])
        return tf.matmul(d, w, name="mm_drop"), d

    x = tf.constant(np.random.default_rng(10).standard_normal((9, 32)).astype(np.float32))
    y, d = f(x)
    _assert_close(y, tf.matmul(d, w), 1e-5)
    (rec,) = _records("rewritten", "mm_drop")
    assert rec["producer"] == "Dropout"


def _keras_model(seed):
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((20,)),
        keras.layers.Dense(48, activation="relu"),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    return model


def test_keras_predict_and_fit_match_unrewritten(rw):
    rng = np.random.default_rng(11)
    x = rng.standard_normal((96, 20)).astype(np.float32)
    y = rng.integers(0, 3, 96)
    m0 = _keras_model(0)
    h0 = m0.fit(x, y, epochs=2, batch_size=32, shuffle=False, verbose=0)
    p0 = m0.predict(x, verbose=0)
    assert rw.counters() == {}
    rw.enable()
    m1 = _keras_model(0)
    h1 = m1.fit(x, y, epochs=2, batch_size=32, shuffle=False, verbose=0)
    n_fit = rw.counters().get("MatMul", 0)
    # train step: 2 forward + dW2, dW3 (ReLU inputs) + dH1 (ReluGrad).
    assert n_fit >= 5
    p1 = m1.predict(x, verbose=0)
    assert rw.counters()["MatMul"] >= n_fit + 2  # predict function: 2 forward
    _assert_close(p1, p0, 1e-5)
    np.testing.assert_allclose(h1.history["loss"], h0.history["loss"], rtol=1e-5)
    for a, b in zip(m1.get_weights(), m0.get_weights()):
        _assert_close(a, b, 1e-5)


def test_saved_model_round_trip(rw, tmp_path):
    rng = np.random.default_rng(12)

    class Mlp(tf.Module):
        def __init__(self):
            super().__init__()
            self.w1 = tf.Variable(rng.standard_normal((20, 64)).astype(np.float32))
            self.w2 = tf.Variable(rng.standard_normal((64, 10)).astype(np.float32))

        @tf.function(input_signature=[tf.TensorSpec([None, 20], tf.float32)])
        def __call__(self, x):
            return tf.matmul(tf.nn.relu(tf.matmul(x, self.w1)), self.w2)

    path = str(tmp_path / "mlp")
    tf.saved_model.save(Mlp(), path)
    x = tf.constant(rng.standard_normal((13, 20)).astype(np.float32))
    want = tf.saved_model.load(path)(x)
    assert rw.counters() == {}
    rw.enable()
    loaded = tf.saved_model.load(path)
    got = loaded(x)
    _assert_close(got, want, 1e-5)
    # Both: the first reads the signature's input, the second a ReLU.
    assert rw.counters() == {"MatMul": 2}


def test_conv2d_entry_when_op_registered(rw):
    if "Conv2D" not in rewrite.active_ops():
        pytest.skip("SparseSplitConv2D is not registered in this build")
    rw.enable(ops=("MatMul", "Conv2D"))
    rng = np.random.default_rng(13)
    k = tf.constant(rng.standard_normal((3, 3, 4, 5)).astype(np.float32))
    f = tf.function(lambda x: tf.nn.conv2d(tf.nn.relu(x), k, 1, "SAME", name="cv"))
    x = tf.constant(rng.standard_normal((2, 9, 9, 4)).astype(np.float32))
    _assert_close(f(x), tf.nn.conv2d(tf.nn.relu(x), k, 1, "SAME"), 1e-5)
    assert rw.counters().get("Conv2D") == 1


def test_declines_nodes_in_xla_scope(rw):
    """Nodes carrying XLA clustering attributes (_XlaCompile/_XlaScope) are
    left alone (a jit_compile=True function body is compiled by XLA and not
    shown to the pass at all; see test_declines_jit_compiled_function)."""
    rw.enable()
    w = tf.ones([6, 3])

    @tf.function
    def g(x):
        with tf.xla.experimental.jit_scope():
            return tf.matmul(tf.nn.relu(x), w, name="mm_scope")

    x = tf.ones([4, 6])
    _assert_close(g(x), tf.matmul(tf.nn.relu(x), w), 1e-6)
    assert rw.counters() == {}
    (rec,) = _records("declined", "mm_scope")
    assert "XLA" in rec["reason"], rec


# -- what the pass sees ----------------------------------------------------
def test_enable_defaults_include_conv2d(rw):
    """enable()'s defaults rewrite what profile reports as pass=yes,
    Conv2D included."""
    assert rewrite.DEFAULT_OPS == ("MatMul", "Conv2D", "Conv2DBackpropFilter")
    active = rw.enable()
    assert "Conv2D" in active and "Conv2DBackpropFilter" in active
    assert rw.config()["ops"] == rewrite.DEFAULT_OPS
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 6, 6, 3)).astype(np.float32)
    k = rng.standard_normal((3, 3, 3, 4)).astype(np.float32)

    @tf.function
    def f(a):
        return tf.nn.conv2d(tf.nn.relu(a), k, 1, "SAME")

    got = f(x)
    assert rw.counters().get("Conv2D") == 1
    _assert_close(got, tf.nn.conv2d(tf.nn.relu(x), k, 1, "SAME"), 1e-5)


def test_nchw_conv2d_is_declined(rw):
    rw.enable()
    g = tf.Graph()
    with g.as_default():
        a = tf.nn.relu(tf.compat.v1.placeholder(tf.float32, [1, 3, 5, 5]))
        tf.raw_ops.Conv2D(input=a, filter=tf.ones([1, 1, 3, 2]),
                          strides=[1, 1, 1, 1], padding="VALID",
                          data_format="NCHW", name="conv_nchw")
    rec = {r["name"]: r for r in rewrite.dry_run(g)}
    assert rec["conv_nchw"]["action"] == "declined"
    assert "data_format" in rec["conv_nchw"]["reason"]


def test_function_instantiated_before_enable_warns_and_logs(rw):
    w = tf.constant(np.eye(4, dtype=np.float32))

    @tf.function
    def early(a):
        return tf.matmul(tf.nn.relu(a), w)

    early(tf.ones([2, 4]))  # instantiated while the pass is off
    name = early.get_concrete_function(tf.ones([2, 4])).function_def \
        .signature.name
    with pytest.warns(RuntimeWarning, match="already instantiated") as rec:
        rw.enable()
    assert name in str(rec[0].message)
    missed = [r for r in rw.log() if r["action"] == "missed"]
    assert any(r["function"] == name and r["op"] == "MatMul:1"
               for r in missed), missed
    # Once: a second enable() does not warn again for the same function.
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rw.enable()
    early(tf.ones([2, 4]))  # keeps its graph
    assert rw.counters() == {}


def test_xla_callee_is_logged_as_declined(rw):
    rw.enable()
    w = tf.constant(np.eye(4, dtype=np.float32))

    @tf.function(jit_compile=True)
    def xla(a):
        return tf.matmul(a, w)

    @tf.function
    def outer(a):
        return xla(tf.nn.relu(a)) + 1.0

    try:
        outer(tf.ones([2, 4]))
    except tf.errors.OpError as e:  # no XLA in this TensorFlow build
        pytest.skip(f"XLA unavailable: {e}")
    declined = [r for r in rw.log() if r["action"] == "declined"
                and "XLA-compiled" in r.get("reason", "")]
    assert declined and declined[0]["op"] == "MatMul", rw.log()


def test_dry_run_answers_like_the_pass(rw):
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [8, 4], name="x")
        w = tf.ones([4, 4])
        h = tf.matmul(x, w, name="from_input")
        tf.matmul(tf.nn.relu(h), w, name="from_relu")
        tf.matmul(tf.nn.dropout(tf.nn.relu(h), 0.5), w, name="from_dropout")
        tf.matmul(tf.cast(tf.nn.relu(h), tf.float64), tf.ones([4, 4], tf.float64),
                  name="through_cast")
        tf.matmul(tf.cast(tf.nn.relu(h), tf.int32), tf.ones([4, 4], tf.int32),
                  name="int")
    rec = {r["name"]: r for r in rewrite.dry_run(g)}
    assert rec["from_input"]["action"] == "would_rewrite"
    assert rec["from_input"]["producer"] == "Input"
    relu_only = tuple(p for p in rewrite.DEFAULT_PRODUCERS if p != "Input")
    (off,) = [r for r in rewrite.dry_run(g, producers=relu_only)
              if r["name"] == "from_input"]
    assert off["action"] == "declined" and off["producer"] == "Placeholder"
    assert "not a listed sparse producer" in off["reason"]
    assert rec["from_relu"]["action"] == "would_rewrite"
    assert rec["from_relu"]["producer"] == "Relu"
    assert rec["from_dropout"]["producer"] == "Dropout"
    assert rec["through_cast"]["action"] == "would_rewrite"
    assert "dtype" in rec["int"]["reason"]
    assert rewrite.dry_run(g, producers="any")[0]["action"] == "would_rewrite"
    assert rw.counters() == {} and not rw.is_enabled()  # nothing changed
    with pytest.raises(TypeError):
        rewrite.dry_run("not a graph")
