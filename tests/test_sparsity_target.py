"""FATReLU and SparsityTargetCallback: semantics, wiring,
serialization, argument checks, and reaching a target on a real problem."""

import numpy as np
import pytest
import tensorflow as tf
import keras

import tf_sparse_split as tfss
from tf_sparse_split.callbacks.sparsity_target import find_activation_producer
from tf_sparse_split.tools import datasets
from tf_sparse_split.tools.models import build_cnn, build_mlp
from tf_sparse_split.tools.train import input_sparsity

pytestmark = pytest.mark.usefixtures("op_library")


# -- FATReLU -----------------------------------------------------------------
def test_fatrelu_forward_and_gradient(rng):
    x = tf.constant(rng.standard_normal((7, 13)).astype("float32"))
    layer = tfss.FATReLU(cutoff=0.3)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x)
        loss = tf.reduce_sum(y * 2.0)
    g = tape.gradient(loss, x)
    xn = x.numpy()
    np.testing.assert_array_equal(y.numpy(), np.where(xn > 0.3, xn, 0.0))
    np.testing.assert_array_equal(g.numpy(), np.where(xn > 0.3, 2.0, 0.0))
    # Cutoff 0 is ReLU.
    np.testing.assert_array_equal(tfss.FATReLU()(x).numpy(),
                                  np.maximum(xn, 0.0))


def test_fatrelu_cutoff_is_a_variable_seen_by_compiled_functions(rng):
    layer = tfss.FATReLU()
    f = tf.function(lambda v: layer(v))
    x = tf.constant(rng.uniform(0, 1, (64, 32)).astype("float32"))
    np.testing.assert_array_equal(f(x).numpy(), x.numpy())
    layer.set_controls(cutoff=0.5)
    np.testing.assert_array_equal(f(x).numpy(),
                                  np.where(x.numpy() > 0.5, x.numpy(), 0))


def test_fatrelu_l1_loss_and_quantile_tracking(rng):
    x = tf.constant(rng.standard_normal((256, 64)).astype("float32"))
    layer = tfss.FATReLU(l1=0.5, target=0.9, momentum=0.0)
    y = layer(x, training=True)
    assert len(layer.losses) == 1
    np.testing.assert_allclose(float(layer.losses[0]),
                               0.5 * np.abs(y.numpy()).mean(), rtol=1e-5)
    # momentum 0: the cutoff is the batch's 0.9-quantile estimate, so a
    # second call on the same data leaves ~90% zeros.
    z = layer(x, training=True).numpy()
    assert 0.88 <= (z == 0).mean() <= 0.92
    assert layer.cutoff > 0.9   # N(0, 1): 0.9-quantile ~ 1.28
    # Inference: no loss, no update.
    before = layer.cutoff
    layer(x * 10.0, training=False)
    assert layer.cutoff == before


def test_fatrelu_serialization_round_trip(tmp_path):
    layer = tfss.FATReLU(cutoff=0.25, l1=0.1, target=0.5, momentum=0.8,
                         sample_size=256, name="fat")
    cfg = layer.get_config()
    clone = tfss.FATReLU.from_config(cfg)
    assert clone.get_config() == cfg
    model = keras.Sequential([
        keras.Input((8,)),
        tfss.SparseSplitDense(16, activation=tfss.FATReLU(cutoff=0.1),
                              name="h"),
        tfss.FATReLU(cutoff=0.05, name="fat2"),
        tfss.SparseSplitDense(3, name="out")])
    model.get_layer("h").activation.set_controls(cutoff=0.2, l1=0.3)
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    act = loaded.get_layer("h").activation
    assert isinstance(act, tfss.FATReLU)
    assert act.cutoff == pytest.approx(0.2) and act.l1 == pytest.approx(0.3)
    assert loaded.get_layer("fat2").cutoff == pytest.approx(0.05)
    x = np.random.default_rng(0).standard_normal((5, 8)).astype("float32")
    np.testing.assert_array_equal(model.predict(x, verbose=0),
                                  loaded.predict(x, verbose=0))


@pytest.mark.parametrize("kwargs", [
    {"cutoff": -0.1}, {"cutoff": float("nan")}, {"l1": -1},
    {"target": 1.0}, {"momentum": 1.0}, {"sample_size": 8},
    {"cutoff": "x"}, {"l1": True},
])
def test_fatrelu_bad_arguments(kwargs):
    with pytest.raises(ValueError, match="Received"):
        tfss.FATReLU(**kwargs)


# -- wiring ------------------------------------------------------------------
def test_producers_are_found_through_zero_preserving_layers():
    cnn = build_cnn(8, [4, 8], 10, sparse=True)
    owner, kind = find_activation_producer(cnn.get_layer("conv_2"))
    assert owner is cnn.get_layer("conv_1") and kind == "relu"
    owner, kind = find_activation_producer(cnn.get_layer("output"))
    assert owner is cnn.get_layer("conv_2") and kind == "relu"  # pool, flatten
    owner, why = find_activation_producer(cnn.get_layer("conv_1"))
    assert owner is None and "model input" in why
    mlp = build_mlp(16, [8, 8], 3, dropout="row", dropout_rate=0.5, seed=0)
    owner, kind = find_activation_producer(mlp.get_layer("hidden_2"))
    assert owner is mlp.get_layer("hidden_1")


def _compile(model):
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"], jit_compile=False)
    return model


def test_callback_rejects_uncontrollable_layers():
    x = np.zeros((16, 8), "float32")
    y = np.zeros((16,), "int32")
    model = _compile(keras.Sequential([
        keras.Input((8,)),
        tfss.SparseSplitDense(8, activation="tanh", name="h"),
        tfss.SparseSplitDense(2, activation="softmax", name="out")]))
    with pytest.raises(ValueError, match="no sparse-split layer"):
        model.fit(x, y, epochs=1, verbose=0,
                  callbacks=[tfss.SparsityTargetCallback(0.5)])
    with pytest.raises(ValueError, match="'out' cannot be controlled.*tanh"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[
            tfss.SparsityTargetCallback(0.5, layers=["out"])])
    with pytest.raises(ValueError, match="not a sparse-split layer"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[
            tfss.SparsityTargetCallback(0.5, layers=["nope"])])


@pytest.mark.parametrize("kwargs", [
    {"target_sparsity": 1.0}, {"target_sparsity": -0.1},
    {"target_sparsity": "a"}, {"target_sparsity": 0.5, "layers": "h"},
    {"target_sparsity": 0.5, "layers": []},
    {"target_sparsity": 0.5, "warmup_epochs": -1},
    {"target_sparsity": 0.5, "ramp_epochs": 0},
    {"target_sparsity": 0.5, "l1": -0.5},
    {"target_sparsity": 0.5, "gain": float("inf")},
    {"target_sparsity": 0.5, "update_every": 0},
    {"target_sparsity": 0.5, "momentum": 1.5},
    {"target_sparsity": 0.5, "verbose": 2},
])
def test_callback_bad_arguments(kwargs):
    with pytest.raises(ValueError, match="Received"):
        tfss.SparsityTargetCallback(**kwargs)


# -- reaching a target on a real problem --------------------------------------
TARGET = 0.9
#: Stated tolerance: test accuracy (359 digits) at most this much below the
#: plain ReLU run's (measured: 0.9777 induced vs 0.9721 plain).
ACC_TOLERANCE = 0.03


def _train_digits(target):
    (x, y), (xt, yt) = datasets.load_digits()
    keras.utils.set_random_seed(0)
    model = _compile(build_mlp(64, [128, 128], 10, sparse=True))
    callbacks = [tfss.SplitThresholdCallback()]
    if target is not None:
        callbacks.insert(0, tfss.SparsityTargetCallback(
            target, warmup_epochs=1, ramp_epochs=4, l1=5.0))
    history = model.fit(x, y, epochs=12, batch_size=64, verbose=0,
                        callbacks=callbacks)
    acc = model.evaluate(xt, yt, verbose=0)[1]
    return model, history, acc, input_sparsity(model, xt)


def test_callback_reaches_target_on_digits(tmp_path):
    plain_model, _, plain_acc, plain_sp = _train_digits(None)
    model, history, acc, sp = _train_digits(TARGET)
    # Natural ReLU sparsity is far below the target...
    assert plain_sp["hidden_2"] < 0.7 and plain_sp["output"] < 0.7
    # ...and the induced one reaches it (inference, test set), on both
    # controlled layers; the first layer's input (pixels) is not controlled.
    for name in ("hidden_2", "output"):
        assert sp[name] >= TARGET - 0.02, (name, sp)
        hist = history.history[f"{name}/sparsity"]
        assert hist[-1] >= TARGET - 0.02, hist
        assert history.history[f"{name}/fat_cutoff"][-1] >= 0.0
        assert (history.history[f"{name}/fat_threshold"]
                == history.history[f"{name}/fat_cutoff"])  # deprecated key
        assert 0.5 - 1e-6 <= history.history[f"{name}/l1"][-1] <= 5.0
        assert f"{name}/threshold" in history.history  # SplitThresholdCallback
    assert sp["hidden_1"] == pytest.approx(plain_sp["hidden_1"])
    assert acc >= plain_acc - ACC_TOLERANCE, (acc, plain_acc)
    # The relu activations were converted in place and save with the model.
    act = model.get_layer("hidden_1").activation
    assert isinstance(act, tfss.FATReLU)
    path = tmp_path / "induced.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.get_layer("hidden_1").activation.cutoff == \
        pytest.approx(act.cutoff)
    (_, _), (xt, _) = datasets.load_digits()
    np.testing.assert_allclose(model.predict(xt, verbose=0),
                               loaded.predict(xt, verbose=0), atol=1e-6)
