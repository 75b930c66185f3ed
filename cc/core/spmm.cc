// CPU implementation of the kernels declared in spmm.h.
#include "cc/core/spmm.h"
#include "cc/core/gather.h"
#include "cc/core/low_precision.h"
#include "cc/core/uninit_vector.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#define TFSS_SPMM_X86 1
#else
#define TFSS_SPMM_X86 0
#endif

namespace tf_sparse_split {

namespace {

// One copy of the kernels per instruction set (spmm_impl.inc). float32 and
// float64 run the copy compiled with the build's flags (`native`); the
// 16-bit types choose theirs at run time from CPUID (LowPrecisionIsa), so a
// library built for any x86-64 runs its AVX-512 or AVX2 copy where the CPU
// has it. Every low-precision copy multiplies-adds with one rounding
// (fused), in ascending k: identical bits on every path.
namespace native {
#if defined(__AVX512F__)
constexpr int kVecBytes = 64;
#elif defined(__AVX__)
constexpr int kVecBytes = 32;
#else
constexpr int kVecBytes = 16;
#endif
constexpr bool kExactFma = false;
#include "cc/core/spmm_impl.inc"
}  // namespace native

namespace lp_scalar {
constexpr int kVecBytes = 4;
constexpr bool kExactFma = true;
#include "cc/core/spmm_impl.inc"
}  // namespace lp_scalar

#if TFSS_SPMM_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace lp_avx2 {
constexpr int kVecBytes = 32;
constexpr bool kExactFma = false;
#include "cc/core/spmm_impl.inc"
}  // namespace lp_avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace lp_avx512 {
constexpr int kVecBytes = 64;
constexpr bool kExactFma = false;
#include "cc/core/spmm_impl.inc"
}  // namespace lp_avx512
#pragma GCC pop_options
#endif  // TFSS_SPMM_X86

// The low-precision SpMM: accumulates in a float32 buffer (rows in CSR
// order), then rounds each output once to T (round-to-nearest-even) into
// c's rows out_rows[r].
template <typename T>
void SpmmLowPrecision(const Csr<T>& csr, const int64_t* out_rows,
                      int64_t n_rows, const T* b, int64_t k, int64_t n,
                      int64_t ldb, T* c, int64_t ldc, const ParallelFor& pfor) {
  if constexpr (std::is_same<T, bf16>::value) {
    if (ChooseBf16SpmmKernel(n_rows, k, n, csr.row_ptr[n_rows]) ==
        Bf16SpmmKernel::kDirect) {
      switch (LowPrecisionIsa()) {
#if TFSS_SPMM_X86
        case KernelIsa::kAvx512:
          lp_avx512::DirectSpmmBf16(csr, out_rows, n_rows, b, k, n, ldb, c, ldc,
                                    pfor);
          return;
        case KernelIsa::kAvx2:
          lp_avx2::DirectSpmmBf16(csr, out_rows, n_rows, b, k, n, ldb, c, ldc,
                                  pfor);
          return;
#endif
        default:
          lp_scalar::DirectSpmmBf16(csr, out_rows, n_rows, b, k, n, ldb, c, ldc,
                                    pfor);
          return;
      }
    }
  }
  UninitVector<float> acc(static_cast<size_t>(n_rows) * n);
  std::vector<int64_t> ident(n_rows);
  for (int64_t r = 0; r < n_rows; ++r) ident[r] = r;
  auto run = [&](const auto& values_csr) {
    using V = typename std::decay<decltype(values_csr.values[0])>::type;
    switch (LowPrecisionIsa()) {
#if TFSS_SPMM_X86
      case KernelIsa::kAvx512:
        lp_avx512::Spmm<T, float, V>(values_csr, ident.data(), n_rows, b, k,
                                     n, ldb, acc.data(), n, pfor);
        break;
      case KernelIsa::kAvx2:
        lp_avx2::Spmm<T, float, V>(values_csr, ident.data(), n_rows, b, k, n,
                                   ldb, acc.data(), n, pfor);
        break;
#endif
      default:
        lp_scalar::Spmm<T, float, V>(values_csr, ident.data(), n_rows, b, k,
                                     n, ldb, acc.data(), n, pfor);
    }
  };
  if constexpr (std::is_same<T, bf16>::value) {
    run(csr);  // bfloat16 -> float32 is a shift, done per broadcast
  } else {
    // half -> float32 is not: the values are widened once (F16C / AVX-512,
    // nnz conversions) into a float32 copy of the CSR.
    Csr<float> wide;
    const int64_t nnz = csr.row_ptr[n_rows];
    wide.row_ptr.assign(csr.row_ptr.begin(), csr.row_ptr.end());
    wide.col_idx.assign(csr.col_idx.begin(), csr.col_idx.end());
    wide.values.resize(nnz);
    WidenToFloat(csr.values.data(), wide.values.data(), nnz);
    run(wide);
  }
  pfor(n_rows, 2 * n, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      NarrowFromFloat(acc.data() + r * n, c + out_rows[r] * ldc, n);
  });
}


std::atomic<int> forced_bf16_kernel{-1};

}  // namespace

Bf16SpmmKernel ChooseBf16SpmmKernel(int64_t n_rows, int64_t k, int64_t n,
                                    int64_t nnz) {
  const int forced = forced_bf16_kernel.load(std::memory_order_relaxed);
  if (forced >= 0) return static_cast<Bf16SpmmKernel>(forced);
  // The packed kernel pays, per call, ~k * n (B widened into the pack, read
  // in strided 256-byte panel rows) and ~n_rows * n (a float32 buffer of
  // the whole output, fresh pages zero-filled by the OS, narrowed to
  // bfloat16 at the end), then one memory-operand FMA per product. The
  // direct kernel pays neither (it rounds each output row once, straight
  // into c) but a shift or a mask per product and B's rows from L2 rather
  // than L1: about twice the packed kernel's cost per product. So the direct
  // kernel wins up to nnz ~ a k + b n_rows. Fitted to the crossovers
  // measured (CPU seconds, 1 and 2 threads, AVX-512; rows x k x n, the
  // nnz where the two tie): forward 128x2048x2048 ~9k (96.5% zeros),
  // 1024x4096x1024 ~20k (99.5%), weight gradients a^T dY 2048x128x2048
  // ~40k (85%), 4096x1024x1024 ~83k (98%), 2048x2048x2048 ~41k (99%). At
  // 98-99% zeros the direct kernel was 1.3-2.4x faster, and the MLP's
  // weight gradient (2048x128x2048) 1.2x at 90% zeros, 2x at 98%. A narrow
  // output (n < 32 columns, one vector of bfloat16) keeps the packed
  // kernel, whose narrow panels are vectorised.
  if (n < 32) return Bf16SpmmKernel::kPacked;
  return nnz <= kDirectNnzPerK * k + kDirectNnzPerRow * n_rows
             ? Bf16SpmmKernel::kDirect
             : Bf16SpmmKernel::kPacked;
}

void ForceBf16SpmmKernel(int kernel) {
  forced_bf16_kernel.store(kernel < 0 ? -1 : (kernel > 0 ? 1 : 0),
                           std::memory_order_relaxed);
}

template <typename T>
void CsrSpmm(const Csr<T>& csr, const int64_t* out_rows, int64_t n_rows,
             const T* b, int64_t k, int64_t n, int64_t ldb, T* c,
             int64_t ldc, const ParallelFor& pfor) {
  if (n_rows == 0 || n == 0) return;
  if (k == 0) {
    ZeroRows<T>(out_rows, n_rows, n, c, ldc, pfor);
    return;
  }
  if constexpr (IsLowPrecision<T>::value) {
    SpmmLowPrecision<T>(csr, out_rows, n_rows, b, k, n, ldb, c, ldc, pfor);
  } else {
    native::Spmm<T, T>(csr, out_rows, n_rows, b, k, n, ldb, c, ldc, pfor);
  }
}

#define TFSS_INSTANTIATE(T)                                                   \
  template void CsrSpmm<T>(const Csr<T>&, const int64_t*, int64_t, const T*,  \
                           int64_t, int64_t, int64_t, T*, int64_t,            \
                           const ParallelFor&);

TFSS_INSTANTIATE(float)
TFSS_INSTANTIATE(double)
TFSS_INSTANTIATE(bf16)
TFSS_INSTANTIATE(f16)
#undef TFSS_INSTANTIATE

}  // namespace tf_sparse_split
