"""The contract every sparse-split layer keeps (as tensorflow/addons'
``layer_test``): config round trip, ``.keras`` save/load with identical
predictions, the weights, the threshold and the statistics API. Run for
every :class:`~tf_sparse_split.layers.SparseSplitLayer` subclass; the
layer-specific behaviour is in test_layers.py and test_conv_layer.py."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sparse_split as tfss
from tf_sparse_split.callbacks import find_split_layers
from tf_sparse_split.layers import SparseSplitLayer
from tf_sparse_split.tuning import stats as S


def _dense_input(rng, batch):
    x = rng.standard_normal((batch, 12)).astype(np.float32)
    x[rng.random(x.shape) < 0.7] = 0.0
    return x


def _conv_input(rng, batch):
    x = rng.standard_normal((batch, 6, 6, 3)).astype(np.float32)
    x[rng.random(x.shape) < 0.6] = 0.0
    return x


# name -> (layer factory(threshold, **kw), input maker(rng, batch),
#          [kernel, bias] shapes, keras class replaced, rows per example)
CASES = {
    "SparseSplitDense": (
        lambda threshold=-1.0, **kw: tfss.SparseSplitDense(
            5, activation="relu", threshold=threshold, **kw),
        _dense_input, [(12, 5), (5,)], keras.layers.Dense),
    "SparseSplitConv2D": (
        lambda threshold=-1.0, **kw: tfss.SparseSplitConv2D(
            4, 3, padding="same", activation="relu", threshold=threshold,
            **kw),
        _conv_input, [(3, 3, 3, 4), (4,)], keras.layers.Conv2D),
}


@pytest.fixture(params=sorted(CASES))
def case(request, op_library):
    return CASES[request.param]


def _built(case, threshold=-1.0, **kw):
    make, make_input, _, _ = case
    layer = make(threshold, **kw)
    x = make_input(np.random.default_rng(0), 4)
    layer.build((None,) + x.shape[1:])
    return layer, x


def test_every_sparse_split_layer_is_covered():
    """A new SparseSplitLayer subclass exported at the top level must be
    added to CASES."""
    exported = {name for name in tfss.__all__
                if isinstance(getattr(tfss, name), type)
                and issubclass(getattr(tfss, name), SparseSplitLayer)
                and getattr(tfss, name) is not SparseSplitLayer}
    assert exported == set(CASES)


def test_is_a_sparse_split_layer_and_found_by_the_callback(case):
    layer, x = _built(case)
    assert isinstance(layer, SparseSplitLayer)
    assert isinstance(layer, case[3])  # drop-in for the Keras layer
    model = keras.Sequential([keras.Input(x.shape[1:]), layer])
    assert find_split_layers(model) == [layer]


def test_weights_and_threshold_variable(case):
    make, _, shapes, _ = case
    layer = make(0.25)
    assert layer.threshold == 0.25  # before build
    layer.set_threshold(0.375)
    assert layer.threshold == 0.375
    layer, _ = _built(case, 0.25)
    weights = layer.get_weights()
    # The Keras layer's list: the threshold is not a Keras weight.
    assert [w.shape for w in weights] == shapes
    assert float(layer.threshold_var.numpy()) == 0.25
    assert layer.threshold_var.trainable is False
    assert len(layer.trainable_weights) == 2
    assert layer.non_trainable_weights == []
    layer.set_threshold(0.75)
    assert layer.threshold == 0.75
    assert float(layer.threshold_var.numpy()) == 0.75
    layer.set_threshold("auto")
    assert layer.threshold == -1.0
    assert layer.supports_jit is False


@pytest.mark.parametrize("bad", [1.5, float("nan"), "abc", None, True])
def test_bad_threshold_raises_value_error(case, bad):
    with pytest.raises(ValueError, match="threshold"):
        case[0](bad)
    layer, _ = _built(case, 0.5)
    with pytest.raises(ValueError, match="Received: threshold="):
        layer.set_threshold(bad)
    assert layer.threshold == 0.5


def test_lora_as_in_keras(case):
    """enable_lora freezes the kernel and adds the two low-rank matrices
    (float32, B zero so the output is unchanged); the config carries the
    rank; the weight list grows as the Keras layer's does."""
    layer, x = _built(case)
    before = layer(x).numpy()
    layer.enable_lora(2, lora_alpha=4)
    assert layer.lora_enabled and layer.get_config()["lora_rank"] == 2
    assert layer.get_config()["lora_alpha"] == 4
    assert layer._kernel.trainable is False
    assert len(layer.trainable_weights) == 3  # bias, lora_kernel_a, _b
    assert [w.shape for w in layer.get_weights()][-1] == (
        2, case[2][0][-1])
    np.testing.assert_allclose(layer(x).numpy(), before, rtol=1e-6)


def test_config_round_trip(case):
    layer = case[0](0.375, name="ssl")
    config = layer.get_config()
    assert config["threshold"] == 0.375
    assert "lora_rank" not in config and "lora_alpha" not in config
    clone = type(layer).from_config(config)
    assert clone.threshold == 0.375 and clone.name == "ssl"
    assert clone.get_config() == config
    assert keras.saving.get_registered_object(
        f"tf_sparse_split>{type(layer).__name__}") is type(layer)
    # After a change, the config carries the current value.
    layer, _ = _built(case, 0.375)
    layer.set_threshold(0.5)
    assert layer.get_config()["threshold"] == 0.5


def test_keras_save_load_identical_predictions(case, tmp_path):
    make, make_input, _, _ = case
    keras.utils.set_random_seed(0)
    x = make_input(np.random.default_rng(5), 7)
    model = keras.Sequential([keras.Input(x.shape[1:]), make(0.25, name="l1"),
                              keras.layers.Flatten(), tfss.SparseSplitDense(3)])
    model.get_layer("l1").set_threshold(0.625)
    before = model.predict(x, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    layer = loaded.get_layer("l1")
    assert type(layer) is type(model.get_layer("l1"))
    assert layer.threshold == 0.625
    assert layer.get_config() == model.get_layer("l1").get_config()
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), before)
    for a, b in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_statistics_api(case):
    make, make_input, _, _ = case
    layer = make(1.0)
    with pytest.raises(RuntimeError, match="not built"):
        layer.latest_stats()
    with pytest.raises(RuntimeError, match="not built"):
        layer.reset_stats()
    x = make_input(np.random.default_rng(6), 6)
    layer(x)
    s = layer.latest_stats()
    assert s["m"] == 6  # rows = examples (images for a convolution)
    assert s["nnz"] == np.count_nonzero(x)
    assert s["threshold"] == 1.0 and s["rows_dense"] == 0
    assert sum(s["histogram"]) == 6
    assert s["sparsity"] == pytest.approx(1 - np.count_nonzero(x) / x.size)
    assert layer.latest_stats_vector().shape == (S.NUM_STATS,)
    layer.set_threshold(0.0)
    layer(x)
    acc = layer.accumulated_stats()
    assert acc["calls"] == 2 and acc["m"] == 12
    assert acc["nnz"] == 2 * np.count_nonzero(x)
    assert acc["threshold"] == pytest.approx(0.5)  # averaged over calls
    total, calls = layer.accumulated_stats_vector()
    assert calls == 2 and total[S.M] == 12
    layer.reset_stats()
    acc = layer.accumulated_stats()
    assert acc["calls"] == 0 and acc["nnz"] == 0
    assert math.isnan(acc["sparsity"])
    assert layer.latest_stats()["nnz"] == np.count_nonzero(x)  # kept


def test_statistics_update_under_tf_function_and_are_not_weights(case):
    layer, _ = _built(case, 0.5)
    n_weights = len(layer.weights)
    make_input = case[1]

    # Training calls record (inference graphs do not: test_serving_stats.py).
    @tf.function
    def f(x):
        return layer(x, training=True)

    x1 = make_input(np.random.default_rng(7), 4)
    x2 = make_input(np.random.default_rng(8), 4)
    x2[0] = 0.0
    f(x1)
    assert layer.latest_stats()["nnz"] == np.count_nonzero(x1)
    f(x2)  # same trace, new values
    assert layer.latest_stats()["nnz"] == np.count_nonzero(x2)
    assert layer.accumulated_stats()["calls"] == 2
    # The threshold variable is read at run time, not frozen in the trace.
    layer.set_threshold(1.0)
    f(x2)
    assert layer.latest_stats()["rows_dense"] == 0
    assert len(layer.weights) == n_weights == 2  # kernel, bias


def test_record_stats_off_leaves_statistics_alone(case):
    layer, x = _built(case)
    layer.record_stats = False
    layer(x)
    assert layer.accumulated_stats()["calls"] == 0


def test_split_work_coefficients(case):
    layer, x = _built(case)
    layer(x)
    dense, sparse = layer.split_work_coefficients(layer.latest_stats_vector())
    n = layer.latest_stats()["n"]
    assert sparse == pytest.approx(2.0 * n) and 0 < dense <= sparse
