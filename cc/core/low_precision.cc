// Conversions between float32 and the 16-bit storage types, with a vector
// path chosen from CPUID at run time (see low_precision.h).
#include "cc/core/low_precision.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define TFSS_X86 1
#else
#define TFSS_X86 0
#endif

namespace tf_sparse_split {

// ---------------------------------------------------------------- scalar --

float F16ToFloat(f16 x) {
  const uint32_t h = x.bits;
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1fu) {  // Inf / NaN
    u = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {  // normal
    u = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {  // +-0
    u = sign;
  } else {  // subnormal half: normalise
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    u = sign | ((112u - e) << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

f16 FloatToF16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) {  // NaN: keep it quiet, keep the top payload bits
    return f16{static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu))};
  }
  if (a >= 0x477ff000u) {  // rounds to >= 65520: Inf
    return f16{static_cast<uint16_t>(sign | 0x7c00u)};
  }
  if (a < 0x38800000u) {  // below the smallest normal half (2^-14)
    if (a < 0x33000000u) return f16{sign};  // below half the smallest subnormal
    // Subnormal: value = mant * 2^-24, rounded to nearest even.
    const uint32_t e = a >> 23;
    const uint32_t m = (a & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e;  // 14..24
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (r & 1u))) ++r;
    return f16{static_cast<uint16_t>(sign | r)};
  }
  // Normal: rebias the exponent, round the mantissa to 10 bits (a carry
  // into the exponent is the correct result).
  uint32_t r = a - 0x38000000u;
  r += 0xfffu + ((r >> 13) & 1u);
  return f16{static_cast<uint16_t>(sign | (r >> 13))};
}

// ------------------------------------------------------------------ CPUID --

namespace {

CpuFeatures DetectCpu() {
  CpuFeatures c;
#if TFSS_X86
  __builtin_cpu_init();
  c.avx2 = __builtin_cpu_supports("avx2");
  c.fma = __builtin_cpu_supports("fma");
  c.avx512f = __builtin_cpu_supports("avx512f");
  c.avx512bw = __builtin_cpu_supports("avx512bw");
  unsigned a, b, cx, d;
  if (__get_cpuid(1, &a, &b, &cx, &d)) c.f16c = c.avx2 && ((cx >> 29) & 1u);
  if (c.avx512f && __get_cpuid_count(7, 0, &a, &b, &cx, &d)) {
    c.avx512fp16 = (d >> 23) & 1u;
    c.amx_bf16 = (d >> 22) & 1u;
    if (a >= 1 && __get_cpuid_count(7, 1, &a, &b, &cx, &d)) {
      c.avx512bf16 = (a >> 5) & 1u;
    }
  }
#endif
  return c;
}

#if TFSS_X86
__attribute__((target("avx512f"))) void WidenBf16Avx512(const bf16* src,
                                                        float* dst,
                                                        int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(w));
  }
  for (; i < n; ++i) dst[i] = Bf16ToFloat(src[i]);
}

// The scalar rounding, 16 lanes at a time (bit-identical to FloatToBf16).
__attribute__((target("avx512f"))) void NarrowBf16Avx512(const float* src,
                                                         bf16* dst,
                                                         int64_t n) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512i inf = _mm512_set1_epi32(0x7f800000);
  const __m512i bias = _mm512_set1_epi32(0x7fff);
  const __m512i one = _mm512_set1_epi32(1);
  const __m512i quiet = _mm512_set1_epi32(0x00400000);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(src + i));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs_mask), inf);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(bias, lsb));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, quiet));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
  }
  for (; i < n; ++i) dst[i] = FloatToBf16(src[i]);
}

__attribute__((target("avx2,f16c"))) void WidenF16F16c(const f16* src,
                                                       float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) dst[i] = F16ToFloat(src[i]);
}

__attribute__((target("avx2,f16c"))) void NarrowF16F16c(const float* src,
                                                        f16* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  for (; i < n; ++i) dst[i] = FloatToF16(src[i]);
}
#endif

}  // namespace

const CpuFeatures& Cpu() {
  static const CpuFeatures features = DetectCpu();
  return features;
}

const char* ConversionPath(bool bfloat16) {
#if TFSS_X86
  if (bfloat16) return Cpu().avx512f ? "avx512f" : "scalar";
  return Cpu().f16c ? "f16c" : "scalar";
#else
  (void)bfloat16;
  return "scalar";
#endif
}

KernelIsa BestKernelIsa() {
#if TFSS_X86
  const CpuFeatures& c = Cpu();
  if (c.avx512f && c.avx512bw && c.fma && c.f16c) return KernelIsa::kAvx512;
  if (c.avx2 && c.fma && c.f16c) return KernelIsa::kAvx2;
#endif
  return KernelIsa::kScalar;
}

namespace {
std::atomic<int> forced_isa{-1};
}  // namespace

KernelIsa LowPrecisionIsa() {
  const int best = static_cast<int>(BestKernelIsa());
  const int forced = forced_isa.load(std::memory_order_relaxed);
  return static_cast<KernelIsa>(forced < 0 ? best : std::min(forced, best));
}

void ForceLowPrecisionIsa(int isa) {
  forced_isa.store(isa < 0 ? -1 : std::min(isa, 2), std::memory_order_relaxed);
}

const char* KernelIsaName(KernelIsa isa) {
  switch (isa) {
    case KernelIsa::kAvx512:
      return "avx512f+fma";
    case KernelIsa::kAvx2:
      return "avx2+fma";
    default:
      return "scalar";
  }
}

// ------------------------------------------------------------------ bulk --

void WidenToFloat(const bf16* src, float* dst, int64_t n) {
#if TFSS_X86
  if (Cpu().avx512f) return WidenBf16Avx512(src, dst, n);
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = Bf16ToFloat(src[i]);
}

void WidenToFloat(const f16* src, float* dst, int64_t n) {
#if TFSS_X86
  if (Cpu().f16c) return WidenF16F16c(src, dst, n);
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = F16ToFloat(src[i]);
}

void NarrowFromFloat(const float* src, bf16* dst, int64_t n) {
#if TFSS_X86
  if (Cpu().avx512f) return NarrowBf16Avx512(src, dst, n);
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = FloatToBf16(src[i]);
}

void NarrowFromFloat(const float* src, f16* dst, int64_t n) {
#if TFSS_X86
  if (Cpu().f16c) return NarrowF16F16c(src, dst, n);
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = FloatToF16(src[i]);
}

}  // namespace tf_sparse_split
