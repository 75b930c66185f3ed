"""FATReLU's training call: output, L1 penalty and the fused gradient equal
TensorFlow's autodiff of where(x > T, x, 0) and l1 * mean(|y|)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sparse_split as tfss
from tf_sparse_split.layers import activations as A

pytestmark = pytest.mark.usefixtures("op_library")


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
@pytest.mark.parametrize("threshold, l1", [(0.0, 0.0), (0.3, 2.0), (0.0, 0.5)])
def test_fused_gradient_matches_autodiff(dtype, threshold, l1):
    rng = np.random.default_rng(3)
    x = tf.constant(rng.normal(size=(4, 6, 5, 3)), dtype)
    w = tf.constant(rng.normal(size=(4, 6, 5, 3)), dtype)
    t = tf.constant(threshold, dtype)
    l1t = tf.constant(l1, dtype)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y, pen = A._fat_relu_l1(x, t, l1t)
        loss = tf.reduce_sum(y * w) + 3.0 * pen
    gx = tape.gradient(loss, x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y_ref = tf.where(x > t, x, tf.zeros_like(x))
        pen_ref = l1t * tf.reduce_mean(tf.abs(y_ref))
        loss_ref = tf.reduce_sum(y_ref * w) + 3.0 * pen_ref
    gx_ref = tape.gradient(loss_ref, x)
    tol = 1e-6 if dtype == tf.float32 else 1e-13
    np.testing.assert_array_equal(y.numpy(), y_ref.numpy())
    np.testing.assert_allclose(pen.numpy(), pen_ref.numpy(), rtol=tol)
    np.testing.assert_allclose(gx.numpy(), gx_ref.numpy(), rtol=tol, atol=tol)
    assert np.count_nonzero(y.numpy()) < y.numpy().size  # real zeros


def test_penalty_unused_gives_masked_gradient():
    x = tf.constant([[-1.0, 0.2, 0.7, 2.0]])
    with tf.GradientTape() as tape:
        tape.watch(x)
        y, _ = A._fat_relu_l1(x, tf.constant(0.5), tf.constant(1.0))
        loss = tf.reduce_sum(y)
    np.testing.assert_array_equal(tape.gradient(loss, x).numpy(),
                                  [[0.0, 0.0, 1.0, 1.0]])


def test_layer_training_call_adds_penalty_and_clamps_cutoff():
    layer = A.FATReLU(cutoff=0.5, l1=2.0)
    x = tf.constant([[-1.0, 0.2, 0.7, 2.0]])
    y = layer(x, training=True)
    np.testing.assert_array_equal(y.numpy(), np.float32([[0.0, 0.0, 0.7, 2.0]]))
    assert float(layer.losses[-1]) == pytest.approx(2.0 * 2.7 / 4)
    layer.cutoff_var.assign(-3.0)  # bypassing set_controls' validation
    relu = np.float32([[0.0, 0.2, 0.7, 2.0]])
    np.testing.assert_array_equal(layer(x, training=True).numpy(), relu)
    np.testing.assert_array_equal(layer(x).numpy(), relu)


# --- BiasFatRelu: bias + FATReLU in one pass, and its gradient. ------------

def _reference(x, b, t):
    v = x + b
    return tf.where(v > t, v, tf.zeros_like(v))


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
@pytest.mark.parametrize("shape", [(4, 7, 5, 16), (3, 33), (70000, 3)])
def test_bias_fat_relu_matches_reference(dtype, shape):
    from tf_sparse_split.ops import bias_fat_relu

    rng = np.random.default_rng(sum(shape))
    x = tf.constant(rng.normal(size=shape), dtype)
    b = tf.constant(rng.normal(size=shape[-1:]) * 0.3, dtype)
    w = tf.constant(rng.normal(size=shape), dtype)
    t = tf.constant(0.25, dtype)
    with tf.GradientTape() as tape:
        tape.watch([x, b])
        y, s = bias_fat_relu(x, b, t)
        loss = tf.reduce_sum(y * w) + 0.7 * s
    gx, gb = tape.gradient(loss, [x, b])
    with tf.GradientTape() as tape:
        tape.watch([x, b])
        y_ref = _reference(x, b, t)
        loss_ref = tf.reduce_sum(y_ref * w) + 0.7 * tf.reduce_sum(y_ref)
    gx_ref, gb_ref = tape.gradient(loss_ref, [x, b])
    tol = 1e-5 if dtype == tf.float32 else 1e-12
    np.testing.assert_array_equal(y.numpy(), y_ref.numpy())
    assert 0 < np.count_nonzero(y.numpy()) < y.numpy().size
    np.testing.assert_allclose(s.numpy(), tf.reduce_sum(y_ref).numpy(),
                               rtol=tol)
    np.testing.assert_allclose(gx.numpy(), gx_ref.numpy(), rtol=tol, atol=tol)
    np.testing.assert_allclose(gb.numpy(), gb_ref.numpy(), rtol=tol,
                               atol=tol * shape[0])


def test_bias_fat_relu_deterministic_and_nan():
    from tf_sparse_split.ops import bias_fat_relu

    rng = np.random.default_rng(9)
    x = rng.normal(size=(200, 28, 28, 8)).astype(np.float32)
    x[0, 0, 0, :2] = np.nan
    b = rng.normal(size=8).astype(np.float32)
    y1, s1 = bias_fat_relu(x, b, 0.1)
    y2, s2 = bias_fat_relu(x, b, 0.1)
    assert np.array_equal(y1.numpy(), y2.numpy()) and s1.numpy() == s2.numpy()
    assert (y1.numpy()[0, 0, 0, :2] == 0).all()  # NaN > t is false
    lib = tfss.load_library()
    dy = rng.normal(size=x.shape).astype(np.float32)
    g1 = lib.tf_sparse_split_bias_fat_relu_grad(dy, y1, 0.5)
    g2 = lib.tf_sparse_split_bias_fat_relu_grad(dy, y1, 0.5)
    for a, c in zip(g1, g2):
        assert np.array_equal(a.numpy(), c.numpy())


@pytest.mark.parametrize("call, match", [
    (lambda f: f(np.ones((2, 3), np.float32), np.ones(3, np.float32), -0.1), ">= 0"),
    (lambda f: f(np.ones((2, 3), np.float32), np.ones(3, np.float32), np.nan), ">= 0"),
    (lambda f: f(np.ones((2, 3), np.float32), np.ones(4, np.float32), 0.0), "bias"),
    (lambda f: f(np.ones((2, 3), np.float32), np.ones(3, np.float64), 0.0), "dtype"),
    (lambda f: f(np.ones((2, 3), np.int32), np.ones(3, np.int32), 0.0), "float32"),
])
def test_bias_fat_relu_invalid_arguments(call, match):
    from tf_sparse_split.ops import bias_fat_relu

    with pytest.raises(tf.errors.InvalidArgumentError, match=match):
        call(bias_fat_relu)


def test_bias_fat_relu_grad_invalid_arguments():
    lib = tfss.load_library()
    with pytest.raises(tf.errors.InvalidArgumentError, match="same shape"):
        lib.tf_sparse_split_bias_fat_relu_grad(
            np.ones((2, 3), np.float32), np.ones((3, 2), np.float32), 0.0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="scalar"):
        lib.tf_sparse_split_bias_fat_relu_grad(
            np.ones((2, 3), np.float32), np.ones((2, 3), np.float32),
            np.zeros(2, np.float32))


@pytest.mark.parametrize("training", [True, False])
def test_conv_layer_with_fatrelu_fuses_bias_and_matches_unfused(training):
    """SparseSplitConv2D(activation=FATReLU) runs BiasFatRelu; output, L1
    penalty and gradients equal keras Conv2D followed by the same FATReLU."""
    rng = np.random.default_rng(4)
    x = tf.constant(np.maximum(rng.normal(size=(3, 9, 9, 4)), 0)
                    .astype(np.float32))
    ours = tfss.SparseSplitConv2D(6, 3, padding="same",
                                  activation=A.FATReLU(cutoff=0.2, l1=1.5),
                                  bias_initializer="random_normal")
    ref_act = A.FATReLU(cutoff=0.2, l1=1.5)
    ref = keras.layers.Conv2D(6, 3, padding="same")
    ours.build(x.shape)
    ref.build(x.shape)
    ref.set_weights([ours.kernel.numpy(), ours.bias.numpy()])

    @tf.function
    def run(layer, act):
        with tf.GradientTape() as tape:
            if act is None:
                y = layer(x, training=training)
            else:
                y = act(layer(x), training=training)
            loss = tf.reduce_sum(y * y) + tf.add_n(
                (layer.losses + (act.losses if act else [])) or [0.0])
        return y, loss, tape.gradient(loss, layer.trainable_variables)

    y, loss, grads = run(ours, None)
    y_ref, loss_ref, grads_ref = run(ref, ref_act)
    graph_ops = [op.type for op in run.get_concrete_function(ours, None)
                 .graph.get_operations()]
    assert "TfSparseSplit>BiasFatRelu" in graph_ops
    assert "BiasAdd" not in graph_ops
    assert np.count_nonzero(y.numpy()) < y.numpy().size
    np.testing.assert_allclose(y.numpy(), y_ref.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(loss.numpy(), loss_ref.numpy(), rtol=1e-5)
    for g, r in zip(grads, grads_ref):
        np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=1e-4, atol=1e-4)
