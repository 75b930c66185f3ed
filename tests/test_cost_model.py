"""Tests of tf_sparse_split.tuning.cost_model (pure numpy; no op library needed)."""

import math

import numpy as np
import pytest

from tf_sparse_split.tuning import stats
from tf_sparse_split.tuning.cost_model import (
    ARGMIN_POLICY, CostModel, DENSE, SPARSE, candidate_thresholds)


def _fill(model, path, overhead, rate, works):
    for w in works:
        model.add_sample(path, w, overhead + w / rate)


def test_fits_known_linear_timings_exactly():
    cm = CostModel()
    rng = np.random.default_rng(1)
    _fill(cm, DENSE, 2e-4, 2.0e11, rng.uniform(1e6, 1e9, 20))
    _fill(cm, SPARSE, 5e-5, 1.5e10, rng.uniform(1e5, 1e8, 20))
    fits = cm.fit()
    assert set(fits) == {DENSE, SPARSE}
    assert cm.overhead(DENSE) == pytest.approx(2e-4, rel=1e-6)
    assert cm.rate(DENSE) == pytest.approx(2.0e11, rel=1e-9)
    assert cm.overhead(SPARSE) == pytest.approx(5e-5, rel=1e-6)
    assert cm.rate(SPARSE) == pytest.approx(1.5e10, rel=1e-9)
    assert fits[DENSE].num_samples == 20
    assert fits[DENSE].rms_error < 1e-12


def test_negative_overhead_is_clipped_and_refit():
    cm = CostModel()
    # time = -1e-3 + w / 1e9 exactly: the unconstrained fit has overhead
    # -1e-3; the model clips it to 0 and refits the rate through the origin.
    works = np.array([2e6, 4e6, 8e6])
    times = -1e-3 + works / 1e9
    for w, t in zip(works, times):
        cm.add_sample(DENSE, w, t)
    cm.fit()
    assert cm.overhead(DENSE) == 0.0
    expected_rate = np.dot(works, works) / np.dot(works, times)
    assert cm.rate(DENSE) == pytest.approx(expected_rate, rel=1e-12)
    assert cm.rate(DENSE) > 1e9  # steeper than the unclipped slope


def test_time_not_growing_with_work_gives_infinite_rate():
    cm = CostModel()
    for w, t in [(1e6, 3e-3), (2e6, 2e-3), (3e6, 1e-3)]:
        cm.add_sample(SPARSE, w, t)
    cm.fit()
    assert math.isinf(cm.rate(SPARSE))
    assert cm.overhead(SPARSE) == pytest.approx(2e-3)


def test_single_sample_goes_through_origin():
    cm = CostModel()
    cm.add_sample(DENSE, 4e9, 2e-2)
    cm.fit()
    assert cm.overhead(DENSE) == 0.0
    assert cm.rate(DENSE) == pytest.approx(2e11)


def test_add_stats_computes_work_per_path():
    v = np.zeros(stats.NUM_STATS)
    v[stats.ROWS_DENSE], v[stats.ROWS_SPARSE] = 10, 6
    v[stats.K], v[stats.N], v[stats.M] = 100, 50, 16
    v[stats.ZERO_COLS_SKIPPED] = 20
    v[stats.NNZ_SPARSE] = 30
    v[stats.TIME_DENSE], v[stats.TIME_SPARSE] = 1e-3, 2e-4
    cm = CostModel()
    cm.add_stats(v)
    cm.fit()
    # dense work = 2 * 10 * (100 - 20) * 50 = 80,000 flop in 1e-3 s
    assert cm.rate(DENSE) == pytest.approx(8e4 / 1e-3)
    # sparse work = 2 * 30 * 50 = 3,000 flop in 2e-4 s
    assert cm.rate(SPARSE) == pytest.approx(3e3 / 2e-4)
    with pytest.raises(ValueError):
        cm.add_stats(np.zeros(stats.NUM_STATS - 1))


def test_zero_work_is_not_a_sample():
    cm = CostModel()
    cm.add_sample(DENSE, 0.0, 0.0)
    assert cm.num_samples(DENSE) == 0
    assert cm.fit() == {}


def _two_paths(dense_rate, sparse_rate):
    cm = CostModel()
    _fill(cm, DENSE, 1e-5, dense_rate, [1e6, 1e7, 1e8])
    _fill(cm, SPARSE, 1e-5, sparse_rate, [1e5, 1e6, 1e7])
    cm.fit()
    return cm


def _uniform_hist(m):
    return np.full(stats.DENSITY_BINS, m / stats.DENSITY_BINS)


def test_best_threshold_all_sparse_when_sparse_much_faster():
    cm = _two_paths(dense_rate=1e10, sparse_rate=1e12)
    assert cm.best_threshold(_uniform_hist(256), 256, 512, 512, 256) == 1.0


def test_best_threshold_all_dense_when_sparse_much_slower():
    cm = _two_paths(dense_rate=1e12, sparse_rate=1e9)
    assert cm.best_threshold(_uniform_hist(256), 256, 512, 512, 256) == 0.0


def test_best_threshold_splits_a_bimodal_histogram():
    # Sparse 4x slower per flop: rows in the lowest bin (density ~1/32) are
    # still 8x cheaper sparse, rows in the top bin are not.
    cm = _two_paths(dense_rate=2e11, sparse_rate=5e10)
    hist = np.zeros(stats.DENSITY_BINS)
    hist[0], hist[-1] = 100, 100
    t = cm.best_threshold(hist, 200, 1024, 1024, 512)
    assert t == pytest.approx(1 / stats.DENSITY_BINS)
    assert cm.predicted_time(hist, 200, 1024, 1024, 512, t) < \
        cm.predicted_time(hist, 200, 1024, 1024, 512, 0.0)
    assert cm.predicted_time(hist, 200, 1024, 1024, 512, t) < \
        cm.predicted_time(hist, 200, 1024, 1024, 512, 1.0)


def test_best_threshold_with_one_path_returns_none():
    cm = CostModel()
    _fill(cm, DENSE, 1e-5, 1e11, [1e6, 1e7])
    cm.fit()
    assert cm.rate(SPARSE) is None
    assert cm.best_threshold(_uniform_hist(64), 64, 64, 64, 64) is None
    with pytest.raises(RuntimeError):
        cm.predicted_time(_uniform_hist(64), 64, 64, 64, 64, 0.5)


def test_min_samples_leaves_path_unfitted():
    cm = CostModel()
    _fill(cm, DENSE, 1e-5, 1e11, [1e6, 1e7, 1e8])
    _fill(cm, SPARSE, 1e-5, 1e10, [1e6])
    fits = cm.fit(min_samples=2)
    assert set(fits) == {DENSE}
    with pytest.raises(ValueError):
        cm.fit(min_samples=0)


def test_bad_samples_and_sizes_raise():
    cm = CostModel()
    with pytest.raises(ValueError):
        cm.add_sample("gpu", 1.0, 1.0)
    with pytest.raises(ValueError):
        cm.add_sample(DENSE, 1.0, -1.0)
    with pytest.raises(ValueError):
        cm.add_sample(DENSE, float("nan"), 1.0)
    cm = _two_paths(1e11, 1e10)
    with pytest.raises(ValueError):
        cm.best_threshold(_uniform_hist(8), 8, 8, 9, 8)  # k_live > k
    with pytest.raises(ValueError):
        cm.best_threshold(-_uniform_hist(8), 8, 8, 8, 8)


def test_candidates_are_bin_edges():
    c = candidate_thresholds()
    assert c[0] == 0.0 and c[-1] == 1.0 and len(c) == stats.DENSITY_BINS + 1


def test_narrow_work_spread_fits_through_origin():
    # Work within 10% of each other, times noisy: a free slope would come
    # from the noise, so the model fits the rate alone.
    cm = CostModel()
    works = np.array([2.60e6, 2.52e6, 2.66e6, 2.68e6])
    times = np.array([1.29e-3, 1.26e-3, 1.15e-3, 1.40e-3])
    for w, t in zip(works, times):
        cm.add_sample(SPARSE, w, t)
    cm.fit()
    assert cm.overhead(SPARSE) == 0.0
    assert cm.rate(SPARSE) == pytest.approx(
        np.dot(works, works) / np.dot(works, times))


from hypothesis import given, settings, strategies as st


@settings(max_examples=60, deadline=None)
@given(
    dense_rate=st.floats(1e8, 1e12), sparse_rate=st.floats(1e8, 1e12),
    dense_overhead=st.floats(0.0, 1e-3), sparse_overhead=st.floats(0.0, 1e-3),
    hist=st.lists(st.integers(0, 200), min_size=stats.DENSITY_BINS,
                  max_size=stats.DENSITY_BINS).filter(lambda h: sum(h) > 0),
    k=st.integers(1, 4096), n=st.integers(1, 4096), dead=st.floats(0, 1),
)
def test_best_threshold_is_the_argmin_of_predicted_time(
        dense_rate, sparse_rate, dense_overhead, sparse_overhead, hist, k, n,
        dead):
    cm = CostModel()
    _fill(cm, DENSE, dense_overhead, dense_rate, [1e6, 1e7, 1e8])
    _fill(cm, SPARSE, sparse_overhead, sparse_rate, [1e6, 1e7, 1e8])
    cm.fit()
    m = sum(hist)
    k_live = int(round(k * (1 - dead)))
    best = cm.best_threshold(hist, m, k, k_live, n, policy=ARGMIN_POLICY)
    times = [cm.predicted_time(hist, m, k, k_live, n, t)
             for t in candidate_thresholds()]
    assert best in candidate_thresholds()
    assert cm.predicted_time(hist, m, k, k_live, n, best) <= min(times) * (
        1 + 1e-12) + 1e-18


def test_warmup_samples_are_discarded():
    cm = CostModel(warmup_samples=1)
    cm.add_sample(DENSE, 1e8, 1.0)  # slow first call: dropped
    _fill(cm, DENSE, 0.0, 1e11, [1e7, 1e8])
    cm.add_sample(SPARSE, 0.0, 0.0)  # zero work does not use up the warm-up
    cm.add_sample(SPARSE, 1e6, 5.0)
    _fill(cm, SPARSE, 0.0, 1e10, [1e6, 1e7])
    cm.fit()
    assert cm.num_samples(DENSE) == 2 and cm.num_samples(SPARSE) == 2
    assert cm.rate(DENSE) == pytest.approx(1e11)
    assert cm.rate(SPARSE) == pytest.approx(1e10)
    for bad in (-1, 0.5, True):
        with pytest.raises(ValueError):
            CostModel(warmup_samples=bad)


def test_nnz_corrects_the_bin_center_estimate():
    # All rows at density 0.01, i.e. in bin 0 whose center is 1/32: without
    # the measured nnz the sparse work looks 3x too large.
    m, k, n = 256, 1024, 512
    hist = np.zeros(stats.DENSITY_BINS)
    hist[0] = m
    nnz = 0.01 * m * k
    # dense: 2*m*k*n / 1e11 = 2.7 ms; sparse with the measured nnz:
    # 2*nnz*n / 1.5e9 = 1.8 ms; with bin centers: 5.6 ms.
    cm = _two_paths(dense_rate=1e11, sparse_rate=1.5e9)
    assert cm.best_threshold(hist, m, k, k, n) == 0.0
    assert cm.best_threshold(hist, m, k, k, n, nnz=nnz) == pytest.approx(
        1 / stats.DENSITY_BINS)
    exact_sparse = 1e-5 + 2 * nnz * n / 1.5e9
    assert cm.predicted_time(hist, m, k, k, n, 1.0, nnz=nnz) == \
        pytest.approx(exact_sparse)
    with pytest.raises(ValueError):
        cm.predicted_time(hist, m, k, k, n, 1.0, nnz=-1.0)


def test_best_threshold_is_the_ops_decision_with_its_margins():
    """One definition: best_threshold is cc/core/cost_model.h's DecideSplit
    (through the pybind11 module) on the fitted terms, so a split that is
    predicted only 5% faster than all-dense is not taken (the ops' 10%
    margin), while the plain argmin would take it."""
    from tf_sparse_split import _kernels as K

    m, k, n = 256, 1024, 512
    hist = np.zeros(stats.DENSITY_BINS)
    hist[0] = m                                  # every row below 1/16
    nnz = 0.02 * m * k
    dense_t = 1e-5 + 2.0 * m * k * n / 1e11      # all-dense seconds
    sparse_rate = 2.0 * nnz * n / (0.95 * dense_t - 1e-5)
    cm = _two_paths(dense_rate=1e11, sparse_rate=sparse_rate)
    t_argmin = cm.best_threshold(hist, m, k, k, n, nnz=nnz, policy=ARGMIN_POLICY)
    assert t_argmin == pytest.approx(1 / stats.DENSITY_BINS)
    assert cm.best_threshold(hist, m, k, k, n, nnz=nnz) == 0.0
    # The same decision as the C++ function on the same terms.
    rows, nnz_b = K.profile_from_histogram(hist, 1, nnz)
    shape = {"m": m, "k": 1, "k_live": 1, "can_compact": False,
             "dense_flops_per_elem": 2.0 * n * k, "sparse_flops_per_nnz": 2.0 * n}
    terms = {"dense_fixed_s": cm.overhead(DENSE), "dense_rate": cm.rate(DENSE),
             "sparse_fixed_s": cm.overhead(SPARSE), "sparse_rate": cm.rate(SPARSE)}
    assert K.decide_split(shape, (rows, nnz_b), terms)["kind"] == "all_dense"
    # A clear win (2x) is taken with the margins too.
    fast = _two_paths(dense_rate=1e11, sparse_rate=4 * sparse_rate)
    assert fast.best_threshold(hist, m, k, k, n, nnz=nnz) == pytest.approx(
        1 / stats.DENSITY_BINS)
