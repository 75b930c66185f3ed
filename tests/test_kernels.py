"""Layer-1 kernels through the pybind11 module, against numpy in float64."""

import numpy as np
import pytest

from tf_sparse_split._loader import kernels
from tf_sparse_split.testing import random_sparse, relative_error

K = kernels()
SHAPES = [(1, 1, 1), (7, 13, 5), (1000, 3, 17), (65, 300, 130), (128, 1024, 256)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9, 0.99, 1.0])
@pytest.mark.parametrize("transpose", [False, True])
def test_counts_and_csr(dtype, sparsity, transpose):
    rng = np.random.default_rng(int(sparsity * 100) + transpose)
    a = random_sparse((37, 53), sparsity, rng, dtype)
    op_a = a.T if transpose else a
    rows, cols, nnz = K.row_col_nnz(a, transpose=transpose)
    np.testing.assert_array_equal(rows, np.count_nonzero(op_a, axis=1))
    np.testing.assert_array_equal(cols, np.count_nonzero(op_a, axis=0))
    assert nnz == np.count_nonzero(a)
    indptr, indices, data, shape = K.csr_from_dense(a, transpose=transpose)
    assert shape == op_a.shape
    dense = np.zeros(op_a.shape, dtype)
    for i in range(shape[0]):
        seg = slice(indptr[i], indptr[i + 1])
        assert np.all(np.diff(indices[seg]) > 0)  # ascending, no duplicates
        dense[i, indices[seg]] = data[seg]
    np.testing.assert_array_equal(dense, op_a)


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_csr_spmm(m, k, n, sparsity, threads):
    rng = np.random.default_rng([m, k, n, threads])
    a = random_sparse((m, k), sparsity, rng)
    b = rng.standard_normal((k, n)).astype(np.float32)
    indptr, indices, data, _ = K.csr_from_dense(a)
    got = K.csr_spmm(indptr, indices, data, b, threads=threads)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    assert relative_error(got, ref) <= 1e-5


def test_csr_spmm_deterministic_across_threads():
    rng = np.random.default_rng(0)
    a = random_sparse((300, 2000), 0.9, rng)
    b = rng.standard_normal((2000, 300)).astype(np.float32)
    csr = K.csr_from_dense(a)[:3]
    one = K.csr_spmm(*csr, b, threads=1)
    for t in (2, 3, 4):
        np.testing.assert_array_equal(K.csr_spmm(*csr, b, threads=t), one)


def test_csr_spmm_float64():
    rng = np.random.default_rng(1)
    a = random_sparse((50, 70), 0.8, rng, np.float64)
    b = rng.standard_normal((70, 90))
    got = K.csr_spmm(*K.csr_from_dense(a)[:3], b)
    assert got.dtype == np.float64
    assert relative_error(got, a @ b) <= 1e-12


@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (7, 13, 5), (40, 60, 33)])
def test_sddmm(m, k, n):
    rng = np.random.default_rng([m, k, n])
    mask = random_sparse((m, k), 0.7, rng)
    x = rng.standard_normal((m, n)).astype(np.float32)
    y = rng.standard_normal((k, n)).astype(np.float32)
    ref = np.where(mask != 0, x.astype(np.float64) @ y.T.astype(np.float64), 0.0)
    assert relative_error(K.sddmm(mask, x, y), ref) <= 1e-5


def test_bad_arguments():
    b = np.ones((4, 3), np.float32)
    with pytest.raises(ValueError, match="out of range"):
        K.csr_spmm(np.array([0, 1]), np.array([9], np.int32), np.array([1.0], np.float32), b)
    with pytest.raises(ValueError, match="indptr"):
        K.csr_spmm(np.array([0, 2]), np.array([1], np.int32), np.array([1.0], np.float32), b)
    with pytest.raises(ValueError, match="ascending"):
        K.csr_spmm(np.array([0, 2]), np.array([2, 1], np.int32),
                   np.array([1.0, 2.0], np.float32), b)
    with pytest.raises(ValueError, match="2-D"):
        K.row_col_nnz(np.ones(3, np.float32))
    with pytest.raises(ValueError, match="shapes"):
        K.sddmm(np.ones((2, 3), np.float32), np.ones((2, 4), np.float32), np.ones((2, 4), np.float32))
