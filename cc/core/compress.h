// Compression of one contiguous run of values into (index, value) pairs,
// shared by the CSR builds of the matmul and conv kernels.
//
// AVX-512 note: the compress-store form (_mm512_mask_compressstoreu_*) is
// microcoded on AMD Zen 4 and cost ~0.55 ms per MB of input whatever the
// number of nonzeros. Here each group of 8 lanes is packed with a
// permutation looked up by its nonzero mask (vpermps) and written with an
// ordinary masked store of the first popcount(mask) lanes, which never
// writes past the nonzeros it appends. (Compressing into a register with
// vcompressps and storing that measured the same, ~0.4 ms per 8 MB on one
// Zen 4 core, 20-25x faster than the compress-store; the permutation form
// avoids vcompress altogether.)
#ifndef TF_SPARSE_SPLIT_CC_CORE_COMPRESS_H_
#define TF_SPARSE_SPLIT_CC_CORE_COMPRESS_H_

#include <cstdint>

#include "cc/core/low_precision.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tf_sparse_split {

// Appends the nonzeros of row[j0..n) (value, and column index + index_base)
// at vals/ci; returns how many. NaN compares unequal to zero, so it is kept.
template <typename T>
inline int64_t CompressRowScalar(const T* row, int64_t j0, int64_t n,
                                 int32_t* ci, T* vals, int32_t index_base = 0) {
  int64_t p = 0;
  for (int64_t j = j0; j < n; ++j) {
    const T v = row[j];
    if (!IsZero(v)) {
      ci[p] = static_cast<int32_t>(j) + index_base;
      vals[p] = v;
      ++p;
    }
  }
  return p;
}

// Appends the nonzeros of row[0..n) at vals/ci (ascending column indices
// index_base + j); returns how many. Writes exactly that many entries of ci
// and vals, nothing beyond. NaN and Inf count as nonzero.
template <typename T>
inline int64_t CompressRow(const T* row, int64_t n, int32_t* ci, T* vals,
                           int32_t index_base = 0) {
  return CompressRowScalar<T>(row, 0, n, ci, vals, index_base);
}

// The 16-bit storage types (bf16, f16): one implementation on the bits
// (zero is +-0: (bits & 0x7fff) == 0), with an AVX-512BW path chosen from
// CPUID at run time (cc/core/csr.cc). Same contract as CompressRow.
int64_t CompressRow16(const uint16_t* row, int64_t n, int32_t* ci,
                      uint16_t* vals, int32_t index_base);

template <>
inline int64_t CompressRow<bf16>(const bf16* row, int64_t n, int32_t* ci,
                                 bf16* vals, int32_t index_base) {
  return CompressRow16(reinterpret_cast<const uint16_t*>(row), n, ci,
                       reinterpret_cast<uint16_t*>(vals), index_base);
}
template <>
inline int64_t CompressRow<f16>(const f16* row, int64_t n, int32_t* ci,
                                f16* vals, int32_t index_base) {
  return CompressRow16(reinterpret_cast<const uint16_t*>(row), n, ci,
                       reinterpret_cast<uint16_t*>(vals), index_base);
}

#if defined(__AVX512F__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
namespace compress_internal {

// kPack.lane[m][0..popcount(m)) = the set bit positions of the 8-bit mask m,
// ascending (a permutation that moves the selected lanes to the front).
struct PackTable {
  alignas(64) uint8_t lane[256][8];
  constexpr PackTable() : lane() {
    for (int m = 0; m < 256; ++m) {
      int p = 0;
      for (int j = 0; j < 8; ++j)
        if ((m >> j) & 1) lane[m][p++] = static_cast<uint8_t>(j);
    }
  }
};
inline constexpr PackTable kPack{};

// The pack permutation of mask m as 8 int32 lanes.
inline __m256i PackPerm(unsigned m) {
  return _mm256_cvtepu8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(kPack.lane[m])));
}

inline __mmask8 LowLanes8(int count) {
  return static_cast<__mmask8>((1u << count) - 1u);
}

// Appends the lanes of v (8 floats, column indices base + 0..7) selected by
// m at vals/ci; returns how many.
inline int Pack8(__m256 v, unsigned m, __m256i base, int32_t* ci,
                 float* vals) {
  const __m256i perm = PackPerm(m);
  const int cnt = __builtin_popcount(m);
  const __mmask8 low = LowLanes8(cnt);
  _mm256_mask_storeu_ps(vals, low, _mm256_permutexvar_ps(perm, v));
  _mm256_mask_storeu_epi32(ci, low, _mm256_add_epi32(perm, base));
  return cnt;
}

inline int Pack8(__m512d v, unsigned m, __m256i base, int32_t* ci,
                 double* vals) {
  const __m256i perm = PackPerm(m);
  const int cnt = __builtin_popcount(m);
  const __mmask8 low = LowLanes8(cnt);
  _mm512_mask_storeu_pd(vals, low,
                        _mm512_permutexvar_pd(_mm512_cvtepi32_epi64(perm), v));
  _mm256_mask_storeu_epi32(ci, low, _mm256_add_epi32(perm, base));
  return cnt;
}

}  // namespace compress_internal

template <>
inline int64_t CompressRow<float>(const float* row, int64_t n, int32_t* ci,
                                  float* vals, int32_t index_base) {
  using compress_internal::Pack8;
  int64_t p = 0, j = 0;
  const __m512 zero = _mm512_setzero_ps();
  for (; j < n; j += 16) {
    const __mmask16 tail =
        n - j >= 16 ? static_cast<__mmask16>(0xffff)
                    : static_cast<__mmask16>((1u << (n - j)) - 1u);
    const __m512 v = _mm512_maskz_loadu_ps(tail, row + j);
    const unsigned mk = _mm512_mask_cmp_ps_mask(tail, v, zero, _CMP_NEQ_UQ);
    const __m256i base = _mm256_set1_epi32(static_cast<int32_t>(j) + index_base);
    p += Pack8(_mm512_castps512_ps256(v), mk & 0xff, base, ci + p, vals + p);
    p += Pack8(_mm512_extractf32x8_ps(v, 1), mk >> 8,
               _mm256_add_epi32(base, _mm256_set1_epi32(8)), ci + p, vals + p);
  }
  return p;
}

template <>
inline int64_t CompressRow<double>(const double* row, int64_t n, int32_t* ci,
                                   double* vals, int32_t index_base) {
  using compress_internal::Pack8;
  int64_t p = 0, j = 0;
  const __m512d zero = _mm512_setzero_pd();
  for (; j < n; j += 8) {
    const __mmask8 tail =
        n - j >= 8 ? static_cast<__mmask8>(0xff)
                   : static_cast<__mmask8>((1u << (n - j)) - 1u);
    const __m512d v = _mm512_maskz_loadu_pd(tail, row + j);
    const unsigned mk = _mm512_mask_cmp_pd_mask(tail, v, zero, _CMP_NEQ_UQ);
    p += Pack8(v, mk, _mm256_set1_epi32(static_cast<int32_t>(j) + index_base),
               ci + p, vals + p);
  }
  return p;
}
#endif

}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_CORE_COMPRESS_H_
