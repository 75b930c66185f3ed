"""The calibration check of the matmul and SDDMM ops' decisions
(cc/core/cost_model.h: DecisionPolicy::calibration, CalibrationAllows,
ChooseCompaction), on terms recorded from the ops: nothing is timed.

The recording is one decision of the forward product of ``hidden_2`` in
``tf-sparse-split train --target-sparsity none --compare`` (MLP
64-2048-2048-10 on the digits, batch 256, the layer's input at its natural
24% zeros; ``TF_CPP_VMODULE=split_runtime=2``, under load): the family's
calibration terms, and the terms scaled by the measured ratios with which
the op entered a split sending 253 of its 256 rows sparse (predicted 22.6
ms against 25.7 ms for the compacted all-dense plan). The plain GEMM's
ratios had been taken under a burst of load, the sparse and compacted
parts' at quieter moments; the calibration, which times both paths
interleaved on the same rows, predicted that split at 34 ms against 21 ms
all-dense, and in the training step the op's forward ran at 1.2x the time
of TF's kernel.
"""

import json
from pathlib import Path

import numpy as np
import pytest
from _helpers import kernels_or_skip

K = kernels_or_skip()
DATA = Path(__file__).resolve().parent / "data" / "mlp_b1_compaction_calls.json"

# The family's calibration terms (calibration at 50% nonzeros).
CAL = dict(dense_fixed_s=0.0, dense_rate=1.00214e11, sparse_fixed_s=0.0,
           convert_s_per_elem=3.38812e-9, sparse_rate=4.83883e10,
           copy_s_per_elem=5.27096e-10, row_copy_s_per_elem=2.60357e-10)
# The decision's terms (the calibration's scaled by the measured ratios);
# compact_scale is not in the log line: the one that gives the recorded
# all-dense prediction (0.0256972 s).
CUR = dict(CAL, dense_rate=4.08032e10, convert_s_per_elem=2.20561e-09,
           sparse_rate=7.4331e10, compact_scale=0.502887)
# bucket:rows:nnz of the call (32 buckets), k_live 1938 of 2048.
PROFILE = "22:13:18180 23:73:105692 24:111:166704 25:56:87571 26:3:4858"
SHAPE = K.matmul_split_shape(256, 2048, 1938, 2048, weight_rows=True)


def _profile(spec=PROFILE, buckets=32):
    rows = np.zeros(buckets + 1)
    nnz = np.zeros(buckets + 1)
    for tok in spec.split():
        j, r, z = tok.split(":")
        rows[int(j)], nnz[int(j)] = float(r), float(z)
    return rows, nnz


def _uniform(density, m=256, k=2048):
    return K.profile_from_row_nnz(
        np.full(m, int(round(density * k)), np.int64), k, 32)


CHECK = {"calibration": CAL}


def test_replay_enters_the_recorded_split():
    plan = K.decide_split(SHAPE, _profile(), CUR)
    assert plan["kind"] == "split" and plan["bucket"] == 25, plan
    assert plan["predicted_s"] == pytest.approx(0.0226038, rel=1e-4)
    assert plan["all_dense_s"] == pytest.approx(0.0256972, rel=1e-4)


def test_calibration_keeps_the_natural_sparsity_call_dense():
    plan = K.decide_split(SHAPE, _profile(), CUR, policy=CHECK)
    assert plan["kind"] == "all_dense" and not plan["compact"], plan
    # What the calibration itself predicts: every plan with sparse rows
    # behind all-dense (the sparsest 13 rows alone 5% behind).
    dense = K.predict_plan_seconds(SHAPE, _profile(), CAL, -1, False)
    for bucket in range(22, 33):
        assert K.predict_plan_seconds(SHAPE, _profile(), CAL, bucket,
                                      False) > dense


def test_a_kept_split_is_left_when_the_calibration_disagrees():
    previous = K.decide_split(SHAPE, _profile(), CUR)
    assert previous["kind"] == "split"
    plan = K.decide_split(SHAPE, _profile(), CUR, previous=previous,
                          policy=CHECK)
    assert plan["kind"] == "all_dense", plan
    # Without the check the split is kept (hysteresis).
    kept = K.decide_split(SHAPE, _profile(), CUR, previous=previous)
    assert kept["kind"] == "split", kept


def test_no_retime_of_a_plan_the_calibration_vetoes():
    dense = K.decide_split(SHAPE, _profile(), CUR, policy=CHECK)
    assert K.other_side_plan(SHAPE, _profile(), CUR, dense,
                             policy=CHECK) is None
    other = K.other_side_plan(SHAPE, _profile(), CUR, dense)
    assert other is not None and other["kind"] == "all_sparse", other


@pytest.mark.parametrize("density", [0.05, 0.1, 0.2])
def test_clear_sparse_wins_are_kept(density):
    """Under a sparsity target (90% zeros and more) both sets of terms
    predict the sparse path well ahead: the check changes nothing."""
    prof = _uniform(density)
    shape = K.matmul_split_shape(256, 2048, 2048, 2048, weight_rows=True)
    for terms in (CUR, CAL):
        plain = K.decide_split(shape, prof, terms)
        checked = K.decide_split(shape, prof, terms, policy=CHECK)
        assert plain["kind"] != "all_dense", plain
        assert checked == plain


def test_all_zero_rows_still_go_sparse():
    """Rows with no nonzeros cost nothing on the sparse path: a plan
    sending them there passes the check (e.g. the weight gradient's rows
    of op(a) = a^T for dead units)."""
    row_nnz = np.full(256, 1556, np.int64)
    row_nnz[:96] = 0
    prof = K.profile_from_row_nnz(row_nnz, 2048, 32)
    shape = K.matmul_split_shape(256, 2048, 2048, 2048, weight_rows=True)
    plan = K.decide_split(shape, prof, CAL, policy=CHECK)
    assert plan["kind"] == "split" and plan["bucket"] == 0, plan


def test_compaction_needs_the_calibration_too():
    """With the sparse terms unknown only the compaction is decided: the
    scaled terms compact the 110 dead columns (the compacted parts' scale
    0.5), the calibration's terms price the 16 MB weight gather above the
    flops it saves."""
    dense_only = dict(CUR, sparse_rate=0.0)
    assert K.decide_split(SHAPE, _profile(), dense_only)["compact"]
    plan = K.decide_split(SHAPE, _profile(), dense_only, policy=CHECK)
    assert plan["kind"] == "all_dense" and not plan["compact"], plan


@pytest.mark.parametrize("name", ["784x2048", "2048x2048"])
def test_batch1_compaction_passes_the_check(name):
    """At batch 1 the compacted GEMV reads only the live rows of op(b): on
    the recorded calibration of tests/data/mlp_b1_compaction_calls.json
    (see test_cost_model_compaction.py) the check lets it compact."""
    with open(DATA) as f:
        data = json.load(f)
    cal = data["row_copy_calibration"][name]["terms"]
    dec = data["families"][name]["decide"]
    rows = np.zeros(33)
    nnz = np.zeros(33)
    for j, r, z in dec["profile"]:
        rows[j], nnz[j] = r, z
    shape = K.matmul_split_shape(dec["m"], dec["k"], dec["k_live"], dec["n"],
                                 weight_rows=True)
    plan = K.decide_split(shape, (rows, nnz), cal,
                          policy={"calibration": cal})
    assert plan["kind"] == "all_dense" and plan["compact"], plan


def test_unknown_calibration_changes_nothing():
    for calibration in (None, dict(CAL, dense_rate=0.0, sparse_rate=0.0)):
        policy = {"calibration": calibration}
        assert (K.decide_split(SHAPE, _profile(), CUR, policy=policy)
                == K.decide_split(SHAPE, _profile(), CUR))


def test_max_loss_widens_the_check():
    """calibration_max_loss: the all-sparse plan, 60% behind all-dense on
    the calibration's terms, is re-timed again with a 100% allowance."""
    dense = K.decide_split(SHAPE, _profile(), CUR, policy=CHECK)
    for loss, allowed in ((0.5, False), (1.0, True)):
        policy = dict(CHECK, calibration_max_loss=loss)
        other = K.other_side_plan(SHAPE, _profile(), CUR, dense, policy=policy)
        assert (other is not None) == allowed, (loss, other)


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf")])
def test_bad_max_loss_is_refused(bad):
    with pytest.raises(ValueError, match="calibration_max_loss"):
        K.decide_split(SHAPE, _profile(), CUR,
                       policy=dict(CHECK, calibration_max_loss=bad))
