"""The convolution ops' cheap analysis (``full_stats=False``: a strided
sample of every image's pixels, or no count at all, on calls the cost model
keeps all-dense, then TF's (fused) kernel on the op's inputs; and a sample
that the forward's all-sparse calls decide on when their sparse kernel, the
direct one, needs no counts).

The decision tests run the ops' cost model (cc/core/cost_model.h,
ChooseAnalysis and its helpers) through the pybind11 module on the
calibration timings recorded for the CLI CNN's two conv layers
(tests/data/conv_family_timings.json, see tests/test_conv2d_family.py):
nothing there is timed. The op tests check that the answer never depends
on how much a call counted and that the statistics say what was counted.
"""

import json
import pathlib

import numpy as np
import pytest
import tensorflow as tf
from _helpers import kernels_or_skip

import tf_sparse_split as tfss
from tf_sparse_split._loader import load_library
from tf_sparse_split.testing import (random_sparse_images, reference_conv2d,
                                     reference_conv2d_bias_act,
                                     reference_conv2d_filter_grad,
                                     relative_error)
from tf_sparse_split.tuning import stats as S

K = kernels_or_skip()
DATA_DIR = pathlib.Path(__file__).resolve().parent / "data"
RECORDED = json.loads((DATA_DIR / "conv_family_timings.json").read_text())

ALL_DENSE = dict(kind="all_dense", bucket=-1, threshold=0.0, compact=False)
#: Seconds per counted value of the full count (CountConvNonzeros) on the
#: development machine: 0.12 ms for the 802816 values of 32x28x28x32.
COUNT_S = 0.12e-3 / (32 * 28 * 28 * 32)


def _record(layer, n):
    (r,) = [r for r in RECORDED["layers"] if r["layer"] == layer and r["n"] == n]
    return r


def _shape(r, c_live=None):
    return K.conv_split_shape(r["n"], r["h"], r["w"], r["c_in"],
                              r["c_in"] if c_live is None else c_live,
                              r["kh"], r["kw"], r["c_out"], r["out_h"],
                              r["out_w"])


def _terms(r):
    return K.fit_calibration(_shape(r), r["calibration"])


def _history(**kw):
    h = dict(seen_full=True, calls_since_full=1, zero_row_frac=0.0,
             dead_col_frac=0.0)
    h.update(kw)
    return h


def _dense_seconds(r, terms):
    k = r["h"] * r["w"] * r["c_in"]
    return K.predict_plan_seconds(_shape(r), K.profile_from_row_nnz(
        np.full(r["n"], k, np.int64), k), terms, -1)


# -- the decision, on recorded timings -----------------------------------------

def test_recorded_dense_layer_samples_after_a_full_count():
    """conv_2 at batch 32 (32x28x28x32 -> 64, 4.4 ms dense, recorded 1.9x
    faster than the sparse path): the first call counts fully; once a full
    count saw the layer all-dense, the next calls sample -- the saving bound
    (rows that could go sparse) is well above the minimum gain, so not
    skipped; a caller that wants exact statistics always counts fully."""
    r = _record("conv_2", 32)
    terms = _terms(r)
    shape = _shape(r)
    assert K.max_saving_seconds(shape, terms) > 1e-4
    first = dict(seen_full=False, calls_since_full=0, zero_row_frac=0.0,
                 dead_col_frac=0.0)
    assert K.choose_analysis(shape, terms, first, None, COUNT_S) == "full"
    assert K.choose_analysis(shape, terms, _history(), ALL_DENSE,
                             COUNT_S) == "sample"
    assert K.choose_analysis(shape, terms, _history(), ALL_DENSE, COUNT_S,
                             full_stats=True) == "full"
    # After a plan with sparse images the next call counts fully.
    split = dict(kind="split", bucket=10, threshold=10 / 32, compact=False)
    assert K.choose_analysis(shape, terms, _history(), split,
                             COUNT_S) == "full"


def test_recorded_dense_layer_full_count_period():
    """The periodic full count keeps the amortised count within 1% of the
    dense call: 0.12 ms per count against a 4.4 ms call is a period of at
    least 3 calls, and the policy's minimum of 16 holds."""
    r = _record("conv_2", 32)
    dense_s = _dense_seconds(r, _terms(r))
    period = K.full_count_period(COUNT_S * 32 * 28 * 28 * 32, dense_s)
    defaults = K.analysis_policy_defaults()
    assert defaults["min_period"] <= period <= defaults["max_period"]
    shape, terms = _shape(r), _terms(r)
    due = _history(calls_since_full=period)
    assert K.choose_analysis(shape, terms, due, ALL_DENSE, COUNT_S) == "full"


def test_pixel_sample_stride_and_estimate():
    """The sample of a convolution strides over the N*H*W pixels (rows of
    C_in values): at the sample budget (0.5% of the dense call) a strided
    sample of conv_2's batch counts a few percent of the pixels; the
    estimated profile of a 50%-dense batch says all-dense (the recorded
    dense path is 1.9x faster there), a 5%-dense batch goes to the full
    count."""
    r = _record("conv_2", 32)
    terms, shape = _terms(r), _shape(r)
    dense_s = _dense_seconds(r, terms)
    pixels = r["n"] * r["h"] * r["w"]
    stride = K.sample_stride(pixels, r["c_in"], dense_s, COUNT_S)
    assert 2 <= stride <= r["h"] * r["w"] // 4
    counted = -(-r["h"] * r["w"] // stride) * r["c_in"]
    k = r["h"] * r["w"] * r["c_in"]
    for density, dense in ((0.5, True), (0.05, False)):
        row_nnz = np.full(r["n"], int(density * counted), np.int64)
        est = K.estimate_profile(row_nnz, counted, r["n"], k)
        assert K.sample_says_dense(shape, est, terms) is dense, density


#: The calibration of 32x56x56x64 -> 64 (3x3 SAME) at 50% ReLU-like zeros,
#: logged (TF_CPP_VMODULE=split_runtime=2) by the forward op on the quiet
#: 2-core Xeon; its full count took 1.9-2.0 ms of a 22-23 ms call.
MAIN_CONV_50 = dict(
    conv=(32, 56, 56, 64, 64),
    calibration=dict(rows_full=6, rows_part=1, nnz_full=602769,
                     nnz_thin=75348, nnz_part=100367,
                     dense_full_s=4.48407e-3, dense_part_s=0.820463e-3,
                     sparse_full_s=3.98644e-3, sparse_thin_s=1.4387e-3,
                     sparse_part_s=0.682043e-3, copy_elems=602112,
                     copy_s=0.254817e-3, row_copy_elems=602112,
                     row_copy_s=0.196666e-3),
    count_s=2.0e-3)


def _main_conv_50():
    """(shape, calibration terms) of MAIN_CONV_50 (3x3 SAME, all channels
    live)."""
    n, h, w, ci, co = MAIN_CONV_50["conv"]
    shape = K.conv_split_shape(n, h, w, ci, ci, 3, 3, co, h, w)
    return shape, K.fit_calibration(shape, MAIN_CONV_50["calibration"])


def test_vetoed_samples_back_off_to_every_fourth_call():
    """Near the break-even a sample asks for the full count, and the
    agreement rule vetoes every plan with sparse images on the sample's
    estimate (the full count charged: the predicted 1.11x of the all-sparse
    plan is under the 1.10x margin once it pays it), so the op runs TF's
    kernel without counting further. Such a sample counts as one that said
    all-dense with the back-off capped at 2^near_break_even_sample_run
    calls (SplitCall::AcceptVetoedSample): the op samples 2, then 4 calls
    apart (the periodic full counts continue it) and counts nothing
    between. Counted as a skip, it sampled on
    every call (0.4-0.6 ms of each 22-23 ms call: the automatic op at 0.97x
    of TF's kernel); backed off as far as a clear sample (16 calls), a jump
    to 70% zeros went unseen for the 12-20 calls of a benchmark row."""
    rec = MAIN_CONV_50
    n, h, w, ci, _ = rec["conv"]
    shape, terms = _main_conv_50()
    k = h * w * ci
    count_per_value = rec["count_s"] / (n * k)
    buckets = len(K.profile_from_row_nnz(np.full(n, k, np.int64), k)[0]) - 1
    # The sample (every 17th pixel: 185 of each image's 3136) at 50% zeros.
    counted = -(-h * w // 17) * ci
    est = K.estimate_profile(np.full(n, counted // 2, np.int64), counted, n,
                             k, buckets)
    assert not K.sample_says_dense(shape, est, terms)
    # The veto of the kernel (AnySplitAgreed with the full count charged)...
    assert not any(K.conv_split_agreed(shape, est, terms, terms, j, False,
                                       rec["count_s"])
                   for j in range(buckets + 1))
    # ... where the parts alone would pass the margin.
    assert K.conv_split_agreed(shape, est, terms, terms, buckets, False, 0.0)

    def replay(note):
        """The op's memory over 64 calls, driven as the forward op drives
        it; note(mem, mode) records a call that did not count fully."""
        mem = K.SplitPlanMemory()
        modes = []
        for _ in range(64):
            mode, before = mem.choose_analysis_and_backoff(shape, terms,
                                                           count_per_value)
            modes.append(mode)
            if mode == "full":  # decided all-dense on the full count
                cont = before if before > 0 else -1
                mem.remember_all_dense(cont)
                mem.record_analysis(True, 0.0, 0.0, cont)
            else:  # a vetoed sample, or nothing counted
                note(mem, mode)
        return modes

    assert K.near_break_even_sample_run == 2
    modes = replay(lambda mem, mode: mem.note_all_dense_without_count(
        sampled=mode == "sample", near_break_even=True))
    assert modes[0] == "full"
    counted_at = [i for i, m in enumerate(modes) if m != "skip"]
    assert max(np.diff(counted_at)) <= 4, modes
    assert 10 <= modes.count("sample") <= 20, modes
    # As a skip: a sample on every call.
    skipped = replay(lambda mem, mode: mem.note_all_dense_without_count(
        sampled=False))
    assert "skip" not in skipped
    # As a clear sample: a sample every 16 calls.
    clear = replay(lambda mem, mode: mem.note_all_dense_without_count(
        sampled=mode == "sample"))
    assert clear.count("sample") <= 6


def test_full_count_of_a_held_change_resets_the_backoff():
    """A full count amid the sample back-off that stays all-dense continues
    the back-off -- unless its decision wanted the all-sparse plan and was
    held (kConvHoldRuns) or confirming: then the back-off resets and the
    next call samples again, so the decisions that complete the change come
    on the next calls. Continued, the same op moved from 50% to 70% zeros
    made one such decision a back-off period apart and stayed all-dense
    for the 20 calls measured (1.00x where all-sparse ran 1.6x)."""
    rec = MAIN_CONV_50
    n, h, w, ci, _ = rec["conv"]
    shape, terms = _main_conv_50()
    k = h * w * ci
    policy = {"analysis_s": rec["count_s"]}
    at = {z: K.profile_from_row_nnz(np.full(n, int((1 - z) * k), np.int64), k)
          for z in (0.5, 0.7)}

    def memory_backed_off():
        mem = K.SplitPlanMemory()
        r = mem.decide_and_retime(shape, at[0.5], terms, policy,
                                  K.conv_retime_policy())
        assert r["plan"]["kind"] == "all_dense"
        mem.record_analysis(True)
        mem.note_all_dense_without_count(sampled=True)  # said all-dense
        assert mem.history()["samples_dense"] == 1
        return mem

    # At 50% the decision stays all-dense (no re-time due yet): the
    # back-off goes on.
    mem = memory_backed_off()
    r = mem.decide_and_retime(shape, at[0.5], terms, policy,
                              K.conv_retime_policy())
    assert r["plan"]["kind"] == "all_dense" and not r["retimed"]
    mem.record_analysis(True, 0.0, 0.0, 1)
    assert mem.history()["samples_dense"] == 2
    assert not mem.change_pending()
    # At 70% it wants all-sparse, held on the dense plan: reset.
    mem = memory_backed_off()
    r = mem.decide_and_retime(shape, at[0.7], terms, policy,
                              K.conv_retime_policy())
    assert r["plan"]["kind"] == "all_dense" and not r["retimed"]
    assert r["decided"]["kind"] == "all_dense"
    mem.record_analysis(True, 0.0, 0.0, 1)
    assert mem.history()["samples_dense"] == 0
    # The change is pending: a sample's full count is not rationed
    # (sample_may_count_fully).
    assert mem.change_pending()
    # The next decisions at 70% complete the change within a few calls.
    kinds = []
    for _ in range(8):
        r = mem.decide_and_retime(shape, at[0.7], terms, policy,
                                  K.conv_retime_policy())
        kinds.append(r["decided"]["kind"])
        mem.record_analysis(True, 0.0, 0.0, -1)
    assert kinds[-1] == "all_sparse", kinds


def test_all_sparse_plan_decides_on_a_sample_between_full_counts():
    """An op whose sparse kernel reads no counts (the forward's direct
    kernel: AnalysisPolicy sample_all_sparse) decides its all-sparse plan
    on a sample of the pixels, with a full count every FullCountPeriod
    calls (weighed against the plan's predicted time); a split, a
    compaction, exact statistics or an op that needs the counts (the
    policy's default, the matmul ops' CSR) count everything."""
    r = _record("conv_2", 32)
    terms, shape = _terms(r), _shape(r)
    ap = dict(K.analysis_policy_defaults(), sample_all_sparse=True)
    assert K.analysis_policy_defaults()["sample_all_sparse"] is False
    sparse = dict(kind="all_sparse", bucket=32, threshold=1.0, compact=False,
                  predicted_s=2.5e-3)
    choose = lambda h, prev, **kw: K.choose_analysis(  # noqa: E731
        shape, terms, h, prev, COUNT_S, **kw)
    assert choose(_history(), sparse, analysis_policy=ap) == "sample_sparse"
    assert choose(_history(), sparse) == "full"
    assert choose(_history(), sparse, analysis_policy=ap,
                  full_stats=True) == "full"
    assert choose(_history(), dict(sparse, compact=True),
                  analysis_policy=ap) == "full"
    split = dict(kind="split", bucket=10, threshold=10 / 32, compact=False)
    assert choose(_history(), split, analysis_policy=ap) == "full"
    # The all-dense regime is unchanged by the policy.
    assert choose(_history(), ALL_DENSE, analysis_policy=ap) == "sample"
    # Nothing counted yet: the first call counts fully.
    first = _history(seen_full=False, calls_since_full=0)
    assert choose(first, sparse, analysis_policy=ap) == "full"
    period = K.full_count_period(COUNT_S * 32 * 28 * 28 * 32, 2.5e-3, ap)
    assert period >= 2
    assert choose(_history(calls_since_full=period - 2), sparse,
                  analysis_policy=ap) == "sample_sparse"
    assert choose(_history(calls_since_full=period - 1), sparse,
                  analysis_policy=ap) == "full"


def test_tiny_layer_skips_the_count():
    """A layer whose whole dense call is below the policy's minimum gain
    cannot gain from any plan: its calls count nothing."""
    shape = K.conv_split_shape(1, 4, 4, 2, 2, 1, 1, 3, 4, 4)
    r = _record("conv_1", 1)
    terms = _terms(r)
    assert K.max_saving_seconds(shape, terms) < 2e-5
    assert K.choose_analysis(shape, terms, _history(), ALL_DENSE,
                             COUNT_S) == "skip"


# -- the ops -------------------------------------------------------------------

def _check_stats(st, n, k, nnz):
    mode = st[S.ANALYSIS]
    assert mode in (S.ANALYSIS_FULL, S.ANALYSIS_SAMPLED, S.ANALYSIS_SKIPPED)
    assert st[S.ROWS_DENSE] + st[S.ROWS_SPARSE] == n
    if mode == S.ANALYSIS_FULL:
        assert st[S.NNZ] == nnz
        assert st[S.HISTOGRAM].sum() == n
        return mode
    # Without a full count nothing is compacted; a sample either said
    # all-dense or (the forward's all-sparse plan, decided on the sample's
    # estimate) sends images to the direct kernel.
    assert st[S.ZERO_COLS_SKIPPED] == 0
    if st[S.ROWS_SPARSE] == 0:
        assert st[S.NNZ_SPARSE] == 0 and st[S.THRESHOLD] == 0.0
    else:
        assert mode == S.ANALYSIS_SAMPLED
        assert 0 < st[S.NNZ_SPARSE] <= st[S.NNZ]
    if mode == S.ANALYSIS_SKIPPED:
        assert st[S.ROWS_DENSE] == n and st[S.ROWS_SPARSE] == 0
        assert np.isnan(st[S.NNZ]) and st[S.HISTOGRAM].sum() == 0
    else:
        assert st[S.HISTOGRAM].sum() == pytest.approx(n)
        assert 0 <= st[S.NNZ] <= n * k
    return mode


@pytest.mark.usefixtures("op_library")
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.97])
@pytest.mark.parametrize("fused", [False, True])
def test_forward_results_equal_reference_in_every_mode(sparsity, fused):
    """Repeated automatic calls with full_stats=False (calibration, then
    sampled or skipped analyses and the periodic full counts) equal the
    float64 reference on fresh inputs every call; with full_stats=True
    every call counts exactly."""
    rng = np.random.default_rng([int(sparsity * 100), fused])
    n, h, w, ci, co = 16, 14, 14, 16, 32
    f = rng.uniform(-0.5, 0.5, (3, 3, ci, co)).astype(np.float32)
    b = rng.uniform(-1, 1, co).astype(np.float32)
    kw = dict(bias=b, activation="relu") if fused else {}

    @tf.function
    def cheap(x):
        return tfss.sparse_split_conv2d(x, f, 1, "SAME", threshold=-1.0,
                                        return_stats=True, full_stats=False,
                                        **kw)

    @tf.function
    def full(x):
        return tfss.sparse_split_conv2d(x, f, 1, "SAME", threshold=-1.0,
                                        return_stats=True, **kw)

    modes = []
    for i in range(14):
        x = random_sparse_images((n, h, w, ci), sparsity, rng)
        x[0, 0, 0, 0] = 0.5
        ref = (reference_conv2d_bias_act(x, f, b, "relu", 1, "SAME") if fused
               else reference_conv2d(x, f, 1, "SAME"))
        got, st = (cheap if i % 3 else full)(x)
        assert relative_error(got, ref) <= 1e-5
        mode = _check_stats(st.numpy(), n, h * w * ci, np.count_nonzero(x))
        if i % 3:
            modes.append(mode)
        else:
            assert mode == S.ANALYSIS_FULL
    assert modes[0] in (S.ANALYSIS_FULL, S.ANALYSIS_SAMPLED,
                        S.ANALYSIS_SKIPPED)


@pytest.mark.usefixtures("op_library")
def test_dense_layer_stops_counting_everything():
    """A dense input on a layer the op keeps all-dense: after the first
    (calibrating) call the op samples or skips, marking its statistics."""
    rng = np.random.default_rng(3)
    f = rng.uniform(-0.5, 0.5, (3, 3, 32, 32)).astype(np.float32)
    x = random_sparse_images((16, 28, 28, 32), 0.0, rng)

    @tf.function
    def cheap(x):
        return tfss.sparse_split_conv2d(x, f, 1, "SAME", threshold=-1.0,
                                        return_stats=True, full_stats=False)

    modes = [cheap(x)[1].numpy()[S.ANALYSIS] for _ in range(6)]
    assert modes[0] == S.ANALYSIS_FULL
    assert set(modes[1:]) & {S.ANALYSIS_SAMPLED, S.ANALYSIS_SKIPPED}


@pytest.mark.usefixtures("op_library")
def test_tiny_conv_counts_nothing():
    """1x4x4x2 -> 3, 1x1: after the calibrating call nothing is counted
    (NNZ NaN) on some call, and the output is always TF's. The skip rests
    on the family's timed terms: a calibration slowed by another process
    can keep the first calls counting until the measured ratios (a window
    of 15) correct the terms, so the calls run well past that window."""
    rng = np.random.default_rng(9)
    f = rng.uniform(-1, 1, (1, 1, 2, 3)).astype(np.float32)

    @tf.function
    def cheap(x):
        return tfss.sparse_split_conv2d(x, f, 1, "VALID", threshold=-1.0,
                                        return_stats=True, full_stats=False)

    modes = []
    for _ in range(40):
        x = random_sparse_images((1, 4, 4, 2), 0.5, rng)
        x[0, 0, 0, 0] = 1.0
        got, st = cheap(x)
        assert relative_error(got, reference_conv2d(x, f)) <= 1e-5
        modes.append(_check_stats(st.numpy(), 1, 32, np.count_nonzero(x)))
    assert modes[0] == S.ANALYSIS_FULL
    assert S.ANALYSIS_SKIPPED in modes[1:]


@pytest.mark.usefixtures("op_library")
@pytest.mark.parametrize("sparsity", [0.0, 0.6])
def test_filter_grad_results_equal_reference_in_every_mode(sparsity):
    lib = load_library()
    rng = np.random.default_rng([17, int(sparsity * 10)])
    n, h, w, ci, co = 16, 14, 14, 16, 32
    fsize = [3, 3, ci, co]

    @tf.function
    def cheap(x, dy):
        return lib.tf_sparse_split_sparse_split_conv2d_backprop_filter(
            x, fsize, dy, -1.0, strides=[1, 1, 1, 1], padding="SAME",
            full_stats=False)

    for _ in range(8):
        x = random_sparse_images((n, h, w, ci), sparsity, rng)
        x[0, 0, 0, 0] = 0.5
        dy = rng.uniform(-1, 1, (n, h, w, co)).astype(np.float32)
        got, st = cheap(x, dy)
        ref = reference_conv2d_filter_grad(x, fsize, dy, 1, "SAME")
        assert relative_error(got, ref) <= 1e-5
        _check_stats(st.numpy(), n, h * w * ci, np.count_nonzero(x))


@pytest.mark.usefixtures("op_library")
def test_wrapper_and_layer_pass_full_stats():
    """The wrapper's full_stats defaults to return_stats; the gradient's
    ops pass false."""
    x = tf.ones([1, 4, 4, 2])
    f = tf.ones([1, 1, 2, 3])
    g = tf.function(lambda x: tfss.sparse_split_conv2d(x, f, 1, "VALID"))
    ops = g.get_concrete_function(x).graph.get_operations()
    (op,) = [o for o in ops if o.type == "TfSparseSplit>SparseSplitConv2D"]
    assert op.get_attr("full_stats") is False
    g = tf.function(lambda x: tfss.sparse_split_conv2d(x, f, 1, "VALID",
                                                        return_stats=True))
    ops = g.get_concrete_function(x).graph.get_operations()
    (op,) = [o for o in ops if o.type == "TfSparseSplit>SparseSplitConv2D"]
    assert op.get_attr("full_stats") is True

    def loss(x, f):
        with tf.GradientTape() as tape:
            tape.watch(f)
            y = tfss.sparse_split_conv2d(x, f, 1, "SAME", return_stats=True)[0]
            total = tf.reduce_sum(y * y)
        return tape.gradient(total, f)

    graph = tf.function(loss).get_concrete_function(
        tf.TensorSpec([2, 5, 5, 2]), tf.TensorSpec([3, 3, 2, 3])).graph
    ours = [o for o in graph.get_operations()
            if o.type.startswith("TfSparseSplit>")]
    # The forward op (return_stats) and the gradient's input gradient and
    # filter gradient.
    assert sorted(o.get_attr("full_stats") for o in ours) == [False, False,
                                                               True]
    assert {o.type for o in ours if not o.get_attr("full_stats")} == {
        "TfSparseSplit>SparseSplitConv2DBackpropInput",
        "TfSparseSplit>SparseSplitConv2DBackpropFilter"}


@pytest.mark.usefixtures("op_library")
@pytest.mark.parametrize("training,want", [(False, False), (True, True)])
def test_layer_asks_full_stats_only_when_recording(training, want):
    """SparseSplitConv2D passes full_stats=True only where the call records
    its statistics (training graphs, eager calls): an inference graph lets
    the op sample or skip its count."""
    layer = tfss.layers.SparseSplitConv2D(4, 3, padding="same",
                                          activation="relu")
    x = tf.TensorSpec([2, 6, 6, 3], tf.float32)
    layer.build((2, 6, 6, 3))
    graph = tf.function(lambda x: layer(x, training=training)) \
        .get_concrete_function(x).graph
    (op,) = [o for o in graph.get_operations()
             if o.type == "TfSparseSplit>SparseSplitConv2D"]
    assert op.get_attr("full_stats") is want


def _off_sample_images(rng, n, h, w, ci):
    """ReLU-like images, one all-zero and two whose nonzeros lie only on
    pixels a strided sample from pixel 0 with a stride of 16 or more skips
    (raster pixels 1 and H*W - 2)."""
    x = random_sparse_images((n, h, w, ci), 0.7, rng)
    x[1] = 0.0
    x[2] = 0.0
    x[2, 0, 1, :] = rng.uniform(0.5, 1.5, ci)
    x[3] = 0.0
    x[3, h - 1, w - 2, : ci // 2] = rng.uniform(0.5, 1.5, ci // 2)
    return x


@pytest.mark.usefixtures("op_library")
@pytest.mark.parametrize("fused", [False, True])
def test_given_threshold_one_samples_and_runs_every_image(fused, monkeypatch):
    """A given threshold of 1 (every image sparse) without full_stats
    counts only a sample when the sparse kernel is the direct one: the
    statistics say sampled with an estimated nnz, every image runs (an
    all-zero one and images whose nonzeros the sample misses included) and
    the output equals the reference; with full_stats every value is
    counted. The pixel-CSR kernel, which is sized by exact counts, always
    gets them."""
    rng = np.random.default_rng([7, fused])
    n, h, w, ci, co = 6, 20, 20, 16, 24
    f = rng.uniform(-0.5, 0.5, (3, 3, ci, co)).astype(np.float32)
    b = rng.uniform(-1, 1, co).astype(np.float32)
    kw = dict(bias=b, activation="relu") if fused else {}
    x = _off_sample_images(rng, n, h, w, ci)
    ref = (reference_conv2d_bias_act(x, f, b, "relu", 1, "SAME") if fused
           else reference_conv2d(x, f, 1, "SAME"))
    nnz = np.count_nonzero(x)
    monkeypatch.setenv("TFSS_CONV_SPARSE_KERNEL", "direct")
    for _ in range(3):
        got, st = tfss.sparse_split_conv2d(x, f, 1, "SAME", threshold=1.0,
                                           return_stats=True,
                                           full_stats=False, **kw)
        st = st.numpy()
        assert relative_error(got, ref) <= 1e-5
        assert st[S.ANALYSIS] == S.ANALYSIS_SAMPLED
        assert st[S.ROWS_SPARSE] == n and st[S.ROWS_DENSE] == 0
        assert st[S.HISTOGRAM].sum() == pytest.approx(n)
        assert st[S.ZERO_COLS_SKIPPED] == 0
        # Estimated: every image at least one nonzero, at most all values.
        assert n <= st[S.NNZ] <= n * h * w * ci
    got, st = tfss.sparse_split_conv2d(x, f, 1, "SAME", threshold=1.0,
                                       return_stats=True, full_stats=True,
                                       **kw)
    assert relative_error(got, ref) <= 1e-5
    assert st.numpy()[S.ANALYSIS] == S.ANALYSIS_FULL
    assert st.numpy()[S.NNZ] == nnz
    monkeypatch.setenv("TFSS_CONV_SPARSE_KERNEL", "csr")
    got, st = tfss.sparse_split_conv2d(x, f, 1, "SAME", threshold=1.0,
                                       return_stats=True, full_stats=False,
                                       **kw)
    assert relative_error(got, ref) <= 1e-5
    assert st.numpy()[S.ANALYSIS] == S.ANALYSIS_FULL
    assert st.numpy()[S.NNZ] == nnz


@pytest.mark.usefixtures("op_library")
def test_automatic_calls_equal_reference_on_off_sample_images(monkeypatch):
    """Automatic calls without full_stats on 97%-zero batches (the plan may
    go all-sparse and then decide on samples) equal the reference on fresh
    batches that hold an all-zero image and images whose nonzeros a sample
    misses, whatever each call counted."""
    rng = np.random.default_rng(11)
    n, h, w, ci, co = 8, 20, 20, 16, 24
    f = rng.uniform(-0.5, 0.5, (3, 3, ci, co)).astype(np.float32)
    monkeypatch.setenv("TFSS_CONV_SPARSE_KERNEL", "direct")

    @tf.function
    def cheap(x):
        return tfss.sparse_split_conv2d(x, f, 1, "SAME", threshold=-1.0,
                                        return_stats=True, full_stats=False)

    for _ in range(40):
        x = _off_sample_images(rng, n, h, w, ci)
        x[4:] *= rng.random(x[4:].shape) < 0.1
        got, st = cheap(x)
        assert relative_error(got, reference_conv2d(x, f, 1, "SAME")) <= 1e-5
        _check_stats(st.numpy(), n, h * w * ci, np.count_nonzero(x))


@pytest.mark.usefixtures("op_library")
def test_filter_grad_given_threshold_one_samples(monkeypatch):
    """The filter gradient with a given threshold of 1 and full_stats false
    counts a sample when the direct kernel runs; the gradient equals the
    reference on images the sample misses (and on an all-zero one)."""
    lib = load_library()
    rng = np.random.default_rng(23)
    n, h, w, ci, co = 6, 20, 20, 16, 24
    fsize = [3, 3, ci, co]
    x = _off_sample_images(rng, n, h, w, ci)
    dy = rng.uniform(-1, 1, (n, h, w, co)).astype(np.float32)
    ref = reference_conv2d_filter_grad(x, fsize, dy, 1, "SAME")
    monkeypatch.setenv("TFSS_CONV_SPARSE_KERNEL", "direct")
    for full_stats, mode in ((False, S.ANALYSIS_SAMPLED),
                             (True, S.ANALYSIS_FULL)):
        got, st = lib.tf_sparse_split_sparse_split_conv2d_backprop_filter(
            x, fsize, dy, 1.0, strides=[1, 1, 1, 1], padding="SAME",
            full_stats=full_stats)
        st = st.numpy()
        assert relative_error(got, ref) <= 1e-5
        assert st[S.ANALYSIS] == mode
        assert st[S.ROWS_SPARSE] == n
        if full_stats:
            assert st[S.NNZ] == np.count_nonzero(x)
