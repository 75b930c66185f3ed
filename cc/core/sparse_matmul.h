// Framework-free CPU kernels behind SparseSplitMatMul (layer 1 of docs/ARCHITECTURE.md).
//
// No TensorFlow headers here: plain pointers, sizes and strides, and a
// ParallelFor hook through which the caller supplies its thread pool (TF's
// intra-op pool in the op, a std::thread pool in the pybind11 module).
//
// Terms. The *activation operand* is op(a), an [m, k] matrix stored either
// row-major as a[m][k] (transpose_a = false) or as the row-major [k, m] matrix
// a, read transposed (transpose_a = true). "Row i" always means row i of
// op(a). Density of a row = nnz(row) / k; sparsity = 1 - density.
//
// Method (K.-Y. Peng, "Adaptive runtime exploiting sparsity in tensor of deep
// learning on heterogeneous systems", NTU 2017): measure the zeros of op(a) at
// run time, send rows above a density threshold to a dense GEMM and the rest to
// a CSR SpMM, and skip all-zero columns of op(a) (with the matching rows of
// op(b)) outright.
#ifndef TF_SPARSE_SPLIT_CC_CORE_SPARSE_MATMUL_H_
#define TF_SPARSE_SPLIT_CC_CORE_SPARSE_MATMUL_H_

#include <cstdint>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

#include "cc/core/parallel_for.h"
#include "cc/core/stats.h"

namespace tf_sparse_split {

// Per-row and per-column nonzero counts of op(a) in one pass over a.
//   a:            the physical matrix, row-major, phys_rows x phys_cols
//                 (= [m, k] if !transpose_a, [k, m] if transpose_a).
//   row_nnz[m]:   out, nonzeros of each row of op(a).
//   col_nnz[k]:   out, nonzeros of each column of op(a).
// NaN and Inf count as nonzero (they are not == 0). Returns total nnz.
template <typename T>
int64_t CountNonzeros(const T* a, int64_t phys_rows, int64_t phys_cols,
                      bool transpose_a, int64_t* row_nnz, int64_t* col_nnz,
                      const ParallelFor& pfor);

// CountNonzeros of the physical rows 0, stride, 2*stride, ... of a (a
// strided sample: rows_s = ceil(phys_rows / stride) of them), as if those
// rows were the whole matrix: with !transpose_a, row_nnz[rows_s] are the
// sampled rows' counts and col_nnz[phys_cols] the columns' counts over
// them; with transpose_a, row_nnz[phys_cols] counts each row of op(a) over
// the rows_s sampled columns and col_nnz[rows_s] the sampled columns'
// counts. Returns the sample's nnz. stride <= 1 counts everything.
template <typename T>
int64_t CountNonzerosStrided(const T* a, int64_t phys_rows, int64_t phys_cols,
                             int64_t stride, bool transpose_a,
                             int64_t* row_nnz, int64_t* col_nnz,
                             const ParallelFor& pfor);

// std::allocator whose value-less construct() default-initialises: resize()
// of a vector of ints or floats leaves the new elements unwritten instead of
// zeroing them (the CSR build overwrites every entry anyway; zeroing was a
// whole extra write pass over the arrays).
template <typename T>
struct DefaultInitAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  DefaultInitAllocator() = default;
  template <typename U>
  DefaultInitAllocator(const DefaultInitAllocator<U>&) noexcept {}
  template <typename U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible<U>::value) {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

// A vector whose resize() does not zero new elements (see above).
template <typename T>
using UninitVector = std::vector<T, DefaultInitAllocator<T>>;

// A CSR matrix over a subset of rows of op(a), column indices in op(a)'s
// column space (uncompacted), ascending within each row.
template <typename T>
struct Csr {
  UninitVector<int64_t> row_ptr;  // [n_rows + 1]
  UninitVector<int32_t> col_idx;  // [nnz]
  UninitVector<T> values;         // [nnz]
};

// Builds the CSR of rows `rows[0..n_rows)` of op(a) (each index in [0, m)).
// row_nnz[m] and col_nnz[k] must be CountNonzeros' outputs for the same a
// (col_nnz may be null). Rows appear in the CSR in the order given; column
// indices ascend within each row. Cost: one read of the selected part of a
// plus the CSR writes (no compress-store instructions: AVX-512 lanes are
// packed by a mask-indexed permutation and a masked store). With
// transpose_a, 16 x 16 tiles of the physical matrix are transposed in
// registers and their columns packed straight into the CSR rows of op(a),
// walking the physical rows in order (contiguous reads); each thread owns a
// range of op(a) rows, so the result does not depend on the thread count.
template <typename T>
void BuildCsr(const T* a, int64_t phys_rows, int64_t phys_cols,
              bool transpose_a, const int64_t* rows, int64_t n_rows,
              const int64_t* row_nnz, const int64_t* col_nnz, Csr<T>* csr,
              const ParallelFor& pfor);

// CSR SpMM: for r in [0, n_rows): c[out_rows[r], :] = csr.row(r) * b,
// where b is a dense row-major [k, n] matrix with leading dimension ldb and
// c a row-major matrix with leading dimension ldc (rows out_rows[r] are
// overwritten, other rows untouched). Column indices must ascend within each
// row (BuildCsr's output does).
// Method: the output is cut into 256-byte column panels (narrower kernels
// for n < 64 floats) and row groups; a tile (panel, row group) walks K in
// blocks whose rows of b are packed into a 64-byte-aligned buffer (~32 KB,
// L1, at high density; deeper blocks at low density so that a row meets
// several nonzeros per visit); two rows are processed at a time, each
// keeping its output segment in vector registers. When b is small (<= 1 MB)
// and several row groups share a panel, b is packed once per call instead.
// The summation order of each output is ascending k whatever the tiling or
// thread count (deterministic bits). NaN/Inf in the CSR values propagate;
// entries of b are only read where op(a) has a nonzero (0 * Inf in b gives
// no NaN, as in tf.sparse).
template <typename T>
void CsrSpmm(const Csr<T>& csr, const int64_t* out_rows, int64_t n_rows,
             const T* b, int64_t k, int64_t n, int64_t ldb, T* c,
             int64_t ldc, const ParallelFor& pfor);

// CSR SDDMM (sampled dense-dense product): for r in [0, n_rows), row
// out_rows[r] of the row-major out (leading dimension ldo, k columns) is
// overwritten with
//   out[out_rows[r], j] = dot(x[out_rows[r], 0..n), y[j, 0..n))  where row r
//                          of csr has column j,  0 elsewhere,
// x row-major with leading dimension ldx, y row-major [k, n] with leading
// dimension ldy. Only the pattern of csr is used, not its values. Cost is
// proportional to nnz(csr) * n plus one pass over the output rows. Used for
// dA = dY * op(b)^T when a came through a ReLU-family activation (its
// gradient is zero wherever a is).
// Method: the CSR is transposed (counting sort, O(nnz + k)) so that the
// nonzeros are walked column by column: each row y[j] is read from memory
// once and kept in L1 while the dots with the rows of x of column j (x is
// reused across columns from L2) run four at a time, one AVX-512 accumulator
// pair per dot. Every dot sums its n products in the same fixed order
// (lane-wise over 32-value chunks, then a fixed reduction tree) whatever the
// tiling or thread count: deterministic bits. NaN/Inf in x or y propagate
// into the dots that read them.
template <typename T>
void CsrSddmm(const Csr<T>& csr, const int64_t* out_rows, int64_t n_rows,
              const T* x, int64_t ldx, const T* y, int64_t ldy, int64_t k,
              int64_t n, T* out, int64_t ldo, const ParallelFor& pfor);

// SDDMM with a dense mask: out[i, j] = mask[i, j] != 0 ? dot(x[i, :],
// y[j, :]) : 0 for the row-major mask [m, k], x [m, n], y [k, n]; out is
// [m, k] row-major. Counts the mask, builds its CSR and runs CsrSddmm.
template <typename T>
void Sddmm(const T* mask, const T* x, const T* y, int64_t m, int64_t k,
           int64_t n, T* out, const ParallelFor& pfor);

// Masked row copy: for r in [0, n_rows), with i = rows ? rows[r] : r,
//   out[i * ldo + j] = mask[i * k + j] != 0 ? src[r * k + j] : 0,  j < k.
// src may equal out when rows is null and ldo == k (in place). The dense
// path of the SDDMM op: a GEMM's rows restricted to the mask's pattern.
template <typename T>
void MaskedCopyRows(const T* mask, int64_t k, const int64_t* rows,
                    int64_t n_rows, const T* src, T* out, int64_t ldo,
                    const ParallelFor& pfor);

// Gathers rows `rows[0..n_rows)` and columns `cols[0..n_cols)` of op(a) into
// the row-major [n_rows, n_cols] matrix out. A null `rows` means all m rows
// in order; a null `cols` means all k columns in order.
template <typename T>
void GatherSubmatrix(const T* a, int64_t phys_rows, int64_t phys_cols,
                     bool transpose_a, const int64_t* rows, int64_t n_rows,
                     const int64_t* cols, int64_t n_cols, T* out,
                     const ParallelFor& pfor);

// Scatters the row-major [n_rows, n] matrix src into rows out_rows[r] of the
// row-major matrix c (leading dimension ldc).
template <typename T>
void ScatterRows(const T* src, const int64_t* out_rows, int64_t n_rows,
                 int64_t n, T* c, int64_t ldc, const ParallelFor& pfor);

// Zeroes rows out_rows[0..n_rows) of the row-major c (n columns, ldc).
template <typename T>
void ZeroRows(const int64_t* out_rows, int64_t n_rows, int64_t n, T* c,
              int64_t ldc, const ParallelFor& pfor);

}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_CORE_SPARSE_MATMUL_H_
