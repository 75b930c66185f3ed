"""The least saving a plan with sparse rows must promise in small calls
(cc/core/cost_model.h: DecisionPolicy::min_gain_fraction, MinGainSeconds),
tested deterministically through the pybind11 module on recorded
calibration timings (tests/data/conv_family_timings.json, see
tests/test_conv2d_family.py) -- nothing here is timed.

``min_gain_s`` (100 us) alone made every call predicted under about 0.1 ms
all-dense stay dense, whatever its sparsity: a batch-1 convolution over an
MNIST image (79% zeros, one channel) ran TF's kernel although its sparse
path ran 1.4x faster in the same process. Below ``min_gain_s /
min_gain_fraction`` (333 us) the least saving is that fraction of the
all-dense time instead, but at least ``min_gain_floor_s`` (20 us);
predicted gains of 10-20% there (the losses ``min_gain_s`` was set
against) and gains of a few microseconds still stay dense.
"""

import json
import math
import pathlib

import numpy as np
import pytest
from _helpers import kernels_or_skip
from _helpers import cost_terms as _terms


K = kernels_or_skip()
DATA_DIR = pathlib.Path(__file__).resolve().parent / "data"
RECORDED = json.loads((DATA_DIR / "conv_family_timings.json").read_text())

ABSOLUTE_ONLY = {"min_gain_fraction": math.inf}   # min_gain_s alone


def _record(layer, n):
    (r,) = [r for r in RECORDED["layers"] if r["layer"] == layer and r["n"] == n]
    return r


def _shape(r):
    return K.conv_split_shape(r["n"], r["h"], r["w"], r["c_in"], r["c_live"],
                              r["kh"], r["kw"], r["c_out"], r["out_h"],
                              r["out_w"])


def _scaled(r, factor):
    """The record's calibration with every time multiplied by `factor` (the
    same call on a machine `1/factor` times as fast)."""
    c = dict(r["calibration"])
    for key in c:
        if key.endswith("_s"):
            c[key] = c[key] * factor
    return c


def _plan(r, factor, policy=None):
    terms = K.fit_calibration(_shape(r), _scaled(r, factor))
    profile = K.profile_from_row_nnz(np.asarray(r["image_nnz"], np.int64),
                                     r["h"] * r["w"] * r["c_in"])
    return K.decide_split(_shape(r), profile, terms, policy=policy)


def test_recorded_batch_1_image_is_faster_sparse():
    """What the record says: the batch-1 call over one digit image (one
    input channel, 89 of 784 pixels nonzero) is several times faster on the
    sparse path."""
    r = _record("conv_1", 1)
    assert r["all_sparse_s"] * 3 < r["all_dense_s"]


@pytest.mark.parametrize("factor", [0.25, 0.5, 0.6])
def test_small_batch_1_call_goes_sparse(factor):
    """The recorded call on faster machines (all-dense about 30-85 us predicted):
    its saving is below min_gain_s, so the absolute minimum alone kept it
    dense; the relative floor lets it take the path the record shows to be
    3-4x faster."""
    r = _record("conv_1", 1)
    plan = _plan(r, factor)
    assert plan["all_dense_s"] < 1e-4
    assert plan["all_dense_s"] - plan["predicted_s"] < 1e-4
    assert plan["kind"] == "all_sparse", plan
    assert _plan(r, factor, ABSOLUTE_ONLY)["kind"] == "all_dense"


@pytest.mark.parametrize("factor", [0.25, 0.5, 1.0, 2.0, 4.0])
def test_batch_32_stays_dense_at_any_speed(factor):
    """The batch-32 calls, recorded faster dense, stay dense on machines
    4x slower to 4x faster, with or without the relative floor."""
    for layer in ("conv_1", "conv_2"):
        r = _record(layer, 32)
        assert r["all_dense_s"] < r["all_sparse_s"]
        assert _plan(r, factor)["kind"] == "all_dense", (layer, factor)


def test_small_predicted_gains_stay_dense():
    """A call predicted at about 200 us all-dense whose best sparse plan is
    predicted 10-20% faster passes the 10% entry margin but not the floor
    (30%, 60 us): all-dense. At 40% it enters."""
    shape = K.matmul_split_shape(64, 2048, 2048, 64)
    m, k = 64, 2048
    for gain, want in ((0.12, "all_dense"), (0.18, "all_dense"),
                       (0.40, "all_sparse")):
        # Dense: 64 rows of 2*64*2048 flop = 16.8 MFLOP in ~200 us.
        terms = _terms(dense_fixed_s=0.0, dense_rate=16.8e6 / 2e-4,
                       sparse_fixed_s=0.0, convert_s_per_elem=0.0,
                       copy_s_per_elem=0.0)
        nnz_row = 205  # 10% dense rows
        useful = 2 * 64 * nnz_row * m
        terms["sparse_rate"] = useful / ((1.0 - gain) * 2e-4)
        profile = K.profile_from_row_nnz(np.full(m, nnz_row, np.int64), k)
        plan = K.decide_split(shape, profile, terms)
        assert plan["all_dense_s"] == pytest.approx(2e-4, rel=0.01)
        assert plan["kind"] == want, (gain, plan)


@pytest.mark.parametrize("dense_s,gain,want", [
    (6e-5, 0.40, "all_sparse"),    # 24 us saved >= max(20 us, 18 us)
    (3e-5, 0.50, "all_dense"),     # 15 us saved < the 20 us floor
    (1.5e-5, 0.60, "all_dense"),   # 9 us: timing noise at this size
])
def test_tens_of_microseconds_need_the_absolute_floor(dense_s, gain, want):
    """Below ~67 us all-dense the relative floor would ask only a few
    microseconds; min_gain_floor_s (20 us) keeps such calls dense."""
    m, k, n = 8, 512, 64
    shape = K.matmul_split_shape(m, k, k, n)
    terms = _terms(dense_fixed_s=0.0, dense_rate=m * 2 * n * k / dense_s,
                   sparse_fixed_s=0.0, convert_s_per_elem=0.0,
                   copy_s_per_elem=0.0)
    nnz_row = 51
    terms["sparse_rate"] = 2 * n * nnz_row * m / ((1.0 - gain) * dense_s)
    profile = K.profile_from_row_nnz(np.full(m, nnz_row, np.int64), k)
    plan = K.decide_split(shape, profile, terms)
    assert plan["all_dense_s"] == pytest.approx(dense_s, rel=0.01)
    assert plan["kind"] == want, plan


def test_min_gain_is_the_smaller_of_the_two():
    """Above 333 us all-dense min_gain_s decides alone: a 5 ms call needs
    100 us, not 1.5 ms; min_gain_s = 0 (as some tests and tools set) still
    means no minimum."""
    shape = K.matmul_split_shape(256, 4096, 4096, 1024)
    m, k = 256, 4096
    terms = _terms(dense_fixed_s=0.0, sparse_fixed_s=0.0,
                   convert_s_per_elem=0.0, copy_s_per_elem=0.0)
    dense_s = m * 2 * 1024 * k / terms["dense_rate"]   # ~10.7 ms
    nnz_row = 410
    useful = 2 * 1024 * nnz_row * m
    # Predicted 15% faster sparse: 1.6 ms saved, above 100 us, below 30%.
    terms["sparse_rate"] = useful / (0.85 * dense_s)
    profile = K.profile_from_row_nnz(np.full(m, nnz_row, np.int64), k)
    assert K.decide_split(shape, profile, terms)["kind"] == "all_sparse"
    # Predicted 5% faster: below the entry margin, whatever the minimum.
    terms["sparse_rate"] = useful / (0.95 * dense_s)
    for policy in (None, {"min_gain_s": 0.0}):
        assert K.decide_split(shape, profile, terms,
                              policy=policy)["kind"] == "all_dense"


def test_small_call_with_a_possible_win_is_sampled_not_skipped():
    """ChooseAnalysis skips the count only when no plan could save the
    minimum gain: for a small call the relative floor, so a 50 us layer
    whose every row could save half its time is sampled."""
    # 1 x 784 x 784 x 64: one dense row = 2*64*784 flop.
    shape = K.matmul_split_shape(1, 784 * 64, 784 * 64, 16)
    terms = _terms(dense_fixed_s=1e-5, dense_rate=2 * 16 * 784 * 64 / 4e-5,
                   sparse_fixed_s=2e-6, convert_s_per_elem=1e-11)
    bound = K.max_saving_seconds(shape, terms)
    assert 0.3 * 5e-5 < bound < 1e-4
    history = dict(seen_full=True, calls_since_full=0, zero_row_frac=0.0,
                   dead_col_frac=0.0)
    all_dense = dict(kind="all_dense", bucket=-1, threshold=0.0, compact=False)
    assert K.choose_analysis(shape, terms, history, all_dense, 1e-10) == \
        "sample"
    assert K.choose_analysis(shape, terms, history, all_dense, 1e-10,
                             policy=ABSOLUTE_ONLY) == "skip"


# -- the analysis a plan with sparse rows pays -------------------------------

# A 128 x 2048 -> 10 bfloat16 product at 99% zeros (one nonzero in 100,
# 2638 in 128 rows of 1498 live columns), from the op's VLOG lines: the
# terms after its second dense call (144 us, 2x its steady time) and after
# its first re-time of the dense path (66 us).
_BF16_SHAPE = dict(m=128, k=2048, k_live=1498, n=10)
_BF16_PROFILE = [(1, 128, 2638)]
_BF16_TERMS_SLOW_DENSE = (0.0, 3.63254e10, 8.64433e-06, 1.64283e-10,
                          7.53416e09, 4.41757e-10)
_BF16_TERMS_STEADY = (0.0, 7.92479e10, 8.04925e-06, 1.52973e-10, 8.09116e09,
                      4.41757e-10)
# Its full count: 32-43 us per call where the sparse plan ran (statistics
# TIME_ANALYZE), about 1.4e-10 s per value.
_BF16_COUNT_S = 1.4e-10 * 128 * 2048


def _bf16_case(terms):
    from tf_sparse_split import _kernels as K

    shape = K.matmul_split_shape(**_BF16_SHAPE)
    rows = np.zeros(33)
    nnz = np.zeros(33)
    for j, r, z in _BF16_PROFILE:
        rows[j], nnz[j] = r, z
    names = ("dense_fixed_s", "dense_rate", "sparse_fixed_s",
             "convert_s_per_elem", "sparse_rate", "copy_s_per_elem")
    t = dict(zip(names, terms), heterogeneous=False)
    return shape, (rows, nnz), t


def test_sparse_plan_pays_its_count_in_the_decision():
    """An op that may count cheaply (full_stats false) counts nothing while
    all-dense but every value on every call of a plan with sparse rows:
    SplitCall::Decide charges that count (DecisionPolicy.analysis_s) to
    those plans. On the recorded bfloat16 product the all-sparse plan,
    entered on a slow dense observation, is kept on the parts' times alone
    (55 us against 66 us dense: within the 5% stay margin) although with its
    count it is slower than the dense call; charged, the op goes back to
    all-dense. The count does not stop a plan that wins by more."""
    from tf_sparse_split import _kernels as K

    shape, prof, slow = _bf16_case(_BF16_TERMS_SLOW_DENSE)
    _, _, steady = _bf16_case(_BF16_TERMS_STEADY)
    charged = {"analysis_s": _BF16_COUNT_S}
    kinds = {}
    for name, policy in (("parts", None), ("charged", charged)):
        mem = K.SplitPlanMemory()
        first = mem.decide(shape, prof, slow, policy)
        later = [mem.decide(shape, prof, steady, policy)["kind"]
                 for _ in range(5)]
        kinds[name] = (first["kind"], later)
    # The slow dense observation makes the sparse plan enter either way ...
    assert kinds["parts"][0] != "all_dense"
    assert kinds["charged"][0] != "all_dense"
    # ... the parts' times keep it, its count sends it back.
    assert set(kinds["parts"][1]) == {"all_sparse"}
    assert set(kinds["charged"][1]) == {"all_dense"}
    # analysis_s 0 is the default, and a plan that wins by far still enters.
    assert K.decide_split(shape, prof, steady)["kind"] == K.decide_split(
        shape, prof, steady, policy={"analysis_s": 0.0})["kind"]
    fast = dict(steady, sparse_rate=10 * steady["sparse_rate"],
                convert_s_per_elem=steady["convert_s_per_elem"] / 10,
                sparse_fixed_s=1e-6)
    assert K.decide_split(shape, prof, fast,
                          policy=charged)["kind"] != "all_dense"
    with pytest.raises(ValueError):
        K.decide_split(shape, prof, steady, policy={"analysis_s": -1.0})
