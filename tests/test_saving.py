"""Saved models reload: a fresh process that imports tf_sparse_split loads
``.keras`` files and SavedModels that use the ops (the import may come
before or after TensorFlow's); without the import TensorFlow names the
missing op; a ``.keras`` file saved by version 0.1 still loads with
identical predictions."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from _helpers import conv_dense_model, run_python

import tf_sparse_split as tfss


@pytest.fixture(scope="module")
def saved(tmp_path_factory, op_library):
    """A .keras file, a model.export() SavedModel and a tf.saved_model.save
    SavedModel that use the ops, and the expected outputs."""
    d = tmp_path_factory.mktemp("saved")
    keras.utils.set_random_seed(3)
    model = conv_dense_model()
    x = np.maximum(np.random.default_rng(0).standard_normal((4, 6, 6, 2)),
                   0).astype(np.float32)
    np.save(d / "x.npy", x)
    np.save(d / "y.npy", model.predict(x, verbose=0))
    model.save(d / "m.keras")
    model.export(str(d / "exported"), verbose=False)

    class Module(tf.Module):
        def __init__(self):
            super().__init__()
            self.w = tf.Variable(np.eye(4, 3, dtype=np.float32))

        @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32)])
        def __call__(self, a):
            return tfss.sparse_split_matmul(a, self.w, threshold=0.5)

    tf.saved_model.save(Module(), str(d / "module"))
    return d


@pytest.mark.slow
def test_import_registers_ops_and_layers_for_a_fresh_process(saved):
    r = run_python(f"""
        import numpy as np
        import tf_sparse_split
        import sys
        assert "tensorflow" not in sys.modules  # the import itself is cheap
        import keras, tensorflow as tf
        d = {str(saved)!r}
        x, y = np.load(d + "/x.npy"), np.load(d + "/y.npy")
        m = keras.saving.load_model(d + "/m.keras")
        assert [l.threshold for l in m.layers if hasattr(l, "threshold")] \\
            == [0.25, 0.5]
        np.testing.assert_array_equal(m.predict(x, verbose=0), y)
        e = tf.saved_model.load(d + "/exported")
        np.testing.assert_allclose(e.serve(x).numpy(), y, rtol=1e-6, atol=1e-6)
        mod = tf.saved_model.load(d + "/module")
        a = np.arange(8, dtype=np.float32).reshape(2, 4)
        np.testing.assert_allclose(mod(a).numpy(), a @ np.eye(4, 3))
        print("OK")
        """)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


@pytest.mark.slow
def test_import_after_tensorflow_registers_too(saved):
    r = run_python(f"""
        import tensorflow as tf
        import tf_sparse_split
        mod = tf.saved_model.load({str(saved / "module")!r})
        print(mod(tf.ones([1, 4])).numpy().tolist())
        """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[[1.0, 1.0, 1.0]]" in r.stdout


@pytest.mark.slow
def test_without_the_import_tensorflow_says_op_not_registered(saved):
    """What the README says to expect without ``import tf_sparse_split``."""
    r = run_python(f"""
        import tensorflow as tf
        tf.saved_model.load({str(saved / "module")!r})
        """)
    assert r.returncode != 0
    assert "Op type not registered" in r.stderr
    assert "SparseSplitMatMul" in r.stderr


def test_legacy_keras_file_loads_with_identical_predictions(data_dir,
                                                            op_library):
    """tests/data/legacy_v0_1.keras was saved by the pre-reorganisation code
    (tests/data/make_legacy_v0_1.py, run in the old layout) with its
    predictions in legacy_v0_1_expected.npz."""
    model = keras.saving.load_model(data_dir / "legacy_v0_1.keras")
    expected = np.load(data_dir / "legacy_v0_1_expected.npz")
    kinds = {type(layer) for layer in model.layers}
    assert {tfss.SparseSplitDense, tfss.SparseSplitConv2D,
            tfss.ApproximateRandomDropout,
            tfss.SensitivityAwareDropout} <= kinds
    assert model.get_layer("conv").threshold == pytest.approx(0.3)
    assert model.get_layer("dense_1").threshold == pytest.approx(0.6)
    # Saved with the old key skip_dead_input_grad (mapped on load).
    assert model.get_layer("dense_2").masked_input_grad is True
    np.testing.assert_array_equal(model.predict(expected["x"], verbose=0),
                                  expected["y"])
