// CUDA kernels behind SparseSplitMatMul (layer 1 of docs/ARCHITECTURE.md, GPU side).
//
// Framework-free: no TensorFlow headers. Every pointer argument is a DEVICE
// pointer unless stated otherwise; sizes are host int64 values; work is
// enqueued on the cudaStream_t passed in (nothing synchronises the host), and
// each function returns the first cudaError_t it meets (cudaSuccess, or
// cudaErrorInvalidValue for bad arguments, or a launch/CUB error). Each
// kernel launch is followed by cudaGetLastError(). Functions that need
// scratch memory take a caller-supplied workspace (so the TF op can allocate
// it through TF's allocator) and have a *WorkspaceBytes query beside them.
//
// Method (K.-Y. Peng, "Adaptive runtime exploiting sparsity in tensor of deep
// learning on heterogeneous systems", NTU 2017): measure the zeros of the
// activation operand op(a) at run time, send rows above a density threshold
// to a dense GEMM (cuBLAS, not here) and the rest to a CSR SpMM, and skip
// all-zero columns of op(a) (with the matching rows of op(b)) outright. The
// backward pass reuses the forward CSR: dW = op(a)^T * dY via a CSC built by
// a stable transposition (no atomics, bitwise deterministic), and
// dX = (dY * W^T) masked by op(a) != 0 (the ReLU gradient) as an SDDMM.
//
// Terms, as in ../sparse_matmul.h: the activation operand op(a) is an [m, k]
// matrix stored row-major either as a[m][k] (transpose_a = false) or as the
// row-major [k, m] matrix a read transposed (transpose_a = true); "row i"
// means row i of op(a). All dense matrices are row-major.
//
// Element types: every template below is instantiated for float, double,
// __half (IEEE binary16, <cuda_fp16.h>) and __nv_bfloat16 (<cuda_bf16.h>).
// The 16-bit types are storage only, as in the CPU kernels
// (../low_precision.h): products are accumulated in float32 (float64 for
// double) and each output element is rounded once to T, round-to-nearest-
// even (overflow gives +-Inf, NaN stays NaN); copies (CSR values, gathers,
// scatters, the CSC) move the stored bits unchanged. A 16-bit zero test is
// on the bits ((bits & 0x7fff) != 0: +-0 is zero, NaN and Inf are not). The
// only second rounding is the accumulate mode of the SpMM^T, which adds a
// rounded sum to the stored (already rounded) dw. TensorFlow's
// Eigen::bfloat16 / Eigen::half have the same 16-bit layouts, so a TF
// kernel passes their data reinterpreted (static_asserts in
// cc/kernels/sparse_split_matmul_kernels_gpu.cc).
//
// Semantics shared by every kernel here:
//  * NaN and Inf count as nonzero (x != 0 is true for them) and propagate as
//    in a dense product. Where the activation is exactly zero the product is
//    skipped, so 0 * Inf in the other operand does NOT become NaN (as in
//    tf.sparse); this is the one documented difference from a dense GEMM.
//  * Deterministic: every output element is accumulated in a fixed order
//    (ascending k for SpMM, ascending CSR row for SpMM^T -- for small n
//    (<= 64 float / 32 double / 128 16-bit) in P interleaved partial sums combined by a
//    fixed butterfly, P chosen from n --, a fixed lane-strided order plus a
//    fixed butterfly tree for SDDMM), so the same inputs give the same bits
//    on every run. The order depends on the sizes
//    only: not on pointer alignment (which picks 16-byte or scalar loads),
//    leading dimensions or launch geometry. Integer counts use atomics,
//    which are exact and order-independent.
//  * Empty problems (any size 0) are valid: outputs are written as the
//    definitions say (e.g. zeros) and no zero-size grid is ever launched.
//  * Indexing uses int64 wherever a product of sizes can exceed 2^31. CSR
//    column indices (and CSC row indices) are int32, as in the CPU Csr<T>, so
//    k (resp. the CSR row count) must be < 2^31; this is checked.
//
// Build: sparse_matmul.cu.cc is compiled by nvcc (`-x cu`); this header only
// needs the CUDA runtime headers and may be included from plain C++.
#ifndef TF_SPARSE_SPLIT_CC_CORE_CUDA_SPARSE_MATMUL_CUDA_H_
#define TF_SPARSE_SPLIT_CC_CORE_CUDA_SPARSE_MATMUL_CUDA_H_

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

namespace tf_sparse_split {

// A device-resident CSR matrix (read-only view), the GPU twin of Csr<T> in
// ../sparse_matmul.h. Row r of the CSR is some row of op(a) (see
// BuildCsrRowPtrGpu); column indices are in op(a)'s uncompacted column space
// [0, n_cols) and ascending within each row.
template <typename T>
struct GpuCsr {
  const int64_t* row_ptr = nullptr;  // device, [n_rows + 1], row_ptr[0] = 0
  const int32_t* col_idx = nullptr;  // device, [nnz]
  const T* values = nullptr;         // device, [nnz]
  int64_t n_rows = 0;                // rows of the CSR (host value)
  int64_t n_cols = 0;                // columns (k of op(a)) (host value)
  int64_t nnz = 0;                   // host copy of row_ptr[n_rows]
};

// A device-resident CSC matrix (equivalently, the CSR of the transpose):
// column j holds entries col_ptr[j] .. col_ptr[j+1]-1, with row indices (rows
// of the CSR it was built from, i.e. in [0, csr.n_rows)) strictly ascending
// within each column.
template <typename T>
struct GpuCsc {
  const int64_t* col_ptr = nullptr;  // device, [n_cols + 1], col_ptr[0] = 0
  const int32_t* row_idx = nullptr;  // device, [nnz]
  const T* values = nullptr;         // device, [nnz]
  int64_t n_rows = 0;                // host
  int64_t n_cols = 0;                // host
  int64_t nnz = 0;                   // host
};

// ---------------------------------------------------------------------------
// Density statistics.

// Per-row and per-column nonzero counts of op(a) in one pass over a (same
// meaning as CountNonzeros in ../sparse_matmul.h).
//   a:          device, the physical matrix, row-major phys_rows x phys_cols
//               (= [m, k] if !transpose_a, [k, m] if transpose_a).
//   row_nnz:    device out, [m]: nonzeros of each row of op(a).
//   col_nnz:    device out, [k]: nonzeros of each column of op(a).
//   total_nnz:  device out, [1], may be null: nonzeros of a.
// The outputs are fully overwritten (zeroed on the stream first).
template <typename T>
cudaError_t CountNonzerosGpu(const T* a, int64_t phys_rows, int64_t phys_cols,
                             bool transpose_a, int64_t* row_nnz,
                             int64_t* col_nnz, int64_t* total_nnz,
                             cudaStream_t stream);

// ---------------------------------------------------------------------------
// CSR build, in two steps so that the caller can allocate col_idx/values once
// nnz (= row_ptr[n_rows], copied to the host) is known.

// Workspace for BuildCsrRowPtrGpu with n_rows rows (host query, no launch).
cudaError_t BuildCsrRowPtrWorkspaceBytes(int64_t n_rows, size_t* bytes);

// Row offsets of the CSR of rows `rows[0..n_rows)` of op(a), in the order
// given (each index in [0, m)); rows == nullptr means all rows 0..n_rows-1.
//   row_nnz:   device, CountNonzerosGpu's row_nnz for the same a.
//   rows:      device, [n_rows] or null.
//   row_ptr:   device out, [n_rows + 1]: exclusive prefix sum (CUB
//              DeviceScan) of row_nnz[rows[r]]; row_ptr[n_rows] = nnz.
//   workspace: device, >= BuildCsrRowPtrWorkspaceBytes(n_rows) bytes, 256-
//              byte aligned (cudaMalloc alignment).
cudaError_t BuildCsrRowPtrGpu(const int64_t* row_nnz, const int64_t* rows,
                              int64_t n_rows, int64_t* row_ptr,
                              void* workspace, size_t workspace_bytes,
                              cudaStream_t stream);

// Column indices and values of that CSR, ascending within each row.
//   a, phys_rows, phys_cols, transpose_a: as in CountNonzerosGpu.
//   rows, n_rows: as in BuildCsrRowPtrGpu; row_ptr its output.
//   col_idx:   device out, [nnz] int32 column indices in [0, k).
//   values:    device out, [nnz].
// Precondition: row_ptr was built from counts of this same a (otherwise rows
// would overrun their slots). Requires k < 2^31.
template <typename T>
cudaError_t FillCsrGpu(const T* a, int64_t phys_rows, int64_t phys_cols,
                       bool transpose_a, const int64_t* rows, int64_t n_rows,
                       const int64_t* row_ptr, int32_t* col_idx, T* values,
                       cudaStream_t stream);

// ---------------------------------------------------------------------------
// Column compaction and row moves.

// Gathers rows `rows[0..n_rows)` and columns `cols[0..n_cols)` of op(a) into
// the row-major [n_rows, n_cols] matrix out (device). A null `rows` means all
// rows 0..n_rows-1 in order; a null `cols` means columns 0..n_cols-1 in order.
// Index arrays are device arrays of int64 in range (not checked).
template <typename T>
cudaError_t GatherSubmatrixGpu(const T* a, int64_t phys_rows,
                               int64_t phys_cols, bool transpose_a,
                               const int64_t* rows, int64_t n_rows,
                               const int64_t* cols, int64_t n_cols, T* out,
                               cudaStream_t stream);

// Column compaction of a product op(a) * op(b): given the live (not all-zero)
// columns `cols[0..n_cols)` of op(a) (device, int64, e.g. the indices j with
// col_nnz[j] != 0), writes
//   a_out [m, n_cols]  = op(a)[:, cols]   (m = rows of op(a))
//   b_out [n_cols, n]  = op(b)[cols, :]   (op(b) is [k, n]; b is stored
//                        row-major [k, n] if !transpose_b, [n, k] otherwise)
// so that op(a) * op(b) == a_out * b_out exactly (skipped terms are 0 * x).
template <typename T>
cudaError_t CompactColumnsGpu(const T* a, int64_t a_phys_rows,
                              int64_t a_phys_cols, bool transpose_a,
                              const T* b, int64_t b_phys_rows,
                              int64_t b_phys_cols, bool transpose_b,
                              const int64_t* cols, int64_t n_cols, T* a_out,
                              T* b_out, cudaStream_t stream);

// c[out_rows[r], 0:n] = src[r, 0:n] for r in [0, n_rows); src is row-major
// [n_rows, n]; c has leading dimension ldc >= n.
template <typename T>
cudaError_t ScatterRowsGpu(const T* src, const int64_t* out_rows,
                           int64_t n_rows, int64_t n, T* c, int64_t ldc,
                           cudaStream_t stream);

// Zeroes c[out_rows[r], 0:n] for r in [0, n_rows) (ldc >= n).
template <typename T>
cudaError_t ZeroRowsGpu(const int64_t* out_rows, int64_t n_rows, int64_t n,
                        T* c, int64_t ldc, cudaStream_t stream);

// ---------------------------------------------------------------------------
// Products.

// CSR SpMM: for r in [0, csr.n_rows): c[out_rows[r], 0:n] = csr.row(r) * b
// (overwrite; other rows of c untouched; out_rows == nullptr means row r).
//   b: device, dense row-major [csr.n_cols, n], leading dimension ldb >= n.
//   c: device, row-major, leading dimension ldc >= n.
// Design: one warp per (CSR row, 32*V-column strip of c), V = 4 floats, 2
// doubles or 8 16-bit values (16-byte loads) when n, ldb, ldc and the
// pointers allow it, else
// V = 1. The warp loads 32 (index, value) pairs at a time and broadcasts
// them with shuffles; each lane streams the matching rows of b through the
// read-only cache, four loads in flight, into register accumulators. Sum
// order per output: ascending k. Small n (n <= 16 * (16 / sizeof(T))): the
// warp splits into P = 2..32 lane groups that each cover the whole row of b
// and take every P-th nonzero (ascending within the group), then a fixed
// xor butterfly adds the P partial sums, so no lane idles and a warp
// streams P rows of b at once; P depends on n only.
template <typename T>
cudaError_t CsrSpmmGpu(const GpuCsr<T>& csr, const int64_t* out_rows,
                       const T* b, int64_t n, int64_t ldb, T* c, int64_t ldc,
                       cudaStream_t stream);

// Workspace for CsrToCscGpu(csr) (host query).
cudaError_t CsrToCscWorkspaceBytes(int64_t n_rows, int64_t n_cols,
                                   int64_t nnz, size_t* bytes);

// Transposes a CSR into CSC form without atomics: a stable CUB radix sort of
// (column, position) pairs keeps entries of equal column in CSR order, so
// row indices ascend within each column and the result is deterministic.
//   csc_col_ptr: device out, [csr.n_cols + 1].
//   csc_row_idx: device out, [csr.nnz], CSR row numbers (< 2^31 required).
//   csc_values:  device out, [csr.nnz].
//   workspace:   >= CsrToCscWorkspaceBytes(...) bytes, 256-byte aligned.
template <typename T>
cudaError_t CsrToCscGpu(const GpuCsr<T>& csr, int64_t* csc_col_ptr,
                        int32_t* csc_row_idx, T* csc_values, void* workspace,
                        size_t workspace_bytes, cudaStream_t stream);

// SpMM^T from a CSC: for j in [0, csc.n_cols):
//   dw[j, 0:n] (=|+=) sum_{p in col j} values[p] * dy[dy_rows[row_idx[p]], :]
// i.e. dW = A^T * dY where A is the CSR the CSC came from and CSR row r
// multiplies dY row dy_rows[r] (dy_rows == nullptr: row r). Accumulation is
// in ascending CSR row order, one thread per output element (no atomics):
// deterministic bits. accumulate = false overwrites dw (rows of all-zero
// columns become 0); true adds to it (for a split where a dense GEMM did the
// other rows).
//   dy: device, row-major, leading dimension lddy >= n.
//   dw: device, row-major [csc.n_cols, n], leading dimension lddw >= n.
template <typename T>
cudaError_t CscSpmmTransposeGpu(const GpuCsc<T>& csc, const int64_t* dy_rows,
                                const T* dy, int64_t n, int64_t lddy, T* dw,
                                int64_t lddw, bool accumulate,
                                cudaStream_t stream);

// Workspace for CsrSpmmTransposeGpu (CSC arrays plus CsrToCsc's scratch).
template <typename T>
cudaError_t CsrSpmmTransposeWorkspaceBytes(int64_t n_rows, int64_t n_cols,
                                           int64_t nnz, size_t* bytes);

// dW = A^T * dY straight from the CSR of A (weight gradient of a MatMul whose
// activation operand is A): CsrToCscGpu into the workspace, then
// CscSpmmTransposeGpu. Same arguments and determinism as those two.
template <typename T>
cudaError_t CsrSpmmTransposeGpu(const GpuCsr<T>& csr, const int64_t* dy_rows,
                                const T* dy, int64_t n, int64_t lddy, T* dw,
                                int64_t lddw, bool accumulate, void* workspace,
                                size_t workspace_bytes, cudaStream_t stream);

// SDDMM: out[i, j] = mask[i, j] != 0 ? dot(x[i, :], y[j, :]) : 0 for the
// row-major mask [m, k], x [m, n], y [k, n]; out is [m, k] row-major (fully
// written). Cost is proportional to nnz(mask) * n. Used for dX = dY * W^T
// when X came from a ReLU (its gradient is zero wherever X is): mask = X,
// x = dY, y = W. Design: one warp per (row i, 32 columns j); the mask is read
// coalesced and a ballot lists the live j; for n > 32 the warp computes each
// live dot together (lane-strided, 16-byte loads when aligned, fixed
// butterfly reduction), for n <= 32 each lane computes its own dot serially.
template <typename T>
cudaError_t SddmmGpu(const T* mask, const T* x, const T* y, int64_t m,
                     int64_t k, int64_t n, T* out, cudaStream_t stream);

}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_CORE_CUDA_SPARSE_MATMUL_CUDA_H_
