"""The bfloat16 SparseSplitMatMul op's sparse path (CSR build + CsrSpmm on
TF's intra-op pool), at the sizes and sparsities where it runs the dot
kernels (AVX512_BF16 ``vdpbf16ps``) where the CPU has them, else the direct
or packed kernels.

Structural checks only (no timings): every row goes to the sparse path at
``threshold=1.0`` (statistics), its output equals the kernel binding's
(``_kernels.lowp_spmm``: count, CSR build and CsrSpmm, the same kernel
choice) bit for bit whatever the thread pool, a split threshold gives the
same bits row by row as the all-sparse call for its sparse rows, and every
output is within one bfloat16 rounding plus the float32 accumulation error
of k products of a float64 reference (inputs with real zeros, never all
zero; both ``a @ b`` and the weight-gradient form ``a^T @ dY``).
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_sparse_split as tfss
from tf_sparse_split.testing import random_sparse
from tf_sparse_split.tuning import stats as S

pytestmark = pytest.mark.usefixtures("op_library")

#: Unit roundoff of bfloat16 (8 significant bits) and of float32.
U_BF16 = 2.0 ** -8
U_F32 = 2.0 ** -24


def _kernels():
    from tf_sparse_split import _kernels as k
    return k


def _operands(rng, m, k, n, sparsity, transpose_a):
    """op(a) [m, k] with `sparsity` zeros (at least one nonzero), b [k, n],
    both exactly representable in bfloat16; returns (a, b) as float32 in the
    op's layout."""
    a = random_sparse((m, k), sparsity, rng, np.float32)
    if not np.any(a):
        a[rng.integers(m), rng.integers(k)] = 1.5
    a = tf.cast(tf.cast(a, tf.bfloat16), tf.float32).numpy()
    b = tf.cast(tf.cast(rng.standard_normal((k, n)), tf.bfloat16),
                tf.float32).numpy()
    return (a.T.copy() if transpose_a else a), b


def _bits(x):
    return tf.bitcast(tf.cast(tf.constant(x, tf.float32), tf.bfloat16),
                      tf.uint16).numpy()


def _check_float64(got, a_op, b):
    """|got - ref| <= 2 (u_bf16 |ref| + gamma_k (|a| @ |b|))."""
    a64, b64 = a_op.astype(np.float64), b.astype(np.float64)
    k = a64.shape[1]
    gamma = k * U_F32 / (1.0 - k * U_F32)
    ref = a64 @ b64
    tol = 2.0 * (U_BF16 * np.abs(ref) + gamma * (np.abs(a64) @ np.abs(b64)))
    err = np.abs(got.astype(np.float64) - ref)
    assert np.all(err <= tol + 1e-300), float(np.max(err - tol))


CASES = [
    # (m, k, n, sparsity): the MLP's hidden products (dot packed at 90-98%,
    # dot at 99%), odd sizes around the 32/128/256-column blocks, a narrow
    # output (packed kernel), and rows with a single nonzero.
    (128, 2048, 2048, 0.90), (128, 2048, 2048, 0.95), (64, 2048, 512, 0.98),
    (13, 1000, 257, 0.99), (7, 300, 33, 0.9), (33, 129, 130, 0.95),
    (50, 700, 7, 0.95), (1, 13, 64, 0.5),
]


@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("m,k,n,sparsity", CASES)
def test_forced_sparse_matches_kernel_and_float64(m, k, n, sparsity,
                                                  transpose_a):
    rng = np.random.default_rng(hash((m, k, n, sparsity, transpose_a)) % 2**32)
    a, b = _operands(rng, m, k, n, sparsity, transpose_a)
    at = tf.cast(tf.constant(a), tf.bfloat16)
    bt = tf.cast(tf.constant(b), tf.bfloat16)
    a_op = a.T if transpose_a else a

    @tf.function
    def graph(x, w):
        return tfss.sparse_split_matmul(x, w, 1.0, transpose_a=transpose_a,
                                        return_stats=True)

    for out, st in (tfss.sparse_split_matmul(at, bt, 1.0,
                                             transpose_a=transpose_a,
                                             return_stats=True),
                    graph(at, bt)):
        assert out.dtype == tf.bfloat16 and out.shape == (m, n)
        st = st.numpy()
        assert st[S.ROWS_SPARSE] == m and st[S.ROWS_DENSE] == 0
        assert st[S.NNZ_SPARSE] == np.count_nonzero(a)
        got_bits = tf.bitcast(out, tf.uint16).numpy()
        kernel_bits = _kernels().lowp_spmm(_bits(a), _bits(b), "bfloat16",
                                           transpose_a, threads=2)
        np.testing.assert_array_equal(got_bits, kernel_bits)
        _check_float64(tf.cast(out, tf.float64).numpy(), a_op, b)


@pytest.mark.parametrize("transpose_a", [False, True])
def test_split_rows_equal_all_sparse_rows(transpose_a):
    """Mixed row densities at a split threshold: the sparse rows carry the
    all-sparse call's bits, the dense rows TF's MatMul's (within the
    float64 bound)."""
    rng = np.random.default_rng(7)
    m, k, n = 96, 1024, 384
    a = random_sparse((m, k), 0.95, rng, np.float32)
    dense_rows = rng.choice(m, size=24, replace=False)
    a[dense_rows] = rng.standard_normal((24, k)) * (rng.random((24, k)) < 0.6)
    a = tf.cast(tf.cast(a, tf.bfloat16), tf.float32).numpy()
    b = tf.cast(tf.cast(rng.standard_normal((k, n)), tf.bfloat16),
                tf.float32).numpy()
    phys = a.T.copy() if transpose_a else a
    at = tf.cast(tf.constant(phys), tf.bfloat16)
    bt = tf.cast(tf.constant(b), tf.bfloat16)
    split, st = tfss.sparse_split_matmul(at, bt, 0.3, transpose_a=transpose_a,
                                         return_stats=True)
    st = st.numpy()
    assert st[S.ROWS_DENSE] == 24 and st[S.ROWS_SPARSE] == m - 24
    sparse_only = tfss.sparse_split_matmul(at, bt, 1.0,
                                           transpose_a=transpose_a)
    sb = tf.bitcast(split, tf.uint16).numpy()
    ab = tf.bitcast(sparse_only, tf.uint16).numpy()
    is_sparse = np.ones(m, bool)
    is_sparse[dense_rows] = False
    np.testing.assert_array_equal(sb[is_sparse], ab[is_sparse])
    _check_float64(tf.cast(split, tf.float64).numpy(), a, b)


def test_kernel_choice_of_the_mlp_products():
    """The kernels the op's sparse path takes on the MLP's hidden products
    (the rule, on any CPU): dot packed at 90-98% zeros, dot at 99%."""
    choose = _kernels().bf16_spmm_kernel
    for sparsity, want in ((0.90, "dot_packed"), (0.95, "dot_packed"),
                           (0.98, "dot_packed"), (0.995, "dot")):
        nnz = int(round(128 * 2048 * (1 - sparsity)))
        for ratio in (0.5, 2.0):   # Sapphire Rapids, Zen 4
            assert choose(128, 2048, 2048, nnz, dot=True,
                          dot_rate_ratio=ratio) == want, (sparsity, ratio)
