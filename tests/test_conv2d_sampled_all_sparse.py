"""What an all-sparse convolution plan is charged for its analysis.

With ``full_stats=False`` (what the layers pass) a convolution that stays
all-dense counts a sample or nothing, while a plan with sparse images counts
every value; the decision charges that full count to such plans
(``DecisionPolicy.analysis_s``). The forward and the filter gradient run an
all-sparse plan on the zero-skipping direct kernel, which reads no counts:
between periodic full counts those calls decide on a sample
(``AnalysisMode::kSampleSparse``), so an all-sparse plan pays only that
share of the full count (``sampled_all_sparse_count_share``,
``DecisionPolicy.all_sparse_analysis_s``); a split still pays every value.

The recording below was logged (``TF_CPP_MAX_VLOG_LEVEL=2``) by the filter
gradient of 32x56x56x64 -> 64 (3x3 SAME) at 50% zeros on the 2-core Xeon:
its calibration, the call's image counts and one full count (1.66 ms).
There the all-sparse calls ran 20-22 ms against 23.5-27 ms all-dense, but
with the full count charged on every call the plan was left on the next
call and the automatic op ran at 1.00x of TF's kernel (all-sparse: 1.17x).
Nothing is timed here.
"""

import pytest
from _helpers import kernels_or_skip
# The recorded convolution's shape, profile and fitted calibration terms,
# and its all-sparse candidate: as the agreement rule's tests build them.
from test_conv2d_split_agreement import _all_sparse, _problem

K = kernels_or_skip()

#: The conv2d's filter gradient: (N, H, W, C_in, C_out), calibration, image
#: nonzeros by (count, nnz) groups, one full count's seconds.
FILTER_GRAD_50 = dict(
    conv=(32, 56, 56, 64, 64),
    calibration=dict(rows_full=6, rows_part=1, nnz_full=602769,
                     nnz_thin=75348, nnz_part=100367, dense_full_s=4.5247e-3,
                     dense_part_s=1.10222e-3, sparse_full_s=3.87442e-3,
                     sparse_thin_s=1.11009e-3, sparse_part_s=0.773176e-3,
                     copy_elems=602112, copy_s=0.362671e-3,
                     row_copy_elems=602112, row_copy_s=0.235651e-3),
    images=((20, 99575), (12, 100973)),
    count_s=1.66e-3)

#: The pixel stride of the convolutions' sample (kSparseSampleStride).
SAMPLE_STRIDE = 16


def _all_sparse_plan(profile, predicted_s):
    b = _all_sparse(profile)
    return {"kind": "all_sparse", "bucket": b, "threshold": 1.0,
            "compact": False, "predicted_s": predicted_s}


def test_share_is_the_periodic_full_count_plus_the_sample():
    ap = K.analysis_policy_defaults()
    share = K.sampled_all_sparse_count_share(SAMPLE_STRIDE)
    assert share == pytest.approx(1.0 / ap["min_period"] + 1.0 / SAMPLE_STRIDE)
    assert 0.0 < share < 0.2
    # A longer period or a sparser sample costs less; never above a count.
    longer = dict(ap, min_period=4 * ap["min_period"])
    assert K.sampled_all_sparse_count_share(SAMPLE_STRIDE, longer) < share
    assert K.sampled_all_sparse_count_share(1) == 1.0


def test_the_sampled_share_keeps_the_recorded_all_sparse_plan():
    """Charged a full count on every call, the recorded all-sparse plan
    fails the stay test and the call goes all-dense (what the op did);
    charged its sampled share, it is kept. A split plan is still charged
    the full count."""
    rec = FILTER_GRAD_50
    shape, profile, terms = _problem(rec)
    sparse_s = K.predict_plan_seconds(shape, profile, terms,
                                      _all_sparse(profile))
    dense_s = K.predict_plan_seconds(shape, profile, terms, -1)
    # The recorded numbers: all-sparse ahead of all-dense by 10-15%, by less
    # than the full count.
    assert 1.05 < dense_s / sparse_s < 1.2
    assert dense_s - sparse_s < 2 * rec["count_s"]
    previous = _all_sparse_plan(profile, sparse_s)
    full = {"analysis_s": rec["count_s"]}
    plan = K.decide_split(shape, profile, terms, previous, full)
    assert plan["kind"] == "all_dense", plan
    share = K.sampled_all_sparse_count_share(SAMPLE_STRIDE)
    sampled = dict(full, all_sparse_analysis_s=share * rec["count_s"])
    plan = K.decide_split(shape, profile, terms, previous, sampled)
    assert plan["kind"] == "all_sparse", plan
    # The agreement rule with the same charges (the calibration's terms as
    # both sets): vetoed with the full count, agreed with the share.
    b = _all_sparse(profile)
    assert not K.conv_split_agreed(shape, profile, terms, terms, b, False,
                                   rec["count_s"])
    assert K.conv_split_agreed(shape, profile, terms, terms, b, False,
                               share * rec["count_s"])


def test_an_all_sparse_plan_beats_a_faster_split_once_analyses_count():
    """Half the images 88% nonzeros, half 2%: the split is the fastest plan
    on its parts' times, but it counts every value on every call; where the
    all-sparse plan pays only a sample, it is taken when its time plus that
    share is below the split's time plus the full count, never a split
    charged less than the full count."""
    _, h, w, ci, _ = FILTER_GRAD_50["conv"]
    k = h * w * ci
    shape, profile, terms = _problem(
        FILTER_GRAD_50, images=((16, int(0.88 * k)), (16, int(0.02 * k))))
    b = _all_sparse(profile)
    split = K.decide_split(shape, profile, terms)
    assert split["kind"] == "split", split
    t_split = split["predicted_s"]
    t_all = K.predict_plan_seconds(shape, profile, terms, b)
    assert t_all > t_split
    # Charge the split more than the difference: the all-sparse plan wins.
    analysis = 2.0 * (t_all - t_split)
    plan = K.decide_split(shape, profile, terms, None,
                          {"analysis_s": analysis,
                           "all_sparse_analysis_s": 0.0})
    assert plan["kind"] == "all_sparse", plan
    # Without the sampled share both pay the same: the split stays.
    plan = K.decide_split(shape, profile, terms, None,
                          {"analysis_s": analysis})
    assert plan["kind"] == "split", plan
    # The share never makes a split cheaper: the same charge keeps it.
    plan = K.decide_split(shape, profile, terms, None,
                          {"analysis_s": analysis,
                           "all_sparse_analysis_s": analysis})
    assert plan["kind"] == "split", plan


def test_bad_all_sparse_analysis_values():
    shape, profile, terms = _problem(FILTER_GRAD_50)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="all_sparse_analysis_s"):
            K.decide_split(shape, profile, terms, None,
                           {"all_sparse_analysis_s": bad})
