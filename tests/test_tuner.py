"""ThresholdTuner: host reads bounded (statistics read only on sampled
batches), custom loops, TensorBoard summaries."""

import glob
from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf
from _helpers import sparse_dataset as _data

from tf_sparse_split.callbacks import SplitThresholdCallback
from tf_sparse_split.layers import SparseSplitDense, SparseSplitLayer
from tf_sparse_split.tuning import stats as _stats
from tf_sparse_split.tuning import tuner as tuner_mod
from tf_sparse_split.tuning.op_model import DENSE, SPARSE
from tf_sparse_split.tuning.tuner import (HISTOGRAM_TAG, SCALAR_TAGS,
                                          ThresholdTuner)

pytestmark = pytest.mark.usefixtures("op_library")


def _model(k=64, threshold=0.0):
    return keras.Sequential([
        keras.Input((k,)),
        SparseSplitDense(32, activation="relu", threshold=threshold,
                         name="wide"),
        SparseSplitDense(4, activation="softmax", name="head"),
    ])


class _CountReads:
    """Wraps tuner._to_numpy; records the batch in progress at each read."""

    def __init__(self):
        self.where = []
        self.batch = None
        self.epoch = None

    def __call__(self, tensor):
        self.where.append((self.epoch, self.batch))
        return np.asarray(tensor.numpy(), dtype=np.float64)


def test_callback_reads_statistics_only_on_sampled_batches():
    keras.utils.set_random_seed(0)
    x, y = _data(40 * 16, 64, 0.7, seed=0)      # 40 batches per epoch
    model = _model()
    model.compile("sgd", "sparse_categorical_crossentropy",
                  jit_compile=False)
    counter = _CountReads()

    class Position(keras.callbacks.Callback):   # runs before ours
        def on_epoch_begin(self, epoch, logs=None):
            counter.epoch, counter.batch = epoch, None

        def on_train_batch_begin(self, batch, logs=None):
            counter.batch = batch

        def on_test_begin(self, logs=None):
            counter.batch = "end"

    cb = SplitThresholdCallback(explore_batches=4, samples_per_epoch=3,
                                min_samples=1)

    def forbidden(*a, **k):
        raise AssertionError("per-layer numpy read")

    with mock.patch.object(tuner_mod, "_to_numpy", counter), \
            mock.patch.object(SparseSplitLayer, "latest_stats_vector",
                              forbidden), \
            mock.patch.object(SparseSplitLayer, "accumulated_stats_vector",
                              forbidden):
        model.fit(x[:-64], y[:-64], validation_data=(x[-64:], y[-64:]),
                  epochs=2, batch_size=16, callbacks=[Position(), cb],
                  verbose=0)
    steps = (len(x) - 64) // 16
    per_epoch = {e: [b for ep, b in counter.where if ep == e] for e in (0, 1)}
    # Epoch 0: begin, after each of the 4 exploration batches, 3 samples, end.
    assert len(per_epoch[0]) <= 1 + 4 + 3 + 1
    # Epoch 1: begin, 3 samples, end -- not one read per batch.
    assert len(per_epoch[1]) <= 1 + 3 + 1
    batches_read = [b for b in per_epoch[1] if isinstance(b, int)]
    assert len(batches_read) <= 3 and steps > 30
    # Keras may dispatch batch ends asynchronously: no batch-end hook.
    assert "on_train_batch_end" not in SplitThresholdCallback.__dict__
    # And the tuning still works: both paths fitted, records complete.
    state = cb._states[0]
    assert state.tuned                            # "wide" has a fixed threshold
    assert state.num_samples(DENSE) >= 1
    assert state.num_samples(SPARSE) >= 1
    rec = cb.history[1]["layers"]["wide"]
    assert rec["calls"] == steps                  # validation calls excluded
    assert rec["rows_dense"] + rec["rows_sparse"] == steps * 16
    assert sum(rec["histogram"]) == steps * 16
    assert cb.tuner.host_reads == len(counter.where)


def test_tuner_in_custom_loop_matches_callback_semantics():
    keras.utils.set_random_seed(1)
    x, y = _data(8 * 32, 64, 0.9, seed=1)
    model = _model(threshold=0.25)
    opt = keras.optimizers.SGD(0.01)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                yb, model(xb, training=True)))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    tuner = ThresholdTuner(model, explore_batches=4, samples_per_epoch=2,
                           min_samples=1)
    tuner.begin_training()
    seen = []
    for epoch in range(2):
        tuner.begin_epoch(epoch, steps=8)
        for b in range(8):
            tuner.before_batch(b)
            step(x[b * 32:(b + 1) * 32], y[b * 32:(b + 1) * 32])
            if epoch == 0:
                seen.append(model.get_layer("wide").latest_stats()["threshold"])
        record = tuner.end_epoch()
        assert record["epoch"] == epoch
    # Exploration 1.0/0.0, then the layer's own threshold until epoch end.
    assert seen[:4] == [1.0, 0.0, 1.0, 0.0]
    assert seen[4:] == pytest.approx([0.25] * 4)
    wide = tuner.history[-1]["layers"]["wide"]
    assert wide["dense_rate"] > 0 and wide["sparse_rate"] > 0
    assert wide["calls"] == 8
    assert wide["sparsity"] == pytest.approx(float((x == 0).mean()), abs=0.02)
    assert model.get_layer("wide").threshold == pytest.approx(wide["threshold"])
    assert tuner.num_replicas == 1 and tuner.is_chief


@pytest.mark.parametrize("kwargs", [{"samples_per_epoch": -1},
                                    {"log_dir": 3}])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        SplitThresholdCallback(**kwargs)
    with pytest.raises(ValueError):
        ThresholdTuner(None, **kwargs)


def _event_values(log_dir):
    scalars, hists = {}, {}
    files = glob.glob(f"{log_dir}/**/events.out.tfevents.*", recursive=True)
    assert files, f"no event files in {log_dir}"
    for f in files:
        for event in tf.compat.v1.train.summary_iterator(f):
            for v in event.summary.value:
                arr = tf.make_ndarray(v.tensor)
                if v.metadata.plugin_data.plugin_name == "histograms":
                    hists.setdefault(v.tag, {})[event.step] = arr
                else:
                    scalars.setdefault(v.tag, {})[event.step] = float(arr)
    return scalars, hists


def test_callback_writes_tensorboard_summaries(tmp_path):
    keras.utils.set_random_seed(2)
    x, y = _data(6 * 32, 64, 0.8, seed=2)
    model = _model()
    model.compile("sgd", "sparse_categorical_crossentropy",
                  jit_compile=False)
    cb = SplitThresholdCallback(explore_batches=4, min_samples=1,
                                log_dir=str(tmp_path / "tb"))
    model.fit(x, y, epochs=2, batch_size=32, callbacks=[cb], verbose=0)
    scalars, hists = _event_values(tmp_path / "tb")
    for layer in ("wide", "head"):
        for tag in SCALAR_TAGS:
            assert set(scalars[f"{layer}/{tag}"]) == {0, 1}, tag
        h = hists[f"{layer}/{HISTOGRAM_TAG}"]
        assert set(h) == {0, 1}
        assert h[1].shape == (_stats.DENSITY_BINS, 3)
        assert h[1][0, 0] == 0.0 and h[1][-1, 1] == 1.0
        rec = cb.history[1]["layers"][layer]
        assert h[1][:, 2].sum() == pytest.approx(6 * 32)
        assert scalars[f"{layer}/threshold"][1] == pytest.approx(
            rec["threshold"])
        assert scalars[f"{layer}/rows_dense"][1] + \
            scalars[f"{layer}/rows_sparse"][1] == pytest.approx(6 * 32)
    assert scalars["wide/input_sparsity"][0] == pytest.approx(
        float((x == 0).mean()), abs=0.01)


_MIRRORED_SCRIPT = r"""
import json, numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras
import tf_sparse_split as tfss
from tf_sparse_split.layers import SparseSplitDense
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
rng = np.random.default_rng(0)
x = rng.standard_normal((512, 64)).astype(np.float32)
x[rng.random(x.shape) < 0.8] = 0
y = rng.integers(0, 4, 512)
keras.utils.set_random_seed(0)
with strategy.scope():
    model = keras.Sequential([
        keras.Input((64,)),
        SparseSplitDense(32, activation="relu", threshold=0.0, name="wide"),
        SparseSplitDense(4, activation="softmax", name="head")])
    model.compile("sgd", "sparse_categorical_crossentropy", jit_compile=False)
cb = tfss.SplitThresholdCallback(explore_batches=4, min_samples=1)
model.fit(x, y, epochs=2, batch_size=64, callbacks=[cb], verbose=0)
out = {"replicas": cb.tuner.num_replicas, "history": [
    {k: [v["calls"], v["rows_dense"] + v["rows_sparse"], v["threshold"],
         v["dense_rate"] is not None and v["sparse_rate"] is not None]
     for k, v in r["layers"].items()} for r in cb.history]}
def components(name):
    var = model.get_layer(name).threshold_var
    var = var.value if isinstance(var, keras.Variable) else var
    return [float(c.numpy()) for c in strategy.experimental_local_results(var)]
out["components"] = components("wide")
out["head_components"] = components("head")
out["modes"] = {k: v["mode"] for k, v in cb.history[-1]["layers"].items()}
out["zeros"] = float((x == 0).mean())
out["sparsity"] = cb.history[-1]["layers"]["wide"]["sparsity"]
print("RESULT " + json.dumps(out))
"""


def test_mirrored_strategy_two_replicas_all_reduce(tmp_path):
    # A fresh process: logical devices must be set before TF initialises.
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "mirrored.py"
    script.write_text(_MIRRORED_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True,
                          text=True, timeout=300,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES="",
                                   TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
    res = json.loads(line[len("RESULT "):])
    assert res["replicas"] == 2
    for record in res["history"]:
        for calls, rows, _, fitted in record.values():
            assert calls == 2 * 8          # 8 steps, both replicas counted
            assert rows == 512             # every example of the epoch
            assert fitted
    # Both replicas run with the threshold the tuner chose for the tuned
    # layer; the automatic one stays automatic on both.
    assert res["modes"] == {"wide": "tuned", "head": "auto"}
    assert res["components"] == [res["history"][-1]["wide"][2]] * 2
    assert res["head_components"] == [-1.0, -1.0]
    assert res["sparsity"] == pytest.approx(res["zeros"], abs=0.01)
