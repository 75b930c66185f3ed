// CPU implementation of the kernels declared in sddmm.h.
#include "cc/core/sddmm.h"
#include "cc/core/count.h"
#include "cc/core/gather.h"
#include "cc/core/low_precision.h"
#include "cc/core/uninit_vector.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#define TFSS_SDDMM_X86 1
#else
#define TFSS_SDDMM_X86 0
#endif

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cc/core/spmm.h"  // Bf16DotAvailable

// The bfloat16 dots with vdpbf16ps need a compiler that knows AVX512_BF16
// (as the SpMM dot kernels, spmm.cc); taken only where CPUID reports it.
#if TFSS_SDDMM_X86 && \
    ((defined(__clang__) && __clang_major__ >= 9) || \
     (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 10))
#define TFSS_SDDMM_HAVE_DOT 1
#include <immintrin.h>
#else
#define TFSS_SDDMM_HAVE_DOT 0
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


// Rows per row block of CsrSddmm (of the rows' copies of x in the
// low-precision paths): their bytes fit in kSddmmBlockBytes, half of a
// core's L2 on the machines measured, so that the dots of a block find
// them in L2 while y streams through once per block. Without blocks, x is
// read from L3 for every column once it outgrows L2. On the 2-core Xeon
// (float32 pybind kernel with CSR build, 2 threads, two interleaved runs):
// 1024 x 1024 x 1024 at 60% zeros 28.2-29.0 ms -> 13.7 ms (256 KB blocks:
// 14.6, 2 MB: 15.8); 256 x 2048 x 2048 (2 MB of x) 17.7-18.3 -> 15.6-15.9
// ms at 50% zeros, 11.1 -> 9.7-9.9 at 70%, 3.6-3.7 -> 3.0-3.2 at 90%.
// Depends on the sizes only.
constexpr int64_t kSddmmBlockBytes = int64_t{1} << 20;
inline int64_t SddmmBlockRows(int64_t n_rows, int64_t row_bytes) {
  return std::max<int64_t>(
      1, std::min<int64_t>(n_rows,
                           kSddmmBlockBytes / std::max<int64_t>(1, row_bytes)));
}

// The CSR's pattern by columns (CSC: the transpose, by a counting sort),
// in row blocks: pos[Begin(b, j) .. End(b, j)) are the CSR positions r
// (ascending) of block b (r in [b * rows, (b + 1) * rows)) holding column j.
struct SddmmColumns {
  int64_t k = 0, rows = 1, blocks = 0;
  std::vector<int64_t> col_ptr;  // [k + 1]
  UninitVector<int64_t> pos;     // [nnz]
  std::vector<int64_t> blk;      // [blocks * k]: where block b starts in j
  int64_t Begin(int64_t b, int64_t j) const { return blk[b * k + j]; }
  int64_t End(int64_t b, int64_t j) const {
    return b + 1 < blocks ? blk[(b + 1) * k + j] : col_ptr[j + 1];
  }
};

template <typename T>
void BuildSddmmColumns(const Csr<T>& csr, int64_t n_rows, int64_t k,
                       int64_t row_bytes, SddmmColumns* c) {
  const int64_t nnz = csr.row_ptr[n_rows];
  c->k = k;
  c->rows = SddmmBlockRows(n_rows, row_bytes);
  c->blocks = (n_rows + c->rows - 1) / c->rows;
  c->col_ptr.assign(k + 1, 0);
  for (int64_t p = 0; p < nnz; ++p) ++c->col_ptr[csr.col_idx[p] + 1];
  for (int64_t j = 0; j < k; ++j) c->col_ptr[j + 1] += c->col_ptr[j];
  c->pos.resize(nnz);
  c->blk.resize(static_cast<size_t>(c->blocks) * k);
  std::vector<int64_t> cursor(c->col_ptr.begin(), c->col_ptr.end() - 1);
  for (int64_t r = 0; r < n_rows; ++r) {
    if (r % c->rows == 0)
      std::copy(cursor.begin(), cursor.end(), c->blk.begin() + (r / c->rows) * k);
    for (int64_t p = csr.row_ptr[r]; p < csr.row_ptr[r + 1]; ++p)
      c->pos[cursor[csr.col_idx[p]]++] = r;
  }
}

// visit(j, p0, p1) for the columns j in [j0, j1) of every row block, blocks
// outer, where the block holds column j (p0 < p1): a thread's y[j] is read
// once per block, the block's rows of x stay in L2 across its columns.
template <typename F>
void WalkSddmmColumns(const SddmmColumns& c, int64_t j0, int64_t j1,
                      F&& visit) {
  for (int64_t b = 0; b < c.blocks; ++b)
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t p0 = c.Begin(b, j), p1 = c.End(b, j);
      if (p0 < p1) visit(j, p0, p1);
    }
}

// The low-precision dots, one copy per instruction set (sddmm_lp_dots.inc),
// chosen at run time from CPUID (LowPrecisionIsa); identical bits on all.
namespace lp_scalar {
constexpr int kVecBytes = 4;
constexpr bool kExactFma = true;
#include "cc/core/sddmm_lp_dots.inc"
}  // namespace lp_scalar
#if TFSS_SDDMM_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace lp_avx2 {
constexpr int kVecBytes = 32;
constexpr bool kExactFma = false;
#include "cc/core/sddmm_lp_dots.inc"
}  // namespace lp_avx2
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
namespace lp_avx512 {
constexpr int kVecBytes = 64;
constexpr bool kExactFma = false;
#include "cc/core/sddmm_lp_dots.inc"
}  // namespace lp_avx512
#pragma GCC pop_options
#endif

typedef void (*DotsFn)(const float* const*, const float*, int64_t, float*);

#if TFSS_SDDMM_HAVE_DOT
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")
namespace lp_avx512bf16 {
// res[r] = dot(xr[r][0..n_pad), y[0..n_pad)) for r < R, on the bfloat16
// values as stored (n_pad a multiple of 32, rows zero-padded): lane l of
// two float32 accumulators (32-value blocks alternating) takes the pairs
// (2l, 2l + 1) of its blocks, vdpbf16ps adding the odd product, then the
// even one, each rounded once; the two accumulators are added and the 16
// lanes summed by the float32 dots' fixed tree. Fixed order (independent
// of R and of threads); vdpbf16ps treats denormal inputs, products and
// partial sums as zero.
template <int R>
void DotsBf16(const uint16_t* const* xr, const uint16_t* y, int64_t n_pad,
              float* res) {
  __m512 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  int64_t t = 0;
  for (; t + 64 <= n_pad; t += 64) {
    const __m512bh y0 = (__m512bh)_mm512_load_si512(y + t);
    const __m512bh y1 = (__m512bh)_mm512_load_si512(y + t + 32);
    for (int r = 0; r < R; ++r) {
      a0[r] = _mm512_dpbf16_ps(a0[r], (__m512bh)_mm512_load_si512(xr[r] + t), y0);
      a1[r] = _mm512_dpbf16_ps(a1[r], (__m512bh)_mm512_load_si512(xr[r] + t + 32), y1);
    }
  }
  if (t < n_pad) {
    const __m512bh y0 = (__m512bh)_mm512_load_si512(y + t);
    for (int r = 0; r < R; ++r)
      a0[r] = _mm512_dpbf16_ps(a0[r], (__m512bh)_mm512_load_si512(xr[r] + t), y0);
  }
  for (int r = 0; r < R; ++r) {
    alignas(64) float s[16];
    _mm512_store_ps(s, _mm512_add_ps(a0[r], a1[r]));
    for (int l = 0; l < 8; ++l) s[l] += s[l + 8];
    for (int l = 0; l < 4; ++l) s[l] += s[l + 4];
    s[0] += s[2];
    s[1] += s[3];
    res[r] = s[0] + s[1];
  }
}
void Dots4Bf16(const uint16_t* const* xr, const uint16_t* y, int64_t n_pad,
               float* res) {
  DotsBf16<4>(xr, y, n_pad, res);
}
void Dots1Bf16(const uint16_t* const* xr, const uint16_t* y, int64_t n_pad,
               float* res) {
  DotsBf16<1>(xr, y, n_pad, res);
}
}  // namespace lp_avx512bf16
#pragma GCC pop_options

// CsrSddmmLowPrecision for bfloat16 with vdpbf16ps (Bf16DotAvailable()):
// the rows of x and y are copied as bfloat16 (zero-padded to 32 values,
// 64-byte aligned), not widened; half the bytes and instructions of the
// float32 dots. Same traversal (row blocks, columns of the CSC, rows in
// groups of 4).
void CsrSddmmBf16Dot(const Csr<bf16>& csr, const int64_t* out_rows,
                     int64_t n_rows, const bf16* x, int64_t ldx, const bf16* y,
                     int64_t ldy, int64_t k, int64_t n, bf16* out, int64_t ldo,
                     const ParallelFor& pfor) {
  const int64_t n_pad = (n + 31) / 32 * 32;
  const int64_t nnz = csr.row_ptr[n_rows];
  SddmmColumns cols;
  BuildSddmmColumns(csr, n_rows, k, n_pad * 2, &cols);
  std::unique_ptr<uint16_t[]> xb_mem(new uint16_t[n_rows * n_pad + 32]);
  uint16_t* xb = reinterpret_cast<uint16_t*>(
      (reinterpret_cast<uintptr_t>(xb_mem.get()) + 63) & ~uintptr_t{63});
  pfor(n_rows, n_pad, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      uint16_t* d = xb + r * n_pad;
      std::memcpy(d, x + out_rows[r] * ldx, sizeof(uint16_t) * n);
      std::fill(d + n, d + n_pad, uint16_t{0});
    }
  });
  constexpr int kGroup = 4;
  const int64_t cost = std::max<int64_t>(1, (nnz / k + 1) * n / 2);
  pfor(k, cost, [&](int64_t j0, int64_t j1) {
    std::unique_ptr<uint16_t[]> yb_mem(new uint16_t[n_pad + 32]);
    uint16_t* yb = reinterpret_cast<uint16_t*>(
        (reinterpret_cast<uintptr_t>(yb_mem.get()) + 63) & ~uintptr_t{63});
    std::fill(yb + n, yb + n_pad, uint16_t{0});
    const uint16_t* xr[kGroup];
    float res[kGroup];
    const int64_t* pos = cols.pos.data();
    WalkSddmmColumns(cols, j0, j1, [&](int64_t j, int64_t p0, int64_t p1) {
      std::memcpy(yb, y + j * ldy, sizeof(uint16_t) * n);
      int64_t p = p0;
      for (; p + kGroup <= p1; p += kGroup) {
        for (int r = 0; r < kGroup; ++r) xr[r] = xb + pos[p + r] * n_pad;
        lp_avx512bf16::Dots4Bf16(xr, yb, n_pad, res);
        for (int r = 0; r < kGroup; ++r)
          out[out_rows[pos[p + r]] * ldo + j] = FromFloat<bf16>(res[r]);
      }
      for (; p < p1; ++p) {
        xr[0] = xb + pos[p] * n_pad;
        lp_avx512bf16::Dots1Bf16(xr, yb, n_pad, res);
        out[out_rows[pos[p]] * ldo + j] = FromFloat<bf16>(res[0]);
      }
    });
  });
}
#endif  // TFSS_SDDMM_HAVE_DOT

// CsrSddmm for bfloat16 / half: the rows of x are widened to float32 once
// (zero-padded to a multiple of 32 values), each row of y when its column
// is visited (once per row block); the dots accumulate in float32 and each
// output is rounded once to T.
template <typename T>
void CsrSddmmLowPrecision(const Csr<T>& csr, const int64_t* out_rows,
                          int64_t n_rows, const T* x, int64_t ldx, const T* y,
                          int64_t ldy, int64_t k, int64_t n, T* out,
                          int64_t ldo, const ParallelFor& pfor) {
  const int64_t nnz = csr.row_ptr[n_rows];
  const int64_t n_pad = (n + 31) / 32 * 32;
#if TFSS_SDDMM_HAVE_DOT
  if constexpr (std::is_same<T, bf16>::value) {
    if (Bf16DotAvailable()) {
      CsrSddmmBf16Dot(csr, out_rows, n_rows, x, ldx, y, ldy, k, n, out, ldo,
                      pfor);
      return;
    }
  }
#endif
  SddmmColumns cols;
  BuildSddmmColumns(csr, n_rows, k, n_pad * 4, &cols);
  UninitVector<float> xf(static_cast<size_t>(n_rows) * n_pad);
  pfor(n_rows, 2 * n_pad, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* d = xf.data() + r * n_pad;
      WidenToFloat(x + out_rows[r] * ldx, d, n);
      std::fill(d + n, d + n_pad, 0.0f);
    }
  });
  DotsFn dots4 = lp_scalar::Dots4, dots1 = lp_scalar::Dots1;
#if TFSS_SDDMM_X86
  switch (LowPrecisionIsa()) {
    case KernelIsa::kAvx512:
      dots4 = lp_avx512::Dots4;
      dots1 = lp_avx512::Dots1;
      break;
    case KernelIsa::kAvx2:
      dots4 = lp_avx2::Dots4;
      dots1 = lp_avx2::Dots1;
      break;
    default:
      break;
  }
#endif
  constexpr int kGroup = 4;
  const int64_t cost = std::max<int64_t>(1, (nnz / k + 1) * n);
  pfor(k, cost, [&](int64_t j0, int64_t j1) {
    UninitVector<float> yf(n_pad);
    std::fill(yf.data() + n, yf.data() + n_pad, 0.0f);
    const float* xr[kGroup];
    float res[kGroup];
    const int64_t* pos = cols.pos.data();
    WalkSddmmColumns(cols, j0, j1, [&](int64_t j, int64_t p0, int64_t p1) {
      WidenToFloat(y + j * ldy, yf.data(), n);
      int64_t p = p0;
      for (; p + kGroup <= p1; p += kGroup) {
        for (int r = 0; r < kGroup; ++r) xr[r] = xf.data() + pos[p + r] * n_pad;
        dots4(xr, yf.data(), n_pad, res);
        for (int r = 0; r < kGroup; ++r)
          out[out_rows[pos[p + r]] * ldo + j] = FromFloat<T>(res[r]);
      }
      for (; p < p1; ++p) {
        xr[0] = xf.data() + pos[p] * n_pad;
        dots1(xr, yf.data(), n_pad, res);
        out[out_rows[pos[p]] * ldo + j] = FromFloat<T>(res[0]);
      }
    });
  });
}

}  // namespace

template <typename T>
void CsrSddmm(const Csr<T>& csr, const int64_t* out_rows, int64_t n_rows,
              const T* x, int64_t ldx, const T* y, int64_t ldy, int64_t k,
              int64_t n, T* out, int64_t ldo, const ParallelFor& pfor) {
  if (n_rows == 0 || k == 0) return;
  ZeroRows<T>(out_rows, n_rows, k, out, ldo, pfor);
  const int64_t nnz = csr.row_ptr[n_rows];
  if (nnz == 0 || n == 0) return;  // empty dots are 0
  if constexpr (IsLowPrecision<T>::value) {
    CsrSddmmLowPrecision<T>(csr, out_rows, n_rows, x, ldx, y, ldy, k, n, out,
                            ldo, pfor);
    return;
  } else {
  SddmmColumns cols;
  BuildSddmmColumns(csr, n_rows, k, n * static_cast<int64_t>(sizeof(T)),
                    &cols);
  // Each thread walks a range of columns, block by block (WalkSddmmColumns):
  // y[j] is read once per block, then from L1 for every group of dots of
  // column j. A dot is computed whole by one call, so neither the blocks
  // nor the groups change its bits.
  constexpr int kGroup = 4;
  const int64_t cost = std::max<int64_t>(1, (nnz / k + 1) * n);
  pfor(k, cost, [&](int64_t j0, int64_t j1) {
    const T* xr[kGroup];
    T res[kGroup];
    int64_t rows[kGroup];
    const int64_t* pos = cols.pos.data();
    WalkSddmmColumns(cols, j0, j1, [&](int64_t j, int64_t p0, int64_t p1) {
      const T* yj = y + j * ldy;
      int64_t p = p0;
      for (; p + kGroup <= p1; p += kGroup) {
        for (int r = 0; r < kGroup; ++r) {
          rows[r] = out_rows[pos[p + r]];
          xr[r] = x + rows[r] * ldx;
        }
        SddmmDots<T>::template Run<kGroup>(xr, yj, n, res);
        for (int r = 0; r < kGroup; ++r) out[rows[r] * ldo + j] = res[r];
      }
      for (; p < p1; ++p) {
        rows[0] = out_rows[pos[p]];
        xr[0] = x + rows[0] * ldx;
        SddmmDots<T>::template Run<1>(xr, yj, n, res);
        out[rows[0] * ldo + j] = res[0];
      }
    });
  });
  }
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
      if constexpr (IsLowPrecision<T>::value) {
        // On the bits, branch-free (vectorised): a data-dependent branch per
        // element mispredicts at mid densities and costs more than the GEMM.
        const uint16_t* mb = reinterpret_cast<const uint16_t*>(mrow);
        const uint16_t* sb = reinterpret_cast<const uint16_t*>(srow);
        uint16_t* ob = reinterpret_cast<uint16_t*>(orow);
        for (int64_t j = 0; j < k; ++j) {
          const uint16_t keep =
              static_cast<uint16_t>(-static_cast<int>((mb[j] & 0x7fffu) != 0));
          ob[j] = static_cast<uint16_t>(sb[j] & keep);
        }
      } else {
        for (int64_t j = 0; j < k; ++j)
          orow[j] = !IsZero(mrow[j]) ? srow[j] : T{};
      }
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
TFSS_INSTANTIATE(bf16)
TFSS_INSTANTIATE(f16)
#undef TFSS_INSTANTIATE

}  // namespace tf_sparse_split
