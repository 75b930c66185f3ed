// CPU implementation of the kernels declared in spmm.h.
#include "cc/core/spmm.h"
#include "cc/core/gather.h"
#include "cc/core/low_precision.h"
#include "cc/core/uninit_vector.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#define TFSS_SPMM_X86 1
#include <immintrin.h>
#else
#define TFSS_SPMM_X86 0
#endif

// The bfloat16 dot kernel needs a compiler that knows AVX512_BF16
// (vdpbf16ps): GCC 10+, Clang 9+. It is compiled in its own target region
// whatever -march says, and taken only where CPUID reports the instruction.
#if TFSS_SPMM_X86 && \
    ((defined(__clang__) && __clang_major__ >= 9) || \
     (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 10))
#define TFSS_SPMM_HAVE_DOT 1
#else
#define TFSS_SPMM_HAVE_DOT 0
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

#if TFSS_SPMM_HAVE_DOT
// The AVX-512 copy again with AVX512_BF16 enabled: only its dot kernel
// (DotSpmmBf16) is used, the templates it does not instantiate cost nothing.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
namespace lp_avx512bf16 {
constexpr int kVecBytes = 64;
constexpr bool kExactFma = false;
#define TFSS_SPMM_BF16_DOT 1
#include "cc/core/spmm_impl.inc"
#undef TFSS_SPMM_BF16_DOT
}  // namespace lp_avx512bf16
#pragma GCC pop_options
#endif  // TFSS_SPMM_HAVE_DOT

// The low-precision SpMM: accumulates in a float32 buffer (rows in CSR
// order), then rounds each output once to T (round-to-nearest-even) into
// c's rows out_rows[r].
template <typename T>
void SpmmLowPrecision(const Csr<T>& csr, const int64_t* out_rows,
                      int64_t n_rows, const T* b, int64_t k, int64_t n,
                      int64_t ldb, T* c, int64_t ldc, const ParallelFor& pfor) {
  if constexpr (std::is_same<T, bf16>::value) {
    const Bf16SpmmKernel kernel =
        ChooseBf16SpmmKernel(n_rows, k, n, csr.row_ptr[n_rows]);
#if TFSS_SPMM_HAVE_DOT
    if (kernel == Bf16SpmmKernel::kDot ||
        kernel == Bf16SpmmKernel::kDotPacked) {
      lp_avx512bf16::DotSpmmBf16(csr, out_rows, n_rows, b, k, n, ldb, c, ldc,
                                 kernel == Bf16SpmmKernel::kDotPacked, pfor);
      return;
    }
#endif
    if (kernel != Bf16SpmmKernel::kPacked) {
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

bool Bf16DotAvailable() {
#if TFSS_SPMM_HAVE_DOT
  return Cpu().avx512bf16 && LowPrecisionIsa() == KernelIsa::kAvx512;
#else
  return false;
#endif
}

double Bf16DotRateRatio() {
#if TFSS_SPMM_HAVE_DOT
  if (!Bf16DotAvailable()) return 0.0;
  static const double ratio = lp_avx512bf16::DotToFmaRateRatio();
  return ratio;
#else
  return 0.0;
#endif
}

Bf16SpmmKernel Bf16SpmmKernelRule(int64_t n_rows, int64_t k, int64_t n,
                                  int64_t nnz, bool dot,
                                  double dot_rate_ratio) {
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
  //
  // The dot kernels (vdpbf16ps on pairs of nonzeros, AVX512_BF16) replace
  // the direct one where the CPU has them. Measured (CPU ms, one thread,
  // loaded machine; packed / dot / dot packed): forward 128x2048x2048 at
  // 50% zeros 8.2 / 11.1 / 9.0, 70% 6.0 / 7.9 / 5.7, 90% 2.9 / 3.3 / 2.3,
  // 98% 1.8 / 1.3 / 1.0, 99% 1.7 / 0.74 / 0.82; 1024x4096x1024 at 50%
  // 98 / 93 / 87, 90% 21 / 23 / 17, 99% 8.2 / 5.3 / 5.8; weight gradients
  // 2048x128x2048 at 50% 11.0 / 11.0 / 9.0, 90% 7.8 / 3.3 / 2.8, 95%
  // 8.0 / 2.5 / 2.8, 4096x1024x1024 at 90% 33 / 21 / 19, 99% 16 / 5.8 /
  // 6.6. So the packed dot kernel wins from ~50% zeros down to about two
  // nonzeros per row per 128-row pack (density 1/64: the copy of B and
  // the per-visit costs are then paid for few products), the unpacked one
  // above that; the float32 packed kernel only at 50% zeros and denser
  // (its memory-operand FMAs run twice vdpbf16ps's products per cycle from
  // L1).
  //
  // That last edge is the CPU's: on Zen 4 (AVX512_BF16, no AMX; a 512-bit
  // FMA takes both 256-bit pipes, vdpbf16ps zmm issues every cycle)
  // vdpbf16ps adds about 2x the FMA's products per second
  // (Bf16DotRateRatio), and the packed dot kernel beat the float32 packed
  // one at every density measured (wall-clock, one thread, loaded machine;
  // t(packed) / t(dot packed), same rounds): at 0 / 50 / 70% zeros forward
  // 1024x4096x1024 1.32 / 1.58 / 1.27x, its a^T dY 1.50 / 1.83 / 1.48x,
  // forward 128x2048x2048 1.0 / 1.28 / 1.65x, its a^T dY 1.80 / 1.64 /
  // 1.88x (benchmarks/results/bench_matmul_bf16_kernels_zen4_under_load.md).
  // So where the measured ratio reaches kDotDenseMinRateRatio, the packed
  // dot kernel also takes densities above 1/2.
  if (n < 32) return Bf16SpmmKernel::kPacked;
  if (dot) {
    const double dense = static_cast<double>(n_rows) * static_cast<double>(k);
    const double z = static_cast<double>(nnz);
    if (z * kDotMaxDensityInv > dense &&
        !(dot_rate_ratio >= kDotDenseMinRateRatio))
      return Bf16SpmmKernel::kPacked;
    return z * kDotPackedMinDensityInv >= dense ? Bf16SpmmKernel::kDotPacked
                                                : Bf16SpmmKernel::kDot;
  }
  return nnz <= kDirectNnzPerK * k + kDirectNnzPerRow * n_rows
             ? Bf16SpmmKernel::kDirect
             : Bf16SpmmKernel::kPacked;
}

Bf16SpmmKernel ChooseBf16SpmmKernel(int64_t n_rows, int64_t k, int64_t n,
                                    int64_t nnz) {
  const int forced = forced_bf16_kernel.load(std::memory_order_relaxed);
  if (forced >= 0) {
    const auto f = static_cast<Bf16SpmmKernel>(forced);
    return (f == Bf16SpmmKernel::kDot || f == Bf16SpmmKernel::kDotPacked) &&
                   !Bf16DotAvailable()
               ? Bf16SpmmKernel::kDirect
               : f;
  }
  const bool dot = Bf16DotAvailable();
  return Bf16SpmmKernelRule(n_rows, k, n, nnz, dot,
                            dot ? Bf16DotRateRatio() : 0.0);
}

void ForceBf16SpmmKernel(int kernel) {
  forced_bf16_kernel.store(kernel < 0 ? -1 : std::min(kernel, 3),
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
