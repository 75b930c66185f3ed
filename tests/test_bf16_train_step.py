"""The training step of a sparse-split MLP under ``mixed_bfloat16`` runs
no work that plain Keras does not: no float32 round trip of an activation
or gradient around the sparse-split ops (every one runs in bfloat16, every
Cast touching them is a variable's autocast or its gradient), a FATReLU
activation (what ``SparsityTargetCallback`` installs) fused with the bias
into ``BiasFatRelu`` / ``BiasFatReluGrad`` (no separate compare, select or
penalty sum), and that path's values and gradients equal the TF
expression's; the cutoff tracking's order statistic equals a sort's."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from _helpers import sparse_normal

import tf_sparse_split as tfss
from tf_sparse_split.layers.activations import _order_statistic

pytestmark = pytest.mark.usefixtures("op_library")

_OURS = ("TfSparseSplit>SparseSplitMatMul", "TfSparseSplit>SparseSplitSddmm",
         "TfSparseSplit>BiasFatRelu", "TfSparseSplit>BiasFatReluGrad")


def _mlp(fat):
    """784 -> 32 -> 32 -> 10 of SparseSplitDense; hidden activations
    FATReLU (``fat``) or relu; inputs of the second and third layer
    masked (``masked_input_grad``), as the model builders set it."""
    def act(i):
        return tfss.FATReLU(cutoff=0.05, l1=1e-3, target=0.5,
                            name=f"fat_{i}") if fat else "relu"

    model = keras.Sequential([
        keras.Input((48,)),
        tfss.SparseSplitDense(32, activation=act(1), name="h1"),
        tfss.SparseSplitDense(32, activation=act(2), masked_input_grad=True,
                              name="h2"),
        tfss.SparseSplitDense(10, activation="softmax",
                              masked_input_grad=True, name="out"),
    ])
    return model


def _step_graph(model, x, y):
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    opt = keras.optimizers.Adam(1e-3)
    opt.build(model.trainable_variables)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            probs = model(x, training=True)
            loss = loss_fn(y, probs) + tf.add_n(model.losses or [0.0])
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply(grads, model.trainable_variables)
        return loss

    graph = step.get_concrete_function(x, y).graph
    return step, graph


def _producer(graph, tensor_name):
    return graph.get_operation_by_name(tensor_name.split(":")[0].lstrip("^"))


@pytest.mark.parametrize("fat", [False, True], ids=["relu", "fatrelu"])
def test_no_float32_round_trips_around_our_ops(mixed_bfloat16_policy, rng,
                                               fat):
    model = _mlp(fat)
    x = tf.constant(np.abs(sparse_normal(rng, (16, 48), 0.6)), tf.float32)
    y = tf.constant(rng.integers(0, 10, 16), tf.int32)
    step, graph = _step_graph(model, x, y)
    ops = graph.get_operations()
    ours = [op for op in ops if op.type in _OURS]
    assert {op.type for op in ours} >= {"TfSparseSplit>SparseSplitMatMul",
                                        "TfSparseSplit>SparseSplitSddmm"}
    for op in ours:
        assert op.get_attr("T") == tf.bfloat16, op.name
        # Inputs: bfloat16 activations/gradients straight from bfloat16
        # ops; a Cast feeding one is a variable's autocast (its input
        # reads a variable), the model input's (as Keras casts it for
        # Dense) or the threshold/cutoff scalar.
        for t in op.inputs:
            src = t.op
            if src.type == "Cast":
                up = src.inputs[0].op
                assert (up.type in ("ReadVariableOp", "Placeholder")
                        or src.inputs[0].shape.rank == 0), (op.name, src.name)
        # Outputs: never widened to float32 and back.
        for out in op.outputs:
            for consumer in out.consumers():
                if consumer.type == "Cast":
                    for c2 in consumer.outputs[0].consumers():
                        assert c2.type != "Cast", (op.name, consumer.name)
    # No Cast pair anywhere that narrows what it just widened (or back).
    for op in ops:
        if op.type == "Cast" and op.inputs[0].op.type == "Cast":
            inner = op.inputs[0].op
            assert not (inner.get_attr("SrcT") == op.get_attr("DstT")), op.name
    loss = step(x, y)
    assert np.isfinite(loss.numpy())


def test_fatrelu_fused_with_bias_in_train_step(mixed_bfloat16_policy, rng):
    model = _mlp(True)
    x = tf.constant(np.abs(sparse_normal(rng, (16, 48), 0.6)), tf.float32)
    y = tf.constant(rng.integers(0, 10, 16), tf.int32)
    _, graph = _step_graph(model, x, y)
    ops = graph.get_operations()
    types = [op.type for op in ops]
    assert types.count("TfSparseSplit>BiasFatRelu") == 2
    assert types.count("TfSparseSplit>BiasFatReluGrad") == 2
    for op in ops:
        if op.type == "TfSparseSplit>BiasFatRelu":
            # Fed by the product, which has no bias and no activation of
            # its own (the pass adds the bias).
            prod = op.inputs[0].op
            assert prod.type == "TfSparseSplit>SparseSplitMatMul"
            assert prod.get_attr("num_bias") == 0
            assert prod.get_attr("activation") == b"none"
    # The FATReLU's own element-wise graph (compare, select, the penalty's
    # widening sum, the gradient's ReluGrad) is not there.
    for name in ("ReluGrad", "Relu"):
        assert name not in types
    for op in ops:
        if op.type in ("Greater", "SelectV2"):
            assert op.outputs[0].shape.num_elements() in (None, 1) or \
                op.outputs[0].shape.rank == 0 or \
                op.outputs[0].shape.num_elements() <= 4096, op.name


def _cutoff_in_gap(values, lo=0.05, hi=0.4):
    """A cutoff in ``[lo, hi]`` halfway across the widest gap between the
    sorted ``values`` there, and the gap's half-width: no value lies
    within it, so rounding cannot move one across the cutoff."""
    v = np.sort(values.ravel())
    v = v[(v >= lo) & (v <= hi)]
    gaps = np.diff(v)
    i = int(np.argmax(gaps))
    return float((v[i] + v[i + 1]) / 2), float(gaps[i] / 2)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16",
                                    "mixed_float16"])
def test_dense_fatrelu_matches_tf_expression(rng, policy):
    """SparseSplitDense(FATReLU) through BiasFatRelu: output, penalty and
    gradients against Dense + where(x > cutoff) in TF ops, with the cutoff
    in a gap of the pre-activations (no value rounds across it)."""
    old = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(policy)
    try:
        dt = keras.mixed_precision.Policy(policy).compute_dtype
        fat = tfss.FATReLU(l1=0.5)
        ours = tfss.SparseSplitDense(24, activation=fat)
        ref = keras.layers.Dense(24)
        x = tf.constant(np.abs(sparse_normal(rng, (13, 40), 0.7)), dt)
        ours.build(x.shape)
        ref.build(x.shape)
        ours.bias.assign(rng.normal(0.0, 0.1, 24).astype(np.float32))
        ref.set_weights([ours.kernel.numpy(), ours.bias.numpy()])
        # The operands as both layers multiply them (rounded to dt).
        k64, b64 = (np.asarray(tf.cast(tf.cast(v, dt), tf.float64))
                    for v in (ours.kernel, ours.bias))
        pre64 = np.asarray(tf.cast(x, tf.float64)) @ k64 + b64
        cutoff, half_gap = _cutoff_in_gap(pre64)
        tol = {"bfloat16": 2.0 ** -6, "float16": 2.0 ** -9}.get(dt, 1e-5)
        # Both round the product and the bias add once each (< 2 ulps).
        assert half_gap > tol / 4
        fat.set_controls(cutoff=cutoff)
        with tf.GradientTape(persistent=True) as tape:
            y = ours(x, training=True)
            pre = ref(x)
            cut = tf.cast(fat.cutoff_var, pre.dtype)
            y_ref = tf.where(pre > cut, pre, tf.zeros_like(pre))
            pen_ref = 0.5 * tf.reduce_mean(tf.cast(y_ref, tf.float32))
            loss = tf.reduce_sum(tf.cast(y, tf.float32)) + fat.losses[-1]
            loss_ref = tf.reduce_sum(tf.cast(y_ref, tf.float32)) + pen_ref
        assert y.dtype == dt
        yo, yr = (np.asarray(tf.cast(t, tf.float32)) for t in (y, y_ref))
        assert 0 < np.count_nonzero(yo) < yo.size
        np.testing.assert_array_equal(yo > 0, yr > 0)
        np.testing.assert_allclose(yo, yr, rtol=tol,
                                   atol=tol * np.abs(yr).max())
        np.testing.assert_allclose(float(fat.losses[-1]), float(pen_ref),
                                   rtol=4 * tol)
        for a, b in zip(tape.gradient(loss, ours.trainable_variables),
                        tape.gradient(loss_ref, ref.trainable_variables)):
            assert a.dtype == "float32"
            np.testing.assert_allclose(
                a.numpy(), b.numpy(), rtol=8 * tol,
                atol=8 * tol * float(np.abs(b.numpy()).max()))
    finally:
        keras.mixed_precision.set_global_policy(old)


def test_dense_fatrelu_without_bias_keeps_its_call(rng):
    """Without a bias the FATReLU runs as its own layer call (the op path
    needs a bias to fuse): same values."""
    fat = tfss.FATReLU(cutoff=0.2)
    layer = tfss.SparseSplitDense(8, activation=fat, use_bias=False)
    x = tf.constant(np.abs(sparse_normal(rng, (5, 6), 0.5)), tf.float32)
    y = layer(x, training=True)
    pre = tf.matmul(x, layer.kernel)
    np.testing.assert_allclose(y.numpy(), tf.where(pre > 0.2, pre, 0).numpy(),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("m", [16, 17, 4096])
def test_order_statistic_equals_sort(rng, m):
    v = tf.constant(rng.standard_normal(m).astype(np.float32))
    for frac in (0.0, 0.05, 0.5, 0.5001, 0.9, 0.999, 1.0):
        i = int(np.floor(np.float32(frac) * np.float32(m - 1)))
        got = _order_statistic(v, tf.constant(frac, tf.float32)).numpy()
        assert got == np.sort(v.numpy())[i], (m, frac)
