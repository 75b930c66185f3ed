"""SplitThresholdCallback and ThresholdTuner across ``fit`` calls: a later
``fit`` of the same model keeps the cost models and thresholds and explores
no more; another model, a replaced layer, or ``resume=False`` start over."""

import keras
import pytest
import tensorflow as tf
from _helpers import sparse_dataset

from tf_sparse_split.callbacks import SplitThresholdCallback
from tf_sparse_split.layers import SparseSplitDense
from tf_sparse_split.tuning.op_model import DENSE, SPARSE
from tf_sparse_split.tuning.tuner import ThresholdTuner, layer_key


def _data(seed=0):
    return sparse_dataset(256, 32, 0.7, seed)


def _model(k=32, units=16):
    model = keras.Sequential([
        keras.Input((k,)),
        SparseSplitDense(units, activation="relu", threshold=0.3,
                         name="wide"),
        SparseSplitDense(4, activation="softmax", name="head")])
    model.compile("sgd", "sparse_categorical_crossentropy",
                  jit_compile=False)
    return model


class _Thresholds(keras.callbacks.Callback):
    """Records the threshold ``wide`` ran each training batch with."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(self.model.get_layer("wide")
                         .latest_stats()["threshold"])


def _samples(cb):
    # The tuned layers' ("wide": a fixed threshold; "head" is automatic, the
    # op decides it per call and it is not explored).
    return [s.num_samples(p) for s in cb._states if s.tuned
            for p in (DENSE, SPARSE)]


def _fit(model, cb, x, y):
    spy = _Thresholds()
    # 8 batches of 32; the spy runs after the tuner's batch begin.
    model.fit(x, y, epochs=1, batch_size=32, callbacks=[cb, spy], verbose=0)
    return spy.seen


def test_second_fit_of_the_same_model_explores_no_more(op_library):
    keras.utils.set_random_seed(0)
    x, y = _data()
    model = _model()
    cb = SplitThresholdCallback(explore_batches=4, samples_per_epoch=2,
                                min_samples=1, warmup_samples=0)
    seen = _fit(model, cb, x, y)
    assert seen[:4] == [1.0, 0.0, 1.0, 0.0]
    assert not cb.tuner.resumed
    assert cb.history[0]["explore_batches"] == 4
    tuner, first = cb.tuner, _samples(cb)
    assert first and min(first) >= 2  # both paths of "wide" were timed
    tuned = model.get_layer("wide").threshold

    seen = _fit(model, cb, x, y)
    assert cb.tuner is tuner and tuner.resumed
    assert [r["explore_batches"] for r in cb.history] == [4, 0]
    # Every batch ran at the tuned threshold: no 1.0 / 0.0 alternation.
    assert seen == pytest.approx([tuned] * 8)
    # The cost models kept their samples; only sampled batches were added
    # (at most 2 per path and layer).
    after = _samples(cb)
    assert all(f <= a <= f + 2 for f, a in zip(first, after)), (first, after)
    assert cb.history[1]["layers"]["wide"]["calls"] == 8
    assert cb.history[1]["layers"]["wide"]["dense_rate"] is not None

    # A threshold set by hand between fits is the layer's own from then on.
    model.get_layer("wide").set_threshold(0.125)
    seen = _fit(model, cb, x, y)
    assert tuner.resumed and seen == pytest.approx([0.125] * 8)

    # Another model starts over: a new tuner, exploration, fresh history.
    other = _model()
    seen = _fit(other, cb, x, y)
    assert cb.tuner is not tuner and not cb.tuner.resumed
    assert seen[:4] == [1.0, 0.0, 1.0, 0.0]
    assert [r["explore_batches"] for r in cb.history] == [4]


def test_resume_false_starts_every_fit_over(op_library):
    keras.utils.set_random_seed(1)
    x, y = _data(seed=1)
    model = _model()
    cb = SplitThresholdCallback(explore_batches=2, min_samples=1,
                                resume=False)
    _fit(model, cb, x, y)
    seen = _fit(model, cb, x, y)
    assert seen[:2] == [1.0, 0.0] and not cb.tuner.resumed
    assert len(cb.history) == 1 and cb.history[0]["explore_batches"] == 2
    with pytest.raises(ValueError, match="resume"):
        SplitThresholdCallback(resume="yes")


def test_a_replaced_layer_with_other_shapes_starts_over(op_library):
    """A Keras model cannot swap a built layer, but a tuner may track a
    list of layers that a custom loop changes."""
    keras.utils.set_random_seed(2)
    x, _ = _data(seed=2)
    # A fixed threshold: the tuner tunes (and explores) it; an automatic
    # layer would stay with the op's per-call decision.
    wide = SparseSplitDense(16, activation="relu", threshold=0.0, name="wide")
    wide.build((None, 32))
    layers = [wide]
    tuner = ThresholdTuner(layers, explore_batches=2, samples_per_epoch=0,
                           min_samples=1)

    def epoch(layer):
        tuner.begin_epoch(0, steps=3)
        ran = []
        for b in range(3):
            tuner.before_batch(b)
            layer(tf.constant(x[b * 32:(b + 1) * 32]), training=True)
            ran.append(layer.latest_stats()["threshold"])
        tuner.end_epoch()
        return ran

    tuner.begin_training()
    assert epoch(wide)[:2] == [1.0, 0.0]
    key = layer_key(layers)
    assert [(name, shape) for _, name, shape in key] == [
        ("wide", ((32,), (32, 16)))]
    tuner.begin_training(resume=True)
    assert tuner.resumed
    # Same name, other units: the problem changed, the tuner starts over.
    layers[0] = SparseSplitDense(24, activation="relu", threshold=0.0,
                                 name="wide")
    layers[0].build((None, 32))
    assert layer_key(layers) != key
    tuner.begin_training(resume=True)
    assert not tuner.resumed and tuner.history == []
    assert epoch(layers[0])[:2] == [1.0, 0.0]


def test_tuner_resume_in_a_custom_loop(op_library):
    keras.utils.set_random_seed(3)
    x, _ = _data(seed=3)
    model = _model()
    layer = model.get_layer("wide")
    tuner = ThresholdTuner(model, explore_batches=2, samples_per_epoch=1,
                           min_samples=1)

    def epoch(index):
        tuner.begin_epoch(index, steps=4)
        ran = []
        for b in range(4):
            tuner.before_batch(b)
            model(tf.constant(x[b * 32:(b + 1) * 32]), training=True)
            ran.append(layer.latest_stats()["threshold"])
        tuner.end_epoch()
        return ran

    tuner.begin_training()
    assert epoch(0)[:2] == [1.0, 0.0]
    tuned = layer.threshold
    tuner.begin_training(resume=True)
    assert tuner.resumed and len(tuner.history) == 1
    assert epoch(0) == pytest.approx([tuned] * 4)
    assert tuner.history[-1]["explore_batches"] == 0
    tuner.begin_training()  # resume=False: starts over
    assert not tuner.resumed and tuner.history == []
    assert epoch(0)[:2] == [1.0, 0.0]
