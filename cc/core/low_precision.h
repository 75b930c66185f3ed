// bfloat16 and IEEE half storage types for the framework-free core, their
// conversions to and from float32, and the CPU features that choose the
// vector conversion path at run time.
//
// The kernels keep these 16-bit types as storage only: every product is
// accumulated in float32 (Accum<T>), and the result is rounded once to T,
// round-to-nearest-even, as TensorFlow's Eigen::bfloat16 / Eigen::half
// conversions do. Both types are layout-compatible with Eigen's (one
// uint16_t), so a TF kernel adapter may reinterpret_cast its tensors' data.
//
// Bulk conversions (WidenToFloat / NarrowFromFloat) pick their instruction
// set from CPUID when first called, never from the flags the library was
// built with: AVX512_BF16 (vcvtne2ps2bf16) or AVX-512F for bfloat16,
// AVX-512F / F16C (vcvtph2ps, vcvtps2ph) for half, else a scalar loop with
// the same rounding. A library built on one x86 machine therefore runs
// correctly, with the same bits, on another.
#ifndef TF_SPARSE_SPLIT_CC_CORE_LOW_PRECISION_H_
#define TF_SPARSE_SPLIT_CC_CORE_LOW_PRECISION_H_

#include <cstdint>
#include <cstring>

namespace tf_sparse_split {

// Brain floating point: the upper 16 bits of an IEEE float32.
struct bf16 {
  uint16_t bits;
};
// IEEE 754 binary16.
struct f16 {
  uint16_t bits;
};
static_assert(sizeof(bf16) == 2 && sizeof(f16) == 2, "16-bit storage");

// The type products are accumulated in: float32 for float32 and the 16-bit
// types, float64 for float64.
template <typename T>
struct Accum {
  typedef float type;
};
template <>
struct Accum<double> {
  typedef double type;
};

// True for the 16-bit storage types.
template <typename T>
struct IsLowPrecision {
  static constexpr bool value = false;
};
template <>
struct IsLowPrecision<bf16> {
  static constexpr bool value = true;
};
template <>
struct IsLowPrecision<f16> {
  static constexpr bool value = true;
};

inline float Bf16ToFloat(bf16 x) {
  const uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Round-to-nearest-even; NaN stays NaN (quiet), +-Inf stays +-Inf.
inline bf16 FloatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    return bf16{static_cast<uint16_t>((u >> 16) | 0x0040u)};
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
}

float F16ToFloat(f16 x);
// Round-to-nearest-even; overflow gives +-Inf, NaN stays NaN.
f16 FloatToF16(float f);

// Scalar conversions, overloaded so that templated kernels can write
// ToFloat(x) / FromFloat<T>(acc) for every T.
inline float ToFloat(float x) { return x; }
inline double ToFloat(double x) { return x; }
inline float ToFloat(bf16 x) { return Bf16ToFloat(x); }
inline float ToFloat(f16 x) { return F16ToFloat(x); }

template <typename T>
inline T FromFloat(typename Accum<T>::type x) {
  return static_cast<T>(x);
}
template <>
inline bf16 FromFloat<bf16>(float x) {
  return FloatToBf16(x);
}
template <>
inline f16 FromFloat<f16>(float x) {
  return FloatToF16(x);
}

// True if x is exactly zero (either sign) -- the test every counting pass
// uses, without converting.
inline bool IsZero(bf16 x) { return (x.bits & 0x7fffu) == 0; }
inline bool IsZero(f16 x) { return (x.bits & 0x7fffu) == 0; }
inline bool IsZero(float x) { return x == 0.0f; }
inline bool IsZero(double x) { return x == 0.0; }

// dst[i] = float(src[i]) for i in [0, n).
void WidenToFloat(const bf16* src, float* dst, int64_t n);
void WidenToFloat(const f16* src, float* dst, int64_t n);
// dst[i] = round_to_nearest_even(src[i]) for i in [0, n).
void NarrowFromFloat(const float* src, bf16* dst, int64_t n);
void NarrowFromFloat(const float* src, f16* dst, int64_t n);

// What this CPU can do, from CPUID (read once).
struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512bf16 = false;
  bool avx512fp16 = false;
  bool amx_bf16 = false;
};
const CpuFeatures& Cpu();

// The instruction set the low-precision sparse kernels (SpMM, SDDMM dots)
// run with: the best this CPU has (CPUID), unless a test or benchmark forced
// one. Every path gives the same bits (fused multiply-adds in the same
// order); only the speed differs.
enum class KernelIsa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };
KernelIsa BestKernelIsa();
KernelIsa LowPrecisionIsa();
// Forces the path (clamped to BestKernelIsa(): a path the CPU lacks is never
// taken); a negative value restores the CPUID choice. Not thread-safe with
// running kernels: for tests and benchmarks.
void ForceLowPrecisionIsa(int isa);
const char* KernelIsaName(KernelIsa isa);

// The instruction-set path the bulk conversions of T take on this CPU, e.g.
// "avx512bf16" or "scalar" (reported in the build info and benchmarks).
const char* ConversionPath(bool bfloat16);

}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_CORE_LOW_PRECISION_H_
