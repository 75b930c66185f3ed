"""Convolution cost-model families across batch sizes, on recorded timings
(nothing is timed here).

tests/data/conv_family_timings.json holds, for the two conv layers of the
CLI's CNN (28x28x1 -> 32 and 28x28x32 -> 64, 3x3 SAME, bias + relu, on
digit-like inputs) at batch 1 and 32, the timings the op's calibration
takes (split_runtime.h ``Calibrate``) and the full batch's all-dense and
all-sparse times, recorded on the 2-core development machine by
``python benchmarks/bench_conv2d.py --record-family
tests/data/conv_family_timings.json``.

At batch 1 oneDNN's dense convolution runs far below its batched
per-image rate (its time is mostly per-call), so terms calibrated there
underrate the dense path at batch 32: with one family for every N, the
batch-32 call went sparse where the dense path is several times faster.
The family key now holds a batch bucket (the smallest power of two >= N),
so each bucket calibrates at its own batch size.
"""

import json
import pathlib

import numpy as np
import pytest
from _helpers import kernels_or_skip


K = kernels_or_skip()
DATA_DIR = pathlib.Path(__file__).resolve().parent / "data"

RECORDED = json.loads((DATA_DIR / "conv_family_timings.json").read_text())
LAYERS = sorted({r["layer"] for r in RECORDED["layers"]})


def _record(layer, n):
    (r,) = [r for r in RECORDED["layers"] if r["layer"] == layer and r["n"] == n]
    return r


def _shape(r, n=None):
    return K.conv_split_shape(n or r["n"], r["h"], r["w"], r["c_in"],
                              r["c_live"], r["kh"], r["kw"], r["c_out"],
                              r["out_h"], r["out_w"])


def _terms(r):
    """The terms the op fits on its first automatic call of r's batch."""
    return K.fit_calibration(_shape(r), r["calibration"])


def _plan(r, terms):
    profile = K.profile_from_row_nnz(np.asarray(r["image_nnz"], np.int64),
                                     r["h"] * r["w"] * r["c_in"])
    return K.decide_split(_shape(r), profile, terms)


def _faster_path(r):
    return "all_dense" if r["all_dense_s"] <= r["all_sparse_s"] else "all_sparse"


def _chosen_seconds(r, plan):
    """Recorded seconds of the path a plan takes (split plans: a mix of the
    two, bounded by the slower one)."""
    if plan["kind"] == "all_dense":
        return r["all_dense_s"]
    if plan["kind"] == "all_sparse":
        return r["all_sparse_s"]
    return max(r["all_dense_s"], r["all_sparse_s"])


def _key(r, n):
    return K.conv_family_key(0, 1, n, r["h"], r["w"], r["c_in"], r["kh"],
                             r["kw"], r["c_out"], r["out_h"], r["out_w"])


def test_recorded_batch_32_is_dense_faster():
    """What the recorded timings say: at batch 32 both layers are faster
    dense (the fault's situation)."""
    for layer in LAYERS:
        r = _record(layer, 32)
        assert r["all_dense_s"] < r["all_sparse_s"], layer


@pytest.mark.parametrize("layer", LAYERS)
def test_batch_1_terms_used_at_batch_32_would_choose_the_slower_path(layer):
    """The fault, on the recorded timings: the batch-1 calibration's terms
    applied to the batch-32 call pick a plan that the recorded batch-32
    timings show to be slower. (This is what the batch bucket prevents;
    the test fails if the recorded timings stop showing it.)"""
    r1, r32 = _record(layer, 1), _record(layer, 32)
    plan = _plan(r32, _terms(r1))
    assert plan["kind"] != "all_dense"
    assert _chosen_seconds(r32, plan) > 1.2 * r32["all_dense_s"]


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("n", [1, 32])
def test_own_bucket_terms_do_not_choose_a_slower_path(layer, n):
    """Terms from the calibration of the call's own batch bucket: the plan
    is never slower, by the recorded timings, than the faster of
    all-dense and all-sparse (beyond 10%: the decision's margin)."""
    r = _record(layer, n)
    plan = _plan(r, _terms(r))
    best = min(r["all_dense_s"], r["all_sparse_s"])
    assert _chosen_seconds(r, plan) <= 1.1 * best, (plan, r["all_dense_s"],
                                                    r["all_sparse_s"])
    if n == 32:
        assert plan["kind"] == _faster_path(r) == "all_dense"


@pytest.mark.parametrize("layer", LAYERS)
def test_batch_1_and_batch_32_never_share_a_family(layer):
    """The kernels key families by the batch bucket: terms learned at
    batch 1 are never used at batch 32 (nor 2..31 at 32 from below 17)."""
    r = _record(layer, 32)
    assert _key(r, 1) != _key(r, 32)
    assert _key(r, 17) == _key(r, 32) == _key(r, 30)
    assert _key(r, 16) != _key(r, 17)
    assert _key(r, 33) != _key(r, 32)


def test_batch_buckets():
    assert [K.conv_batch_bucket(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 64, 65,
                                             128, 1000)] == \
        [0, 1, 2, 4, 4, 8, 8, 16, 64, 128, 128, 1024]
    # Within a bucket N varies by less than 2x.
    for n in range(1, 600):
        b = K.conv_batch_bucket(n)
        assert b >= n and b < 2 * n and b & (b - 1) == 0


def test_family_key_is_the_geometry_and_the_bucket():
    base = dict(op=2, dtype=1, n=32, h=28, w=28, c_in=32, kh=3, kw=3,
                c_out=64, out_h=28, out_w=28)
    key = K.conv_family_key(**base)
    assert key[:3] == [2, 1, 32]
    for field, other in (("op", 3), ("dtype", 2), ("h", 27), ("c_in", 16),
                         ("c_out", 32), ("kh", 5), ("out_w", 14)):
        assert K.conv_family_key(**dict(base, **{field: other})) != key, field
    with pytest.raises(ValueError):
        K.conv_family_key(**dict(base, n=-1))


def test_conv_split_shape_matches_the_documented_formulas():
    s = K.conv_split_shape(32, 28, 28, 32, 30, 3, 3, 64, 28, 28)
    assert s["m"] == 32 and s["k"] == 28 * 28 * 32 and s["k_live"] == 28 * 28 * 30
    assert s["sparse_flops_per_nnz"] == 2 * 3 * 3 * 64
    assert s["dense_flops_per_elem"] == pytest.approx(2 * 3 * 3 * 64)
    assert s["row_copy_elems"] == 28 * 28 * 64
    with pytest.raises(ValueError):
        K.conv_split_shape(1, 4, 4, 2, 3, 3, 3, 1, 4, 4)  # c_live > c_in
