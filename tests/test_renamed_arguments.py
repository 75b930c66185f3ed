"""Renamed arguments: the input-gradient mask is ``masked_input_grad``
(``SparseSplitDense``, ``sparse_split_matmul``) and the FATReLU's
threshold is its ``cutoff`` (``FATReLU``, ``set_controls``,
``bias_fat_relu``). Each old keyword and attribute still works, warns with a
``DeprecationWarning`` naming the new one, and gives the same results;
configurations saved with the old keys load without a warning, and
``get_config`` writes the new keys only."""

import json
import warnings
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sparse_split as tfss
from tf_sparse_split.ops.fat_relu import bias_fat_relu
from tf_sparse_split.utils.deprecation import rename_config_key


def _relu_input(rng, m, k):
    """A ReLU output [m, k] with real zeros (about half) and dead columns."""
    z = rng.standard_normal((m, k)).astype(np.float32)
    z[:, ::4] = -np.abs(z[:, ::4])
    return np.maximum(z, 0.0)


def _no_rename_warnings(record):
    return [str(w.message) for w in record
            if issubclass(w.category, DeprecationWarning)
            and "is deprecated and will be removed" in str(w.message)]


# -- SparseSplitDense(skip_dead_input_grad) -> masked_input_grad ----------
def _dense_grads(x, **kwargs):
    keras.utils.set_random_seed(11)
    layer = tfss.SparseSplitDense(6, threshold=0.0, **kwargs)
    xv = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xv)
        y = layer(xv, training=True)
        loss = tf.reduce_sum(tf.sin(y))
    return layer, [g.numpy() for g in tape.gradient(
        loss, [xv] + layer.trainable_variables)]


def test_dense_old_keyword_warns_and_behaves_the_same():
    x = _relu_input(np.random.default_rng(1), 12, 16)
    new_layer, new = _dense_grads(x, masked_input_grad=True)
    with pytest.warns(DeprecationWarning, match="`skip_dead_input_grad`.*"
                      "`masked_input_grad`"):
        old_layer, old = _dense_grads(x, skip_dead_input_grad=True)
    assert old_layer.masked_input_grad is True
    for a, b in zip(old, new):
        np.testing.assert_array_equal(a, b)
    # The masked gradient differs from the dense one (it is 0 where x is).
    _, dense = _dense_grads(x)
    assert np.all(new[0][x == 0] == 0) and np.any(dense[0][x == 0] != 0)
    assert old_layer.get_config()["masked_input_grad"] is True
    assert "skip_dead_input_grad" not in old_layer.get_config()


def test_dense_old_attribute_warns_and_aliases_the_new_one():
    layer = tfss.SparseSplitDense(4)
    with pytest.warns(DeprecationWarning, match="masked_input_grad"):
        assert layer.skip_dead_input_grad is False
    with pytest.warns(DeprecationWarning, match="masked_input_grad"):
        layer.skip_dead_input_grad = True
    assert layer.masked_input_grad is True
    assert "skip_dead_input_grad" not in dir(layer)


def test_dense_both_keywords_and_bad_type():
    with pytest.raises(TypeError, match="both"):
        tfss.SparseSplitDense(4, masked_input_grad=True,
                              skip_dead_input_grad=True)
    with pytest.raises(ValueError, match="masked_input_grad"):
        tfss.SparseSplitDense(4, masked_input_grad="yes")


def test_dense_old_config_loads_without_warning():
    config = tfss.SparseSplitDense(4, masked_input_grad=True).get_config()
    old = rename_config_key(config, "masked_input_grad",
                            "skip_dead_input_grad")
    assert "masked_input_grad" not in old and old["skip_dead_input_grad"]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        layer = tfss.SparseSplitDense.from_config(old)
    assert layer.masked_input_grad is True
    assert not _no_rename_warnings(record)


def test_legacy_file_with_old_key_loads_without_warning(data_dir):
    """legacy_v0_1.keras was written with ``skip_dead_input_grad=True``."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model = keras.saving.load_model(data_dir / "legacy_v0_1.keras")
    assert model.get_layer("dense_2").masked_input_grad is True
    assert not _no_rename_warnings(record)


# -- sparse_split_matmul(grad_a_live_only) -> masked_input_grad -----------
def _matmul_grads(a, b, **kwargs):
    av, bv = tf.constant(a), tf.constant(b)
    with tf.GradientTape() as tape:
        tape.watch([av, bv])
        y = tfss.sparse_split_matmul(av, bv, 0.5, **kwargs)
        loss = tf.reduce_sum(tf.sin(y))
    return [y.numpy()] + [g.numpy() for g in tape.gradient(loss, [av, bv])]


def test_matmul_old_keyword_warns_and_behaves_the_same(op_library):
    rng = np.random.default_rng(2)
    a = _relu_input(rng, 20, 24)
    b = rng.standard_normal((24, 9)).astype(np.float32)
    new = _matmul_grads(a, b, masked_input_grad=True)
    with pytest.warns(DeprecationWarning, match="`grad_a_live_only`.*"
                      "`masked_input_grad`"):
        old = _matmul_grads(a, b, grad_a_live_only=True)
    for x, y in zip(old, new):
        np.testing.assert_array_equal(x, y)
    assert np.all(new[1][a == 0] == 0)
    dense = _matmul_grads(a, b)
    assert np.any(dense[1][a == 0] != 0)


def test_matmul_both_keywords(op_library):
    one = np.ones((2, 3), np.float32)
    with pytest.raises(TypeError, match="both"):
        tfss.sparse_split_matmul(one, one.T, masked_input_grad=True,
                                 grad_a_live_only=True)


def test_matmul_op_attr_keeps_its_name(op_library):
    """Saved graphs name the op attr ``grad_a_live_only``; the wrapper's new
    keyword sets it."""

    @tf.function
    def f(a, b):
        return tfss.sparse_split_matmul(a, b, masked_input_grad=True)

    spec = tf.TensorSpec([4, 3], tf.float32)
    graph = f.get_concrete_function(spec, tf.TensorSpec([3, 2])).graph
    ops = [op for op in graph.get_operations()
           if op.type.endswith("SparseSplitMatMul")]
    assert ops and all(op.get_attr("grad_a_live_only") for op in ops)


# -- FATReLU(threshold) -> cutoff -------------------------------------------
def test_fatrelu_old_keyword_warns_and_behaves_the_same():
    x = tf.constant(np.random.default_rng(3).standard_normal((9, 7))
                    .astype(np.float32))
    new = tfss.FATReLU(cutoff=0.3)
    with pytest.warns(DeprecationWarning, match="`threshold`.*`cutoff`"):
        old = tfss.FATReLU(threshold=0.3)
    assert old.cutoff == pytest.approx(0.3)
    np.testing.assert_array_equal(old(x).numpy(), new(x).numpy())
    np.testing.assert_array_equal(
        new(x).numpy(), np.where(x.numpy() > 0.3, x.numpy(), 0.0))
    config = old.get_config()
    assert config["cutoff"] == pytest.approx(0.3) and "threshold" not in config


@pytest.mark.parametrize("bad", [float("nan"), -1.0, "x"])
def test_fatrelu_bad_value_is_named_by_the_keyword_passed(bad):
    with pytest.raises(ValueError, match="`cutoff`"):
        tfss.FATReLU(cutoff=bad)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ValueError, match="`threshold`") as e:
            tfss.FATReLU(threshold=bad)
    assert "`cutoff`" not in str(e.value)


def test_fatrelu_old_attributes_and_set_controls_warn():
    layer = tfss.FATReLU(cutoff=0.2)
    with pytest.warns(DeprecationWarning, match="cutoff"):
        assert layer.threshold == pytest.approx(0.2)
    with pytest.warns(DeprecationWarning, match="cutoff_var"):
        assert layer.threshold_var is layer.cutoff_var
    with pytest.warns(DeprecationWarning, match="`threshold`.*`cutoff`"):
        layer.set_controls(threshold=0.4)
    assert layer.cutoff == pytest.approx(0.4)
    layer.set_controls(cutoff=0.1)
    assert layer.cutoff == pytest.approx(0.1)
    assert "threshold" not in dir(layer)


def test_fatrelu_both_keywords():
    with pytest.raises(TypeError, match="both"):
        tfss.FATReLU(cutoff=0.1, threshold=0.2)
    with pytest.raises(TypeError, match="both"):
        tfss.FATReLU().set_controls(cutoff=0.1, threshold=0.2)


def test_bias_fat_relu_old_keyword_warns_and_behaves_the_same(op_library):
    rng = np.random.default_rng(4)
    x = tf.constant(rng.standard_normal((5, 6)).astype(np.float32))
    b = tf.constant(rng.standard_normal(6).astype(np.float32))
    y_new, s_new = bias_fat_relu(x, b, cutoff=0.25)
    with pytest.warns(DeprecationWarning, match="`threshold`.*`cutoff`"):
        y_old, s_old = bias_fat_relu(x, b, threshold=0.25)
    np.testing.assert_array_equal(y_old.numpy(), y_new.numpy())
    assert float(s_old) == float(s_new)
    with pytest.raises(TypeError, match="cutoff"):
        bias_fat_relu(x, b)


# -- saved models with the old keys ----------------------------------------
def _rewrite_config(path, out, renames):
    """Copies the .keras file ``path`` to ``out`` with config keys renamed
    (new -> old), as a file written before the renames would hold them."""

    def rename(obj):
        if isinstance(obj, dict):
            return {renames.get(k, k): rename(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [rename(v) for v in obj]
        return obj

    with zipfile.ZipFile(path) as src, zipfile.ZipFile(out, "w") as dst:
        for item in src.infolist():
            data = src.read(item.filename)
            if item.filename == "config.json":
                data = json.dumps(rename(json.loads(data))).encode()
            dst.writestr(item, data)


def _configs_of(obj, class_name):
    """The ``config`` dicts of every serialized ``class_name`` in obj."""
    if isinstance(obj, dict):
        if obj.get("class_name") == class_name:
            yield obj["config"]
        for v in obj.values():
            yield from _configs_of(v, class_name)
    elif isinstance(obj, list):
        for v in obj:
            yield from _configs_of(v, class_name)


def test_model_saved_with_old_keys_loads_the_same(tmp_path, op_library):
    keras.utils.set_random_seed(5)
    model = keras.Sequential([
        keras.Input((8,)),
        tfss.SparseSplitDense(16, activation=tfss.FATReLU(cutoff=0.1),
                              name="h"),
        tfss.FATReLU(cutoff=0.05, name="fat"),
        tfss.SparseSplitDense(3, masked_input_grad=True, name="out")])
    path = tmp_path / "new.keras"
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model.save(path)  # saving reads no deprecated alias
    assert not _no_rename_warnings(record)
    with zipfile.ZipFile(path) as z:
        saved = json.loads(z.read("config.json"))
    fat_configs = list(_configs_of(saved, "FATReLU"))
    assert len(fat_configs) == 2
    assert all("cutoff" in c and "threshold" not in c for c in fat_configs)
    dense_configs = list(_configs_of(saved, "SparseSplitDense"))
    assert len(dense_configs) == 2
    assert all("masked_input_grad" in c and "skip_dead_input_grad" not in c
               for c in dense_configs)
    old_path = tmp_path / "old.keras"
    _rewrite_config(path, old_path, {"cutoff": "threshold",
                                     "masked_input_grad":
                                     "skip_dead_input_grad"})
    with zipfile.ZipFile(old_path) as z:
        old = json.loads(z.read("config.json"))
    assert all("threshold" in c and "cutoff" not in c
               for c in _configs_of(old, "FATReLU"))
    assert all("skip_dead_input_grad" in c
               for c in _configs_of(old, "SparseSplitDense"))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        loaded = keras.saving.load_model(old_path)
    assert not _no_rename_warnings(record)
    assert loaded.get_layer("h").activation.cutoff == pytest.approx(0.1)
    assert loaded.get_layer("fat").cutoff == pytest.approx(0.05)
    assert loaded.get_layer("out").masked_input_grad is True
    x = np.random.default_rng(6).standard_normal((5, 8)).astype(np.float32)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0),
                                  model.predict(x, verbose=0))
