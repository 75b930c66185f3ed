"""Statistics recording of the sparse-split layers:
training calls record, inference graphs and exported serving functions do
not write variables, and ``record_stats`` switches it explicitly."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from _helpers import sparse_dataset

import tf_sparse_split as tfss

_WRITE_OPS = ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
              "Assign", "AssignAdd", "AssignSub")


def _model(record_stats="auto"):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((12,)),
        tfss.SparseSplitDense(16, activation="relu", name="d1"),
        tfss.SparseSplitDense(3, name="d2"),
    ])
    for layer in model.layers:
        layer.record_stats = record_stats
    return model


def _data():
    return sparse_dataset(32, 12, 0.6, seed=1, classes=3)


def _write_ops(graph_def):
    """Variable-writing ops in a GraphDef and every function of its library
    (nested calls included)."""
    nodes = list(graph_def.node)
    for fn in graph_def.library.function:
        nodes += list(fn.node_def)
    return [n.op for n in nodes if n.op in _WRITE_OPS]


def _calls(model):
    return [layer.accumulated_stats()["calls"] for layer in model.layers]


@pytest.mark.parametrize("record_stats", ["auto", True])
def test_model_export_serving_function_writes_no_variables(record_stats, tmp_path,
                                                           op_library):
    model = _model(record_stats)
    x, _ = _data()
    want = model.predict(x, verbose=0)
    path = str(tmp_path / "exported")
    model.export(path)  # Keras' serving endpoint "serve"
    loaded = tf.saved_model.load(path)
    fn = loaded.signatures["serving_default"]
    writes = _write_ops(fn.graph.as_graph_def())
    got = list(fn(tf.constant(x)).values())[0].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if record_stats == "auto":
        assert writes == []
    else:  # explicitly enabled: the writes are there (the check can fail)
        assert "AssignVariableOp" in writes and "AssignAddVariableOp" in writes
    serve = loaded.serve.get_concrete_function(tf.TensorSpec([None, 12], tf.float32))
    assert (_write_ops(serve.graph.as_graph_def()) == []) == (record_stats == "auto")


def test_tf_saved_model_save_serving_signature_writes_no_variables(tmp_path,
                                                                   op_library):
    model = _model()
    x, _ = _data()
    model(x)
    path = str(tmp_path / "saved")
    tf.saved_model.save(model, path)
    loaded = tf.saved_model.load(path)
    assert loaded.signatures, "tf.saved_model.save exported no signature"
    for fn in loaded.signatures.values():
        assert _write_ops(fn.graph.as_graph_def()) == []
        fn(tf.constant(x))


def test_training_records_inference_does_not(op_library):
    model = _model()
    x, y = _data()
    model.compile("sgd", "sparse_categorical_crossentropy", jit_compile=False)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert _calls(model) == [4, 4]
    first = model.layers[0].latest_stats()
    assert first["m"] == 8 and first["nnz"] > 0
    model.predict(x, batch_size=8, verbose=0)
    model.evaluate(x, y, batch_size=8, verbose=0)
    assert _calls(model) == [4, 4]
    # Validation batches inside fit are not recorded either.
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, validation_data=(x, y))
    assert _calls(model) == [8, 8]

    # A tf.function: training=True records, unset/False does not.
    @tf.function
    def call(t, training):
        return model(t, training=training)

    call(tf.constant(x), True)
    assert _calls(model) == [9, 9]
    call(tf.constant(x), False)
    call(tf.constant(x), None)
    assert _calls(model) == [9, 9]
    # Eager calls record (no graph is built).
    model(x)
    assert _calls(model) == [10, 10]


def test_record_stats_switch(op_library):
    model = _model(record_stats=True)
    x, y = _data()
    model.predict(x, batch_size=8, verbose=0)
    assert _calls(model) == [4, 4]
    for layer in model.layers:
        layer.record_stats = False
    model.compile("sgd", "sparse_categorical_crossentropy", jit_compile=False)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    model(x)
    assert _calls(model) == [4, 4]
    layer = model.layers[0]
    assert layer.record_stats is False
    for bad in ("yes", 1, None, "training"):
        with pytest.raises(ValueError, match="record_stats"):
            layer.record_stats = bad
    layer.record_stats = np.bool_(True)
    assert layer.record_stats is True


def test_conv_layer_records_only_in_training(op_library):
    # The convolution layer's call has no `training` argument: the value
    # comes from the outer model's call.
    keras.utils.set_random_seed(2)
    model = keras.Sequential([
        keras.Input((6, 6, 2)),
        tfss.SparseSplitConv2D(3, 3, padding="same", activation="relu",
                               name="conv"),
        keras.layers.Flatten(),
        keras.layers.Dense(2),
    ])
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 6, 6, 2)).astype(np.float32)
    y = rng.integers(0, 2, 8)
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), jit_compile=False)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    conv = model.get_layer("conv")
    assert conv.accumulated_stats()["calls"] == 2
    model.predict(x, batch_size=4, verbose=0)
    assert conv.accumulated_stats()["calls"] == 2
