"""The ops' cheap analysis (``full_stats=False``: a strided sample or no
count at all on calls the cost model keeps dense) and the all-dense fused
kernel, against float64 references: the answer never depends on how much a
call counted, and the statistics say what was counted."""

import itertools

import numpy as np
import pytest
import tensorflow as tf

import tf_sparse_split as tfss
from tf_sparse_split.ops.sddmm import sparse_split_sddmm
from tf_sparse_split.tuning import stats as S
from tf_sparse_split.testing import random_sparse, reference_matmul, relative_error

pytestmark = pytest.mark.usefixtures("op_library")


def _check_stats(st, m, k, a_opnnz):
    """Invariants of one call's statistics under any analysis mode."""
    mode = st[S.ANALYSIS]
    assert mode in (S.ANALYSIS_FULL, S.ANALYSIS_SAMPLED, S.ANALYSIS_SKIPPED)
    assert st[S.ROWS_DENSE] + st[S.ROWS_SPARSE] == m
    if mode == S.ANALYSIS_FULL:
        assert st[S.NNZ] == a_opnnz
        assert st[S.HISTOGRAM].sum() == m
        return mode
    # Not counted fully: every row dense, nothing compacted.
    assert st[S.ROWS_DENSE] == m and st[S.ROWS_SPARSE] == 0
    assert st[S.NNZ_SPARSE] == 0 and st[S.ZERO_COLS_SKIPPED] == 0
    assert st[S.THRESHOLD] == 0.0
    if mode == S.ANALYSIS_SKIPPED:
        assert np.isnan(st[S.NNZ]) and st[S.HISTOGRAM].sum() == 0
    else:
        assert st[S.HISTOGRAM].sum() == pytest.approx(m)
        assert 0 <= st[S.NNZ] <= m * k
    return mode


CASES = [(16, 64, 4), (128, 256, 10), (200, 300, 64), (37, 500, 129)]


@pytest.mark.parametrize("m,k,n", CASES)
@pytest.mark.parametrize("sparsity", [0.0, 0.6, 0.97])
def test_cheap_analysis_results_equal_reference(m, k, n, sparsity):
    """Repeated automatic calls (calibration, then sampled or skipped
    analyses and the periodic full counts) equal tf.matmul's float64
    reference on fresh inputs every call, both transposes."""
    rng = np.random.default_rng([m, k, n, int(sparsity * 100)])
    for ta, tb in itertools.product([False, True], repeat=2):

        @tf.function
        def f(x, y):
            return tfss.sparse_split_matmul(x, y, -1.0, ta, tb, return_stats=True,
                                            full_stats=False)

        for _ in range(12):
            a = random_sparse((m, k), sparsity, rng, np.float32)
            a[rng.integers(m), rng.integers(k)] = 1.5     # a real nonzero
            b = rng.standard_normal((k, n)).astype(np.float32)
            x, y = (a.T.copy() if ta else a), (b.T.copy() if tb else b)
            got, st = f(x, y)
            assert relative_error(got, reference_matmul(x, y, ta, tb)) <= 1e-5
            _check_stats(st.numpy(), m, k, np.count_nonzero(a))


def test_tiny_product_stops_counting():
    """16 x 64 x 4: the whole GEMM is microseconds, far below the gain any
    other plan must show (min_gain_s): after the first (full, calibrating)
    call the op counts nothing, and full_stats=True still counts every
    call exactly."""
    rng = np.random.default_rng(4)
    a = random_sparse((16, 64), 0.5, rng, np.float32)
    b = rng.standard_normal((64, 4)).astype(np.float32)

    @tf.function
    def cheap(x):
        return tfss.sparse_split_matmul(x, b, -1.0, return_stats=True,
                                        full_stats=False)

    @tf.function
    def full(x):
        return tfss.sparse_split_matmul(x, b, -1.0, return_stats=True)

    modes = [cheap(a)[1].numpy()[S.ANALYSIS] for _ in range(10)]
    assert modes[0] == S.ANALYSIS_FULL
    assert S.ANALYSIS_SKIPPED in modes[1:]
    for _ in range(10):
        got, st = full(a)
        st = st.numpy()
        assert st[S.ANALYSIS] == S.ANALYSIS_FULL
        assert st[S.NNZ] == np.count_nonzero(a)
        assert relative_error(got, reference_matmul(a, b)) <= 1e-5


def test_full_count_comes_back_periodically():
    """Statistics and the model stay fresh: among the cheap calls a full
    count recurs at least every AnalysisPolicy.max_period calls."""
    from tf_sparse_split import _kernels as K

    period = K.analysis_policy_defaults()["max_period"]
    rng = np.random.default_rng(6)
    a = random_sparse((16, 64), 0.5, rng, np.float32)
    b = rng.standard_normal((64, 4)).astype(np.float32)

    @tf.function
    def cheap(x):
        return tfss.sparse_split_matmul(x, b, -1.0, return_stats=True,
                                        full_stats=False)[1]

    modes = [cheap(a).numpy()[S.ANALYSIS] for _ in range(period + 2)]
    full = [i for i, v in enumerate(modes) if v == S.ANALYSIS_FULL]
    assert full[0] == 0 and len(full) >= 2
    assert all(j - i <= period for i, j in zip(full, full[1:]))


def test_return_stats_defaults_to_full_stats():
    rng = np.random.default_rng(5)
    a = random_sparse((16, 64), 0.5, rng, np.float32)
    b = rng.standard_normal((64, 4)).astype(np.float32)
    for _ in range(6):
        _, st = tfss.sparse_split_matmul(a, b, return_stats=True)
        assert st.numpy()[S.ANALYSIS] == S.ANALYSIS_FULL
        assert st.numpy()[S.NNZ] == np.count_nonzero(a)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("activation", ["none", "relu", "relu6"])
@pytest.mark.parametrize("thr", [0.0, -1.0])
def test_all_dense_with_bias_equals_reference(dtype, activation, thr):
    """No zeros in a: every row dense, nothing compacted -- the fused
    kernel's case (float32) -- equal to act(a @ b + bias) in float64."""
    rng = np.random.default_rng([int(thr + 2), len(activation)])
    m, k, n = 33, 70, 29
    for _ in range(4):
        a = (rng.standard_normal((m, k)) + 3.0).astype(dtype)
        b = rng.standard_normal((k, n)).astype(dtype)
        bias = (4 * rng.standard_normal(n)).astype(dtype)
        got, st = tfss.sparse_split_matmul(a, b, thr, bias=bias,
                                           activation=activation,
                                           return_stats=True, full_stats=False)
        ref = a.astype(np.float64) @ b.astype(np.float64) + bias
        if activation == "relu":
            ref = np.maximum(ref, 0)
        elif activation == "relu6":
            ref = np.clip(ref, 0, 6)
        assert st.numpy()[S.ROWS_DENSE] == m
        assert relative_error(got, ref) <= (1e-5 if dtype == np.float32 else 1e-12)


@pytest.mark.parametrize("activation", ["none", "relu"])
def test_all_dense_with_bias_nan_inf_like_tf(activation):
    """NaN/Inf in a go through the all-dense bias path as in TF's own graph
    for act(matmul + bias) (a tf.function: Grappler fuses it, and oneDNN's
    fused relu maps NaN to 0 in float32)."""
    rng = np.random.default_rng(8)
    a = (rng.standard_normal((8, 16)) + 3.0).astype(np.float32)
    a[2, 3] = np.nan
    a[5, 1] = np.inf
    b = rng.standard_normal((16, 6)).astype(np.float32)
    bias = rng.standard_normal(6).astype(np.float32)
    got = tfss.sparse_split_matmul(a, b, 0.0, bias=bias, activation=activation)
    act = tf.nn.relu if activation == "relu" else tf.identity
    ref = tf.function(lambda x, w, c: act(tf.nn.bias_add(tf.matmul(x, w), c)))(
        a, b, bias)
    got, ref = got.numpy(), ref.numpy()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(ref))
    fin = np.isfinite(ref)
    np.testing.assert_allclose(got[fin], ref[fin], rtol=1e-5, atol=1e-5)


def test_output_layer_gradients_repeated_match_tf():
    """A 10-unit output layer's gradients (weight gradient through the op
    with full_stats=False, input gradient through tf.matmul) over repeated
    steps equal tf.matmul's gradients."""
    rng = np.random.default_rng(12)
    w = tf.constant(rng.standard_normal((256, 10)).astype(np.float32))
    bias = tf.constant(rng.standard_normal(10).astype(np.float32))

    @tf.function
    def grads(x):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch([x, w, bias])
            ours = tf.reduce_sum(tf.sin(tfss.sparse_split_matmul(
                x, w, -1.0, bias=bias)))
            ref = tf.reduce_sum(tf.sin(tf.matmul(x, w) + bias))
        return ([tape.gradient(ours, v) for v in (x, w, bias)],
                [tape.gradient(ref, v) for v in (x, w, bias)])

    for sparsity in (0.0, 0.5, 0.9) * 4:
        x = tf.constant(random_sparse((64, 256), sparsity, rng, np.float32))
        g_ours, g_ref = grads(x)
        for go, gr in zip(g_ours, g_ref):
            assert relative_error(go, gr) <= 1e-5


@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.95])
def test_sddmm_cheap_analysis_equals_reference(sparsity):
    rng = np.random.default_rng(int(sparsity * 100))
    m, k, n = 64, 200, 10

    @tf.function
    def f(mask, x, y):
        return sparse_split_sddmm(mask, x, y, -1.0, return_stats=True,
                                  full_stats=False)

    for _ in range(10):
        mask = random_sparse((m, k), sparsity, rng, np.float32)
        mask[0, 0] = 1.0
        x = rng.standard_normal((m, n)).astype(np.float32)
        y = rng.standard_normal((k, n)).astype(np.float32)
        got, st = f(mask, x, y)
        ref = (mask != 0) * (x.astype(np.float64) @ y.astype(np.float64).T)
        assert relative_error(got, ref) <= 1e-5
        _check_stats(st.numpy(), m, k, np.count_nonzero(mask))


def test_layer_records_full_stats_in_training_only():
    """A SparseSplitDense layer asks for exact statistics when it records
    them (training calls): its latest statistics are a full count."""
    rng = np.random.default_rng(3)
    layer = tfss.SparseSplitDense(10, activation="relu")
    x = tf.constant(random_sparse((32, 64), 0.5, rng, np.float32))

    @tf.function
    def train_step(v):
        return layer(v, training=True)

    @tf.function
    def infer(v):
        return layer(v, training=False)

    for _ in range(5):
        train_step(x)
        y = infer(x)
    st = layer.latest_stats_vector()
    assert st[S.ANALYSIS] == S.ANALYSIS_FULL
    assert st[S.NNZ] == np.count_nonzero(x.numpy())
    ref = np.maximum(x.numpy() @ layer.kernel.numpy() + layer.bias.numpy(), 0)
    assert relative_error(y, ref) <= 1e-5
