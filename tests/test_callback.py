"""Tests of tf_sparse_split.callbacks.SplitThresholdCallback (needs the op)."""

import keras
import pytest
from _helpers import sparse_dataset as _data

from tf_sparse_split.callbacks import SplitThresholdCallback, find_split_layers
from tf_sparse_split.tuning.op_model import DENSE, SPARSE
from tf_sparse_split.layers import SparseSplitDense

pytestmark = pytest.mark.usefixtures("op_library")


@pytest.mark.parametrize("kwargs", [
    {"explore_batches": -1}, {"explore_batches": 1.5},
    {"explore_batches": "3"}, {"explore_batches": True},
    {"min_samples": 0}, {"min_samples": None}, {"verbose": 2},
    {"verbose": "yes"},
])
def test_bad_arguments_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        SplitThresholdCallback(**kwargs)


def test_finds_layers_in_nested_models():
    inner = keras.Sequential([keras.Input((8,)),
                              SparseSplitDense(8, name="inner_ssd")],
                             name="inner")
    outer = keras.Sequential([keras.Input((8,)), inner,
                              keras.layers.Dense(8),
                              SparseSplitDense(2, name="outer_ssd")])
    names = [l.name for l in find_split_layers(outer)]
    assert names == ["inner_ssd", "outer_ssd"]


def test_callback_tunes_a_very_sparse_layer():
    # 99% zeros over K=1024, N=512: the sparse path does ~1% of the dense
    # flops, so the fitted model must move the threshold up from 0.0
    # (all nonzero rows dense). The small output layer is also tracked.
    keras.utils.set_random_seed(0)
    x, y = _data(2048, 1024, 0.99, seed=0)
    model = keras.Sequential([
        keras.Input((1024,)),
        SparseSplitDense(512, activation="relu", threshold=0.0,
                         name="wide"),
        SparseSplitDense(4, activation="softmax", name="head"),
    ])
    model.compile("sgd", "sparse_categorical_crossentropy",
                  jit_compile=False)
    cb = SplitThresholdCallback(explore_batches=6, min_samples=2)
    hist = model.fit(x, y, epochs=2, batch_size=256, callbacks=[cb],
                     verbose=0)
    wide = model.get_layer("wide")
    assert cb.layers == [wide, model.get_layer("head")]
    # Both paths were timed during exploration.
    state = cb._states[0]
    assert state.num_samples(DENSE) >= 2
    assert state.num_samples(SPARSE) >= 2
    # The threshold moved: rows of density ~1% now go sparse.
    assert wide.threshold > 0.0
    assert wide.threshold >= 1 / 16
    # Logs reach History.
    for key in ("wide/sparsity", "wide/threshold", "head/sparsity",
                "head/threshold"):
        assert key in hist.history and len(hist.history[key]) == 2
    assert hist.history["wide/sparsity"][0] == pytest.approx(
        float((x == 0).mean()), abs=1e-3)
    assert hist.history["wide/threshold"][-1] == pytest.approx(
        wide.threshold)
    # Per-epoch records.
    assert [r["epoch"] for r in cb.history] == [0, 1]
    rec = cb.history[0]["layers"]["wide"]
    assert rec["calls"] == 8
    assert rec["dense_rate"] > 0 and rec["sparse_rate"] > 0
    assert rec["time_in_op"] > 0


def test_exploration_restores_threshold_and_resume_false_starts_over():
    keras.utils.set_random_seed(1)
    x, y = _data(256, 64, 0.5, seed=1)
    model = keras.Sequential([
        keras.Input((64,)),
        SparseSplitDense(4, activation="softmax", threshold=0.3,
                         name="only"),
    ])
    model.compile("sgd", "sparse_categorical_crossentropy",
                  jit_compile=False)
    layer = model.get_layer("only")
    seen = []

    class Spy(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(layer.latest_stats()["threshold"])

    # Batches 0, 1 explore (1.0 then 0.0); then the own threshold is back.
    cb = SplitThresholdCallback(explore_batches=2, min_samples=1,
                                resume=False)
    model.fit(x, y, epochs=1, batch_size=32, callbacks=[cb, Spy()],
              verbose=0)
    assert seen[:2] == [1.0, 0.0]
    assert seen[2:] == pytest.approx([0.3] * 6)
    assert 0.0 <= layer.threshold <= 1.0
    # With resume=False a second fit starts over: history and samples
    # reset (the default resumes: tests/test_threshold_resume.py).
    seen.clear()
    model.fit(x, y, epochs=1, batch_size=32, callbacks=[cb, Spy()],
              verbose=0)
    assert len(cb.history) == 1
    assert cb.history[0]["layers"]["only"]["calls"] == 8
    assert seen[:2] == [1.0, 0.0]


def test_validation_calls_are_not_counted():
    keras.utils.set_random_seed(2)
    x, y = _data(320, 32, 0.6, seed=2)
    model = keras.Sequential([
        keras.Input((32,)),
        SparseSplitDense(4, activation="softmax", name="only"),
    ])
    model.compile("sgd", "sparse_categorical_crossentropy",
                  jit_compile=False)
    cb = SplitThresholdCallback(explore_batches=0)
    model.fit(x[:256], y[:256], validation_data=(x[256:], y[256:]),
              epochs=2, batch_size=64, callbacks=[cb], verbose=0)
    assert [r["layers"]["only"]["calls"] for r in cb.history] == [4, 4]


def test_warns_when_steps_per_execution_hides_samples():
    x, y = _data(64, 16, 0.5, seed=3)
    model = keras.Sequential([keras.Input((16,)), SparseSplitDense(8, activation="relu"),
                              SparseSplitDense(4)])
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy",
                  steps_per_execution=4, jit_compile=False)
    with pytest.warns(RuntimeWarning, match="steps_per_execution=4"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0,
                  callbacks=[SplitThresholdCallback()])
