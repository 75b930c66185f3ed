"""The GPU SparseSplitMatMul in bfloat16 and float16.

Here (any machine): the kernel registry of the loaded op library lists
SparseSplitMatMul for float32, float64, bfloat16 and half on the CPU, and on
the GPU exactly when the library was built with the CUDA kernels (then for
the same four dtypes, with `threshold` and `stats` in host memory).

With a GPU (skipped otherwise): results against a float64 reference of the
stored values with the bound of tests/test_low_precision_matmul.py
(``eps_T |ref| + (eps_T + 4 K eps_f32) |a| |b|``: values stored in the dtype,
accumulated in float32, rounded once), at fixed and automatic thresholds,
both transposes, the heterogeneous split, the bias + relu epilogue, all-zero
rows and columns, odd sizes and empty inputs. The standalone CUDA harness
(cc/tests/cuda/, run by device_check.sh) tests the same kernels without
TensorFlow.
"""

import itertools

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import kernels as tf_kernels

import tf_sparse_split as tfss
from tf_sparse_split._loader import build_info
from tf_sparse_split.tuning import stats as S

pytestmark = pytest.mark.usefixtures("op_library")

HAS_GPU = bool(tf.config.list_physical_devices("GPU"))
OP = "TfSparseSplit>SparseSplitMatMul"
DTYPES = [tf.bfloat16, tf.float16]
EPS = {tf.bfloat16: 2.0 ** -7, tf.float16: 2.0 ** -10}
EPS_F32 = 2.0 ** -23
ALL_DTYPES = {"DT_FLOAT", "DT_DOUBLE", "DT_BFLOAT16", "DT_HALF"}


def _dtype_names(device):
    names = set()
    for kd in tf_kernels.get_registered_kernels_for_op(OP).kernel:
        if kd.device_type != device:
            continue
        for c in kd.constraint:
            if c.name == "T":
                names.update(tf.dtypes.as_dtype(t).as_datatype_enum for t in
                             c.allowed_values.list.type)
    return {tf.dtypes.as_dtype(e).name for e in names}


def test_cpu_kernels_cover_the_four_dtypes():
    assert _dtype_names("CPU") == {"float32", "float64", "bfloat16", "float16"}


def test_gpu_kernels_registered_exactly_with_the_cuda_build():
    names = _dtype_names("GPU")
    if not build_info()["CUDA"]:
        assert names == set()  # a CPU-only build claims no GPU kernel
        return
    assert names == {"float32", "float64", "bfloat16", "float16"}
    for kd in tf_kernels.get_registered_kernels_for_op(OP).kernel:
        if kd.device_type == "GPU":
            assert set(kd.host_memory_arg) == {"threshold", "stats"}


# -- with a GPU -------------------------------------------------------------

def _sparse_input(rng, m, k, sparsity):
    """float32 [m, k] with real zeros, all-zero rows (every 5th from row 1)
    and all-zero columns (every 7th from column 1), and at least one nonzero
    when sparsity < 1."""
    a = rng.standard_normal((m, k)).astype(np.float32)
    a *= rng.random((m, k)) >= sparsity
    a[1::5] = 0
    a[:, 1::7] = 0
    if sparsity < 1.0 and not a.any():
        a[0, 0] = 0.5
    return a


def _rounded(x, dtype):
    t = tf.cast(tf.constant(x, tf.float32), dtype)
    return t, tf.cast(t, tf.float64).numpy()


def _check(got, ref, abs_prod, k, dtype, what):
    got = tf.cast(got, tf.float64).numpy()
    eps = EPS[dtype]
    tol = eps * np.abs(ref) + (eps + 4 * max(k, 1) * EPS_F32) * abs_prod + 1e-30
    err = np.abs(got - ref)
    assert np.all(err <= tol), (what, float(np.max(err - tol)))


@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (7, 13, 5), (33, 70, 129),
                                   (300, 257, 136)])
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9, 1.0])
def test_gpu_matches_float64_reference(dtype, m, k, n, sparsity):
    rng = np.random.default_rng([m, k, n, int(sparsity * 100), dtype.size])
    for ta, tb, hetero in itertools.product([False, True], repeat=3):
        a = _sparse_input(rng, m, k, sparsity)
        b = rng.standard_normal((k, n)).astype(np.float32)
        a_t, a64 = _rounded(a.T.copy() if ta else a, dtype)
        b_t, b64 = _rounded(b.T.copy() if tb else b, dtype)
        oa, ob = (a64.T if ta else a64), (b64.T if tb else b64)
        ref, abs_prod = oa @ ob, np.abs(oa) @ np.abs(ob)
        with tf.device("/GPU:0"):
            for thr in (0.0, 0.5, 1.0, -1.0, -1.0):
                got, st = tfss.sparse_split_matmul(
                    a_t, b_t, thr, ta, tb, return_stats=True,
                    heterogeneous=hetero)
                assert got.dtype == dtype and got.shape == (m, n)
                assert got.device.endswith("GPU:0")
                _check(got, ref, abs_prod, k, dtype, (ta, tb, hetero, thr))
                st = st.numpy()
                assert st[S.NNZ] == np.count_nonzero(oa)
                assert st[S.ROWS_DENSE] + st[S.ROWS_SPARSE] == m
        # All-zero rows of op(a) give exact zeros at every threshold.
        zero_rows = ~oa.any(axis=1)
        assert np.all(tf.cast(got, tf.float64).numpy()[zero_rows] == 0.0)


@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("activation", ["none", "relu", "relu6"])
def test_gpu_bias_activation(dtype, activation):
    rng = np.random.default_rng([41, dtype.size])
    m, k, n = 130, 96, 72
    a_t, a64 = _rounded(_sparse_input(rng, m, k, 0.6), dtype)
    b_t, b64 = _rounded(rng.standard_normal((k, n)), dtype)
    bias_t, bias64 = _rounded(rng.standard_normal(n), dtype)
    pre = a64 @ b64 + bias64
    ref = {"none": pre, "relu": np.maximum(pre, 0),
           "relu6": np.clip(pre, 0, 6)}[activation]
    abs_prod = np.abs(a64) @ np.abs(b64) + np.abs(bias64)
    with tf.device("/GPU:0"):
        for thr in (0.0, 0.5, 1.0):
            got = tfss.sparse_split_matmul(a_t, b_t, thr, bias=bias_t,
                                           activation=activation)
            # The product is rounded, then its sum with the bias: the first
            # rounding (<= eps_T/2 |a||b|) is inside the (eps_T + ...) term.
            _check(got, ref, abs_prod, k, dtype, (activation, thr))


@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_gpu_empty_and_all_zero(dtype):
    with tf.device("/GPU:0"):
        z = tfss.sparse_split_matmul(tf.zeros((0, 4), dtype), tf.ones((4, 3), dtype))
        assert z.shape == (0, 3) and z.dtype == dtype
        e = tfss.sparse_split_matmul(tf.zeros((5, 0), dtype), tf.ones((0, 3), dtype))
        np.testing.assert_array_equal(tf.cast(e, tf.float32).numpy(), np.zeros((5, 3)))
        y = tfss.sparse_split_matmul(tf.zeros((5, 4), dtype), tf.ones((4, 3), dtype),
                                     0.5, heterogeneous=True)
    np.testing.assert_array_equal(tf.cast(y, tf.float32).numpy(), np.zeros((5, 3)))
