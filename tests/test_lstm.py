"""SparseSplitLSTM: equality with keras.layers.LSTM, its own training
loop (compacted and masked), when it compacts, the pattern masks' rates,
serialization, arguments."""

import numpy as np
import pytest
import tensorflow as tf
import keras

import tf_sparse_split as tfss
from tf_sparse_split.layers.lstm import (DEFAULT_PATTERN_GROUPS,
                                         DEFAULT_RECURRENT_GROUP_SHARE,
                                         DEFAULT_SUBSET_GROUPS,
                                         COMPACTION_MIN_ROWS,
                                         SparseSplitLSTMCell,
                                         compaction_pays,
                                         split_recurrent_rate)

pytestmark = pytest.mark.usefixtures("op_library")


def _pair(x_shape, units=16, **kwargs):
    ref = keras.layers.LSTM(units, **{k: v for k, v in kwargs.items()
                                      if k not in ("pattern", "tile_shape")})
    ours = tfss.SparseSplitLSTM(units, **kwargs)
    ref.build(x_shape)
    ours.build(x_shape)
    ours.set_weights(ref.get_weights())
    return ref, ours


def _run(layer, x, training):
    with tf.GradientTape() as tape:
        y = layer(x, training=training)
        if isinstance(y, (list, tuple)):
            y = tf.concat([tf.reshape(t, [-1]) for t in y], 0)
        loss = tf.reduce_sum(y * y)
    return y.numpy(), [g.numpy() for g in
                       tape.gradient(loss, layer.trainable_weights)]


@pytest.mark.parametrize("options,training", [
    ({}, True), ({"return_sequences": True}, False),
    ({"go_backwards": True, "return_state": True}, True),
])
def test_equals_keras_lstm_without_dropout(rng, options, training):
    """Without dropout: Keras' loop at inference (the same bits); in
    training (on CPUs) the layer's own loop, equal to float rounding."""
    x = tf.constant(rng.standard_normal((5, 7, 12)).astype("float32"))
    ref, ours = _pair(x.shape, **options)
    assert ours._use_own_loop(None, training) == training
    y_ref, g_ref = _run(ref, x, training)
    y, g = _run(ours, x, training)
    check = (lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5,
                                                     atol=1e-6)) \
        if training else np.testing.assert_array_equal
    check(y, y_ref)
    for a, b in zip(g, g_ref):
        check(a, b)


def test_without_dropout_other_activations_run_keras_loop(rng):
    """The own loop without dropout runs only with the fused gate math
    (tanh, sigmoid); other activations keep Keras' loop, bit for bit."""
    x = tf.constant(rng.standard_normal((5, 7, 12)).astype("float32"))
    ref, ours = _pair(x.shape, activation="relu")
    assert not ours._use_own_loop(None, True)
    y_ref, g_ref = _run(ref, x, True)
    y, g = _run(ours, x, True)
    np.testing.assert_array_equal(y, y_ref)
    for a, b in zip(g, g_ref):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("return_sequences", [False, True])
def test_pattern_random_equals_keras_lstm_with_seed(rng, return_sequences):
    x = tf.constant(rng.standard_normal((6, 5, 8)).astype("float32"))
    ref, ours = _pair(x.shape, dropout=0.3, recurrent_dropout=0.4, seed=7,
                      pattern="random", return_sequences=return_sequences)
    for _ in range(2):  # the seed generators advance identically
        y_ref, g_ref = _run(ref, x, True)
        y, g = _run(ours, x, True)
        np.testing.assert_array_equal(y, y_ref)
        for a, b in zip(g, g_ref):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("pattern,tile_shape,go_backwards,rates,groups,batch,"
                         "options", [
    ("row", None, False, (0.5, 0.5), 1, 5, {}),
    ("row", None, True, (0.0, 0.6), 1, 5, {}),
    ("row", None, False, (0.4, 0.0), 1, 5, {}),
    ("tile", (2, 4), True, (0.5, 0.5), 1, 5, {}),
    # groups: batch divisible, not divisible (padding), fewer examples than
    # groups, one rate only
    ("row", None, False, (0.5, 0.5), 4, 12, {}),
    ("row", None, True, (0.5, 0.5), 4, 13, {}),
    ("row", None, False, (0.5, 0.3), 8, 5, {}),
    ("row", None, True, (0.0, 0.6), 3, 7, {}),
    ("row", None, False, (0.4, 0.0), 4, 10, {}),
    # last state only, c not in the loss (no upstream gradient for it);
    # other activations: TensorFlow differentiates the loop instead of the
    # written-out backward pass
    ("row", None, False, (0.5, 0.5), 4, 9,
     {"return_sequences": False, "loss_on_c": False}),
    ("row", None, True, (0.5, 0.5), 4, 9,
     {"activation": "relu", "recurrent_activation": "hard_sigmoid"}),
    ("tile", (2, 4), False, (0.3, 0.5), 1, 6, {"activation": "softsign"}),
    # random unit subsets per group: one group, divisible, padded, one rate
    # only, rates whose count is not an integer, other activations
    ("subset", None, False, (0.5, 0.5), 1, 5, {}),
    ("subset", None, True, (0.5, 0.5), 4, 12, {}),
    ("subset", None, False, (0.3, 0.45), 4, 13, {}),
    ("subset", None, True, (0.0, 0.6), 3, 7, {}),
    ("subset", None, False, (0.4, 0.0), 8, 5, {}),
    ("subset", None, False, (0.5, 0.5), 4, 9,
     {"return_sequences": False, "loss_on_c": False}),
    ("subset", None, True, (0.5, 0.5), 4, 9,
     {"activation": "relu", "recurrent_activation": "hard_sigmoid"}),
    # recurrent_group_share: all by groups (no per-example factor), all
    # per example (nothing compacted), in between
    ("subset", None, False, (0.5, 0.5), 4, 13,
     {"recurrent_group_share": 1.0}),
    ("subset", None, True, (0.3, 0.5), 4, 9,
     {"recurrent_group_share": 0.0}),
    ("subset", None, True, (0.3, 0.6), 3, 7,
     {"recurrent_group_share": 0.3}),
    ("subset", None, False, (0.5, 0.5), 4, 9,
     {"recurrent_group_share": 0.5,
      "recurrent_activation": "hard_sigmoid"}),
])
@pytest.mark.parametrize("compaction", [True, False])
def test_own_loop_equals_masked_keras_loop(rng, pattern, tile_shape,
                                           go_backwards, rates, groups,
                                           batch, options, compaction):
    """The compacted products, and the full products times the masks, give
    the values (and gradients) of Keras' own loop run with the same pattern
    masks (per-group masks included)."""
    _compare_own_loop(rng, pattern, tile_shape, go_backwards, rates,
                      groups, batch, options, graph=False,
                      compaction=compaction)


@pytest.mark.parametrize("pattern,tile_shape,go_backwards,rates,groups,batch,"
                         "options", [
    ("row", None, True, (0.5, 0.5), 4, 13, {}),
    ("row", None, False, (0.4, 0.0), 4, 10, {}),
    ("tile", (2, 4), False, (0.5, 0.5), 1, 6, {}),
    ("row", None, False, (0.5, 0.5), 4, 9,
     {"return_sequences": False, "loss_on_c": False}),
    ("subset", None, True, (0.5, 0.3), 4, 13, {}),
    ("subset", None, False, (0.5, 0.5), 4, 13,
     {"recurrent_group_share": 1.0}),
])
@pytest.mark.parametrize("compaction", [True, False])
def test_own_loop_equals_masked_keras_loop_in_graph(
        rng, pattern, tile_shape, go_backwards, rates, groups, batch,
        options, compaction):
    """The same inside a tf.function (graph while loops, as in fit)."""
    _compare_own_loop(rng, pattern, tile_shape, go_backwards, rates,
                      groups, batch, options, graph=True,
                      compaction=compaction)


def test_own_loop_tf_gates_path(rng, monkeypatch):
    """The step math in TensorFlow ops (what runs when a GPU is visible)
    gives the same values and gradients as Keras' masked loop."""
    from tf_sparse_split.layers import _lstm_recurrence as rec
    monkeypatch.setattr(rec, "_gates_ops",
                        lambda: (rec._tf_gates, rec._tf_gates_grad))
    _compare_own_loop(rng, "row", None, True, (0.5, 0.5), 4, 13, {},
                      graph=True)
    _compare_own_loop(rng, "subset", None, False, (0.5, 0.5), 4, 13, {},
                      graph=True, compaction=False)
    _compare_own_loop(rng, "tile", (2, 4), False, (0.5, 0.5), 1, 6,
                      {}, graph=False)


def _compare_own_loop(rng, pattern, tile_shape, go_backwards, rates,
                      groups, batch, options, graph, compaction=True):
    x = tf.constant(rng.standard_normal((batch, 7, 12)).astype("float32"))
    options = dict(options)
    loss_on_c = options.pop("loss_on_c", True)
    options.setdefault("return_sequences", True)
    layer = tfss.SparseSplitLSTM(
        16, dropout=rates[0], recurrent_dropout=rates[1], seed=1,
        pattern=pattern, tile_shape=tile_shape, go_backwards=go_backwards,
        pattern_groups=groups, compaction=compaction, **options)
    layer.build(x.shape)
    assert layer._use_own_loop(None, True)
    state = [tf.constant(rng.standard_normal((batch, 16)).astype("float32"))
             for _ in range(2)]
    wrt = layer.trainable_weights + [x] + state

    def run():
        with tf.GradientTape(persistent=True) as tape:
            tape.watch([x] + state)
            layer._maybe_config_dropout_masks(layer.cell, x[:, 0, :], state)
            _, out, (h, c) = layer._own_loop(x, state)
            _, ref, (h_ref, c_ref) = keras.layers.LSTM.inner_loop(
                layer, x, state, None, training=True)
            if not options["return_sequences"]:
                ref = ref[:, -1:]
            loss = tf.reduce_sum(out * out)
            loss_ref = tf.reduce_sum(ref * ref)
            if loss_on_c:
                loss += tf.reduce_sum(c)
                loss_ref += tf.reduce_sum(c_ref)
        layer._maybe_reset_dropout_masks(layer.cell)
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, wrt)]
        grads_ref = [tf.convert_to_tensor(g)
                     for g in tape.gradient(loss_ref, wrt)]
        return (out, h, c), (ref, h_ref, c_ref), grads, grads_ref

    # autograph off: the loops are explicit tf.while_loops, and autograph
    # would convert the unbound Keras inner_loop call wrongly.
    ours, refs, grads, grads_ref = (
        tf.function(run, autograph=False) if graph else run)()
    assert layer._traced_compaction[2] == (
        compaction and pattern != "tile")
    steps = 7 if options["return_sequences"] else 1
    assert ours[0].shape == refs[0].shape == (batch, steps, 16)
    for a, b in zip(ours, refs):     # outputs, h, c
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-5)
    for a, b in zip(grads, grads_ref):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=2e-5)


@pytest.mark.parametrize("groups,batch", [(1, 4), (4, 10)])
def test_row_masks_rate_and_unbiased(groups, batch):
    """Every unit is dropped with the requested rate and E[mask] = 1 per
    unit in every group (kept values are rescaled by 1 / (1 - the group's
    realized rate)), so E[output] = input; a mask is constant over the
    examples of a group (whole units; example b is in group
    b // ceil(batch / groups)), groups draw their own offsets of one
    pattern per batch, so they keep the same number of units (+-1)."""
    rate, units, draws, dim = 0.5, 24, 3000, 20
    cell = SparseSplitLSTMCell(units, dropout=rate, recurrent_dropout=0.3,
                               seed=3, pattern="row", pattern_groups=groups)
    cell.build((None, dim))
    dist = cell.pattern_distribution("input")
    np.testing.assert_allclose(dist.per_unit_drop_probability(), rate,
                               atol=1e-9)
    step = tf.ones((batch, dim))

    @tf.function
    def draw_many():
        ta = tf.TensorArray(tf.float32, size=draws)
        for i in tf.range(draws):
            ta = ta.write(i, cell._pattern_mask("input", step)[0])
        return ta.stack()

    masks = draw_many().numpy()                   # [draws, batch or 1, dim]
    rows = -(-batch // groups)
    starts = list(range(0, batch, rows))
    assert masks.shape[1] == (1 if groups == 1 else batch)
    for b in range(masks.shape[1]):               # constant within a group
        np.testing.assert_array_equal(masks[:, b], masks[:, b // rows * rows])
    g_masks = masks[:, starts if groups > 1 else [0]]   # [draws, G', dim]
    drop = (g_masks == 0).mean(axis=0)
    np.testing.assert_allclose(drop, rate, atol=0.05)
    np.testing.assert_allclose(g_masks.mean(axis=0), 1.0, atol=0.08)
    kept = (g_masks > 0).sum(axis=2)                     # [draws, G']
    for d in range(0, draws, 97):
        for g in range(g_masks.shape[1]):
            np.testing.assert_allclose(g_masks[d, g][g_masks[d, g] > 0],
                                       dim / kept[d, g], rtol=1e-6)
    assert (kept.max(axis=1) - kept.min(axis=1)).max() <= 1
    if groups > 1:   # the groups' masks differ in most draws
        differ = [len({m.tobytes() for m in g_masks[d]}) > 1
                  for d in range(draws)]
        assert np.mean(differ) > 0.5
    rmask = cell._pattern_mask("recurrent", tf.ones((batch, units)))[0]
    rmask = rmask.numpy()
    assert rmask.shape == (1 if groups == 1 else batch, units)
    kept = rmask[0] > 0
    np.testing.assert_allclose(rmask[0, kept], units / kept.sum(), rtol=1e-6)


@pytest.mark.parametrize("groups,batch,rates", [(1, 4, (0.5, 0.3)),
                                                (4, 10, (0.5, 0.5)),
                                                (3, 9, (0.3, 0.45))])
def test_subset_masks_rate_and_unbiased(groups, batch, rates):
    """pattern="subset" (the default): the recurrent mask drops every unit
    of every group with the requested rate, E[mask] = 1 per unit and group
    (kept values scaled by units / kept), is constant within a group, all
    groups of a batch keep the same number of units (the compacted products
    stay rectangular), the groups' subsets differ and are balanced (each
    unit dropped by rate * groups of them, +-1); the input mask is drawn per
    example and unit (values 0 or 1 / (1 - rate)), as Keras' is."""
    units, draws, dim = 24, 3000, 20
    cell = SparseSplitLSTMCell(units, dropout=rates[0],
                               recurrent_dropout=rates[1], seed=3,
                               pattern_groups=groups,
                               recurrent_group_share=1.0)
    assert cell.pattern == "subset"
    cell.build((None, dim))
    assert cell.pattern_distribution("input") is None
    rows = -(-batch // groups)
    starts = list(range(0, batch, rows))
    masks = {}
    for which, width in (("input", dim), ("recurrent", units)):
        step = tf.ones((batch, width))

        @tf.function
        def draw_many():
            ta = tf.TensorArray(tf.float32, size=draws)
            for i in tf.range(draws):
                ta = ta.write(i, cell._pattern_mask(which, step)[0])
            return ta.stack()

        masks[which] = draw_many().numpy()   # [draws, batch or 1, width]

    m = masks["input"]
    assert m.shape == (draws, batch, dim)
    np.testing.assert_allclose(np.unique(m), [0.0, 1.0 / (1 - rates[0])],
                               rtol=1e-6)
    np.testing.assert_allclose((m == 0).mean(axis=0), rates[0], atol=0.05)
    np.testing.assert_allclose(m.mean(axis=0), 1.0, atol=0.1)
    assert (m[:, 0] != m[:, 1]).any(axis=1).mean() > 0.9   # per example

    m, rate = masks["recurrent"], rates[1]
    assert m.shape == (draws, 1 if groups == 1 else batch, units)
    for b in range(m.shape[1]):                 # constant within a group
        np.testing.assert_array_equal(m[:, b], m[:, b // rows * rows])
    g_masks = m[:, starts if groups > 1 else [0]]        # [draws, G', U]
    np.testing.assert_allclose((g_masks == 0).mean(axis=0), rate, atol=0.05)
    np.testing.assert_allclose(g_masks.mean(axis=0), 1.0, atol=0.08)
    kept = (g_masks > 0).sum(axis=2)                     # [draws, G']
    assert (kept == kept[:, :1]).all()
    lo = int(np.floor(rate * units))
    assert set(np.unique(units - kept)) <= {lo, lo + 1}
    np.testing.assert_allclose(
        (g_masks * (kept / units)[:, :, None])[g_masks > 0], 1.0, rtol=1e-6)
    if groups > 1:
        dropped_by = (g_masks == 0).sum(axis=1)          # [draws, U]
        n = units - kept[:, :1]
        assert (np.abs(dropped_by - n * groups / units) <= 1.0 + 1e-9).all()
        differ = [len({x.tobytes() for x in g_masks[d]}) > 1
                  for d in range(draws)]
        assert np.mean(differ) > 0.9


@pytest.mark.parametrize("share,groups,batch", [(0.5, 4, 12), (0.3, 3, 9),
                                                (0.0, 2, 6)])
def test_subset_group_share_masks_rate_and_unbiased(share, groups, batch):
    """recurrent_group_share < 1: the recurrent mask is a group subset mask
    at rate r_g (1 - r_g = (1 - rate) ** share; constant within a group,
    same kept count in every group) times a per-example mask at rate r_e
    ((1 - r_g)(1 - r_e) = 1 - rate): every unit of every example is dropped
    with the requested rate, E[mask] = 1, kept values are units / kept
    times 1 / (1 - r_e), and examples of a group differ."""
    rate, units, draws = 0.5, 24, 3000
    g_rate, e_rate = split_recurrent_rate(rate, share)
    np.testing.assert_allclose((1 - g_rate) * (1 - e_rate), 1 - rate)
    np.testing.assert_allclose(1 - g_rate, (1 - rate) ** share)
    cell = SparseSplitLSTMCell(units, recurrent_dropout=rate, seed=5,
                               pattern_groups=groups,
                               recurrent_group_share=share)
    cell.build((None, 8))
    step = tf.ones((batch, units))

    @tf.function
    def draw_many():
        ta, tg = (tf.TensorArray(tf.float32, size=draws) for _ in range(2))
        for i in tf.range(draws):
            cell.reset_recurrent_dropout_mask()
            ta = ta.write(i, cell.get_recurrent_dropout_mask(step)[0])
            parts = cell._recurrent_parts
            tg = tg.write(i, step if parts is None else parts[0])
        return ta.stack(), tg.stack()

    m, g = (t.numpy() for t in draw_many())     # [draws, batch, U]
    assert m.shape == (draws, batch, units)
    np.testing.assert_allclose((m == 0).mean(axis=0), rate, atol=0.05)
    np.testing.assert_allclose(m.mean(axis=0), 1.0, atol=0.1)
    rows = -(-batch // groups)
    if share > 0:
        for b in range(batch):                  # group factor per group
            np.testing.assert_array_equal(g[:, b], g[:, b // rows * rows])
        np.testing.assert_allclose((g == 0).mean(axis=(0, 1)), g_rate,
                                   atol=0.05)
        kept = (g[:, ::rows] > 0).sum(axis=2)   # same count in every group
        assert (kept == kept[:, :1]).all()
        # the per-example factor only drops among the group's kept units
        assert (m[g == 0] == 0).all()
        np.testing.assert_allclose(
            m[m > 0] / g[m > 0], 1.0 / (1.0 - e_rate), rtol=1e-6)
    else:
        np.testing.assert_allclose(np.unique(m), [0.0, 2.0], rtol=1e-6)
    assert (m[:, 0] != m[:, 1]).any(axis=1).mean() > 0.9   # per example


def test_training_fit_and_keras_round_trip(rng, tmp_path):
    x = rng.standard_normal((16, 6, 8)).astype("float32")
    y = rng.integers(0, 3, 16)
    model = keras.Sequential([
        keras.Input((6, 8)),
        tfss.SparseSplitLSTM(12, dropout=0.5, recurrent_dropout=0.5, seed=0,
                             pattern_groups=3, name="lstm"),
        keras.layers.Dense(3, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy", jit_compile=False)
    before = model.get_layer("lstm").get_weights()[1].copy()
    model.fit(x, y, epochs=2, batch_size=8, verbose=0)
    assert not np.allclose(before, model.get_layer("lstm").get_weights()[1])
    path = tmp_path / "lstm.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    layer = loaded.get_layer("lstm")
    assert isinstance(layer, tfss.SparseSplitLSTM)
    assert layer.get_config() == model.get_layer("lstm").get_config()
    assert layer.pattern == "subset" and layer.dropout == 0.5
    assert layer.get_config()["pattern_groups"] == 3
    assert layer.get_config()["recurrent_group_share"] == \
        DEFAULT_RECURRENT_GROUP_SHARE
    assert tfss.SparseSplitLSTM(8).get_config()["pattern_groups"] == \
        DEFAULT_SUBSET_GROUPS
    assert tfss.SparseSplitLSTM(8, pattern="row").get_config()[
        "pattern_groups"] == DEFAULT_PATTERN_GROUPS
    np.testing.assert_array_equal(model.predict(x, verbose=0),
                                  loaded.predict(x, verbose=0))
    cfg = tfss.SparseSplitLSTM(8, pattern="tile", tile_shape=(4, 4),
                               recurrent_dropout=0.5).get_config()
    assert tfss.SparseSplitLSTM.from_config(cfg).get_config() == cfg
    assert cfg["pattern_groups"] == 1
    keras_cfg = keras.layers.LSTM(8).get_config()
    assert set(keras_cfg) <= set(cfg)   # same arguments, plus the pattern


def test_saved_row_pattern_configs_load_with_their_values(rng, tmp_path):
    """A config that stores ``pattern="row"`` (and its groups and period),
    as every saved ``SparseSplitLSTM`` config stores its pattern, loads
    with those values and draws periodic row patterns, not the default
    subsets."""
    old = {**keras.layers.LSTM(8, dropout=0.5, recurrent_dropout=0.5,
                               seed=2).get_config(),
           "pattern": "row", "tile_shape": None, "max_period": 4,
           "pattern_groups": 8}
    layer = tfss.SparseSplitLSTM.from_config(old)
    assert layer.pattern == "row" and layer.cell.pattern_groups == 8
    assert layer.get_config() == {**old, "name": layer.name,
                                  "recurrent_group_share": 1.0,
                                  "compaction": "auto"}
    model = keras.Sequential([keras.Input((5, 6)), layer])
    path = tmp_path / "row.keras"
    model.save(path)
    loaded = keras.models.load_model(path).layers[0]
    assert loaded.get_config() == layer.get_config()
    dist = loaded.cell.pattern_distribution("recurrent")
    assert dist is not None and ("drop", 2) in dist.patterns
    x = tf.constant(rng.standard_normal((4, 5, 6)).astype("float32"))
    np.testing.assert_array_equal(model(x).numpy(), loaded(x).numpy())
    mask = loaded.cell._pattern_mask("recurrent", tf.ones((16, 8)))[0]
    kept = mask.numpy()[::2] > 0           # groups of 2 examples
    for g in kept:   # periodic: the dropped or the kept units equidistant
        assert any(len(set(np.diff(np.flatnonzero(v)))) <= 1
                   for v in (g, ~g))


def test_saved_subset_configs_without_group_share_load_as_saved(rng):
    """A saved subset config without ``recurrent_group_share`` (all of the
    recurrent dropout by group subsets) loads with share 1.0, i.e. masks
    constant within each group; new layers default to
    DEFAULT_RECURRENT_GROUP_SHARE."""
    new = tfss.SparseSplitLSTM(8, dropout=0.5, recurrent_dropout=0.5,
                               seed=2, pattern_groups=4)
    assert new.cell.recurrent_group_share == DEFAULT_RECURRENT_GROUP_SHARE
    cfg = new.get_config()
    assert cfg["recurrent_group_share"] == DEFAULT_RECURRENT_GROUP_SHARE
    assert tfss.SparseSplitLSTM.from_config(cfg).get_config() == cfg
    old = {k: v for k, v in cfg.items() if k != "recurrent_group_share"}
    layer = tfss.SparseSplitLSTM.from_config(old)
    assert layer.cell.recurrent_group_share == 1.0
    layer.build((None, 5, 6))
    mask = layer.cell.get_recurrent_dropout_mask(tf.ones((8, 8)))[0]
    mask = mask.numpy()
    for b in range(8):                          # groups of 2 examples
        np.testing.assert_array_equal(mask[b], mask[b // 2 * 2])
    cell_cfg = {k: v for k, v in layer.cell.get_config().items()
                if k != "recurrent_group_share"}
    assert SparseSplitLSTMCell.from_config(
        cell_cfg).recurrent_group_share == 1.0


@pytest.mark.parametrize("kwargs,match", [
    ({"pattern": "block"}, "pattern"),
    ({"recurrent_group_share": 1.5}, "recurrent_group_share"),
    ({"recurrent_group_share": -0.1}, "recurrent_group_share"),
    ({"recurrent_group_share": "half"}, "recurrent_group_share"),
    ({"pattern": "row", "recurrent_group_share": 0.5},
     "recurrent_group_share"),
    ({"tile_shape": (4, 4)}, "tile_shape"),
    ({"pattern": "tile", "tile_shape": (0, 4)}, "tile_shape"),
    ({"max_period": 1}, "max_period"),
    ({"use_cudnn": "yes"}, "use_cudnn"),
    ({"pattern_groups": 0}, "pattern_groups"),
    ({"pattern_groups": 2.5}, "pattern_groups"),
    ({"pattern_groups": True}, "pattern_groups"),
    ({"pattern": "tile", "pattern_groups": 2}, "pattern_groups"),
    ({"pattern": "random", "pattern_groups": 4}, "pattern_groups"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tfss.SparseSplitLSTM(8, **kwargs)


def test_tile_not_dividing_is_reported_at_build():
    layer = tfss.SparseSplitLSTM(8, dropout=0.5, pattern="tile",
                                 tile_shape=(4, 5))
    with pytest.raises(ValueError, match="does not divide"):
        layer.build((None, 3, 12))


@pytest.mark.parametrize("features,units,input_tile,recurrent_tile", [
    (8, 128, 4, 32), (28, 128, 14, 32), (12, 20, 6, 10), (64, 96, 32, 32)])
def test_default_tile_fits_each_mask(features, units, input_tile,
                                     recurrent_tile):
    # Without a tile_shape, each mask gets (32, w), w the largest divisor
    # of its width up to 32 leaving two tiles across, so pattern="tile"
    # trains on 8 or 28 input features, where one (32, 32) tile for both
    # masks could not fit.
    batch = 64
    cell = SparseSplitLSTMCell(units, dropout=0.5, recurrent_dropout=0.5,
                               pattern="tile", seed=3)
    cell.build((None, features))
    assert cell.get_config()["tile_shape"] is None
    for which, width, tu in (("input", features, input_tile),
                             ("recurrent", units, recurrent_tile)):
        assert cell._tile(which) == (32, tu)
        m = cell._pattern_mask(which, tf.ones((batch, width)))
        m = tf.broadcast_to(m[0] if isinstance(m, list) else m,
                            (batch, width)).numpy()
        # constant within every 32 x tu tile, and some tiles dropped
        blocks = m.reshape(batch // 32, 32, width // tu, tu)
        assert (blocks == blocks[:, :1, :, :1]).all()
        assert 0 < (m == 0).mean() < 1
    layer = tfss.SparseSplitLSTM(units, dropout=0.5, recurrent_dropout=0.5,
                                 pattern="tile", seed=3)
    model = keras.Sequential([keras.Input((5, features)), layer,
                              keras.layers.Dense(3)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    x = np.random.default_rng(0).random((batch, 5, features),
                                        dtype=np.float32)
    loss = model.train_on_batch(x, np.arange(batch) % 3)
    assert np.isfinite(loss)
    cfg = layer.get_config()
    assert tfss.SparseSplitLSTM.from_config(cfg).get_config() == cfg


@pytest.mark.parametrize("groups", [1, 8])
def test_empty_batch_in_training_matches_keras(groups):
    # An empty batch (e.g. the last shard of a split) trains like Keras'
    # layer: empty outputs, zero-size gradients, no error.
    layer = tfss.SparseSplitLSTM(8, dropout=0.5, recurrent_dropout=0.5,
                                 return_sequences=True, pattern_groups=groups)
    ref = keras.layers.LSTM(8, dropout=0.5, recurrent_dropout=0.5,
                            return_sequences=True)
    x = tf.zeros((0, 6, 3))
    assert ref(x, training=True).shape == (0, 6, 8)
    with tf.GradientTape() as tape:
        y = layer(x, training=True)
        loss = tf.reduce_sum(y)
    assert y.shape == (0, 6, 8)
    grads = tape.gradient(loss, layer.trainable_weights)
    for g, w in zip(grads, layer.trainable_weights):
        assert g is not None
        g = tf.convert_to_tensor(g)           # IndexedSlices from gathers
        assert g.shape == w.shape
        np.testing.assert_array_equal(g.numpy(), 0.0)


# ---------------------------------------------------------------------------
# rates as variables (set_rates between steps, no retracing)
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("pattern,share", [("subset", None), ("subset", 1.0),
                                           ("row", None)])
def test_set_rates_moves_compiled_masks_without_retracing(pattern, share):
    units, dim, batch, draws = 24, 16, 8, 600
    cell = SparseSplitLSTMCell(units, dropout=0.3, recurrent_dropout=0.2,
                               seed=5, pattern=pattern,
                               recurrent_group_share=share)
    cell.build((None, dim))
    traces = []

    @tf.function
    def draw_many():
        traces.append(1)
        out = []
        for which, width in (("input", dim), ("recurrent", units)):
            step = tf.ones((batch, width))
            ta = tf.TensorArray(tf.float32, size=draws)
            for i in tf.range(draws):
                m = cell._pattern_mask(which, step)
                ta = ta.write(i, tf.broadcast_to(
                    m[0] if isinstance(m, list) else m, (batch, width)))
            out.append(ta.stack())
        return out

    for rates in ((0.3, 0.2), (0.5, 0.6), (0.1, 0.4)):
        assert cell.set_rates(*rates) is False
        assert (cell.dropout, cell.recurrent_dropout) == rates
        for rate, m in zip(rates, draw_many()):
            m = m.numpy()
            assert (m == 0).mean() == pytest.approx(rate, abs=0.04)
            assert m.mean() == pytest.approx(1.0, abs=0.05)   # unbiased
    assert len(traces) == 1
    assert cell.get_config()["recurrent_dropout"] == 0.4
    # to 0 and back: the traced step keeps its masks (identity at 0) ...
    assert cell.set_rates(recurrent_dropout=0.0) is False
    assert (draw_many()[1].numpy() == 1.0).all()
    assert cell.set_rates(recurrent_dropout=0.3) is False
    # ... but a rate raised from one that was 0 when the training step
    # was traced needs a retrace (the step has no mask for it).
    lstm = tfss.SparseSplitLSTM(units, recurrent_dropout=0.0, seed=5,
                                pattern=pattern)
    lstm(tf.ones((batch, 3, dim)), training=True)
    assert lstm.set_rates(recurrent_dropout=0.3) is True
    lstm(tf.ones((batch, 3, dim)), training=True)
    assert lstm.set_rates(recurrent_dropout=0.5) is False
    with pytest.raises(ValueError):
        cell.set_rates(dropout=1.0)


def test_set_rates_in_fit_keeps_the_layer_exact(rng, tmp_path):
    """A SparseSplitLSTM whose rates move between fits trains, saves and
    loads with the rates in force."""
    x = rng.standard_normal((32, 6, 5)).astype("float32")
    y = rng.integers(0, 3, 32)
    model = keras.Sequential([
        keras.Input((6, 5)),
        tfss.SparseSplitLSTM(12, dropout=0.2, recurrent_dropout=0.3, seed=1,
                             name="lstm"),
        keras.layers.Dense(3, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    lstm = model.get_layer("lstm")
    assert lstm.set_rates(dropout=0.1, recurrent_dropout=0.5) is False
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path).get_layer("lstm")
    assert (loaded.cell.dropout, loaded.cell.recurrent_dropout) == (0.1, 0.5)
    np.testing.assert_allclose(
        keras.models.load_model(path)(x).numpy(), model(x).numpy(),
        rtol=1e-5, atol=1e-6)


# Training steps of SparseSplitLSTM (fused gate ops, 28 input features,
# both rates 0.5, pattern "row", batch 256) on the 2-core Xeon, interleaved
# medians in ms: (steps, units, groups) -> (compacted, masked).
RECORDED_STEP_MS = {
    (8, 128, 1): (10.2, 10.8), (8, 128, 2): (11.1, 11.1),
    (8, 128, 4): (11.6, 11.0), (8, 128, 8): (13.5, 11.4),
    (8, 512, 1): (48.0, 69.7), (8, 512, 2): (53.6, 70.6),
    (8, 512, 4): (66.9, 72.0), (8, 512, 8): (90.2, 72.2),
    (28, 128, 1): (29.8, 35.6), (28, 128, 2): (33.7, 36.3),
    (28, 128, 4): (35.8, 36.7), (28, 128, 8): (39.0, 36.9),
    (28, 512, 1): (159.3, 233.3), (28, 512, 2): (165.9, 234.4),
    (28, 512, 4): (187.8, 233.5), (28, 512, 8): (224.6, 235.7),
}


def test_compaction_choice_on_recorded_step_times():
    """On recorded step times, the automatic choice never takes the path
    that ran more than 10% slower, and takes the faster one wherever the
    two differ by more than 10%."""
    for (steps, units, groups), (compacted, masked) in \
            RECORDED_STEP_MS.items():
        pays = compaction_pays(steps, 256, groups, 0.5)
        chosen, other = (compacted, masked) if pays else (masked, compacted)
        assert chosen <= 1.10 * other, (steps, units, groups, pays)


def test_compaction_pays_rule():
    assert not compaction_pays(8, 256, 8, 0.5)       # 8 * 32 = 256 rows
    assert compaction_pays(8, 256, 1, 0.5)           # 2048
    assert compaction_pays(8, 256, 8, 0.9)           # 256 * 9 = 2304
    assert not compaction_pays(8, 256, 1, 0.0)       # nothing dropped
    assert compaction_pays(None, 256, 8, 0.5)        # unknown sizes
    assert compaction_pays(8, None, 8, 0.5)
    # ceil(batch / G) rows per group (padded groups)
    assert compaction_pays(COMPACTION_MIN_ROWS // 2, 9, 8, 0.5)
    assert not compaction_pays(COMPACTION_MIN_ROWS // 2 - 1, 9, 8, 0.5)


@pytest.mark.parametrize("pattern,rates,groups,batch,steps,want", [
    ("row", (0.5, 0.5), 8, 256, 8, False),
    ("row", (0.5, 0.5), 1, 256, 8, True),
    ("row", (0.5, 0.0), 1, 256, 8, True),      # the input rate decides
    ("subset", (0.5, 0.5), 4, 256, 8, False),  # group rate 0.159
    ("subset", (0.0, 0.5), 1, 512, 28, True),
    ("subset", (0.5, 0.0), 1, 512, 28, False),  # input masks: per example
])
def test_automatic_compaction_follows_the_traced_sizes(
        rng, pattern, rates, groups, batch, steps, want):
    x = tf.constant(rng.standard_normal((batch, steps, 3)).astype("float32"))
    layer = tfss.SparseSplitLSTM(4, dropout=rates[0],
                                 recurrent_dropout=rates[1], seed=1,
                                 pattern=pattern, pattern_groups=groups)
    y = layer(x, training=True)
    assert y.shape == (batch, 4)
    assert layer._traced_compaction == (steps, batch, want)


def test_set_rates_asks_for_a_retrace_when_the_compaction_choice_changes(
        rng):
    x = tf.constant(rng.standard_normal((256, 8, 3)).astype("float32"))
    layer = tfss.SparseSplitLSTM(16, recurrent_dropout=0.5, seed=1,
                                 pattern="row", pattern_groups=8)
    layer(x, training=True)
    assert layer._traced_compaction[2] is False
    assert layer.set_rates(recurrent_dropout=0.6) is False  # 384 rows
    assert layer.set_rates(recurrent_dropout=0.9) is True   # 2304 rows
    layer(x, training=True)
    assert layer._traced_compaction[2] is True
    assert layer.set_rates(recurrent_dropout=0.85) is False
    fixed = tfss.SparseSplitLSTM(16, recurrent_dropout=0.5, seed=1,
                                 pattern="row", pattern_groups=8,
                                 compaction=False)
    fixed(x, training=True)
    assert fixed.set_rates(recurrent_dropout=0.9) is False


@pytest.mark.parametrize("bad", ["yes", 1, None, 0.5])
def test_compaction_argument_is_checked(bad):
    with pytest.raises(ValueError, match="compaction"):
        tfss.SparseSplitLSTM(4, compaction=bad)


@pytest.mark.parametrize("compaction", ["auto", True, False])
def test_compaction_round_trips_through_the_config(compaction):
    cfg = tfss.SparseSplitLSTM(4, compaction=compaction).get_config()
    assert cfg["compaction"] == compaction
    assert tfss.SparseSplitLSTM.from_config(cfg).compaction == compaction


@pytest.mark.parametrize("batch,pays", [(130, True), (5, False)])
def test_compaction_decided_per_call_when_the_batch_is_unknown(
        rng, batch, pays):
    """Traced with a None batch (as Keras' fit traces its step), the
    automatic choice is made per call from the run-time batch; both
    branches give the values and gradients of Keras' loop with the same
    masks."""
    layer = tfss.SparseSplitLSTM(16, dropout=0.5, recurrent_dropout=0.5,
                                 seed=1, pattern="row", pattern_groups=1,
                                 return_sequences=True)
    layer.build((None, 8, 6))
    spec = tf.TensorSpec((None, 8, 6), tf.float32)

    @tf.function(input_signature=[spec], autograph=False)
    def run(x):
        state = [tf.zeros([tf.shape(x)[0], 16])] * 2
        # One tape each, one after the other (the masks are drawn once and
        # held until the reset): a tape that records while another computes
        # or records the conditional's gradient would ask for a
        # second-order gradient, which the fused gate ops do not have.
        layer._maybe_config_dropout_masks(layer.cell, x[:, 0, :], state)
        with tf.GradientTape() as tape:
            tape.watch(x)
            _, out, _ = layer._own_loop(x, state)
            loss = tf.reduce_sum(out * out)
        with tf.GradientTape() as tape_ref:
            tape_ref.watch(x)
            _, ref, _ = keras.layers.LSTM.inner_loop(layer, x, state, None,
                                                     training=True)
            loss_ref = tf.reduce_sum(ref * ref)
        layer._maybe_reset_dropout_masks(layer.cell)
        wrt = layer.trainable_weights + [x]
        return (out, ref, [tf.convert_to_tensor(g)
                           for g in tape.gradient(loss, wrt)],
                [tf.convert_to_tensor(g)
                 for g in tape_ref.gradient(loss_ref, wrt)],
                layer._compaction_pays_now(x))

    x = tf.constant(rng.standard_normal((batch, 8, 6)).astype("float32"))
    out, ref, grads, grads_ref, chose = run(x)
    assert layer._traced_compaction == (8, None, None)
    assert bool(chose) == pays == compaction_pays(8, batch, 1, 0.5)
    np.testing.assert_allclose(out.numpy(), ref.numpy(), atol=1e-5)
    for a, b in zip(grads, grads_ref):   # sums over up to 130 x 8 terms
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5,
                                   atol=2e-5)


def test_fit_with_a_partial_batch_traces_the_per_call_choice(rng):
    x = rng.standard_normal((70, 5, 3)).astype("float32")
    y = rng.integers(0, 2, 70)
    lstm = tfss.SparseSplitLSTM(8, dropout=0.3, recurrent_dropout=0.3,
                                seed=1, pattern="row")
    model = keras.Sequential([keras.Input((5, 3)), lstm,
                              keras.layers.Dense(2)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    hist = model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    assert np.all(np.isfinite(hist.history["loss"]))
    assert lstm._traced_compaction == (5, None, None)
