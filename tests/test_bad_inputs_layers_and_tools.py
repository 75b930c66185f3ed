"""Bad inputs to the layers, the op wrappers' flags, model conversion, the
rewrite switch, the command line's parsers and ``fit_latency_budget``
that were accepted and gave a wrong or NaN answer, or failed with an
error that did not name the argument. Each must raise a clear
``ValueError`` / ``TypeError`` / ``InvalidArgumentError`` naming it."""

import argparse
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sparse_split as tfss
from tf_sparse_split import rewrite
from tf_sparse_split.ops.fat_relu import bias_fat_relu
from tf_sparse_split.ops.sddmm import sparse_split_sddmm
from tf_sparse_split.tools import cli


def _sparse(rng, *shape):
    a = rng.standard_normal(shape).astype(np.float32)
    a[rng.random(shape) < 0.6] = 0.0             # real zeros, not all zero
    return a


# -- op wrappers -------------------------------------------------------------
@pytest.mark.usefixtures("op_library")
@pytest.mark.parametrize("flag", ["no", "yes", 1, None])
def test_sddmm_transpose_b_must_be_a_bool(flag):
    """``bool("no")`` is True: a square ``b`` was transposed silently."""
    rng = np.random.default_rng(0)
    mask, x, b = _sparse(rng, 6, 5), _sparse(rng, 6, 5), _sparse(rng, 5, 5)
    with pytest.raises(TypeError, match="transpose_b"):
        sparse_split_sddmm(mask, x, b, transpose_b=flag)
    want = (mask != 0) * (x.astype(np.float64) @ b.astype(np.float64).T)
    for tb in (True, np.bool_(True)):
        np.testing.assert_allclose(
            sparse_split_sddmm(mask, x, b.T.copy(), transpose_b=tb), want,
            rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("op_library")
@pytest.mark.parametrize("cutoff", [-1.0, float("nan"), np.float32(-0.5),
                                    True, "0.1", [0.1, 0.2],
                                    tf.constant(-1.0), tf.constant([0.1]),
                                    tf.constant("x")],
                         ids=["negative", "nan", "np-negative", "bool",
                              "string", "list", "tensor-negative",
                              "tensor-vector", "tensor-string"])
def test_bias_fat_relu_names_cutoff(cutoff):
    """The kernel's message names the op's input ``threshold``; the wrapper
    checks ``cutoff`` under its own name first."""
    rng = np.random.default_rng(1)
    x, b = _sparse(rng, 4, 6), np.zeros(6, np.float32)
    with pytest.raises(tf.errors.InvalidArgumentError, match="cutoff"):
        bias_fat_relu(x, b, cutoff)


@pytest.mark.usefixtures("op_library")
@pytest.mark.parametrize("cutoff", [0.25, np.float64(0.25), 0,
                                    tf.constant(0.25), tf.Variable(0.25)])
def test_bias_fat_relu_good_cutoffs(cutoff):
    rng = np.random.default_rng(2)
    x, b = _sparse(rng, 4, 6), rng.standard_normal(6).astype(np.float32)
    t = float(np.asarray(cutoff.numpy() if hasattr(cutoff, "numpy")
                         else cutoff))
    v = x.astype(np.float64) + b
    want = np.where(v > t, v, 0.0)
    y, s = bias_fat_relu(x, b, cutoff)
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(s, want.sum(), rtol=1e-5)

    @tf.function
    def g(c):       # a symbolic cutoff: checked by the kernel at run time
        return bias_fat_relu(x, b, c)[0]

    np.testing.assert_allclose(g(tf.constant(t)), want, rtol=1e-6, atol=1e-6)


# -- layers ------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, name", [
    (dict(dropout=1.0), "dropout"),                # gave NaN outputs
    (dict(recurrent_dropout=1.0), "recurrent_dropout"),
    (dict(dropout=float("nan")), "dropout"),       # Keras made it 0
    (dict(dropout=-0.1), "dropout"),
    (dict(recurrent_dropout=True), "recurrent_dropout"),   # Keras: 1.0
    (dict(dropout="half"), "dropout"),
])
@pytest.mark.parametrize("pattern", ["subset", "row", "random"])
def test_lstm_rates_outside_0_1_are_refused(kwargs, name, pattern):
    with pytest.raises(ValueError, match=f"`{name}`"):
        tfss.SparseSplitLSTM(4, pattern=pattern, **kwargs)


def test_lstm_good_rates_are_kept():
    layer = tfss.SparseSplitLSTM(4, dropout=0.3, recurrent_dropout=0.0)
    assert layer.cell.dropout == 0.3 and layer.cell.recurrent_dropout == 0.0
    y = layer(np.random.default_rng(3).random((4, 3, 2), np.float32),
              training=True)
    assert np.isfinite(y.numpy()).all()


def test_lstm_inputs_with_no_features():
    """The own loop's bias column (``ones_like(x[..., :1])``) was
    empty for 0 features: a BatchMatMul shape error, where
    ``keras.layers.LSTM`` runs (its output is then the bias' alone)."""
    x = np.zeros((4, 3, 0), np.float32)
    layer = tfss.SparseSplitLSTM(8, dropout=0.5, recurrent_dropout=0.5)
    ref = keras.layers.LSTM(8)
    layer(x, training=True)
    ref(x)
    layer.set_weights([np.asarray(w) for w in ref.get_weights()])
    bias = np.random.default_rng(6).standard_normal(32).astype(np.float32)
    layer.cell.bias.assign(bias)
    ref.cell.bias.assign(bias)
    # Recurrent dropout: compare with Keras' masks off, same realised
    # state (zero input, so only the bias and the recurrence act).
    got = layer(x, training=True)
    assert got.shape == (4, 8) and np.isfinite(got.numpy()).all()
    np.testing.assert_allclose(layer(x, training=False), ref(x), rtol=1e-6,
                               atol=1e-6)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(x, training=True))
    grads = tape.gradient(loss, layer.trainable_variables)
    assert [tuple(g.shape) for g in grads] == [(0, 32), (8, 32), (32,)]


def test_approximate_random_dropout_rank_1_input():
    layer = tfss.ApproximateRandomDropout(0.5)
    with pytest.raises(ValueError, match="rank >= 2"):
        layer(np.ones(8, np.float32), training=True)


@pytest.mark.parametrize("probabilities, match", [
    ([["drop", 2, float("inf")], ["keep", 2, 1.0]], "finite"),  # -> NaN
    ([["drop", 2, "x"]], "probability"),
    ("drop", "triples"),
    ([["drop", 2]], "triples"),
    ([["drop", 2, 0.5, 1]], "triples"),
])
def test_approximate_random_dropout_bad_probabilities(probabilities, match):
    with pytest.raises(ValueError, match=match):
        tfss.ApproximateRandomDropout(0.5, probabilities=probabilities)


def test_approximate_random_dropout_given_probabilities_still_work():
    layer = tfss.ApproximateRandomDropout(
        0.5, probabilities=[["drop", 2, 3.0], ["keep", 2, 1.0]])
    layer(np.ones((4, 8), np.float32), training=True)
    probs = [p for _, _, p in layer.pattern_probabilities()]
    np.testing.assert_allclose(probs, [0.75, 0.25])


def test_tile_keep_mask_needs_batch_size():
    layer = tfss.ApproximateRandomDropout(0.5, pattern="tile",
                                          tile_shape=(2, 4))
    layer(np.ones((4, 8), np.float32), training=True)
    with pytest.raises(ValueError, match="batch_size"):
        layer.keep_mask()
    assert layer.keep_mask(4).shape == (4, 8)


# -- sparse_split_model ------------------------------------------------------
class _Sub(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d = keras.layers.Dense(3)

    def call(self, x):
        return self.d(x)


@pytest.mark.parametrize("convert", [tfss.sparse_split_model,
                                     tfss.strip_sparse_split])
def test_subclassed_model_nested_in_a_functional_one(convert):
    """Keras' clone failed with a long TypeError ("Unable to revive model
    from config"); the docs promise ValueError for subclassed models."""
    inp = keras.Input((6,))
    model = keras.Model(inp, keras.layers.Dense(2)(_Sub()(inp)))
    with pytest.raises(ValueError, match="subclassed"):
        convert(model)


def test_unbuilt_model_is_refused():
    """The docs promise ValueError; an unbuilt copy came back silently."""
    with pytest.raises(ValueError, match="not built"):
        tfss.sparse_split_model(keras.Sequential([keras.layers.Dense(3)]))


def test_layer_filter_with_an_unknown_name():
    """A misspelt name converted nothing, silently."""
    inner = keras.Sequential([keras.Input((6,)),
                              keras.layers.Dense(5, name="inner_d")])
    inp = keras.Input((6,))
    model = keras.Model(inp, keras.layers.Dense(2, name="outer_d")(inner(inp)))
    with pytest.raises(ValueError, match="inner_x"):
        tfss.sparse_split_model(model, layer_filter=["outer_d", "inner_x"])
    split = tfss.sparse_split_model(model, layer_filter=["inner_d"])
    kinds = {l.name: type(l).__name__ for l in split._flatten_layers()}
    assert kinds["inner_d"] == "SparseSplitDense"
    assert kinds["outer_d"] == "Dense"


# -- rewrite.enable / dry_run ------------------------------------------------
@pytest.mark.usefixtures("op_library")
@pytest.mark.parametrize("kwargs, match", [
    (dict(min_flops=True), "min_flops"),
    (dict(min_flops="10"), "min_flops"),
    (dict(ops=None), "ops"),
    (dict(ops=5), "ops"),
    (dict(producers=None), "producers"),
    (dict(producers=3), "producers"),
    (dict(producers=["Re\tlu"]), "producers"),
])
def test_rewrite_enable_bad_arguments(kwargs, match):
    before = rewrite.config()
    with pytest.raises(ValueError, match=match):
        rewrite.enable(**kwargs)
    assert rewrite.config() == before and not rewrite.is_enabled()
    with pytest.raises(ValueError, match=match):
        rewrite.dry_run(tf.Graph(), **kwargs)


# -- command line ------------------------------------------------------------
def test_cli_lr_must_be_finite(run_cli):
    with pytest.raises(argparse.ArgumentTypeError, match="finite"):
        cli.parse_positive_float("inf")
    assert cli.parse_positive_float("0.01") == 0.01
    assert run_cli(["train", "--lr", "inf"])[0] == 2


def test_cli_seed_fits_32_bits(run_cli):
    assert cli.parse_seed(str(2**32 - 1)) == 2**32 - 1
    with pytest.raises(argparse.ArgumentTypeError, match="2\\*\\*32"):
        cli.parse_seed(str(2**32))
    assert run_cli(["train", "--seed", "99999999999999999999"])[0] == 2
    assert run_cli(["profile", "m.keras", "--seed", str(2**40)])[0] == 2


def test_cli_output_dir_that_cannot_be_created(tmp_path, monkeypatch):
    """The permission bits passed (root on /proc); creation failed after
    training had started."""
    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", path)

    target = tmp_path / "a" / "b"
    monkeypatch.setattr(os, "makedirs", refuse)
    problem = cli._writable_dir_problem(str(target))
    assert problem and "cannot be created" in problem
    monkeypatch.undo()
    assert cli._writable_dir_problem(str(target)) is None
    assert not (tmp_path / "a").exists()       # the probe leaves nothing


# -- fit_latency_budget ------------------------------------------------------
def _split_mlp():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)),
                              keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(3)])
    return tfss.sparse_split_model(model)


@pytest.mark.usefixtures("op_library")
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_fit_latency_budget_non_finite_sample(bad):
    model = _split_mlp()
    x = np.random.default_rng(4).standard_normal((8, 8)).astype(np.float32)
    x[0, 0] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        tfss.fit_latency_budget(model, 1e-9, x, rounds=1, warmup=1)


@pytest.mark.usefixtures("op_library")
@pytest.mark.parametrize("levels", ["0.5", None, 0.5, [0.5, "x"]])
def test_fit_latency_budget_levels_not_a_sequence(levels):
    model = _split_mlp()
    x = np.random.default_rng(5).standard_normal((8, 8)).astype(np.float32)
    with pytest.raises(ValueError, match="levels"):
        tfss.fit_latency_budget(model, 1.0, x, levels=levels, rounds=1,
                                warmup=1)


@pytest.mark.usefixtures("op_library")
def test_fit_latency_budget_labels_must_be_class_indices():
    """Float labels of the input's shape failed deep inside with "cannot
    reshape array of size ..."."""
    model = _split_mlp()
    x = np.random.default_rng(7).standard_normal((8, 8)).astype(np.float32)
    for y in (x, np.zeros(8, np.float32), np.zeros((8, 2), np.int64)):
        with pytest.raises(ValueError, match="labels"):
            tfss.fit_latency_budget(model, 1.0, x, accuracy_data=(x, y),
                                    rounds=1, warmup=1)


@pytest.mark.usefixtures("op_library")
@pytest.mark.parametrize("array, match", [
    (np.ones((4, 8), np.int64), "dtype int64"),       # a graph error before
    (np.zeros((0, 8), np.float32), "no examples"),    # timed nothing
])
def test_profile_input_that_is_not_float_examples(tmp_path, run_cli, array,
                                                  match):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)),
                              keras.layers.Dense(4, activation="relu"),
                              keras.layers.Dense(2)])
    model.save(tmp_path / "m.keras")
    np.save(tmp_path / "x.npy", array)
    rc, _, err = run_cli(["profile", str(tmp_path / "m.keras"), "--input",
                          str(tmp_path / "x.npy"), "--repeats", "1"])
    assert rc == 1 and match in err, err


def test_cli_tensorflow_runtime_error_is_one_line(run_cli, monkeypatch):
    """``train --hidden 2000000000`` ended in a ResourceExhaustedError
    traceback; TensorFlow's run-time errors now end the run with one
    line and exit code 1."""
    from tf_sparse_split.tools import train

    def oom(args, out):
        raise tf.errors.ResourceExhaustedError(
            None, None, "OOM when allocating tensor with shape[64,2000000000]")

    monkeypatch.setattr(train, "train_command", oom)
    rc, _, err = run_cli(["train", "--epochs", "1"])
    assert rc == 1
    assert err.strip().splitlines() == [
        "tf-sparse-split: error: ResourceExhaustedError: OOM when allocating "
        "tensor with shape[64,2000000000]"]


@pytest.mark.usefixtures("op_library")
@pytest.mark.parametrize("call, name", [
    (lambda a, b: tfss.sparse_split_matmul(None, b), "a"),
    (lambda a, b: tfss.sparse_split_matmul(a, None), "b"),
    (lambda a, b: sparse_split_sddmm(None, a, b), "mask"),
    (lambda a, b: sparse_split_sddmm(a, None, b), "x"),
    (lambda a, b: tfss.sparse_split_conv2d(None, b[None, None], 1, "SAME"),
     "input"),
    (lambda a, b: tfss.sparse_split_conv2d(a[None, None], None, 1, "SAME"),
     "filters"),
    (lambda a, b: bias_fat_relu(None, b[0], 0.1), "x"),
], ids=["matmul-a", "matmul-b", "sddmm-mask", "sddmm-x", "conv-input",
        "conv-filters", "fat-relu-x"])
def test_none_operand_names_the_argument(call, name):
    """``convert_to_tensor(None)``'s ValueError named no argument."""
    rng = np.random.default_rng(8)
    a, b = _sparse(rng, 4, 5), _sparse(rng, 5, 5)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=f"{name} must be a .*got None"):
        call(a, b)


def _masked_rates(patterns, num_columns):
    """The realized drop fraction per offset by an explicit mask."""
    j = np.arange(num_columns)
    out = []
    for kind, p in patterns:
        hit = (j[None, :] - np.arange(p)[:, None]) % p == 0
        out.append((hit if kind == "drop" else ~hit).mean(axis=1))
    return out


@pytest.mark.parametrize("columns, max_period", [
    (2, 2), (7, 8), (8, 8), (13, 40), (100, 64), (1000, 2000)])
def test_pattern_rates_are_counted_exactly(columns, max_period):
    """The search's candidate rates, counted per offset instead of masked
    over every unit (a mask per offset made ``search_pattern_distribution
    (0.999, 10000)`` take 342 s: periods up to 2,000), bit for bit."""
    from tf_sparse_split.tuning import pattern_search as ps

    patterns = ps.pattern_list(columns, max_period)
    for got, want in zip(ps._pattern_rates(patterns, columns),
                         _masked_rates(patterns, columns)):
        np.testing.assert_array_equal(got, want)


def test_pattern_search_at_a_rate_near_1_on_a_wide_layer():
    d = tfss.search_pattern_distribution(0.999, 10000)
    assert d.expected_rate == pytest.approx(0.999, abs=1e-9)
    assert abs(sum(d.probabilities) - 1.0) < 1e-9
