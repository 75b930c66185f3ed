"""Bad inputs to the time-budget APIs and 16-bit inputs to the ops.

``TimeBudgetCallback`` on a model compiled with ``steps_per_execution`` > 1
(its batch hooks then see several steps at once), a layer of another model
in ``layers``, budgets and bounds given as text; the CLI's budget flags'
message; the ``train`` epoch line's words for the L1 coefficient. Then
bfloat16/float16 operands with NaN/Inf, empty operands and mismatched
dtypes for the matmul, LSTM-gate and FATReLU ops, against a float64
reference."""

import argparse
import io

import numpy as np
import pytest
import tensorflow as tf

import tf_sparse_split as tfss

LOW = [tf.bfloat16, tf.float16]
TOL = {tf.bfloat16: 3e-2, tf.float16: 3e-3}


def _mlp():
    import keras

    model = keras.Sequential([
        keras.Input((16,)),
        tfss.SparseSplitDense(32, activation="relu", name="h1"),
        tfss.SparseSplitDense(32, activation="relu", name="h2"),
        tfss.SparseSplitDense(4, name="out")])
    return model


def _data():
    rng = np.random.default_rng(5)
    return (rng.standard_normal((64, 16)).astype(np.float32),
            rng.integers(0, 4, 64))


def test_time_budget_refuses_steps_per_execution_above_1():
    """Keras calls the batch hooks once per execution: a step budget would
    be compared with four steps' time. Refused before anything changes."""
    model = _mlp()
    model.compile("adam", "sparse_categorical_crossentropy",
                  jit_compile=False, steps_per_execution=4)
    x, y = _data()
    cb = tfss.TimeBudgetCallback(step_time=0.01, warmup_steps=2,
                                 min_samples=2)
    with pytest.raises(ValueError, match="steps_per_execution=4"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[cb])
    assert cb.controller is None and cb.trace == []


def test_time_budget_steps_per_execution_1_still_trains():
    model = _mlp()
    model.compile("adam", "sparse_categorical_crossentropy",
                  jit_compile=False, steps_per_execution=1)
    x, y = _data()
    cb = tfss.TimeBudgetCallback(step_time=0.01, warmup_steps=2,
                                 min_samples=2)
    h = model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[cb])
    assert "budget/step_budget" in h.history
    # One trace entry per step (not per execution of several): the last
    # of the 4 steps is step 4.
    assert cb.trace and cb.trace[-1]["step"] == 4


def test_time_budget_bad_sensitivity_data_is_named():
    """NaN or non-numeric held batches are refused when the callback is
    made; labels outside the model's classes at on_train_begin, before
    anything changes (TensorFlow's loss would fail only after the
    warm-up, inside the probe's traced call)."""
    x, y = _data()
    for data, match in (((np.full_like(x, np.nan), y), "NaN"),
                        (("a", "b"), "must be numbers"),
                        ((x, np.full(64, np.inf)), "NaN")):
        with pytest.raises(ValueError, match="sensitivity_data.*" + match):
            tfss.TimeBudgetCallback(step_time=0.01, sensitivity_data=data)
    model = _mlp()
    model.compile("adam", "sparse_categorical_crossentropy",
                  jit_compile=False)
    cb = tfss.TimeBudgetCallback(step_time=0.01, warmup_steps=2,
                                 min_samples=2, sensitivity_data=(x, y + 99))
    with pytest.raises(ValueError, match=r"classes in \[0, 4\)"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[cb])
    assert cb.trace == []
    # verbose may be a bool, as Keras' own callbacks take it.
    assert tfss.TimeBudgetCallback(step_time=0.01, verbose=True).verbose


def test_time_budget_layer_of_another_model_is_refused():
    model, other = _mlp(), _mlp()
    model.compile("adam", "sparse_categorical_crossentropy",
                  jit_compile=False)
    x, y = _data()
    cb = tfss.TimeBudgetCallback(step_time=0.01,
                                 layers=[other.get_layer("h2")])
    with pytest.raises(ValueError, match="'h2' is not in the model"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[cb])
    # The same layer of the model itself is accepted.
    cb = tfss.TimeBudgetCallback(step_time=0.01, warmup_steps=2,
                                 min_samples=2,
                                 layers=[model.get_layer("h2")])
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[cb])
    assert [k.name for k in cb._knobs] == ["h2"]


@pytest.mark.parametrize("kwargs, name", [
    (dict(step_time="0.1"), "step_time"),
    (dict(deadline=b"60"), "deadline"),
    (dict(step_time=0.1, max_sparsity="0.9"), "max_sparsity"),
    (dict(step_time=0.1, min_rate="0"), "min_rate"),
])
def test_time_budget_numbers_given_as_text_are_refused(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}` must be a number"):
        tfss.TimeBudgetCallback(**kwargs)


def test_fit_latency_budget_seconds_as_text_is_refused():
    model = _mlp()
    x, _ = _data()
    model(x[:2])
    with pytest.raises(ValueError, match="`seconds` must be a number"):
        tfss.fit_latency_budget(model, "0.01", x)


@pytest.mark.parametrize("text", ["0", "-1", "nan", "inf", "1e400", "fast",
                                  ""])
def test_cli_budget_flag_message_names_what_is_wrong(text):
    from tf_sparse_split.tools.cli import parse_seconds

    with pytest.raises(argparse.ArgumentTypeError,
                       match="a budget must be a finite number > 0, got "):
        parse_seconds(text)
    assert parse_seconds("2.5") == 2.5


def test_train_epoch_line_says_what_the_l1_number_is():
    from tf_sparse_split.tools.train import epoch_printer

    out = io.StringIO()
    printer = epoch_printer(1, ["hidden_2"], out)
    printer.on_epoch_begin(0)
    printer.on_epoch_end(0, {"loss": 0.5, "accuracy": 0.9,
                             "hidden_2/sparsity": 0.74,
                             "hidden_2/threshold": 0.75,
                             "hidden_2/fat_cutoff": 0.2383,
                             "hidden_2/l1": 2.0})
    line = out.getvalue().splitlines()[1]
    assert line == ("  hidden_2: split: 74% zeros, rows denser than 0.750 "
                    "dense, the rest CSR; FATReLU cutoff 0.2383, L1 "
                    "activity penalty 2 x mean |activation|")


# -- 16-bit operands ---------------------------------------------------------
def _relu(rng, shape, dtype):
    a = np.maximum(rng.standard_normal(shape), 0.0)   # ~50% real zeros
    return tf.cast(a, dtype)


def _close(out, ref, dtype):
    out = tf.cast(out, tf.float64).numpy()
    ref = np.asarray(ref)
    assert out.shape == ref.shape
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    np.testing.assert_array_equal(np.isinf(out), np.isinf(ref))
    fin = np.isfinite(ref)
    if fin.any():
        scale = np.abs(ref[fin]).max() + 1e-30
        assert np.abs(out[fin] - ref[fin]).max() / scale <= TOL[dtype]


@pytest.mark.usefixtures("op_library")
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("sa, sb", [((0, 5), (5, 3)), ((4, 0), (0, 3)),
                                    ((4, 5), (5, 0)), ((0, 0), (0, 0))])
def test_matmul_empty_16_bit_operands_and_gradients(dtype, sa, sb):
    rng = np.random.default_rng(1)
    a, b = _relu(rng, sa, dtype), tf.cast(rng.standard_normal(sb), dtype)
    with tf.GradientTape() as tape:
        tape.watch([a, b])
        y = tfss.sparse_split_matmul(a, b, threshold="auto")
        loss = tf.reduce_sum(tf.cast(y, tf.float32))
    _close(y, np.zeros((sa[0], sb[1])), dtype)
    ga, gb = tape.gradient(loss, [a, b])
    assert ga.shape == a.shape and gb.shape == b.shape
    assert ga.dtype == dtype and gb.dtype == dtype
    # d(sum)/da = row sums of b, d(sum)/db = column sums of a.
    _close(ga, np.broadcast_to(tf.reduce_sum(tf.cast(b, tf.float64), 1),
                               sa), dtype)
    _close(gb, np.broadcast_to(
        tf.reduce_sum(tf.cast(a, tf.float64), 0)[:, None], sb), dtype)


@pytest.mark.usefixtures("op_library")
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("threshold", [0.0, 1.0, "auto"])
def test_matmul_16_bit_nan_inf_in_a_propagate(dtype, threshold):
    """NaN/Inf in ``a`` reach the rows they are in, as in the dense op;
    every row on the CSR kernel (threshold 1) matches float64 exactly in
    its NaN/Inf pattern."""
    rng = np.random.default_rng(2)
    a = np.maximum(rng.standard_normal((40, 70)), 0.0)
    a[0, 1], a[5, 3] = np.nan, np.inf
    a = tf.cast(a, dtype)
    b = tf.cast(rng.standard_normal((70, 30)), dtype)
    ref = tf.matmul(tf.cast(a, tf.float64), tf.cast(b, tf.float64))
    if threshold != 1.0 and dtype == tf.bfloat16:
        # Dense rows run TensorFlow's own bfloat16 MatMul (oneDNN), which
        # on these CPUs also turns a row next to the Inf row into NaN: the
        # op then matches that kernel's NaN/Inf pattern, not float64's.
        tf_out = tf.cast(tf.matmul(a, b), tf.float64).numpy()
        ref = np.where(np.isnan(tf_out), np.nan, ref)
    _close(tfss.sparse_split_matmul(a, b, threshold=threshold), ref, dtype)


@pytest.mark.usefixtures("op_library")
@pytest.mark.parametrize("dtype", LOW)
def test_lstm_gates_16_bit_non_finite_and_gradients(dtype):
    from tf_sparse_split.ops import lstm_gates

    rng = np.random.default_rng(3)
    zx = rng.standard_normal((3, 8))
    zx[0, 0], zx[1, 1], zx[2, 7] = np.nan, np.inf, -np.inf
    zx, zh, c = (tf.cast(v, dtype) for v in
                 (zx, rng.standard_normal((3, 8)),
                  rng.standard_normal((3, 2))))

    def ref(zx, zh, c):
        i, f, o, g = tf.split(zx + zh, 4, -1)
        c2 = tf.sigmoid(f) * c + tf.sigmoid(i) * tf.tanh(g)
        return tf.sigmoid(o) * tf.tanh(c2), c2

    h, c2, _ = lstm_gates(zx, zh, c)
    rh, rc = ref(*(tf.cast(v, tf.float64) for v in (zx, zh, c)))
    _close(h, rh, dtype)
    _close(c2, rc, dtype)
    # Gradients on finite inputs against float64.
    zx = tf.cast(rng.standard_normal((3, 8)), dtype)
    with tf.GradientTape() as tape:
        tape.watch([zx, zh, c])
        h, c2, _ = lstm_gates(zx, zh, c)
        loss = tf.reduce_sum(tf.cast(h, tf.float32) + tf.cast(c2, tf.float32))
    got = tape.gradient(loss, [zx, zh, c])
    v64 = [tf.cast(v, tf.float64) for v in (zx, zh, c)]
    with tf.GradientTape() as tape:
        tape.watch(v64)
        rh, rc = ref(*v64)
        loss = tf.reduce_sum(rh) + tf.reduce_sum(rc)
    for g, r in zip(got, tape.gradient(loss, v64)):
        _close(g, r, dtype)


@pytest.mark.usefixtures("op_library")
@pytest.mark.parametrize("dtype", LOW)
def test_lstm_gates_16_bit_bad_shapes_and_dtypes(dtype):
    from tf_sparse_split.ops import lstm_gates

    z = tf.zeros((3, 8), dtype)
    for args, match in [
            ((z, tf.zeros((3, 8), tf.float32), tf.zeros((3, 2), dtype)),
             "one dtype"),
            ((tf.zeros((3, 7), dtype),) * 2 + (tf.zeros((3, 2), dtype),),
             "multiple of 4"),
            ((z, tf.zeros((2, 8), dtype), tf.zeros((3, 2), dtype)), "zh"),
            ((z, z, tf.zeros((4, 2), dtype)), "c_prev"),
            ((tf.zeros((), dtype),) * 3, "rank")]:
        with pytest.raises((tf.errors.InvalidArgumentError, ValueError),
                           match=match):
            lstm_gates(*args)
    h, c, saved = lstm_gates(tf.zeros((0, 8), dtype), tf.zeros((0, 8), dtype),
                             tf.zeros((0, 2), dtype))
    assert h.shape == (0, 2) and c.shape == (0, 2) and saved.shape == (0, 12)


@pytest.mark.usefixtures("op_library")
@pytest.mark.parametrize("dtype", LOW)
def test_bias_fat_relu_16_bit_non_finite(dtype):
    from tf_sparse_split.ops import bias_fat_relu

    rng = np.random.default_rng(4)
    x = rng.standard_normal((5, 6))
    x[0, 0], x[1, 1], x[2, 2] = np.nan, np.inf, -np.inf
    x, b = tf.cast(x, dtype), tf.cast(rng.standard_normal(6), dtype)
    y, total = bias_fat_relu(x, b, 0.1)
    z = tf.cast(x, tf.float64) + tf.cast(b, tf.float64)
    ref = tf.where(z > 0.1, z, tf.zeros_like(z))     # NaN > 0.1 is False
    _close(y, ref, dtype)
    assert np.isinf(float(tf.cast(total, tf.float64)))
    for cutoff in (-1.0, float("nan"), tf.constant(float("nan"), dtype)):
        with pytest.raises(tf.errors.InvalidArgumentError, match="cutoff"):
            bias_fat_relu(x, b, cutoff)
    with pytest.raises(tf.errors.InvalidArgumentError, match="bias"):
        bias_fat_relu(x, tf.cast(b, tf.float32), 0.1)
    with pytest.raises(tf.errors.InvalidArgumentError, match="bias"):
        bias_fat_relu(x, tf.zeros((7,), dtype), 0.1)


@pytest.mark.usefixtures("op_library")
@pytest.mark.parametrize("dtype", LOW)
def test_conv2d_16_bit_input_grad_with_nan_filter(dtype):
    """A NaN in the filter reaches dX where the float64 reference has it,
    and nowhere TensorFlow's own Conv2DBackpropInput of that dtype does not
    put one (in bfloat16 oneDNN's kernel, which the op runs for dense
    images, also spreads it to the border pixels that face the padding);
    finite values match float64."""
    rng = np.random.default_rng(6)
    x = _relu(rng, (2, 6, 6, 3), dtype)
    w = rng.standard_normal((3, 3, 3, 4))
    w[0, 0, 0, 0] = np.nan
    w = tf.cast(w, dtype)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tfss.sparse_split_conv2d(x, w, 1, "SAME", threshold=0.5)
        loss = tf.reduce_sum(tf.cast(y, tf.float32))
    dx = tf.cast(tape.gradient(loss, x), tf.float64).numpy()
    dy = tf.ones((2, 6, 6, 4), dtype)
    kw = dict(input_sizes=[2, 6, 6, 3], strides=[1, 1, 1, 1], padding="SAME")
    same_dtype = tf.cast(tf.raw_ops.Conv2DBackpropInput(
        filter=w, out_backprop=dy, **kw), tf.float64).numpy()
    exact = tf.raw_ops.Conv2DBackpropInput(
        filter=tf.cast(w, tf.float64), out_backprop=tf.cast(dy, tf.float64),
        **kw).numpy()
    assert np.isnan(exact).any()
    assert np.all(np.isnan(dx) >= np.isnan(exact))
    assert np.all(np.isnan(dx) <= np.isnan(same_dtype))
    fin = np.isfinite(dx) & np.isfinite(exact)
    assert fin.any()
    assert np.abs(dx[fin] - exact[fin]).max() / np.abs(exact[fin]).max() \
        <= TOL[dtype]


def test_time_budget_verbose_line_says_why_sensitivities_are_equal(capsys):
    model = _mlp()
    model.compile("adam", "sparse_categorical_crossentropy",
                  jit_compile=False)
    x, y = _data()
    cb = tfss.TimeBudgetCallback(step_time=0.01, warmup_steps=2,
                                 min_samples=2, verbose=1)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[cb])
    out = capsys.readouterr().out
    assert "no sensitivity_data: every layer taken as equally sensitive" \
        in out, out
    assert "held batch" not in out
