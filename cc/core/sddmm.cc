// CPU implementation of the kernels declared in sddmm.h.
#include "cc/core/sddmm.h"
#include "cc/core/count.h"
#include "cc/core/gather.h"

#include <algorithm>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tf_sparse_split {

namespace {

// Dots of R rows xr[0..R) of x with one row y, n values each. The summation
// order of a dot does not depend on R (nor on which other rows share the
// call): deterministic bits whatever the grouping.
template <typename T>
struct SddmmDots {
  template <int R>
  static void Run(const T* const* xr, const T* y, int64_t n, T* res) {
    for (int r = 0; r < R; ++r) {
      T s = T(0);
      for (int64_t t = 0; t < n; ++t) s += xr[r][t] * y[t];
      res[r] = s;
    }
  }
};

#if defined(__AVX512F__)
// Two accumulators per dot over 2 x 16 floats (2 x 8 doubles) per step;
// the tail goes through masked loads (zeros beyond n, never read).
template <>
struct SddmmDots<float> {
  template <int R>
  static void Run(const float* const* xr, const float* y, int64_t n,
                  float* res) {
    __m512 a0[R], a1[R];
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
    int64_t t = 0;
    for (; t + 32 <= n; t += 32) {
      const __m512 y0 = _mm512_loadu_ps(y + t);
      const __m512 y1 = _mm512_loadu_ps(y + t + 16);
      for (int r = 0; r < R; ++r) {
        a0[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xr[r] + t), y0, a0[r]);
        a1[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xr[r] + t + 16), y1, a1[r]);
      }
    }
    if (t + 16 <= n) {
      const __m512 y0 = _mm512_loadu_ps(y + t);
      for (int r = 0; r < R; ++r)
        a0[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xr[r] + t), y0, a0[r]);
      t += 16;
    }
    if (t < n) {
      const __mmask16 mk = static_cast<__mmask16>((1u << (n - t)) - 1u);
      const __m512 y1 = _mm512_maskz_loadu_ps(mk, y + t);
      for (int r = 0; r < R; ++r)
        a1[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, xr[r] + t), y1, a1[r]);
    }
    for (int r = 0; r < R; ++r)
      res[r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
  }
};

template <>
struct SddmmDots<double> {
  template <int R>
  static void Run(const double* const* xr, const double* y, int64_t n,
                  double* res) {
    __m512d a0[R], a1[R];
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_pd();
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) {
      const __m512d y0 = _mm512_loadu_pd(y + t);
      const __m512d y1 = _mm512_loadu_pd(y + t + 8);
      for (int r = 0; r < R; ++r) {
        a0[r] = _mm512_fmadd_pd(_mm512_loadu_pd(xr[r] + t), y0, a0[r]);
        a1[r] = _mm512_fmadd_pd(_mm512_loadu_pd(xr[r] + t + 8), y1, a1[r]);
      }
    }
    if (t + 8 <= n) {
      const __m512d y0 = _mm512_loadu_pd(y + t);
      for (int r = 0; r < R; ++r)
        a0[r] = _mm512_fmadd_pd(_mm512_loadu_pd(xr[r] + t), y0, a0[r]);
      t += 8;
    }
    if (t < n) {
      const __mmask8 mk = static_cast<__mmask8>((1u << (n - t)) - 1u);
      const __m512d y1 = _mm512_maskz_loadu_pd(mk, y + t);
      for (int r = 0; r < R; ++r)
        a1[r] = _mm512_fmadd_pd(_mm512_maskz_loadu_pd(mk, xr[r] + t), y1, a1[r]);
    }
    for (int r = 0; r < R; ++r)
      res[r] = _mm512_reduce_add_pd(_mm512_add_pd(a0[r], a1[r]));
  }
};
#endif  // __AVX512F__

}  // namespace

template <typename T>
void CsrSddmm(const Csr<T>& csr, const int64_t* out_rows, int64_t n_rows,
              const T* x, int64_t ldx, const T* y, int64_t ldy, int64_t k,
              int64_t n, T* out, int64_t ldo, const ParallelFor& pfor) {
  if (n_rows == 0 || k == 0) return;
  ZeroRows<T>(out_rows, n_rows, k, out, ldo, pfor);
  const int64_t nnz = csr.row_ptr[n_rows];
  if (nnz == 0 || n == 0) return;  // empty dots are 0
  // The pattern transposed (CSC): col_ptr[k + 1], and per column the
  // positions r (ascending) of the rows holding it.
  std::vector<int64_t> col_ptr(k + 1, 0);
  for (int64_t p = 0; p < nnz; ++p) ++col_ptr[csr.col_idx[p] + 1];
  for (int64_t j = 0; j < k; ++j) col_ptr[j + 1] += col_ptr[j];
  UninitVector<int64_t> col_rows(nnz);
  {
    std::vector<int64_t> cursor(col_ptr.begin(), col_ptr.end() - 1);
    for (int64_t r = 0; r < n_rows; ++r)
      for (int64_t p = csr.row_ptr[r]; p < csr.row_ptr[r + 1]; ++p)
        col_rows[cursor[csr.col_idx[p]]++] = out_rows[r];
  }
  // Each thread walks a range of columns: y[j] is read once (then from L1
  // for every group of dots of column j); x (the rows of the dots) is
  // reused from L2 across columns.
  constexpr int kGroup = 4;
  const int64_t cost = std::max<int64_t>(1, (nnz / k + 1) * n);
  pfor(k, cost, [&](int64_t j0, int64_t j1) {
    const T* xr[kGroup];
    T res[kGroup];
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t p0 = col_ptr[j], p1 = col_ptr[j + 1];
      const T* yj = y + j * ldy;
      int64_t p = p0;
      for (; p + kGroup <= p1; p += kGroup) {
        for (int r = 0; r < kGroup; ++r) xr[r] = x + col_rows[p + r] * ldx;
        SddmmDots<T>::template Run<kGroup>(xr, yj, n, res);
        for (int r = 0; r < kGroup; ++r) out[col_rows[p + r] * ldo + j] = res[r];
      }
      for (; p < p1; ++p) {
        xr[0] = x + col_rows[p] * ldx;
        SddmmDots<T>::template Run<1>(xr, yj, n, res);
        out[col_rows[p] * ldo + j] = res[0];
      }
    }
  });
}

template <typename T>
void Sddmm(const T* mask, const T* x, const T* y, int64_t m, int64_t k,
           int64_t n, T* out, const ParallelFor& pfor) {
  if (m == 0 || k == 0) return;
  std::vector<int64_t> row_nnz(m), col_nnz(k), rows(m);
  CountNonzeros<T>(mask, m, k, false, row_nnz.data(), col_nnz.data(), pfor);
  for (int64_t i = 0; i < m; ++i) rows[i] = i;
  Csr<T> csr;
  BuildCsr<T>(mask, m, k, false, rows.data(), m, row_nnz.data(),
              col_nnz.data(), &csr, pfor);
  CsrSddmm<T>(csr, rows.data(), m, x, n, y, n, k, n, out, k, pfor);
}

template <typename T>
void MaskedCopyRows(const T* mask, int64_t k, const int64_t* rows,
                    int64_t n_rows, const T* src, T* out, int64_t ldo,
                    const ParallelFor& pfor) {
  if (n_rows == 0 || k == 0) return;
  pfor(n_rows, k * 2, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t i = rows ? rows[r] : r;
      const T* mrow = mask + i * k;
      const T* srow = src + r * k;
      T* orow = out + i * ldo;
      for (int64_t j = 0; j < k; ++j)
        orow[j] = mrow[j] != T(0) ? srow[j] : T(0);
    }
  });
}

#define TFSS_INSTANTIATE(T)                                                   \
  template void CsrSddmm<T>(const Csr<T>&, const int64_t*, int64_t, const T*, \
                            int64_t, const T*, int64_t, int64_t, int64_t, T*, \
                            int64_t, const ParallelFor&);                     \
  template void Sddmm<T>(const T*, const T*, const T*, int64_t, int64_t,      \
                         int64_t, T*, const ParallelFor&);                    \
  template void MaskedCopyRows<T>(const T*, int64_t, const int64_t*, int64_t, \
                                  const T*, T*, int64_t, const ParallelFor&);

TFSS_INSTANTIATE(float)
TFSS_INSTANTIATE(double)
#undef TFSS_INSTANTIATE

}  // namespace tf_sparse_split
