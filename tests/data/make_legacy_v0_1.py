"""Wrote legacy_v0_1.keras and legacy_v0_1_expected.npz with the v0.1
(pre-reorganisation) package layout; kept for reference. Run from an empty
directory with that version installed."""
import keras
import numpy as np

import tf_sparse_split as tfss
print(tfss.__file__)
keras.utils.set_random_seed(3)
inp = keras.Input((8, 8, 2))
x = tfss.SparseSplitConv2D(4, 3, padding="same", activation="relu", threshold=0.3, name="conv")(inp)
x = tfss.SensitivityAwareDropout(0.25, seed=2, name="sad")(x)
x = keras.layers.Flatten()(x)
x = tfss.SparseSplitDense(16, activation="relu", threshold=0.6, name="dense_1")(x)
x = tfss.ApproximateRandomDropout(0.5, pattern="row", seed=1, name="ard")(x)
out = tfss.SparseSplitDense(3, threshold=-1.0, skip_dead_input_grad=True, name="dense_2")(x)
model = keras.Model(inp, out, name="legacy_v0_1")
rng = np.random.default_rng(0)
xin = np.maximum(rng.standard_normal((5, 8, 8, 2)), 0).astype("float32")
model.compile(optimizer="adam", loss="mse", jit_compile=False)
model.fit(xin, rng.standard_normal((5, 3)).astype("float32"), epochs=1, verbose=0)
pred = model.predict(xin, verbose=0)
model.save("legacy_v0_1.keras")
np.savez("legacy_v0_1_expected.npz", x=xin, y=pred)
print(pred)
m2 = keras.saving.load_model("legacy_v0_1.keras")
np.testing.assert_array_equal(m2.predict(xin, verbose=0), pred)
