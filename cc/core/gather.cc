// CPU implementation of the kernels declared in gather.h.
#include "cc/core/gather.h"
#include "cc/core/low_precision.h"
#include "cc/core/simd_transpose.h"

#include <algorithm>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tf_sparse_split {

namespace {

// out[r, j] = a[col_j, r] for r in [r0, r0 + rh), j in [j0, j0 + jw) (rh,
// jw <= 16; col_j = cols ? cols[j] : j): one tile of a transposed gather.
template <typename T>
struct TransposeTile {
  static void Run(const T* a, int64_t phys_cols, const int64_t* cols,
                  int64_t j0, int64_t jw, int64_t r0, int64_t rh, T* out,
                  int64_t n_cols) {
    for (int64_t j = j0; j < j0 + jw; ++j) {
      const T* src = a + (cols ? cols[j] : j) * phys_cols;
      for (int64_t r = r0; r < r0 + rh; ++r) out[r * n_cols + j] = src[r];
    }
  }
};

#if defined(__AVX512F__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
// 16 rows of a loaded, transposed in registers, 16 rows of out stored: every
// cache line is read or written whole, once.
template <>
struct TransposeTile<float> {
  static void Run(const float* a, int64_t phys_cols, const int64_t* cols,
                  int64_t j0, int64_t jw, int64_t r0, int64_t rh, float* out,
                  int64_t n_cols) {
    const __mmask16 rmask = static_cast<__mmask16>((1u << rh) - 1u);
    const __mmask16 jmask = static_cast<__mmask16>((1u << jw) - 1u);
    __m512 v[16];
    for (int i = 0; i < 16; ++i) {
      v[i] = i < jw ? _mm512_maskz_loadu_ps(
                          rmask, a + (cols ? cols[j0 + i] : j0 + i) * phys_cols + r0)
                    : _mm512_setzero_ps();
    }
    Transpose16x16(v);
    for (int i = 0; i < rh; ++i)
      _mm512_mask_storeu_ps(out + (r0 + i) * n_cols + j0, jmask, v[i]);
  }
};
#endif

}  // namespace

template <typename T>
void GatherSubmatrix(const T* a, int64_t phys_rows, int64_t phys_cols,
                     bool transpose_a, const int64_t* rows, int64_t n_rows,
                     const int64_t* cols, int64_t n_cols, T* out,
                     const ParallelFor& pfor) {
  if (n_rows == 0 || n_cols == 0) return;
  (void)phys_rows;
  if (!transpose_a) {
    pfor(n_rows, n_cols * 2, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const T* src = a + (rows ? rows[r] : r) * phys_cols;
        T* dst = out + r * n_cols;
        if (cols) {
          for (int64_t j = 0; j < n_cols; ++j) dst[j] = src[cols[j]];
        } else {
          std::memcpy(dst, src, n_cols * sizeof(T));
        }
      }
    });
  } else {
    // out[r, j] = a[col_j, row_r]. Without a row selection: 16 x 16 tiles
    // (TransposeTile), a thread owning 16 columns of out (one cache line
    // of each of its rows) and walking the rows; every line is read or
    // written whole (a column of out at a time touched each line of out 16
    // times, far apart).
    if (rows == nullptr) {
      constexpr int64_t kTile = 16;
      const int64_t col_tiles = (n_cols + kTile - 1) / kTile;
      pfor(col_tiles, n_rows * kTile * 2, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t j0 = t * kTile, jw = std::min(kTile, n_cols - j0);
          for (int64_t r0 = 0; r0 < n_rows; r0 += kTile)
            TransposeTile<T>::Run(a, phys_cols, cols, j0, jw, r0,
                                  std::min(kTile, n_rows - r0), out, n_cols);
        }
      });
      return;
    }
    pfor(n_cols, n_rows * 2, [&](int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; ++j) {
        const T* src = a + (cols ? cols[j] : j) * phys_cols;
        for (int64_t r = 0; r < n_rows; ++r) out[r * n_cols + j] = src[rows[r]];
      }
    });
  }
}

template <typename T>
void ScatterRows(const T* src, const int64_t* out_rows, int64_t n_rows,
                 int64_t n, T* c, int64_t ldc, const ParallelFor& pfor) {
  if (n_rows == 0 || n == 0) return;
  pfor(n_rows, n * 2, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      std::memcpy(c + out_rows[r] * ldc, src + r * n, n * sizeof(T));
  });
}

template <typename T>
void ZeroRows(const int64_t* out_rows, int64_t n_rows, int64_t n, T* c,
              int64_t ldc, const ParallelFor& pfor) {
  if (n_rows == 0 || n == 0) return;
  pfor(n_rows, n, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* row = c + out_rows[r] * ldc;
      std::fill(row, row + n, T{});
    }
  });
}

#define TFSS_INSTANTIATE(T)                                                   \
  template void GatherSubmatrix<T>(const T*, int64_t, int64_t, bool,          \
                                   const int64_t*, int64_t, const int64_t*,   \
                                   int64_t, T*, const ParallelFor&);          \
  template void ScatterRows<T>(const T*, const int64_t*, int64_t, int64_t,    \
                               T*, int64_t, const ParallelFor&);              \
  template void ZeroRows<T>(const int64_t*, int64_t, int64_t, T*, int64_t,    \
                            const ParallelFor&);

TFSS_INSTANTIATE(float)
TFSS_INSTANTIATE(double)
TFSS_INSTANTIATE(bf16)
TFSS_INSTANTIATE(f16)
#undef TFSS_INSTANTIATE

}  // namespace tf_sparse_split
