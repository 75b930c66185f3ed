"""The convolutions' agreement rule (cc/core/conv_cost.h ConvSplitAgreed):
below the zero-free rule's density, a plan with sparse images runs (other
than as a re-time) only where the family's calibration terms and its
current, ratio-scaled terms each predict it at least
``conv_split_min_speedup`` times faster than TF's kernel on the call's own
profile (each set on its own).

The calibrations below were logged (TF_CPP_VMODULE=split_runtime=2) by the
converted models of benchmarks/bench_inference.py on a loaded 2-core Zen 4
machine; nothing is timed here. cnn-small's second convolution at batch 32
(14% zeros) calibrated at 621 us dense against 646 us sparse; a burst of
load then moved its current dense terms to 839 us, the decision alone took
the all-sparse plan and the op ran it on most later calls, slower than TF's
fused kernel. Its first convolution (79% zeros) calibrated at 295 us dense
against 323 us sparse. cnn-wide's second convolution at batch 1 (47% zeros)
is a real win (312 us dense, 207 us sparse) and stays allowed.
"""

import numpy as np
import pytest
from _helpers import kernels_or_skip

K = kernels_or_skip()

#: (convolution N, H, W, C_in, C_out (3x3 SAME), calibration timings, image
#: nonzeros by (count, nnz) groups) as logged.
SMALL_CONV2_B32 = dict(
    conv=(32, 14, 14, 16, 32),
    calibration=dict(rows_full=32, rows_part=8, nnz_full=86403, nnz_thin=10816,
                     nnz_part=21748, dense_full_s=620.959e-6,
                     dense_part_s=224.222e-6, sparse_full_s=646.086e-6,
                     sparse_thin_s=183.863e-6, sparse_part_s=152.886e-6,
                     copy_elems=65856, copy_s=36.194e-6,
                     row_copy_elems=65856, row_copy_s=7.461e-6),
    images=((2, 2635), (26, 2697), (4, 2754)))
SMALL_CONV1_B32 = dict(
    conv=(32, 28, 28, 1, 16),
    calibration=dict(rows_full=32, rows_part=8, nnz_full=5182, nnz_thin=661,
                     nnz_part=1456, dense_full_s=295.047e-6,
                     dense_part_s=109.753e-6, sparse_full_s=323.489e-6,
                     sparse_thin_s=293.544e-6, sparse_part_s=81.821e-6,
                     copy_elems=65856, copy_s=37.135e-6,
                     row_copy_elems=65856, row_copy_s=9.964e-6),
    images=((1, 93), (7, 109), (4, 137), (7, 158), (5, 179), (5, 213),
            (2, 223), (1, 257)))
WIDE_CONV2_B1 = dict(
    conv=(1, 14, 14, 64, 128),
    calibration=dict(rows_full=1, rows_part=1, nnz_full=6592, nnz_thin=824,
                     nnz_part=6592, dense_full_s=311.521e-6,
                     dense_part_s=305.683e-6, sparse_full_s=206.576e-6,
                     sparse_thin_s=61.051e-6, sparse_part_s=197.292e-6,
                     copy_elems=68992, copy_s=38.107e-6,
                     row_copy_elems=62720, row_copy_s=5.909e-6),
    images=((1, 6592),))

WIDE_CONV2_B32 = dict(
    conv=(32, 14, 14, 64, 128),
    calibration=dict(rows_full=32, rows_part=8, nnz_full=207236,
                     nnz_thin=25916, nnz_part=53838, dense_full_s=11.802e-3,
                     dense_part_s=2.0902e-3, sparse_full_s=6.0921e-3,
                     sparse_thin_s=1.75209e-3, sparse_part_s=1.51278e-3,
                     copy_elems=200704, copy_s=103.002e-6,
                     row_copy_elems=200704, row_copy_s=33.65e-6),
    images=((4, 5751), (9, 6080), (7, 6493), (6, 6843), (6, 7167)))


def _problem(rec, images=None):
    n, h, w, ci, co = rec["conv"]
    shape = K.conv_split_shape(n, h, w, ci, ci, 3, 3, co, h, w)
    k = h * w * ci
    row_nnz = np.concatenate([np.full(c, v, np.int64)
                              for c, v in (images or rec["images"])])
    assert row_nnz.size == n
    profile = K.profile_from_row_nnz(row_nnz, k)
    return shape, profile, K.fit_calibration(shape, rec["calibration"])


def _all_sparse(profile):
    return len(profile[0]) - 1  # the last candidate: every image sparse


def test_burst_in_the_dense_terms_does_not_move_a_break_even_layer():
    """cnn-small conv2: with the current terms of the burst the decision
    alone takes the all-sparse plan (what the op ran); the calibration
    disagrees, so the rule vetoes it, with either set of terms as the
    current one."""
    shape, profile, base = _problem(SMALL_CONV2_B32)
    burst = dict(base, dense_fixed_s=124.298e-6, dense_rate=8.08572e10,
                 convert_s_per_elem=8.39492e-10, sparse_rate=8.89752e10)
    plan = K.decide_split(shape, profile, burst)
    assert plan["kind"] == "all_sparse", plan
    assert K.decide_split(shape, profile, base)["kind"] == "all_dense"
    j = _all_sparse(profile)
    assert not K.conv_split_agreed(shape, profile, base, burst, j)
    assert not K.conv_split_agreed(shape, profile, base, base, j)
    assert not K.conv_split_agreed(shape, profile, burst, base, j)


def test_a_calibration_that_found_dense_faster_vetoes_sparse_images():
    """cnn-small conv1 at batch 32 (79% zeros): every split candidate is
    vetoed on the calibration's own terms."""
    shape, profile, base = _problem(SMALL_CONV1_B32)
    for j in range(_all_sparse(profile) + 1):
        assert not K.conv_split_agreed(shape, profile, base, base, j), j


def test_a_real_gain_is_agreed():
    """cnn-wide conv2 at batch 1: the calibration's sparse path is 1.5x
    faster; agreed with the calibration's terms and with the slower current
    terms the op logged later (sparse 266 us against 316 us dense)."""
    shape, profile, base = _problem(WIDE_CONV2_B1)
    j = _all_sparse(profile)
    assert K.conv_split_agreed(shape, profile, base, base, j)
    later = dict(base, dense_rate=9.15652e10, convert_s_per_elem=4.13781e-9,
                 sparse_rate=7.08363e10)
    assert K.conv_split_agreed(shape, profile, base, later, j)
    # Both directions of disagreement veto: a current dense path 2x faster.
    fast_dense = dict(base, dense_rate=2.0 * base["dense_rate"],
                      dense_fixed_s=0.5 * base["dense_fixed_s"])
    assert not K.conv_split_agreed(shape, profile, base, fast_dense, j)


def test_a_change_of_the_zeros_is_still_seen():
    """The rule reads the call's own profile: the break-even layer's family,
    calibrated at 14% zeros, agrees to the sparse plan once its input holds
    90% zeros (both term sets price the nonzeros)."""
    n, h, w, ci, _ = SMALL_CONV2_B32["conv"]
    shape, profile, base = _problem(SMALL_CONV2_B32,
                                    images=((n, h * w * ci // 10),))
    assert K.decide_split(shape, profile, base)["kind"] != "all_dense"
    assert K.conv_split_agreed(shape, profile, base, base,
                               _all_sparse(profile))


def test_all_dense_is_always_agreed_and_unknown_terms_never_split():
    shape, profile, base = _problem(SMALL_CONV2_B32)
    assert K.conv_split_agreed(shape, profile, base, base, -1)
    unknown = {key: 0.0 for key in base}
    unknown["heterogeneous"] = False
    assert K.conv_split_agreed(shape, profile, unknown, unknown, -1)
    for terms in ((unknown, base), (base, unknown)):
        assert not K.conv_split_agreed(shape, profile, *terms,
                                       _all_sparse(profile))
    assert K.conv_split_min_speedup > 1.0


@pytest.mark.parametrize("rec", [SMALL_CONV2_B32, SMALL_CONV1_B32,
                                 WIDE_CONV2_B1])
def test_the_rule_is_no_looser_than_the_calibration(rec):
    """Agreed implies the calibration's own terms predict the plan at least
    conv_split_min_speedup times faster than all-dense."""
    shape, profile, base = _problem(rec)
    for j in range(_all_sparse(profile) + 1):
        if K.conv_split_agreed(shape, profile, base, base, j):
            split = K.predict_plan_seconds(shape, profile, base, j)
            dense = K.predict_plan_seconds(shape, profile, base, -1)
            assert split * K.conv_split_min_speedup <= dense * (1 + 1e-12)


def test_each_set_on_its_own():
    """cnn-wide conv2 at batch 32 (48% zeros; forced runs: 5.9 ms sparse,
    11.8 ms dense): its calibration's fit puts all-dense at 8.4 ms, and
    bursts slowed its logged sparse runs, so the slower sparse prediction of
    the two sets is above the faster dense one -- a cross-set comparison
    vetoes the 2x win; each set on its own predicts it."""
    shape, profile, base = _problem(WIDE_CONV2_B32)
    current = dict(base, dense_fixed_s=0.0, dense_rate=7.81824e10,
                   sparse_fixed_s=0.0, convert_s_per_elem=3.21898e-9,
                   sparse_rate=6.67874e10)
    j = _all_sparse(profile)
    dense = [K.predict_plan_seconds(shape, profile, t, -1)
             for t in (base, current)]
    split = [K.predict_plan_seconds(shape, profile, t, j)
             for t in (base, current)]
    assert max(split) * K.conv_split_min_speedup > min(dense)
    assert K.conv_split_agreed(shape, profile, base, current, j)


def test_the_full_count_is_charged_to_the_split():
    """The same convolution calibrated once at 687 us dense (a burst in its
    dense sample; steady calls ran 629-655 us) against 623 us sparse: agreed
    on the parts alone, vetoed once the full count that every call of a
    plan with sparse images pays (30-40 us logged) is charged to it."""
    rec = dict(SMALL_CONV2_B32, calibration=dict(
        SMALL_CONV2_B32["calibration"], dense_full_s=687.358e-6,
        dense_part_s=194.698e-6, sparse_full_s=623.503e-6,
        sparse_thin_s=186.386e-6, sparse_part_s=154.419e-6))
    shape, profile, base = _problem(rec)
    j = _all_sparse(profile)
    assert K.conv_split_agreed(shape, profile, base, base, j)
    assert not K.conv_split_agreed(shape, profile, base, base, j,
                                   split_extra_s=30e-6)
