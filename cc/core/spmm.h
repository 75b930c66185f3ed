// CSR SpMM: the sparse rows of op(a), in CSR, times a dense row-major
// matrix.
//
// Terms as in sparse_matmul.h: op(a) is the [m, k] activation operand, a
// row-major [m, k] matrix (transpose_a = false) or a row-major [k, m] one
// read transposed (transpose_a = true); "row i" is row i of op(a).
#ifndef TF_SPARSE_SPLIT_CC_CORE_SPMM_H_
#define TF_SPARSE_SPLIT_CC_CORE_SPMM_H_

#include <cstdint>

#include "cc/core/csr.h"
#include "cc/core/parallel_for.h"

namespace tf_sparse_split {

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

// The two bfloat16 kernels of CsrSpmm (identical bits): kPacked widens
// each K block of B into a float32 pack and runs memory-operand FMAs on it
// (its cost has k * n and n_rows * n terms whatever the sparsity: the
// pack, a float32 buffer of the output); kDirect widens B's
// values in registers as each nonzero uses them (cost ~ nnz * n, about
// twice the packed kernel's per product).
enum class Bf16SpmmKernel { kPacked = 0, kDirect = 1 };

// The direct kernel is taken up to nnz = kDirectNnzPerK * k +
// kDirectNnzPerRow * n_rows nonzeros (fitted to measured crossovers, see
// ChooseBf16SpmmKernel in spmm.cc).
constexpr int64_t kDirectNnzPerK = 3;
constexpr int64_t kDirectNnzPerRow = 16;

// The kernel a bfloat16 CsrSpmm of n_rows x k (nnz nonzeros) times k x n
// takes: forced (ForceBf16SpmmKernel), else kDirect for n >= 32 and
// nnz <= kDirectNnzPerK * k + kDirectNnzPerRow * n_rows.
Bf16SpmmKernel ChooseBf16SpmmKernel(int64_t n_rows, int64_t k, int64_t n,
                                    int64_t nnz);

// Forces the bfloat16 kernel (0 packed, 1 direct); a negative value
// restores the choice above. Not thread-safe with running kernels: for
// tests and benchmarks.
void ForceBf16SpmmKernel(int kernel);

}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_CORE_SPMM_H_
