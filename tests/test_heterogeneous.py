"""Tests of the heterogeneous split (dense rows on the GPU, sparse rows on
the CPU; K.-Y. Peng, NTU 2017): the op attribute, the CPU fallback and its
warning, the max-of-both-devices cost model, the layer argument, the
callback plumbing, the TFSS_WITH_CUDA build switch, and (only with a GPU)
the GPU kernel against tf.matmul."""

import ast
import os
import shutil
import subprocess
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sparse_split as tfss
from tf_sparse_split.ops import matmul as tfss_ops
from tf_sparse_split.tuning import stats as S
from tf_sparse_split.callbacks import SplitThresholdCallback
from tf_sparse_split.tuning.cost_model import (
    ARGMIN_POLICY, DENSE, SPARSE, CostModel, candidate_thresholds)
from tf_sparse_split.layers import SparseSplitDense

pytestmark = pytest.mark.usefixtures("op_library")

HAS_GPU = bool(tf.config.list_physical_devices("GPU"))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sparse_input(m, k, zero_fraction, seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(dtype)
    # Rows of varied density, some all-zero rows and all-zero columns.
    keep = rng.random((m, k)) >= (zero_fraction * rng.random((m, 1)) * 2).clip(0, 1)
    x *= keep
    x[:, ::7] = 0
    x[::5] = 0
    return x


@pytest.fixture
def fresh_warning_state(monkeypatch):
    monkeypatch.setattr(tfss_ops, "_no_gpu_warned", False)


# -- the op attribute ------------------------------------------------------

def _matmul_nodes(graph_def):
    return [n for n in graph_def.node if n.op == "TfSparseSplit>SparseSplitMatMul"]


@pytest.mark.parametrize("hetero", [None, False, True])
def test_attr_default_and_graph_round_trip(hetero, fresh_warning_state):
    kwargs = {} if hetero is None else {"heterogeneous": hetero}

    @tf.function
    def f(a, b):
        return tfss.sparse_split_matmul(a, b, 0.5, **kwargs)

    spec = tf.TensorSpec([None, 6], tf.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        gd = f.get_concrete_function(spec, tf.TensorSpec([6, 3])).graph.as_graph_def()
    (node,) = _matmul_nodes(gd)
    assert node.attr["heterogeneous"].b is bool(hetero)
    # Through a serialized GraphDef into a fresh graph.
    gd2 = tf.compat.v1.GraphDef.FromString(gd.SerializeToString())
    with tf.Graph().as_default() as g:
        tf.graph_util.import_graph_def(gd2, name="")
        ops = [op for op in g.get_operations() if op.type == "TfSparseSplit>SparseSplitMatMul"]
        assert len(ops) == 1
        assert ops[0].get_attr("heterogeneous") is bool(hetero)


def test_graph_def_without_the_attr_gets_the_default():
    # A graph written before the attr existed: importing adds the default.
    @tf.function
    def f(a, b):
        return tfss.sparse_split_matmul(a, b, 0.5)

    gd = f.get_concrete_function(tf.TensorSpec([4, 6]),
                                 tf.TensorSpec([6, 3])).graph.as_graph_def()
    (node,) = _matmul_nodes(gd)
    del node.attr["heterogeneous"]
    with tf.Graph().as_default() as g:
        tf.graph_util.import_graph_def(gd, name="")
        (op,) = [o for o in g.get_operations() if o.type == "TfSparseSplit>SparseSplitMatMul"]
        assert op.get_attr("heterogeneous") is False


def test_attr_type_is_checked():
    with pytest.raises(TypeError):
        tfss.sparse_split_matmul(np.ones((2, 2), np.float32),
                                 np.ones((2, 2), np.float32), heterogeneous="yes")


# -- the CPU fallback --------------------------------------------------------

@pytest.mark.skipif(HAS_GPU, reason="tests the CPU kernel's fallback")
@pytest.mark.parametrize("threshold", [0.0, 0.5, 1.0, -1.0])
@pytest.mark.parametrize("ta,tb", [(False, False), (True, True)])
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_cpu_fallback_is_identical(threshold, ta, tb, mode, fresh_warning_state):
    a = _sparse_input(37, 29, 0.7, seed=1)
    b = np.random.default_rng(2).standard_normal((29, 11)).astype(np.float32)
    a_in = a.T.copy() if ta else a
    b_in = b.T.copy() if tb else b

    def run(hetero):
        def g(x, y):
            return tfss.sparse_split_matmul(x, y, threshold, transpose_a=ta,
                                            transpose_b=tb, return_stats=True,
                                            heterogeneous=hetero)
        fn = tf.function(g) if mode == "function" else g
        p, s = fn(tf.constant(a_in), tf.constant(b_in))
        return p.numpy(), s.numpy()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        p0, s0 = run(False)
        p1, s1 = run(True)
    np.testing.assert_array_equal(p1, p0)  # same kernel, same bits
    ref = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(p1, ref, rtol=1e-5, atol=1e-5)
    assert s0[S.HETEROGENEOUS] == S.HETERO_OFF
    assert s1[S.HETEROGENEOUS] == S.HETERO_CPU_FALLBACK
    # Same split decisions (rows, nnz) with and without the flag; the
    # automatic threshold decides from the op's own measured timings, so two
    # calls may differ in their plan (rows, skipped columns) there, but both
    # count every value (return_stats asks for exact statistics).
    for i in ((S.NNZ, S.ZERO_COLS_SKIPPED, S.M, S.K, S.N) if threshold >= 0
              else (S.NNZ, S.M, S.K, S.N)):
        assert s1[i] == s0[i]
    assert s0[S.ANALYSIS] == s1[S.ANALYSIS] == S.ANALYSIS_FULL
    assert s0[S.NNZ] == np.count_nonzero(a)
    if threshold >= 0:
        for i in (S.ROWS_DENSE, S.ROWS_SPARSE, S.NNZ_SPARSE):
            assert s1[i] == s0[i]


@pytest.mark.skipif(HAS_GPU, reason="tests the CPU kernel's fallback")
def test_cpu_fallback_gradients_match(fresh_warning_state):
    a = tf.constant(_sparse_input(16, 12, 0.6, seed=3))
    b = tf.constant(np.random.default_rng(4).standard_normal((12, 5)).astype(np.float32))
    grads = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for hetero in (False, True):
            with tf.GradientTape() as tape:
                tape.watch([a, b])
                y = tfss.sparse_split_matmul(a, b, 0.5, heterogeneous=hetero)
                loss = tf.reduce_sum(y * y)
            grads.append([g.numpy() for g in tape.gradient(loss, [a, b])])
    for g0, g1 in zip(*grads):
        np.testing.assert_array_equal(g1, g0)


@pytest.mark.skipif(HAS_GPU, reason="the warning is for machines without a GPU")
def test_warns_once_without_gpu(fresh_warning_state):
    a = np.eye(3, dtype=np.float32)
    with pytest.warns(RuntimeWarning, match="heterogeneous=True needs a GPU"):
        tfss.sparse_split_matmul(a, a, heterogeneous=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise
        tfss.sparse_split_matmul(a, a, heterogeneous=True)
        tfss.sparse_split_matmul(a, a, heterogeneous=False)


@pytest.mark.skipif(HAS_GPU, reason="the warning is for machines without a GPU")
def test_no_warning_without_the_flag(fresh_warning_state):
    a = np.eye(3, dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tfss.sparse_split_matmul(a, a, heterogeneous=False)
    assert tfss_ops._no_gpu_warned is False


# -- cost model: max of both devices instead of the sum ----------------------

def _synthetic_model(dense_rate, sparse_rate, dense_overhead=0.0,
                     sparse_overhead=0.0):
    cm = CostModel()
    for w in (1e8, 2e8, 4e8, 8e8):
        cm.add_sample(DENSE, w, dense_overhead + w / dense_rate)
        cm.add_sample(SPARSE, w, sparse_overhead + w / sparse_rate)
    cm.fit()
    return cm


def test_cost_model_max_picks_a_balanced_threshold():
    # Equal rates, 10 rows in each of the 16 density bins, no dead columns.
    # Sum: every row is cheaper sparse (density < 1) -> threshold 1.0.
    # Max: all sparse costs 10*sum((j+.5)/16) = 80 row-units, balance is at
    # 12 sparse bins (sparse 45, dense 40) -> threshold 0.75.
    cm = _synthetic_model(1e10, 1e10)
    hist = np.full(16, 10.0)
    m, k, n = 160, 1024, 256
    thr_sum = cm.best_threshold(hist, m, k, k, n, policy=ARGMIN_POLICY)
    thr_max = cm.best_threshold(hist, m, k, k, n, heterogeneous=True,
                                policy=ARGMIN_POLICY)
    assert thr_sum == 1.0
    assert thr_max == 0.75
    # Both are the argmin of their own objective over the candidates.
    cands = candidate_thresholds(16)
    t_sum = [cm.predicted_time(hist, m, k, k, n, t) for t in cands]
    t_max = [cm.predicted_time(hist, m, k, k, n, t, heterogeneous=True)
             for t in cands]
    assert cands[int(np.argmin(t_sum))] == thr_sum
    assert cands[int(np.argmin(t_max))] == thr_max
    assert min(t_max) < cm.predicted_time(hist, m, k, k, n, thr_sum,
                                          heterogeneous=True)


def test_cost_model_max_is_the_max_of_the_paths():
    cm = _synthetic_model(4e10, 5e9, dense_overhead=1e-4, sparse_overhead=2e-5)
    hist = np.arange(16, dtype=np.float64)
    for thr in candidate_thresholds(16):
        t_sum = cm.predicted_time(hist, 120, 512, 400, 64, thr)
        t_max = cm.predicted_time(hist, 120, 512, 400, 64, thr, heterogeneous=True)
        assert t_max <= t_sum + 1e-15
        # sum = dense + sparse and max = max(dense, sparse): recover both.
        parts = _split_parts(cm, hist, 120, 512, 400, 64, thr)
        assert t_sum == pytest.approx(sum(parts), rel=1e-12)
        assert t_max == pytest.approx(max(parts), rel=1e-12)


def _split_parts(cm, hist, m, k, k_live, n, thr):
    bins = hist.size
    centers = (np.arange(bins) + 0.5) / bins
    sb = min(max(int(np.floor(thr * bins + 1e-9)), 0), bins)
    dense = cm.fitted(DENSE).predict(2.0 * hist[sb:].sum() * k_live * n)
    sparse = cm.fitted(SPARSE).predict(2.0 * (hist[:sb] * centers[:sb] * k).sum() * n)
    return float(dense), float(sparse)


def test_cost_model_max_goes_all_dense_when_the_gpu_is_much_faster():
    # A GPU 1000x faster than the CPU SpMM: offloading anything only delays.
    cm = _synthetic_model(1e13, 1e10)
    hist = np.full(16, 10.0)
    assert cm.best_threshold(hist, 160, 1024, 1024, 256, heterogeneous=True) == 0.0


def test_cost_model_heterogeneous_needs_both_fits():
    cm = CostModel()
    cm.add_sample(DENSE, 1e8, 1e-3)
    cm.fit()
    assert cm.best_threshold(np.ones(16), 16, 64, 64, 8, heterogeneous=True) is None


# -- the layer ---------------------------------------------------------------

def test_layer_argument_serialization():
    default = SparseSplitDense(4)
    assert default.heterogeneous is False
    assert default.get_config()["heterogeneous"] is False
    layer = SparseSplitDense(4, threshold=0.25, heterogeneous=True, name="h")
    cfg = layer.get_config()
    assert cfg["heterogeneous"] is True and cfg["threshold"] == 0.25
    clone = SparseSplitDense.from_config(cfg)
    assert clone.heterogeneous is True
    ser = keras.saving.serialize_keras_object(layer)
    back = keras.saving.deserialize_keras_object(ser)
    assert isinstance(back, SparseSplitDense) and back.heterogeneous is True
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError):
            SparseSplitDense(4, heterogeneous=bad)


def test_layer_saved_model_file_round_trip(tmp_path, fresh_warning_state):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((9,)),
                              SparseSplitDense(5, heterogeneous=True, name="h")])
    x = _sparse_input(8, 9, 0.6, seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        y = model.predict(x, verbose=0)
        path = str(tmp_path / "m.keras")
        model.save(path)
        loaded = keras.saving.load_model(path)
        y2 = loaded.predict(x, verbose=0)
    assert loaded.get_layer("h").heterogeneous is True
    np.testing.assert_array_equal(y2, y)


@pytest.mark.skipif(HAS_GPU, reason="tests the CPU kernel's fallback")
def test_layer_fallback_matches_and_warns_once(fresh_warning_state):
    keras.utils.set_random_seed(1)
    x = _sparse_input(12, 10, 0.5, seed=6)
    plain = SparseSplitDense(3, threshold=0.5)
    hetero = SparseSplitDense(3, threshold=0.5, heterogeneous=True)
    y0 = plain(x)
    hetero.build(x.shape)
    hetero.set_weights(plain.get_weights())
    with pytest.warns(RuntimeWarning, match="heterogeneous=True"):
        y1 = hetero(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hetero(x)
    np.testing.assert_array_equal(y1.numpy(), y0.numpy())
    assert hetero.latest_stats()["heterogeneous"] == S.HETERO_CPU_FALLBACK
    assert plain.latest_stats()["heterogeneous"] == S.HETERO_OFF


def test_callback_decides_with_the_split_that_ran(monkeypatch,
                                                 fresh_warning_state):
    # The tuner's decision is heterogeneous (max of the parts) exactly when
    # the op's statistics say the heterogeneous split ran (HETERO_RAN, GPU
    # kernel); the CPU fallback runs the parts one after the other.
    from tf_sparse_split.tuning import op_model

    seen = []
    original = op_model.decide

    def spy(vector, *args, **kwargs):
        seen.append(op_model.cost_problem(vector).terms["heterogeneous"])
        return original(vector, *args, **kwargs)

    monkeypatch.setattr(op_model, "decide", spy)
    keras.utils.set_random_seed(0)
    x = _sparse_input(64, 16, 0.7, seed=7)
    y = np.random.default_rng(8).integers(0, 2, 64)
    model = keras.Sequential([
        keras.Input((16,)),
        SparseSplitDense(8, activation="relu", heterogeneous=True, name="het"),
        SparseSplitDense(2, name="plain"),
    ])
    model.compile("sgd", "sparse_categorical_crossentropy", jit_compile=False)
    cb = SplitThresholdCallback(explore_batches=4, min_samples=1,
                                warmup_samples=0,
                                policy="fixed")  # both explored
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        model.fit(x, y, batch_size=8, epochs=1, callbacks=[cb], verbose=0)
    assert sorted(seen) == sorted([HAS_GPU, False])


# -- the build switch ----------------------------------------------------------

def _setup_functions():
    """setup.py's imports and functions, without running setup()."""
    with open(os.path.join(ROOT, "setup.py")) as f:
        tree = ast.parse(f.read())
    tree.body = [n for n in tree.body
                 if isinstance(n, (ast.Import, ast.ImportFrom, ast.FunctionDef))]
    ns = {"__file__": os.path.join(ROOT, "setup.py")}
    exec(compile(tree, "setup.py", "exec"), ns)
    return ns


@pytest.mark.skipif(tf.sysconfig.get_build_info().get("is_cuda_build", False),
                    reason="checks the CPU-only TensorFlow case")
def test_tfss_with_cuda_on_cpu_only_tensorflow(monkeypatch):
    ns = _setup_functions()
    monkeypatch.setenv("TFSS_WITH_CUDA", "auto")
    nvcc, desc = ns["_cuda_mode"](tf)
    assert nvcc is None and "CPU-only" in desc
    monkeypatch.setenv("TFSS_WITH_CUDA", "0")
    assert ns["_cuda_mode"](tf)[0] is None
    for bad in ("1", "yes"):
        monkeypatch.setenv("TFSS_WITH_CUDA", bad)
        with pytest.raises(SystemExit):
            ns["_cuda_mode"](tf)


def test_nvcc_command_and_sources():
    ns = _setup_functions()
    cmd = ns["_nvcc_command"]("nvcc", "cc/core/cuda/x.cu.cc", "x.o",
                              ["-I/tf/include", "-D_GLIBCXX_USE_CXX11_ABI=1",
                               "--std=c++17"])
    for flag in ("-x", "cu", "-std=c++17", "-O3", "-Xcompiler", "-fPIC",
                 "arch=compute_90,code=sm_90", "arch=compute_80,code=compute_80",
                 "-I/tf/include", "-D_GLIBCXX_USE_CXX11_ABI=1"):
        assert flag in cmd
    assert "--std=c++17" not in cmd
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)
        srcs = ns["_cuda_sources"]()
    finally:
        os.chdir(cwd)
    assert "cc/core/cuda/sparse_matmul.cu.cc" in srcs
    assert not any(s.startswith("cc/tests/") for s in srcs)  # harness has main()


# -- the CUDA harness script (runs here: a fake harness and nvidia-smi) -------

HARNESS_SCRIPT = os.path.join(ROOT, "cc", "tests", "cuda", "run_harness.sh")


def _run_harness_script(tmp_path, harness_rc, smi, **env_extra):
    """run_harness.sh with TFSS_HARNESS_BIN = a script exiting `harness_rc`
    and a fake nvidia-smi first on PATH that lists a GPU (smi="gpu") or
    finds none (smi="none")."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    smi_out = ('echo "GPU 0: NVIDIA H200 (UUID: GPU-0)"; exit 0' if smi == "gpu"
               else 'echo "No devices were found"; exit 6')
    (bindir / "nvidia-smi").write_text(f"#!/bin/sh\n{smi_out}\n")
    fake = tmp_path / "fake_harness"
    fake.write_text(f'#!/bin/sh\necho "fake harness $*"\nexit {harness_rc}\n')
    for f in (bindir / "nvidia-smi", fake):
        f.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TFSS_")}
    env.update(PATH=f"{bindir}:{os.environ.get('PATH', '')}",
               TFSS_HARNESS_BIN=str(fake), **env_extra)
    r = subprocess.run(["bash", HARNESS_SCRIPT, "--tests-only"], env=env,
                       capture_output=True, text=True, timeout=120)
    return r.returncode, r.stdout + r.stderr


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                    reason="needs bash and timeout")
@pytest.mark.parametrize("harness_rc,smi,extra,ok,expect", [
    # nvidia-smi lists a GPU but the harness says "no CUDA device": a failure
    # (it used to be reported as "built only", exit 0).
    (77, "gpu", {}, False, "FAILED: nvidia-smi lists a GPU"),
    (77, "none", {}, True, "no GPU: built only"),
    (77, "none", {"TFSS_REQUIRE_GPU": "1"}, False, "TFSS_REQUIRE_GPU=1"),
    (1, "gpu", {}, False, "harness FAILED (exit 1)"),
    (0, "gpu", {}, True, "all CUDA harness tests passed"),
])
def test_run_harness_exit_status(tmp_path, harness_rc, smi, extra, ok, expect):
    rc, out = _run_harness_script(tmp_path, harness_rc, smi, **extra)
    assert (rc == 0) is ok, out
    assert expect in out, out
    assert "fake harness --tests-only" in out  # the harness ran, with the args


def test_device_check_script_is_valid_bash():
    script = os.path.join(ROOT, "cc", "tests", "cuda", "device_check.sh")
    r = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text = open(script).read()
    # It must require a GPU and cuBLAS (no silent "built only" pass).
    assert "TFSS_REQUIRE_GPU=1" in text and "TFSS_REQUIRE_CUBLAS=1" in text


# -- the GPU kernel (skipped without a GPU) ------------------------------------
#
# The GPU contract (docs/guide/gpu.md): float32 dense
# rows run through TF's MatMul and so use TF32 on Ampere+ while
# tf.config.experimental.enable_tensor_float_32_execution is on (TF's
# default), exactly like tf.matmul; sparse rows are full FP32. A fixed
# threshold gives the same bits on every call; an automatic one is fixed to
# 0 (every nonzero row dense) while op determinism is enabled.


def _tf32_active():
    """Whether float32 GEMMs on GPU:0 run at TF32 precision."""
    if not tf.config.experimental.tensor_float_32_execution_enabled():
        return False
    gpu = tf.config.list_physical_devices("GPU")[0]
    cc = tf.config.experimental.get_device_details(gpu).get("compute_capability", (0, 0))
    return tuple(cc) >= (8, 0)


def _normwise_err(got, ref):
    ref = np.asarray(ref, np.float64)
    scale = max(np.max(np.abs(ref)), 1e-300)
    return float(np.max(np.abs(np.asarray(got, np.float64) - ref)) / scale)


def _gpu_tol(dtype, dense_rows_possible=True):
    """Normwise relative bound against a float64 reference: float rounding,
    or TF32's (10-bit mantissa inputs) when dense float32 rows use TF32."""
    if dtype == np.float64:
        return 1e-12
    return 1e-2 if (dense_rows_possible and _tf32_active()) else 1e-5


@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
@pytest.mark.parametrize("hetero", [False, True])
@pytest.mark.parametrize("threshold", [0.0, 0.5, 1.0, -1.0])
@pytest.mark.parametrize("ta,tb", [(False, False), (False, True), (True, False),
                                   (True, True)])
def test_gpu_kernel_matches_reference(hetero, threshold, ta, tb):
    for dtype in (np.float32, np.float64):
        a = _sparse_input(300, 257, 0.8, seed=9, dtype=dtype)
        b = np.random.default_rng(10).standard_normal((257, 130)).astype(dtype)
        a_in = a.T.copy() if ta else a
        b_in = b.T.copy() if tb else b
        ref64 = a.astype(np.float64) @ b.astype(np.float64)
        with tf.device("/GPU:0"):
            for _ in range(3):  # automatic mode explores over calls
                p, s = tfss.sparse_split_matmul(
                    a_in, b_in, threshold, transpose_a=ta, transpose_b=tb,
                    return_stats=True, heterogeneous=hetero)
                s = s.numpy()
                # Sparse rows are full FP32 even while TF32 is on; only
                # calls with dense rows may show TF32 error.
                tol = _gpu_tol(dtype, dense_rows_possible=s[S.ROWS_DENSE] > 0)
                assert _normwise_err(p.numpy(), ref64) <= tol
            ref = tf.matmul(a_in, b_in, transpose_a=ta, transpose_b=tb)
        assert p.device.endswith("GPU:0")
        assert _normwise_err(ref.numpy(), ref64) <= _gpu_tol(dtype)
        assert s[S.HETEROGENEOUS] == (S.HETERO_RAN if hetero else S.HETERO_OFF)
        assert s[S.ROWS_DENSE] + s[S.ROWS_SPARSE] == 300
        assert s[S.NNZ] == np.count_nonzero(a)
        # The stats were consumed: the op waited and measured both parts.
        assert np.isfinite(s[S.TIME_DENSE]) and np.isfinite(s[S.TIME_SPARSE])


@pytest.fixture
def tf32_off():
    was = tf.config.experimental.tensor_float_32_execution_enabled()
    tf.config.experimental.enable_tensor_float_32_execution(False)
    yield
    tf.config.experimental.enable_tensor_float_32_execution(was)


@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
@pytest.mark.parametrize("threshold", [0.0, 0.5, 1.0])
def test_gpu_fp32_everywhere_when_tf32_is_off(threshold, tf32_off):
    # With TF32 off every row is FP32: float rounding at any threshold.
    a = _sparse_input(256, 384, 0.7, seed=21)
    b = np.random.default_rng(22).standard_normal((384, 96)).astype(np.float32)
    ref64 = a.astype(np.float64) @ b.astype(np.float64)
    with tf.device("/GPU:0"):
        p = tfss.sparse_split_matmul(a, b, threshold)
    assert _normwise_err(p.numpy(), ref64) <= 1e-5


@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
@pytest.mark.parametrize("hetero", [False, True])
@pytest.mark.parametrize("threshold", [0.0, 0.3, 1.0])
def test_gpu_fixed_threshold_gives_the_same_bits(hetero, threshold):
    a = _sparse_input(512, 300, 0.75, seed=23)
    b = np.random.default_rng(24).standard_normal((300, 72)).astype(np.float32)
    with tf.device("/GPU:0"):
        outs = [tfss.sparse_split_matmul(a, b, threshold, heterogeneous=hetero).numpy()
                for _ in range(4)]
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


@pytest.fixture
def op_determinism():
    # Only enable_op_determinism is public; the switch back is TF-internal.
    from tensorflow.python.framework import config as tf_config
    was = tf_config.is_op_determinism_enabled()
    tf.config.experimental.enable_op_determinism()
    yield
    if not was:
        tf_config.disable_op_determinism()


@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
@pytest.mark.parametrize("hetero", [False, True])
def test_gpu_auto_threshold_is_fixed_under_op_determinism(hetero, op_determinism):
    # Without determinism the automatic threshold explores (0, then 1, then
    # a measured value) and rows move between cuBLAS and the CSR kernel
    # between calls; with it the split is fixed and the bits repeat. The
    # problem is large enough (2*m*k*n > 2e7 flops) for the rates to count.
    a = _sparse_input(512, 520, 0.75, seed=25)
    b = np.random.default_rng(26).standard_normal((520, 264)).astype(np.float32)
    outs, thresholds, rows_dense = [], [], []
    with tf.device("/GPU:0"):
        for _ in range(5):
            p, s = tfss.sparse_split_matmul(a, b, -1.0, return_stats=True,
                                            heterogeneous=hetero)
            outs.append(p.numpy())
            s = s.numpy()
            thresholds.append(s[S.THRESHOLD])
            rows_dense.append(s[S.ROWS_DENSE])
    assert thresholds == [0.0] * 5
    assert len(set(rows_dense)) == 1
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
@pytest.mark.parametrize("hetero", [False, True])
def test_gpu_calls_without_a_stats_consumer(hetero):
    # In a tf.function that drops the statistics the op returns without
    # waiting for the GPU; its pinned index/copy buffers are released in
    # stream order. Many calls with different zero patterns are queued
    # before any result is read: a buffer freed too early would give wrong
    # rows (or an illegal-address error).
    b = np.random.default_rng(27).standard_normal((200, 40)).astype(np.float32)

    @tf.function
    def f(x):
        return tfss.sparse_split_matmul(x, b, 0.4, heterogeneous=hetero)

    xs = [_sparse_input(333, 200, 0.5 + 0.04 * i, seed=100 + i) for i in range(12)]
    with tf.device("/GPU:0"):
        ys = [f(tf.constant(x)) for x in xs]  # queued; nothing read yet
    for x, y in zip(xs, ys):
        ref64 = x.astype(np.float64) @ b.astype(np.float64)
        assert _normwise_err(y.numpy(), ref64) <= _gpu_tol(np.float32)


@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
def test_gpu_kernel_empty_and_all_zero():
    with tf.device("/GPU:0"):
        z = tfss.sparse_split_matmul(np.zeros((0, 4), np.float32),
                                     np.ones((4, 3), np.float32))
        assert z.shape == (0, 3)
        y = tfss.sparse_split_matmul(np.zeros((5, 4), np.float32),
                                     np.ones((4, 3), np.float32), 0.5,
                                     heterogeneous=True)
    np.testing.assert_array_equal(y.numpy(), np.zeros((5, 3), np.float32))
