// SDDMM (sampled dense-dense product) on a CSR pattern or a dense mask,
// and the masked row copy that is the SDDMM op's dense path.
//
// Terms as in sparse_matmul.h: op(a) is the [m, k] activation operand, a
// row-major [m, k] matrix (transpose_a = false) or a row-major [k, m] one
// read transposed (transpose_a = true); "row i" is row i of op(a).
#ifndef TF_SPARSE_SPLIT_CC_CORE_SDDMM_H_
#define TF_SPARSE_SPLIT_CC_CORE_SDDMM_H_

#include <cstdint>

#include "cc/core/csr.h"
#include "cc/core/parallel_for.h"

namespace tf_sparse_split {

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

}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_CORE_SDDMM_H_
