// In-register transpose of a 16 x 16 float tile (AVX-512), shared by the
// transposed CSR build (csr.cc) and the transposed gather (gather.cc).
// Empty without AVX-512F/VL/DQ; the callers then take their scalar paths.
#ifndef TF_SPARSE_SPLIT_CC_CORE_SIMD_TRANSPOSE_H_
#define TF_SPARSE_SPLIT_CC_CORE_SIMD_TRANSPOSE_H_

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tf_sparse_split {

#if defined(__AVX512F__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
// Transposes the 16 x 16 floats of r[0..16) (row i in r[i]) in registers.
inline void Transpose16x16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    const __m512d t0 = _mm512_castps_pd(t[i]), t1 = _mm512_castps_pd(t[i + 1]);
    const __m512d t2 = _mm512_castps_pd(t[i + 2]), t3 = _mm512_castps_pd(t[i + 3]);
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
  }
  for (int h8 = 0; h8 < 16; h8 += 8) {
    for (int i = 0; i < 4; ++i) {
      t[h8 + i] = _mm512_shuffle_f32x4(r[h8 + i], r[h8 + 4 + i], 0x88);
      t[h8 + 4 + i] = _mm512_shuffle_f32x4(r[h8 + i], r[h8 + 4 + i], 0xdd);
    }
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
  }
}
#endif

}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_CORE_SIMD_TRANSPOSE_H_
