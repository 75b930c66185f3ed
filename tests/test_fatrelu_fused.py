"""FATReLU's training call: output, L1 penalty and the fused gradient equal
TensorFlow's autodiff of where(x > T, x, 0) and l1 * mean(|y|)."""

import numpy as np
import pytest
import tensorflow as tf

from tf_sparse_split.layers import activations as A


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


def test_layer_training_call_adds_penalty_and_clamps_threshold():
    layer = A.FATReLU(threshold=0.5, l1=2.0)
    x = tf.constant([[-1.0, 0.2, 0.7, 2.0]])
    y = layer(x, training=True)
    np.testing.assert_array_equal(y.numpy(), np.float32([[0.0, 0.0, 0.7, 2.0]]))
    assert float(layer.losses[-1]) == pytest.approx(2.0 * 2.7 / 4)
    layer.threshold_var.assign(-3.0)  # bypassing set_controls' validation
    relu = np.float32([[0.0, 0.2, 0.7, 2.0]])
    np.testing.assert_array_equal(layer(x, training=True).numpy(), relu)
    np.testing.assert_array_equal(layer(x).numpy(), relu)
