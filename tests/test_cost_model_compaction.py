"""The compacted dense parts' own scale (cc/core/cost_model.h:
CostTerms::compact_scale, FamilyModel::Record) and the size of the
calibration's copy timing (CalibrationCopyRows), on synthetic terms and on
recorded calls of a converted MLP at batch 1: nothing is timed.

The recording (tests/data/mlp_b1_compaction_calls.json, made with
tests/data/record_retime.py from the ops' VLOG lines; see its description)
holds the calls of the three layer families of the MLP 784-2048-2048-10 of
benchmarks/bench_inference.py at batch 1: the plain all-dense GEMV, the
compacted one (the live rows of op(b) gathered first) and the all-sparse
path, each timed in the same process. At batch 1 the live columns of
op(a) are its nonzeros (21% of the input layer's 784, 31% of the hidden
layer's 2048), and the compacted GEMV reads only their rows of op(b).

Two faults kept the plain GEMV (1.4-2.1x slower) running there:

* the copy term was timed on the one-row sample (392 values), mostly the
  gather's fixed cost: ~1 ns a value against 0.56 ns on 2^16 values, which
  priced the compaction's gather of op(b)'s live rows out;
* one dense window held the measured/predicted ratios of both GEMVs: the
  plain one reads op(b) from memory (3x its calibrated time), the
  compacted one reads the gathered rows from cache (1.1x), so the median
  -- and with it the compaction choice -- moved with the plan it came from.
"""

import json
import math
import statistics
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from _helpers import kernels_or_skip
from _helpers import cost_terms as _terms

K = kernels_or_skip()
DATA = Path(__file__).resolve().parent / "data" / "mlp_b1_compaction_calls.json"
LAYERS = ("784x2048", "2048x2048")


def _data():
    with open(DATA) as f:
        return json.load(f)


# -- the calibration's copy timing ------------------------------------------

@pytest.mark.parametrize("k,rows_full", [(784, 1), (2048, 1), (784, 32),
                                         (2048, 32), (784, 1337), (1, 1),
                                         (3, 0), (12544, 83)])
def test_copy_timing_covers_enough_values(k, rows_full):
    rows = K.calibration_copy_rows(k, rows_full)
    half = max(1, k // 2)
    assert rows >= max(1, rows_full)
    assert rows * half >= K.CALIBRATION_COPY_ELEMS == 2 ** 16
    if rows > max(1, rows_full):  # no more rows than it takes
        assert (rows - 1) * half < 2 ** 16


def test_copy_timing_rejects_bad_sizes():
    for k, rows in ((0, 1), (-1, 1), (784, -1)):
        with pytest.raises(ValueError):
            K.calibration_copy_rows(k, rows)


# -- the compacted parts' scale -------------------------------------------

def _b1_case():
    m, k, k_live, n = 1, 784, 164, 2048
    shape = K.matmul_split_shape(m, k, k_live, n)
    terms = _terms(dense_fixed_s=0.0, dense_rate=2e10,
                   copy_s_per_elem=5.7e-10, sparse_rate=1e9)
    prof = K.profile_from_row_nnz(np.array([k_live], np.int64), k, 32)
    return shape, terms, prof


def test_compact_scale_multiplies_only_compacted_parts():
    shape, terms, prof = _b1_case()
    plain = K.predict_plan_seconds(shape, prof, terms, -1, False)
    packed = K.predict_plan_seconds(shape, prof, terms, -1, True)
    scaled = dict(terms, compact_scale=0.5)
    assert K.predict_plan_seconds(shape, prof, scaled, -1, False) == plain
    assert math.isclose(K.predict_plan_seconds(shape, prof, scaled, -1, True),
                        0.5 * packed)
    unscaled = dict(terms, compact_scale=0.0)
    assert K.predict_plan_seconds(shape, prof, unscaled, -1, True) == packed
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            K.predict_plan_seconds(shape, prof, dict(terms, compact_scale=bad),
                                   -1, True)


def test_each_gemv_is_scaled_by_its_own_measurements():
    """The plain GEMV measured 3x its calibrated time (op(b) from memory),
    the compacted one 1.05x (the gathered rows from cache): each keeps its
    own scale, both are predicted as measured, and the compacted one is
    chosen call after call -- one window holding both ratios flipped the
    choice with its median."""
    shape, terms, prof = _b1_case()
    fam = K.SplitFamilyModel()
    fam.set_calibration(terms)
    plain = K.predict_plan_seconds(shape, prof, terms, -1, False)
    for _ in range(5):
        fam.record(shape, 1, False, 3.0 * plain, 0, 0, 0)
    t = fam.terms()
    assert math.isclose(t["dense_rate"], terms["dense_rate"] / 3.0)
    assert t["compact_scale"] == 1.0
    packed_now = K.predict_plan_seconds(shape, prof, t, -1, True)
    plans = []
    for _ in range(15):
        fam.record(shape, 1, True, 1.05 * packed_now, 0, 0, 0)
        t = fam.terms()
        plans.append(K.decide_split(shape, prof, t))
    assert math.isclose(t["compact_scale"], 1.05)
    assert math.isclose(t["dense_rate"], terms["dense_rate"] / 3.0)
    assert math.isclose(K.predict_plan_seconds(shape, prof, t, -1, False),
                        3.0 * plain)
    assert math.isclose(K.predict_plan_seconds(shape, prof, t, -1, True),
                        1.05 * packed_now)
    assert all(p["kind"] == "all_dense" and p["compact"] for p in plans)


def test_a_slow_compaction_is_left():
    """A compacted GEMV measured slower than the plain one (its gathers
    dearer than calibrated): its scale rises until the plain GEMV is
    chosen again."""
    shape, terms, prof = _b1_case()
    fam = K.SplitFamilyModel()
    fam.set_calibration(terms)
    plain = K.predict_plan_seconds(shape, prof, terms, -1, False)
    for _ in range(3):
        fam.record(shape, 1, False, 3.0 * plain, 0, 0, 0)
    assert K.decide_split(shape, prof, fam.terms())["compact"]
    for _ in range(3):
        fam.record(shape, 1, True, 1.2 * 3.0 * plain, 0, 0, 0)
    plan = K.decide_split(shape, prof, fam.terms())
    assert plan["kind"] == "all_dense" and not plan["compact"]


# -- replay of recorded calls ------------------------------------------------

def _replay(fam, calls=300, terms=None):
    """Decides every call with decide_and_retime on the family's terms, takes
    the next recorded seconds of the path the plan runs (each path's
    observations in recorded order, cycled), records them as the op does
    (its first all-dense call at a shape kept out); returns the paths run
    and the recorded median seconds per path."""
    dec = fam["decide"]
    m, k, k_live, n = dec["m"], dec["k"], dec["k_live"], dec["n"]
    shape = K.matmul_split_shape(m, k, k_live, n)
    rows = np.zeros(33)
    nnz = np.zeros(33)
    for j, r, z in dec["profile"]:
        rows[j], nnz[j] = r, z
    cols = fam["calls"]
    obs = {}
    for i in range(len(cols["op"])):
        key = (cols["rows_dense"][i], cols["rows_sparse"][i],
               bool(cols["compact"][i]))
        obs.setdefault(key, []).append(
            (cols["dense_s"][i], cols["sparse_s"][i], cols["nnz_sparse"][i]))
    model = K.SplitFamilyModel()
    model.set_calibration(terms or fam["calibrations"][0]["terms"])
    mem = K.SplitPlanMemory()
    pos, run = {}, []
    for _ in range(calls):
        plan = mem.decide_and_retime(shape, (rows, nnz), model.terms())["plan"]
        if plan["kind"] == "all_dense":
            key = (m, 0, bool(plan["compact"]))
        else:
            rs = int(round(rows[:plan["bucket"] + 1].sum()))
            key = (m - rs, rs, bool(plan["compact"]) and rs < m)
        seq = obs[key]
        i = pos.get(key, 0)
        pos[key] = i + 1
        dense_s, sparse_s, nnz_sparse = seq[i % len(seq)]
        one_time = key[1] == 0 and mem.note_dense_shape(
            m, k_live if key[2] else k, key[2])
        model.record(shape, key[0], key[2], dense_s, key[1], nnz_sparse,
                     sparse_s, dense_one_time=one_time)
        run.append(key)
    medians = {key: statistics.median(d + s for d, s, _ in v)
               for key, v in obs.items()}
    return run, medians


@pytest.mark.parametrize("name", LAYERS)
def test_recording_times_the_compacted_gemv_fastest(name):
    _, medians = _replay(_data()["families"][name], calls=1)
    compacted = medians[(1, 0, True)]
    assert compacted < 0.8 * medians[(1, 0, False)]
    assert compacted < 0.8 * medians[(0, 1, False)]


@pytest.mark.parametrize("name", LAYERS)
def test_replay_keeps_the_compacted_gemv(name):
    """With each GEMV on its own scale the plan settles on the compacted
    one; with one window the input layer alternated between the two (76 of
    the last 150 calls compacted) and the hidden layer stayed on the plain
    one (7 of 150)."""
    run, medians = _replay(_data()["families"][name])
    late = Counter(run[len(run) // 2:])
    assert late[(1, 0, True)] >= 0.9 * sum(late.values()), (late, medians)


@pytest.mark.parametrize("name", LAYERS)
def test_one_row_copy_term_priced_the_compaction_out(name):
    """The same replay from the terms of a calibration that timed its copy
    on the one-row sample (392 or 1024 values: 1.0-1.7 ns a value against
    0.56-0.60 ns on 2^16 values): at the hidden layer (640 live rows of
    2048 values to gather) the gathers look too dear and the plain GEMV
    runs nearly every call. (The input layer's 164 rows compact either
    way once each GEMV has its own scale.)"""
    d = _data()
    old = d["copy_timed_on_one_row"][name]
    new = d["families"][name]["calibrations"][0]["terms"]
    assert math.isclose(old["terms"]["copy_s_per_elem"],
                        old["copy_s"] / old["copy_elems"], rel_tol=1e-3)
    assert old["copy_elems"] < K.CALIBRATION_COPY_ELEMS
    assert old["terms"]["copy_s_per_elem"] > 1.5 * new["copy_s_per_elem"]
    if name == "2048x2048":
        run, _ = _replay(d["families"][name], terms=old["terms"])
        late = Counter(run[len(run) // 2:])
        assert late[(1, 0, True)] <= 0.1 * sum(late.values()), late


# -- the row-copy term ------------------------------------------------------

def test_row_copy_term_is_fitted_from_its_timing():
    shape = K.matmul_split_shape(1, 2048, 2048, 2048, weight_rows=True)
    assert shape["weight_run_elems"] == 2048
    assert K.matmul_split_shape(1, 2048, 2048, 2048)["weight_run_elems"] == 0
    cal = _data()["row_copy_calibration"]["2048x2048"]
    t = K.fit_calibration(shape, dict(
        rows_full=1, rows_part=1, dense_full_s=1e-3, dense_part_s=1e-3,
        nnz_full=643, nnz_thin=81, nnz_part=643, sparse_full_s=2e-3,
        sparse_thin_s=1e-3, sparse_part_s=2e-3, copy_elems=cal["copy_elems"],
        copy_s=cal["copy_s"], row_copy_elems=cal["row_copy_elems"],
        row_copy_s=cal["row_copy_s"]))
    assert math.isclose(t["row_copy_s_per_elem"],
                        cal["terms"]["row_copy_s_per_elem"], rel_tol=1e-3)
    # Copying whole rows ran 2.6-3.7x faster per value than the indexed
    # gather on the same values.
    for name in LAYERS:
        terms = _data()["row_copy_calibration"][name]["terms"]
        assert terms["row_copy_s_per_elem"] < 0.5 * terms["copy_s_per_elem"]


def test_weight_row_gather_is_priced_as_row_copies():
    """A compacted product whose b is not transposed gathers k_live whole
    rows of op(b): one indexed access per row and a row copy per value. An
    unknown row-copy term (0: statistics read back, older terms) or a
    transposed b keep the indexed price."""
    m, k, k_live, n = 1, 2048, 640, 2048
    terms = _terms(dense_fixed_s=0.0, dense_rate=1e10, copy_s_per_elem=6e-10,
                   row_copy_s_per_elem=2e-10)
    prof = K.profile_from_row_nnz(np.array([k_live], np.int64), k, 32)
    rows = K.matmul_split_shape(m, k, k_live, n, weight_rows=True)
    indexed = K.matmul_split_shape(m, k, k_live, n)
    flops = 2.0 * k_live * n / 1e10
    gather_a = k_live * 6e-10
    got = K.predict_plan_seconds(rows, prof, terms, -1, True)
    want = flops + gather_a + k_live * n * 2e-10 + k_live * 6e-10
    assert math.isclose(got, want, rel_tol=1e-9)
    got = K.predict_plan_seconds(indexed, prof, terms, -1, True)
    assert math.isclose(got, flops + gather_a + k_live * n * 6e-10,
                        rel_tol=1e-9)
    unknown = dict(terms, row_copy_s_per_elem=0.0)
    assert math.isclose(K.predict_plan_seconds(rows, prof, unknown, -1, True),
                        got, rel_tol=1e-9)


@pytest.mark.parametrize("name", LAYERS)
def test_calibration_terms_compact_the_batch1_gemv(name):
    """On the terms of a calibration that timed the row copy, the first
    decision at batch 1 already compacts (the live rows of op(b) copied
    whole); priced as an indexed gather (a transposed b, or without the
    term) the hidden layer's 640 live rows of 2048 values kept the plain
    GEMV until measured ratios moved the terms -- the plain GEMV ran at
    1123 us, the compacted one at 778 us in the recording."""
    cal = _data()["row_copy_calibration"][name]
    dec = _data()["families"][name]["decide"]
    m, k, k_live, n = dec["m"], dec["k"], dec["k_live"], dec["n"]
    rows = np.zeros(33)
    nnz = np.zeros(33)
    for j, r, z in dec["profile"]:
        rows[j], nnz[j] = r, z
    shape = K.matmul_split_shape(m, k, k_live, n, weight_rows=True)
    plan = K.decide_split(shape, (rows, nnz), cal["terms"])
    assert plan["kind"] == "all_dense" and plan["compact"], plan
    if name == "2048x2048":
        indexed = K.matmul_split_shape(m, k, k_live, n)
        plan = K.decide_split(indexed, (rows, nnz), cal["terms"])
        assert plan["kind"] == "all_dense" and not plan["compact"], plan
