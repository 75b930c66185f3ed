// The CSR format of the sparse rows of op(a) and its build from the dense
// layout (row-major or read transposed).
//
// Terms as in sparse_matmul.h: op(a) is the [m, k] activation operand, a
// row-major [m, k] matrix (transpose_a = false) or a row-major [k, m] one
// read transposed (transpose_a = true); "row i" is row i of op(a).
#ifndef TF_SPARSE_SPLIT_CC_CORE_CSR_H_
#define TF_SPARSE_SPLIT_CC_CORE_CSR_H_

#include <cstdint>

#include "cc/core/parallel_for.h"
#include "cc/core/uninit_vector.h"

namespace tf_sparse_split {

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
// transpose_a, 16 x 16 tiles of the physical matrix (32 x 32 for 16-bit
// values, at a density of 1/32 or more) are transposed in registers and
// their columns packed straight into the CSR rows of op(a),
// walking the physical rows in order (contiguous reads); each thread owns a
// range of op(a) rows, so the result does not depend on the thread count.
template <typename T>
void BuildCsr(const T* a, int64_t phys_rows, int64_t phys_cols,
              bool transpose_a, const int64_t* rows, int64_t n_rows,
              const int64_t* row_nnz, const int64_t* col_nnz, Csr<T>* csr,
              const ParallelFor& pfor);

}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_CORE_CSR_H_
