"""SparseSplitConv2D with bias + relu under the automatic threshold, call
after call: the calibration, the one-time dense calls, the re-times, the
held changes of side and the calls that count a sample or nothing (the
sample back-off) all change which path a call takes, never its answer.
Every call is checked against ``relu(conv2d(x, w) + b)`` in float64 (the
inference graph's fused Conv2D + BiasAdd + Relu), on inputs without zeros,
with natural CNN sparsity (60% zeros) and with all-zero images among
others, under ``tf.function`` and eagerly. Nothing is timed.
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_sparse_split as tfss
from tf_sparse_split.tuning import stats as S

SHAPES = [((8, 14, 14, 1), 16), ((4, 7, 7, 16), 32), ((1, 9, 9, 8), 64)]


def _input(rng, shape, kind):
    x = rng.standard_normal(shape)
    if kind == "natural":
        x[rng.random(shape) < 0.6] = 0.0
    elif kind == "zero_images":
        x[rng.random(shape) < 0.6] = 0.0
        x[::2] = 0.0
    return x.astype(np.float32)


def _reference(x, f, b):
    y = tf.nn.conv2d(tf.constant(x, tf.float64), tf.constant(f, tf.float64),
                     1, "SAME") + b.astype(np.float64)
    return tf.nn.relu(y).numpy()


@pytest.mark.parametrize("shape,c_out", SHAPES)
@pytest.mark.parametrize("kind", ["no_zeros", "natural", "zero_images"])
def test_every_automatic_call_equals_the_fused_reference(shape, c_out, kind):
    rng = np.random.default_rng(
        [SHAPES.index((shape, c_out)), ("no_zeros", "natural",
                                        "zero_images").index(kind)])
    c_in = shape[3]
    f = (rng.standard_normal((3, 3, c_in, c_out)) / np.sqrt(9 * c_in)).astype(
        np.float32)
    b = (0.1 * rng.standard_normal(c_out)).astype(np.float32)
    xs = [_input(rng, shape, kind) for _ in range(3)]
    want = [_reference(x, f, b) for x in xs]

    @tf.function
    def plain_call(x):  # no node reads the statistics
        return tfss.sparse_split_conv2d(x, f, 1, "SAME", threshold=-1.0,
                                        full_stats=False, bias=b,
                                        activation="relu")

    @tf.function
    def with_stats(x):
        return tfss.sparse_split_conv2d(x, f, 1, "SAME", threshold=-1.0,
                                        full_stats=False, bias=b,
                                        activation="relu", return_stats=True)

    paths = set()
    for i in range(40):
        j = i % len(xs)
        got = plain_call(tf.constant(xs[j])).numpy()
        np.testing.assert_allclose(got, want[j], rtol=1e-5, atol=1e-5)
        if i % 8 == 0:
            got, st = with_stats(tf.constant(xs[j]))
            np.testing.assert_allclose(got.numpy(), want[j], rtol=1e-5,
                                       atol=1e-5)
            st = st.numpy()
            assert st[S.ROWS_DENSE] + st[S.ROWS_SPARSE] == shape[0]
            paths.add(st[S.ANALYSIS])
    # Eagerly, forced to each path.
    for thr in (0.0, 1.0):
        got = tfss.sparse_split_conv2d(tf.constant(xs[0]), f, 1, "SAME",
                                       threshold=thr, bias=b,
                                       activation="relu")
        np.testing.assert_allclose(got.numpy(), want[0], rtol=1e-5, atol=1e-5)
    assert paths <= {S.ANALYSIS_FULL, S.ANALYSIS_SAMPLED, S.ANALYSIS_SKIPPED}
