"""Tests of the SparseSplitConv2D Keras layer, its use by the callback and
cost model, and the CNN main job (tf-sparse-split train --model cnn); the
contract shared by all sparse-split layers is in test_layer_contract.py."""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sparse_split as tfss
from tf_sparse_split.tools import cli, models
from tf_sparse_split.tuning import stats as S
from tf_sparse_split import testing as T
from tf_sparse_split.callbacks import SplitThresholdCallback, find_split_layers
from tf_sparse_split.tuning.cost_model import CostModel

pytestmark = pytest.mark.usefixtures("op_library")


def _pair(layer_kwargs, input_shape, threshold, seed=0):
    """Our layer and keras Conv2D with the same weights, and an input."""
    rng = np.random.default_rng(seed)
    ours = tfss.SparseSplitConv2D(threshold=threshold, **layer_kwargs)
    ref = keras.layers.Conv2D(**layer_kwargs)
    ours.build(input_shape)
    ref.build(input_shape)
    ref.set_weights(ours.get_weights())
    x = T.random_sparse_images((3, *input_shape[1:]), 0.6, rng,
                               zero_channels=0.3)
    return ours, ref, x


CONFIGS = [
    dict(filters=8, kernel_size=3, padding="same", activation="relu"),
    dict(filters=5, kernel_size=(1, 1)),
    dict(filters=4, kernel_size=(3, 5), strides=2, padding="valid",
         use_bias=False),
    dict(filters=6, kernel_size=3, dilation_rate=2, padding="same"),
]


@pytest.mark.parametrize("cfg", range(len(CONFIGS)))
@pytest.mark.parametrize("threshold", [0.0, 1.0, -1.0])
def test_layer_matches_keras_conv2d(cfg, threshold):
    ours, ref, x = _pair(CONFIGS[cfg], (None, 11, 9, 4), threshold, seed=cfg)
    y_ref = ref(x).numpy()
    assert T.relative_error(ours(x), y_ref) <= 1e-5
    fn = tf.function(lambda a: ours(a))
    assert T.relative_error(fn(x), y_ref) <= 1e-5
    st = ours.latest_stats()
    assert st["m"] == 3 and st["k"] == 11 * 9 * 4
    assert st["sparsity"] == pytest.approx(1 - np.count_nonzero(x) / x.size)
    assert ours.supports_jit is False


def test_layer_gradients_match_keras_conv2d():
    ours, ref, x = _pair(CONFIGS[0], (None, 10, 10, 4), -1.0)
    grads = []
    for layer in (ours, ref):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(x) ** 2)
        grads.append(tape.gradient(loss, layer.trainable_weights))
    assert len(grads[0]) == len(grads[1]) == 2
    for a, b in zip(*grads):
        assert T.relative_error(a, b) <= 1e-5


@pytest.mark.parametrize("kwargs, match", [
    (dict(groups=3), "divisible"),  # 4 filters
    (dict(data_format="channels_first"), "channels_last"),
])
def test_layer_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tfss.SparseSplitConv2D(4, 3, **kwargs)


def test_work_coefficients():
    layer = tfss.SparseSplitConv2D(8, 3, strides=2, padding="same")
    layer.build((None, 10, 10, 4))
    v = np.zeros(S.NUM_STATS)
    v[S.N] = 9 * 8
    dense_coef, sparse_coef = layer.split_work_coefficients(v)
    assert sparse_coef == 2 * 9 * 8
    assert dense_coef == pytest.approx(2 * 9 * 8 * (5 * 5) / (10 * 10))
    # Dense work through the cost model: 2 * N_dense * OH*OW*KH*KW*C_live*C_out.
    v[S.ROWS_DENSE], v[S.K], v[S.ZERO_COLS_SKIPPED] = 3, 400, 100  # 3 live ch.
    v[S.NNZ_SPARSE], v[S.TIME_DENSE], v[S.TIME_SPARSE] = 50, 1.0, 1.0
    cm = CostModel()
    cm.add_stats(v, coefficients=(dense_coef, sparse_coef))
    cm.fit()
    assert cm.rate("dense") == pytest.approx(2 * 3 * 25 * 9 * 3 * 8)
    assert cm.rate("sparse") == pytest.approx(2 * 50 * 9 * 8)


def test_callback_tunes_conv_layers():
    keras.utils.set_random_seed(0)
    model = models.build_cnn(8, [4, 8], 10, sparse=True)
    model.compile("adam", "sparse_categorical_crossentropy", jit_compile=False)
    assert [l.name for l in find_split_layers(model)] == [
        "conv_1", "conv_2", "output"]
    rng = np.random.default_rng(0)
    x = np.abs(rng.normal(size=(256, 8, 8, 1))).astype(np.float32)
    x[x < 0.8] = 0
    y = rng.integers(0, 10, size=256)
    cb = SplitThresholdCallback(explore_batches=4, min_samples=1,
                                warmup_samples=0)
    hist = model.fit(x, y, batch_size=32, epochs=2, callbacks=[cb], verbose=0)
    for name in ("conv_1", "conv_2"):
        entry = cb.history[-1]["layers"][name]
        assert entry["calls"] > 0
        assert 0.0 < entry["sparsity"] < 1.0
        assert entry["dense_rate"] is not None and entry["sparse_rate"] is not None
        assert 0.0 <= entry["threshold"] <= 1.0
        assert f"{name}/threshold" in hist.history


def test_cli_cnn_on_digits(capsys):
    rc = cli.main(["train", "--model", "cnn", "--epochs", "1", "--filters",
                   "4,8", "--batch-size", "128", "--split-all-layers",
                   "--timing-rounds", "0"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "model: sparse-split CNN 8x8x1 conv3x3(4)-relu-conv3x3(8)-relu-" \
           "maxpool2-dense(10) (SparseSplitConv2D)" in out
    assert re.search(r"epoch 1/1: time \d+\.\d\d s", out)
    for name in ("conv_1", "conv_2", "output"):
        assert re.search(rf"  {name}: (dense|split|sparse|auto): \d+% zeros",
                         out)
    assert re.search(r"sparse-split: test accuracy \d\.\d{4}", out)


def test_cli_cnn_baseline(capsys):
    rc = cli.main(["train", "--model", "cnn", "--epochs", "1", "--filters",
                   "4,8", "--baseline", "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "(keras.layers.Conv2D)" in out
    assert re.search(r"baseline: test accuracy \d\.\d{4}", out)


def test_cli_cnn_bad_filters(capsys):
    assert cli.main(["train", "--model", "cnn", "--filters", "4,8,16",
                     "--epochs", "1"]) == 1
    assert "two sizes" in capsys.readouterr().err
