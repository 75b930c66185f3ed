"""The layers under Keras mixed precision (``mixed_bfloat16``,
``mixed_float16``): each against its Keras counterpart under the same policy
with the same weights (outputs and gradients within the dtype's tolerance),
float32 variables, outputs in the compute dtype, the sparse-split ops run in
the compute dtype, ``.keras`` round trips, the conversions keeping the
policy, ``SparseSplitLSTM`` against ``keras.layers.LSTM``, and short ``fit``
runs with the callbacks and with Keras' loss scaling."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from _helpers import sparse_normal

import tf_sparse_split as tfss
from tf_sparse_split.layers.base import op_dtype_for

pytestmark = pytest.mark.usefixtures("op_library")

POLICIES = ["mixed_bfloat16", "mixed_float16"]

#: Unit roundoff (half an ulp, relative) of the compute dtypes.
EPS = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}


@pytest.fixture(params=POLICIES)
def policy(request):
    """Sets the global dtype policy for the test and restores the previous
    one afterwards; the value is the policy's name."""
    old = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(request.param)
    yield request.param
    keras.mixed_precision.set_global_policy(old)


def _compute(policy):
    return keras.mixed_precision.Policy(policy).compute_dtype


def _assert_close(ours, ref, dtype, factor=4.0):
    """Within ``factor`` roundings of the dtype, relative to each value
    and to the tensor's scale (the two sides round at different points:
    Keras after the GEMM and after the bias add, the op once)."""
    ours = np.asarray(tf.cast(ours, tf.float64))
    ref = np.asarray(tf.cast(ref, tf.float64))
    assert np.all(np.isfinite(ours)) and np.all(np.isfinite(ref))
    eps = EPS[dtype]
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    np.testing.assert_allclose(ours, ref, rtol=factor * eps,
                               atol=factor * eps * scale)


def _sparse_op_dtypes(graph):
    """``{op type: set of T}`` of the sparse-split ops in ``graph``
    (function bodies of while loops included)."""
    out = {}
    graphs = [graph.as_graph_def()]
    for g in graphs:
        nodes = list(g.node)
        for f in g.library.function:
            nodes += list(f.node_def)
        for n in nodes:
            if n.op.startswith("TfSparseSplit>") and "T" in n.attr:
                out.setdefault(n.op.split(">")[1], set()).add(
                    tf.as_dtype(n.attr["T"].type).name)
    return out


def _grads(layer, x, upstream):
    """Output, and gradients of ``sum(output * upstream)`` for the
    layer's trainable variables and the input."""
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=True)
        loss = tf.reduce_sum(tf.cast(y, tf.float32) * upstream)
    return y, tape.gradient(loss, layer.trainable_variables + [x])


def _check_pair(ours, ref, x, dtype, factor=4.0):
    ref.set_weights(ours.get_weights())
    up = tf.constant(np.random.default_rng(7).standard_normal(
        ours.compute_output_shape(x.shape)).astype(np.float32))
    y, g = _grads(ours, x, up)
    y_ref, g_ref = _grads(ref, x, up)
    if getattr(ours, "masked_input_grad", False):
        # the input gradient is computed where the input is nonzero only
        g_ref[-1] = tf.where(x != 0, g_ref[-1], tf.zeros_like(g_ref[-1]))
    assert y.dtype == y_ref.dtype == dtype
    for v in ours.weights:
        assert v.dtype == "float32"
    for a, b in zip(g, g_ref):
        assert a.dtype == b.dtype
    _assert_close(y, y_ref, dtype.name, factor)
    for a, b in zip(g, g_ref):
        _assert_close(tf.convert_to_tensor(a), tf.convert_to_tensor(b),
                      dtype.name, 2 * factor)
    return y


@pytest.mark.parametrize("kwargs,threshold,shape", [
    (dict(activation="relu"), "auto", (37, 50)),
    (dict(activation="relu"), 1.0, (37, 50)),          # all rows sparse
    (dict(activation="relu", masked_input_grad=True), 0.5, (37, 50)),
    (dict(activation="tanh"), 0.0, (4, 9, 50)),        # rank 3, not fused
    (dict(activation=None, use_bias=False), 1.0, (13, 50)),
])
def test_dense_matches_keras_dense(policy, rng, kwargs, threshold, shape):
    dtype = tf.as_dtype(_compute(policy))
    x = sparse_normal(rng, shape, 0.6)
    if kwargs.get("masked_input_grad"):
        x = np.abs(x)   # a ReLU output: the masked input gradient is exact
    x = tf.constant(x, dtype)
    ours = tfss.SparseSplitDense(24, threshold=threshold, **kwargs)
    ref = keras.layers.Dense(24, **{k: v for k, v in kwargs.items()
                                    if k != "masked_input_grad"})
    ours.build(x.shape)
    ref.build(x.shape)
    assert ours.compute_dtype == dtype.name
    assert ours.variable_dtype == "float32"
    _check_pair(ours, ref, x, dtype)
    stats = ours.latest_stats()
    assert stats["m"] == np.prod(shape[:-1])


def test_dense_op_runs_in_compute_dtype(policy, rng):
    """The forward op and the gradient ops take the compute dtype where
    the op has a kernel for it (no float32 round trip), else float32."""
    dtype = _compute(policy)
    layer = tfss.SparseSplitDense(16, activation="relu",
                                  masked_input_grad=True)
    x = tf.constant(np.abs(sparse_normal(rng, (8, 32), 0.5)), dtype)
    layer.build(x.shape)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
        return tape.gradient(y, layer.trainable_variables + [x])

    graph = step.get_concrete_function(x).graph
    dtypes = _sparse_op_dtypes(graph)
    want = op_dtype_for("SparseSplitMatMul", dtype)
    assert want == dtype    # the 16-bit kernels are registered
    assert dtypes["SparseSplitMatMul"] == {want}
    if "SparseSplitSddmm" in dtypes:
        assert dtypes["SparseSplitSddmm"] == {
            op_dtype_for("SparseSplitSddmm", dtype)}


@pytest.mark.parametrize("kwargs", [
    dict(activation="relu", padding="same"),
    dict(activation="relu", strides=2, threshold=1.0),
    dict(activation=None, use_bias=False, threshold=0.0),
    dict(activation="relu", groups=2),
])
def test_conv2d_matches_keras_conv2d(policy, rng, kwargs):
    dtype = tf.as_dtype(_compute(policy))
    x = tf.constant(sparse_normal(rng, (3, 9, 9, 6), 0.6), dtype)
    ours = tfss.SparseSplitConv2D(8, 3, **kwargs)
    ref = keras.layers.Conv2D(8, 3, **{k: v for k, v in kwargs.items()
                                       if k != "threshold"})
    ours.build(x.shape)
    ref.build(x.shape)
    _check_pair(ours, ref, x, dtype, factor=6.0)


def test_conv2d_ops_run_in_compute_dtype(policy, rng):
    """The convolution, its filter gradient and the fused bias + FATReLU
    take the compute dtype where they have kernels for it."""
    dtype = _compute(policy)
    layer = tfss.SparseSplitConv2D(4, 3, activation=tfss.FATReLU())
    x = tf.constant(np.abs(sparse_normal(rng, (2, 6, 6, 3), 0.5)), dtype)
    layer.build(x.shape)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
        return tape.gradient(y, layer.trainable_variables + [x])

    dtypes = _sparse_op_dtypes(step.get_concrete_function(x).graph)
    for op in ("SparseSplitConv2D", "SparseSplitConv2DBackpropFilter",
               "BiasFatRelu", "BiasFatReluGrad"):
        assert dtypes[op] == {op_dtype_for(op.replace("Grad", ""), dtype)}, op
    assert op_dtype_for("SparseSplitConv2D", dtype) == dtype


def test_fatrelu_activation_matches_keras(policy, rng):
    """A FATReLU activation (the fused bias + FATReLU path of the conv
    layer, and as a layer of its own) against ``Conv2D`` + the same
    cutoff in TF ops; its penalty is float32 and finite."""
    dtype = tf.as_dtype(_compute(policy))
    x = tf.constant(sparse_normal(rng, (2, 7, 7, 4), 0.5), dtype)
    fat = tfss.FATReLU(cutoff=0.1, l1=1e-3)
    ours = tfss.SparseSplitConv2D(6, 3, activation=fat)
    ref = keras.layers.Conv2D(6, 3)
    ours.build(x.shape)
    ref.build(x.shape)
    ref.set_weights([ours.kernel.numpy(), ours.bias.numpy()])
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y = ours(x, training=True)
        pre = ref(x)
        y_ref = tf.where(pre > tf.cast(0.1, dtype), pre, tf.zeros_like(pre))
        loss = tf.reduce_sum(tf.cast(y, tf.float32))
        loss_ref = tf.reduce_sum(tf.cast(y_ref, tf.float32))
    assert y.dtype == dtype and fat.cutoff_var.dtype == "float32"
    # Values near the cutoff may fall on either side of it after rounding.
    near = np.abs(np.asarray(tf.cast(pre, tf.float32)) - 0.1) < 0.05
    yo, yr = (np.where(near, 0, np.asarray(tf.cast(t, tf.float32)))
              for t in (y, y_ref))
    _assert_close(yo, yr, dtype.name, 6.0)
    penalty = ours.losses[-1] if ours.losses else fat.losses[-1]
    assert penalty.dtype == tf.float32 and np.isfinite(penalty.numpy())
    g = tape.gradient(loss, ours.trainable_variables)
    g_ref = tape.gradient(loss_ref, ref.trainable_variables)
    for a, b in zip(g, g_ref):
        assert a.dtype == "float32"
        # a few outputs near the cutoff may pass it on one side only
        _assert_close(a, b, dtype.name, 16.0)
    # The layer form: same values as the TF expression in the dtype.
    layer = tfss.FATReLU(cutoff=0.2)
    z = tf.constant(rng.standard_normal((5, 7)), dtype)
    out = layer(z, training=True)
    assert out.dtype == dtype
    np.testing.assert_array_equal(
        out.numpy(), tf.where(z > tf.cast(0.2, dtype), z, 0).numpy())


def test_fatrelu_penalty_in_float32_for_large_activations(policy, rng):
    """The L1 penalty's sum and size are float32: float16 cannot hold the
    sum (or even the size) of a large activation."""
    dtype = tf.as_dtype(_compute(policy))
    fat = tfss.FATReLU(l1=1.0)
    x = tf.constant(np.abs(rng.standard_normal((64, 2048))) + 1.0, dtype)
    with tf.GradientTape() as tape:
        tape.watch(x)
        fat(x, training=True)
        penalty = fat.losses[-1]
    grad = tape.gradient(penalty, x)
    exact = float(np.mean(np.asarray(tf.cast(x, tf.float64))))
    assert penalty.dtype == tf.float32
    np.testing.assert_allclose(penalty.numpy(), exact, rtol=1e-3)
    g = np.asarray(tf.cast(grad, tf.float64))
    np.testing.assert_allclose(g, 1.0 / x.shape.num_elements(), rtol=0.02)


def _lstm_pair(policy, rng, **kwargs):
    x = tf.constant(rng.standard_normal((6, 5, 7)), _compute(policy))
    ours = tfss.SparseSplitLSTM(8, return_sequences=True, **kwargs)
    ref = keras.layers.LSTM(8, return_sequences=True)
    ours.build(x.shape)
    ref.build(x.shape)
    ref.set_weights(ours.get_weights())
    return x, ours, ref


def test_lstm_equals_keras_lstm_without_dropout(policy, rng):
    """Dropout off: the same values as ``keras.layers.LSTM`` under the same
    policy at inference (Keras' loop), and within the dtype's tolerance in
    training (the layer's own loop, fused gate math in float32)."""
    dtype = tf.as_dtype(_compute(policy))
    x, ours, ref = _lstm_pair(policy, rng)
    for training in (False, True):
        y, y_ref = ours(x, training=training), ref(x, training=training)
        assert y.dtype == dtype
        if training:
            _assert_close(y, y_ref, dtype.name, 8.0)
        else:
            np.testing.assert_array_equal(y.numpy(), y_ref.numpy())
    assert all(v.dtype == "float32" for v in ours.weights)


@pytest.mark.parametrize("pattern,groups", [("subset", 2), ("row", 2)])
def test_lstm_own_loop_matches_masked_keras_loop(policy, rng, pattern,
                                                       groups):
    """With dropout (the layer's own loop with the fused gate ops in the
    compute dtype) against Keras' own loop with the same masks under the
    same policy: values and gradients within the dtype's tolerance."""
    dtype = _compute(policy)
    x, layer, _ = _lstm_pair(policy, rng, dropout=0.3, recurrent_dropout=0.4,
                             seed=3, pattern=pattern, pattern_groups=groups)
    assert layer._use_own_loop(None, True)
    state = [tf.constant(rng.standard_normal((6, 8)), dtype)
             for _ in range(2)]
    wrt = layer.trainable_weights + [x] + state

    def run():
        with tf.GradientTape(persistent=True) as tape:
            tape.watch([x] + state)
            layer._maybe_config_dropout_masks(layer.cell, x[:, 0, :], state)
            with keras.src.backend.AutocastScope(dtype):
                _, out, (h, c) = layer._own_loop(x, state)
                _, ref, (h_ref, c_ref) = keras.layers.LSTM.inner_loop(
                    layer, x, state, None, training=True)
            loss = tf.reduce_sum(tf.cast(out * out, tf.float32)) + \
                tf.reduce_sum(tf.cast(c, tf.float32))
            loss_ref = tf.reduce_sum(tf.cast(ref * ref, tf.float32)) + \
                tf.reduce_sum(tf.cast(c_ref, tf.float32))
        layer._maybe_reset_dropout_masks(layer.cell)
        g = [tf.convert_to_tensor(t) for t in tape.gradient(loss, wrt)]
        g_ref = [tf.convert_to_tensor(t) for t in tape.gradient(loss_ref, wrt)]
        return (out, h, c), (ref, h_ref, c_ref), g, g_ref

    ours, refs, g, g_ref = run()
    for a, b in zip(ours, refs):
        assert a.dtype == b.dtype == dtype
        _assert_close(a, b, dtype, 8.0)    # 5 recurrent steps of roundings
    for a, b in zip(g, g_ref):
        assert a.dtype == b.dtype
        _assert_close(a, b, dtype, 16.0)


def test_lstm_gate_ops_run_in_compute_dtype(policy, rng):
    """The own loop's fused gate ops, forward and backward, take the
    compute dtype (no float32 round trip per step)."""
    dtype = _compute(policy)
    x, layer, _ = _lstm_pair(policy, rng, dropout=0.3, recurrent_dropout=0.4,
                             seed=3)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            y = layer(x, training=True)
            loss = tf.reduce_sum(tf.cast(y, tf.float32))
        return tape.gradient(loss, layer.trainable_weights)

    dtypes = _sparse_op_dtypes(step.get_concrete_function(x).graph)
    assert dtypes["LstmGates"] == {dtype}
    assert dtypes["LstmGatesGrad"] == {dtype}


def test_lstm_fit_under_policy(policy, rng):
    """Training (the own loop, fused gate ops in the compute dtype;
    loss scaling under mixed_float16) runs and gives finite weights."""
    x = rng.standard_normal((32, 5, 7)).astype(np.float32)
    y = rng.integers(0, 3, 32)
    model = keras.Sequential([
        keras.Input((5, 7)),
        tfss.SparseSplitLSTM(8, dropout=0.2, recurrent_dropout=0.3, seed=0),
        keras.layers.Dense(3, activation="softmax", dtype="float32")])
    model.compile(keras.optimizers.SGD(0.05),
                  "sparse_categorical_crossentropy", jit_compile=False)
    hist = model.fit(x, y, epochs=2, batch_size=16, verbose=0)
    assert np.all(np.isfinite(hist.history["loss"]))
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())


def _mlp(sparse, seed=0):
    keras.utils.set_random_seed(seed)
    Dense = tfss.SparseSplitDense if sparse else keras.layers.Dense
    extra = dict(masked_input_grad=True) if sparse else {}
    return keras.Sequential([
        keras.Input((40,)),
        Dense(64, activation="relu", name="h1"),
        tfss.ApproximateRandomDropout(0.25, seed=1) if sparse
        else keras.layers.Dropout(0.25, seed=1),
        Dense(32, activation="relu", name="h2", **extra),
        Dense(4, activation="softmax", name="out", dtype="float32",
              **extra)])


def _relu_mlp(sparse, seed=0):
    """784-style MLP of the bench, small: ReLU hidden layers, softmax out;
    ours with ``masked_input_grad`` after a ReLU, as ``build_mlp`` does."""
    keras.utils.set_random_seed(seed)
    Dense = tfss.SparseSplitDense if sparse else keras.layers.Dense
    extra = dict(masked_input_grad=True) if sparse else {}
    return keras.Sequential([
        keras.Input((40,)),
        Dense(64, activation="relu", name="h1"),
        Dense(48, activation="relu", name="h2", **extra),
        Dense(4, activation="softmax", name="out", **extra)])


def _op_types(fn, *args):
    """``{op type: count}`` of the graph ``fn`` traces for ``args``."""
    out = {}
    for op in fn.get_concrete_function(*args).graph.get_operations():
        out[op.type] = out.get(op.type, 0) + 1
    return out


def _step_parts(model, loss_fn):
    """``(gradients(x, y), apply(*grads))``: a training step's gradient
    and Adam update, each its own ``tf.function``."""
    variables = model.trainable_variables
    opt = keras.optimizers.Adam(1e-3)
    opt.build(variables)

    @tf.function
    def gradients(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        return tape.gradient(loss, variables)

    @tf.function
    def apply(*g):
        opt.apply(list(g), variables)

    return gradients, apply


def test_optimizer_gets_the_gradients_keras_dense_gives(policy, rng):
    """What the layers hand ``optimizer.apply`` under a mixed policy is
    what ``keras.layers.Dense`` hands it: one dense float32 ``tf.Tensor``
    per trainable variable (no IndexedSlices, no 16-bit gradient that the
    optimizer would cast), the same shapes, values within the dtype's
    tolerance; the optimizer's update graph is then the same ops, and the
    training step casts each variable and each gradient once, as Keras
    does (no extra pass over weight-sized tensors)."""
    dtype = _compute(policy)
    x = tf.constant(np.abs(sparse_normal(rng, (32, 40), 0.6)))
    y = tf.constant(rng.integers(0, 4, 32))
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    models = [_relu_mlp(sparse=True), _relu_mlp(sparse=False)]
    models[1].set_weights(models[0].get_weights())
    grads, apply_ops, var_casts = [], [], []
    for m in models:
        variables = m.trainable_variables
        gradients, apply = _step_parts(m, loss_fn)
        g = gradients(x, y)
        grads.append(g)
        apply_ops.append(_op_types(apply, *g))
        # Casts whose output has a variable's shape: the autocast of each
        # variable in the forward pass and the cast of its gradient back.
        shapes = [tuple(v.shape) for v in variables]
        graph = gradients.get_concrete_function(x, y).graph
        var_casts.append(sorted(
            tuple(op.outputs[0].shape) for op in graph.get_operations()
            if op.type == "Cast" and tuple(op.outputs[0].shape) in shapes))
    ours, ref = grads
    assert len(ours) == len(ref) == 6
    for a, b, v in zip(ours, ref, models[0].trainable_variables):
        assert type(a) is type(b) and isinstance(a, tf.Tensor)
        assert a.dtype == b.dtype == v.dtype == tf.float32
        assert a.shape == b.shape == v.shape
        _assert_close(a, b, dtype, 8.0)
    assert apply_ops[0] == apply_ops[1]
    assert var_casts[0] == var_casts[1]
    assert len(var_casts[0]) == 2 * len(shapes)


def test_keras_round_trip_under_policy(policy, rng, tmp_path):
    model = _mlp(sparse=True)
    x = tf.constant(sparse_normal(rng, (9, 40), 0.5))
    before = model(x).numpy()
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    for a, b in zip(model.layers, loaded.layers):
        assert a.dtype_policy.name == b.dtype_policy.name
        assert type(a) is type(b)
    assert loaded.get_layer("h1").dtype_policy.name == policy
    assert loaded.get_layer("out").dtype_policy.name == "float32"
    np.testing.assert_array_equal(loaded(x).numpy(), before)
    assert all(w.dtype == "float32" for w in loaded.weights)


def test_conversions_keep_the_policy(policy, rng):
    """Converting a model built under a mixed policy after the global
    policy changed keeps each layer's own policy, both ways."""
    plain = _mlp(sparse=False)
    plain.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy",
                  jit_compile=False)
    x = tf.constant(sparse_normal(rng, (5, 40), 0.5))
    keras.mixed_precision.set_global_policy("float32")   # fixture restores
    converted = tfss.sparse_split_model(plain)
    stripped = tfss.strip_sparse_split(converted)
    assert keras.mixed_precision.global_policy().name == "float32"
    for m in (converted, stripped):
        assert m.dtype_policy.name == plain.dtype_policy.name == policy
        assert type(m.optimizer) is type(plain.optimizer)
        for a, b in zip(plain.layers, m.layers):
            assert a.dtype_policy.name == b.dtype_policy.name
    assert converted.get_layer("h1").dtype_policy.name == policy
    assert isinstance(converted.get_layer("h1"), tfss.SparseSplitDense)
    ref = plain(x)
    _assert_close(converted(x), ref, _compute(policy))
    np.testing.assert_array_equal(stripped(x).numpy(), ref.numpy())


def test_loss_scaled_training_step_matches_keras(rng):
    """mixed_float16: Keras wraps the optimizer in a LossScaleOptimizer;
    our gradients under the scaled loss give the step Keras' layers give."""
    old = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x = np.abs(sparse_normal(rng, (64, 40), 0.5))
        y = rng.integers(0, 4, 64)
        models = [_mlp(sparse=True), _mlp(sparse=False)]
        models[1].set_weights(models[0].get_weights())
        for m in models:
            m.layers[1].rate = 0.0      # no dropout: the same function
            m.compile(keras.optimizers.SGD(0.1),
                      "sparse_categorical_crossentropy", jit_compile=False)
            assert isinstance(m.optimizer, keras.optimizers.LossScaleOptimizer)
        w0 = models[0].get_weights()
        losses = [m.train_on_batch(x, y) for m in models]
        np.testing.assert_allclose(losses[0], losses[1], rtol=1e-2)
        for a, b, w in zip(models[0].get_weights(), models[1].get_weights(),
                           w0):
            assert a.dtype == np.float32 and np.all(np.isfinite(a))
            step, step_ref = a - w, b - w
            scale = np.max(np.abs(step_ref)) + 1e-12
            np.testing.assert_allclose(step, step_ref, atol=0.03 * scale)
        assert float(models[0].optimizer.scale_loss(1.0)) > 1.0
    finally:
        keras.mixed_precision.set_global_policy(old)


def test_fit_with_callbacks_under_mixed_bfloat16(rng):
    """A short ``fit`` with each callback under mixed_bfloat16: the
    callbacks read float64 statistics, write float32 controls, and the
    FATReLU they install takes the layer's policy."""
    old = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        x = sparse_normal(rng, (256, 40), 0.5)
        y = rng.integers(0, 4, 256)
        for make_cb in (lambda: tfss.SplitThresholdCallback(explore_batches=2,
                                                            min_samples=1),
                        lambda: tfss.SparsityTargetCallback(
                            0.6, warmup_epochs=0, ramp_epochs=1)):
            model = _mlp(sparse=True)
            model.compile(keras.optimizers.Adam(1e-3),
                          "sparse_categorical_crossentropy",
                          jit_compile=False)
            cb = make_cb()
            hist = model.fit(x, y, epochs=2, batch_size=64, callbacks=[cb],
                             verbose=0)
            assert np.all(np.isfinite(hist.history["loss"]))
            logged = {k: v for k, v in hist.history.items() if "/" in k}
            assert logged, "the callback wrote nothing into the logs"
            for k, v in logged.items():
                assert all(isinstance(e, float) or np.isscalar(e)
                           for e in v), k
            for layer in model.layers:
                if isinstance(layer, tfss.SparseSplitLayer):
                    assert layer.threshold_var.dtype == tf.float32
                    assert layer.statistics_variables().total.dtype == \
                        tf.float64
                    assert layer.accumulated_stats()["calls"] > 0
                act = getattr(layer, "activation", None)
                if isinstance(act, tfss.FATReLU):
                    assert act.dtype_policy.name == "mixed_bfloat16"
                    assert act.cutoff_var.dtype == "float32"
                    assert np.isfinite(act.cutoff)
    finally:
        keras.mixed_precision.set_global_policy(old)


@pytest.mark.parametrize("make,shape", [
    (lambda: tfss.ApproximateRandomDropout(0.5, seed=2), (16, 32)),
    (lambda: tfss.ApproximateRandomDropout(0.5, pattern="tile",
                                           tile_shape=(4, 8), seed=2),
     (16, 32)),
    (lambda: tfss.SensitivityAwareDropout(0.25, seed=2), (4, 5, 5, 8)),
])
def test_dropout_layers_under_policy(policy, rng, make, shape):
    """Output in the compute dtype; each value is either dropped (0) or the
    input times its example's rescale factor rounded in the dtype; the
    sensitivity scores stay float32 (the channel means of the input)."""
    dtype = tf.as_dtype(_compute(policy))
    layer = make()
    x = tf.constant(rng.uniform(1.0, 2.0, shape), dtype)
    y = layer(x, training=True)
    assert y.dtype == dtype
    assert layer(x, training=False) is x or np.array_equal(
        layer(x, training=False).numpy(), x.numpy())
    ratio = np.asarray(tf.cast(y, tf.float64)) / np.asarray(
        tf.cast(x, tf.float64))
    assert 0 < np.count_nonzero(ratio) < ratio.size
    # one rescale factor per example (per group of examples for grouped
    # row patterns), rounded in the dtype, then the product rounded
    for row in ratio.reshape(shape[0], -1):
        kept = row[row != 0]
        if kept.size:
            np.testing.assert_allclose(kept, np.median(kept),
                                       rtol=4 * EPS[dtype.name])
    for v in layer.weights:
        assert v.dtype in ("float32", "int64")
    if isinstance(layer, tfss.SensitivityAwareDropout):
        assert np.all(np.isfinite(layer.sensitivity.numpy()))
        np.testing.assert_allclose(
            layer.sensitivity.numpy(),
            np.mean(np.asarray(tf.cast(x, tf.float64)), axis=(0, 1, 2)),
            rtol=1e-5)
