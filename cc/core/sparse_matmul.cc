// CPU implementations of the kernels declared in sparse_matmul.h.
#include "cc/core/sparse_matmul.h"
#include "cc/core/compress.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tf_sparse_split {

namespace {

// Splits [0, total) into at most max_blocks equal contiguous blocks; the
// partition depends only on (total, max_blocks), never on the thread count,
// so results computed per block are deterministic.
struct Blocks {
  int64_t total, count, size;
  Blocks(int64_t total_, int64_t max_blocks) : total(total_) {
    count = std::max<int64_t>(1, std::min(total_, max_blocks));
    size = total_ == 0 ? 0 : (total_ + count - 1) / count;
    if (size > 0) count = (total_ + size - 1) / size;
  }
  int64_t begin(int64_t b) const { return std::min(total, b * size); }
  int64_t end(int64_t b) const { return std::min(total, (b + 1) * size); }
};

constexpr int64_t kCountBlocks = 64;

// Appends the nonzeros of an h x w tile (h, w <= kSize) of a row-major
// matrix with leading dimension ld, read transposed: for each tile column j
// with slot[j] >= 0, entries (q0 + t, src[t * ld + j]) in ascending t go to
// ci/vals at cursor[j], which advances.
template <typename T>
struct TransposeCompressTile {
  static constexpr int64_t kSize = 16;
  static void Run(const T* src, int64_t ld, int64_t h, int64_t w, int64_t q0,
                  const int64_t* slot, int64_t* cursor, int32_t* ci,
                  T* vals) {
    for (int64_t t = 0; t < h; ++t) {
      const T* row = src + t * ld;
      for (int64_t j = 0; j < w; ++j) {
        const T v = row[j];
        if (v != T(0) && slot[j] >= 0) {
          ci[cursor[j]] = static_cast<int32_t>(q0 + t);
          vals[cursor[j]++] = v;
        }
      }
    }
  }
};

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

template <>
struct TransposeCompressTile<float> {
  static constexpr int64_t kSize = 16;
  static void Run(const float* src, int64_t ld, int64_t h, int64_t w,
                  int64_t q0, const int64_t* slot, int64_t* cursor,
                  int32_t* ci, float* vals) {
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

}  // namespace

void SerialFor(int64_t total, int64_t /*cost_per_unit*/,
               const std::function<void(int64_t, int64_t)>& fn) {
  if (total > 0) fn(0, total);
}

namespace {

// CountNonzeros over phys_rows rows of phys_cols values, row r starting at
// a + r * pitch (pitch = phys_cols: the whole matrix; stride * phys_cols:
// every stride-th row).
template <typename T>
int64_t CountNonzerosPitched(const T* a, int64_t phys_rows, int64_t phys_cols,
                             int64_t pitch, bool transpose_a, int64_t* row_nnz,
                             int64_t* col_nnz, const ParallelFor& pfor) {
  // Physical row / column counts of a; for transpose_a the roles swap.
  int64_t* prow = transpose_a ? col_nnz : row_nnz;
  int64_t* pcol = transpose_a ? row_nnz : col_nnz;
  std::fill(prow, prow + phys_rows, 0);
  std::fill(pcol, pcol + phys_cols, 0);
  if (phys_rows == 0 || phys_cols == 0) return 0;
  // Enough blocks to feed a thread pool, few enough that the partial column
  // counts of a small matrix stay small (no page-faulting fresh memory).
  const int64_t elems = phys_rows * phys_cols;
  Blocks blocks(phys_rows, std::max<int64_t>(
                               1, std::min<int64_t>(kCountBlocks, elems >> 16)));
  // Per-block partial column counts (int32: a block has < 2^31 rows).
  UninitVector<int32_t> partial(static_cast<size_t>(blocks.count) * phys_cols);
  pfor(blocks.count, phys_cols * std::max<int64_t>(1, blocks.size) * 2,
       [&](int64_t b0, int64_t b1) {
         for (int64_t b = b0; b < b1; ++b) {
           int32_t* pc = partial.data() + b * phys_cols;
           std::fill(pc, pc + phys_cols, 0);
           for (int64_t i = blocks.begin(b); i < blocks.end(b); ++i) {
             const T* row = a + i * pitch;
             int32_t cnt = 0;
             for (int64_t j = 0; j < phys_cols; ++j) {
               const int32_t nz = row[j] != T(0);
               cnt += nz;
               pc[j] += nz;
             }
             prow[i] = cnt;
           }
         }
       });
  // Reduce the partial column counts, in parallel over columns.
  pfor(phys_cols, blocks.count * 2, [&](int64_t j0, int64_t j1) {
    for (int64_t b = 0; b < blocks.count; ++b) {
      const int32_t* pc = partial.data() + b * phys_cols;
      for (int64_t j = j0; j < j1; ++j) pcol[j] += pc[j];
    }
  });
  int64_t total = 0;
  for (int64_t i = 0; i < phys_rows; ++i) total += prow[i];
  return total;
}

}  // namespace

template <typename T>
int64_t CountNonzeros(const T* a, int64_t phys_rows, int64_t phys_cols,
                      bool transpose_a, int64_t* row_nnz, int64_t* col_nnz,
                      const ParallelFor& pfor) {
  return CountNonzerosPitched<T>(a, phys_rows, phys_cols, phys_cols,
                                 transpose_a, row_nnz, col_nnz, pfor);
}

template <typename T>
int64_t CountNonzerosStrided(const T* a, int64_t phys_rows, int64_t phys_cols,
                             int64_t stride, bool transpose_a,
                             int64_t* row_nnz, int64_t* col_nnz,
                             const ParallelFor& pfor) {
  stride = std::max<int64_t>(1, stride);
  const int64_t rows = (phys_rows + stride - 1) / stride;
  return CountNonzerosPitched<T>(a, rows, phys_cols, stride * phys_cols,
                                 transpose_a, row_nnz, col_nnz, pfor);
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
                                        cursor + (s0 - s_lo), ci, vals);
        }
      }
    }
  });
}

namespace {

// Vector width of the SpMM micro-kernels. GCC/Clang vector extensions
// compile to the widest ISA enabled.
#if defined(__AVX512F__)
constexpr int kVecBytes = 64;
#elif defined(__AVX__)
constexpr int kVecBytes = 32;
#else
constexpr int kVecBytes = 16;
#endif

template <typename T>
struct Vec {
  // Unaligned, may-alias vector type: dereferencing a pointer to it compiles
  // to a single unaligned vector load/store.
  typedef T type __attribute__((vector_size(kVecBytes), aligned(alignof(T)),
                                __may_alias__));
  static constexpr int kLanes = kVecBytes / sizeof(T);
};

template <typename T>
inline typename Vec<T>::type LoadU(const T* p) {
  return *reinterpret_cast<const typename Vec<T>::type*>(p);
}
template <typename T>
inline void StoreU(T* p, const typename Vec<T>::type& v) {
  *reinterpret_cast<typename Vec<T>::type*>(p) = v;
}

// A column panel of the output is at most kPanelBytes wide (4 AVX-512
// vectors): one output row segment lives in registers while the nonzeros of
// its row stream through.
constexpr int kPanelBytes = 256;
constexpr int kMaxVecs = kPanelBytes / kVecBytes;

// Tiles the SpMM aims for (several per thread for balance), and the fewest
// rows a tile's row group may have.
constexpr int64_t kTargetTiles = 16;
constexpr int64_t kMinGroupRows = 32;
constexpr int64_t kMaxGroupRows = 1024;

// The tiling of one CsrSpmm call. It depends only on the problem (never on
// the thread count), and the result bits do not depend on it at all: each
// output is the ascending-k sum of its products, carried through memory
// between K blocks.
struct SpmmPlan {
  int64_t kb = 1;        // K-block depth (rows of the packed B block)
  int64_t group = 1;     // rows per row group
  int64_t n_groups = 1;  // row groups
  int64_t n_panels = 1;  // column panels
  int64_t panel = 1;     // columns per panel
};

template <typename T>
SpmmPlan PlanSpmm(int64_t n_rows, int64_t k, int64_t n, int64_t nnz) {
  SpmmPlan p;
  // Measured on 512x4096x1024 (one thread, 50-99% sparsity): 512-byte
  // panels ran ~40% slower, 128-byte ones ~20% slower.
  const int64_t panel = kPanelBytes / sizeof(T);
  p.panel = panel;
  p.n_panels = (n + panel - 1) / panel;
  // The packed B block (kb x panel) should stay in L1 while every row of
  // the group sweeps over it; but each visit of a row loads and stores its
  // output segment, so a row should meet several nonzeros per block.
  const double density =
      static_cast<double>(nnz) / (static_cast<double>(n_rows) * k);
  int64_t kb = 128;
  if (density > 0) kb = std::max<int64_t>(kb, static_cast<int64_t>(64.0 / density));
  // ... but the pack stays in L2 (512 KB): at 99% sparsity a 1 MB pack
  // (kb = 4096) ran ~1.4x slower than kb = 2048 (one thread, 1024 x 4096).
  kb = std::min<int64_t>(kb, (int64_t{512} << 10) / kPanelBytes);
  p.kb = std::max<int64_t>(1, std::min(k, kb));
  const int64_t max_groups = (n_rows + kMinGroupRows - 1) / kMinGroupRows;
  p.n_groups = std::max<int64_t>(
      1, std::min(max_groups, (kTargetTiles + p.n_panels - 1) / p.n_panels));
  // Every K block sweeps the output segments of the whole group: keep them
  // (group x 256 bytes, 256 KB) in L2 rather than L3. (On the loaded
  // 2-core test machine the 4096 x 1024 weight-gradient shape showed no
  // measurable difference either way; this bounds the worst case.)
  p.n_groups = std::max(p.n_groups, (n_rows + kMaxGroupRows - 1) / kMaxGroupRows);
  p.group = (n_rows + p.n_groups - 1) / p.n_groups;
  p.n_groups = (n_rows + p.group - 1) / p.group;
  return p;
}

// Accumulates the nonzeros p in [*pp, end) with ci[p] < k1 of one CSR row
// into acc: acc += vals[p] * B[ci[p]], where B row q is at
// bblk + (q - k0) * W. Advances *pp past them.
template <typename T, int NV>
inline void AccumulateRow(const int32_t* ci, const T* vals, int64_t* pp,
                          int64_t end, int64_t k0, int64_t k1, const T* bblk,
                          typename Vec<T>::type* acc) {
  constexpr int L = Vec<T>::kLanes;
  constexpr int W = NV * L;
  int64_t p = *pp;
  for (; p < end && ci[p] < k1; ++p) {
    const T v = vals[p];
    const T* brow = bblk + (ci[p] - k0) * W;
#pragma GCC unroll 4
    for (int q = 0; q < NV; ++q) acc[q] += v * LoadU<T>(brow + q * L);
  }
  *pp = p;
}

// Two rows at once (independent FMA chains hide the FMA latency): like
// AccumulateRow for rows with cursors *pa / *pb and ends ea / eb.
template <typename T, int NV>
inline void AccumulateTwoRows(const int32_t* ci, const T* vals, int64_t* pa,
                              int64_t ea, int64_t* pb, int64_t eb, int64_t k0,
                              int64_t k1, const T* bblk,
                              typename Vec<T>::type* acc_a,
                              typename Vec<T>::type* acc_b) {
  constexpr int L = Vec<T>::kLanes;
  constexpr int W = NV * L;
  int64_t p = *pa, q = *pb;
  while (p < ea && ci[p] < k1 && q < eb && ci[q] < k1) {
    const T va = vals[p], vb = vals[q];
    const T* ba = bblk + (ci[p] - k0) * W;
    const T* bb = bblk + (ci[q] - k0) * W;
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      acc_a[v] += va * LoadU<T>(ba + v * L);
      acc_b[v] += vb * LoadU<T>(bb + v * L);
    }
    ++p;
    ++q;
  }
  *pa = p;
  *pb = q;
  AccumulateRow<T, NV>(ci, vals, pa, ea, k0, k1, bblk, acc_a);
  AccumulateRow<T, NV>(ci, vals, pb, eb, k0, k1, bblk, acc_b);
}

// B is packed once per call (shared by all tiles) when it takes at most this.
constexpr int64_t kSharedPackBytes = 1 << 20;

// A buffer of `count` T whose start *aligned is 64-byte aligned (a vector
// load that straddles two cache lines costs two).
template <typename T>
std::unique_ptr<T[]> AlignedBuffer(int64_t count, T** aligned) {
  std::unique_ptr<T[]> mem(new T[count + 64 / sizeof(T)]);
  *aligned = reinterpret_cast<T*>(
      (reinterpret_cast<uintptr_t>(mem.get()) + 63) & ~uintptr_t{63});
  return mem;
}

// Copies rows [k0, k1) of columns [c0, c0 + w) of B (leading dimension
// ldb) to dst, row q at dst + (q - k0) * W, zero-padded to W >= w columns.
template <typename T>
void PackPanel(const T* b, int64_t ldb, int64_t c0, int64_t w, int64_t W,
               int64_t k0, int64_t k1, T* dst) {
  for (int64_t q = k0; q < k1; ++q) {
    T* d = dst + (q - k0) * W;
    std::memcpy(d, b + q * ldb + c0, w * sizeof(T));
    if (w < W) std::fill(d + w, d + W, T(0));
  }
}

// Vectors of the kernel that covers a panel of w columns (1, 2 or kMaxVecs).
template <typename T>
int PanelVecs(int64_t w) {
  constexpr int L = Vec<T>::kLanes;
  const int nv = static_cast<int>((w + L - 1) / L);
  return nv <= 1 ? 1 : nv <= 2 ? 2 : kMaxVecs;
}

// Rows [r0, r1) of the CSR times columns [c0, c0 + w) of B (w <= NV * L),
// written to the same columns of the output rows. K-blocked: each block of
// kb rows of that column panel is first packed into `pack` (kb x NV * L,
// zero-padded): contiguous rows stay in L1 (a power-of-two ldb would map all
// rows of a panel to a few cache sets) and the padding lets a narrow tail
// panel use full vectors. cursor has r1 - r0 entries.
template <typename T, int NV>
void SpmmTile(const Csr<T>& csr, const int64_t* out_rows, int64_t r0,
              int64_t r1, const T* b, int64_t k, int64_t ldb, int64_t c0,
              int64_t w, T* c, int64_t ldc, int64_t kb, int64_t* cursor,
              T* pack, const T* packed_panel) {
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::kLanes;
  constexpr int W = NV * L;
  const bool full = w == W;
  const int64_t* rp = csr.row_ptr.data();
  const int32_t* ci = csr.col_idx.data();
  const T* vals = csr.values.data();
  for (int64_t r = r0; r < r1; ++r) cursor[r - r0] = rp[r];
  for (int64_t k0 = 0; k0 < k; k0 += kb) {
    const int64_t k1 = std::min(k, k0 + kb);
    const bool first = k0 == 0;
    const T* bblk = pack;
    if (packed_panel != nullptr) {
      bblk = packed_panel + k0 * W;
    } else {
      PackPanel<T>(b, ldb, c0, w, W, k0, k1, pack);
    }
    // Rows of this block in pairs; a row without nonzeros in the block is
    // skipped (except in the first block, which initialises the output).
    int64_t pending = -1;
    for (int64_t r = r0; r <= r1; ++r) {
      if (r < r1) {
        const int64_t p = cursor[r - r0];
        if (!first && (p == rp[r + 1] || ci[p] >= k1)) continue;
        if (pending < 0) {
          pending = r;
          continue;
        }
      } else if (pending < 0) {
        break;
      }
      // Process `pending` (and r when r < r1).
      const int64_t ra = pending, rb = r < r1 ? r : -1;
      pending = -1;
      alignas(64) T buf_a[W], buf_b[W];
      T* crow_a = c + out_rows[ra] * ldc + c0;
      T* cio_a = full ? crow_a : buf_a;  // a narrow panel goes through buf
      T* crow_b = rb >= 0 ? c + out_rows[rb] * ldc + c0 : nullptr;
      T* cio_b = full ? crow_b : buf_b;
      V acc_a[NV], acc_b[NV];
      if (first) {
        for (int q = 0; q < NV; ++q) acc_a[q] = acc_b[q] = V{};
      } else {
        if (!full) {
          std::memcpy(buf_a, crow_a, w * sizeof(T));
          if (rb >= 0) std::memcpy(buf_b, crow_b, w * sizeof(T));
        }
        for (int q = 0; q < NV; ++q) acc_a[q] = LoadU<T>(cio_a + q * L);
        if (rb >= 0)
          for (int q = 0; q < NV; ++q) acc_b[q] = LoadU<T>(cio_b + q * L);
      }
      if (rb >= 0) {
        AccumulateTwoRows<T, NV>(ci, vals, &cursor[ra - r0], rp[ra + 1],
                                 &cursor[rb - r0], rp[rb + 1], k0, k1, bblk,
                                 acc_a, acc_b);
      } else {
        AccumulateRow<T, NV>(ci, vals, &cursor[ra - r0], rp[ra + 1], k0, k1,
                             bblk, acc_a);
      }
      for (int q = 0; q < NV; ++q) StoreU<T>(cio_a + q * L, acc_a[q]);
      if (!full) std::memcpy(crow_a, buf_a, w * sizeof(T));
      if (rb >= 0) {
        for (int q = 0; q < NV; ++q) StoreU<T>(cio_b + q * L, acc_b[q]);
        if (!full) std::memcpy(crow_b, buf_b, w * sizeof(T));
      }
    }
  }
}

// Dispatches a panel of width w to the narrowest kernel that covers it.
template <typename T>
void SpmmTileAny(const Csr<T>& csr, const int64_t* out_rows, int64_t r0,
                 int64_t r1, const T* b, int64_t k, int64_t ldb, int64_t c0,
                 int64_t w, T* c, int64_t ldc, int64_t kb, int64_t* cursor,
                 T* pack, const T* packed_panel) {
  switch (PanelVecs<T>(w)) {
    case 1:
      SpmmTile<T, 1>(csr, out_rows, r0, r1, b, k, ldb, c0, w, c, ldc, kb,
                     cursor, pack, packed_panel);
      break;
    case 2:
      SpmmTile<T, 2>(csr, out_rows, r0, r1, b, k, ldb, c0, w, c, ldc, kb,
                     cursor, pack, packed_panel);
      break;
    default:
      SpmmTile<T, kMaxVecs>(csr, out_rows, r0, r1, b, k, ldb, c0, w, c, ldc,
                            kb, cursor, pack, packed_panel);
  }
}

// All column panels of B packed one after the other (panel pi at
// buf + off[pi], k rows of PanelVecs(w) * L columns, zero-padded).
template <typename T>
struct PackedB {
  std::unique_ptr<T[]> mem;
  T* data = nullptr;
  std::vector<int64_t> off;
};

template <typename T>
int64_t PackedBSize(int64_t k, int64_t n, int64_t panel) {
  constexpr int L = Vec<T>::kLanes;
  int64_t total = 0;
  for (int64_t c0 = 0; c0 < n; c0 += panel)
    total += k * PanelVecs<T>(std::min(panel, n - c0)) * L;
  return total;
}

template <typename T>
void PackAllPanels(const T* b, int64_t k, int64_t n, int64_t ldb,
                   int64_t panel, const ParallelFor& pfor, PackedB<T>* out) {
  constexpr int L = Vec<T>::kLanes;
  const int64_t n_panels = (n + panel - 1) / panel;
  out->off.assign(n_panels + 1, 0);
  for (int64_t pi = 0; pi < n_panels; ++pi) {
    const int64_t w = std::min(panel, n - pi * panel);
    out->off[pi + 1] = out->off[pi] + k * PanelVecs<T>(w) * L;
  }
  out->mem = AlignedBuffer<T>(out->off[n_panels], &out->data);
  pfor(n_panels, k * panel, [&](int64_t p0, int64_t p1) {
    for (int64_t pi = p0; pi < p1; ++pi) {
      const int64_t w = std::min(panel, n - pi * panel);
      PackPanel<T>(b, ldb, pi * panel, w, PanelVecs<T>(w) * L, 0, k,
                   out->data + out->off[pi]);
    }
  });
}

}  // namespace

template <typename T>
void CsrSpmm(const Csr<T>& csr, const int64_t* out_rows, int64_t n_rows,
             const T* b, int64_t k, int64_t n, int64_t ldb, T* c,
             int64_t ldc, const ParallelFor& pfor) {
  if (n_rows == 0 || n == 0) return;
  if (k == 0) {
    ZeroRows<T>(out_rows, n_rows, n, c, ldc, pfor);
    return;
  }
  const int64_t nnz = csr.row_ptr[n_rows];
  const SpmmPlan plan = PlanSpmm<T>(n_rows, k, n, nnz);
  const int64_t panel = plan.panel;
  const int64_t tiles = plan.n_panels * plan.n_groups;
  // When several row groups share a panel and B is small, B is packed once
  // per call (panel after panel, each k x padded width) instead of once per
  // tile: small-n products would otherwise repack it for every row group.
  const bool shared = plan.n_groups > 1 && PackedBSize<T>(k, n, panel) *
                                                  static_cast<int64_t>(sizeof(T)) <=
                                              kSharedPackBytes;
  PackedB<T> packed;
  if (shared) PackAllPanels<T>(b, k, n, ldb, panel, pfor, &packed);
  const int64_t cost = std::max<int64_t>(
      1, (nnz / plan.n_groups) * panel / 8 + plan.group * panel +
             (shared ? 0 : k * panel / 4));
  pfor(tiles, cost, [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> cursor(plan.group);
    T* pack = nullptr;
    std::unique_ptr<T[]> pack_mem;
    if (!shared) pack_mem = AlignedBuffer<T>(plan.kb * panel, &pack);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t pi = t / plan.n_groups, g = t % plan.n_groups;
      const int64_t r0 = g * plan.group;
      const int64_t r1 = std::min(n_rows, r0 + plan.group);
      const int64_t c0 = pi * panel, w = std::min(panel, n - c0);
      if (r0 >= r1) continue;
      SpmmTileAny<T>(csr, out_rows, r0, r1, b, k, ldb, c0, w, c, ldc,
                     plan.kb, cursor.data(), pack,
                     shared ? packed.data + packed.off[pi] : nullptr);
    }
  });
}

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
      std::fill(row, row + n, T(0));
    }
  });
}

#define TFSS_INSTANTIATE(T)                                                   \
  template int64_t CountNonzeros<T>(const T*, int64_t, int64_t, bool,         \
                                    int64_t*, int64_t*, const ParallelFor&);  \
  template int64_t CountNonzerosStrided<T>(const T*, int64_t, int64_t,        \
                                           int64_t, bool, int64_t*, int64_t*, \
                                           const ParallelFor&);               \
  template void BuildCsr<T>(const T*, int64_t, int64_t, bool, const int64_t*, \
                            int64_t, const int64_t*, const int64_t*, Csr<T>*, \
                            const ParallelFor&);                              \
  template void CsrSpmm<T>(const Csr<T>&, const int64_t*, int64_t, const T*,  \
                           int64_t, int64_t, int64_t, T*, int64_t,            \
                           const ParallelFor&);                               \
  template void CsrSddmm<T>(const Csr<T>&, const int64_t*, int64_t, const T*, \
                            int64_t, const T*, int64_t, int64_t, int64_t, T*, \
                            int64_t, const ParallelFor&);                     \
  template void Sddmm<T>(const T*, const T*, const T*, int64_t, int64_t,      \
                         int64_t, T*, const ParallelFor&);                    \
  template void MaskedCopyRows<T>(const T*, int64_t, const int64_t*, int64_t, \
                                  const T*, T*, int64_t, const ParallelFor&); \
  template void GatherSubmatrix<T>(const T*, int64_t, int64_t, bool,          \
                                   const int64_t*, int64_t, const int64_t*,   \
                                   int64_t, T*, const ParallelFor&);          \
  template void ScatterRows<T>(const T*, const int64_t*, int64_t, int64_t,    \
                               T*, int64_t, const ParallelFor&);              \
  template void ZeroRows<T>(const int64_t*, int64_t, int64_t, T*, int64_t,    \
                            const ParallelFor&);

TFSS_INSTANTIATE(float)
TFSS_INSTANTIATE(double)
#undef TFSS_INSTANTIATE

}  // namespace tf_sparse_split
