// Compression of one contiguous run of values into (index, value) pairs,
// shared by the CSR builds of the matmul and conv kernels.
#ifndef TF_SPARSE_SPLIT_CC_CORE_COMPRESS_H_
#define TF_SPARSE_SPLIT_CC_CORE_COMPRESS_H_

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tf_sparse_split {

// Appends the nonzeros of row[0..n) (value and column index) at vals/ci;
// returns how many. NaN compares unequal to zero, so it is kept.
template <typename T>
inline int64_t CompressRowScalar(const T* row, int64_t j0, int64_t n,
                                 int32_t* ci, T* vals) {
  int64_t p = 0;
  for (int64_t j = j0; j < n; ++j) {
    const T v = row[j];
    if (v != T(0)) {
      ci[p] = static_cast<int32_t>(j);
      vals[p] = v;
      ++p;
    }
  }
  return p;
}

template <typename T>
inline int64_t CompressRow(const T* row, int64_t n, int32_t* ci, T* vals) {
  return CompressRowScalar<T>(row, 0, n, ci, vals);
}

#if defined(__AVX512F__) && defined(__AVX512VL__)
// AVX-512: compress 16 (8) lanes per step with vcompress.
template <>
inline int64_t CompressRow<float>(const float* row, int64_t n, int32_t* ci,
                           float* vals) {
  int64_t p = 0, j = 0;
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                                  13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  const __m512 zero = _mm512_setzero_ps();
  for (; j + 16 <= n; j += 16) {
    const __m512 v = _mm512_loadu_ps(row + j);
    const __mmask16 mk = _mm512_cmp_ps_mask(v, zero, _CMP_NEQ_UQ);
    _mm512_mask_compressstoreu_ps(vals + p, mk, v);
    _mm512_mask_compressstoreu_epi32(ci + p, mk, idx);
    p += __builtin_popcount(mk);
    idx = _mm512_add_epi32(idx, step);
  }
  return p + CompressRowScalar<float>(row, j, n, ci + p, vals + p);
}

template <>
inline int64_t CompressRow<double>(const double* row, int64_t n, int32_t* ci,
                            double* vals) {
  int64_t p = 0, j = 0;
  __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i step = _mm256_set1_epi32(8);
  const __m512d zero = _mm512_setzero_pd();
  for (; j + 8 <= n; j += 8) {
    const __m512d v = _mm512_loadu_pd(row + j);
    const __mmask8 mk = _mm512_cmp_pd_mask(v, zero, _CMP_NEQ_UQ);
    _mm512_mask_compressstoreu_pd(vals + p, mk, v);
    _mm256_mask_compressstoreu_epi32(ci + p, mk, idx);
    p += __builtin_popcount(mk);
    idx = _mm256_add_epi32(idx, step);
  }
  return p + CompressRowScalar<double>(row, j, n, ci + p, vals + p);
}
#endif

}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_CORE_COMPRESS_H_
