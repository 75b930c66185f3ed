"""Functions the library traces once per model: a loop over models, fits or
budgets must not draw TensorFlow's "triggered tf.function retracing"
warning, while a function retraced for new shapes still does."""

import io
import logging

import numpy as np
import pytest


@pytest.fixture
def tf_log():
    import tensorflow as tf

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = tf.get_logger()
    logger.addHandler(handler)
    try:
        yield stream
    finally:
        logger.removeHandler(handler)


def _scaler(w):
    return lambda t: t * w


def test_a_closure_per_model_traces_without_the_warning(tf_log):
    import tensorflow as tf

    from tf_sparse_split.utils.tracing import function_per_instance

    for i in range(7):
        w = tf.Variable(float(i + 1))
        f = function_per_instance(_scaler(w))
        x = np.arange(i + 1, dtype=np.float32)
        np.testing.assert_array_equal(f(tf.constant(x)).numpy(), x * (i + 1))
    assert "retracing" not in tf_log.getvalue()


def test_plain_tf_function_of_the_same_closures_warns(tf_log):
    """What the wrapper is for: the same loop with ``tf.function`` warns (if
    TensorFlow ever stops warning here, the wrapper can go)."""
    import tensorflow as tf

    for i in range(7):
        w = tf.Variable(float(i + 1))
        tf.function(_scaler(w))(tf.ones([i + 1]))
    assert "retracing" in tf_log.getvalue()


def test_one_instance_retraced_for_new_shapes_still_warns(tf_log):
    import tensorflow as tf

    from tf_sparse_split.utils.tracing import function_per_instance

    f = function_per_instance(_scaler(2.0))
    for i in range(7):
        f(tf.ones([i + 1]))
    text = tf_log.getvalue()
    assert "retracing" in text
    assert "_scaler" in text          # names the closure, not the wrapper


def test_keyword_arguments_and_signature():
    import tensorflow as tf

    from tf_sparse_split.utils.tracing import function_per_instance

    f = function_per_instance(lambda a, b: a - b,
                              input_signature=[tf.TensorSpec([None]),
                                               tf.TensorSpec([None])])
    np.testing.assert_array_equal(
        f(b=tf.constant([1.0]), a=tf.constant([3.0])).numpy(), [2.0])
    with pytest.raises(TypeError, match="expected a callable"):
        function_per_instance(3)


def test_sensitivity_probes_of_several_models_do_not_warn(tf_log):
    import keras

    import tf_sparse_split as tfss
    from tf_sparse_split.callbacks._discovery import (
        fatrelu_for, find_activation_producer)
    from tf_sparse_split.callbacks.time_budget import SensitivityProbe

    rng = np.random.default_rng(3)
    x = rng.standard_normal((32, 16)).astype(np.float32)
    y = rng.integers(0, 4, 32)
    for seed in range(6):
        keras.utils.set_random_seed(seed)
        model = keras.Sequential([
            keras.Input((16,)),
            keras.layers.Dense(24, activation="relu", name="h1"),
            tfss.SparseSplitDense(4, activation="softmax", name="out")])
        model.compile("sgd", "sparse_categorical_crossentropy")
        owner, kind = find_activation_producer(model.get_layer("out"))
        fat, _ = fatrelu_for(owner, kind)
        base, sens, zeros = SensitivityProbe(model, [(owner, fat)]).measure(
            x, y)
        assert np.isfinite(base) and 0.0 < zeros[0] < 1.0
    assert "retracing" not in tf_log.getvalue()
