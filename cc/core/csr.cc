// CPU implementation of the kernels declared in csr.h.
#include "cc/core/csr.h"
#include "cc/core/compress.h"
#include "cc/core/low_precision.h"
#include "cc/core/simd_transpose.h"

#include <algorithm>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace tf_sparse_split {

namespace {

// Appends the nonzeros of an h x w tile (h, w <= kSize) of a row-major
// matrix with leading dimension ld, read transposed: for each tile column j
// with slot[j] >= 0, entries (q0 + t, src[t * ld + j]) in ascending t go to
// ci/vals at cursor[j], which advances.
template <typename T>
struct TransposeCompressTile {
  static constexpr int64_t kSize = 16;
  static void Run(const T* src, int64_t ld, int64_t h, int64_t w, int64_t q0,
                  const int64_t* slot, int64_t* cursor, int32_t* ci,
                  T* vals, bool /*by_vector*/) {
    for (int64_t t = 0; t < h; ++t) {
      const T* row = src + t * ld;
      for (int64_t j = 0; j < w; ++j) {
        const T v = row[j];
        if (!IsZero(v) && slot[j] >= 0) {
          ci[cursor[j]] = static_cast<int32_t>(q0 + t);
          vals[cursor[j]++] = v;
        }
      }
    }
  }
};

#if defined(__AVX512F__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
template <>
struct TransposeCompressTile<float> {
  static constexpr int64_t kSize = 16;
  static void Run(const float* src, int64_t ld, int64_t h, int64_t w,
                  int64_t q0, const int64_t* slot, int64_t* cursor,
                  int32_t* ci, float* vals, bool /*by_vector*/) {
    __mmask16 sel = 0;
    for (int64_t j = 0; j < w; ++j)
      sel |= static_cast<__mmask16>((slot[j] >= 0 ? 1u : 0u) << j);
    __m512 r[16];
    __mmask16 nz[16];
    int total = 0;
    const __m512 zero = _mm512_setzero_ps();
    for (int i = 0; i < 16; ++i) {
      r[i] = i < h ? _mm512_maskz_loadu_ps(sel, src + i * ld) : zero;
      nz[i] = _mm512_cmp_ps_mask(r[i], zero, _CMP_NEQ_UQ);
      total += __builtin_popcount(nz[i]);
    }
    if (total == 0) return;
    if (total <= 24) {
      // Few nonzeros: append them one by one (rows ascending).
      for (int i = 0; i < 16; ++i) {
        alignas(64) float row[16];
        if (nz[i] == 0) continue;
        _mm512_store_ps(row, r[i]);
        for (unsigned m = nz[i]; m != 0; m &= m - 1) {
          const int j = __builtin_ctz(m);
          ci[cursor[j]] = static_cast<int32_t>(q0 + i);
          vals[cursor[j]++] = row[j];
        }
      }
      return;
    }
    // Transpose in registers, then compress each column as a row segment.
    Transpose16x16(r);
    const __m256i base_lo = _mm256_set1_epi32(static_cast<int32_t>(q0));
    const __m256i base_hi = _mm256_set1_epi32(static_cast<int32_t>(q0) + 8);
    for (unsigned m = sel; m != 0; m &= m - 1) {
      const int j = __builtin_ctz(m);
      const unsigned mk = _mm512_cmp_ps_mask(r[j], zero, _CMP_NEQ_UQ);
      int64_t& cur = cursor[j];
      cur += compress_internal::Pack8(_mm512_castps512_ps256(r[j]), mk & 0xff,
                                      base_lo, ci + cur, vals + cur);
      cur += compress_internal::Pack8(_mm512_extractf32x8_ps(r[j], 1), mk >> 8,
                                      base_hi, ci + cur, vals + cur);
    }
  }
};
#endif

// ---- 16-bit values: the nonzero test on the bits, lanes from a mask. ----

// Appends the set lanes of `mask` (lane l: value src[l], index base + l),
// ascending.
inline int64_t AppendMasked16(uint64_t mask, const uint16_t* src,
                              int32_t base, int32_t* ci, uint16_t* vals) {
  int64_t p = 0;
  for (; mask != 0; mask &= mask - 1) {
    const int l = __builtin_ctzll(mask);
    ci[p] = base + l;
    vals[p] = src[l];
    ++p;
  }
  return p;
}

int64_t CompressRow16Scalar(const uint16_t* row, int64_t n, int32_t* ci,
                            uint16_t* vals, int32_t index_base) {
  int64_t p = 0;
  for (int64_t j = 0; j < n; ++j) {
    if ((row[j] & 0x7fffu) != 0) {
      ci[p] = static_cast<int32_t>(j) + index_base;
      vals[p++] = row[j];
    }
  }
  return p;
}

// For each tile row t < h: lanes j < w with slot[j] >= 0 and a nonzero at
// src[t * ld + j] append (q0 + t, value) to column j's cursor.
void TransposeCompress16Scalar(const uint16_t* src, int64_t ld, int64_t h,
                               int64_t w, int64_t q0, const int64_t* slot,
                               int64_t* cursor, int32_t* ci, uint16_t* vals) {
  for (int64_t t = 0; t < h; ++t) {
    const uint16_t* row = src + t * ld;
    for (int64_t j = 0; j < w; ++j) {
      if ((row[j] & 0x7fffu) != 0 && slot[j] >= 0) {
        ci[cursor[j]] = static_cast<int32_t>(q0 + t);
        vals[cursor[j]++] = row[j];
      }
    }
  }
}

#if defined(__x86_64__) || defined(__i386__)
__attribute__((target("avx512f,avx512bw"))) int64_t CompressRow16Avx512(
    const uint16_t* row, int64_t n, int32_t* ci, uint16_t* vals,
    int32_t index_base) {
  const __m512i abs = _mm512_set1_epi16(0x7fff);
  int64_t p = 0, j = 0;
  for (; j + 32 <= n; j += 32) {
    const __m512i v = _mm512_loadu_si512(row + j);
    const uint64_t mk = _mm512_test_epi16_mask(v, abs);
    if (mk) p += AppendMasked16(mk, row + j, static_cast<int32_t>(j) + index_base,
                                ci + p, vals + p);
  }
  if (j < n) {
    const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << (n - j)) - 1u);
    const __m512i v = _mm512_maskz_loadu_epi16(tail, row + j);
    const uint64_t mk = _mm512_mask_test_epi16_mask(tail, v, abs);
    if (mk) p += AppendMasked16(mk, row + j, static_cast<int32_t>(j) + index_base,
                                ci + p, vals + p);
  }
  return p;
}

// A 16-bit tile is up to 32 columns wide: one 64-byte load per physical
// row reads a whole cache line (16-column tiles read each line twice, and
// at a power-of-two row stride the line is gone from L1 by the second read).
__attribute__((target("avx512f,avx512bw,avx512vl"))) void
TransposeCompress16Avx512(const uint16_t* src, int64_t ld, int64_t h, int64_t w,
                          int64_t q0, const int64_t* slot, int64_t* cursor,
                          int32_t* ci, uint16_t* vals) {
  uint32_t sel = 0;
  for (int64_t j = 0; j < w; ++j) sel |= (slot[j] >= 0 ? 1u : 0u) << j;
  const __m512i abs = _mm512_set1_epi16(0x7fff);
  for (int64_t t = 0; t < h; ++t) {
    const uint16_t* row = src + t * ld;
    const __m512i v = _mm512_maskz_loadu_epi16(static_cast<__mmask32>(sel), row);
    const int32_t idx = static_cast<int32_t>(q0 + t);
    for (uint32_t mk = _mm512_mask_test_epi16_mask(static_cast<__mmask32>(sel), v, abs);
         mk != 0; mk &= mk - 1) {
      const int j = __builtin_ctz(mk);
      const int64_t at = cursor[j]++;
      ci[at] = idx;
      vals[at] = row[j];
    }
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__AVX512BW__) && defined(__AVX512VBMI2__)
#define TFSS_CSR_TRANSPOSE16_VECTOR 1
// The 16-bit transposed tile in registers (h <= 32 physical rows, w <= 32
// columns, in halves of 16 columns): physical rows 2i and 2i + 1 are
// widened and merged into one vector of 16 32-bit words (row 2i in the low
// halves), the 16 x 16 words are transposed (Transpose16x16), so that word
// vector j holds the 32 entries of column j in row order; its nonzeros are
// compressed in registers (vpcompressw / vpcompressd, no compress-store)
// and appended with masked stores that write only the nonzeros.
void TransposeCompress16Vector(const uint16_t* src, int64_t ld, int64_t h,
                               int64_t w, int64_t q0, const int64_t* slot,
                               int64_t* cursor, int32_t* ci, uint16_t* vals) {
  const __m512i abs = _mm512_set1_epi16(0x7fff);
  const __m256i zero = _mm256_setzero_si256();
  const __m512i base_lo = _mm512_add_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int32_t>(q0)));
  const __m512i base_hi = _mm512_add_epi32(base_lo, _mm512_set1_epi32(16));
  for (int64_t s = 0; s < w; s += 16) {
    const int64_t sw = std::min<int64_t>(16, w - s);
    unsigned sel = 0;
    for (int64_t j = 0; j < sw; ++j) sel |= (slot[s + j] >= 0 ? 1u : 0u) << j;
    if (sel == 0) continue;
    const __mmask16 lm = static_cast<__mmask16>(sel);
    __m512 r[16];
    for (int64_t i = 0; i < 16; ++i) {
      const int64_t t = 2 * i;
      const __m256i e =
          t < h ? _mm256_maskz_loadu_epi16(lm, src + t * ld + s) : zero;
      const __m256i o =
          t + 1 < h ? _mm256_maskz_loadu_epi16(lm, src + (t + 1) * ld + s)
                    : zero;
      r[i] = _mm512_castsi512_ps(
          _mm512_or_si512(_mm512_cvtepu16_epi32(e),
                          _mm512_slli_epi32(_mm512_cvtepu16_epi32(o), 16)));
    }
    Transpose16x16(r);
    for (unsigned m = sel; m != 0; m &= m - 1) {
      const int j = __builtin_ctz(m);
      const __m512i v = _mm512_castps_si512(r[j]);
      const uint32_t mk = _mm512_test_epi16_mask(v, abs);
      if (mk == 0) continue;
      int64_t& cur = cursor[s + j];
      const int n_lo = __builtin_popcount(mk & 0xffffu);
      const int n = __builtin_popcount(mk);
      _mm512_mask_storeu_epi32(
          ci + cur, static_cast<__mmask16>((1u << n_lo) - 1u),
          _mm512_maskz_compress_epi32(static_cast<__mmask16>(mk), base_lo));
      _mm512_mask_storeu_epi32(
          ci + cur + n_lo, static_cast<__mmask16>((1u << (n - n_lo)) - 1u),
          _mm512_maskz_compress_epi32(static_cast<__mmask16>(mk >> 16),
                                      base_hi));
      _mm512_mask_storeu_epi16(
          vals + cur, static_cast<__mmask32>((uint64_t{1} << n) - 1u),
          _mm512_maskz_compress_epi16(static_cast<__mmask32>(mk), v));
      cur += n;
    }
  }
}
#endif

bool Has16BitCompressAvx512() {
  static const bool has = Cpu().avx512f && Cpu().avx512bw;
  return has;
}

template <typename T>
struct TransposeCompressTile16 {
  static constexpr int64_t kSize = 32;
  // by_vector: the tile in registers (TransposeCompress16Vector, where
  // compiled), else one nonzero at a time.
  static void Run(const T* src, int64_t ld, int64_t h, int64_t w, int64_t q0,
                  const int64_t* slot, int64_t* cursor, int32_t* ci, T* vals,
                  bool by_vector) {
    (void)by_vector;
    const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
    uint16_t* v = reinterpret_cast<uint16_t*>(vals);
#if defined(TFSS_CSR_TRANSPOSE16_VECTOR)
    if (by_vector) {
      TransposeCompress16Vector(s, ld, h, w, q0, slot, cursor, ci, v);
      return;
    }
#endif
#if defined(__x86_64__) || defined(__i386__)
    if (Has16BitCompressAvx512()) {
      TransposeCompress16Avx512(s, ld, h, w, q0, slot, cursor, ci, v);
      return;
    }
#endif
    TransposeCompress16Scalar(s, ld, h, w, q0, slot, cursor, ci, v);
  }
};
template <>
struct TransposeCompressTile<bf16> : TransposeCompressTile16<bf16> {};
template <>
struct TransposeCompressTile<f16> : TransposeCompressTile16<f16> {};

}  // namespace

int64_t CompressRow16(const uint16_t* row, int64_t n, int32_t* ci,
                      uint16_t* vals, int32_t index_base) {
#if defined(__x86_64__) || defined(__i386__)
  if (Has16BitCompressAvx512())
    return CompressRow16Avx512(row, n, ci, vals, index_base);
#endif
  return CompressRow16Scalar(row, n, ci, vals, index_base);
}

template <typename T>
void BuildCsr(const T* a, int64_t phys_rows, int64_t phys_cols,
              bool transpose_a, const int64_t* rows, int64_t n_rows,
              const int64_t* row_nnz, const int64_t* col_nnz, Csr<T>* csr,
              const ParallelFor& pfor) {
  csr->row_ptr.assign(n_rows + 1, 0);
  for (int64_t r = 0; r < n_rows; ++r)
    csr->row_ptr[r + 1] = csr->row_ptr[r] + row_nnz[rows[r]];
  const int64_t nnz = csr->row_ptr[n_rows];
  csr->col_idx.resize(nnz);
  csr->values.resize(nnz);
  if (nnz == 0) return;
  int32_t* ci = csr->col_idx.data();
  T* vals = csr->values.data();
  const int64_t* rp = csr->row_ptr.data();
  if (!transpose_a) {
    // Row i of op(a) is physical row i: scan it contiguously.
    pfor(n_rows, phys_cols * 2, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const T* row = a + rows[r] * phys_cols;
        CompressRow<T>(row, phys_cols, ci + rp[r], vals + rp[r]);
      }
    });
    return;
  }
  // Row i of op(a) is physical column i; its column index is the physical
  // row. Tiles of kTile physical rows x kTile physical columns are
  // transposed in registers (or through a small buffer) and each transposed
  // column -- kTile consecutive entries of one row of op(a) -- is compressed
  // like a row segment, straight to its place in the CSR. A shard owns a
  // range of physical column blocks, i.e. of op rows, and walks the physical
  // rows in ascending order, so indices come out sorted and no two threads
  // write the same row.
  constexpr int64_t kT = TransposeCompressTile<T>::kSize;
  constexpr int64_t kW = 4 * kT;  // physical columns per block: 4 tiles wide
  // pos[c]: index in `rows` of physical column c, or -1 if not selected.
  std::vector<int64_t> pos(phys_cols, -1);
  for (int64_t r = 0; r < n_rows; ++r) pos[rows[r]] = r;
  const int64_t col_blocks = (phys_cols + kW - 1) / kW;
  // 16-bit values: tiles in registers from a density of 1/32 of the
  // selected rows (1024 x 4096 bfloat16, one thread, Zen 4: about 1.2x faster
  // than one nonzero at a time at 50% and 90% zeros, 1.3x slower at 99%).
  const bool by_vector = nnz * 32 >= phys_rows * n_rows;
  pfor(col_blocks, phys_rows * kW * 2, [&](int64_t cb0, int64_t cb1) {
    // This shard's physical columns, walked row block by row block:
    // contiguous row segments (prefetcher-friendly), every selected column
    // appending to its own CSR row at cursor[].
    // At most kSuper columns at a time: each is an output stream, and
    // thousands of them thrash the cache and TLB (one thread, a 1024 x 4096
    // float32 matrix at 50%: 19 ms with all 4096 columns at once, 13 ms
    // with 256; loaded machine).
    constexpr int64_t kSuper = 256;
    int64_t cursor[kSuper], slot[kSuper];
    for (int64_t s_lo = cb0 * kW; s_lo < std::min(phys_cols, cb1 * kW);
         s_lo += kSuper) {
      const int64_t s_hi = std::min({phys_cols, cb1 * kW, s_lo + kSuper});
      for (int64_t c = s_lo; c < s_hi; ++c) {
        slot[c - s_lo] = pos[c];
        if (pos[c] >= 0) cursor[c - s_lo] = rp[pos[c]];
      }
      for (int64_t q0 = 0; q0 < phys_rows; q0 += kT) {
        const int64_t h = std::min<int64_t>(kT, phys_rows - q0);
        for (int64_t s0 = s_lo; s0 < s_hi; s0 += kT) {
          const int64_t sw = std::min<int64_t>(kT, s_hi - s0);
          TransposeCompressTile<T>::Run(a + q0 * phys_cols + s0, phys_cols,
                                        h, sw, q0, slot + (s0 - s_lo),
                                        cursor + (s0 - s_lo), ci, vals,
                                        by_vector);
        }
      }
    }
  });
}

#define TFSS_INSTANTIATE(T)                                                   \
  template void BuildCsr<T>(const T*, int64_t, int64_t, bool, const int64_t*, \
                            int64_t, const int64_t*, const int64_t*, Csr<T>*, \
                            const ParallelFor&);

TFSS_INSTANTIATE(float)
TFSS_INSTANTIATE(double)
TFSS_INSTANTIATE(bf16)
TFSS_INSTANTIATE(f16)
#undef TFSS_INSTANTIATE

}  // namespace tf_sparse_split
