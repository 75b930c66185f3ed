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

// The bfloat16 kernels of CsrSpmm. kPacked widens each K block of B into
// a float32 pack and runs memory-operand FMAs on it (its cost has k * n and
// n_rows * n terms whatever the sparsity: the pack, a float32 buffer of the
// output); kDirect widens B's values in registers as each nonzero uses them
// (cost ~ nnz * n, about twice the packed kernel's per product); kDot
// (AVX512_BF16 only, see Bf16DotAvailable) is the direct kernel with the
// nonzeros of a row taken two at a time: one vdpbf16ps multiplies a pair of
// nonzeros by the word-interleaved pair of their rows of B (32 products
// into 16 float32 lanes), about 1.3x the direct kernel's products per
// cycle. kPacked and kDirect give identical bits; kDot gives the same bits
// except where a value, product or partial sum is a float32 denormal
// (below 2^-126 in magnitude), which vdpbf16ps flushes to zero (DAZ/FTZ)
// whatever MXCSR says (the FMA kernels follow the thread's MXCSR):
// it adds each pair's products in ascending k, one rounding each, as the
// fused multiply-adds of the other two do.
// kDotPacked is kDot reading B from a per-tile copy of each K block
// (128 columns x 1024 rows of B, 256 KB in L2; 128 rows, 32 KB in L1,
// where the density is at least 1/10; copied once per row group) instead
// of from B's rows in place: worth its copy where each row of B serves
// several nonzeros of a row group.
enum class Bf16SpmmKernel { kPacked = 0, kDirect = 1, kDot = 2, kDotPacked = 3 };

// The direct kernel is taken up to nnz = kDirectNnzPerK * k +
// kDirectNnzPerRow * n_rows nonzeros (fitted to measured crossovers, see
// Bf16SpmmKernelRule in spmm.cc).
constexpr int64_t kDirectNnzPerK = 3;
constexpr int64_t kDirectNnzPerRow = 16;
// Where the CPU has the dot kernels: kPacked above a density (nnz /
// (n_rows * k)) of 1 / kDotMaxDensityInv unless vdpbf16ps runs at least
// kDotDenseMinRateRatio times the FMA's products per second (then kDotPacked
// at any density from 1 / kDotPackedMinDensityInv), kDotPacked from a
// density of 1 / kDotPackedMinDensityInv (two nonzeros per row per 128-row
// pack), else kDot.
constexpr int64_t kDotMaxDensityInv = 2;
constexpr int64_t kDotPackedMinDensityInv = 64;
constexpr double kDotDenseMinRateRatio = 1.0;

// True where the dot kernel can run: the CPU has AVX512_BF16 (CPUID leaf 7
// subleaf 1, EAX bit 5) and the AVX-512 copy of the 16-bit kernels is the
// active one (LowPrecisionIsa; forcing a lower path turns it off), and the
// library was compiled with a compiler that knows the instruction.
bool Bf16DotAvailable();

// Products per second of vdpbf16ps (zmm) over those of a float32 FMA (zmm)
// on this CPU, measured once per process by two register-only throughput
// loops (about 0.1 ms on first use; the fastest of 7 alternating rounds of
// each): 2.0 on Zen 4, about 0.5 expected on Sapphire Rapids. 0 where
// Bf16DotAvailable() is false.
double Bf16DotRateRatio();

// The rule of ChooseBf16SpmmKernel for a CPU with (dot = true) or without
// the dot kernels, never forced; dot_rate_ratio is Bf16DotRateRatio() of
// the CPU (used only with dot): for n < 32 kPacked; with dot, kPacked for
// nnz > n_rows * k / kDotMaxDensityInv when dot_rate_ratio <
// kDotDenseMinRateRatio, kDotPacked for nnz >= n_rows * k /
// kDotPackedMinDensityInv, else kDot; without, kDirect for nnz <=
// kDirectNnzPerK * k + kDirectNnzPerRow * n_rows, else kPacked.
Bf16SpmmKernel Bf16SpmmKernelRule(int64_t n_rows, int64_t k, int64_t n,
                                  int64_t nnz, bool dot,
                                  double dot_rate_ratio);

// The kernel a bfloat16 CsrSpmm of n_rows x k (nnz nonzeros) times k x n
// takes: forced (ForceBf16SpmmKernel; a forced kDot or kDotPacked where
// Bf16DotAvailable() is false runs kDirect), else
// Bf16SpmmKernelRule(..., Bf16DotAvailable(), Bf16DotRateRatio()).
Bf16SpmmKernel ChooseBf16SpmmKernel(int64_t n_rows, int64_t k, int64_t n,
                                    int64_t nnz);

// Forces the bfloat16 kernel (0 packed, 1 direct, 2 dot, 3 dot packed); a
// negative value
// restores the choice above. Not thread-safe with running kernels: for
// tests and benchmarks.
void ForceBf16SpmmKernel(int kernel);

}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_CORE_SPMM_H_
