// Nonzero counting: per-row and per-column nnz of op(a), in one pass
// over all of a or over a strided sample of its physical rows.
//
// Terms as in sparse_matmul.h: op(a) is the [m, k] activation operand, a
// row-major [m, k] matrix (transpose_a = false) or a row-major [k, m] one
// read transposed (transpose_a = true); "row i" is row i of op(a).
#ifndef TF_SPARSE_SPLIT_CC_CORE_COUNT_H_
#define TF_SPARSE_SPLIT_CC_CORE_COUNT_H_

#include <cstdint>

#include "cc/core/parallel_for.h"

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

}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_CORE_COUNT_H_
