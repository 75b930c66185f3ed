"""What a new user hits: reloading saved models in a fresh
process, Dense/Conv2D weight lists, one-call conversion, damaged libraries,
the cheap import, the source-tree shadowing advice, statistics dicts and
empty convolution outputs."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sparse_split as tfss
from tf_sparse_split import convert

REPO = Path(__file__).resolve().parents[1]
PKG = Path(tfss.__file__).resolve().parent


def _python(code, cwd=None, env=None, timeout=240):
    """Runs ``code`` in a fresh interpreter; returns the CompletedProcess."""
    full_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                          cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


# -- 1. reloading in a fresh process ---------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory, op_library):
    """A .keras file, a model.export() SavedModel and a tf.saved_model.save
    SavedModel that use the ops, and the expected outputs."""
    d = tmp_path_factory.mktemp("saved")
    keras.utils.set_random_seed(3)
    model = keras.Sequential([
        keras.Input((6, 6, 2)),
        tfss.SparseSplitConv2D(3, 3, activation="relu", threshold=0.25),
        keras.layers.Flatten(),
        tfss.SparseSplitDense(5, threshold=0.5)])
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


def test_import_registers_ops_and_layers_for_a_fresh_process(saved):
    r = _python(f"""
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


def test_import_after_tensorflow_registers_too(saved):
    r = _python(f"""
        import tensorflow as tf
        import tf_sparse_split
        mod = tf.saved_model.load({str(saved / "module")!r})
        print(mod(tf.ones([1, 4])).numpy().tolist())
        """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[[1.0, 1.0, 1.0]]" in r.stdout


def test_without_the_import_tensorflow_says_op_not_registered(saved):
    """What the README says to expect without ``import tf_sparse_split``."""
    r = _python(f"""
        import tensorflow as tf
        tf.saved_model.load({str(saved / "module")!r})
        """)
    assert r.returncode != 0
    assert "Op type not registered" in r.stderr
    assert "SparseSplitMatMul" in r.stderr


# -- 2. weights of Dense / Conv2D ------------------------------------------
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


# -- 2b. one-call conversion -----------------------------------------------
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


# -- 3. damaged library -----------------------------------------------------
def _package_copy(tmp_path, damage):
    dst = tmp_path / "site"
    shutil.copytree(PKG, dst / "tf_sparse_split",
                    ignore=shutil.ignore_patterns("__pycache__"))
    lib = next((dst / "tf_sparse_split").glob("_sparse_split_ops*.so"))
    data = lib.read_bytes()
    if damage == "truncated":
        lib.write_bytes(data[: len(data) // 3])
    elif damage == "garbage":
        lib.write_bytes(b"\x00garbage" * 1000)
    elif damage == "wrong_hash":  # same size, one byte flipped in the middle
        i = len(data) // 2
        lib.write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:])
    elif damage == "missing":
        lib.unlink()
    return dst


@pytest.mark.parametrize("damage", ["truncated", "garbage", "wrong_hash",
                                    "missing"])
def test_damaged_library_gives_library_load_error(tmp_path, damage):
    site = _package_copy(tmp_path, damage)
    r = _python("""
        import tf_sparse_split as tfss          # must not fail
        import tensorflow as tf
        assert isinstance(tfss.library_error, tfss.LibraryLoadError)
        try:
            tfss.sparse_split_matmul(tf.ones([2, 2]), tf.ones([2, 2]))
        except tfss.LibraryLoadError as e:
            print("ERROR:", e)
        """, cwd=str(tmp_path), env={"PYTHONPATH": str(site)})
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    assert "ERROR:" in r.stdout
    expect = {"truncated": "damaged", "garbage": "not an ELF",
              "wrong_hash": "SHA-256", "missing": "not built"}[damage]
    assert expect in r.stdout
    assert "pip install --no-build-isolation" in r.stdout


def test_build_info_records_the_library(op_library):
    from tf_sparse_split import _loader

    info = _loader.build_info()
    path = _loader.library_path()
    assert info["LIB_SIZE"] == os.path.getsize(path)
    assert len(info["LIB_SHA256"]) == 64
    _loader.check_library_file(path)


# -- 6/7. cheap import, source-tree shadowing -------------------------------
def test_source_tree_shadowing_gives_the_right_advice(tmp_path):
    clone = tmp_path / "clone"
    shutil.copytree(PKG, clone / "tf_sparse_split", ignore=shutil.ignore_patterns(
        "__pycache__", "*.so", "_build_info.py"))
    (clone / "setup.py").write_text("# the checkout\n")
    installed = tmp_path / "site" / "tf_sparse_split"
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text("")
    r = _python("""
        import tf_sparse_split as tfss
        try:
            tfss.load_library()
        except tfss.LibraryLoadError as e:
            print("ERROR:", e)
        """, cwd=str(clone), env={"PYTHONPATH": str(installed.parent)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "unbuilt source tree" in r.stdout
    assert "another directory" in r.stdout
    assert "--force-reinstall" not in r.stdout


# -- 7. statistics dicts -----------------------------------------------------
def test_as_dict_accepts_latest_stats(op_library):
    layer = tfss.SparseSplitDense(3)
    layer(np.eye(4, dtype=np.float32))
    d = layer.latest_stats()
    assert tfss.tuning.stats.as_dict(d) == d
    assert tfss.tuning.stats.as_dict(layer.latest_stats_vector()) == d
    with pytest.raises(ValueError, match="lacks"):
        tfss.tuning.stats.as_dict({"m": 1.0})


# -- 8. empty convolution output -------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_conv2d_filter_larger_than_input_gives_empty_output(dtype, op_library):
    x = tf.constant(np.ones((2, 2, 1, 3), dtype))
    f = tf.constant(np.ones((3, 1, 3, 3), dtype))
    want = tf.nn.conv2d(tf.cast(x, tf.float64), tf.cast(f, tf.float64), 1,
                        "VALID")
    assert want.shape == (2, 0, 1, 3)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([x, f])
        y = tfss.sparse_split_conv2d(x, f, strides=1, padding="VALID")
        loss = tf.reduce_sum(y)
    assert y.shape == (2, 0, 1, 3) and y.dtype == dtype
    dx, df = tape.gradient(loss, [x, f])
    assert dx.shape == x.shape and not np.any(dx.numpy())
    assert df.shape == f.shape and not np.any(df.numpy())

    # In a graph with unknown spatial sizes the kernel decides (empty
    # output); with known sizes the shape function refuses, as
    # tf.nn.conv2d's does (TensorFlow's own Conv2D shape function).
    graph = tf.function(
        lambda a, b: tfss.sparse_split_conv2d(a, b, strides=1, padding="VALID"),
        input_signature=[tf.TensorSpec([None, None, None, 3], dtype),
                         tf.TensorSpec([3, 1, 3, 3], dtype)])
    assert graph(x, f).shape == (2, 0, 1, 3)
    for op in (tf.nn.conv2d, tfss.sparse_split_conv2d):
        with pytest.raises(ValueError, match="Negative dimension"):
            tf.function(lambda a, b: op(a, b, 1, "VALID"))(x, f)
    # Smaller still: an error, as tf.nn.conv2d gives.
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)):
        tfss.sparse_split_conv2d(x, tf.ones((4, 1, 3, 3), dtype), strides=1,
                                 padding="VALID")
