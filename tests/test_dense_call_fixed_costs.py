"""The all-dense call's own path, which runs with no per-call set-up beyond
TF's kernel and the decision:

* every row dense and nothing compacted runs TF's MatMul on the op's own
  context (``TfKernel::RunOnContext``: the op's inputs 0 and 1 as TF's
  kernel inputs, its output 0 as the op's output 0): the product must equal
  the float64 reference in every dtype and transpose, with and without the
  epilogue, whether or not a node reads the statistics, and the op's other
  output (the statistics) must stay intact;
* one op instance keeps the cost-model family of its last call's sizes
  (``FamilyCache``): a graph with a dynamic batch dimension that changes
  shape from call to call must still compute each call right and describe
  it in its statistics;
* the cost problem is written into the statistics whenever a node reads
  them (``SplitCall::Finish`` skips it only for statistics nobody reads).

Nothing here is timed; which analysis an automatic call takes depends on
the calibration, so those calls are checked for their results only, and
the deterministic all-dense path is forced by ``threshold=0.0`` on inputs
with zeros but no all-zero row or column.
"""

import numpy as np
import pytest
import tensorflow as tf
from _helpers import sparse_normal

import tf_sparse_split as tfss
from tf_sparse_split.ops.sddmm import sparse_split_sddmm
from tf_sparse_split.tuning import stats as S

TOL = {tf.float32: (1e-5, 1e-4), tf.float64: (1e-12, 1e-10),
       tf.bfloat16: (2e-2, 5e-1), tf.float16: (2e-3, 2e-2)}


def _no_dead_rows_or_columns(x):
    """x with one nonzero put back in every all-zero row and column."""
    x = x.copy()
    for i in np.flatnonzero(~x.any(axis=1)):
        x[i, 0] = 1.0
    for j in np.flatnonzero(~x.any(axis=0)):
        x[0, j] = 1.0
    return x


def _operands(rng, m, k, n, ta, tb, zeros):
    a = _no_dead_rows_or_columns(sparse_normal(rng, (m, k), zeros))
    b = rng.standard_normal((k, n)).astype(np.float32)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    return (a.T.copy() if ta else a), (b.T.copy() if tb else b), ref


def _reference(ref, bias, activation):
    out = ref if bias is None else ref + bias.astype(np.float64)
    if activation == "relu":
        out = np.maximum(out, 0.0)
    return out


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64, tf.bfloat16,
                                   tf.float16])
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False),
                                   (False, True), (True, True)])
@pytest.mark.parametrize("epilogue", ["none", "relu", "bias", "bias_relu"])
def test_all_dense_call_matches_reference(dtype, ta, tb, epilogue):
    rng = np.random.default_rng(11)
    m, k, n = 13, 70, 10
    a, b, ref = _operands(rng, m, k, n, ta, tb, zeros=0.5)
    bias = (rng.standard_normal(n).astype(np.float32)
            if epilogue.startswith("bias") else None)
    activation = "relu" if epilogue.endswith("relu") else None
    if bias is not None:
        bias_c = tf.cast(tf.constant(bias), dtype)
        bias = tf.cast(bias_c, tf.float64).numpy()
    want = _reference(
        tf.cast(tf.cast(a if not ta else a.T, dtype), tf.float64).numpy()
        @ tf.cast(tf.cast(b if not tb else b.T, dtype), tf.float64).numpy(),
        bias, activation)
    x, w = tf.cast(tf.constant(a), dtype), tf.cast(tf.constant(b), dtype)
    kw = dict(transpose_a=ta, transpose_b=tb, activation=activation,
              bias=None if bias is None else bias_c)

    @tf.function
    def product(x, w, threshold):  # nothing reads the statistics
        return tfss.sparse_split_matmul(x, w, threshold, **kw)

    @tf.function
    def with_stats(x, w, threshold, full_stats):
        return tfss.sparse_split_matmul(x, w, threshold, return_stats=True,
                                        full_stats=full_stats, **kw)

    rtol, atol = TOL[dtype]
    for threshold in (0.0, -1.0):
        for _ in range(3):  # automatic: calibrates, then may skip the count
            got = product(x, w, tf.constant(threshold))
            assert got.dtype == dtype and got.shape == (m, n)
            np.testing.assert_allclose(tf.cast(got, tf.float64).numpy(),
                                       want, rtol=rtol, atol=atol)
            for full_stats in (True, False):
                got, stats = with_stats(x, w, tf.constant(threshold),
                                        full_stats)
                np.testing.assert_allclose(tf.cast(got, tf.float64).numpy(),
                                           want, rtol=rtol, atol=atol)
                stats = stats.numpy()
                assert stats.shape == (S.NUM_STATS,)
                assert (stats[S.M], stats[S.K], stats[S.N]) == (m, k, n)
                assert stats[S.ROWS_DENSE] + stats[S.ROWS_SPARSE] == m
                if threshold == 0.0:
                    # Every row has a nonzero, no column is all zero: the
                    # plain all-dense product, exactly counted.
                    assert stats[S.ROWS_DENSE] == m
                    assert stats[S.ZERO_COLS_SKIPPED] == 0
                    assert stats[S.ANALYSIS] == S.ANALYSIS_FULL
                    assert stats[S.NNZ] == np.count_nonzero(a)
                # The cost problem is written for a consumed vector.
                assert stats[S.K_LIVE] == k
                assert stats[S.DENSE_ALLOWED] == 1.0
                assert stats[S.DENSE_FLOPS_PER_ELEM] == 2.0 * n


def test_all_dense_gradients_match_tf():
    """The gradient products (a^T dY through the op, its statistics read by
    nothing) on the all-dense path, against tf.matmul's gradients."""
    rng = np.random.default_rng(5)
    a = tf.constant(_no_dead_rows_or_columns(
        sparse_normal(rng, (16, 40), 0.4)))
    b = tf.constant(rng.standard_normal((40, 10)).astype(np.float32))
    up = tf.constant(rng.standard_normal((16, 10)).astype(np.float32))

    @tf.function
    def grads(x, w, threshold):
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            y = tfss.sparse_split_matmul(x, w, threshold)
        return tape.gradient(y, [x, w], output_gradients=up)

    with tf.GradientTape() as tape:
        tape.watch([a, b])
        y = tf.matmul(a, b)
    want = tape.gradient(y, [a, b], output_gradients=up)
    for threshold in (0.0, -1.0, -1.0, -1.0):
        got = grads(a, b, tf.constant(threshold))
        for g, r in zip(got, want):
            np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=1e-5,
                                       atol=1e-5)


@pytest.mark.parametrize("op", ["matmul", "sddmm"])
def test_one_op_instance_changing_shapes(op):
    """One op instance (a graph with dynamic dimensions) called with
    batches in different M buckets and different K: each call right, its
    statistics its own sizes."""
    rng = np.random.default_rng(3)
    n = 8
    spec = tf.TensorSpec([None, None], tf.float32)

    @tf.function(input_signature=[spec, spec, spec])
    def matmul(x, w, unused):
        return tfss.sparse_split_matmul(x, w, -1.0, return_stats=True,
                                        full_stats=False)

    @tf.function(input_signature=[spec, spec, spec])
    def sddmm(mask, x, w):
        return sparse_split_sddmm(mask, x, w, -1.0, return_stats=True,
                                  full_stats=False)

    for m, k in [(1, 33), (7, 33), (128, 33), (7, 33), (300, 65), (1, 65),
                 (128, 33), (7, 65)]:
        a = sparse_normal(rng, (m, k), 0.5)
        if op == "matmul":
            b = rng.standard_normal((k, n)).astype(np.float32)
            got, stats = matmul(tf.constant(a), tf.constant(b),
                                tf.zeros([0, 0]))
            ref = a.astype(np.float64) @ b.astype(np.float64)
            sizes = (m, k, n)
        else:
            x = rng.standard_normal((m, n)).astype(np.float32)
            b = rng.standard_normal((k, n)).astype(np.float32)
            got, stats = sddmm(tf.constant(a), tf.constant(x), tf.constant(b))
            ref = (a != 0) * (x.astype(np.float64) @ b.astype(np.float64).T)
            sizes = (m, k, n)
        np.testing.assert_allclose(got.numpy(), ref, rtol=1e-5, atol=1e-4)
        stats = stats.numpy()
        assert (stats[S.M], stats[S.K], stats[S.N]) == sizes
        assert stats[S.ROWS_DENSE] + stats[S.ROWS_SPARSE] == m
        assert stats[S.CALIBRATED] == 1.0


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("epilogue", ["none", "bias_relu"])
def test_calls_without_a_count_describe_every_row_dense(ta, epilogue):
    """A call that counts nothing or a sample (ANALYSIS skipped / sampled)
    runs TF's kernel on the op's inputs and builds no row lists
    (SplitCall::SkipAnalysis / AcceptSample): its statistics must still say
    every row dense, none sparse, nothing compacted, the threshold 0, and
    its product must be the reference, call after call (a 16 x 64 x 4
    product: the count is skipped after the first call; with 99% zeros
    too, where a full count would see dead columns). float32: in bfloat16
    oneDNN's kernel at this size runs ~10x its calibrated time inside a
    graph and the op rightly leaves the dense path."""
    dtype = tf.float32
    rng = np.random.default_rng(21)
    m, k, n = 16, 64, 4
    b = rng.standard_normal((k, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    kw = {}
    if epilogue == "bias_relu":
        kw = dict(bias=tf.cast(tf.constant(bias), dtype), activation="relu")
    w = tf.cast(tf.constant(b), dtype)

    @tf.function
    def cheap(x):
        return tfss.sparse_split_matmul(x, w, -1.0, transpose_a=ta,
                                        return_stats=True, full_stats=False,
                                        **kw)

    rtol, atol = TOL[dtype]
    without_count = 0
    for zeros in (0.5, 0.99):
        a = sparse_normal(rng, (m, k), zeros)
        a[0, 0] = 1.0  # a real nonzero
        ac = tf.cast(tf.constant(a), dtype)
        a64 = tf.cast(ac, tf.float64).numpy()
        want = a64 @ tf.cast(w, tf.float64).numpy()
        if epilogue == "bias_relu":
            want = np.maximum(
                want + tf.cast(kw["bias"], tf.float64).numpy(), 0.0)
        x = tf.constant(tf.transpose(ac).numpy()) if ta else ac
        for _ in range(12):
            got, stats = cheap(x)
            np.testing.assert_allclose(tf.cast(got, tf.float64).numpy(), want,
                                       rtol=rtol, atol=atol)
            st = stats.numpy()
            assert (st[S.M], st[S.K], st[S.N]) == (m, k, n)
            if st[S.ANALYSIS] == S.ANALYSIS_FULL:
                assert st[S.NNZ] == np.count_nonzero(a64)
                continue
            without_count += 1
            assert st[S.ROWS_DENSE] == m and st[S.ROWS_SPARSE] == 0
            assert st[S.NNZ_SPARSE] == 0 and st[S.ZERO_COLS_SKIPPED] == 0
            assert st[S.THRESHOLD] == 0.0
            # The cost problem is still written (a node reads the vector).
            assert st[S.K_LIVE] == k and st[S.CALIBRATED] == 1.0
    assert without_count >= 12


def test_family_model_reads_are_snapshots_of_its_records():
    """FamilyModel keeps its scaled terms and counting cost computed after
    every record (what a call reads under one lock): terms() and
    count_seconds_per_elem() equal the medians of the records at every
    step, over more records than its window holds (the last 15)."""
    from tf_sparse_split import _kernels as K

    fam = K.SplitFamilyModel()
    assert fam.count_seconds_per_elem() == 0.0
    base = dict(dense_fixed_s=1e-5, dense_rate=1e11, sparse_fixed_s=2e-5,
                convert_s_per_elem=1e-10, sparse_rate=5e10,
                copy_s_per_elem=1e-10, heterogeneous=False)
    fam.set_calibration(base)
    shape = K.matmul_split_shape(64, 512, 512, 256)
    pred = base["dense_fixed_s"] + 2.0 * 64 * 512 * 256 / base["dense_rate"]
    rng = np.random.default_rng(2)
    ratios, counts = [], []
    for i in range(40):
        r = float(rng.uniform(0.5, 3.0))
        ratios.append(r)
        fam.record(shape, 64, False, r * pred, 0, 0, 0)
        c = float(rng.uniform(1e-10, 5e-10))
        counts.append(c)
        fam.record_count(1e6, c * 1e6)
        window = ratios[-15:]
        want = min(window) if len(window) < 3 else float(np.median(window))
        t = fam.terms()
        assert np.isclose(t["dense_rate"], base["dense_rate"] / want)
        assert np.isclose(t["dense_fixed_s"], base["dense_fixed_s"] * want)
        # The sparse path never ran: its terms are the calibration's.
        assert t["sparse_rate"] == base["sparse_rate"]
        assert np.isclose(fam.count_seconds_per_elem(),
                          float(np.median(counts[-15:])))
