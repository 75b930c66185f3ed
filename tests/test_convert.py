"""Dropping sparse-split layers into Keras models: SparseSplitDense /
SparseSplitConv2D take the weight lists of keras Dense / Conv2D (layer and
model level, exact .keras round trip, checkpointed threshold), and the
one-call conversion tf_sparse_split.sparse_split_model (Sequential,
functional and nested models, compile configuration, layer filter, errors)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sparse_split as tfss
from tf_sparse_split import convert


# -- weights of Dense / Conv2D ------------------------------------------------
def _dense_pair():
    plain = keras.layers.Dense(4, activation="relu")
    plain.build((None, 6))
    ours = tfss.SparseSplitDense(4, activation="relu", threshold=0.3)
    ours.build((None, 6))
    return plain, ours


def test_dense_weights_drop_in(op_library):
    plain, ours = _dense_pair()
    ours.set_weights(plain.get_weights())
    assert len(ours.get_weights()) == len(plain.get_weights()) == 2
    for a, b in zip(ours.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert ours.threshold == pytest.approx(0.3)
    # The 0.1 list (threshold appended) still works and sets the threshold.
    ours.set_weights(plain.get_weights() + [np.float32(0.75)])
    assert ours.threshold == 0.75
    with pytest.raises(ValueError):
        ours.set_weights(plain.get_weights()[:1])


def test_conv_weights_drop_in(op_library):
    plain = keras.layers.Conv2D(3, 2)
    plain.build((None, 5, 5, 2))
    ours = tfss.SparseSplitConv2D(3, 2)
    ours.build((None, 5, 5, 2))
    ours.set_weights(plain.get_weights())
    assert [w.shape for w in ours.get_weights()] == \
        [w.shape for w in plain.get_weights()]


def test_model_level_weights_and_exact_keras_round_trip(tmp_path, op_library):
    keras.utils.set_random_seed(1)

    def build(dense, conv, **kw):
        return keras.Sequential([
            keras.Input((5, 5, 1)), conv(2, 3, activation="relu", **kw),
            keras.layers.Flatten(), dense(3, **kw)])

    plain = build(keras.layers.Dense, keras.layers.Conv2D)
    ours = build(tfss.SparseSplitDense, tfss.SparseSplitConv2D, threshold=0.125)
    ours.set_weights(plain.get_weights())
    x = np.random.default_rng(0).random((3, 5, 5, 1)).astype(np.float32)
    np.testing.assert_allclose(ours.predict(x, verbose=0),
                               plain.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    ours.layers[0].set_threshold(0.625)
    ours.save(tmp_path / "m.keras")
    back = keras.saving.load_model(tmp_path / "m.keras")
    for a, b in zip(back.get_weights(), ours.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert [l.threshold for l in back.layers if hasattr(l, "threshold")] == \
        [0.625, 0.125]
    np.testing.assert_array_equal(back.predict(x, verbose=0),
                                  ours.predict(x, verbose=0))


def test_threshold_is_tracked_for_checkpoints(tmp_path, op_library):
    _, ours = _dense_pair()
    ours.set_threshold(0.4)
    path = tf.train.Checkpoint(layer=ours).write(str(tmp_path / "ckpt"))
    _, other = _dense_pair()
    tf.train.Checkpoint(layer=other).read(path).assert_existing_objects_matched()
    assert other.threshold == pytest.approx(0.4)


# -- one-call conversion -----------------------------------------------------
def _sequential():
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(4, 3, activation="relu", name="c1"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(16, activation="relu", name="d1"),
        keras.layers.Dense(3, name="d2")], name="seq")


def _functional():
    inp = keras.Input((8, 8, 1))
    a = keras.layers.Conv2D(4, 3, activation="relu", name="c1")(inp)
    b = keras.layers.Conv2D(2, 1, name="c2", data_format="channels_last")(a)
    f = keras.layers.Flatten()(keras.layers.Concatenate()([a, b]))
    h = keras.layers.Dense(16, activation="relu", name="d1")(f)
    return keras.Model(inp, [keras.layers.Dense(3, name="d2")(h),
                             keras.layers.Dense(2, name="d3")(h)])


def _nested():
    inner = keras.Sequential([keras.Input((16,)),
                              keras.layers.Dense(8, activation="relu",
                                                 name="inner_d")], name="inner")
    inp = keras.Input((8, 8, 1))
    x = keras.layers.Conv2D(4, 3, activation="relu", name="c1")(inp)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dense(16, activation="relu", name="d1")(x)
    x = inner(x)
    return keras.Model(inp, keras.layers.Dense(3, name="d2")(x))


def _all_layers(model):
    return [l for l in model._flatten_layers(include_self=False, recursive=True)]


@pytest.mark.parametrize("make", [_sequential, _functional, _nested],
                         ids=["sequential", "functional", "nested"])
def test_sparse_split_model_round_trip(make, op_library):
    keras.utils.set_random_seed(2)
    model = make()
    x = np.maximum(np.random.default_rng(1).standard_normal((5, 8, 8, 1)),
                   0).astype(np.float32)
    want = model.predict(x, verbose=0)
    split = tfss.sparse_split_model(model, threshold=0.5)
    kinds = {l.name: type(l) for l in _all_layers(split)}
    for name, layer in ((l.name, l) for l in _all_layers(model)):
        if type(layer) is keras.layers.Dense:
            assert kinds[name] is tfss.SparseSplitDense, name
        if type(layer) is keras.layers.Conv2D:
            assert kinds[name] is tfss.SparseSplitConv2D, name
    assert all(l.threshold == 0.5 for l in _all_layers(split)
               if isinstance(l, tfss.SparseSplitLayer))
    got = split.predict(x, verbose=0)
    for a, b in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    plain = tfss.strip_sparse_split(split)
    assert not any(isinstance(l, tfss.SparseSplitLayer)
                   for l in _all_layers(plain))
    for a, b in zip(tf.nest.flatten(plain.predict(x, verbose=0)),
                    tf.nest.flatten(want)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("make", [_sequential, _functional],
                         ids=["sequential", "functional"])
def test_sparse_split_model_copies_the_compile_configuration(make, op_library):
    """A compiled model's copy is compiled the same way, with a new
    optimizer (same class and hyper-parameters, no state); an uncompiled
    model's copy is uncompiled."""
    model = make()
    assert not tfss.sparse_split_model(model).compiled
    model.compile(optimizer=keras.optimizers.Adam(0.0125), loss="mse",
                  metrics=["mae"])
    for copy in (tfss.sparse_split_model(model),
                 tfss.strip_sparse_split(tfss.sparse_split_model(model))):
        assert copy.compiled
        assert type(copy.optimizer) is keras.optimizers.Adam
        assert copy.optimizer is not model.optimizer
        assert float(copy.optimizer.learning_rate) == pytest.approx(0.0125)
        assert copy.loss == "mse"
        assert int(copy.optimizer.iterations) == 0


def test_sparse_split_model_filter_and_errors(op_library):
    model = _sequential()
    split = tfss.sparse_split_model(model, layer_filter=["d1"])
    assert [type(l).__name__ for l in split.layers if "d" in l.name[:1]] == \
        ["SparseSplitDense", "Dense"]
    assert type(split.get_layer("c1")) is keras.layers.Conv2D
    split = tfss.sparse_split_model(
        model, layer_filter=lambda l: isinstance(l, keras.layers.Conv2D))
    assert type(split.get_layer("c1")) is tfss.SparseSplitConv2D
    assert type(split.get_layer("d1")) is keras.layers.Dense
    with pytest.raises(ValueError, match="threshold"):
        tfss.sparse_split_model(model, threshold=2.0)
    with pytest.raises(ValueError, match="layer_filter"):
        tfss.sparse_split_model(model, layer_filter=3)

    class Sub(keras.Model):
        def __init__(self):
            super().__init__()
            self.d = keras.layers.Dense(2)

        def call(self, x):
            return self.d(x)

    with pytest.raises(ValueError, match="subclassed"):
        tfss.sparse_split_model(Sub())
    assert convert.eligible_reason(keras.layers.Conv2D(2, 1, groups=1)) is None
    assert convert.eligible_reason(keras.layers.Conv2D(4, 1, groups=2)) is None
    assert "data_format" in convert.eligible_reason(
        keras.layers.Conv2D(4, 1, data_format="channels_first"))


def test_relu_layers_become_fatrelu_and_back(op_library):
    """A plain keras.layers.ReLU becomes a FATReLU of the same name at
    cutoff 0 (the same outputs, a cutoff the callbacks can raise); a capped
    ReLU is copied unchanged; strip_sparse_split turns a FATReLU into
    ReLU(threshold=cutoff)."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential([
        keras.Input((16,)), keras.layers.Dense(32, name="d1"),
        keras.layers.ReLU(name="r1"), keras.layers.Dense(8, name="d2"),
        keras.layers.ReLU(max_value=6.0, name="r6"),
        keras.layers.Dense(4, name="d3")])
    x = np.random.default_rng(4).standard_normal((32, 16)).astype(np.float32)
    want = model.predict(x, verbose=0)
    split = tfss.sparse_split_model(model)
    kinds = {l.name: type(l) for l in split.layers}
    assert kinds["r1"] is tfss.layers.FATReLU
    assert kinds["r6"] is keras.layers.ReLU
    assert split.get_layer("r1").cutoff == 0.0
    np.testing.assert_allclose(split.predict(x, verbose=0), want, rtol=1e-5,
                               atol=1e-6)
    # The ReLU is now controllable: found as the producer of d2's input.
    from tf_sparse_split.callbacks._discovery import find_activation_producer
    owner, kind = find_activation_producer(split.get_layer("d2"))
    assert owner is split.get_layer("r1") and kind == "layer"
    # A raised cutoff goes back as Keras' thresholded ReLU.
    h = split.get_layer("r1")
    h.cutoff_var.assign(0.5)
    got = split.predict(x, verbose=0)
    plain = tfss.strip_sparse_split(split)
    r1 = plain.get_layer("r1")
    assert type(r1) is keras.layers.ReLU
    assert r1.get_config()["threshold"] == pytest.approx(0.5)
    np.testing.assert_allclose(plain.predict(x, verbose=0), got, rtol=1e-5,
                               atol=1e-6)


def test_unconvertible_relu_layer_is_named_in_the_error(op_library):
    """A model built with sparse-split layers behind a keras.layers.ReLU:
    the callbacks and fit_latency_budget say which layer and what to use."""
    model = keras.Sequential([
        keras.Input((16,)), keras.layers.Dense(32),
        keras.layers.ReLU(name="plain_relu"), tfss.SparseSplitDense(4)])
    x = np.zeros((4, 16), np.float32)
    with pytest.raises(ValueError, match="keras.layers.ReLU layer "
                                         "'plain_relu'.*FATReLU"):
        tfss.fit_latency_budget(model, 1.0, x)
