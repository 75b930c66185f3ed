// CPU implementation of the kernels declared in spmm.h.
#include "cc/core/spmm.h"
#include "cc/core/gather.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace tf_sparse_split {

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

#define TFSS_INSTANTIATE(T)                                                   \
  template void CsrSpmm<T>(const Csr<T>&, const int64_t*, int64_t, const T*,  \
                           int64_t, int64_t, int64_t, T*, int64_t,            \
                           const ParallelFor&);

TFSS_INSTANTIATE(float)
TFSS_INSTANTIATE(double)
#undef TFSS_INSTANTIATE

}  // namespace tf_sparse_split
