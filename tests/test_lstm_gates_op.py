"""LstmGates / LstmGatesGrad (tf_sparse_split.ops.lstm_gates): forward and
gradient against TensorFlow's elementwise ops, float32/float64, bfloat16 and
float16 against a float64 reference on the same (rounded) inputs, partial
recurrent gradients, thread-count independence and bad inputs."""

import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tf_sparse_split.ops import lstm_gates, lstm_gates_grad

pytestmark = pytest.mark.usefixtures("op_library")

TOL = {tf.float32: dict(rtol=1e-5, atol=1e-5),
       tf.float64: dict(rtol=1e-12, atol=1e-13)}


def _reference(zx, zh, c_prev):
    z = zx + zh
    i, f, o, g = tf.split(z, 4, axis=-1)
    i, f, o, a = tf.sigmoid(i), tf.sigmoid(f), tf.sigmoid(o), tf.tanh(g)
    c = f * c_prev + i * a
    return o * tf.tanh(c), c


def _inputs(rng, prefix, units, dtype):
    mk = lambda *s: tf.constant(2 * rng.standard_normal(prefix + s), dtype)
    return mk(4 * units), mk(4 * units), mk(units)


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
@pytest.mark.parametrize("prefix,units", [((5,), 3), ((2, 3), 8),
                                          ((64,), 37), ((0,), 4), ((3,), 0)])
def test_forward_and_gradient_match_tf_ops(rng, dtype, prefix, units):
    zx, zh, c_prev = _inputs(rng, prefix, units, dtype)
    wh = tf.constant(rng.standard_normal(prefix + (units,)), dtype)
    wc = tf.constant(rng.standard_normal(prefix + (units,)), dtype)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([zx, zh, c_prev])
        h, c, saved = lstm_gates(zx, zh, c_prev)
        h_ref, c_ref = _reference(zx, zh, c_prev)
        loss = tf.reduce_sum(h * wh) + tf.reduce_sum(c * wc)
        loss_ref = tf.reduce_sum(h_ref * wh) + tf.reduce_sum(c_ref * wc)
    assert h.dtype == c.dtype == saved.dtype == dtype
    assert saved.shape == prefix + (6 * units,)
    np.testing.assert_allclose(h.numpy(), h_ref.numpy(), **TOL[dtype])
    np.testing.assert_allclose(c.numpy(), c_ref.numpy(), **TOL[dtype])
    u = units
    # saved = (s_i, s_f, s_o, tanh(z_g), tanh(c), c_prev); h from it exactly
    np.testing.assert_array_equal(saved[..., 5 * u:].numpy(), c_prev.numpy())
    np.testing.assert_array_equal(
        (saved[..., 2 * u:3 * u] * saved[..., 4 * u:5 * u]).numpy(),
        h.numpy())
    for a, b in zip(tape.gradient(loss, [zx, zh, c_prev]),
                    tape.gradient(loss_ref, [zx, zh, c_prev])):
        np.testing.assert_allclose(a.numpy(), b.numpy(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
@pytest.mark.parametrize("k", [0, 3, 7])
def test_grad_with_partial_recurrent_gradient(rng, dtype, k):
    """dh = dh_rec (first k units) + dh_out, against the TF reference."""
    prefix, units = (4, 5), 7
    zx, zh, c_prev = _inputs(rng, prefix, units, dtype)
    dh_rec = tf.constant(rng.standard_normal(prefix + (k,)), dtype)
    dh_out = tf.constant(rng.standard_normal(prefix + (units,)), dtype)
    dc = tf.constant(rng.standard_normal(prefix + (units,)), dtype)
    _, _, saved = lstm_gates(zx, zh, c_prev)
    dz, dc_prev = lstm_gates_grad(saved, dh_rec, dh_out, dc)
    dh = dh_out + tf.pad(dh_rec, [[0, 0], [0, 0], [0, units - k]])
    with tf.GradientTape() as tape:
        tape.watch([zx, c_prev])
        h_ref, c_ref = _reference(zx, zh, c_prev)
    dz_ref, dc_ref = tape.gradient([h_ref, c_ref], [zx, c_prev],
                                   output_gradients=[dh, dc])
    np.testing.assert_allclose(dz.numpy(), dz_ref.numpy(), **TOL[dtype])
    np.testing.assert_allclose(dc_prev.numpy(), dc_ref.numpy(), **TOL[dtype])


def test_bits_independent_of_thread_count(rng):
    """Large enough to be split over the pool; same bits with one intra-op
    thread and inside a tf.function."""
    zx, zh, c_prev = _inputs(rng, (512,), 256, tf.float32)
    dh = tf.constant(rng.standard_normal((512, 256)), tf.float32)
    _, _, saved = lstm_gates(zx, zh, c_prev)
    first = [t.numpy() for t in lstm_gates(zx, zh, c_prev)
             + lstm_gates_grad(saved, dh[:, :100], dh, dh)]

    @tf.function
    def both():
        return (lstm_gates(zx, zh, c_prev)
                + lstm_gates_grad(saved, dh[:, :100], dh, dh))

    # The intra-op thread count is fixed once TF has started: run the
    # one-thread case in a subprocess.
    code = (
        "import pickle, sys, tensorflow as tf\n"
        "tf.config.threading.set_intra_op_parallelism_threads(1)\n"
        "from tf_sparse_split.ops import lstm_gates, lstm_gates_grad\n"
        "zx, zh, c_prev, dh = pickle.load(sys.stdin.buffer)\n"
        "_, _, saved = lstm_gates(zx, zh, c_prev)\n"
        "out = [t.numpy() for t in lstm_gates(zx, zh, c_prev)\n"
        "       + lstm_gates_grad(saved, dh[:, :100], dh, dh)]\n"
        "pickle.dump(out, sys.stdout.buffer)\n")
    data = pickle.dumps([t.numpy() for t in (zx, zh, c_prev, dh)])
    res = subprocess.run([sys.executable, "-c", code], input=data,
                         capture_output=True, check=True,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    single = pickle.loads(res.stdout)
    for a, b, c in zip(first, single, both()):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c.numpy())


@pytest.mark.parametrize("args,match", [
    (((2, 8), (2, 8), (2, 3)), "c_prev must have shape"),
    (((2, 8), (2, 4), (2, 2)), "zh"),
    (((2, 6), (2, 6), (2, 1)), "multiple of 4"),
    (((), (), ()), "rank >= 1"),
    (((3, 8), (3, 8), (2, 2)), "c_prev must have shape"),
])
def test_lstm_gates_bad_shapes(args, match):
    ts = [tf.zeros(s) for s in args]
    with pytest.raises(tf.errors.InvalidArgumentError, match=match):
        lstm_gates(*ts)
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError)):
        tf.function(lstm_gates).get_concrete_function(
            *[tf.TensorSpec(s) for s in args])


@pytest.mark.parametrize("args,match", [
    (((2, 12), (2, 3), (2, 2), (2, 2)), "dh_rec"),        # k > units
    (((2, 12), (3, 1), (2, 2), (2, 2)), "dh_rec"),        # other prefix
    (((2, 12), (2, 1), (2, 3), (2, 2)), "dh_out must"),
    (((2, 12), (2, 1), (2, 2), (1, 2)), "dc must"),
    (((2, 10), (2, 1), (2, 2), (2, 2)), "multiple of 6"),
])
def test_lstm_gates_grad_bad_shapes(args, match):
    ts = [tf.zeros(s) for s in args]
    with pytest.raises(tf.errors.InvalidArgumentError, match=match):
        lstm_gates_grad(*ts)
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError)):
        tf.function(lstm_gates_grad).get_concrete_function(
            *[tf.TensorSpec(s) for s in args])


#: Unit roundoff of the 16-bit dtypes (half an ulp, relative).
UNIT_ROUNDOFF = {tf.bfloat16: 2.0 ** -8, tf.float16: 2.0 ** -11}


def _f64(t):
    return tf.cast(t, tf.float64)


def _assert_rounded_once(ours, exact, dtype):
    """``ours`` (dtype) is ``exact`` (float64) rounded once to ``dtype``:
    within half an ulp, plus float32 arithmetic error."""
    assert ours.dtype == dtype
    np.testing.assert_allclose(_f64(ours).numpy(), exact.numpy(),
                               rtol=UNIT_ROUNDOFF[dtype], atol=1e-5)


@pytest.mark.parametrize("dtype", [tf.bfloat16, tf.float16])
@pytest.mark.parametrize("prefix,units", [((5,), 3), ((2, 3), 8),
                                          ((64,), 37), ((300,), 64),
                                          ((0,), 4), ((3,), 0)])
def test_low_precision_computes_in_float32_rounds_once(rng, dtype, prefix,
                                                       units):
    """bfloat16/float16: every output equals the float64 math on the same
    16-bit inputs rounded once to the dtype (half an ulp), forward and
    backward; c_prev is saved exactly."""
    zx, zh, c_prev = _inputs(rng, prefix, units, dtype)
    k = units // 2
    dh_rec = tf.constant(rng.standard_normal(prefix + (k,)), dtype)
    dh_out = tf.constant(rng.standard_normal(prefix + (units,)), dtype)
    dc = tf.constant(rng.standard_normal(prefix + (units,)), dtype)
    h, c, saved = lstm_gates(zx, zh, c_prev)
    assert saved.dtype == dtype and saved.shape == prefix + (6 * units,)
    h_ref, c_ref = _reference(_f64(zx), _f64(zh), _f64(c_prev))
    _assert_rounded_once(h, h_ref, dtype)
    _assert_rounded_once(c, c_ref, dtype)
    u = units
    np.testing.assert_array_equal(saved[..., 5 * u:].numpy(), c_prev.numpy())
    z = _f64(zx) + _f64(zh)
    exact_saved = tf.concat([tf.sigmoid(z[..., :3 * u]),
                             tf.tanh(z[..., 3 * u:]), tf.tanh(c_ref),
                             _f64(c_prev)], -1)
    _assert_rounded_once(saved, exact_saved, dtype)
    # Backward from the 16-bit saved activations, against the float64 math
    # of those same values.
    dz, dc_prev = lstm_gates_grad(saved, dh_rec, dh_out, dc)
    i, f, o, a, tc, cp = tf.split(_f64(saved), 6, axis=-1)
    pad = [[0, 0]] * len(prefix) + [[0, u - k]]
    dh = _f64(dh_out) + tf.pad(_f64(dh_rec), pad)
    dct = _f64(dc) + dh * o * (1 - tc * tc)
    dz_ref = tf.concat([dct * a * i * (1 - i), dct * cp * f * (1 - f),
                        dh * tc * o * (1 - o), dct * i * (1 - a * a)], -1)
    _assert_rounded_once(dz, dz_ref, dtype)
    _assert_rounded_once(dc_prev, dct * f, dtype)


@pytest.mark.parametrize("dtype", [tf.bfloat16, tf.float16])
def test_low_precision_gradient_and_graph(rng, dtype):
    """The registered gradient in bfloat16/float16 matches the float64
    gradient of the TF reference to the dtype's precision, eagerly and in a
    tf.function (same bits), and NaN/Inf propagate."""
    prefix, units = (6, 4), 9
    zx, zh, c_prev = _inputs(rng, prefix, units, dtype)
    wh = tf.constant(rng.standard_normal(prefix + (units,)), dtype)

    def run(zx, zh, c_prev):
        with tf.GradientTape() as tape:
            tape.watch([zx, zh, c_prev])
            h, c, _ = lstm_gates(zx, zh, c_prev)
            loss = tf.reduce_sum(tf.cast(h * wh, tf.float32)) + \
                tf.reduce_sum(tf.cast(c, tf.float32))
        return [h, c] + tape.gradient(loss, [zx, zh, c_prev])

    eager = run(zx, zh, c_prev)
    graph = tf.function(run)(zx, zh, c_prev)
    for a, b in zip(eager, graph):
        assert a.dtype == dtype
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    x64 = [_f64(t) for t in (zx, zh, c_prev)]
    with tf.GradientTape() as tape:
        tape.watch(x64)
        h_ref, c_ref = _reference(*x64)
        loss = tf.reduce_sum(h_ref * _f64(wh)) + tf.reduce_sum(c_ref)
    refs = [h_ref, c_ref] + tape.gradient(loss, x64)
    eps = UNIT_ROUNDOFF[dtype]
    for a, b in zip(eager, refs):
        # a few roundings of the saved activations, relative to the scale
        scale = float(tf.reduce_max(tf.abs(b)))
        np.testing.assert_allclose(_f64(a).numpy(), b.numpy(),
                                   rtol=4 * eps, atol=8 * eps * scale)
    bad = tf.tensor_scatter_nd_update(
        zx, [[0, 0, 0], [1, 0, 3 * units]],
        tf.constant([np.nan, np.inf], dtype))
    h, c, _ = lstm_gates(bad, zh, c_prev)
    assert np.isnan(_f64(h)[0, 0, 0].numpy())       # i gate NaN -> c, h NaN
    assert np.isnan(_f64(c)[0, 0, 0].numpy())
    assert np.isfinite(_f64(h)[1, 0, 0].numpy())    # tanh(inf) = 1: finite


def test_bad_dtypes():
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="float32, float64, bfloat16 or float16"):
        lstm_gates(tf.zeros([2, 4], tf.int32), tf.zeros([2, 4], tf.int32),
                   tf.zeros([2, 1], tf.int32))
    with pytest.raises(tf.errors.InvalidArgumentError, match="one dtype"):
        lstm_gates(tf.zeros([2, 4]), tf.zeros([2, 4], tf.float64),
                   tf.zeros([2, 1]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="one dtype"):
        lstm_gates(tf.zeros([2, 4], tf.bfloat16), tf.zeros([2, 4]),
                   tf.zeros([2, 1], tf.bfloat16))
    with pytest.raises(tf.errors.InvalidArgumentError, match="one dtype"):
        lstm_gates_grad(tf.zeros([2, 6], tf.float16), tf.zeros([2, 1],
                                                                 tf.float16),
                        tf.zeros([2, 1], tf.bfloat16),
                        tf.zeros([2, 1], tf.float16))
    with pytest.raises(tf.errors.InvalidArgumentError, match="one dtype"):
        lstm_gates_grad(tf.zeros([2, 6]), tf.zeros([2, 1]),
                        tf.zeros([2, 1], tf.float64), tf.zeros([2, 1]))
