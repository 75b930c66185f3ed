"""The tuner decides with the ops' own cost model: the terms travel in the
statistics tail (cc/core/stats.h kStatKLive .. kStatCalibrated), the tuner
reads them back and applies the ops' DecideSplit; automatic layers stay
automatic; tuning/ imports no layer module. Decisions are checked on
recorded statistics vectors (nothing timed)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sparse_split as tfss
from tf_sparse_split._loader import kernels
from tf_sparse_split.callbacks import SplitThresholdCallback
from tf_sparse_split.layers import SparseSplitDense
from tf_sparse_split.tuning import op_model
from tf_sparse_split.tuning import stats as S
from tf_sparse_split.tuning.tuner import (ThresholdTuner, find_split_layers,
                                          is_split_layer)

pytestmark = pytest.mark.usefixtures("op_library")

REPO = Path(__file__).resolve().parents[1]

# Terms of one recorded family (seconds, flop/s): a 100 GFLOP/s GEMM with
# 20 us per call, a 20 GFLOP/s SpMM with 30 us per call and 0.2 ns per value
# converted.
TERMS = {"dense_fixed_s": 2e-5, "dense_rate": 1e11, "sparse_fixed_s": 3e-5,
         "convert_s_per_elem": 2e-10, "sparse_rate": 2e10,
         "copy_s_per_elem": 5e-10, "heterogeneous": False}


def _recorded(m=256, k=1024, n=512, density=0.01, terms=TERMS,
              calibrated=True, hetero=S.HETERO_OFF, threshold=0.0):
    """One call's statistics vector as the op writes it: every row at
    `density`, the matmul's shape, and the family's terms."""
    v = np.zeros(S.NUM_STATS)
    nnz = m * k * density
    v[S.M], v[S.K], v[S.N] = m, k, n
    v[S.NNZ] = nnz
    v[S.HISTOGRAM.start + int(density * S.DENSITY_BINS)] = m
    v[S.ROWS_DENSE] = m
    v[S.TIME_DENSE] = 2.0 * m * k * n / terms["dense_rate"]
    v[S.THRESHOLD] = threshold
    v[S.HETEROGENEOUS] = hetero
    shape = kernels().matmul_split_shape(m, k, k, n)
    v[S.K_LIVE] = k
    v[S.DENSE_FLOPS_PER_ELEM] = shape["dense_flops_per_elem"]
    v[S.SPARSE_FLOPS_PER_NNZ] = shape["sparse_flops_per_nnz"]
    v[S.ROW_COPY_ELEMS] = shape["row_copy_elems"]
    v[S.WEIGHT_ELEMS_PER_COL] = shape["weight_elems_per_col"]
    v[S.CAN_COMPACT] = float(shape["can_compact"])
    v[S.DENSE_ALLOWED] = float(shape["dense_allowed"])
    v[S.TERM_DENSE_FIXED] = terms["dense_fixed_s"]
    v[S.TERM_DENSE_RATE] = terms["dense_rate"]
    v[S.TERM_SPARSE_FIXED] = terms["sparse_fixed_s"]
    v[S.TERM_CONVERT] = terms["convert_s_per_elem"]
    v[S.TERM_SPARSE_RATE] = terms["sparse_rate"]
    v[S.TERM_COPY] = terms["copy_s_per_elem"]
    v[S.CALIBRATED] = float(calibrated)
    return v


# -- the statistics tail ------------------------------------------------------

def test_cost_problem_reads_back_the_shape_and_terms():
    v = _recorded()
    p = op_model.cost_problem(v)
    assert p.calibrated
    assert p.shape == kernels().matmul_split_shape(256, 1024, 1024, 512)
    # compact_scale and the row-copy term are not in the statistics vector:
    # read back as 1 and 0 (unknown: the copy term prices row copies).
    assert p.terms == dict(TERMS, compact_scale=1.0, row_copy_s_per_elem=0.0)
    assert p.known(op_model.DENSE) and p.known(op_model.SPARSE)
    # Unknown rates (0), and garbage, read as unknown, never negative.
    v[S.TERM_SPARSE_RATE] = 0.0
    v[S.TERM_DENSE_FIXED] = -1.0
    v[S.TERM_CONVERT] = np.nan
    p = op_model.cost_problem(v)
    assert not p.known(op_model.SPARSE)
    assert p.terms["dense_fixed_s"] == 0.0 and p.terms["convert_s_per_elem"] == 0.0
    # The heterogeneous flag is the split that ran, not the one requested.
    assert op_model.cost_problem(_recorded(hetero=S.HETERO_RAN)).terms[
        "heterogeneous"]
    assert not op_model.cost_problem(
        _recorded(hetero=S.HETERO_CPU_FALLBACK)).terms["heterogeneous"]
    with pytest.raises(ValueError, match=str(S.NUM_STATS)):
        op_model.cost_problem(np.zeros(S.NUM_STATS - 1))


def test_epoch_vector_takes_the_last_calls_terms():
    first = _recorded(terms=dict(TERMS, sparse_rate=1e9))
    last = _recorded()
    v = op_model.epoch_vector(last, first + last, 2)
    assert v[S.TERM_SPARSE_RATE] == TERMS["sparse_rate"]  # not the mean
    assert v[S.M] == 256 and v[S.NNZ] == pytest.approx(last[S.NNZ])
    with pytest.raises(ValueError):
        op_model.epoch_vector(last, last, 0)


def test_the_op_writes_its_family_terms_into_the_statistics():
    rng = np.random.default_rng(0)
    # Shapes no other test uses: fresh families in this process.
    a = rng.standard_normal((96, 232)).astype(np.float32)
    a[rng.random(a.shape) < 0.9] = 0.0
    a[:, :8] = 0.0                                   # 8 dead columns
    b = rng.standard_normal((232, 40)).astype(np.float32)
    _, st = tfss.sparse_split_matmul(a, b, threshold=-1.0, return_stats=True)
    d = S.as_dict(st.numpy())
    assert d["calibrated"] == 1.0                     # automatic: calibrated
    assert d["term_dense_rate"] > 0 and d["term_sparse_rate"] > 0
    assert d["k_live"] == 232 - 8
    shape = kernels().matmul_split_shape(96, 232, 232 - 8, 40)
    assert d["dense_flops_per_elem"] == shape["dense_flops_per_elem"]
    assert d["sparse_flops_per_nnz"] == shape["sparse_flops_per_nnz"]
    assert d["weight_elems_per_col"] == shape["weight_elems_per_col"]

    # A family that never runs automatically is never calibrated: each
    # path's rate is learnt from the first call that runs it.
    a2 = rng.standard_normal((88, 216)).astype(np.float32)
    a2[rng.random(a2.shape) < 0.9] = 0.0
    b2 = rng.standard_normal((216, 24)).astype(np.float32)
    _, st = tfss.sparse_split_matmul(a2, b2, threshold=1.0, return_stats=True)
    d = S.as_dict(st.numpy())
    assert d["calibrated"] == 0.0
    assert d["term_sparse_rate"] > 0 and d["term_dense_rate"] == 0.0
    _, st = tfss.sparse_split_matmul(a2, b2, threshold=0.0, return_stats=True)
    d = S.as_dict(st.numpy())
    assert d["term_sparse_rate"] > 0 and d["term_dense_rate"] > 0


# -- the decision -------------------------------------------------------------

def test_decide_is_the_ops_decision_on_the_recorded_terms():
    v = _recorded()
    plan = op_model.decide(v)
    k = kernels()
    shape = op_model.cost_problem(v).shape
    hist = v[S.HISTOGRAM]
    want = k.decide_split(shape, k.profile_from_histogram(hist, 1024, v[S.NNZ]),
                          TERMS, None, None)
    assert plan == dict(want)
    # 1% density, a SpMM a fifth of the GEMM's rate: every row goes sparse.
    assert plan["kind"] == "all_sparse" and plan["threshold"] == 1 / 16
    # The same rows with a 1000x slower SpMM: all-dense.
    slow = _recorded(terms=dict(TERMS, sparse_rate=2e7))
    assert op_model.decide(slow)["kind"] == "all_dense"
    # Unknown sparse rate: nothing to decide (the op would stay dense).
    assert op_model.decide(_recorded(terms=dict(TERMS, sparse_rate=0.0))) is None


def test_heterogeneous_split_balances_the_two_devices():
    # Rows at 30% density, a SpMM about as fast per row as the GEMM: summed
    # parts favour one path, overlapping ones (max) a split.
    terms = dict(TERMS, sparse_rate=3e10, convert_s_per_elem=0.0)
    hist = np.zeros(S.DENSITY_BINS)
    hist[2], hist[12] = 128, 128                    # two row populations
    seq, het = (_recorded(terms=terms, hetero=h)
                for h in (S.HETERO_OFF, S.HETERO_RAN))
    for v in (seq, het):
        v[S.HISTOGRAM] = hist
        v[S.NNZ] = 128 * 1024 * (2.5 / 16) + 128 * 1024 * (12.5 / 16)
    p_seq, p_het = op_model.decide(seq), op_model.decide(het)
    assert p_het["predicted_s"] < p_seq["predicted_s"]
    assert p_het["kind"] == "split"


class _FakeLayer:
    """The tuner's protocol and nothing else: no Keras, no op."""

    def __init__(self, name, threshold):
        self.name = name
        self._threshold = float(threshold)
        self.writes = []
        with tf.init_scope():
            zeros = tf.zeros([S.NUM_STATS], tf.float64)
            self.vars = type("V", (), {})()
            self.vars.latest = tf.Variable(zeros)
            self.vars.total = tf.Variable(zeros)
            self.vars.calls = tf.Variable(tf.constant(0, tf.int64))

    @property
    def threshold(self):
        return self._threshold

    def set_threshold(self, value):
        self.writes.append(float(value))
        self._threshold = float(value)

    def statistics_variables(self):
        return self.vars

    def reset_stats(self):
        self.vars.total.assign(tf.zeros([S.NUM_STATS], tf.float64))
        self.vars.calls.assign(0)

    def record(self, v):
        """What a layer call records."""
        self.vars.latest.assign(v)
        self.vars.total.assign_add(v)
        self.vars.calls.assign_add(1)


def _epoch(tuner, layers, vectors, epoch=0):
    tuner.begin_epoch(epoch, steps=len(vectors))
    for b, v in enumerate(vectors):
        tuner.before_batch(b)
        for layer in layers:
            layer.record(v)
    return tuner.end_epoch(epoch)


def test_tuner_uses_the_op_terms_and_keeps_automatic_layers_automatic():
    auto, fixed = _FakeLayer("auto", -1.0), _FakeLayer("fixed", 0.0)
    assert is_split_layer(auto) and find_split_layers([auto, fixed]) == [
        auto, fixed]
    tuner = ThresholdTuner([auto, fixed], explore_batches=0,
                           samples_per_epoch=0)
    tuner.begin_training()
    rec = _epoch(tuner, [auto, fixed], [_recorded(), _recorded()])
    want = op_model.decide(_recorded())["threshold"]
    e_auto, e_fixed = rec["layers"]["auto"], rec["layers"]["fixed"]
    # The automatic layer: reported, never written.
    assert e_auto["mode"] == "auto" and auto.writes == [] and auto.threshold == -1
    assert e_auto["threshold"] == e_auto["predicted_threshold"] == want
    # The fixed layer: tuned to the op model's pick.
    assert e_fixed["mode"] == "tuned" and fixed.writes == [want]
    assert e_fixed["threshold"] == want
    # Rates reported are the op's terms, not a fit of the tuner's.
    assert e_fixed["dense_rate"] == TERMS["dense_rate"]
    assert e_fixed["sparse_overhead"] == TERMS["sparse_fixed_s"]
    assert e_fixed["terms"] == dict(TERMS, compact_scale=1.0,
                                    row_copy_s_per_elem=0.0)
    assert e_fixed["calibrated"]
    assert e_fixed["threshold_used"] == 0.0

    # The op's terms change (a much slower SpMM measured): the decision
    # follows them, with the ops' hysteresis.
    slow = _recorded(terms=dict(TERMS, sparse_rate=2e7))
    rec = _epoch(tuner, [auto, fixed], [slow, slow], epoch=1)
    assert rec["layers"]["fixed"]["threshold"] == 0.0 and fixed.writes[-1] == 0.0
    assert rec["layers"]["auto"]["predicted_threshold"] == 0.0
    assert auto.writes == []


def test_untrusted_terms_keep_a_tuned_threshold():
    # A family never calibrated, whose sparse path no sampled call ran: the
    # tuned layer keeps its threshold until min_samples samples ran it.
    layer = _FakeLayer("fixed", 0.25)
    tuner = ThresholdTuner([layer], explore_batches=0, samples_per_epoch=2,
                           min_samples=2, warmup_samples=0)
    tuner.begin_training()
    dense_only = _recorded(calibrated=False)
    rec = _epoch(tuner, [layer], [dense_only, dense_only])
    assert rec["layers"]["fixed"]["predicted_threshold"] is None
    # (A tuned layer is written every epoch: the chief's value on every
    # replica; here the one it had.)
    assert rec["layers"]["fixed"]["threshold"] == 0.25
    assert set(layer.writes) <= {0.25} and layer.threshold == 0.25
    ran_sparse = _recorded(calibrated=False)
    ran_sparse[S.ROWS_SPARSE], ran_sparse[S.NNZ_SPARSE] = 10, 100
    ran_sparse[S.TIME_SPARSE] = 1e-4
    rec = _epoch(tuner, [layer], [ran_sparse, ran_sparse], epoch=1)
    assert rec["layers"]["fixed"]["predicted_threshold"] is not None
    assert layer.writes[-1] == rec["layers"]["fixed"]["threshold"]


@pytest.mark.parametrize("policy", ["fixed", "report"])
def test_policies(policy):
    auto, fixed = _FakeLayer("auto", -1.0), _FakeLayer("fixed", 0.5)
    tuner = ThresholdTuner([auto, fixed], explore_batches=0,
                           samples_per_epoch=0, policy=policy)
    tuner.begin_training()
    rec = _epoch(tuner, [auto, fixed], [_recorded()])
    want = op_model.decide(_recorded())["threshold"]
    if policy == "fixed":   # every layer tuned, automatic ones on purpose
        assert auto.writes == [want] and fixed.writes == [want]
        assert {e["mode"] for e in rec["layers"].values()} == {"tuned"}
    else:                   # nothing written, the picks reported
        assert auto.writes == fixed.writes == []
        assert rec["layers"]["fixed"]["mode"] == "kept"
        assert rec["layers"]["fixed"]["threshold"] == 0.5
        assert rec["layers"]["fixed"]["predicted_threshold"] == want
    with pytest.raises(ValueError, match="policy"):
        ThresholdTuner([auto], policy="always")
    with pytest.raises(ValueError, match="policy"):
        SplitThresholdCallback(policy=None)


def test_callback_leaves_automatic_mode_on():
    keras.utils.set_random_seed(5)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((192, 48)).astype(np.float32)
    x[rng.random(x.shape) < 0.8] = 0.0
    y = rng.integers(0, 4, 192)
    model = keras.Sequential([
        keras.Input((48,)),
        SparseSplitDense(24, activation="relu", name="auto_layer"),
        SparseSplitDense(4, activation="softmax", threshold=0.3,
                         name="fixed_layer")])
    model.compile("sgd", "sparse_categorical_crossentropy", jit_compile=False)
    cb = SplitThresholdCallback(explore_batches=2, min_samples=1,
                                warmup_samples=0)
    hist = model.fit(x, y, epochs=2, batch_size=32, callbacks=[cb], verbose=0)
    auto = model.get_layer("auto_layer")
    assert float(auto.threshold_var.numpy()) == -1.0     # still automatic
    assert auto.latest_stats()["calibrated"] == 1.0     # the op decided
    for rec in cb.history:
        e = rec["layers"]["auto_layer"]
        assert e["mode"] == "auto" and e["threshold"] >= 0.0
        assert rec["layers"]["fixed_layer"]["mode"] == "tuned"
    assert hist.history["auto_layer/threshold"][-1] == pytest.approx(
        cb.history[-1]["layers"]["auto_layer"]["threshold"])
    assert hist.history["fixed_layer/threshold"][-1] == pytest.approx(
        model.get_layer("fixed_layer").threshold)
    # What ran: the fraction of the epoch's rows sent to the sparse kernel.
    for epoch, rec in enumerate(cb.history):
        e = rec["layers"]["auto_layer"]
        assert hist.history["auto_layer/rows_sparse"][epoch] == \
            pytest.approx(e["rows_sparse"] / (e["rows_dense"] +
                                              e["rows_sparse"]))


# -- dependencies ---------------------------------------------------------------

_IMPORT_PROBE = textwrap.dedent("""
    import sys
    import tf_sparse_split.tuning
    import tf_sparse_split.tuning.op_model
    import tf_sparse_split.tuning.cost_model
    import tf_sparse_split.tuning.pattern_search
    assert "tensorflow" not in sys.modules, "tuning imported tensorflow"
    # The tuner needs TensorFlow, not Keras or the layers. Importing
    # TensorFlow is followed by the package's own registration, which
    # imports the layers only once Keras is imported too; block Keras so
    # that any layer import comes from tuning/ itself.
    sys.modules["keras"] = None
    import tf_sparse_split.tuning.tuner
    from tf_sparse_split.tuning import ThresholdTuner
    bad = sorted(m for m in sys.modules
                 if m.startswith("tf_sparse_split.layers") and
                 sys.modules[m] is not None)
    print("LAYERS", bad)
""")


def test_tuning_imports_no_layer_module():
    proc = subprocess.run([sys.executable, "-c", _IMPORT_PROBE],
                          capture_output=True, text=True, timeout=120,
                          cwd=str(REPO),
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
                                   CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LAYERS []" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    # And no source file of tuning/ imports a layer module.
    import ast

    for path in (REPO / "tf_sparse_split" / "tuning").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [
                    f"{node.module}.{a.name}" for a in node.names]
            assert not any(n.startswith("tf_sparse_split.layers")
                           for n in names), (path, names)
