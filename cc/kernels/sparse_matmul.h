// Framework-free CPU kernels behind SparseSplitMatMul (layer 1 of DESIGN.md).
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
#ifndef TF_SPARSE_SPLIT_CC_KERNELS_SPARSE_MATMUL_H_
#define TF_SPARSE_SPLIT_CC_KERNELS_SPARSE_MATMUL_H_

#include <cstdint>
#include <functional>
#include <vector>

namespace tf_sparse_split {

// Runs fn(begin, end) over disjoint sub-ranges that together cover
// [0, total), possibly concurrently; returns when all have finished.
// cost_per_unit is a rough cost of one unit in cycles (used to size shards).
using ParallelFor = std::function<void(
    int64_t total, int64_t cost_per_unit,
    const std::function<void(int64_t, int64_t)>& fn)>;

// A ParallelFor that runs everything on the calling thread.
void SerialFor(int64_t total, int64_t cost_per_unit,
               const std::function<void(int64_t, int64_t)>& fn);

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

// A CSR matrix over a subset of rows of op(a), column indices in op(a)'s
// column space (uncompacted), ascending within each row.
template <typename T>
struct Csr {
  std::vector<int64_t> row_ptr;  // [n_rows + 1]
  std::vector<int32_t> col_idx;  // [nnz]
  std::vector<T> values;         // [nnz]
};

// Builds the CSR of rows `rows[0..n_rows)` of op(a) (each index in [0, m)).
// row_nnz[m] and col_nnz[k] must be CountNonzeros' outputs for the same a
// (col_nnz is read only when transpose_a; it may be null otherwise). Rows
// appear in the CSR in the order given; ascending `rows` is fastest.
template <typename T>
void BuildCsr(const T* a, int64_t phys_rows, int64_t phys_cols,
              bool transpose_a, const int64_t* rows, int64_t n_rows,
              const int64_t* row_nnz, const int64_t* col_nnz, Csr<T>* csr,
              const ParallelFor& pfor);

// CSR SpMM: for r in [0, n_rows): c[out_rows[r], :] = csr.row(r) * b,
// where b is a dense row-major [k, n] matrix with leading dimension ldb and
// c a row-major matrix with leading dimension ldc (rows out_rows[r] are
// overwritten, other rows untouched). Tiled over N and K so the block of b
// being read stays in L1/L2 while all rows sweep over it; parallel over
// (row block, column block) tiles; the summation order of each output is
// ascending k whatever the thread count (deterministic bits).
template <typename T>
void CsrSpmm(const Csr<T>& csr, const int64_t* out_rows, int64_t n_rows,
             const T* b, int64_t k, int64_t n, int64_t ldb, T* c,
             int64_t ldc, const ParallelFor& pfor);

// SDDMM: out[i, j] = mask[i, j] != 0 ? dot(x[i, :], y[j, :]) : 0 for the
// row-major mask [m, k], x [m, n], y [k, n]; out is [m, k] row-major. Cost is
// proportional to nnz(mask) * n. Used for dX = dY * W^T when X came from a
// ReLU (its gradient is zero wherever X is).
template <typename T>
void Sddmm(const T* mask, const T* x, const T* y, int64_t m, int64_t k,
           int64_t n, T* out, const ParallelFor& pfor);

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

// Number of bins of the row-density histogram in the statistics vector.
constexpr int kDensityBins = 16;

// Bin of a row density d in [0, 1]: floor(d * kDensityBins), 1.0 in the last.
inline int DensityBin(double d) {
  int b = static_cast<int>(d * kDensityBins);
  return b < 0 ? 0 : (b >= kDensityBins ? kDensityBins - 1 : b);
}

// Layout of the per-call statistics vector (float64) that SparseSplitMatMul
// emits as its second output. Times are wall-clock seconds.
enum StatIndex : int {
  kStatRowsDense = 0,       // rows of op(a) sent to the dense GEMM
  kStatRowsSparse = 1,      // rows sent to the CSR SpMM (incl. all-zero rows)
  kStatNnz = 2,             // nonzeros of op(a)
  kStatZeroColsSkipped = 3, // all-zero columns of op(a) compacted away
  kStatTimeDense = 4,       // seconds in the dense part (gather+GEMM+scatter)
  kStatTimeSparse = 5,      // seconds in the sparse part (CSR build + SpMM)
  kStatTimeAnalyze = 6,     // seconds measuring densities and deciding
  kStatThreshold = 7,       // density threshold actually used, in [0, 1]
  kStatM = 8,               // m: rows of op(a)
  kStatK = 9,               // k: columns of op(a)
  kStatN = 10,              // n: columns of op(b)
  kStatNnzSparse = 11,      // nonzeros in the rows sent sparse
  kStatHistogram = 12,      // [12, 12 + kDensityBins): rows per density bin
  // Heterogeneous split (attr heterogeneous): kHeteroOff, kHeteroRan or
  // kHeteroCpuFallback below.
  kStatHeterogeneous = 12 + kDensityBins,
  kNumStats = 13 + kDensityBins,
};

// Values of stats[kStatHeterogeneous].
constexpr double kHeteroOff = 0.0;          // not requested
constexpr double kHeteroRan = 1.0;          // GPU kernel: dense rows on the
                                            // GPU, sparse rows on the CPU
constexpr double kHeteroCpuFallback = 2.0;  // requested, but the CPU kernel
                                            // ran: the normal CPU split

}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_KERNELS_SPARSE_MATMUL_H_
