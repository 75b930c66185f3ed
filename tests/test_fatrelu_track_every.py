"""FATReLU's ``track_every`` (the cutoff moves on every k-th training call
only, with the momentum raised to the k-th power) and the
SparsityTargetCallback wiring that sets it."""

import numpy as np
import pytest
import tensorflow as tf
import keras

import tf_sparse_split as tfss

pytestmark = pytest.mark.usefixtures("op_library")


def _scaled_batches(rng, n):
    """n batches of N(0, s^2) with s = 1, 2, ...: each batch's 0.9-quantile
    differs, so every update of the cutoff is visible."""
    return [tf.constant((s + 1.0) * rng.standard_normal((128, 64)),
                        tf.float32) for s in range(n)]


@pytest.mark.parametrize("compiled", [False, True])
def test_cutoff_moves_on_every_kth_training_call(rng, compiled):
    layer = tfss.FATReLU(target=0.9, momentum=0.0, track_every=3)
    call = (tf.function(lambda v: layer(v, training=True)) if compiled
            else (lambda v: layer(v, training=True)))
    cutoffs = []
    for x in _scaled_batches(rng, 7):
        call(x)
        cutoffs.append(layer.cutoff)
    # Calls 1, 4, 7 update (momentum 0: the cutoff is that batch's
    # estimate, ~1.28 s); calls 2-3 and 5-6 leave it.
    assert cutoffs[0] > 0.9
    assert cutoffs[1] == cutoffs[0] and cutoffs[2] == cutoffs[0]
    assert cutoffs[3] > 3.0 * 1.28 * 0.8
    assert cutoffs[4] == cutoffs[3] and cutoffs[5] == cutoffs[3]
    assert cutoffs[6] > 6.0 * 1.28 * 0.8
    # Inference calls neither count nor update.
    layer(_scaled_batches(rng, 1)[0] * 100.0, training=False)
    assert layer.cutoff == cutoffs[6]


def test_momentum_is_raised_to_the_interval(rng):
    """One update of a k-interval layer moves the cutoff as k updates of a
    per-call layer toward the same estimate: momentum**k."""
    x = tf.constant(rng.standard_normal((256, 64)), tf.float32)
    every = tfss.FATReLU(cutoff=2.0, target=0.9, momentum=0.5, track_every=4,
                         sample_size=16384)
    every(x, training=True)
    # T1 = 0.5^4 * 2 + (1 - 0.5^4) * q, q ~ 1.28 (the 0.9-quantile of
    # N(0, 1) estimated on 16384 samples).
    q = (every.cutoff - 0.0625 * 2.0) / 0.9375
    assert 1.15 < q < 1.4
    # With track_every 1 the same momentum moves it by half only.
    each = tfss.FATReLU(cutoff=2.0, target=0.9, momentum=0.5,
                        sample_size=16384)
    each(x, training=True)
    assert each.cutoff > every.cutoff + 0.2


def test_track_every_config_weights_and_checks():
    layer = tfss.FATReLU(target=0.5, track_every=5, name="fat")
    cfg = layer.get_config()
    assert cfg["track_every"] == 5
    assert tfss.FATReLU.from_config(cfg).track_every == 5
    # The call counter is no Keras weight: the weight list is unchanged.
    assert len(layer.weights) == 3
    old = dict(cfg)
    del old["track_every"]          # configurations saved before it
    assert tfss.FATReLU.from_config(old).track_every == 1
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(ValueError, match="track_every"):
            tfss.FATReLU(track_every=bad)
    with pytest.raises(ValueError, match="track_every"):
        tfss.SparsityTargetCallback(0.9, track_every=0)


def test_callback_sets_track_every_and_assigns_controls_on_change(rng):
    keras.utils.set_random_seed(3)
    model = keras.Sequential([
        keras.Input((32,)),
        keras.layers.Dense(64, activation="relu"),
        tfss.SparseSplitDense(64, activation="relu", name="h"),
        tfss.SparseSplitDense(4, name="out")])
    model.compile("adam", "sparse_categorical_crossentropy")
    x = rng.standard_normal((256, 32)).astype("float32")
    y = rng.integers(0, 4, 256)
    cb = tfss.SparsityTargetCallback(0.8, warmup_epochs=0.0, ramp_epochs=1.0,
                                     track_every=2, update_every=4)
    fats = []

    class Count(keras.callbacks.Callback):
        """Counts the assigns of the controls after the ramp."""

        def on_train_begin(self, logs=None):
            fats[:] = [c["fatrelu"] for c in cb.controls]
            self.assigns = 0
            for fat in fats:
                for var in (fat.l1_var, fat.target_var):
                    orig = var.assign

                    def counted(value, *a, _orig=orig, **k):
                        self.assigns += 1
                        return _orig(value, *a, **k)
                    var.assign = counted

    count = Count()
    model.fit(x, y, batch_size=32, epochs=3, callbacks=[cb, count],
              verbose=0)
    assert fats and all(f.track_every == 2 for f in fats)
    assert all(f.momentum == cb.momentum for f in fats)
    # 24 steps, 2 controls with 2 variables each: during the 8-step ramp
    # every step changes the values; after it only the feedback updates
    # (every 4 steps) may (assigning every step would be 4 * 24).
    assert len(fats) == 2
    assert 0 < count.assigns <= 4 * (8 + 24 // 4)
    h = cb.history[-1]["h"]
    assert 0.0 <= h["sparsity"] <= 1.0
