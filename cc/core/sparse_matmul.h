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
//
// This umbrella header includes the kernel families, one header each:
//   count.h   CountNonzeros, CountNonzerosStrided (per-row/column nnz)
//   csr.h     Csr, BuildCsr (CSR of selected rows of op(a))
//   spmm.h    CsrSpmm (CSR x dense)
//   sddmm.h   CsrSddmm, Sddmm, MaskedCopyRows (sampled dense-dense product)
//   gather.h  GatherSubmatrix, ScatterRows, ZeroRows (dense-part copies)
// and the thread-pool hook (parallel_for.h) and statistics layout (stats.h).
#ifndef TF_SPARSE_SPLIT_CC_CORE_SPARSE_MATMUL_H_
#define TF_SPARSE_SPLIT_CC_CORE_SPARSE_MATMUL_H_

#include "cc/core/count.h"
#include "cc/core/csr.h"
#include "cc/core/gather.h"
#include "cc/core/parallel_for.h"
#include "cc/core/sddmm.h"
#include "cc/core/spmm.h"
#include "cc/core/stats.h"
#include "cc/core/uninit_vector.h"

#endif  // TF_SPARSE_SPLIT_CC_CORE_SPARSE_MATMUL_H_
