"""How much of the analysis an automatic call pays (cc/core/cost_model.h,
ChooseAnalysis and its helpers), tested deterministically through the
pybind11 module on recorded terms and counts -- nothing here is timed.

The terms below are of the kind the ops calibrate on the 2-core development
machine: tf.matmul at about 200 GFLOP/s at large N but far less at N <= 16,
a CSR conversion of about 0.25 ns per value, a count of about 0.1 ns per
value.
"""

import math

import numpy as np
import pytest
from _helpers import kernels_or_skip
from _helpers import cost_terms as _terms


K = kernels_or_skip()
DEFAULT = K.analysis_policy_defaults()




def _history(**kw):
    h = dict(seen_full=True, calls_since_full=0, zero_row_frac=0.0,
             dead_col_frac=0.0)
    h.update(kw)
    return h


ALL_DENSE = dict(kind="all_dense", bucket=-1, threshold=0.0, compact=False)
COUNT_S = 1e-10  # seconds per counted value


# -- skipping the analysis ----------------------------------------------------

def test_small_n_output_layer_skips_the_count():
    """128x2048 x 2048x10 (an output layer; its weight gradient is the same
    product size): a dense row costs 2*10*2048 flop at the small-N rate of
    50 GFLOP/s = 0.82 us, its CSR conversion 0.51 us; even with every row
    converted the saving bound is below the policy's minimum gain, so no
    plan but the GEMM can be chosen: nothing is counted."""
    shape = K.matmul_split_shape(128, 2048, 2048, 10)
    terms = _terms(dense_rate=5e10)
    bound = K.max_saving_seconds(shape, terms)
    row_s = 2 * 10 * 2048 / 5e10
    expect = 128 * (row_s - 2.5e-10 * 2048) - 2e-5
    assert bound == pytest.approx(expect)
    assert bound < 1e-4
    assert K.choose_analysis(shape, terms, _history(), ALL_DENSE,
                             COUNT_S) == "skip"


def test_skip_bound_counts_zero_rows_and_dead_columns():
    """Zero rows save their whole dense row, dead columns their share of
    the flops: a layer whose last full count saw them is not skipped."""
    shape = K.matmul_split_shape(128, 2048, 2048, 10)
    terms = _terms(dense_rate=5e10)
    plain = K.max_saving_seconds(shape, terms)
    with_zero_rows = K.max_saving_seconds(shape, terms, zero_row_frac=0.5)
    with_dead = K.max_saving_seconds(shape, terms, dead_col_frac=0.5)
    assert with_zero_rows > plain and with_dead > plain
    assert K.choose_analysis(shape, terms, _history(dead_col_frac=0.5),
                             ALL_DENSE, COUNT_S) == "skip"
    assert K.choose_analysis(shape, terms, _history(dead_col_frac=1.0),
                             ALL_DENSE, COUNT_S) == "sample"
    # Never more than the whole dense call.
    dense_s = K.predict_plan_seconds(shape, K.profile_from_row_nnz(
        np.full(128, 2048, np.int64), 2048), terms, -1)
    assert K.max_saving_seconds(shape, terms, 1.0, 1.0) <= dense_s + 1e-15


def test_conversion_dearer_than_the_gemm_row_leaves_only_zero_rows():
    """When converting a row costs more than its dense GEMM row, rows with
    nonzeros can save nothing: the bound is the zero rows' dense time."""
    shape = K.matmul_split_shape(4096, 4096, 4096, 4)
    terms = _terms(dense_rate=2e10, convert_s_per_elem=1e-9)
    row_s = 2 * 4 * 4096 / 2e10
    assert row_s < 1e-9 * 4096
    assert K.max_saving_seconds(shape, terms) == 0.0
    assert K.max_saving_seconds(shape, terms, zero_row_frac=0.25) == \
        pytest.approx(0.25 * 4096 * row_s)


def test_large_problem_samples_instead_of_skipping():
    shape = K.matmul_split_shape(1024, 4096, 4096, 1024)
    assert K.max_saving_seconds(shape, _terms()) > 1e-3
    assert K.choose_analysis(shape, _terms(), _history(), ALL_DENSE,
                             COUNT_S) == "sample"


def test_samples_that_keep_saying_dense_come_further_apart():
    """After s samples in a row said all-dense, the next comes
    min(2^s, max_sample_period = 16) calls after the last and the calls
    between count nothing; a full count (the history's reset) starts over,
    and the full-count period still wins."""
    assert DEFAULT["max_sample_period"] == 16
    shape = K.matmul_split_shape(1024, 4096, 4096, 1024)

    def mode(samples, since, **kw):
        return K.choose_analysis(
            shape, _terms(), _history(samples_dense=samples,
                                      calls_since_sample=since, **kw),
            ALL_DENSE, COUNT_S)

    assert mode(0, 0) == "sample"
    for s, period in ((1, 2), (2, 4), (3, 8), (4, 16), (9, 16)):
        assert [mode(s, c) for c in range(period)] == \
            ["skip"] * (period - 1) + ["sample"], s
    assert mode(4, 3, calls_since_full=10_000) == "full"
    off = dict(DEFAULT, max_sample_period=1)
    assert K.choose_analysis(
        shape, _terms(), _history(samples_dense=5, calls_since_sample=0),
        ALL_DENSE, COUNT_S, analysis_policy=off) == "sample"
    # The op's memory: an accepted sample counts, a full count resets.
    mem = K.SplitPlanMemory()
    mem.record_analysis(True)
    assert mem.history()["samples_dense"] == 0
    mem.record_analysis(False)
    assert mem.history()["calls_since_sample"] == 1
    mem.record_analysis(True)
    assert mem.history()["calls_since_sample"] == 0


# -- when the full count is kept ------------------------------------------------

@pytest.mark.parametrize("case", [
    "full_stats", "no_full_count_yet", "no_previous", "previous_split",
    "previous_compact", "terms_unknown", "count_rate_unknown", "period_due"])
def test_full_count_cases(case):
    shape = K.matmul_split_shape(128, 2048, 2048, 10)
    terms = _terms(dense_rate=5e10)
    kw = dict(history=_history(), previous=ALL_DENSE, count_s_per_elem=COUNT_S,
              full_stats=False)
    if case == "full_stats":
        kw["full_stats"] = True
    elif case == "no_full_count_yet":
        kw["history"] = _history(seen_full=False)
    elif case == "no_previous":
        kw["previous"] = None
    elif case == "previous_split":
        kw["previous"] = dict(kind="split", bucket=8, threshold=0.25)
    elif case == "previous_compact":
        kw["previous"] = dict(ALL_DENSE, compact=True)
    elif case == "terms_unknown":
        terms = _terms(sparse_rate=0.0)
    elif case == "count_rate_unknown":
        kw["count_s_per_elem"] = 0.0
    elif case == "period_due":
        kw["history"] = _history(calls_since_full=10_000)
    assert K.choose_analysis(shape, terms, **kw) == "full"
    # The same call without the reason skips.
    assert K.choose_analysis(shape, _terms(dense_rate=5e10), _history(),
                             ALL_DENSE, COUNT_S) == "skip"


def test_full_count_period_amortises_the_count():
    # A count of 10% of the dense call: every 0.1 / 0.01 = 10 calls -> the
    # minimum 16; of 50%: 50 calls; of 10x: capped at 256.
    assert K.full_count_period(0.1, 1.0) == DEFAULT["min_period"]
    assert K.full_count_period(0.5, 1.0) == math.ceil(0.5 / 0.01)
    assert 49 <= K.full_count_period(0.5, 1.0) <= 51
    assert K.full_count_period(10.0, 1.0) == DEFAULT["max_period"]
    shape = K.matmul_split_shape(128, 2048, 2048, 10)
    terms = _terms(dense_rate=5e10)
    dense_s = 2e-5 + 2 * 128 * 2048 * 10 / 5e10
    period = K.full_count_period(COUNT_S * 128 * 2048, dense_s)
    due = _history(calls_since_full=period - 1)
    early = _history(calls_since_full=period - 2)
    assert K.choose_analysis(shape, terms, due, ALL_DENSE, COUNT_S) == "full"
    assert K.choose_analysis(shape, terms, early, ALL_DENSE, COUNT_S) == "skip"


def test_plan_memory_tracks_calls_since_full():
    mem = K.SplitPlanMemory()
    shape = K.matmul_split_shape(128, 2048, 2048, 10)
    terms = _terms(dense_rate=5e10)
    assert mem.choose_analysis(shape, terms, COUNT_S) == "full"
    mem.remember_all_dense()
    mem.record_analysis(True, 0.0, 0.0)
    assert mem.history()["seen_full"]
    assert mem.choose_analysis(shape, terms, COUNT_S) == "skip"
    assert mem.choose_analysis(shape, terms, COUNT_S, full_stats=True) == "full"
    for _ in range(3):
        mem.record_analysis(False)
    assert mem.history()["calls_since_full"] == 3
    mem.record_analysis(True, 0.25, 0.5)
    h = mem.history()
    assert (h["calls_since_full"], h["zero_row_frac"], h["dead_col_frac"]) == \
        (0, 0.25, 0.5)


def test_family_model_count_rate_is_a_median():
    f = K.SplitFamilyModel()
    assert f.count_seconds_per_elem() == 0.0
    for s in (1e-4, 1e-4, 5e-3, 1e-4):   # one outlier
        f.record_count(1e6, s)
    assert f.count_seconds_per_elem() == pytest.approx(1e-10)


# -- the sample ---------------------------------------------------------------

def test_sample_stride_fits_the_budget():
    # 4096 rows of 4096 values, 0.1 ns a value, dense call 10 ms: 0.5% of
    # it is 50 us = 122 rows -> stride ceil(4096 / 122) = 34.
    assert DEFAULT["sample_budget"] == 0.005
    assert K.sample_stride(4096, 4096, 1e-2, 1e-10) == 34
    # A cheap GEMM: the budget is under min_sample_rows; 4 rows are taken.
    assert K.sample_stride(4096, 4096, 1e-6, 1e-10) == 1024
    # Too few rows to sample, or a budget of half the rows or more: full.
    assert K.sample_stride(7, 4096, 1e-2, 1e-10) == 1
    assert K.sample_stride(64, 64, 1.0, 1e-10) == 1


def test_estimate_profile_scales_rows_and_nnz():
    # Rows sampled at stride 4 out of 40: 10 rows of 100 values.
    row_nnz = np.array([0, 10, 10, 50, 50, 50, 100, 100, 100, 100], np.int64)
    rows, nnz = K.estimate_profile(row_nnz, 100, 40, 100, buckets=4)
    exact_rows, exact_nnz = K.profile_from_row_nnz(row_nnz, 100, 4)
    np.testing.assert_allclose(rows, 4 * exact_rows)
    np.testing.assert_allclose(nnz, 4 * exact_nnz)
    # Transposed sampling: every row, a quarter of its values counted.
    rows, nnz = K.estimate_profile(row_nnz // 4, 25, 10, 100, buckets=4)
    assert rows.sum() == pytest.approx(10)
    assert nnz.sum() == pytest.approx((row_nnz // 4).sum() * 4)


def test_sample_far_from_break_even_runs_dense():
    """1024x4096 x 4096x16 at 50% density: the SpMM is predicted far
    slower than the GEMM (conversion alone ~1 ms vs a ~0.7 ms GEMM)."""
    m, k, n = 1024, 4096, 16
    rng = np.random.default_rng(0)
    sample = rng.binomial(k, 0.5, size=m // 16).astype(np.int64)
    p = K.estimate_profile(sample, k, m, k)
    shape = K.matmul_split_shape(m, k, k, n)
    assert K.sample_says_dense(shape, p, _terms())


def test_sample_near_break_even_counts_fully():
    """A sparsity where the best split is predicted a little slower than the
    entry test wants (within near_margin): the estimate could be off, so the
    call counts everything and decides on exact counts."""
    m, k, n = 1024, 4096, 1024
    shape = K.matmul_split_shape(m, k, k, n)
    terms = _terms()
    found_near = False
    for density in np.linspace(0.05, 0.95, 91):
        row_nnz = np.full(m, int(density * k), np.int64)
        p = K.profile_from_row_nnz(row_nnz, k)
        plan = K.decide_split(shape, p, terms)
        dense_s, best = plan["all_dense_s"], plan["best_sparse_s"]
        says_dense = K.sample_says_dense(shape, p, terms)
        if plan["kind"] != "all_dense":
            assert not says_dense        # a win is never skipped
        elif best <= dense_s * (1.0 - 0.10 + DEFAULT["near_margin"]) and \
                best <= dense_s - 0.5e-4:
            assert not says_dense        # near: full count
            found_near = True
        elif best > dense_s * 1.2:
            assert says_dense            # clearly dense
    assert found_near


def test_sample_with_dead_columns_counts_fully():
    """Columns dead in the sample may be dead in the whole operand:
    compaction might win, so the full count decides."""
    m, k, n = 1024, 4096, 64
    shape = K.matmul_split_shape(m, k, k // 2, n)
    p = K.profile_from_row_nnz(np.full(m, k // 4, np.int64), k)
    terms = _terms(convert_s_per_elem=1e-8)     # sparse rows never pay
    assert not K.sample_says_dense(shape, p, terms)
    assert K.sample_says_dense(K.matmul_split_shape(m, k, k, n), p, terms)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("stride", [1, 2, 3, 16])
def test_strided_counts_match_numpy(dtype, transpose, stride):
    rng = np.random.default_rng([stride, int(transpose)])
    a = rng.standard_normal((37, 29)).astype(dtype)
    a[rng.random(a.shape) < 0.6] = 0
    a[:, 3] = 0
    a[5, 7] = np.nan
    row, col, nnz = K.row_col_nnz_strided(a, stride, transpose)
    sub = a[::stride] != 0
    opa = sub.T if transpose else sub
    np.testing.assert_array_equal(row, opa.sum(1))
    np.testing.assert_array_equal(col, opa.sum(0))
    assert nnz == sub.sum()
    if stride == 1:
        full_row, full_col, full_nnz = K.row_col_nnz(a, transpose)
        np.testing.assert_array_equal(row, full_row)
        np.testing.assert_array_equal(col, full_col)


# -- batch-aware families ------------------------------------------------------

# Recorded on the development machine (tf.matmul and the op's all-sparse
# path, threshold 1.0; 2048 x 2048 weights, float32, 90% of a's values
# zero; fastest of 40 interleaved calls each, the machine under load).
RECORDED_M = {
    # m: (dense seconds, sparse seconds)
    1: (1.12e-3, 1.37e-3),
    32: (3.96e-3, 1.93e-3),
}


def _terms_from_recorded(m, k=2048, n=2048, density=0.1):
    dense_s, sparse_s = RECORDED_M[m]
    nnz = density * m * k
    # Rates through the origin (the calibration of an M=1 family has one
    # row: no fixed term can be separated).
    return _terms(dense_fixed_s=0.0, dense_rate=2.0 * m * k * n / dense_s,
                  sparse_fixed_s=0.0, convert_s_per_elem=0.0,
                  sparse_rate=2.0 * nnz * n / sparse_s)


def test_m_buckets_separate_batch_sizes():
    assert [K.m_bucket(m) for m in (1, 2, 3, 32, 33, 256, 512, 100000)] == \
        [1, 2, 4, 32, 64, 256, 512, 512]
    key1 = K.matmul_family_key(0, 1, 1, 2048, 2048, False)
    key32 = K.matmul_family_key(0, 1, 32, 2048, 2048, False)
    assert key1 != key32
    assert key1[:5] == key32[:5]
    # 17..32 share a family; the transpose and n bucket still matter.
    assert K.matmul_family_key(0, 1, 17, 2048, 2048, False) == key32
    assert K.matmul_family_key(0, 1, 32, 2048, 2048, True) != key32


def test_terms_learned_at_m1_do_not_decide_at_m32():
    """At M = 1 the GEMM is a matrix-vector product bound by reading b
    (recorded 1.12 ms for 8 MFLOP, 7.5 GFLOP/s) and the SpMM, which streams
    b as well, is no faster; at M = 32 the GEMM reuses b over 32 rows, but
    the SpMM's work shrinks with the zeros and wins 2x. With families per M
    bucket, each batch size decides on terms of its own and picks the
    recorded faster path; the M = 1 terms at M = 32 would have picked the
    recorded slower one."""
    k = n = 2048
    rng = np.random.default_rng(1)
    families = {}

    def family(m):
        key = tuple(K.matmul_family_key(0, 1, m, k, n, False))
        return families.setdefault(key, K.SplitFamilyModel())

    family(1).set_calibration(_terms_from_recorded(1))
    assert not family(32).calibrated          # M = 32 calibrates anew
    family(32).set_calibration(_terms_from_recorded(32))

    for m in (1, 32):
        a_nnz = rng.binomial(k, 0.1, size=m).astype(np.int64)
        p = K.profile_from_row_nnz(a_nnz, k)
        shape = K.matmul_split_shape(m, k, k, n)
        plan = K.decide_split(shape, p, family(m).terms())
        dense_s, sparse_s = RECORDED_M[m]
        faster = "all_dense" if dense_s < sparse_s else "sparse"
        got = "all_dense" if plan["kind"] == "all_dense" else "sparse"
        assert got == faster, (m, plan)
    # What a key without the M bucket would have done at M = 32.
    a_nnz = rng.binomial(k, 0.1, size=32).astype(np.int64)
    stale = K.decide_split(K.matmul_split_shape(32, k, k, n),
                           K.profile_from_row_nnz(a_nnz, k),
                           family(1).terms())
    assert stale["kind"] == "all_dense"       # recorded 2x slower


def test_full_counts_a_sample_asks_for_are_rationed():
    """A sample near the break-even asks for a full count; such counts may
    cost at most escalate_budget (2%) of the predicted dense time per call
    since the last full count. A 1x1 convolution whose count is half its
    dense call (recorded on the 2-core Xeon: 0.3 ms against 0.6 ms) may
    count again 25 calls after the last one -- near the break-even it
    counted every 4-8 calls, 4% of its time; 32x56x56x64 -> 64 (2 ms count,
    22 ms dense) every fifth call; a pending change of side is never
    held back, nor an op that has not counted yet."""
    assert DEFAULT["escalate_budget"] == 0.02

    def allowed(count_s, dense_s, calls, pending=False, **h):
        return K.sample_may_count_fully(
            count_s, dense_s, _history(calls_since_full=calls, **h), pending)

    assert [allowed(0.3e-3, 0.6e-3, c) for c in (0, 10, 23, 24, 40)] == \
        [False, False, False, True, True]
    assert [allowed(2e-3, 22e-3, c) for c in (0, 3, 4)] == [False, False, True]
    assert allowed(0.3e-3, 0.6e-3, 0, pending=True)
    assert allowed(0.3e-3, 0.6e-3, 0, seen_full=False)
    # Unknown costs (nothing measured yet) do not hold a count back.
    assert allowed(0.0, 0.6e-3, 0) and allowed(0.3e-3, 0.0, 0)
    # The budget is the policy's.
    assert K.sample_may_count_fully(
        0.3e-3, 0.6e-3, _history(calls_since_full=0), False,
        dict(DEFAULT, escalate_budget=0.5))
