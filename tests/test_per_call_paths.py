"""The ops' per-call paths that depend on how the graph uses them, and the
recalibration rule of the cost model.

* A graph that drops the statistics output (a gradient product, a caller
  without ``return_stats``) lets the op skip allocating it
  (``OpKernelContext::output_required``): the product must be the same, in
  every path (skipped analysis, full count, forced dense, forced sparse,
  fused bias/activation), for the matmul, SDDMM and convolution ops.
* ``recalibration_due`` (``RecalibrationDue`` of ``cc/core/cost_model.h``)
  decides when a calibrated family times its paths again; checked on
  recorded densities and call counts (nothing timed).
"""

import numpy as np
import pytest
import tensorflow as tf
from _helpers import kernels_or_skip, sparse_normal

import tf_sparse_split as tfss
from tf_sparse_split.tuning import stats as S


@pytest.mark.parametrize("threshold", [-1.0, 0.0, 1.0, 0.5])
@pytest.mark.parametrize("zeros", [0.0, 0.6, 0.97])
@pytest.mark.parametrize("transpose_a", [False, True])
def test_matmul_without_stats_consumer_matches_reference(threshold, zeros,
                                                         transpose_a):
    rng = np.random.default_rng(7)
    m, k, n = 37, 129, 10
    a = sparse_normal(rng, (k, m) if transpose_a else (m, k), zeros)
    b = rng.standard_normal((k, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    op_a = a.T if transpose_a else a
    ref = op_a.astype(np.float64) @ b.astype(np.float64)

    @tf.function
    def product(x, w):  # the statistics output has no consumer
        return tfss.sparse_split_matmul(x, w, threshold,
                                        transpose_a=transpose_a)

    @tf.function
    def with_stats(x, w):
        return tfss.sparse_split_matmul(x, w, threshold,
                                        transpose_a=transpose_a,
                                        return_stats=True)

    for _ in range(3):  # first call calibrates; later ones may skip the count
        got = product(tf.constant(a), tf.constant(b)).numpy()
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)
    got, stats = with_stats(tf.constant(a), tf.constant(b))
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-5, atol=1e-4)
    stats = stats.numpy()
    assert stats.shape == (S.NUM_STATS,)
    assert (stats[S.M], stats[S.K], stats[S.N]) == (m, k, n)
    assert stats[S.ROWS_DENSE] + stats[S.ROWS_SPARSE] == m

    if not transpose_a:
        @tf.function
        def fused(x, w, c):
            return tfss.sparse_split_matmul(x, w, threshold, bias=c,
                                            activation="relu")

        got = fused(tf.constant(a), tf.constant(b), tf.constant(bias))
        np.testing.assert_allclose(got.numpy(), np.maximum(ref + bias, 0),
                                   rtol=1e-5, atol=1e-4)


def test_gradients_drop_the_statistics_of_their_products():
    """The gradient's products (threshold -1, statistics unused) give TF's
    gradients."""
    rng = np.random.default_rng(3)
    a = tf.constant(np.maximum(sparse_normal(rng, (64, 96), 0.5), 0))
    b = tf.constant(rng.standard_normal((96, 80)).astype(np.float32))

    @tf.function
    def grads(f):
        with tf.GradientTape() as tape:
            tape.watch([a, b])
            loss = tf.reduce_sum(tf.sin(f(a, b)))
        return tape.gradient(loss, [a, b])

    ours = grads(lambda x, y: tfss.sparse_split_matmul(x, y, -1.0))
    ref = grads(tf.matmul)
    for o, r in zip(ours, ref):
        np.testing.assert_allclose(o.numpy(), r.numpy(), rtol=1e-4,
                                   atol=1e-4)


def test_sddmm_and_conv_without_stats_consumer_match_reference():
    rng = np.random.default_rng(5)
    x = sparse_normal(rng, (33, 70), 0.7)
    dy = rng.standard_normal((33, 20)).astype(np.float32)
    w = rng.standard_normal((70, 20)).astype(np.float32)
    from tf_sparse_split.ops.sddmm import sparse_split_sddmm

    @tf.function
    def sddmm(m, g, b):
        return sparse_split_sddmm(m, g, b, -1.0)

    ref = (x != 0) * (dy.astype(np.float64) @ w.T.astype(np.float64))
    for _ in range(2):
        got = sddmm(tf.constant(x), tf.constant(dy), tf.constant(w))
        np.testing.assert_allclose(got.numpy(), ref, rtol=1e-5, atol=1e-4)

    img = sparse_normal(rng, (3, 9, 9, 5), 0.6)
    f = rng.standard_normal((3, 3, 5, 4)).astype(np.float32)
    from tf_sparse_split.ops.conv2d import sparse_split_conv2d

    @tf.function
    def conv(v, k):
        return sparse_split_conv2d(v, k, strides=[1, 1, 1, 1],
                                   padding="SAME", threshold=-1.0)

    ref = tf.nn.conv2d(tf.constant(img, tf.float64), tf.constant(f, tf.float64),
                       1, "SAME").numpy()
    for _ in range(2):
        got = conv(tf.constant(img), tf.constant(f))
        np.testing.assert_allclose(got.numpy(), ref, rtol=1e-5, atol=1e-4)


K = kernels_or_skip()


@pytest.mark.parametrize("cal, now, calls, recals, due", [
    (0.5, 0.12, 32, 0, True),     # 50% -> 88% zeros, long enough: re-time
    (0.12, 0.5, 32, 0, True),     # and back
    (0.5, 0.12, 31, 0, False),    # too soon after the calibration
    (0.5, 0.3, 500, 0, False),    # moved, but less than 2x
    (0.02, 0.009, 500, 0, False),  # 2x, but by less than 0.05
    (0.5, 0.1, 500, 8, False),    # recalibrated often enough already
    (-1.0, 0.1, 500, 0, False),   # calibrated elsewhere: no record
    (0.5, float("nan"), 500, 0, False),
])
def test_recalibration_due(cal, now, calls, recals, due):
    assert K.recalibration_due(cal, now, calls, recals) is due


# -- Recalibration records per op instance -----------------------------------
#
# A family is shared by every op of its key; the MLP's two weight gradients
# (x^T dY at ~19% nonzeros and h1^T dY at 50% -> 9%) have one family. The
# rule compares each op's density with its own reference (its density on its
# first call after the family's latest calibration), so the alternating calls
# of the two ops never look like a density change.

_A, _B, _A2, _B2 = 0, 1, 2, 3  # op ids: natural model's, then target model's


def _recorded_calls():
    """The recorded weight-gradient densities as one family's calls: per
    step hidden_2's gradient then hidden_1's (backprop order), the natural
    model's ops then the target model's (new op instances)."""
    import json
    import os

    path = os.path.join(os.path.dirname(__file__), "data",
                        "mlp_weight_grad_densities.json")
    with open(path) as f:
        rec = json.load(f)
    calls = []
    for a, b in rec["natural"]:
        calls += [(_B, b), (_A, a)]
    for a, b in rec["target"]:
        calls += [(_B2, b), (_A2, a)]
    return calls, len(rec["natural"])


def test_recalibration_recorded_mlp_weight_gradients():
    calls, natural = _recorded_calls()
    fired = K.recalibration_calls(calls)
    # Only hidden_2's gradient under the sparsity target moves 2x (0.50 ->
    # 0.09); hidden_1's stays at 0.19-0.20 and the natural phase moves < 2x.
    # One density per family instead fired on the natural phase's 33rd call
    # (hidden_1's 0.19 against hidden_2's 0.50) and then alternately on the
    # two ops until the limit of 8.
    assert fired, "the target phase's 2x density drop must recalibrate"
    assert all(calls[i][0] == _B2 for i in fired), [calls[i] for i in fired]
    assert all(i >= 2 * natural for i in fired)
    assert len(fired) <= 3
    # Each recalibration is >= 32 of that op's calls after its reference and
    # at a density below half of it.
    ref_i = 2 * natural
    for i in fired:
        own = [j for j in range(ref_i, i) if calls[j][0] == _B2]
        assert len(own) >= 32
        assert calls[i][1] <= 0.5 * calls[own[0]][1] + 1e-12
        ref_i = i


def test_recalibration_alternating_ops_at_constant_densities():
    # Two ops of one family, each at its own steady density: never.
    calls = [(_A, 0.19) if i % 2 else (_B, 0.5) for i in range(2000)]
    assert K.recalibration_calls(calls) == []


def test_recalibration_one_op_drifts_other_steady():
    # hidden_2's gradient drops from 0.5 to 0.08 at call 200 (its 100th
    # since it calibrated the family); hidden_1's stays: one recalibration,
    # on the first dropped call, and none after (the new reference of the
    # drifted op is the new density; the other op restarts from its own).
    calls = []
    for step in range(400):
        calls.append((_B, 0.5 if step < 100 else 0.08))
        calls.append((_A, 0.19))
    assert K.recalibration_calls(calls) == [200]
    # A drop sooner than 32 calls after the reference waits for the 32nd.
    calls = [(_B, 0.5)] + [(_B, 0.08)] * 40
    assert K.recalibration_calls(calls) == [32]


def test_recalibration_limit_per_family():
    # One op oscillating 0.5 <-> 0.1 every 40 calls: at most 8 in total.
    calls = [(_A, 0.5 if (i // 40) % 2 == 0 else 0.1) for i in range(4000)]
    fired = K.recalibration_calls(calls)
    assert len(fired) == 8
    assert all(b - a >= 32 for a, b in zip(fired, fired[1:]))


def test_recalibration_calls_rejects_bad_pairs():
    with pytest.raises(ValueError):
        K.recalibration_calls([(0, 0.5, 1)])
