"""``benchmarks/bench_train_step.py``'s lines under the breakdown: the
sentence on the optimizer part (it says the two update graphs and
gradients are the same when they are, names what differs when they are
not, and gives the part's per-round ratio: medians and ranges of given
times, no timing here) and the plans of our backward products."""

from types import SimpleNamespace

import keras
import numpy as np
import pytest
import tensorflow as tf
from _helpers import import_benchmark

import tf_sparse_split as tfss

pytestmark = pytest.mark.usefixtures("op_library")


@pytest.fixture(scope="module")
def bench():
    return import_benchmark("bench_train_step")


class _Variant:
    """What ``_optimizer_control`` reads of a ``bench_train_step.Variant``:
    ``parts["optimizer"] = (apply tf.function, gradients)``."""

    def __init__(self, sparse, optimizer, x, y):
        keras.utils.set_random_seed(0)
        dense = tfss.SparseSplitDense if sparse else keras.layers.Dense
        model = keras.Sequential([keras.Input((12,)),
                                  dense(16, activation="relu"),
                                  dense(3, activation="softmax")])
        variables = model.trainable_variables
        optimizer.build(variables)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                y, model(x, training=True)))
        grads = tuple(tape.gradient(loss, variables))

        @tf.function
        def apply(*g):
            optimizer.apply(list(g), variables)

        self.parts = {"optimizer": (apply, grads)}


def _data(rng):
    x = tf.constant(np.abs(rng.standard_normal((8, 12))).astype(np.float32))
    return x, tf.constant(rng.integers(0, 3, 8))


def test_same_update_is_reported_as_noise(bench, rng,
                                          mixed_bfloat16_policy):
    x, y = _data(rng)
    ref = _Variant(False, keras.optimizers.Adam(1e-3), x, y)
    ours = _Variant(True, keras.optimizers.Adam(1e-3), x, y)
    text = bench._optimizer_control(ref, ours, [2.0, 3.0, 3.0],
                                    [2.0, 2.0, 4.0])
    assert "hold the same ops" in text
    assert "4 float32 Tensor, same shapes" in text
    # per-round ratios 1.0, 1.5, 0.75
    assert "is 1.00 (range 0.75-1.50)" in text
    assert "noise" in text


def test_a_different_update_is_named(bench, rng, mixed_bfloat16_policy):
    x, y = _data(rng)
    ref = _Variant(False, keras.optimizers.Adam(1e-3), x, y)
    ours = _Variant(True, keras.optimizers.Adam(1e-3, clipnorm=1.0), x, y)
    text = bench._optimizer_control(ref, ours, [1.0], [1.0])
    assert "differ (op type: keras, ours)" in text
    assert "noise" not in text


def test_plans_are_recorded_from_the_statistics(bench):
    from tf_sparse_split.tuning import stats

    def vector(rows_dense, rows_sparse):
        v = np.zeros(stats.NUM_STATS)
        v[stats.ROWS_DENSE], v[stats.ROWS_SPARSE] = rows_dense, rows_sparse
        return tf.constant(v)

    holder = SimpleNamespace(plans={})
    outs = iter([(tf.ones([2]), tf.zeros([2]), vector(4, 0)),
                 (tf.ones([2]), tf.zeros([2]), vector(1, 3)),
                 (tf.ones([2]), tf.zeros([2]), vector(0, 4))])
    d_w = bench.Variant._recording(holder, "dW h2", lambda: next(outs))
    for _ in range(3):
        prod, bias_grad = d_w()   # the statistics are not returned
    d_x = bench.Variant._recording(
        holder, "dX h2", lambda: (tf.ones([2]), vector(0, 0)))
    assert d_x().shape == [2]
    assert holder.plans == {"dW h2": ["dense", "split", "sparse"],
                            "dX h2": ["dense"]}
