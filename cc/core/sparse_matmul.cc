// CPU implementations of the kernels declared in sparse_matmul.h.
#include "cc/core/sparse_matmul.h"
#include "cc/core/compress.h"

#include <algorithm>
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

}  // namespace

void SerialFor(int64_t total, int64_t /*cost_per_unit*/,
               const std::function<void(int64_t, int64_t)>& fn) {
  if (total > 0) fn(0, total);
}

template <typename T>
int64_t CountNonzeros(const T* a, int64_t phys_rows, int64_t phys_cols,
                      bool transpose_a, int64_t* row_nnz, int64_t* col_nnz,
                      const ParallelFor& pfor) {
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
  std::vector<int32_t> partial(static_cast<size_t>(blocks.count) * phys_cols);
  pfor(blocks.count, phys_cols * std::max<int64_t>(1, blocks.size) * 2,
       [&](int64_t b0, int64_t b1) {
         for (int64_t b = b0; b < b1; ++b) {
           int32_t* pc = partial.data() + b * phys_cols;
           std::fill(pc, pc + phys_cols, 0);
           for (int64_t i = blocks.begin(b); i < blocks.end(b); ++i) {
             const T* row = a + i * phys_cols;
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
  // row. First the CSR of the physical matrix (vectorised compress of its
  // contiguous rows; col_nnz of op(a) are its row counts), then a parallel
  // transposition: each shard owns a range of op rows and walks the physical
  // rows in ascending order, so indices come out sorted. `rows` ascending
  // lets a shard find its entries of a physical row by binary search.
  std::vector<int64_t> prp(phys_rows + 1, 0);
  for (int64_t q = 0; q < phys_rows; ++q) prp[q + 1] = prp[q] + col_nnz[q];
  std::vector<int32_t> pci(prp[phys_rows]);
  std::vector<T> pv(prp[phys_rows]);
  pfor(phys_rows, phys_cols * 2, [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q)
      CompressRow<T>(a + q * phys_cols, phys_cols, pci.data() + prp[q],
                     pv.data() + prp[q]);
  });
  // pos[c]: index in `rows` of physical column c, or -1 if not selected.
  std::vector<int64_t> pos(phys_cols, -1);
  bool ascending = true;
  for (int64_t r = 0; r < n_rows; ++r) {
    pos[rows[r]] = r;
    if (r > 0 && rows[r] <= rows[r - 1]) ascending = false;
  }
  const int64_t per_unit = std::max<int64_t>(1, prp[phys_rows] / n_rows) * 4;
  pfor(n_rows, per_unit, [&](int64_t r0, int64_t r1) {
    std::vector<int64_t> cursor(rp + r0, rp + r1);
    const int32_t c_lo = static_cast<int32_t>(rows[r0]);
    const int32_t c_hi = static_cast<int32_t>(rows[r1 - 1]);
    for (int64_t q = 0; q < phys_rows; ++q) {
      const int32_t* b = pci.data() + prp[q];
      const int32_t* e = pci.data() + prp[q + 1];
      if (ascending) {
        b = std::lower_bound(b, e, c_lo);
        e = std::upper_bound(b, e, c_hi);
      }
      for (const int32_t* it = b; it != e; ++it) {
        const int64_t r = pos[*it];
        if (r < r0 || r >= r1) continue;
        int64_t& p = cursor[r - r0];
        ci[p] = static_cast<int32_t>(q);
        vals[p] = pv[it - pci.data()];
        ++p;
      }
    }
  });
}

namespace {

// Register-blocked micro-kernel width: one output row segment of kVecBytes *
// kVecs bytes lives in vector registers while the nonzeros of the row stream
// through. GCC/Clang vector extensions compile to the widest ISA enabled.
#if defined(__AVX512F__)
constexpr int kVecBytes = 64;
#elif defined(__AVX__)
constexpr int kVecBytes = 32;
#else
constexpr int kVecBytes = 16;
#endif
// Vectors per output row segment: the segment (and a B panel row) is 256
// bytes whatever the ISA.
constexpr int kVecs = 256 / kVecBytes;

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

// Column-block width (elements) of the SpMM tile.
template <typename T>
constexpr int64_t kNb = Vec<T>::kLanes * kVecs;

// Tiles the SpMM aims for (several per thread for balance), and the fewest
// rows a tile's row group may have.
constexpr int64_t kTargetTiles = 16;
constexpr int64_t kMinGroupRows = 64;

// How many nonzeros ahead the SpMM prefetches B rows.
constexpr int64_t kPrefetchDistance = 4;
static_assert(kVecBytes * kVecs == 256, "prefetch covers 4 cache lines");

// Returns the K-block depth: small enough that the B panel block (kb x nb)
// stays in L2 while every row of the tile sweeps over it, large enough that
// a row has several nonzeros per block on average (each visit of a row loads
// and stores its output segment).
template <typename T>
int64_t KBlock(int64_t k, int64_t nnz, int64_t n_rows) {
  const int64_t budget = 512 * 1024;  // bytes of B kept hot
  int64_t kb = budget / (kNb<T> * static_cast<int64_t>(sizeof(T)));
  const double row_density =
      static_cast<double>(nnz) / (static_cast<double>(std::max<int64_t>(1, n_rows)) * k);
  if (row_density > 0) kb = std::max<int64_t>(kb, static_cast<int64_t>(16.0 / row_density));
  return std::max<int64_t>(1, std::min(k, kb));
}

// Rows [r0, r1) of the CSR times the kNb<T>-wide column panel of B starting
// at column c0 (row q at b + q * ldb + c0), written to columns [c0, c0 + kNb)
// of the output rows. K-blocked; cursor has r1 - r0 entries. With `pack`
// (kb * kNb elements), each K block of the panel is first copied to it:
// contiguous rows avoid the cache-set conflicts of a power-of-two ldb (all
// rows of a column block would map to a few sets).
template <typename T>
void SpmmPanel(const Csr<T>& csr, const int64_t* out_rows, int64_t r0,
               int64_t r1, const T* b, int64_t k, int64_t ldb, int64_t c0,
               T* c, int64_t ldc, int64_t kb, int64_t* cursor, T* pack) {
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::kLanes;
  const int64_t* rp = csr.row_ptr.data();
  const int32_t* ci = csr.col_idx.data();
  const T* vals = csr.values.data();
  for (int64_t r = r0; r < r1; ++r) cursor[r - r0] = rp[r];
  for (int64_t k0 = 0; k0 < k; k0 += kb) {
    const int64_t k1 = std::min(k, k0 + kb);
    const bool first = k0 == 0;
    // Row q of the panel block is at bblk + (q - boff) * bld.
    const T* bblk = b + c0;
    int64_t bld = ldb, boff = 0;
    if (pack != nullptr) {
      for (int64_t q = k0; q < k1; ++q)
        std::memcpy(pack + (q - k0) * kNb<T>, b + q * ldb + c0,
                    kNb<T> * sizeof(T));
      bblk = pack;
      bld = kNb<T>;
      boff = k0;
    }
    for (int64_t r = r0; r < r1; ++r) {
      int64_t p = cursor[r - r0];
      const int64_t end = rp[r + 1];
      if (!first && (p == end || ci[p] >= k1)) continue;
      T* crow = c + out_rows[r] * ldc + c0;
      V acc[kVecs];
#pragma GCC unroll 16
      for (int q = 0; q < kVecs; ++q)
        acc[q] = first ? V{} : LoadU<T>(crow + q * L);
      for (; p < end && ci[p] < k1; ++p) {
        const T v = vals[p];
        const T* brow = bblk + (ci[p] - boff) * bld;
        if (p + kPrefetchDistance < end && ci[p + kPrefetchDistance] < k1) {
          // The B rows are visited in a data-dependent order the hardware
          // prefetcher cannot follow: fetch the 4 lines of a coming one.
          const char* next = reinterpret_cast<const char*>(
              bblk + (ci[p + kPrefetchDistance] - boff) * bld);
          __builtin_prefetch(next);
          __builtin_prefetch(next + 64);
          __builtin_prefetch(next + 128);
          __builtin_prefetch(next + 192);
        }
#pragma GCC unroll 16
        for (int q = 0; q < kVecs; ++q) acc[q] += v * LoadU<T>(brow + q * L);
      }
      cursor[r - r0] = p;
#pragma GCC unroll 16
      for (int q = 0; q < kVecs; ++q) StoreU<T>(crow + q * L, acc[q]);
    }
  }
}

// The tail column block [c0, n) narrower than kNb: plain loops, same order.
template <typename T>
void SpmmTail(const Csr<T>& csr, const int64_t* out_rows, int64_t r0,
              int64_t r1, const T* b, int64_t ldb, int64_t c0, int64_t n,
              T* c, int64_t ldc) {
  const int64_t w = n - c0;
  T acc[kNb<T>];
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t j = 0; j < w; ++j) acc[j] = T(0);
    for (int64_t p = csr.row_ptr[r]; p < csr.row_ptr[r + 1]; ++p) {
      const T v = csr.values[p];
      const T* brow = b + static_cast<int64_t>(csr.col_idx[p]) * ldb + c0;
      for (int64_t j = 0; j < w; ++j) acc[j] += v * brow[j];
    }
    T* crow = c + out_rows[r] * ldc + c0;
    for (int64_t j = 0; j < w; ++j) crow[j] = acc[j];
  }
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
  constexpr int64_t nb = kNb<T>;
  const int64_t n_full = n / nb;
  const int64_t n_cblocks = n_full + (n % nb != 0 ? 1 : 0);
  const int64_t nnz = csr.row_ptr[n_rows];
  // Packing pays off once each B row is reused a few times in a tile.
  const int64_t kb = KBlock<T>(k, nnz, n_rows);
  // Tiles: (column block, row group); enough row groups to feed the pool.
  const int64_t max_groups = (n_rows + kMinGroupRows - 1) / kMinGroupRows;
  const int64_t n_groups = std::max<int64_t>(
      1, std::min(max_groups, (kTargetTiles + n_cblocks - 1) / n_cblocks));
  const int64_t group = (n_rows + n_groups - 1) / n_groups;
  const int64_t tiles = n_cblocks * n_groups;
  const bool pack = nnz / n_groups >= 4 * k;
  const int64_t cost =
      std::max<int64_t>(1, (nnz / n_groups) * nb / 4 + group * nb);
  pfor(tiles, cost, [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> cursor(group);
    std::unique_ptr<T[]> pack_buf(pack ? new T[kb * nb] : nullptr);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t cb = t / n_groups, g = t % n_groups;
      const int64_t r0 = g * group, r1 = std::min(n_rows, r0 + group);
      if (r0 >= r1) continue;
      const int64_t c0 = cb * nb;
      if (cb < n_full) {
        SpmmPanel<T>(csr, out_rows, r0, r1, b, k, ldb, c0, c, ldc, kb,
                     cursor.data(), pack_buf.get());
      } else {
        SpmmTail<T>(csr, out_rows, r0, r1, b, ldb, c0, n, c, ldc);
      }
    }
  });
}

template <typename T>
void Sddmm(const T* mask, const T* x, const T* y, int64_t m, int64_t k,
           int64_t n, T* out, const ParallelFor& pfor) {
  if (m == 0 || k == 0) return;
  pfor(m, k * 4 + n, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const T* mrow = mask + i * k;
      const T* xrow = x + i * n;
      T* orow = out + i * k;
      for (int64_t j = 0; j < k; ++j) {
        if (mrow[j] == T(0)) {
          orow[j] = T(0);
          continue;
        }
        const T* yrow = y + j * n;
        T s = T(0);
        for (int64_t t = 0; t < n; ++t) s += xrow[t] * yrow[t];
        orow[j] = s;
      }
    }
  });
}

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
    // out[r, j] = a[col_j, row_r]: walk physical rows (the op's columns) so
    // reads are contiguous, writing a column of out at a time.
    pfor(n_cols, n_rows * 2, [&](int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; ++j) {
        const T* src = a + (cols ? cols[j] : j) * phys_cols;
        for (int64_t r = 0; r < n_rows; ++r)
          out[r * n_cols + j] = src[rows ? rows[r] : r];
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
  template void BuildCsr<T>(const T*, int64_t, int64_t, bool, const int64_t*, \
                            int64_t, const int64_t*, const int64_t*, Csr<T>*, \
                            const ParallelFor&);                              \
  template void CsrSpmm<T>(const Csr<T>&, const int64_t*, int64_t, const T*,  \
                           int64_t, int64_t, int64_t, T*, int64_t,            \
                           const ParallelFor&);                               \
  template void Sddmm<T>(const T*, const T*, const T*, int64_t, int64_t,      \
                         int64_t, T*, const ParallelFor&);                    \
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
