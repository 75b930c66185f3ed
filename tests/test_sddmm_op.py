"""SparseSplitSddmm (masked input gradient behind ReLU) and the input
gradients of SparseSplitMatMul that exploit the zeros of dY or of a: against
numpy in float64 and against TF's own gradients of tf.matmul + relu."""

import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf
from _helpers import kernels_or_skip

import tf_sparse_split as tfss
from tf_sparse_split.ops import sparse_split_sddmm
from tf_sparse_split.testing import random_sparse, relative_error
from tf_sparse_split.tuning import stats as S

pytestmark = pytest.mark.usefixtures("op_library")
K = kernels_or_skip()


def _mask(rng, m, k, sparsity, dtype=np.float32):
    mask = random_sparse((m, k), sparsity, rng, dtype)
    mask[rng.integers(m), rng.integers(k)] = 0.5  # never all zero
    return mask


def _ref(mask, x, y):
    """(mask != 0) * (x @ y^T) in float64; y is op(b) [k, n]."""
    full = x.astype(np.float64) @ y.astype(np.float64).T
    return np.where(mask != 0, full, 0.0)


# --- the core kernel through the pybind11 module -----------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (7, 13, 5), (9, 40, 31),
                                   (33, 70, 129), (128, 512, 1000)])
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9, 0.99])
def test_kernel_matches_numpy(dtype, m, k, n, sparsity):
    rng = np.random.default_rng([m, k, n, int(sparsity * 100)])
    mask = _mask(rng, m, k, sparsity, dtype)
    x = rng.standard_normal((m, n)).astype(dtype)
    y = rng.standard_normal((k, n)).astype(dtype)
    got = K.sddmm(mask, x, y)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == np.float32 else 1e-12
    assert relative_error(got, _ref(mask, x, y)) <= tol
    assert np.all(got[mask == 0] == 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [3, 16, 47, 300])
def test_kernel_deterministic_bits_across_threads(dtype, n):
    rng = np.random.default_rng([5, n])
    mask = _mask(rng, 61, 257, 0.8, dtype)
    x = rng.standard_normal((61, n)).astype(dtype)
    y = rng.standard_normal((257, n)).astype(dtype)
    first = K.sddmm(mask, x, y, threads=1)
    for threads in (2, 3, 7):
        np.testing.assert_array_equal(K.sddmm(mask, x, y, threads=threads), first)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("sparsity", [0.5, 0.95])
def test_kernel_row_blocks_keep_every_dot_whole(dtype, sparsity):
    # 16 KB rows of x: 64 rows per 1 MB block, five blocks, the last short.
    # Each dot is summed whole whatever block holds its row: the rows
    # computed alone (one block) give the same bits.
    m, k, n = 300, 97, 16384 // np.dtype(dtype).itemsize
    rng = np.random.default_rng([m, int(sparsity * 100)])
    mask = _mask(rng, m, k, sparsity, dtype)
    x = rng.standard_normal((m, n)).astype(dtype)
    y = rng.standard_normal((k, n)).astype(dtype)
    got = K.sddmm(mask, x, y, threads=2)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    assert relative_error(got, _ref(mask, x, y)) <= tol
    assert np.all(got[mask == 0] == 0)
    for threads in (1, 3):
        np.testing.assert_array_equal(K.sddmm(mask, x, y, threads=threads), got)
    for lo, hi in ((0, 7), (60, 70), (250, 300)):
        np.testing.assert_array_equal(
            K.sddmm(mask[lo:hi], x[lo:hi], y, threads=1), got[lo:hi])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_kernel_row_blocks_keep_every_dot_whole(dtype):
    # Rows widened to float32 (or copied as bfloat16 for the vdpbf16ps dots)
    # of 16-32 KB: 32-64 rows per 1 MB block, several blocks. Every ISA's
    # copy gives the rows computed alone (one block) the same bits.
    m, k, n = 150, 41, 8192
    rng = np.random.default_rng(21)

    def bits(a):
        if dtype == "float16":
            return a.astype(np.float16).view(np.uint16)
        return (a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)

    def values(b):
        if dtype == "float16":
            return b.view(np.float16).astype(np.float64)
        return (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64)

    mask = bits(_mask(rng, m, k, 0.6))
    x, y = bits(rng.standard_normal((m, n))), bits(rng.standard_normal((k, n)))
    ref = np.where(values(mask) != 0, values(x) @ values(y).T, 0.0)
    bound = np.abs(values(x)) @ np.abs(values(y)).T
    for isa in (-1, 0, 1, 2):
        got = K.lowp_sddmm(mask, x, y, dtype, isa=isa, threads=2)
        err = np.abs(values(got) - ref)
        assert np.all(err <= 1e-2 * np.abs(ref) + 4 * n * 2.0 ** -24 * bound + 1e-30)
        for lo, hi in ((0, 5), (30, 40), (140, 150)):
            np.testing.assert_array_equal(
                K.lowp_sddmm(mask[lo:hi], x[lo:hi], y, dtype, isa=isa,
                             threads=1), got[lo:hi])


def test_kernel_nan_inf_reach_only_the_sampled_dots():
    rng = np.random.default_rng(8)
    mask = _mask(rng, 6, 9, 0.5)
    x = rng.standard_normal((6, 20)).astype(np.float32)
    y = rng.standard_normal((9, 20)).astype(np.float32)
    x[2, 4] = np.nan
    y[3, 7] = np.inf
    got = K.sddmm(mask, x, y)
    with np.errstate(invalid="ignore"):
        ref = _ref(mask, x, y)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    finite = np.isfinite(ref)
    assert relative_error(got[finite], ref[finite]) <= 1e-5
    assert np.all(got[mask == 0] == 0)


# --- the op -------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize("threshold", [0.0, 0.3, 1.0, -1.0])
@pytest.mark.parametrize("m,k,n,sparsity", [(1, 1, 1, 0.0), (7, 13, 5, 0.5),
                                            (64, 300, 70, 0.9),
                                            (128, 256, 33, 0.99)])
def test_op_matches_reference(dtype, tb, threshold, m, k, n, sparsity):
    rng = np.random.default_rng([m, k, n, int(tb)])
    mask = _mask(rng, m, k, sparsity, dtype)
    # Rows of mixed density, so that thresholds in (0, 1) split them.
    mask[: m // 3] = rng.standard_normal((m // 3, k))
    x = rng.standard_normal((m, n)).astype(dtype)
    y = rng.standard_normal((k, n)).astype(dtype)
    got, st = sparse_split_sddmm(mask, x, y.T.copy() if tb else y, threshold,
                                 transpose_b=tb, return_stats=True)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    assert got.dtype == dtype and got.shape == (m, k)
    assert relative_error(got.numpy(), _ref(mask, x, y)) <= tol
    assert np.all(got.numpy()[mask == 0] == 0)
    st = st.numpy()
    assert st[S.ROWS_DENSE] + st[S.ROWS_SPARSE] == m
    assert st[S.NNZ] == np.count_nonzero(mask)
    if threshold == 1.0:
        assert st[S.ROWS_DENSE] == 0


def test_op_all_zero_mask_and_empty_sizes():
    # An all-zero mask (or n = 0) has no dot to compute: zeros.
    got = sparse_split_sddmm(np.zeros((3, 4), np.float32),
                             np.ones((3, 5), np.float32),
                             np.ones((4, 5), np.float32))
    np.testing.assert_array_equal(got.numpy(), np.zeros((3, 4)))
    for (m, k, n) in [(0, 4, 5), (3, 0, 5), (3, 4, 0)]:
        got = sparse_split_sddmm(np.ones((m, k), np.float32),
                                 np.ones((m, n), np.float32),
                                 np.ones((k, n), np.float32))
        np.testing.assert_array_equal(got.numpy(), np.zeros((m, k)))


def test_op_inside_tf_function_and_unknown_shapes():
    rng = np.random.default_rng(2)
    mask = _mask(rng, 20, 30, 0.8)
    x = rng.standard_normal((20, 12)).astype(np.float32)
    y = rng.standard_normal((30, 12)).astype(np.float32)

    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.float32)] * 3)
    def f(a, b, c):
        return sparse_split_sddmm(a, b, c)

    assert relative_error(f(mask, x, y).numpy(), _ref(mask, x, y)) <= 1e-5


F32 = np.float32


@pytest.mark.parametrize("args,kwargs,msg", [
    ((np.ones((2, 3, 1), F32), np.ones((2, 4), F32), np.ones((3, 4), F32)), {},
     "rank|matrix"),
    ((np.ones((2, 3), F32), np.ones((5, 4), F32), np.ones((3, 4), F32)), {},
     "shapes|Dimensions"),
    ((np.ones((2, 3), F32), np.ones((2, 4), F32), np.ones((3, 5), F32)), {},
     "shapes|Dimensions"),
    ((np.ones((2, 3), F32), np.ones((2, 4), F32), np.ones((3, 4), F32)),
     {"transpose_b": True}, "shapes|Dimensions"),
    ((np.ones((2, 3), F32), np.ones((2, 4), np.float64), np.ones((3, 4), F32)),
     {}, "dtype"),
    ((np.ones((2, 3), np.int32), np.ones((2, 4), F32), np.ones((3, 4), F32)),
     {}, "float32 or float64"),
    ((np.ones((2, 3), F32), np.ones((2, 4), F32), np.ones((3, 4), F32)),
     {"threshold": 1.5}, "threshold"),
    ((np.ones((2, 3), F32), np.ones((2, 4), F32), np.ones((3, 4), F32)),
     {"threshold": float("nan")}, "threshold"),
])
def test_op_bad_inputs_raise_invalid_argument(args, kwargs, msg):
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match=msg):
        sparse_split_sddmm(*args, **kwargs)


def test_op_bad_inputs_reach_the_kernel():
    """The kernel itself refuses what the wrapper cannot see (raw op)."""
    lib = tfss.load_library()
    ok = np.ones((2, 3), F32)
    with pytest.raises(tf.errors.InvalidArgumentError, match="shapes must be"):
        lib.tf_sparse_split_sparse_split_sddmm(ok, np.ones((2, 4), F32),
                                               np.ones((3, 5), F32), -1.0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="scalar"):
        lib.tf_sparse_split_sparse_split_sddmm(ok, np.ones((2, 4), F32),
                                               np.ones((3, 4), F32), [0.5, 0.5])
    with pytest.raises(tf.errors.InvalidArgumentError, match="threshold"):
        lib.tf_sparse_split_sparse_split_sddmm(ok, np.ones((2, 4), F32),
                                               np.ones((3, 4), F32), 2.0)


def test_op_gradients_against_numeric():
    rng = np.random.default_rng(11)
    mask = tf.constant(_mask(rng, 6, 9, 0.5, np.float64))
    for tb in (False, True):
        x = tf.constant(rng.standard_normal((6, 5)))
        b = tf.constant(rng.standard_normal((5, 9) if tb else (9, 5)))
        f = lambda x_, b_: sparse_split_sddmm(mask, x_, b_, 0.5, transpose_b=tb)  # noqa: E731
        theo, num = tf.test.compute_gradient(f, [x, b])
        for t_, n_ in zip(theo, num):
            np.testing.assert_allclose(t_, n_, rtol=1e-6, atol=1e-6)


# --- SparseSplitMatMul's input gradients ----------------------------------------

def _relu_input(rng, m, k, sparsity, dtype):
    """z with about `sparsity` of relu(z) exactly zero (a few dead units)."""
    z = rng.standard_normal((m, k)).astype(dtype)
    shift = np.quantile(z, sparsity)
    z = z - shift
    z[:, ::7] = -np.abs(z[:, ::7])  # dead units: all-zero columns
    z[0, 1] = abs(z[0, 1]) + 0.5    # never all zero
    return z


@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("m,k,n,sparsity", [(9, 20, 7, 0.5), (64, 300, 70, 0.9),
                                            (128, 512, 96, 0.99)])
def test_masked_grad_a_equals_tf_behind_relu(tb, fused, m, k, n, sparsity):
    """masked_input_grad (the SDDMM): d loss / d z equals TF's for relu(z)."""
    rng = np.random.default_rng([m, k, n, int(tb), int(fused)])
    z = tf.constant(_relu_input(rng, m, k, sparsity, np.float32))
    b = tf.constant(rng.standard_normal((n, k) if tb else (k, n)).astype(np.float32))
    act = "relu" if fused else None
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([z, b])
        ours = tfss.sparse_split_matmul(tf.nn.relu(z), b, -1.0, transpose_b=tb,
                                        masked_input_grad=True, activation=act)
        ref = tf.matmul(tf.nn.relu(z), b, transpose_b=tb)
        if fused:
            ref = tf.nn.relu(ref)
        w = tf.constant(rng.standard_normal((m, n)).astype(np.float32))
        loss_o = tf.reduce_sum(tf.sin(ours) * w)
        loss_r = tf.reduce_sum(tf.sin(ref) * w)
    for v in (z, b):
        assert relative_error(tape.gradient(loss_o, v), tape.gradient(loss_r, v)) <= 1e-5


def test_masked_grad_a_runs_through_the_sddmm_op():
    a = tf.constant(random_sparse((8, 6), 0.5, np.random.default_rng(0)))
    b = tf.constant(np.ones((6, 4), np.float32))

    @tf.function
    def grads():
        with tf.GradientTape() as tape:
            tape.watch(a)
            y = tf.reduce_sum(tfss.sparse_split_matmul(a, b, masked_input_grad=True))
        return tape.gradient(y, a)

    graph = grads.get_concrete_function().graph
    types = [op.type for op in graph.get_operations()]
    assert types.count("TfSparseSplit>SparseSplitSddmm") == 1
    ga = grads().numpy()
    assert np.all(ga[a.numpy() == 0] == 0)
    np.testing.assert_allclose(ga[a.numpy() != 0], 4.0, rtol=1e-6)


@pytest.mark.parametrize("ta,tb", list(itertools.product([False, True], repeat=2)))
@pytest.mark.parametrize("n,sparsity", [(70, 0.9), (130, 0.5), (20, 0.9)])
def test_dy_sparse_grad_a_equals_tf(ta, tb, n, sparsity):
    """The input gradient with dY (masked by a relu downstream) as the sparse
    operand equals TF's, for every transpose; N < 64 stays a plain GEMM."""
    rng = np.random.default_rng([n, int(ta), int(tb)])
    m, k = 48, 90
    a = random_sparse((m, k), 0.5, rng)
    a = tf.constant(a.T.copy() if ta else a)
    b = rng.standard_normal((k, n)).astype(np.float32)
    b = tf.constant(b.T.copy() if tb else b)
    shift = tf.constant(np.float32(np.quantile(rng.standard_normal(1000), sparsity)))

    def loss(mm):
        with tf.GradientTape() as tape:
            tape.watch([a, b])
            y = tf.nn.relu(mm(a, b) - shift)  # dY mostly zeros
            out = tf.reduce_sum(tf.sin(y))
        return tape.gradient(out, [a, b])

    ours = loss(lambda x, y: tfss.sparse_split_matmul(x, y, -1.0, ta, tb))
    ref = loss(lambda x, y: tf.matmul(x, y, transpose_a=ta, transpose_b=tb))
    for g_o, g_r in zip(ours, ref):
        assert relative_error(g_o, g_r) <= 1e-5

    @tf.function
    def graph_grads():
        return loss(lambda x, y: tfss.sparse_split_matmul(x, y, -1.0, ta, tb))

    types = [op.type for op in
             graph_grads.get_concrete_function().graph.get_operations()]
    # forward + grad_b, and grad_a with dY as sparse operand when N >= 64.
    assert types.count("TfSparseSplit>SparseSplitMatMul") == (3 if n >= 64 else 2)


def test_sparsity_target_callback_sets_masked_input_grad():
    x = np.random.default_rng(0).standard_normal((64, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    model = keras.Sequential([
        keras.Input((8,)),
        tfss.SparseSplitDense(16, activation="relu", name="h"),
        tfss.SparseSplitDense(2, activation="softmax", name="out")])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                  jit_compile=False)
    assert not model.get_layer("out").masked_input_grad
    model.fit(x, y, epochs=1, batch_size=16, verbose=0,
              callbacks=[tfss.SparsityTargetCallback(0.5)])
    assert model.get_layer("out").masked_input_grad
    assert not model.get_layer("h").masked_input_grad  # fed by the input
