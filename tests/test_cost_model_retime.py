"""Re-timing the path that stopped running, and the robust dense
observations (cc/core/cost_model.h: RetimePolicy, RetimeDue, OtherSidePlan,
PlanMemory::DecideAndRetime, FamilyModel::Record), on synthetic terms and on
recorded calls of a converted MLP: nothing is timed.

The recordings (tests/data/mlp_b32_retime_calls.json, made with
tests/data/record_retime.py from the ops' VLOG lines; see its description)
hold the calls of the three layer families of the MLP 784-2048-2048-10 at
batch 32 of benchmarks/bench_inference.py: the calibration terms, the
profile and the part seconds of the path each call ran, with both paths
timed in the model. A replay feeds those seconds back through
SplitFamilyModel and SplitPlanMemory.decide_and_retime, as the ops do
(every call decided on a full count), and checks where the plan ends up.
The replays use the recorded seconds in recorded order, bursts of load
included; paths within 10% of the fastest recorded median (the decision's
entry margin) count as ties.
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
    assert K.retime_policy_defaults() == {"max_ratio": 3.0,
                                          "first_period": 4,
                                          "max_period": 256,
                                          "confirm_runs": 3,
                                          "hold_runs": 0}


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
    shape, prof, terms = _sparse_winning_case(3.5)
    mem = K.SplitPlanMemory()
    for _ in range(300):
        r = mem.decide_and_retime(shape, prof, terms)
        assert not r["retimed"] and r["plan"]["kind"] != "all_dense"
    assert mem.retime_state()["retimes"] == 0
    # ... unless the policy allows that much.
    r = [mem.decide_and_retime(shape, prof, terms,
                               retime_policy={"max_ratio": 4.0,
                                              "first_period": 4,
                                              "max_period": 256})["retimed"]
         for _ in range(20)]
    assert any(r)


def test_first_period_zero_disables_retiming():
    shape, prof, terms = _sparse_winning_case(1.2)
    mem = K.SplitPlanMemory()
    off = {"max_ratio": 3.0, "first_period": 0, "max_period": 256}
    assert not any(mem.decide_and_retime(shape, prof, terms,
                                         retime_policy=off)["retimed"]
                   for _ in range(100))


def test_all_dense_plan_retimes_every_row_sparse():
    """Dense decided (every plan with sparse rows predicted slower, the
    all-sparse one 1.3x): the re-time runs every row sparse, and the
    hysteresis keeps the decided all-dense plan."""
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
    assert kinds[3] == "all_sparse"
    other = K.other_side_plan(shape, prof, terms, r["decided"])
    assert other["kind"] == "all_sparse" and other["threshold"] == 1.0
    assert math.isclose(other["predicted_s"], 1.3 * dense_s)
    # Beyond max_ratio (3x) no re-time.
    slow = _terms(sparse_rate=terms["sparse_rate"] / 3)
    mem = K.SplitPlanMemory()
    assert not any(mem.decide_and_retime(shape, prof, slow)["retimed"]
                   for _ in range(40))


def test_tiny_all_dense_calls_are_not_retimed():
    """A call predicted a few microseconds all-dense can never save the
    least gain (20 us) with sparse rows: re-timing its sparse path would
    change nothing."""
    m, k, n = 16, 32, 16
    rows = _uniform(m, k, 0.1)
    shape = K.matmul_split_shape(m, k, k, n)
    prof = _profile(rows, k)
    terms = _terms(dense_fixed_s=3e-6, dense_rate=1e10, sparse_fixed_s=2e-6,
                   sparse_rate=1e9)
    mem = K.SplitPlanMemory()
    for _ in range(40):
        r = mem.decide_and_retime(shape, prof, terms)
        assert r["decided"]["kind"] == "all_dense" and not r["retimed"]
    assert r["decided"]["all_dense_s"] < 2e-5
    other = K.other_side_plan(shape, prof, terms, r["decided"])
    assert other["predicted_s"] < 3 * r["decided"]["predicted_s"]


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


def test_a_change_of_side_waits_for_runs_of_the_new_side():
    """A decision that changes side is confirmed by runs of the new side
    (RetimePolicy.confirm_runs, 3): with no re-time of the other side since
    the side began, the first three calls that decide the change run the
    new side's plan as re-times and the old plan stays decided; the fourth
    takes the change. A side change the re-times already measured often
    enough is taken at once (test_change_of_side_restarts_the_schedule)."""
    shape, prof, sparse_terms = _sparse_winning_case(1.5)
    dense_terms = dict(sparse_terms, sparse_rate=sparse_terms["sparse_rate"] / 2)
    mem = K.SplitPlanMemory()
    for _ in range(3):  # before the first re-time (call 4)
        r = mem.decide_and_retime(shape, prof, sparse_terms)
        assert r["decided"]["kind"] != "all_dense" and not r["retimed"]
    seen = []
    for _ in range(4):
        r = mem.decide_and_retime(shape, prof, dense_terms)
        seen.append((r["decided"]["kind"] != "all_dense", r["plan"]["kind"],
                     r["retimed"]))
    assert seen[:3] == [(True, "all_dense", True)] * 3
    assert seen[3] == (False, "all_dense", False)
    st = mem.retime_state()
    assert st["side"] == 0 and st["confirmations"] == 3
    assert st["other_runs"] == 0 and st["calls_on_side"] == 1
    # A change that the next call takes back is never taken: one call
    # deciding dense (run as a re-time), then sparse again.
    mem = K.SplitPlanMemory()
    for _ in range(3):
        mem.decide_and_retime(shape, prof, sparse_terms)
    r = mem.decide_and_retime(shape, prof, dense_terms)
    assert r["retimed"] and r["decided"]["kind"] != "all_dense"
    for _ in range(20):
        r = mem.decide_and_retime(shape, prof, sparse_terms)
        assert r["decided"]["kind"] != "all_dense"
    assert mem.retime_state()["side"] == 1
    # confirm_runs 0: the change is taken at once.
    mem = K.SplitPlanMemory()
    now = {"max_ratio": 3.0, "first_period": 4, "max_period": 256,
           "confirm_runs": 0}
    for _ in range(3):
        mem.decide_and_retime(shape, prof, sparse_terms, retime_policy=now)
    r = mem.decide_and_retime(shape, prof, dense_terms, retime_policy=now)
    assert r["decided"]["kind"] == "all_dense" and not r["retimed"]


def test_one_fast_retimed_observation_does_not_flip_the_plan():
    """The failure the confirmation guards against, on a family model: an
    op decided all-dense, whose every-row-sparse re-time runs once in a
    quiet moment (0.6x its steady time), would flip to the sparse side on
    that single observation (a path with fewer than 3 ratios counts by its
    smallest); the confirming runs see the steady time, the median of three
    decides and the plan stays all-dense."""
    m, k, n = 256, 1024, 1024
    rows = _uniform(m, k, 0.1)
    shape = K.matmul_split_shape(m, k, k, n)
    prof = _profile(rows, k)
    dense_s = 2.0 * m * k * n / 1e11
    # Sparse predicted 1.3x the dense call; truly 1.3x, once 0.6x.
    base = _terms(sparse_rate=2.0 * rows.sum() * n / (1.3 * dense_s))
    fam = K.SplitFamilyModel()
    fam.set_calibration(base)
    mem = K.SplitPlanMemory()
    kinds = []
    fast_once = True
    for i in range(40):
        r = mem.decide_and_retime(shape, prof, fam.terms())
        plan = r["plan"]
        kinds.append(r["decided"]["kind"])
        if plan["kind"] == "all_dense":
            fam.record(shape, m, False, dense_s, 0, 0, 0)
        else:
            t = 1.3 * dense_s * (0.6 if fast_once else 1.0)
            fast_once = False
            fam.record(shape, 0, False, 0, m, float(rows.sum()), t)
    assert set(kinds) == {"all_dense"}, kinds
    assert mem.retime_state()["confirmations"] >= 1


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


def test_first_all_dense_call_of_a_shape_is_kept_out_of_the_ratios():
    """The ops pass each op instance's first all-dense call at a shape as
    dense_one_time (it pays the oneDNN primitive creation)."""
    m, k, k_live, n = 32, 2048, 1666, 10
    fam = K.SplitFamilyModel()
    base = _terms(dense_fixed_s=1e-5, dense_rate=5e10)
    fam.set_calibration(base)
    shape = K.matmul_split_shape(m, k, k_live, n)
    pred = K.predict_plan_seconds(shape, _profile(np.ones(m, np.int64), k),
                                  base, -1, True)
    op_a, op_b = K.SplitPlanMemory(), K.SplitPlanMemory()
    first = op_a.note_dense_shape(m, k_live, True)
    assert first
    assert not fam.record(shape, m, True, 10 * pred, 0, 0, 0,
                          dense_one_time=first)
    assert fam.terms()["dense_rate"] == base["dense_rate"]
    assert fam.terms()["compact_scale"] == 1.0
    # The same op's next call at the shape counts (a compacted part: in the
    # compacted parts' own scale); another op's first not.
    assert not op_a.note_dense_shape(m, k_live, True)
    assert fam.record(shape, m, True, 1.1 * pred, 0, 0, 0)
    assert math.isclose(fam.terms()["compact_scale"], 1.1)
    assert fam.terms()["dense_rate"] == base["dense_rate"]
    assert op_b.note_dense_shape(m, k_live, True)
    # Another compaction (kc) or no compaction is another shape.
    assert op_a.note_dense_shape(m, 1500, True)
    assert op_a.note_dense_shape(m, k_live, False)
    # At most 64 shapes are remembered; later new ones count as seen.
    for kc in range(100, 161):
        assert op_a.note_dense_shape(m, kc, True)
    assert not op_a.note_dense_shape(m, 999, True)


def test_fewer_than_three_ratios_count_by_their_smallest():
    m, k, n = 256, 1024, 1024
    fam = K.SplitFamilyModel()
    base = _terms(dense_rate=1e11, sparse_rate=5e10)
    fam.set_calibration(base)
    shape = K.matmul_split_shape(m, k, k, n)
    pred = 2.0 * m * k * n / 1e11
    fam.record(shape, m, False, 4.0 * pred, 0, 0, 0)
    assert math.isclose(fam.terms()["dense_rate"], 1e11 / 4.0)
    fam.record(shape, m, False, 1.5 * pred, 0, 0, 0)
    assert math.isclose(fam.terms()["dense_rate"], 1e11 / 1.5)
    fam.record(shape, m, False, 2.0 * pred, 0, 0, 0)  # median of 3
    assert math.isclose(fam.terms()["dense_rate"], 1e11 / 2.0)


# -- replay of recorded calls ------------------------------------------------

def _recording(name):
    with open(DATA) as f:
        return json.load(f)["recordings"][name]


def _calls(fam):
    """The calls of one family, in order (dicts, as record_retime.py
    parses them; the shape from the family's decision line)."""
    cols = fam["calls"]
    d = fam["decide"]
    return [dict({c: cols[c][i] for c in cols}, m=d["m"], k=d["k"])
            for i in range(len(cols["op"]))]


def _decides(fam):
    return [fam["decide"]]


def _profile_of(decide):
    rows = np.zeros(33)
    nnz = np.zeros(33)
    for j, r, z in decide["profile"]:
        rows[j] = r
        nnz[j] = z
    return rows, nnz


def _key(rows_dense, rows_sparse, compact):
    return (int(rows_dense), int(rows_sparse), bool(compact))


def _plan_key(plan, prof, m, shape):
    """The (rows dense, rows sparse, compact) a plan runs, as the op's
    Apply does it (the dense part's compaction is ChooseCompaction's)."""
    rows, _ = prof
    if plan["kind"] == "all_dense":
        return _key(m, 0, plan["compact"])
    rs = int(round(rows[:plan["bucket"] + 1].sum()))
    return _key(m - rs, rs, plan["compact"] and rs < m)


class _Recorded:
    """Measured seconds per (op, path) in recorded order; each op's first
    all-dense call at a shape (the primitive creation) is handed out once,
    then the steady observations cycle."""

    def __init__(self, calls):
        self.obs = {}
        for c in calls:
            key = _key(c["rows_dense"], c["rows_sparse"], c["compact"])
            self.obs.setdefault((c["op"], key), []).append(
                (c["dense_s"], c["sparse_s"], c["nnz_sparse"]))
        self.pos = {}

    def keys(self):
        return {k for _, k in self.obs}

    def steady(self, key):
        """Every op's observations of `key` after its first."""
        out = []
        for (op, k), v in self.obs.items():
            if k == key:
                out += v[1:] if key[1] == 0 else v
        return out

    def median(self, key):
        s = self.steady(key)
        return statistics.median(d + p for d, p, _ in s) if s else math.inf

    def next(self, op, key):
        seq = self.obs.get((op, key))
        if seq is None:  # this op never ran the path: the others' steady ones
            seq = self.steady(key)
            assert seq, f"path {key} was never recorded"
            op = ("any", op)
            self.obs[(op, key)] = seq
        i = self.pos.get((op, key), 0)
        self.pos[(op, key)] = i + 1
        if i < len(seq):
            return seq[i]
        steady = seq[1:] if key[1] == 0 and len(seq) > 1 else seq
        return steady[(i - len(seq)) % len(steady)]


def _replay_setup(fam):
    """A recorded family's calls, their recorded seconds, a model with its
    first calibration, its first deciding call and that call's SplitShape."""
    calls = _calls(fam)
    model = K.SplitFamilyModel()
    model.set_calibration(fam["calibrations"][0]["terms"])
    d0 = _decides(fam)[0]
    shape = K.matmul_split_shape(d0["m"], d0["k"], d0["k_live"], d0["n"])
    return calls, _Recorded(calls), model, d0, shape


def _record_path(rec, mem, model, op, key, shape, m, k, k_live):
    """Records the recorded seconds of the path `key` takes in `op`'s
    call into `model` (the dense path's first runs one-time, as the ops
    do); returns the call's seconds."""
    dense_s, sparse_s, nnz_sparse = rec.next(op, key)
    rows_dense, rows_sparse, compact = key
    one_time = rows_dense == m and mem.note_dense_shape(
        m, k_live if compact else k, compact)
    model.record(shape, rows_dense, compact, dense_s, rows_sparse,
                 nnz_sparse, sparse_s, dense_one_time=one_time)
    return dense_s + sparse_s


def _replay(fam, repeat=4, retime_policy=None, with_state=False):
    """Replays a recorded family `repeat` times over its recorded op order:
    decide_and_retime on each call's profile with the family's terms, the
    recorded seconds of the path the plan takes, record. Returns per call
    (op, key run, decided side, retimed, seconds)."""
    calls, rec, model, d0, shape = _replay_setup(fam)
    m, k, k_live = d0["m"], d0["k"], d0["k_live"]
    # The benchmark calls the model on one batch: one profile throughout.
    prof = _profile_of(d0)
    mems = {}
    out = []
    for _ in range(repeat):
        for c in calls:
            mem = mems.setdefault(c["op"], K.SplitPlanMemory())
            r = mem.decide_and_retime(shape, prof, model.terms(),
                                      retime_policy=retime_policy)
            key = _plan_key(r["plan"], prof, m, shape)
            seconds = _record_path(rec, mem, model, c["op"], key, shape, m, k,
                                   k_live)
            out.append((c["op"], key, 0 if r["decided"]["kind"] == "all_dense"
                        else 1, r["retimed"], seconds))
    if with_state:
        return rec, out, {op: mem.retime_state()["confirmations"]
                          for op, mem in mems.items()}
    return rec, out


RECORDINGS = ("forced_1", "forced_2", "bench_1", "bench_2")
LAYERS = ("784x2048", "2048x2048", "2048x10")


def _families(recording):
    """{'k x n': family} of one recording."""
    rec = _recording(recording)
    return {f"{fam['calibrations'][0]['k']}x{_decides(fam)[0]['n']}": fam
            for fam in rec["families"].values()}


@pytest.mark.parametrize("recording", RECORDINGS)
def test_recording_holds_the_three_layers_of_the_mlp(recording):
    fams = _families(recording)
    assert set(fams) == set(LAYERS)
    for name, fam in fams.items():
        calls = _calls(fam)
        assert len(calls) >= 60, name
        assert all(c["m"] == 32 for c in calls)
        # Both all-dense and all-sparse calls were timed in the model.
        keys = {(c["rows_dense"] > 0, c["rows_sparse"] > 0) for c in calls}
        if recording.startswith("forced"):
            assert {(True, False), (False, True)} <= keys


def _cases():
    for r in RECORDINGS:
        for name in LAYERS:
            marks = ()
            if (r, name) == ("forced_1", "784x2048"):
                # The first sparse calls this op made (three automatic calls,
                # then its forced block) ran in a burst of load: 755, 3661
                # and 1547 us, then 3308 and 3229 us, against a median of
                # 837 us. Replayed in that order, the sparse estimate leaves
                # the re-time range (2x the dense plan) and the plan stays
                # all-dense, 17% slower than sparse by the recorded medians.
                marks = (pytest.mark.xfail(strict=True, reason=(
                    "re-times drawn from a burst of load push the sparse "
                    "estimate beyond max_ratio")),)
            yield pytest.param(r, name, marks=marks, id=f"{r}-{name}")


def _good_paths(rec):
    """Recorded paths within the decision's entry margin (10%) of the
    fastest recorded median: the margin below which the plan is kept."""
    medians = {key: rec.median(key) for key in rec.keys()}
    best = min(medians.values())
    return medians, {key for key, v in medians.items() if v <= 1.10 * best}


@pytest.mark.parametrize("recording,name", list(_cases()))
def test_replay_converges_to_the_faster_recorded_path(recording, name):
    fam = _families(recording)[name]
    rec, out = _replay(fam)
    medians, good = _good_paths(rec)
    late = out[len(out) // 2:]
    on_good = sum(key in good for _, key, _, _, _ in late) / len(late)
    assert on_good >= 0.8, (medians, on_good)


@pytest.mark.parametrize("recording", RECORDINGS)
@pytest.mark.parametrize("name", LAYERS)
def test_replay_retimes_stay_bounded(recording, name):
    fam = _families(recording)[name]
    rec, out, confirmations = _replay(fam, with_state=True)
    for op in {o for o, *_ in out}:
        seq = [(side, retimed) for o, _, side, retimed, _ in out if o == op]
        # The bound per run of decisions on one side (RetimePolicy).
        bound, run, prev = 0.0, 0, None
        for side, _ in seq + [(None, False)]:
            if side != prev and run:
                bound += math.log2(run / 4 + 1) + run / 256
                run = 0
            run += 1
            prev = side
        # Confirming runs of a change of side (RetimePolicy.confirm_runs)
        # come on top of the schedule's re-times: at most confirm_runs per
        # side the op was decided on.
        changes = sum(a != b for (a, _), (b, _) in zip(seq, seq[1:]))
        confirm = K.retime_policy_defaults()["confirm_runs"]
        conf = confirmations[op]
        assert sum(r for _, r in seq) <= bound + conf, op
        assert conf <= confirm * (changes + 1), (op, conf)
    # What the re-timed calls cost beyond the fastest recorded path: a few
    # percent of the replayed time.
    best = min(rec.median(key) for key in rec.keys())
    total = sum(s for *_, s in out)
    extra = sum(max(0.0, s - best) for _, _, _, retimed, s in out if retimed)
    assert extra <= 0.05 * total, (extra, total)


@pytest.mark.parametrize("recording,name", [("forced_1", "784x2048"),
                                            ("forced_1", "2048x2048"),
                                            ("bench_1", "2048x2048")])
def test_without_retiming_the_replay_keeps_the_slower_path(recording, name):
    """The failure the re-time rule fixes, on the same recordings: the plan
    keeps a path that is more than 10% slower by the recorded medians."""
    fam = _families(recording)[name]
    off = {"max_ratio": 3.0, "first_period": 0, "max_period": 256}
    rec, out = _replay(fam, retime_policy=off)
    medians, good = _good_paths(rec)
    late = out[len(out) // 2:]
    assert sum(key in good for _, key, *_ in late) <= 0.1 * len(late), medians
    # ... and with re-timing (the default) the same replay leaves it, except
    # for forced_1's input layer (see _cases).
    if (recording, name) != ("forced_1", "784x2048"):
        rec, out = _replay(fam)
        late = out[len(out) // 2:]
        assert sum(key in good for _, key, *_ in late) >= 0.8 * len(late)


# -- the analysis the ops run: back-off and re-time schedule in calls ---------
#
# The recorded benchmark calls (bench_*) ran with full_stats false: most
# all-dense calls counted a sample or nothing and decided nothing. The
# runtime (SplitCall over PlanMemory) keeps the re-time schedule in calls
# for every op: a call without a decision counts in it
# (note_all_dense_without_count), the call a re-time falls due on counts
# fully (choose_analysis_and_backoff), and a full count the back-off led to
# that stays all-dense continues the back-off (record_analysis's
# continue_backoff_from). These replays run the same steps.

# Counting cost per value of op(a): the order of one read at copy bandwidth
# on these machines (4 bytes at ~41 GB/s) and twice that.
COUNT_S_PER_ELEM = (1e-10, 2e-10)


def _analysis_step(mem, shape, dense_shape, prof, terms, count_s, zero_rows,
                   dead_cols, m):
    """One automatic call's analysis and decision as SplitCall runs it:
    returns (key of the path run, decided side, retimed, mode)."""
    mode, before = mem.choose_analysis_and_backoff(dense_shape, terms,
                                                   count_s)
    # The sample's estimate: the call's own profile and live columns.
    if mode == "sample" and K.sample_says_dense(shape, prof, terms):
        mem.note_all_dense_without_count(sampled=True)
        return _key(m, 0, False), 0, False, "sampled"
    if mode == "skip":
        mem.note_all_dense_without_count(sampled=False)
        return _key(m, 0, False), 0, False, "skip"
    backoff_full = mode == "sample" or before > 0
    policy = {"analysis_s": count_s * shape["m"] * shape["k"]}
    r = mem.decide_and_retime(shape, prof, terms, policy)
    key = _plan_key(r["plan"], prof, m, shape)
    cont = before if backoff_full and key[1] == 0 and not key[2] else -1
    mem.record_analysis(True, zero_rows, dead_cols, continue_backoff_from=cont)
    side = 0 if r["decided"]["kind"] == "all_dense" else 1
    return key, side, r["retimed"], "full"


def _replay_with_analysis(fam, count_s, repeat=4):
    """_replay with the analysis the ops run (full_stats false)."""
    calls, rec, model, d0, shape = _replay_setup(fam)
    m, k, k_live, n = d0["m"], d0["k"], d0["k_live"], d0["n"]
    dense_shape = K.matmul_split_shape(m, k, k, n)
    prof = _profile_of(d0)
    zero_rows, dead_cols = prof[0][0] / m, (k - k_live) / k
    mems = {}
    out = []
    for _ in range(repeat):
        for c in calls:
            mem = mems.setdefault(c["op"], K.SplitPlanMemory())
            if c is calls[0] and not out:
                # The calibrating call counted everything.
                mem.record_analysis(True, zero_rows, dead_cols)
            key, side, retimed, mode = _analysis_step(
                mem, shape, dense_shape, prof, model.terms(), count_s,
                zero_rows, dead_cols, m)
            seconds = _record_path(rec, mem, model, c["op"], key, shape, m, k,
                                   k_live)
            out.append((c["op"], key, side, retimed, seconds, mode))
    return rec, out


def _analysis_cases():
    for case in _cases():
        r, name = case.values
        marks = case.marks
        if (r, name) in (("forced_1", "2048x2048"), ("forced_2", "784x2048")):
            # The calls a sample keeps all-dense decide nothing, so a change
            # of side gets fewer decisions to be confirmed on, and the sparse
            # estimate rests on fewer observations: forced_1's hidden layer
            # leaves the dense plan only in the last quarter (0.48 of the
            # late calls on the faster path); forced_2's input layer, whose
            # sparse re-times draw the recording's first (burst) sparse
            # calls, stays all-dense (0.75 against 1.00 ms recorded).
            marks = (pytest.mark.xfail(strict=True, reason=(
                "sampled all-dense calls decide nothing: fewer decisions to "
                "confirm a change of side on")),)
        yield pytest.param(r, name, marks=marks, id=f"{r}-{name}")


@pytest.mark.parametrize("count_s", COUNT_S_PER_ELEM)
@pytest.mark.parametrize("recording,name", list(_analysis_cases()))
def test_replay_with_the_ops_analysis_converges(recording, name, count_s):
    """The same convergence with the count back-off of the runtime (calls
    that decide nothing count in the re-time schedule; the call a re-time
    falls due on counts fully; a full count the back-off led to that stays
    all-dense continues it), where the recorded timings allow it."""
    fam = _families(recording)[name]
    rec, out = _replay_with_analysis(fam, count_s)
    medians, good = _good_paths(rec)
    late = out[len(out) // 2:]
    on_good = sum(o[1] in good for o in late) / len(late)
    assert on_good >= 0.8, (medians, on_good)


def _dense_near_families():
    """(recording, layer) whose calibration terms decide all-dense on the
    recorded profile with the all-sparse plan within the re-time range and
    a sample that asks for the full count."""
    out = []
    for r in RECORDINGS:
        for name, fam in _families(r).items():
            d0 = _decides(fam)[0]
            shape = K.matmul_split_shape(d0["m"], d0["k"], d0["k_live"],
                                         d0["n"])
            terms = fam["calibrations"][0]["terms"]
            prof = _profile_of(d0)
            plan = K.decide_split(shape, prof, terms)
            if plan["kind"] != "all_dense":
                continue
            other = K.other_side_plan(shape, prof, terms, plan)
            if other is None or other["predicted_s"] > 3 * plan["predicted_s"]:
                continue
            if K.sample_says_dense(shape, prof, terms):
                continue
            out.append((r, name))
    return out


def _matmul_retime_calls(fam, backoff, count_s, calls=120):
    """The calls on which a replayed all-dense matmul re-times its sparse
    path, on the family's calibration terms (constant: nothing recorded).
    backoff: the ops' analysis (_analysis_step); else every call counts
    fully and decides."""
    d0 = _decides(fam)[0]
    m, k, k_live, n = d0["m"], d0["k"], d0["k_live"], d0["n"]
    shape = K.matmul_split_shape(m, k, k_live, n)
    dense_shape = K.matmul_split_shape(m, k, k, n)
    terms = fam["calibrations"][0]["terms"]
    prof = _profile_of(d0)
    zero_rows, dead_cols = prof[0][0] / m, (k - k_live) / k
    mem = K.SplitPlanMemory()
    mem.record_analysis(True, zero_rows, dead_cols)
    out, modes = [], []
    for i in range(calls):
        if backoff:
            _, side, retimed, mode = _analysis_step(
                mem, shape, dense_shape, prof, terms, count_s, zero_rows,
                dead_cols, m)
        else:
            policy = {"analysis_s": count_s * m * k}
            r = mem.decide_and_retime(shape, prof, terms, policy)
            side = 0 if r["decided"]["kind"] == "all_dense" else 1
            retimed, mode = r["retimed"], "full"
        assert side == 0
        modes.append(mode)
        if retimed:
            out.append(i)
    return out, modes


@pytest.mark.parametrize("count_s", COUNT_S_PER_ELEM)
def test_matmul_backoff_keeps_the_retime_schedule_in_calls(count_s):
    """An all-dense matmul near the break-even (its samples ask for the
    full count) backs off its full counts as the convolutions do, and its
    sparse path is still re-timed on the calls of the every-call schedule
    (4, 8, 16, 32 calls apart), not on every decision's."""
    cases = _dense_near_families()
    assert cases
    for r, name in cases:
        fam = _families(r)[name]
        every, _ = _matmul_retime_calls(fam, backoff=False, count_s=count_s)
        backed, modes = _matmul_retime_calls(fam, backoff=True,
                                             count_s=count_s)
        assert len(every) >= 4, (r, name, every)
        assert backed == every, (r, name, backed, every)
        # The back-off: most calls count a sample or nothing.
        assert modes.count("full") <= len(modes) // 4, (r, name, modes)
