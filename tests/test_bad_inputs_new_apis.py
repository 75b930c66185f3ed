"""Bad inputs to the newest public APIs: the stride-1 input-gradient op's
``input_sizes`` (non-integer dtypes, int64 values beyond int32), the
top-level name of its wrapper, ``SparseSplitLSTM.set_rates`` with one good
and one bad rate (nothing may change), and ``TimeBudgetCallback``'s
``min_gain`` of the wrong type. Each must raise a clear error, never
truncate or wrap a size or leave a half-applied change."""

import numpy as np
import pytest
import tensorflow as tf

import tf_sparse_split as tfss
from tf_sparse_split.ops import conv2d as conv_ops

bpi = conv_ops.sparse_split_conv2d_backprop_input


def _operands(rng):
    f = rng.standard_normal((3, 3, 4, 5)).astype(np.float32)
    dy = rng.standard_normal((2, 8, 8, 5)).astype(np.float32)
    dy[rng.random(dy.shape) < 0.6] = 0.0       # real zeros, not all zero
    return f, dy


def _reference(f, dy, sizes):
    return tf.raw_ops.Conv2DBackpropInput(
        input_sizes=sizes, filter=f.astype(np.float64),
        out_backprop=dy.astype(np.float64), strides=[1, 1, 1, 1],
        padding="SAME").numpy()


def test_backprop_input_is_a_top_level_name():
    assert tfss.sparse_split_conv2d_backprop_input is bpi
    assert "sparse_split_conv2d_backprop_input" in tfss.__all__


@pytest.mark.usefixtures("op_library")
@pytest.mark.parametrize("sizes", [
    [2, 8.5, 8, 4],                                   # a float list
    np.array([2.0, 8.0, 8.0, 4.0], np.float32),       # float array
    tf.constant([2.0, 8.0, 8.0, 4.0]),                # float tensor
    tf.constant([True, True, True, True]),            # bool
], ids=["float-list", "float-array", "float-tensor", "bool"])
def test_backprop_input_rejects_non_integer_input_sizes(sizes):
    f, dy = _operands(np.random.default_rng(0))
    with pytest.raises(tf.errors.InvalidArgumentError, match="input_sizes"):
        bpi(sizes, f, dy, "SAME")


@pytest.mark.usefixtures("op_library")
@pytest.mark.parametrize("sizes", [
    [2, 2**32 + 8, 8, 4],       # wraps to 8 in int32: the right shape
    [2, 8, 8, 2**31 + 4],
    [2, -(2**32) + 8, 8, 4],
], ids=["h-wraps-to-8", "c-above-int32", "negative-wraps"])
def test_backprop_input_rejects_int64_sizes_beyond_int32(sizes):
    f, dy = _operands(np.random.default_rng(1))
    for given in (np.array(sizes, np.int64), sizes, tuple(sizes),
                  tf.constant(sizes, tf.int64)):
        with pytest.raises(tf.errors.InvalidArgumentError, match="int32"):
            bpi(given, f, dy, "SAME")


@pytest.mark.usefixtures("op_library")
@pytest.mark.parametrize("threshold", [0.0, 1.0, "auto"])
def test_backprop_input_int64_sizes_in_range(threshold):
    f, dy = _operands(np.random.default_rng(2))
    sizes = [2, 8, 8, 4]
    want = _reference(f, dy, sizes)
    for s in (np.array(sizes, np.int64), tf.constant(sizes, tf.int64),
              [np.int64(2), 8, 8, 4], tf.Variable(sizes, dtype=tf.int64)):
        got = bpi(s, f, dy, "SAME", threshold=threshold).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("op_library")
def test_backprop_input_int64_sizes_checked_in_tf_function():
    f, dy = _operands(np.random.default_rng(3))

    @tf.function(input_signature=[tf.TensorSpec([4], tf.int64)])
    def g(s):
        return bpi(s, f, dy, "SAME")

    np.testing.assert_allclose(g(tf.constant([2, 8, 8, 4], tf.int64)),
                               _reference(f, dy, [2, 8, 8, 4]),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(tf.errors.InvalidArgumentError, match="int32"):
        g(tf.constant([2, 2**32 + 8, 8, 4], tf.int64))

    @tf.function(input_signature=[tf.TensorSpec([None, 8, 8, 5])])
    def h(d):       # a size from a tensor among Python ints
        return bpi([tf.shape(d)[0], 8, 8, 4], f, d, "SAME")

    np.testing.assert_allclose(h(dy), _reference(f, dy, [2, 8, 8, 4]),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pattern", ["subset", "row", "random"])
@pytest.mark.parametrize("built", [False, True])
def test_lstm_set_rates_changes_nothing_when_one_rate_is_bad(pattern,
                                                             built):
    layer = tfss.SparseSplitLSTM(8, dropout=0.25, recurrent_dropout=0.25,
                                 pattern=pattern)
    if built:
        layer.build((None, 3, 4))
    for bad in (1.2, -0.1, float("nan")):
        with pytest.raises(ValueError, match="recurrent_dropout"):
            layer.set_rates(dropout=0.5, recurrent_dropout=bad)
        assert layer.cell.dropout == 0.25
        assert layer.cell.recurrent_dropout == 0.25
    with pytest.raises(ValueError, match="dropout"):
        layer.set_rates(dropout=1.0, recurrent_dropout=0.5)
    assert layer.cell.recurrent_dropout == 0.25
    if built:
        assert float(layer.cell._rate("input")) == 0.25
        assert float(layer.cell._rate("recurrent")) == 0.25


@pytest.mark.parametrize("min_gain", [None, "a", [0.1], float("inf")])
def test_time_budget_min_gain_of_wrong_type(min_gain):
    with pytest.raises(ValueError, match="min_gain"):
        tfss.TimeBudgetCallback(step_time=0.1, min_gain=min_gain)


@pytest.mark.usefixtures("op_library")
def test_time_budget_epoch_line_has_no_dangling_separator(capsys):
    """Without a held batch the verbose epoch line has no empty '; '
    field, and during the warm-up it says that no decision is made yet."""
    import keras

    model = keras.Sequential([
        keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
        tfss.SparseSplitDense(32, activation="relu", name="h2"),
        tfss.SparseSplitDense(4, name="out")])
    model.compile("adam", "mse", jit_compile=False)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((64, 16)).astype(np.float32)
    y = rng.standard_normal((64, 4)).astype(np.float32)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[
        tfss.TimeBudgetCallback(step_time=1.0, verbose=1)])
    lines = [l for l in capsys.readouterr().out.splitlines()
             if l.startswith("TimeBudgetCallback: epoch 1:")]
    assert len(lines) == 1
    # 4 steps of the 20-step warm-up: the line says so, and has no empty
    # field.
    assert lines[0].endswith("; warm-up, step 4 of 20"), lines[0]
    assert "; ;" not in lines[0]


@pytest.mark.parametrize("argv,flag", [
    (["train", "--seed", "-1"], "--seed"),
    (["train", "--seed", "x"], "--seed"),
    (["profile", "m.keras", "--seed", "-3"], "--seed"),
    (["train", "--dropout", "tile", "--tile-shape", "32,30"],
     "--tile-shape"),
    (["train", "--hidden", "64,48", "--dropout", "tile"], "--tile-shape"),
])
def test_cli_bad_seed_or_tile_is_a_usage_error(argv, flag, capsys):
    """Exit code 2 and one error line before any data is loaded (a
    negative seed used to fail in numpy after loading the data, a tile
    that does not divide a hidden size when the model was built)."""
    from tf_sparse_split.tools import cli

    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert "data:" not in captured.out
    assert flag in captured.err.strip().splitlines()[-1]


def test_cli_tile_dividing_every_hidden_size_is_accepted():
    from tf_sparse_split.tools import cli

    parser = cli.build_parser()
    args = parser.parse_args(["train", "--hidden", "64,96", "--dropout",
                              "tile", "--tile-shape", "8,32"])
    cli._check_combinations(parser, args)   # no SystemExit


@pytest.mark.usefixtures("op_library")
@pytest.mark.parametrize("data", ["xy", "short-y", "empty", "scalar-y"])
def test_latency_budget_bad_accuracy_data_before_any_change(data):
    """Mismatched accuracy data is refused up front (it used to fail in a
    numpy reshape after the first point had been timed)."""
    import keras

    model = keras.Sequential([
        keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
        tfss.SparseSplitDense(32, activation="relu"),
        tfss.SparseSplitDense(4)])
    x = np.random.default_rng(6).random((32, 16)).astype(np.float32)
    bad = {"xy": "xy", "short-y": (x, np.zeros(3, np.int64)),
           "empty": (x[:0], np.zeros(0, np.int64)),
           "scalar-y": (x, 3)}[data]
    with pytest.raises(ValueError, match="accuracy_data"):
        tfss.fit_latency_budget(model, 0.01, x, accuracy_data=bad)


@pytest.mark.usefixtures("op_library")
@pytest.mark.parametrize("f_dtype,dy_dtype", [
    ("float32", "float64"), ("float64", "float32"), ("bfloat16", "float32"),
    ("float16", "float32"), ("bfloat16", "float16")])
def test_backprop_input_numpy_dy_of_another_dtype_is_refused(f_dtype,
                                                             dy_dtype):
    """As the matmul and forward wrappers: an array keeps its dtype, so a
    float64 dY is not silently rounded to the filter's float32 (or a
    float32 one to bfloat16)."""
    f, dy = _operands(np.random.default_rng(7))
    filt = tf.cast(f, f_dtype)
    dy_np = tf.cast(dy, dy_dtype).numpy()
    with pytest.raises(tf.errors.InvalidArgumentError, match="dtype"):
        bpi([2, 8, 8, 4], filt, dy_np, "SAME")
    # A Python list takes the filter's dtype.
    got = bpi([2, 8, 8, 4], f, dy.tolist(), "SAME")
    np.testing.assert_allclose(got, _reference(f, dy, [2, 8, 8, 4]),
                               rtol=1e-5, atol=1e-5)


# -- WallTimePlan and TimeBudgetCallback arguments --------------------------
from tf_sparse_split.tuning.deadline import WallTimePlan  # noqa: E402


@pytest.mark.parametrize("seconds", [None, "abc", True, float("inf"),
                                     float("-inf"), [5.0]])
def test_wall_time_plan_rejects_non_numeric_seconds(seconds):
    with pytest.raises(ValueError, match="`deadline`"):
        WallTimePlan("deadline", seconds, 5, 2)


@pytest.mark.parametrize("kw, name", [
    (dict(steps_per_epoch=2.5), "steps_per_epoch"),   # was truncated to 2
    (dict(steps_per_epoch=True), "steps_per_epoch"),
    (dict(steps_per_epoch="x"), "steps_per_epoch"),
    (dict(epochs=2.7), "epochs"),                     # was truncated to 2
    (dict(epochs=True), "epochs"),
    (dict(epochs="x"), "epochs"),
    (dict(epochs=-1), "epochs"),
    (dict(start=float("nan")), "start"),              # NaN budgets after
    (dict(start=None), "start"),
])
def test_wall_time_plan_rejects_bad_counts_and_start(kw, name):
    args = dict(kind="deadline", seconds=10.0, steps_per_epoch=5, epochs=2)
    args.update(kw)
    with pytest.raises(ValueError, match=f"`{name}`"):
        WallTimePlan(**args)


def test_wall_time_plan_numpy_counts_and_passed_deadline():
    p = WallTimePlan("deadline", 10.0, np.int64(5), np.int64(2), start=0.0)
    assert (p.steps_per_epoch, p.epochs) == (5, 2)
    p.epoch_begin(0.0, 0)
    p.step_begin(20.0)                  # 10 s past the deadline
    assert p.budget(20.0) == 0.0
    assert p.predicted_elapsed(20.0, 0.1) > 10.0


@pytest.mark.parametrize("gain", ["abc", None, float("inf"), -1.0, True])
def test_time_budget_gain_of_the_wrong_type(gain):
    with pytest.raises(ValueError, match="`gain`"):
        tfss.TimeBudgetCallback(step_time=0.1, gain=gain)


def test_time_budget_clock_must_be_callable():
    with pytest.raises(ValueError, match="`clock`"):
        tfss.TimeBudgetCallback(deadline=5.0, clock=3.0)


# -- bench_train_step.py command line ----------------------------------------
@pytest.mark.parametrize("argv, flag", [
    (["--what", "ops", "--rounds", "0"], "--rounds"),
    (["--what", "ops", "--ops-steps", "-2"], "--ops-steps"),
    (["--ops-rounds", "x"], "--ops-rounds"),
    (["--policy-block", "0"], "--policy-block"),
    (["--target", "1.5"], "--target"),
    (["--warmup", "-1"], "--warmup"),
    (["--clock", "gpu"], "--clock"),
    (["--what", "opz"], "--what"),
    (["--what", "ops", "--breakdown-policy", "bogus"], "--breakdown-policy"),
    (["--policies", " , "], "--policies"),
    (["--policies", "float32,bogus"], "--policies"),
])
def test_bench_train_step_refuses_bad_flags_before_running(argv, flag,
                                                           capsys):
    from _helpers import import_benchmark

    mod = import_benchmark("bench_train_step")
    with pytest.raises(SystemExit) as e:
        mod.main(argv)
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


# -- dropout set_rate and scores ----------------------------------------------
@pytest.mark.parametrize("cls", ["SensitivityAwareDropout",
                                 "ApproximateRandomDropout"])
def test_set_rate_refuses_a_symbolic_tensor_by_name(cls):
    layer = getattr(tfss, cls)(0.25)
    if cls == "SensitivityAwareDropout":
        layer.build((None, 4, 4, 8))
    else:
        layer.build((None, 32))
    before = layer.rate

    @tf.function
    def set_inside(r):
        layer.set_rate(r)
        return r

    with pytest.raises(ValueError, match="symbolic tensor"):
        set_inside(tf.constant(0.5))
    assert layer.rate == before
    layer.set_rate(tf.constant(0.5))          # an eager tensor is a number
    assert layer.rate == pytest.approx(0.5)


@pytest.mark.parametrize("rate", [1.0, 1.5, -0.1, float("nan"), True, None,
                                  "x", [0.5]])
def test_sensitivity_dropout_bad_rate_changes_nothing(rate):
    d = tfss.SensitivityAwareDropout(0.25)
    d.build((None, 4, 4, 8))
    with pytest.raises(ValueError, match="`rate`"):
        d.set_rate(rate)
    with pytest.raises(ValueError, match="`rate`"):
        d.rate = rate
    assert (d.rate, d.num_drop, int(d.num_drop_var.numpy())) == (0.25, 2, 2)


def test_sensitivity_dropout_nan_input_keeps_the_scores():
    rng = np.random.default_rng(8)
    d = tfss.SensitivityAwareDropout(0.25, seed=3)
    x = np.abs(rng.standard_normal((2, 4, 4, 8))).astype(np.float32) + 0.1
    d(x, training=True)
    before = d.sensitivity.numpy().copy()
    bad = x.copy()
    bad[0, 0, 0, 2] = np.nan
    bad[1, 1, 1, 5] = np.inf
    d(bad, training=True)
    after = d.sensitivity.numpy()
    assert np.all(np.isfinite(after))
    np.testing.assert_array_equal(after[[2, 5]], before[[2, 5]])
    assert not np.array_equal(after[[0, 1]], before[[0, 1]])  # updated
    y = d(x, training=True).numpy()     # still exactly 2 channels dropped
    assert int((np.abs(y).sum(axis=(0, 1, 2)) == 0).sum()) == 2


# -- FATReLU (alone and fused with SparseSplitDense's bias) ------------------
def _fat_dense(target, l1, seed):
    layer = tfss.SparseSplitDense(
        16, activation=tfss.FATReLU(target=target, l1=l1))
    layer.build((None, 24))
    rng = np.random.default_rng(seed)
    layer.kernel.assign(np.abs(rng.standard_normal((24, 16))).astype(
        np.float32) * 0.2)
    return layer


@pytest.mark.usefixtures("op_library")
@pytest.mark.parametrize("target,l1", [(0.5, 0.0), (0.5, 1e-3), (0.0, 1e-3),
                                       (0.0, 0.0)])
@pytest.mark.parametrize("shape", [(0, 24), (0, 3, 24)])
def test_fat_dense_empty_batch_in_training(target, l1, shape):
    """A batch of 0 rows: an empty output, zero penalty (not 0/0), finite
    gradients, the cutoff unchanged (no quantile to track; it used to fail
    in the sampling with an InvalidArgumentError)."""
    layer = _fat_dense(target, l1, 9)
    layer.activation.cutoff_var.assign(0.25)
    x = tf.zeros(shape)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=True)
        loss = tf.reduce_sum(y) + tf.add_n(layer.losses)
    grads = tape.gradient(loss, [x] + layer.trainable_weights)
    assert y.shape == shape[:-1] + (16,)
    assert [float(v) for v in layer.losses] == [0.0]
    assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)
    assert float(layer.activation.cutoff_var.numpy()) == 0.25
    f = tfss.FATReLU(target=target, l1=l1)
    assert f(tf.zeros((0, 5)), training=True).shape == (0, 5)
    assert [float(v) for v in f.losses] == [0.0]


@pytest.mark.usefixtures("op_library")
@pytest.mark.parametrize("fused", [True, False], ids=["dense", "alone"])
def test_fat_relu_nan_input_keeps_a_finite_cutoff(fused):
    """A NaN/Inf batch must not make the tracked cutoff NaN: x > NaN is
    false, so every later output would be silently all zero."""
    rng = np.random.default_rng(10)
    x = np.abs(rng.standard_normal((64, 24))).astype(np.float32)
    if fused:
        layer = _fat_dense(0.5, 0.0, 11)
        fat = layer.activation
    else:
        layer = fat = tfss.FATReLU(target=0.5)
    layer(x, training=True)
    before = float(fat.cutoff_var.numpy())
    assert before > 0
    bad = x.copy()
    bad[:, 0] = np.nan
    bad[:, 1] = np.inf
    layer(bad, training=True)
    after = float(fat.cutoff_var.numpy())
    assert np.isfinite(after) and after > 0
    y = np.asarray(layer(x))
    assert np.mean(y == 0) < 0.95       # a NaN cutoff zeroes everything


# -- TimeBudgetCallback sensitivity_data --------------------------------------
@pytest.mark.parametrize("data", [
    (np.zeros((0, 32), np.float32), np.zeros(0, np.int64)),
    (np.zeros((16, 32), np.float32), np.zeros(8, np.int64)),
    ([[0.0] * 32] * 4, [1, 2]),
], ids=["empty", "length-mismatch", "lists"])
def test_time_budget_sensitivity_data_checked_at_construction(data):
    with pytest.raises(ValueError, match="sensitivity_data"):
        tfss.TimeBudgetCallback(step_time=0.01, sensitivity_data=data)


@pytest.mark.usefixtures("op_library")
def test_time_budget_sensitivity_data_shape_checked_before_training():
    """A held batch of the wrong feature size fails at on_train_begin with
    both shapes named, not after the warm-up deep inside the probe."""
    import keras

    model = keras.Sequential([keras.Input((32,)),
                              keras.layers.Dense(16, activation="relu"),
                              tfss.SparseSplitDense(4)])
    model.compile("adam", "sparse_categorical_crossentropy",
                  jit_compile=False)
    rng = np.random.default_rng(12)
    x = rng.standard_normal((64, 32)).astype(np.float32)
    y = rng.integers(0, 4, 64)
    cb = tfss.TimeBudgetCallback(step_time=0.01,
                                 sensitivity_data=(x[:16, :30], y[:16]))
    seen = []

    class Count(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(batch)

    with pytest.raises(ValueError, match=r"\(16, 30\).*\(None, 32\)"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0,
                  callbacks=[cb, Count()])
    assert seen == []


@pytest.mark.usefixtures("op_library")
def test_time_budget_deadline_already_passed():
    """A deadline spent before the first step: step budget 0, logged as
    unreachable (``budget/deadline_reachable`` 0, a predicted end past the
    deadline), the message giving the deadline's own value (not 0.00 s),
    and the fit runs to its end."""
    import keras

    model = keras.Sequential([keras.Input((32,)),
                              keras.layers.Dense(32, activation="relu"),
                              tfss.SparseSplitDense(4)])
    model.compile("adam", "sparse_categorical_crossentropy",
                  jit_compile=False)
    rng = np.random.default_rng(13)
    x = rng.standard_normal((96, 32)).astype(np.float32)
    y = rng.integers(0, 4, 96)
    cb = tfss.TimeBudgetCallback(deadline=1e-3, warmup_steps=2,
                                 min_samples=2)
    h = model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[cb])
    assert h.history["budget/step_budget"] == [0.0, 0.0]
    assert h.history["budget/deadline_reachable"][-1] == 0.0
    assert all(v > 1e-3 for v in h.history["budget/predicted_end_s"])
    assert cb.deadline_log and not cb.deadline_log[0][1]
    assert "deadline of 0.001 s is not reachable" in cb.deadline_log[0][3]
    assert len(h.history["loss"]) == 2


@pytest.mark.parametrize("log_dir", [5, b"logs", ["logs"]])
def test_time_budget_log_dir_must_be_a_path(log_dir):
    with pytest.raises(ValueError, match="`log_dir`"):
        tfss.TimeBudgetCallback(step_time=0.1, log_dir=log_dir)


def test_time_budget_log_dir_accepts_a_pathlib_path(tmp_path):
    cb = tfss.TimeBudgetCallback(step_time=0.1, log_dir=tmp_path / "tb")
    assert cb.log_dir == str(tmp_path / "tb")


@pytest.mark.parametrize("argv,flag", [
    (["train", "--hidden", "8,,8"], "--hidden"),
    (["train", "--hidden", "8,"], "--hidden"),
    (["train", "--model", "cnn", "--filters", ",16"], "--filters"),
])
def test_cli_empty_size_entry_is_a_usage_error(argv, flag, capsys):
    """An empty entry of a size list is refused, not dropped (``8,,8``
    built a 64-8-8-10 model)."""
    from tf_sparse_split.tools import cli

    assert cli.main(argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert flag in last and "empty entry" in last


def test_cli_dropout_with_cnn_names_the_models_that_take_it(capsys):
    from tf_sparse_split.tools import cli

    assert cli.main(["train", "--model", "cnn", "--dropout", "row"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--model mlp and --model lstm" in last


def test_profile_of_a_file_that_is_not_a_keras_archive(tmp_path):
    """A ``.keras`` path that exists but is no zip archive: the error says
    so (Keras' own message said the file was not found)."""
    from tf_sparse_split.tools._model_io import model_kind

    bad = tmp_path / "bad.keras"
    bad.write_text("x")
    with pytest.raises(ValueError, match="not a valid .keras file"):
        model_kind(str(bad))


@pytest.mark.usefixtures("op_library")
def test_rewrite_warns_about_producers_that_are_no_op_type():
    from tf_sparse_split import rewrite

    with pytest.warns(UserWarning, match=r"\['Bogus', 'relu'\]"):
        rewrite.enable(producers=("Bogus", "relu", "Relu", "Dropout",
                                  "Input"))
    rewrite.disable()
    import warnings

    with warnings.catch_warnings():
        # (the pass's RuntimeWarning about graphs instantiated before it
        # was on is another matter)
        warnings.simplefilter("error", UserWarning)
        rewrite.enable()     # the defaults: no warning about producers
        rewrite.disable()


@pytest.mark.usefixtures("op_library")
def test_backprop_input_errors_name_the_function():
    """Its argument errors name ``sparse_split_conv2d_backprop_input``, and
    a stride given where the padding goes (the argument order of
    ``tf.nn.conv2d_backprop_input``) says the function takes none."""
    rng = np.random.default_rng(2)
    f, dy = _operands(rng)
    sizes = [dy.shape[0], dy.shape[1], dy.shape[2], f.shape[2]]
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="sparse_split_conv2d_backprop_input: padding.*"
                             "takes no strides"):
        tfss.sparse_split_conv2d_backprop_input(sizes, f, dy, 1, "SAME")
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="^sparse_split_conv2d_backprop_input: dilations"):
        tfss.sparse_split_conv2d_backprop_input(sizes, f, dy, "SAME", "x")
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="^sparse_split_conv2d_backprop_input: padding"):
        tfss.sparse_split_conv2d_backprop_input(sizes, f, dy, "FULL")


def test_dir_lists_no_standard_library_modules():
    names = dir(tfss)
    assert not {"importlib", "sys", "threading", "warnings"} & set(names)
    assert "sparse_split_matmul" in names and "layers" in names
