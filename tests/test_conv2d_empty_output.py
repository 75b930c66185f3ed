"""SparseSplitConv2D where the filter is larger than the input: an empty
output (and zero gradients) as tf.nn.conv2d gives, in eager mode and in a
graph with unknown spatial sizes; the shape function refuses known sizes
as TensorFlow's Conv2D shape function does."""

import numpy as np
import pytest
import tensorflow as tf

import tf_sparse_split as tfss


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_conv2d_filter_larger_than_input_gives_empty_output(dtype, op_library):
    x = tf.constant(np.ones((2, 2, 1, 3), dtype))
    f = tf.constant(np.ones((3, 1, 3, 3), dtype))
    want = tf.nn.conv2d(tf.cast(x, tf.float64), tf.cast(f, tf.float64), 1,
                        "VALID")
    assert want.shape == (2, 0, 1, 3)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([x, f])
        y = tfss.sparse_split_conv2d(x, f, strides=1, padding="VALID")
        loss = tf.reduce_sum(y)
    assert y.shape == (2, 0, 1, 3) and y.dtype == dtype
    dx, df = tape.gradient(loss, [x, f])
    assert dx.shape == x.shape and not np.any(dx.numpy())
    assert df.shape == f.shape and not np.any(df.numpy())

    # In a graph with unknown spatial sizes the kernel decides (empty
    # output); with known sizes the shape function refuses, as
    # tf.nn.conv2d's does (TensorFlow's own Conv2D shape function).
    graph = tf.function(
        lambda a, b: tfss.sparse_split_conv2d(a, b, strides=1, padding="VALID"),
        input_signature=[tf.TensorSpec([None, None, None, 3], dtype),
                         tf.TensorSpec([3, 1, 3, 3], dtype)])
    assert graph(x, f).shape == (2, 0, 1, 3)
    for op in (tf.nn.conv2d, tfss.sparse_split_conv2d):
        with pytest.raises(ValueError, match="Negative dimension"):
            tf.function(lambda a, b: op(a, b, 1, "VALID"))(x, f)
    # Smaller still: an error, as tf.nn.conv2d gives.
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)):
        tfss.sparse_split_conv2d(x, tf.ones((4, 1, 3, 3), dtype), strides=1,
                                 padding="VALID")
