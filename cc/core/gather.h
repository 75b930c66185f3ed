// Gathers and scatters of rows and columns: the submatrix of op(a) that a
// dense GEMM gets (transposed in 16 x 16 register tiles where op(a) is read
// transposed), the scatter of its result rows, and zeroed output rows.
//
// Terms as in sparse_matmul.h: op(a) is the [m, k] activation operand, a
// row-major [m, k] matrix (transpose_a = false) or a row-major [k, m] one
// read transposed (transpose_a = true); "row i" is row i of op(a).
#ifndef TF_SPARSE_SPLIT_CC_CORE_GATHER_H_
#define TF_SPARSE_SPLIT_CC_CORE_GATHER_H_

#include <cstdint>

#include "cc/core/parallel_for.h"

namespace tf_sparse_split {

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

#endif  // TF_SPARSE_SPLIT_CC_CORE_GATHER_H_
