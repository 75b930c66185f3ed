"""The SparseSplitConv2D layer's fused path: with a bias and a linear,
relu or relu6 activation the layer's bias and activation run inside the
SparseSplitConv2D op (TF's fused convolution for all-dense calls).
Outputs and gradients equal keras.layers.Conv2D with the same weights;
other activations and the FATReLU path keep their own; .keras round trip."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sparse_split as tfss
from tf_sparse_split import testing as T

pytestmark = pytest.mark.usefixtures("op_library")
OP = "TfSparseSplit>SparseSplitConv2D"

ACTS = [None, "linear", "relu", keras.activations.relu, "relu6"]


def _act_id(a):
    return getattr(a, "__name__", str(a))


def _pair(activation, use_bias=True, seed=0, threshold=-1.0, **kw):
    rng = np.random.default_rng(seed)
    cfg = dict(filters=7, kernel_size=3, padding="same", activation=activation,
               use_bias=use_bias, **kw)
    ours = tfss.SparseSplitConv2D(threshold=threshold, **cfg)
    ref = keras.layers.Conv2D(**dict(
        cfg, activation=None if isinstance(activation, tfss.FATReLU)
        else activation))
    shape = (None, 9, 11, 5)
    ours.build(shape)
    ref.build(shape)
    weights = ours.get_weights()
    if use_bias:  # a bias that makes relu and relu6 clip
        weights[1] = rng.normal(scale=3.0, size=weights[1].shape).astype(np.float32)
        weights[0] = weights[0] * 4.0
        ours.set_weights(weights)
    ref.set_weights(weights[:len(ref.weights)])
    x = T.random_sparse_images((4, 9, 11, 5), 0.5, rng, zero_channels=0.2)
    return ours, ref, x


def _op_nodes(layer, x):
    g = tf.function(lambda a: layer(a)).get_concrete_function(
        tf.TensorSpec(x.shape, tf.float32)).graph
    return [op for op in g.get_operations() if op.type == OP]


@pytest.mark.parametrize("activation", ACTS, ids=_act_id)
@pytest.mark.parametrize("threshold", [0.0, 1.0, -1.0])
def test_fused_layer_matches_keras_conv2d(activation, threshold):
    ours, ref, x = _pair(activation, threshold=threshold)
    y_ref = ref(x).numpy()
    assert T.relative_error(ours(x), y_ref) <= 1e-5
    assert T.relative_error(tf.function(lambda a: ours(a))(x), y_ref) <= 1e-5
    nodes = _op_nodes(ours, x)
    assert len(nodes) == 1 and nodes[0].get_attr("num_bias") == 1
    name = _act_id(activation)
    expected = {"None": b"none", "linear": b"none", "relu": b"relu",
                "relu6": b"relu6"}[name]
    assert nodes[0].get_attr("activation") == expected


@pytest.mark.parametrize("activation", ["relu", "relu6", None])
def test_fused_layer_gradients_match_keras_conv2d(activation):
    ours, ref, x = _pair(activation, seed=3)
    dy = np.random.default_rng(4).normal(size=(4, 9, 11, 7)).astype(np.float32)
    grads = []
    for layer in (ours, ref):
        xt = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(xt)
            y = layer(xt)
        grads.append(tape.gradient(y, [xt] + layer.trainable_weights,
                                   output_gradients=dy))
    assert len(grads[0]) == 3  # input, kernel, bias
    for g, r in zip(*grads):
        assert T.relative_error(g, r) <= 2e-5


@pytest.mark.parametrize("activation, use_bias", [("tanh", True),
                                                  ("relu", False),
                                                  (None, False)])
def test_other_activations_keep_the_separate_path(activation, use_bias):
    ours, ref, x = _pair(activation, use_bias=use_bias, seed=5)
    assert T.relative_error(ours(x), ref(x).numpy()) <= 1e-5
    nodes = _op_nodes(ours, x)
    assert len(nodes) == 1
    assert nodes[0].get_attr("num_bias") == 0
    assert nodes[0].get_attr("activation") == b"none"


def test_fatrelu_layer_keeps_bias_fat_relu():
    ours, _, x = _pair(tfss.FATReLU(cutoff=0.05), seed=6)
    k, b = ours.get_weights()[:2]
    y = ours(x).numpy()
    pre = T.reference_conv2d(x, k, padding="SAME") + b
    np.testing.assert_allclose(y, np.where(pre > 0.05, pre, 0.0), rtol=1e-5,
                               atol=1e-5)
    g = tf.function(lambda a: ours(a)).get_concrete_function(
        tf.TensorSpec(x.shape, tf.float32)).graph
    types = [op.type for op in g.get_operations()]
    assert any("BiasFatRelu" in t for t in types)
    assert [op.get_attr("num_bias") for op in g.get_operations()
            if op.type == OP] == [0]


def test_float64_layer(rng):
    ours = tfss.SparseSplitConv2D(6, 3, activation="relu", dtype="float64")
    ref = keras.layers.Conv2D(6, 3, activation="relu", dtype="float64")
    x = T.random_sparse_images((2, 8, 8, 3), 0.5, rng, np.float64)
    ours.build(x.shape)
    ref.build(x.shape)
    w = ours.get_weights()
    w[1] = rng.normal(size=6)
    ours.set_weights(w)
    ref.set_weights(w)
    y = ours(x)
    assert y.dtype == tf.float64
    assert T.relative_error(y, ref(x).numpy()) <= 1e-12


def test_keras_round_trip_of_fused_model(tmp_path):
    rng = np.random.default_rng(7)
    model = keras.Sequential([
        keras.Input((12, 12, 3)),
        tfss.SparseSplitConv2D(8, 3, activation="relu", name="c1"),
        tfss.SparseSplitConv2D(4, 3, strides=2, activation="relu6", name="c2"),
        keras.layers.Flatten(),
        keras.layers.Dense(3),
    ])
    for layer in model.layers[:2]:
        w = layer.get_weights()
        w[1] = rng.normal(size=w[1].shape).astype(np.float32)
        layer.set_weights(w)
    x = T.random_sparse_images((5, 12, 12, 3), 0.4, rng)
    y = model.predict(x, verbose=0)
    path = tmp_path / "fused.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.get_layer("c1"), tfss.SparseSplitConv2D)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), y, rtol=1e-5,
                               atol=1e-6)
    # The plain Keras model with the same weights gives the same.
    plain = keras.Sequential([
        keras.Input((12, 12, 3)),
        keras.layers.Conv2D(8, 3, activation="relu"),
        keras.layers.Conv2D(4, 3, strides=2, activation="relu6"),
        keras.layers.Flatten(),
        keras.layers.Dense(3),
    ])
    plain.set_weights(model.get_weights())
    np.testing.assert_allclose(plain.predict(x, verbose=0), y, rtol=1e-5,
                               atol=1e-5)
