"""Layer-1 kernels through the pybind11 module, against numpy in float64."""

import numpy as np
import pytest
from _helpers import kernels_or_skip

from tf_sparse_split.testing import random_sparse, relative_error

K = kernels_or_skip()
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


# --- Fast CSR build, tiled SpMM, transposed build ---

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (13, 7), (16, 16), (17, 33), (1000, 7),
                                   (7, 1000), (100, 130)])
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.97, 1.0])
@pytest.mark.parametrize("transpose", [False, True])
def test_csr_build_odd_shapes(dtype, shape, sparsity, transpose):
    # Row segments shorter than / not a multiple of a vector, and tiles of the
    # transposed build cut at both edges; the few-nonzeros and the dense tile
    # paths of the transposed build are both hit (0.97 vs 0.0/0.5).
    rng = np.random.default_rng([shape[0], shape[1], int(sparsity * 100), transpose])
    a = random_sparse(shape, sparsity, rng, dtype)
    op_a = a.T if transpose else a
    indptr, indices, data, shp = K.csr_from_dense(a, transpose=transpose, threads=2)
    assert shp == op_a.shape
    assert indices.dtype == np.int32 and data.dtype == dtype
    assert indptr[-1] == np.count_nonzero(a) == len(indices) == len(data)
    for i in range(shp[0]):
        seg = slice(indptr[i], indptr[i + 1])
        want = np.flatnonzero(op_a[i])
        np.testing.assert_array_equal(indices[seg], want)
        np.testing.assert_array_equal(data[seg], op_a[i, want])


@pytest.mark.parametrize("transpose", [False, True])
def test_csr_build_keeps_nan_inf(transpose):
    a = np.zeros((19, 37), np.float32)
    a[3, 5], a[3, 6], a[18, 36], a[0, 0] = np.nan, np.inf, -np.inf, -0.0  # -0.0 == 0
    indptr, indices, data, _ = K.csr_from_dense(a, transpose=transpose)
    assert len(data) == 3
    assert np.isnan(data).sum() == 1 and np.isinf(data).sum() == 2


@pytest.mark.parametrize("n", [1, 2, 7, 10, 16, 17, 33, 64, 65, 100, 257])
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9, 1.0])
def test_csr_spmm_small_and_odd_n(n, sparsity):
    # Narrow panels (1 or 2 vectors, zero-padded), the tail panel of a wide
    # product, and the shared pack of B (several row groups, small B).
    rng = np.random.default_rng([n, int(sparsity * 10)])
    a = random_sparse((300, 257), sparsity, rng)
    b = rng.standard_normal((257, n)).astype(np.float32)
    h = K.csr_matrix(a, threads=2)
    assert h.shape == (300, 257) and h.nnz == np.count_nonzero(a)
    got = h.spmm(b, threads=2)
    assert got.shape == (300, n) and got.dtype == np.float32
    ref = a.astype(np.float64) @ b.astype(np.float64)
    assert relative_error(got, ref) <= 1e-5
    if sparsity == 1.0:
        assert np.all(got == 0)


@pytest.mark.parametrize("m,n", [(1, 64), (8, 200), (32, 2048), (5, 7)])
def test_csr_spmm_reading_b_in_place_gives_the_packed_bits(m, n):
    # Under one nonzero per row of B on average, the float32 SpMM reads B
    # in place (full column panels; a narrow tail panel is still packed);
    # the same rows inside a denser product (B packed) give the same bits:
    # each output is its ascending-k sum either way.
    rng = np.random.default_rng([m, n])
    k = 2048
    low = random_sparse((m, k), 0.99, rng)
    low[0, [0, 5, k - 1]] = [1.5, -2.0, 0.25]   # real nonzeros in every row
    assert np.count_nonzero(low) < k             # the in-place regime
    b = rng.standard_normal((k, n)).astype(np.float32)
    direct = K.csr_matrix(low).spmm(b, threads=2)
    dense_rows = random_sparse((64, k), 0.5, rng)
    packed = K.csr_matrix(np.vstack([low, dense_rows])).spmm(b, threads=2)
    np.testing.assert_array_equal(direct, packed[:m])
    ref = low.astype(np.float64) @ b.astype(np.float64)
    assert relative_error(direct, ref) <= 1e-5


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("m,k,n,sparsity", [(8, 2048, 2048, 0.6), (32, 2048, 2048, 0.92),
                                            (32, 784, 2048, 0.82), (64, 700, 300, 0.8),
                                            (3, 1000, 64, 0.5), (33, 513, 1000, 0.95)])
def test_csr_spmm_slab_kernel_gives_the_panel_bits(dtype, m, k, n, sparsity):
    # A few rows with one to eight nonzeros per row of B go through the slab
    # kernel (each K block of B packed for four full panels at once, a
    # narrow tail panel by itself); the same rows under a tall stack of
    # other rows (a row group past kSlabMaxRows: one panel per tile) give
    # the same bits, NaN and inf included.
    rng = np.random.default_rng([m, k, n, int(sparsity * 100)])
    a = random_sparse((m, k), sparsity, rng, dtype)
    assert np.count_nonzero(a) >= k             # packed, not B in place
    b = rng.standard_normal((k, n)).astype(dtype)
    b[5, 3], b[k - 1, n - 1] = np.nan, np.inf
    slab = K.csr_matrix(a).spmm(b, threads=2)
    tall = np.vstack([a, random_sparse((300, k), 0.5, rng, dtype)])
    panel = K.csr_matrix(tall).spmm(b, threads=2)
    np.testing.assert_array_equal(slab, panel[:m])
    finite = np.isfinite(b).all(axis=1)
    ref = a[:, finite].astype(np.float64) @ b[finite].astype(np.float64)
    rows = ~(a[:, ~finite] != 0).any(axis=1)
    assert relative_error(slab[rows], ref[rows]) <= (1e-5 if dtype == np.float32 else 1e-12)
    assert np.isnan(slab[a[:, 5] != 0, 3]).all()


@pytest.mark.parametrize("sparsity", [0.5, 0.99])
def test_csr_spmm_k_blocks_and_empty_rows(sparsity):
    # k large enough for several K blocks; rows empty in the first block,
    # rows entirely zero, an odd number of rows (the two-row kernel's tail).
    rng = np.random.default_rng(7)
    a = random_sparse((101, 5000), sparsity, rng)
    a[:, :1000] = 0.0   # nothing in the first block(s)
    a[[0, 50, 100]] = 0.0
    b = rng.standard_normal((5000, 70)).astype(np.float32)
    got = K.csr_matrix(a).spmm(b)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    assert relative_error(got, ref) <= 1e-5
    assert np.all(got[[0, 50, 100]] == 0)


@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (7, 13, 5), (13, 1000, 7), (1000, 13, 64),
                                   (300, 200, 130)])
@pytest.mark.parametrize("sparsity", [0.0, 0.7, 0.99])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_transposed_spmm(m, k, n, sparsity, dtype):
    # The weight-gradient path: op(a) = a^T from the physical [m, k] matrix,
    # times dY [m, n].
    rng = np.random.default_rng([m, k, n, int(sparsity * 100)])
    a = random_sparse((m, k), sparsity, rng, dtype)
    dy = rng.standard_normal((m, n)).astype(dtype)
    h = K.csr_matrix(a, transpose=True, threads=2)
    assert h.shape == (k, m)
    got = h.spmm(dy, threads=2)
    ref = a.T.astype(np.float64) @ dy.astype(np.float64)
    assert relative_error(got, ref) <= (1e-5 if dtype == np.float32 else 1e-12)


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("shape,n", [((300, 2000), 300), ((512, 2048), 10), ((64, 4096), 1)])
def test_deterministic_bits_across_threads(transpose, shape, n):
    rng = np.random.default_rng(3)
    a = random_sparse(shape, 0.8, rng)
    rows = shape[1] if transpose else shape[0]
    inner = shape[0] if transpose else shape[1]
    b = rng.standard_normal((inner, n)).astype(np.float32)
    one = K.csr_matrix(a, transpose=transpose, threads=1).spmm(b, threads=1)
    assert one.shape == (rows, n)
    for t in (2, 3, 5):
        h = K.csr_matrix(a, transpose=transpose, threads=t)
        np.testing.assert_array_equal(h.spmm(b, threads=t), one)


def test_spmm_nan_inf_propagate():
    # NaN/Inf in a propagate to their output rows; zeros of a skip b entirely
    # (0 * Inf in b is not turned into NaN, as in tf.sparse).
    rng = np.random.default_rng(5)
    a = random_sparse((40, 50), 0.5, rng)
    a[3, :] = 0.0
    a[3, 7] = np.nan
    a[5, :] = 0.0
    a[5, 9] = np.inf
    b = rng.uniform(0.5, 1.0, (50, 20)).astype(np.float32)
    b[11, :] = np.inf
    a[:, 11] = 0.0
    got = K.csr_matrix(a).spmm(b)
    assert np.all(np.isnan(got[3]))
    assert np.all(np.isposinf(got[5]))
    others = np.delete(np.arange(40), [3, 5])
    assert np.all(np.isfinite(got[others]))
    ref = a[others].astype(np.float64) @ np.where(np.isinf(b), 0, b).astype(np.float64)
    assert relative_error(got[others], ref) <= 1e-5


def test_csr_matrix_bad_arguments():
    h = K.csr_matrix(np.ones((3, 4), np.float32))
    with pytest.raises(ValueError, match="4 rows"):
        h.spmm(np.ones((5, 2), np.float32))
    with pytest.raises(ValueError, match="2-D"):
        K.csr_matrix(np.ones(3, np.float32))


def test_parallel_copy():
    x = np.random.default_rng(0).standard_normal((123, 457)).astype(np.float32)
    np.testing.assert_array_equal(K.parallel_copy(x, threads=3), x)


@pytest.mark.parametrize("transpose", [False, True])
def test_csr_matrix_rebuild_reuses_and_matches(transpose):
    rng = np.random.default_rng(11)
    a1 = random_sparse((70, 90), 0.3, rng)
    a2 = random_sparse((50, 40), 0.9, rng)  # smaller: arrays shrink in place
    h = K.csr_matrix(a1, transpose=transpose)
    h.rebuild(a2, transpose=transpose)
    op = a2.T if transpose else a2
    assert h.shape == op.shape and h.nnz == np.count_nonzero(a2)
    b = rng.standard_normal((op.shape[1], 9)).astype(np.float32)
    np.testing.assert_array_equal(h.spmm(b), K.csr_matrix(a2, transpose=transpose).spmm(b))
    assert relative_error(h.spmm(b), op.astype(np.float64) @ b) <= 1e-5
