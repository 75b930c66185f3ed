"""Re-timing the path that stopped running, and the robust dense
observations (cc/core/cost_model.h: RetimePolicy, RetimeDue, OtherSidePlan,
PlanMemory::DecideAndRetime, FamilyModel::Record), on synthetic terms and on
recorded calls of a converted MLP: nothing is timed.

The recording (tests/data/mlp_b32_retime_calls.json, made with
tests/data/record_retime.py from the ops' VLOG lines) holds every automatic
call of the three layer families of the MLP 784-2048-2048-10 at batch 32 in
benchmarks/bench_inference.py: the calibration terms, each call's profile
and the part seconds of the path it ran. A replay feeds those seconds back
through SplitFamilyModel and SplitPlanMemory.decide_and_retime, as the ops
do, and checks where the plan ends up.
"""

import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest

from tf_sparse_split import _kernels as K

DATA = Path(__file__).resolve().parent / "data" / "mlp_b32_retime_calls.json"


def _terms(**kw):
    t = dict(dense_fixed_s=0.0, dense_rate=1e11, sparse_fixed_s=0.0,
             convert_s_per_elem=0.0, sparse_rate=1e11, copy_s_per_elem=0.0,
             heterogeneous=False)
    t.update(kw)
    return t


def _profile(row_nnz, k):
    return K.profile_from_row_nnz(np.asarray(row_nnz, np.int64), k, 32)


def _uniform(m, k, density, seed=0):
    rng = np.random.default_rng(seed)
    return rng.binomial(k, density, m).astype(np.int64)


# -- the schedule ----------------------------------------------------------

def _sparse_winning_case(dense_over_sparse):
    """A 256 x 1024 -> 1024 call at 90% zeros whose all-sparse plan wins and
    whose all-dense plan is predicted `dense_over_sparse` times slower."""
    m, k, n = 256, 1024, 1024
    rows = _uniform(m, k, 0.1)
    shape = K.matmul_split_shape(m, k, k, n)
    prof = _profile(rows, k)
    sparse_s = 2.0 * rows.sum() * n / 1e11
    dense_flops = 2.0 * m * k * n
    terms = _terms(dense_rate=dense_flops / (dense_over_sparse * sparse_s))
    return shape, prof, terms


def test_defaults_are_the_documented_ones():
    assert K.retime_policy_defaults() == {"max_ratio": 2.0,
                                          "first_period": 4,
                                          "max_period": 256}


def test_retimes_follow_a_doubling_period_and_stay_bounded():
    shape, prof, terms = _sparse_winning_case(1.5)
    mem = K.SplitPlanMemory()
    at = []
    calls = 2000
    for i in range(1, calls + 1):
        r = mem.decide_and_retime(shape, prof, terms)
        assert r["decided"]["kind"] != "all_dense"
        if r["retimed"]:
            at.append(i)
            assert r["plan"]["kind"] == "all_dense"
            assert math.isclose(r["plan"]["predicted_s"],
                                r["decided"]["all_dense_s"])
        else:
            assert r["plan"] == r["decided"]
    # first after 4 decisions, then periods 8, 16, ..., 256, 256, ...
    assert at[:7] == [4, 12, 28, 60, 124, 252, 508]
    assert all(b - a == 256 for a, b in zip(at[6:], at[7:]))
    bound = math.log2(calls / 4 + 1) + calls / 256
    assert len(at) <= bound
    st = mem.retime_state()
    assert st["retimes"] == len(at) and st["side"] == 1
    assert st["calls_on_side"] == calls


def test_no_retime_when_the_other_side_is_predicted_far_slower():
    shape, prof, terms = _sparse_winning_case(2.5)
    mem = K.SplitPlanMemory()
    for _ in range(300):
        r = mem.decide_and_retime(shape, prof, terms)
        assert not r["retimed"] and r["plan"]["kind"] != "all_dense"
    assert mem.retime_state()["retimes"] == 0
    # ... unless the policy allows that much.
    r = [mem.decide_and_retime(shape, prof, terms,
                               retime_policy={"max_ratio": 3.0,
                                              "first_period": 4,
                                              "max_period": 256})["retimed"]
         for _ in range(20)]
    assert any(r)


def test_first_period_zero_disables_retiming():
    shape, prof, terms = _sparse_winning_case(1.2)
    mem = K.SplitPlanMemory()
    off = {"max_ratio": 2.0, "first_period": 0, "max_period": 256}
    assert not any(mem.decide_and_retime(shape, prof, terms,
                                         retime_policy=off)["retimed"]
                   for _ in range(100))


def test_all_dense_plan_retimes_its_best_sparse_plan():
    """Dense decided (the sparse plan is predicted 1.3x slower): the re-time
    runs the best plan with sparse rows, and the hysteresis keeps the
    decided all-dense plan."""
    m, k, n = 256, 1024, 1024
    rows = _uniform(m, k, 0.1)
    shape = K.matmul_split_shape(m, k, k, n)
    prof = _profile(rows, k)
    dense_s = 2.0 * m * k * n / 1e11
    terms = _terms(sparse_rate=2.0 * rows.sum() * n / (1.3 * dense_s))
    mem = K.SplitPlanMemory()
    kinds = []
    for _ in range(13):
        r = mem.decide_and_retime(shape, prof, terms)
        assert r["decided"]["kind"] == "all_dense"
        kinds.append(r["plan"]["kind"] if r["retimed"] else None)
    assert [i + 1 for i, v in enumerate(kinds) if v] == [4, 12]
    assert kinds[3] != "all_dense"
    other = K.other_side_plan(shape, prof, terms, r["decided"])
    assert other["kind"] == kinds[3]
    assert other["predicted_s"] <= 2.0 * r["decided"]["predicted_s"]
    assert math.isclose(other["predicted_s"], other["best_sparse_s"],
                        rel_tol=0.02)


def test_change_of_side_restarts_the_schedule():
    shape, prof, sparse_terms = _sparse_winning_case(1.5)
    dense_terms = dict(sparse_terms, sparse_rate=sparse_terms["sparse_rate"] / 2)
    mem = K.SplitPlanMemory()
    for _ in range(30):
        mem.decide_and_retime(shape, prof, sparse_terms)
    assert mem.retime_state()["period"] == 32
    r = mem.decide_and_retime(shape, prof, dense_terms)
    assert r["decided"]["kind"] == "all_dense"
    st = mem.retime_state()
    assert st["side"] == 0 and st["calls_on_side"] == 1 and st["period"] == 4


def test_other_side_plan_none_without_terms_or_dense_path():
    shape, prof, terms = _sparse_winning_case(1.5)
    decided = K.decide_split(shape, prof, terms)
    assert K.other_side_plan(shape, prof, _terms(sparse_rate=0.0),
                             decided) is None
    no_dense = dict(shape, dense_allowed=False)
    assert K.other_side_plan(no_dense, prof, terms, decided) is None


def test_bad_retime_policy_is_refused():
    shape, prof, terms = _sparse_winning_case(1.5)
    mem = K.SplitPlanMemory()
    for bad in ({"max_ratio": -1.0}, {"max_period": 0},
                {"max_ratio": float("nan")}, {"period": 3}):
        with pytest.raises(ValueError):
            mem.decide_and_retime(shape, prof, terms, retime_policy=bad)


# -- robust dense observations ------------------------------------------------

def test_compacted_dense_fixed_term_scales_with_live_columns():
    m, k, k_live, n = 32, 784, 453, 2048
    shape = K.matmul_split_shape(m, k, k_live, n)
    prof = _profile(_uniform(m, k, 0.2), k)
    terms = _terms(dense_fixed_s=6e-4, dense_rate=1.8e11)
    plain = K.predict_plan_seconds(shape, prof, terms, -1, False)
    packed = K.predict_plan_seconds(shape, prof, terms, -1, True)
    assert math.isclose(plain, 6e-4 + 2.0 * m * k * n / 1.8e11)
    assert math.isclose(packed, 6e-4 * k_live / k + 2.0 * m * k_live * n / 1.8e11)


def test_first_all_dense_call_of_a_shape_is_not_recorded():
    m, k, k_live, n = 32, 2048, 1666, 10
    fam = K.SplitFamilyModel()
    base = _terms(dense_fixed_s=1e-5, dense_rate=5e10)
    fam.set_calibration(base)
    shape = K.matmul_split_shape(m, k, k_live, n)
    pred = K.predict_plan_seconds(shape, _profile(np.ones(m, np.int64), k),
                                  base, -1, True)
    # The first compacted call pays a primitive creation: 10x.
    assert not fam.record(shape, m, True, 10 * pred, 0, 0, 0)
    assert fam.terms()["dense_rate"] == base["dense_rate"]
    assert fam.record(shape, m, True, 1.1 * pred, 0, 0, 0)
    assert math.isclose(fam.terms()["dense_rate"], base["dense_rate"] / 1.1)
    # Another compaction (k_live) is another shape; a split is never held.
    other = K.matmul_split_shape(m, k, 1500, n)
    assert not fam.record(other, m, True, 1.0, 0, 0, 0)
    assert fam.record(shape, m // 2, True, 1.1 * pred, m // 2, 0, 0)


def test_stale_ratios_are_forgotten():
    m, k, n = 256, 1024, 1024
    fam = K.SplitFamilyModel()
    base = _terms(dense_rate=1e11, sparse_rate=5e10)
    fam.set_calibration(base)
    shape = K.matmul_split_shape(m, k, k, n)
    dense_pred = 2.0 * m * k * n / 1e11
    fam.record(shape, m, False, dense_pred, 0, 0, 0)  # first of its shape
    for _ in range(5):
        assert fam.record(shape, m, False, 3.0 * dense_pred, 0, 0, 0)
    assert math.isclose(fam.terms()["dense_rate"], 1e11 / 3.0)
    nnz = 0.1 * m * k
    sparse_pred = 2.0 * nnz * n / 5e10
    for _ in range(31):
        fam.record(shape, 0, False, 0, m, nnz, sparse_pred)
    # 32 records after the last dense one its ratios still count ...
    assert fam.record(shape, m, False, 1.0 * dense_pred, 0, 0, 0)
    assert math.isclose(fam.terms()["dense_rate"], 1e11 / 3.0)
    for _ in range(33):
        fam.record(shape, 0, False, 0, m, nnz, sparse_pred)
    # ... 34 records after it they are forgotten: one observation is the
    # ratio.
    assert fam.record(shape, m, False, 1.2 * dense_pred, 0, 0, 0)
    assert math.isclose(fam.terms()["dense_rate"], 1e11 / 1.2)
    assert math.isclose(fam.terms()["sparse_rate"], 5e10)
