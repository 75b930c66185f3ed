"""Tests of tf_sparse_split.layers.dropout (structured dropout; needs the op library
for the tests that check what SparseSplitDense skips)."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sparse_split as tfss
from tf_sparse_split.tuning import stats
from tf_sparse_split.tuning.pattern_search import pattern_list

pytestmark = pytest.mark.usefixtures("op_library")


def _positive(shape, seed=0):
    """Strictly positive input, so every zero of the output is a drop."""
    return (np.random.default_rng(seed).random(shape) + 0.5).astype(np.float32)


def _masks(layer, steps, batch=None):
    """``steps`` training masks of ``layer`` drawn inside one tf.function
    (the way model.fit draws them), as a numpy array."""

    @tf.function
    def draw():
        return tf.stack([layer.keep_mask(batch) for _ in range(50)])

    out = [draw().numpy() for _ in range(steps // 50)]
    return np.concatenate(out)


# --------------------------------------------------------------------------
# the search
# --------------------------------------------------------------------------
@pytest.mark.parametrize("rate", [0.1, 0.3, 0.5, 0.7, 0.9])
@pytest.mark.parametrize("units", [10, 64, 2048])
def test_search_reaches_rate_for_every_unit(rate, units):
    d = tfss.search_pattern_distribution(rate, units, seed=3)
    assert d.probabilities.shape == (len(d.patterns),)
    assert np.all(d.probabilities >= 0)
    assert math.isclose(d.probabilities.sum(), 1.0, abs_tol=1e-12)
    assert d.expected_rate == pytest.approx(rate, abs=1e-9)
    # Every unit is dropped with the requested probability (exact formula).
    np.testing.assert_allclose(d.per_unit_drop_probability(), rate,
                               atol=1e-9)
    # The objective went down and the distribution is spread (the entropy
    # term): more than one pattern has a real share.
    assert d.loss_history[-1] < d.loss_history[0]
    if rate < 1 - 1 / units:  # at the top rate only keep-1-of-units fits
        assert np.sum(d.probabilities > 0.02) >= 2


def test_search_is_reproducible_and_seed_dependent():
    a = tfss.search_pattern_distribution(0.4, 256, seed=7)
    b = tfss.search_pattern_distribution(0.4, 256, seed=7)
    c = tfss.search_pattern_distribution(0.4, 256, seed=8, steps=3)
    np.testing.assert_array_equal(a.probabilities, b.probabilities)
    np.testing.assert_array_equal(a.loss_history, b.loss_history)
    assert not np.array_equal(a.loss_history[:3], c.loss_history)


def test_search_tile_uses_tile_columns():
    d = tfss.search_pattern_distribution(0.5, 256, pattern="tile",
                                         tile_shape=(8, 32))
    assert d.num_columns == 8
    assert max(p for _, p in d.patterns) <= 8
    assert d.expected_rate == pytest.approx(0.5, abs=1e-9)


def test_pattern_list():
    assert pattern_list(5, 8) == [("keep", 1), ("drop", 2), ("drop", 3),
                                  ("drop", 4), ("drop", 5), ("keep", 3),
                                  ("keep", 4), ("keep", 5)]


@pytest.mark.parametrize("kwargs, match", [
    (dict(rate=1.0, num_units=8), "rate"),
    (dict(rate=-0.1, num_units=8), "rate"),
    (dict(rate=float("nan"), num_units=8), "rate"),
    (dict(rate=0.95, num_units=10), "not reachable"),
    (dict(rate=0.6, num_units=64, pattern="tile", tile_shape=(32, 32)),
     r"not reachable .*narrower tile_shape \(now \(32, 32\)\)"),
    (dict(rate=0.5, num_units=0), "num_units"),
    (dict(rate=0.5, num_units=8, pattern="column"), "pattern"),
    (dict(rate=0.5, num_units=64, pattern="tile"), "tile_shape"),
    (dict(rate=0.5, num_units=64, pattern="tile", tile_shape=(4, 48)),
     "does not divide"),
    (dict(rate=0.5, num_units=64, pattern="tile", tile_shape=(4, 128)),
     "wider"),
    (dict(rate=0.5, num_units=8, lr=0), "lr"),
    (dict(rate=0.5, num_units=8, steps=0), "steps"),
])
def test_search_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tfss.search_pattern_distribution(**kwargs)


# --------------------------------------------------------------------------
# ApproximateRandomDropout
# --------------------------------------------------------------------------
@pytest.mark.parametrize("pattern, rate", [("row", 0.3), ("row", 0.7),
                                           ("tile", 0.5)])
def test_realized_drop_rate_per_unit(pattern, rate):
    # 2000 steps; a unit's drop count is Binomial(2000, rate) across steps
    # (steps are independent draws), std <= sqrt(0.25 / 2000) = 0.0112. The
    # tolerance 0.06 is > 5 std per unit (p < 1e-6 per unit, < 1e-4 over all
    # units by a union bound). The mean over units and steps is checked to
    # 0.02 (> 5 std of the per-step realized rate, <= 0.2, over 2000 steps).
    units = 60
    kw = {"tile_shape": (4, 6)} if pattern == "tile" else {}
    layer = tfss.ApproximateRandomDropout(rate, pattern=pattern, seed=11, **kw)
    layer.build((None, units))
    masks = _masks(layer, 2000, batch=16 if pattern == "tile" else None)
    drop = 1.0 - masks.reshape(2000, -1, units)  # [steps, rows, units]
    per_unit = drop.mean(axis=0)
    np.testing.assert_allclose(per_unit, rate, atol=0.06)
    assert drop.mean() == pytest.approx(rate, abs=0.02)
    # Not a fixed mask: masks differ between steps.
    assert len({m.tobytes() for m in masks[:50]}) > 3


@pytest.mark.parametrize("pattern", ["row", "tile"])
def test_training_rescales_and_inference_is_identity(pattern):
    kw = {"tile_shape": (8, 16)} if pattern == "tile" else {}
    if pattern == "row":   # one pattern for the whole batch
        kw["pattern_groups"] = 1
    layer = tfss.ApproximateRandomDropout(0.5, pattern=pattern, seed=1, **kw)
    x = _positive((32, 64))
    np.testing.assert_array_equal(layer(x).numpy(), x)          # default
    np.testing.assert_array_equal(layer(x, training=False).numpy(), x)
    for _ in range(5):
        y = layer(x, training=True).numpy()
        dropped = y == 0
        realized = dropped.mean()
        assert 0 < realized < 1
        np.testing.assert_allclose(y[~dropped], x[~dropped] / (1 - realized),
                                   rtol=1e-6)
        if pattern == "row":  # whole columns, identical for every example
            assert np.all(dropped == dropped[:1])
        else:  # whole tiles
            t = dropped.reshape(4, 8, 4, 16)
            assert np.all(t == t[:, :1, :, :1])


def test_rate_zero_is_identity_in_training():
    layer = tfss.ApproximateRandomDropout(0.0)
    x = _positive((4, 8))
    np.testing.assert_array_equal(layer(x, training=True).numpy(), x)


def test_higher_rank_input_drops_last_axis():
    layer = tfss.ApproximateRandomDropout(0.5, seed=2, pattern_groups=1)
    x = _positive((3, 5, 16))
    y = layer(x, training=True).numpy()
    dropped = y == 0
    assert np.all(dropped == dropped[:1, :1])
    assert 0 < dropped.mean() < 1


@pytest.mark.parametrize("pattern", ["row", "tile"])
def test_gradient_flows_only_through_kept_units(pattern):
    kw = {"tile_shape": (4, 8)} if pattern == "tile" else {}
    layer = tfss.ApproximateRandomDropout(0.5, pattern=pattern, seed=4, **kw)
    x = tf.constant(_positive((16, 32)))
    w = tf.constant(np.random.default_rng(0).standard_normal((32, 1)),
                    tf.float32)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=True)
        loss = tf.reduce_sum(tf.matmul(y, w))
    g = tape.gradient(loss, x).numpy()
    dropped = y.numpy() == 0
    scale = 1.0 / (1.0 - dropped.mean())
    assert np.all(g[dropped] == 0)
    expected = np.broadcast_to(w.numpy()[:, 0] * scale, g.shape)
    np.testing.assert_allclose(g[~dropped], expected[~dropped], rtol=1e-6)


def test_dense_after_row_dropout_skips_dropped_columns():
    # threshold 0.0 (not automatic): the op then never calibrates its rate
    # model for this shape and compacts by its fixed rule (>= 1/16 of the
    # columns dead), so the check does not depend on timings; in automatic
    # mode it compacts when the measured flops saved beat the gather.
    units = 96
    drop = tfss.ApproximateRandomDropout(0.5, seed=5, pattern_groups=1)
    dense = tfss.SparseSplitDense(24, threshold=0.0)
    x = _positive((40, units))
    for _ in range(5):
        y = drop(x, training=True)
        out = dense(y)
        st = stats.as_dict(dense.latest_stats_vector())
        zero_cols = int(np.sum(np.all(y.numpy() == 0, axis=0)))
        assert zero_cols > 0
        # Forward: every dropped neuron is a compacted-away column.
        assert st["zero_cols_skipped"] == zero_cols
        assert st["nnz"] == 40 * (units - zero_cols)
        # Same result as the full product.
        np.testing.assert_allclose(
            out.numpy(), y.numpy() @ dense.kernel.numpy() + dense.bias.numpy(),
            rtol=1e-5, atol=1e-5)
        # Weight gradient dW = Y^T dOut runs through the op with Y^T as its
        # sparse operand: the dropped neurons are all-zero rows of Y^T, which
        # go to the sparse path and cost nothing (nnz 0).
        d_out = tf.ones((40, 24))
        _, st_w = tfss.sparse_split_matmul(y, d_out, threshold=0.0,
                                           transpose_a=True,
                                           return_stats=True)
        st_w = stats.as_dict(st_w)
        assert st_w["rows_sparse"] >= zero_cols
        assert st_w["nnz"] == 40 * (units - zero_cols)


def test_weight_gradient_of_dense_goes_through_the_op():
    drop = tfss.ApproximateRandomDropout(0.5, seed=5)
    dense = tfss.SparseSplitDense(8)
    x = _positive((16, 32))
    dense.build((None, 32))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(dense(drop(x, training=True)))
        return tape.gradient(loss, dense.kernel)

    graph = step.get_concrete_function(tf.TensorSpec((16, 32))).graph
    ops = [op.type for op in graph.get_operations()]
    # one in the forward pass, one for dW (the dX gradient is a plain MatMul)
    assert ops.count("TfSparseSplit>SparseSplitMatMul") == 2, ops
    g = step(x).numpy()
    assert np.all(np.isfinite(g))


def test_dense_after_grouped_row_dropout_sparse_path_touches_only_kept():
    # Per-group row patterns (the default) leave (almost) no all-zero
    # column; with the threshold at 1.0 every row goes to the CSR path,
    # whose work is the kept values only, and the result is exact.
    drop = tfss.ApproximateRandomDropout(0.5, seed=8)
    dense = tfss.SparseSplitDense(16, threshold=1.0)
    x = _positive((32, 64))
    y = drop(x, training=True)
    out = dense(y)
    st = stats.as_dict(dense.latest_stats_vector())
    kept = int(np.count_nonzero(y.numpy()))
    assert kept < x.size
    assert st["rows_sparse"] == 32 and st["nnz_sparse"] == kept
    np.testing.assert_allclose(
        out.numpy(), y.numpy() @ dense.kernel.numpy() + dense.bias.numpy(),
        rtol=1e-5, atol=1e-5)


def test_dense_after_tile_dropout_sparse_path_touches_only_kept():
    # Tiles leave no all-zero column (so nothing is compacted); with the
    # threshold at 1.0 every row goes to the CSR path, whose work is the
    # nonzeros only.
    drop = tfss.ApproximateRandomDropout(0.5, pattern="tile",
                                         tile_shape=(8, 16), seed=6)
    dense = tfss.SparseSplitDense(16, threshold=1.0)
    x = _positive((32, 64))
    y = drop(x, training=True)
    dense(y)
    st = stats.as_dict(dense.latest_stats_vector())
    kept = int(np.count_nonzero(y.numpy()))
    assert kept < x.size
    assert st["rows_sparse"] == 32 and st["nnz_sparse"] == kept
    assert st["zero_cols_skipped"] == 0


def test_seeds_make_masks_reproducible():
    def run(seed):
        layer = tfss.ApproximateRandomDropout(0.5, seed=seed)
        x = _positive((2, 40))
        return np.stack([layer(x, training=True).numpy() for _ in range(20)])

    np.testing.assert_array_equal(run(3), run(3))
    assert not np.array_equal(run(3), run(4))


def test_fit_with_dropout_is_reproducible_and_masks_vary():
    x = _positive((64, 12))
    y = np.random.default_rng(1).integers(0, 3, 64)

    def train():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((12,)),
            tfss.SparseSplitDense(32, activation="relu"),
            tfss.ApproximateRandomDropout(0.5, seed=9),
            # threshold 0.0: compaction by the op's fixed rule (see above)
            tfss.SparseSplitDense(3, activation="softmax", threshold=0.0)])
        model.compile("sgd", "sparse_categorical_crossentropy",
                      jit_compile=False)
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        return model

    a, b = train(), train()
    for wa, wb in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_array_equal(wa, wb)
    # The compiled training step drew different patterns across steps: the
    # output layer saw different numbers of skipped columns.
    total, calls = a.layers[2].accumulated_stats_vector()
    assert calls == 8
    assert total[stats.ZERO_COLS_SKIPPED] > 0


def test_serialization_round_trip(tmp_path):
    model = keras.Sequential([
        keras.Input((32,)),
        tfss.ApproximateRandomDropout(0.3, seed=2, name="ard_row"),
        tfss.ApproximateRandomDropout(0.6, pattern="tile", tile_shape=(4, 8),
                                      max_period=5, seed=3, name="ard_tile"),
        tfss.SparseSplitDense(4)])
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    for name in ("ard_row", "ard_tile"):
        a, b = model.get_layer(name), loaded.get_layer(name)
        assert type(b) is tfss.ApproximateRandomDropout
        assert a.get_config() == b.get_config()
        assert a.pattern_probabilities() == b.pattern_probabilities()
    cfg = loaded.get_layer("ard_tile").get_config()
    assert cfg["tile_shape"] == [4, 8] and cfg["pattern"] == "tile"
    x = _positive((5, 32))
    np.testing.assert_allclose(loaded(x).numpy(), model(x).numpy(), rtol=1e-6)
    # from_config with explicit probabilities skips the search.
    layer = tfss.ApproximateRandomDropout.from_config(
        model.get_layer("ard_row").get_config())
    layer.build((None, 32))
    assert layer.distribution is None
    assert layer.pattern_probabilities() == \
        model.get_layer("ard_row").pattern_probabilities()


def test_pattern_groups_masks_per_group_of_examples():
    # 9 examples in 4 groups of ceil(9/4) = 3 consecutive examples (the last
    # group holds none): every group's rows share one row pattern, rescaled
    # by that group's own realized rate; the groups' patterns differ.
    layer = tfss.ApproximateRandomDropout(0.5, seed=4, pattern_groups=4)
    x = _positive((9, 2, 40))            # rank 3: drops the last axis
    seen = set()
    for _ in range(20):
        y = layer(x, training=True).numpy()
        dropped = y == 0
        for g0 in (0, 3, 6):
            block = dropped[g0:g0 + 3]
            assert np.all(block == block[:1, :1])   # one pattern per group
            realized = block[0, 0].mean()
            assert 0 < realized < 1
            np.testing.assert_allclose(y[g0:g0 + 3][~block],
                                       x[g0:g0 + 3][~block] / (1 - realized),
                                       rtol=1e-6)
        seen.add(len({dropped[g0, 0].tobytes() for g0 in (0, 3, 6)}))
    assert max(seen) > 1                  # groups draw independently


def test_pattern_groups_rate_per_unit_and_unbiased():
    # 300 steps x 4 groups = 1200 draws per unit: drop-rate std per unit
    # <= sqrt(0.25 / 1200) = 0.0144, tolerance 0.075 (> 5 std). E[output] =
    # input: the mean of y / x over draws is 1 within 0.1 per unit.
    layer = tfss.ApproximateRandomDropout(0.5, seed=6, pattern_groups=4)
    x = _positive((8, 24))

    @tf.function
    def draw():
        return tf.stack([layer(x, training=True) for _ in range(50)])

    ys = np.concatenate([draw().numpy() for _ in range(6)])   # [300, 8, 24]
    per_group = ys[:, ::2, :]                                 # one row/group
    np.testing.assert_allclose((per_group == 0).mean(axis=(0, 1)), 0.5,
                               atol=0.075)
    np.testing.assert_allclose((per_group / x[::2]).mean(axis=(0, 1)), 1.0,
                               atol=0.1)


def test_pattern_groups_config_and_gradient_exact(tmp_path):
    model = keras.Sequential([
        keras.Input((16,)),
        tfss.ApproximateRandomDropout(0.5, seed=2, pattern_groups=3,
                                      name="ard"),
        tfss.SparseSplitDense(4, masked_input_grad=True)])
    path = tmp_path / "g.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.get_layer("ard").get_config()["pattern_groups"] == 3
    assert loaded.get_layer("ard").get_config() == \
        model.get_layer("ard").get_config()
    # The gradient through the grouped mask is the mask (and scale) itself.
    layer = model.get_layer("ard")
    x = tf.constant(_positive((6, 16)))
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=True)
    g = tape.gradient(y, x).numpy()
    np.testing.assert_allclose(g * x.numpy(), y.numpy(), rtol=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    (dict(pattern_groups=0), "pattern_groups"),
    (dict(pattern_groups="2"), "pattern_groups"),
    (dict(pattern_groups=2, pattern="tile"), "pattern='row'"),
])
def test_pattern_groups_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tfss.ApproximateRandomDropout(0.5, **kwargs)


@pytest.mark.parametrize("kwargs, shape, match", [
    (dict(rate=1.0), (None, 8), "rate"),
    (dict(rate=-0.5), (None, 8), "rate"),
    (dict(rate="half"), (None, 8), "rate"),
    (dict(rate=0.5, pattern="diag"), (None, 8), "pattern"),
    (dict(rate=0.5, tile_shape=(2, 2)), (None, 8), "only used"),
    (dict(rate=0.5, pattern="tile", tile_shape=(2, 3)), (None, 8),
     "does not divide"),
    (dict(rate=0.5, pattern="tile", tile_shape=(2, 16)), (None, 8), "wider"),
    (dict(rate=0.5, pattern="tile", tile_shape=(0, 4)), (None, 8),
     "tile_shape"),
    (dict(rate=0.5, pattern="tile", tile_shape=4), (None, 8), "tile_shape"),
    (dict(rate=0.5, probabilities=[["drop", 1, 1.0]]), (None, 8), "period"),
    (dict(rate=0.5, probabilities=[["drop", 16, 1.0]]), (None, 8),
     "exceeds"),
])
def test_bad_arguments(kwargs, shape, match):
    with pytest.raises(ValueError, match=match):
        layer = tfss.ApproximateRandomDropout(**kwargs)
        layer.build(shape)


# --------------------------------------------------------------------------
# SensitivityAwareDropout
# --------------------------------------------------------------------------
def test_sensitivity_dropout_drops_whole_channels_and_matches_conv():
    layer = tfss.SensitivityAwareDropout(0.25, seed=1)
    x = _positive((2, 6, 5, 16))
    np.testing.assert_array_equal(layer(x).numpy(), x)  # inference
    w = tf.constant(np.random.default_rng(2).standard_normal((3, 3, 16, 4)),
                    tf.float32)
    for _ in range(3):
        y = layer(x, training=True).numpy()
        dropped = np.all(y == 0, axis=(0, 1, 2))
        assert dropped.sum() == 4  # round(0.25 * 16)
        assert not np.any((y == 0)[..., ~dropped])
        np.testing.assert_allclose(y[..., ~dropped],
                                   x[..., ~dropped] * 16 / 12, rtol=1e-6)
        # What a channel-skipping convolution computes: only kept channels.
        full = tf.nn.conv2d(y, w, 1, "SAME")
        kept = np.flatnonzero(~dropped)
        skip = tf.nn.conv2d(tf.gather(y, kept, axis=3),
                            tf.gather(w, kept, axis=2), 1, "SAME")
        np.testing.assert_allclose(full.numpy(), skip.numpy(), rtol=1e-5,
                                   atol=1e-5)


def test_sensitivity_score_and_preference():
    c = 8
    layer = tfss.SensitivityAwareDropout(0.5, momentum=0.5, seed=3)
    scale = np.array([0.01] * 4 + [1.0] * 4, np.float32)
    x = _positive((4, 3, 3, c)) * scale
    layer(x, training=True)
    # First update: the score is the mean |activation| per channel.
    np.testing.assert_allclose(layer.sensitivity.numpy(),
                               np.abs(x).mean(axis=(0, 1, 2)), rtol=1e-6)
    assert int(layer.score_updates.numpy()) == 1
    counts = np.zeros(c)
    for _ in range(100):
        y = layer(x, training=True).numpy()
        counts += np.all(y == 0, axis=(0, 1, 2))
    # Low-sensitivity channels (0-3) are dropped far more often.
    assert counts[:4].mean() > 0.9 * 100
    assert counts[4:].mean() < 0.1 * 100


def test_sensitivity_high_temperature_is_near_uniform():
    c = 8
    layer = tfss.SensitivityAwareDropout(0.5, temperature=1e6, seed=4)
    x = _positive((2, 2, 2, c)) * np.array([0.01] * 4 + [1.0] * 4, np.float32)
    counts = np.zeros(c)
    for _ in range(400):
        counts += np.all(layer(x, training=True).numpy() == 0, axis=(0, 1, 2))
    # Each channel dropped with prob 0.5: 400 draws, std 10; allow 6 std.
    np.testing.assert_allclose(counts, 200, atol=60)


def test_sensitivity_gradient_and_serialization(tmp_path):
    layer = tfss.SensitivityAwareDropout(0.5, seed=5)
    x = tf.constant(_positive((2, 4, 4, 6)))
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=True)
        loss = tf.reduce_sum(y)
    g = tape.gradient(loss, x).numpy()
    dropped = y.numpy() == 0
    assert np.all(g[dropped] == 0) and np.allclose(g[~dropped], 2.0)
    model = keras.Sequential([keras.Input((4, 4, 6)), layer])
    model.save(tmp_path / "s.keras")
    loaded = keras.models.load_model(tmp_path / "s.keras")
    lb = loaded.layers[0]
    assert type(lb) is tfss.SensitivityAwareDropout
    assert lb.get_config() == layer.get_config()
    np.testing.assert_array_equal(lb.sensitivity.numpy(),
                                  layer.sensitivity.numpy())


def test_sensitivity_set_rate_without_retrace():
    """The dropped-channel count is a variable the compiled step reads:
    set_rate moves it between calls of one traced function, 0 included."""
    c = 16
    layer = tfss.SensitivityAwareDropout(0.25, seed=6)
    x = tf.constant(_positive((2, 3, 3, c)))
    layer.build(x.shape)    # (variables created in a trace retrace it)
    traces = []

    @tf.function
    def step(t):
        traces.append(1)
        return layer(t, training=True)

    assert np.all(step(x).numpy() == 0, axis=(0, 1, 2)).sum() == 4
    for rate, n in ((0.5, 8), (0.0, 0), (0.02, 0), (0.1, 2), (0.99, 15),
                    (0.25, 4)):
        layer.set_rate(rate)
        assert layer.rate == rate and layer.num_drop == n
        assert layer.realized_rate == n / c
        y = step(x).numpy()
        dropped = np.all(y == 0, axis=(0, 1, 2))
        assert dropped.sum() == n
        np.testing.assert_allclose(y[..., ~dropped],
                                   x.numpy()[..., ~dropped] * c / (c - n),
                                   rtol=1e-6)
    assert len(traces) == 1
    # Rate 0: the identity, and the scores still follow the input.
    layer.rate = 0.0
    before = int(layer.score_updates.numpy())
    np.testing.assert_array_equal(step(x).numpy(), x.numpy())
    assert int(layer.score_updates.numpy()) == before + 1
    assert len(traces) == 1
    with pytest.raises(ValueError, match="rate"):
        layer.set_rate(1.0)
    with pytest.raises(ValueError, match="rate"):
        layer.set_rate(float("nan"))
    # Before build only the value is stored.
    fresh = tfss.SensitivityAwareDropout(0.5)
    fresh.set_rate(0.25)
    fresh.build((None, 2, 2, 8))
    assert fresh.num_drop == 2 and int(fresh.num_drop_var.numpy()) == 2


def test_sensitivity_dropped_set_is_the_top_k_of_the_perturbed_scores():
    """The channels dropped are the num_drop largest of -log(s + eps) / T
    plus the Gumbel noise the seed draws (what tf.math.top_k chose when
    the count was fixed at build time)."""
    c, n, seed = 12, 5, 9
    rng = np.random.default_rng(3)
    x = tf.constant((rng.random((2, 2, 2, c)) * np.linspace(0.01, 2, c)
                     ).astype(np.float32))
    layer = tfss.SensitivityAwareDropout(n / c, temperature=0.5, seed=seed)
    layer(x, training=True)         # one score update
    ref = keras.random.SeedGenerator(seed)
    keras.random.uniform((c,), minval=1e-7, maxval=1.0, seed=ref)
    for _ in range(4):
        s = layer.sensitivity.numpy()
        u = keras.random.uniform((c,), minval=1e-7, maxval=1.0, seed=ref)
        z = -np.log(s + 1e-6) / 0.5 - np.log(-np.log(u.numpy()))
        _, top = tf.math.top_k(tf.constant(z, tf.float32), k=n)
        keep = layer.keep_mask().numpy()
        assert set(np.flatnonzero(keep == 0)) == set(top.numpy())


def test_sensitivity_rate_in_force_round_trips_and_old_configs_load(
        tmp_path):
    layer = tfss.SensitivityAwareDropout(0.25, seed=2)
    model = keras.Sequential([keras.Input((3, 3, 16)), layer])
    model(np.ones((1, 3, 3, 16), np.float32), training=True)
    layer.set_rate(0.375)
    model.save(tmp_path / "s.keras")
    lb = keras.models.load_model(tmp_path / "s.keras").layers[0]
    assert lb.rate == 0.375 and lb.num_drop == 6
    assert lb.get_config() == layer.get_config()
    np.testing.assert_array_equal(lb.sensitivity.numpy(),
                                  layer.sensitivity.numpy())
    lb.set_rate(0.5)
    assert lb.num_drop == 8
    # A config written before the count became a variable (the same keys).
    old = {"name": "sad", "trainable": True, "dtype": "float32",
           "rate": 0.25, "temperature": 1.0, "momentum": 0.9, "seed": 2}
    restored = tfss.SensitivityAwareDropout.from_config(old)
    restored.build((None, 4, 4, 8))
    assert restored.num_drop == 2 and restored.rate == 0.25


@pytest.mark.parametrize("kwargs, shape, match", [
    (dict(rate=1.0), (None, 4, 4, 8), "rate"),
    (dict(rate=0.5, temperature=0), (None, 4, 4, 8), "temperature"),
    (dict(rate=0.5, momentum=1.0), (None, 4, 4, 8), "momentum"),
    (dict(rate=0.5), (None, 8), "NHWC"),
    (dict(rate=0.3), (None, 4, 4, 1), "drops no channel"),
])
def test_sensitivity_bad_arguments(kwargs, shape, match):
    with pytest.raises(ValueError, match=match):
        tfss.SensitivityAwareDropout(**kwargs).build(shape)


# --------------------------------------------------------------------------
# CLI: tf-sparse-split train --dropout
# --------------------------------------------------------------------------
CLI_SMALL = ["train", "--epochs", "1", "--hidden", "32,32", "--quiet"]


@pytest.mark.parametrize("kind, what", [
    ("standard", "keras.layers.Dropout"),
    ("row", "ApproximateRandomDropout row patterns"),
    ("tile", "ApproximateRandomDropout tile patterns (16, 8)"),
])
def test_cli_train_with_dropout(capsys, kind, what):
    from tf_sparse_split.tools import cli

    extra = ["--tile-shape", "16,8"] if kind == "tile" else []
    rc = cli.main(CLI_SMALL + ["--dropout", kind, "--dropout-rate", "0.3"]
                  + extra)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"dropout: {what}, rate 0.3, after every hidden layer" in out
    assert "sparse-split: test accuracy" in out and "time/epoch" in out


def test_cli_build_mlp_places_dropout():
    from tf_sparse_split.tools import models

    model = models.build_mlp(8, [16, 16], 3, dropout="row", dropout_rate=0.5,
                          seed=1)
    names = [l.name for l in model.layers]
    assert names == ["hidden_1", "dropout_1", "hidden_2", "dropout_2",
                     "output"]
    assert isinstance(model.get_layer("dropout_1"),
                      tfss.ApproximateRandomDropout)
    assert model.get_layer("dropout_2").seed == 2
    plain = models.build_mlp(8, [16], 3)
    assert [l.name for l in plain.layers] == ["hidden_1", "output"]


@pytest.mark.parametrize("argv, rc, msg", [
    (["--dropout", "row", "--dropout-rate", "1.0"], 2,
     "must be a number in [0, 1)"),
    (["--dropout", "blocks"], 2, "invalid choice"),
    # Flags that do not apply are usage errors (exit 2), checked at parsing.
    (["--dropout-rate", "0.3"], 2, "need --dropout"),
    (["--dropout", "row", "--tile-shape", "8,8"], 2, "needs --dropout tile"),
    (["--dropout", "tile", "--tile-shape", "8,12"], 2, "does not divide"),
])
def test_cli_dropout_bad_arguments(capsys, argv, rc, msg):
    from tf_sparse_split.tools import cli

    assert cli.main(CLI_SMALL + argv) == rc
    assert msg in capsys.readouterr().err


def test_masked_input_grad_is_exact_after_relu_and_row_dropout():
    """Dense(relu) -> ApproximateRandomDropout(row) -> SparseSplitDense with
    masked_input_grad=True gives the same gradients for every weight."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((32, 24)).astype(np.float32)
    grads = []
    for skip in (False, True):
        keras.utils.set_random_seed(3)
        model = keras.Sequential([
            keras.Input((24,)), keras.layers.Dense(48, activation="relu"),
            tfss.ApproximateRandomDropout(0.5, pattern="row", seed=7),
            tfss.SparseSplitDense(10, masked_input_grad=skip, threshold=0.0)])
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(x, training=True)))
        grads.append(tape.gradient(loss, model.trainable_variables))
    for g0, g1 in zip(*grads):
        np.testing.assert_allclose(g1.numpy(), g0.numpy(), rtol=1e-5, atol=1e-6)
    layer = tfss.SparseSplitDense(4, masked_input_grad=True)
    assert tfss.SparseSplitDense.from_config(layer.get_config()).masked_input_grad


def test_sensitivity_dropout_channels_skipped_by_sparse_split_conv2d():
    """The channels SensitivityAwareDropout drops are all-zero input channels
    that the following SparseSplitConv2D compacts away (dense path)."""
    rng = np.random.default_rng(8)
    x = np.abs(rng.standard_normal((4, 6, 6, 8))).astype(np.float32) + 0.1
    drop = tfss.SensitivityAwareDropout(0.5, seed=2)
    conv = tfss.SparseSplitConv2D(5, 3, padding="same", threshold=0.0)
    y = drop(x, training=True)
    dropped = int(np.sum(~np.asarray(y).any(axis=(0, 1, 2))))
    assert dropped == 4
    out = conv(y)
    st = conv.latest_stats()
    assert st["zero_cols_skipped"] == dropped * 6 * 6
    ref = tf.nn.conv2d(y, conv.kernel, 1, "SAME") + conv.bias
    np.testing.assert_allclose(out.numpy(), ref.numpy(), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# random unit subsets per group (SparseSplitLSTM's pattern="subset")
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("rate,units,groups", [(0.5, 16, 4), (0.3, 25, 3),
                                               (0.8, 7, 2)])
def test_random_subset_masks_rate_count_and_pairs(rate, units, groups):
    """Every unit of every group is dropped with probability ``rate``
    (E[n] = rate * units when that is not an integer), all groups of a draw
    drop the same number of units, subsets are uniform (every pair of units
    is dropped together about as often as independent sampling of n of
    ``units`` predicts: no pair is always dropped together, unlike the
    periodic row patterns) and groups differ."""
    from tf_sparse_split.layers.dropout import random_subset_keep_mask
    gen = keras.random.SeedGenerator(5)
    draws = 4000

    @tf.function
    def draw_many():
        ta = tf.TensorArray(tf.float32, size=draws)
        for i in tf.range(draws):
            ta = ta.write(i, random_subset_keep_mask(units, rate, gen,
                                                     groups=groups))
        return ta.stack()

    keep = draw_many().numpy()                       # [draws, G, units]
    assert keep.shape == (draws, groups, units)
    assert set(np.unique(keep)) <= {0.0, 1.0}
    dropped = 1.0 - keep
    n = dropped.sum(axis=2)                          # [draws, G]
    np.testing.assert_array_equal(n, n[:, :1].repeat(groups, 1))
    lo = math.floor(rate * units)
    assert set(np.unique(n)) <= {lo, lo + 1}
    np.testing.assert_allclose(n.mean(), rate * units, atol=0.05 * units)
    np.testing.assert_allclose(dropped.mean(axis=0), rate, atol=0.04)
    # Unbiased after the per-group rescale units / (units - n).
    scaled = keep * (units / (units - n))[:, :, None]
    np.testing.assert_allclose(scaled.mean(axis=0), 1.0, atol=0.08)
    d = dropped[:, 0]                                # one group
    together = (d.T @ d) / draws                     # [units, units]
    nn = n[:, 0]
    expect = np.mean(nn * (nn - 1)) / (units * (units - 1))
    off = together[~np.eye(units, dtype=bool)]
    np.testing.assert_allclose(off, expect, atol=0.05)
    differ = (keep != keep[:, :1]).any(axis=(1, 2))
    assert differ.mean() > 0.75


def test_random_subset_mask_keeps_one_unit_and_checks_arguments():
    from tf_sparse_split.layers.dropout import random_subset_keep_mask
    gen = keras.random.SeedGenerator(0)
    keep = random_subset_keep_mask(3, 0.99, gen, groups=5).numpy()
    np.testing.assert_array_equal(keep.sum(axis=1), 1.0)
    np.testing.assert_array_equal(
        random_subset_keep_mask(4, 0.0, gen).numpy(), np.ones((1, 4)))
    for kwargs, match in (({"units": 0}, "units"), ({"rate": 1.0}, "rate"),
                          ({"groups": 0}, "groups")):
        args = {"units": 4, "rate": 0.5, "groups": 1, **kwargs}
        with pytest.raises(ValueError, match=match):
            random_subset_keep_mask(args["units"], args["rate"], gen,
                                    groups=args["groups"])


@pytest.mark.parametrize("rate,units,groups", [(0.5, 16, 4), (0.5, 24, 8),
                                               (0.3, 25, 3)])
def test_balanced_random_subsets(rate, units, groups):
    """balanced=True: each group's subset is still uniform (every unit
    dropped with probability ``rate``, unbiased after the rescale, no pair
    of units always dropped together over draws), every group drops the
    same count n, and within a draw every unit is dropped by n * groups /
    units groups (+-1; exactly when that is an integer and groups divides
    units), e.g. complementary subsets for two groups at rate 0.5."""
    from tf_sparse_split.layers.dropout import random_subset_keep_mask
    gen = keras.random.SeedGenerator(11)
    draws = 4000

    @tf.function
    def draw_many():
        ta = tf.TensorArray(tf.float32, size=draws)
        for i in tf.range(draws):
            ta = ta.write(i, random_subset_keep_mask(
                units, rate, gen, groups=groups, balanced=True))
        return ta.stack()

    keep = draw_many().numpy()                       # [draws, G, units]
    dropped = 1.0 - keep
    n = dropped.sum(axis=2)
    np.testing.assert_array_equal(n, n[:, :1].repeat(groups, 1))
    np.testing.assert_allclose(dropped.mean(axis=0), rate, atol=0.04)
    scaled = keep * (units / (units - n))[:, :, None]
    np.testing.assert_allclose(scaled.mean(axis=0), 1.0, atol=0.08)
    by = dropped.sum(axis=1)                         # [draws, units]
    share = n[:, :1] * groups / units
    assert (np.abs(by - share) <= 1.0 + 1e-9).all()
    if (rate * units).is_integer() and units % groups == 0 and \
            (rate * groups).is_integer():
        np.testing.assert_array_equal(by, rate * groups)
    d = dropped[:, 0]
    off = ((d.T @ d) / draws)[~np.eye(units, dtype=bool)]
    assert off.max() < 0.8 * rate
    two = random_subset_keep_mask(10, 0.5, gen, groups=2,
                                  balanced=True).numpy()
    np.testing.assert_array_equal(two[0] + two[1], 1.0)


# --------------------------------------------------------------------------
# the rate as a variable (set_rate between steps, no retracing)
# --------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [{}, {"pattern_groups": 1},
                                    {"pattern": "tile", "tile_shape": (4, 8)}])
def test_set_rate_moves_a_compiled_step_without_retracing(kwargs):
    layer = tfss.ApproximateRandomDropout(0.2, seed=4, **kwargs)
    x = _positive((16, 64))
    layer.build(x.shape)
    traces = []

    @tf.function
    def draw():
        traces.append(1)
        return tf.stack([layer(x, training=True) for _ in range(40)])

    def rate_now(n=5):
        ys = np.concatenate([draw().numpy() for _ in range(n)])
        return float((ys == 0).mean()), ys

    r, _ = rate_now()
    assert r == pytest.approx(0.2, abs=0.04)
    for rate in (0.6, 0.35, 0.0, 0.5):
        layer.set_rate(rate)
        r, ys = rate_now()
        if rate == 0.0:
            np.testing.assert_array_equal(ys, np.broadcast_to(x, ys.shape))
        else:
            assert r == pytest.approx(rate, abs=0.05)
            # unbiased at the new rate: E[y] = x
            assert (ys / x).mean() == pytest.approx(1.0, abs=0.06)
        assert layer.rate == rate and float(layer.rate_var.numpy()) == \
            pytest.approx(rate)
    assert len(traces) == 1
    # assigning the attribute does the same
    layer.rate = 0.3
    assert layer.get_config()["rate"] == 0.3
    with pytest.raises(ValueError, match="rate"):
        layer.set_rate(1.0)
    with pytest.raises(ValueError, match="rate"):
        layer.set_rate(float("nan"))
    assert layer.rate == 0.3


def test_set_rate_from_zero_and_the_config_round_trip(tmp_path):
    model = keras.Sequential([
        keras.Input((32,)),
        tfss.ApproximateRandomDropout(0.0, seed=2, name="ard"),
        tfss.SparseSplitDense(4)])
    layer = model.get_layer("ard")
    x = _positive((8, 32))
    step = tf.function(lambda: layer(x, training=True))
    np.testing.assert_array_equal(step().numpy(), x)
    layer.set_rate(0.4)
    assert (step().numpy() == 0).any()
    cfg = layer.get_config()
    assert cfg["rate"] == 0.4
    assert cfg["probabilities"] == [list(p) for p in
                                    layer.pattern_probabilities()]
    ref = tfss.search_pattern_distribution(0.4, 32, max_period=4, seed=2)
    assert [tuple(p[:2]) for p in cfg["probabilities"]] == \
        list(ref.patterns)
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path).get_layer("ard")
    assert loaded.rate == 0.4
    assert loaded.pattern_probabilities() == layer.pattern_probabilities()
    # the layout of the saved weights is unchanged: no new Keras weights
    assert [w.name for w in model.get_layer("ard").weights] == \
        [w.name for w in keras.models.load_model(path).get_layer(
            "ard").weights]
