"""The sparse-split layers as complete drop-ins for ``keras.layers.Dense`` /
``Conv2D``: LoRA (``enable_lora``, ``lora_rank``), grouped convolution,
``tf.SparseTensor`` inputs, and the model conversion of such layers. Each
case is checked against the Keras layer itself with the same weights:
outputs, gradients (and their types), trainable weights, ``.keras`` files."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from _helpers import sparse_normal as _sparse

import tf_sparse_split as tfss
from tf_sparse_split import testing as T

pytestmark = pytest.mark.usefixtures("op_library")

TOL = 1e-5


def _randomize_lora(layers, rng):
    """Gives the LoRA matrices of every layer in ``layers`` the same random
    values (Keras initialises ``lora_kernel_b`` to zeros, which would hide
    the branch)."""
    a = rng.standard_normal(layers[0].lora_kernel_a.shape).astype(np.float32)
    b = rng.standard_normal(layers[0].lora_kernel_b.shape).astype(np.float32)
    for layer in layers:
        layer.lora_kernel_a.assign(a * 0.3)
        layer.lora_kernel_b.assign(b * 0.3)


def _grads(layer, x):
    """Output and the gradients of ``sum(y^2 / 2 + y)`` w.r.t. the trainable
    weights and the input (a list, input last)."""
    x = tf.convert_to_tensor(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x)
        loss = tf.reduce_sum(0.5 * y * y + y)
    grads = tape.gradient(loss, layer.trainable_weights + [x])
    return y, grads


def _assert_close(a, b, tol=TOL):
    assert T.relative_error(tf.convert_to_tensor(a), tf.convert_to_tensor(b)) \
        <= tol


def _pair(kind, lora=None, **kw):
    """(ours, keras) built with the same weights; LoRA enabled on both when
    ``lora`` = (rank, alpha)."""
    if kind == "dense":
        ours = tfss.SparseSplitDense(7, **kw)
        ref = keras.layers.Dense(7, **{k: v for k, v in kw.items()
                                       if k != "threshold"})
        shape = (None, 13)
    else:
        ours = tfss.SparseSplitConv2D(6, 3, padding="same", **kw)
        ref = keras.layers.Conv2D(6, 3, padding="same",
                                  **{k: v for k, v in kw.items()
                                     if k != "threshold"})
        shape = (None, 7, 7, 4)
    ours.build(shape)
    ref.build(shape)
    ref.set_weights(ours.get_weights())
    if lora is not None:
        rank, alpha = lora
        ours.enable_lora(rank, lora_alpha=alpha)
        ref.enable_lora(rank, lora_alpha=alpha)
        _randomize_lora([ours, ref], np.random.default_rng(3))
    return ours, ref, shape


# -- LoRA -------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["dense", "conv"])
@pytest.mark.parametrize("threshold", [-1.0, 0.0, 1.0])
@pytest.mark.parametrize("sparsity", [0.0, 0.6, 0.95])
def test_lora_matches_keras(kind, threshold, sparsity):
    ours, ref, shape = _pair(kind, lora=(3, 6), activation="relu",
                             threshold=threshold)
    x = _sparse(np.random.default_rng(7), (5,) + shape[1:], sparsity)
    y0, g0 = _grads(ours, x)
    y1, g1 = _grads(ref, x)
    _assert_close(y0, y1)
    assert len(g0) == len(g1) == 4  # bias, lora_kernel_a, lora_kernel_b, x
    for a, b in zip(g0, g1):
        _assert_close(a, b)
    _assert_close(ours.kernel, ref.kernel)  # the merged kernel


@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_lora_trainable_weights_and_config_match_keras(kind):
    ours, ref, _ = _pair(kind, lora=(2, None))
    names = lambda ws: [w.path.split("/")[-1] for w in ws]  # noqa: E731
    assert names(ours.trainable_weights) == names(ref.trainable_weights) == [
        "bias", "lora_kernel_a", "lora_kernel_b"]
    assert names(ours.non_trainable_weights) == names(
        ref.non_trainable_weights) == ["kernel"]
    assert [w.shape for w in ours.weights] == [w.shape for w in ref.weights]
    assert ours.lora_kernel_a.dtype == ref.lora_kernel_a.dtype == "float32"
    assert ours.lora_enabled and ours.lora_rank == 2 and ours.lora_alpha == 2
    config = ours.get_config()
    assert config["lora_rank"] == 2 and config["lora_alpha"] == 2
    # Keras' own errors: twice, before build, with a kernel constraint.
    with pytest.raises(ValueError, match="already enabled"):
        ours.enable_lora(2)
    fresh = type(ours).from_config({**ours.get_config(), "lora_rank": None,
                                    "lora_alpha": None})
    with pytest.raises(ValueError, match="built"):
        fresh.enable_lora(2)
    constrained = (tfss.SparseSplitDense(3, kernel_constraint="non_neg")
                   if kind == "dense" else
                   tfss.SparseSplitConv2D(3, 1, kernel_constraint="non_neg"))
    constrained.build((None, 4) if kind == "dense" else (None, 3, 3, 4))
    with pytest.raises(ValueError, match="constraint"):
        constrained.enable_lora(2)


@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_lora_from_constructor_trains_only_the_low_rank_matrices(kind):
    rng = np.random.default_rng(11)
    if kind == "dense":
        layer = tfss.SparseSplitDense(5, lora_rank=2, lora_alpha=4)
        x = _sparse(rng, (16, 9), 0.7)
        y = rng.standard_normal((16, 5)).astype(np.float32)
    else:
        layer = tfss.SparseSplitConv2D(4, 3, lora_rank=2, lora_alpha=4)
        x = _sparse(rng, (16, 6, 6, 3), 0.7)
        y = rng.standard_normal((16, 4, 4, 4)).astype(np.float32)
    model = keras.Sequential([keras.Input(x.shape[1:]), layer])
    assert layer.lora_enabled and layer.lora_alpha == 4  # alpha kept
    frozen = layer._kernel.numpy().copy()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    model.fit(x, y, epochs=2, batch_size=8, verbose=0)
    np.testing.assert_array_equal(layer._kernel.numpy(), frozen)
    assert np.abs(layer.lora_kernel_b.numpy()).max() > 0  # trained


@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_lora_keras_file_round_trip_matches_keras(kind, tmp_path):
    ours, ref, shape = _pair(kind, lora=(3, 5), activation="relu",
                             name="l")
    x = _sparse(np.random.default_rng(2), (4,) + shape[1:], 0.6)
    results = []
    for i, layer in enumerate((ours, ref)):
        model = keras.Sequential([keras.Input(shape[1:]), layer])
        before = model.predict(x, verbose=0)
        path = tmp_path / f"m{i}.keras"
        model.save(path)
        loaded = keras.models.load_model(path)
        lay = loaded.get_layer("l")
        assert type(lay) is type(layer)
        assert lay.lora_enabled and lay.lora_rank == 3
        np.testing.assert_allclose(loaded.predict(x, verbose=0), before,
                                   rtol=1e-5, atol=1e-6)
        results.append([w.numpy() for w in lay.weights])
    # Same file contents as Keras writes: merged kernel, zeroed LoRA.
    assert len(results[0]) == len(results[1])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
    assert not results[0][-1].any() and not results[0][-2].any()


def test_lora_dense_rank3_input_and_live_only_gradient():
    ours, ref, _ = _pair("dense", lora=(2, 2))
    rng = np.random.default_rng(4)
    x = _sparse(rng, (3, 4, 13), 0.5)
    y0, g0 = _grads(ours, x)
    y1, g1 = _grads(ref, x)
    assert y0.shape == (3, 4, 7)
    for a, b in zip([y0] + g0, [y1] + g1):
        _assert_close(a, b)
    # masked_input_grad: the input gradient is the true one masked by
    # x != 0 (for an input behind a ReLU), on both products.
    live = tfss.SparseSplitDense(7, masked_input_grad=True)
    live.build((None, 13))
    live.set_weights(ref.get_weights()[:2])
    live.enable_lora(2)
    live.lora_kernel_a.assign(ref.lora_kernel_a)
    live.lora_kernel_b.assign(ref.lora_kernel_b)
    x2 = np.maximum(_sparse(rng, (6, 13), 0.3), 0.0)
    _, g_live = _grads(live, x2)
    _, g_ref = _grads(ref, x2)
    _assert_close(g_live[-1], g_ref[-1] * (x2 != 0))
    for a, b in zip(g_live[:-1], g_ref[:-1]):
        _assert_close(a, b)


# -- grouped convolution --------------------------------------------------
def _grouped_pair(groups, use_bias, strides, padding, threshold, filters=8,
                  channels=8):
    kw = dict(strides=strides, padding=padding, groups=groups,
              use_bias=use_bias, activation="relu",
              bias_initializer="random_normal")
    ours = tfss.SparseSplitConv2D(filters, 3, threshold=threshold, **kw)
    ref = keras.layers.Conv2D(filters, 3, **kw)
    shape = (None, 9, 9, channels)
    ours.build(shape)
    ref.build(shape)
    ref.set_weights(ours.get_weights())
    return ours, ref, shape


@pytest.mark.parametrize("groups", [2, 4])
@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("strides,padding", [(1, "same"), (2, "valid"),
                                             (2, "same")])
def test_grouped_conv_matches_keras(groups, use_bias, strides, padding):
    ours, ref, shape = _grouped_pair(groups, use_bias, strides, padding, -1.0)
    assert ours.kernel.shape == (3, 3, 8 // groups, 8)
    rng = np.random.default_rng(groups * 10 + strides)
    for sparsity in (0.0, 0.5, 0.9):
        x = _sparse(rng, (3,) + shape[1:], sparsity)
        x[1, :, :, : 8 // groups] = 0.0  # one group of one image all zero
        y0, g0 = _grads(ours, x)
        y1, g1 = _grads(ref, x)
        _assert_close(y0, y1)
        assert len(g0) == len(g1)
        for a, b in zip(g0, g1):
            _assert_close(a, b)


def test_grouped_conv_dilated_matches_keras():
    kw = dict(padding="same", groups=2, dilation_rate=2)
    ours = tfss.SparseSplitConv2D(4, 3, **kw)
    ref = keras.layers.Conv2D(4, 3, **kw)
    for layer in (ours, ref):
        layer.build((None, 8, 8, 6))
    ref.set_weights(ours.get_weights())
    x = _sparse(np.random.default_rng(14), (2, 8, 8, 6), 0.6)
    y0, g0 = _grads(ours, x)
    y1, g1 = _grads(ref, x)
    for a, b in zip([y0] + g0, [y1] + g1):
        _assert_close(a, b)


@pytest.mark.parametrize("threshold", [0.0, 1.0])
def test_grouped_conv_any_threshold_and_tf_function(threshold):
    ours, ref, shape = _grouped_pair(2, True, 1, "same", threshold)
    x = _sparse(np.random.default_rng(8), (4,) + shape[1:], 0.7)
    f = tf.function(lambda t: _grads(ours, t))
    y0, g0 = f(x)
    y1, g1 = _grads(ref, x)
    for a, b in zip([y0] + g0, [y1] + g1):
        _assert_close(a, b)


def test_grouped_conv_statistics_count_image_group_rows():
    ours, _, shape = _grouped_pair(4, True, 1, "same", 1.0)
    x = _sparse(np.random.default_rng(9), (3,) + shape[1:], 0.75)
    ours(x)
    st = ours.latest_stats()
    assert st["m"] == 3 * 4  # (image, group) pairs
    assert st["k"] == 9 * 9 * 2 and st["n"] == 3 * 3 * 2
    assert st["nnz"] == np.count_nonzero(x)
    assert st["sparsity"] == pytest.approx(1.0 - np.count_nonzero(x) / x.size)
    assert st["rows_sparse"] == 12 and st["threshold"] == 1.0
    assert sum(st["histogram"]) == 12


def test_grouped_conv_keras_file_round_trip(tmp_path):
    ours, _, shape = _grouped_pair(2, True, 1, "same", 0.5)
    model = keras.Sequential([keras.Input(shape[1:]), ours])
    x = _sparse(np.random.default_rng(1), (2,) + shape[1:], 0.5)
    before = model.predict(x, verbose=0)
    model.save(tmp_path / "g.keras")
    loaded = keras.models.load_model(tmp_path / "g.keras")
    layer = loaded.layers[0]
    assert layer.groups == 2 and layer.threshold == 0.5
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), before)


def test_grouped_conv_with_lora_matches_keras():
    ours, ref, shape = _grouped_pair(2, True, 1, "same", -1.0)
    ours.enable_lora(2)
    ref.enable_lora(2)
    _randomize_lora([ours, ref], np.random.default_rng(6))
    x = _sparse(np.random.default_rng(5), (2,) + shape[1:], 0.6)
    y0, g0 = _grads(ours, x)
    y1, g1 = _grads(ref, x)
    for a, b in zip([y0] + g0, [y1] + g1):
        _assert_close(a, b)


def test_bad_groups_raise_keras_errors():
    for cls in (tfss.SparseSplitConv2D, keras.layers.Conv2D):
        with pytest.raises(ValueError, match="divisible"):
            cls(6, 3, groups=4)  # filters not divisible
        with pytest.raises(ValueError, match="positive"):
            cls(6, 3, groups=0)
        layer = cls(8, 3, groups=4)
        with pytest.raises(ValueError, match="input channels"):
            layer.build((None, 5, 5, 6))  # channels not divisible


# -- SparseTensor inputs --------------------------------------------------
@pytest.mark.parametrize("lora", [None, (2, 4)])
def test_sparse_tensor_input_gradient_type_and_values_match_keras(lora):
    ours, ref, _ = _pair("dense", lora=lora, activation="relu")
    rng = np.random.default_rng(12)
    dense_x = _sparse(rng, (6, 13), 0.8)
    dense_x[2] = 0.0  # an empty row
    x = tf.sparse.from_dense(dense_x)
    out = []
    for layer in (ours, ref):
        with tf.GradientTape() as tape:
            y = layer(x)
            loss = tf.reduce_sum(y * 0.5 + y * y)
        out.append((y, tape.gradient(loss, layer.trainable_weights)))
    (y0, g0), (y1, g1) = out
    _assert_close(y0, y1)
    _assert_close(y0, ref(dense_x))
    for a, b in zip(g0, g1):
        assert type(a) is type(b)
        _assert_close(a, b)
    if lora is None:
        assert isinstance(g0[0], tf.IndexedSlices)  # the kernel's


def test_sparse_tensor_input_few_live_columns_empty_and_tf_function():
    ours = tfss.SparseSplitDense(5, activation="relu",
                                 bias_initializer="random_normal")
    ref = keras.layers.Dense(5, activation="relu")
    ours.build((None, 64))
    ref.build((None, 64))
    ref.set_weights(ours.get_weights())
    rng = np.random.default_rng(13)
    dense_x = np.zeros((6, 64), np.float32)
    dense_x[:, [3, 17, 40]] = _sparse(rng, (6, 3), 0.3)  # 3 live columns
    f = tf.function(lambda t: _sparse_grads(ours, t))
    for x in (dense_x, np.zeros_like(dense_x)):
        st = tf.sparse.from_dense(x)
        y0, g0 = f(st)
        y1, g1 = _sparse_grads(ref, st)
        _assert_close(y0, y1)
        for a, b in zip(g0, g1):
            _assert_close(a, b)
    ours(tf.sparse.from_dense(dense_x))
    # The op saw the live columns only, padded to a power of two.
    assert ours.latest_stats()["k"] == 4
    # Duplicate indices are summed (as tf.sparse.sparse_dense_matmul does).
    dup = tf.SparseTensor([[0, 3], [0, 3], [2, 9]], [1.0, 2.0, -1.5], [3, 64])
    _assert_close(ours(dup), ref(tf.sparse.to_dense(
        tf.sparse.reorder(tf.SparseTensor([[0, 3], [2, 9]], [3.0, -1.5],
                                          [3, 64])))))


def _sparse_grads(layer, x):
    with tf.GradientTape() as tape:
        y = layer(x)
        loss = tf.reduce_sum(0.5 * y * y + y)
    return y, tape.gradient(loss, layer.trainable_weights)


# -- conversion -----------------------------------------------------------
def _plain_model():
    inp = keras.Input((8, 8, 4))
    h = keras.layers.Conv2D(8, 3, padding="same", groups=2, activation="relu",
                            name="gconv")(inp)
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu",
                            name="lconv")(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(6, activation="relu", name="ldense")(h)
    out = keras.layers.Dense(3, name="out")(h)
    model = keras.Model(inp, out)
    model.get_layer("lconv").enable_lora(2, lora_alpha=3)
    model.get_layer("ldense").enable_lora(3, lora_alpha=6)
    rng = np.random.default_rng(0)
    for name in ("lconv", "ldense"):
        _randomize_lora([model.get_layer(name)], rng)
    return model


def test_convert_and_strip_grouped_and_lora_models():
    model = _plain_model()
    x = _sparse(np.random.default_rng(3), (5, 8, 8, 4), 0.5)
    expected = model.predict(x, verbose=0)
    conv = tfss.sparse_split_model(model)
    kinds = {l.name: type(l) for l in conv.layers}
    assert kinds["gconv"] is tfss.SparseSplitConv2D
    assert kinds["lconv"] is tfss.SparseSplitConv2D
    assert kinds["ldense"] is tfss.SparseSplitDense
    assert conv.get_layer("gconv").groups == 2
    for name, rank, alpha in (("lconv", 2, 3), ("ldense", 3, 6)):
        layer = conv.get_layer(name)
        assert layer.lora_enabled and layer.lora_rank == rank
        assert layer.lora_alpha == alpha
        assert not layer._kernel.trainable
    for a, b in zip(model.get_weights(), conv.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert len(conv.trainable_weights) == len(model.trainable_weights)
    np.testing.assert_allclose(conv.predict(x, verbose=0), expected,
                               rtol=1e-5, atol=1e-5)
    back = tfss.strip_sparse_split(conv)
    kinds = {l.name: type(l) for l in back.layers}
    assert kinds["gconv"] is keras.layers.Conv2D
    assert kinds["ldense"] is keras.layers.Dense
    for name, alpha in (("lconv", 3), ("ldense", 6)):
        assert back.get_layer(name).lora_enabled
        assert back.get_layer(name).lora_alpha == alpha
    np.testing.assert_allclose(back.predict(x, verbose=0), expected,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_quantize_is_refused(kind):
    layer = _pair(kind)[0]
    with pytest.raises(NotImplementedError):
        layer.quantize("int8")
