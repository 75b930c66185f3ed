// CUDA implementation of the contract in sparse_matmul_cuda.h (see there for
// buffer sizes, layouts and semantics; method after K.-Y. Peng, "Adaptive
// runtime exploiting sparsity in tensor of deep learning on heterogeneous
// systems", NTU 2017).
//
// The whole translation unit is wrapped so that a plain C++ compiler that
// picks the file up through a *.cc glob sees an empty unit: the body is
// compiled only by nvcc (`-x cu`, which defines __CUDACC__), and not when a
// build says GOOGLE_CUDA=0 explicitly. Explicit instantiations for float,
// double, __half and __nv_bfloat16 are at the end of the file; the 16-bit
// types are storage only (element_cuda.cuh): products accumulate in float32
// and each output is rounded once to T, round-to-nearest-even.
#if defined(__CUDACC__) && (!defined(GOOGLE_CUDA) || GOOGLE_CUDA)

#include "sparse_matmul_cuda.h"

#include "element_cuda.cuh"

#include <climits>
#include <cstddef>
#include <cstdint>

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

namespace tf_sparse_split {
namespace {

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int64_t kMaxGridX = INT_MAX;  // gridDim.x limit (2^31 - 1)
constexpr int64_t kMaxGridY = 65535;    // gridDim.y limit

#define TFSS_RETURN_IF_ERROR(expr)          \
  do {                                      \
    const cudaError_t tfss_err_ = (expr);   \
    if (tfss_err_ != cudaSuccess) return tfss_err_; \
  } while (0)

// After a kernel launch: report a bad configuration or earlier async error.
#define TFSS_RETURN_LAUNCH_ERROR() TFSS_RETURN_IF_ERROR(cudaGetLastError())

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline unsigned GridX(int64_t blocks) {
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > kMaxGridX ? kMaxGridX : blocks));
}
inline unsigned GridY(int64_t blocks) {
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > kMaxGridY ? kMaxGridY : blocks));
}
// Rounds a workspace slice up to 256 bytes (cudaMalloc's alignment).
inline size_t AlignUp(size_t bytes) { return (bytes + 255) & ~size_t{255}; }

inline bool Aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

using cuda_elem::Acc;
using cuda_elem::Elem;
using cuda_elem::kVec16;
using cuda_elem::Load;
using cuda_elem::LoadRO;
using cuda_elem::Store;

// ===========================================================================
// CountNonzeros: one pass over the physical [P, Q] matrix. A block is 8 warps
// over a 32-column strip; warp w takes rows r0 + w + 8 t of a 128-row tile
// (4 loads in flight per lane). Physical-row counts: one ballot + popc per
// warp and row, one integer atomicAdd per (row, strip). Physical-column
// counts: per-thread register sums, combined across the 8 warps in shared
// memory, one atomicAdd per (column, block). Integer atomics are exact, so
// the counts are deterministic.
constexpr int kCountWarps = 8;
constexpr int kCountRowsPerWarp = 16;
constexpr int kCountRowsPerBlock = kCountWarps * kCountRowsPerWarp;

template <typename T>
__global__ void __launch_bounds__(kWarp * kCountWarps, 2)
    CountNonzerosKernel(const T* __restrict__ a, int64_t P, int64_t Q,
                        unsigned long long* __restrict__ phys_row_nnz,
                        unsigned long long* __restrict__ phys_col_nnz,
                        unsigned long long* __restrict__ total) {
  const int lane = threadIdx.x;
  const int wy = threadIdx.y;
  __shared__ unsigned long long col_sums[kCountWarps][kWarp];
  unsigned long long block_total = 0;  // only meaningful in warp 0
  for (int64_t strip = blockIdx.x; strip * kWarp < Q; strip += gridDim.x) {
    const int64_t col = strip * kWarp + lane;
    const bool col_ok = col < Q;
    unsigned long long col_count = 0;
    for (int64_t r0 = static_cast<int64_t>(blockIdx.y) * kCountRowsPerBlock; r0 < P;
         r0 += static_cast<int64_t>(gridDim.y) * kCountRowsPerBlock) {
#pragma unroll
      for (int t0 = 0; t0 < kCountRowsPerWarp; t0 += 4) {
        T v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int64_t r = r0 + wy + kCountWarps * (t0 + u);
          v[u] = (col_ok && r < P) ? Elem<T>::Ld(a + r * Q + col) : Elem<T>::Zero();
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int64_t r = r0 + wy + kCountWarps * (t0 + u);
          const bool nz = Elem<T>::Nonzero(v[u]);  // NaN, Inf: counted
          const unsigned bal = __ballot_sync(kFullMask, nz);
          col_count += nz ? 1u : 0u;
          if (lane == 0 && bal != 0u && r < P) {
            atomicAdd(phys_row_nnz + r, static_cast<unsigned long long>(__popc(bal)));
          }
        }
      }
    }
    col_sums[wy][lane] = col_count;
    __syncthreads();
    if (wy == 0) {
      unsigned long long s = 0;
#pragma unroll
      for (int w = 0; w < kCountWarps; ++w) s += col_sums[w][lane];
      if (col_ok && s != 0) atomicAdd(phys_col_nnz + col, s);
      block_total += s;
    }
    __syncthreads();
  }
  if (wy == 0 && total != nullptr) {
#pragma unroll
    for (int off = kWarp / 2; off > 0; off >>= 1) {
      block_total += __shfl_xor_sync(kFullMask, block_total, off);
    }
    if (lane == 0 && block_total != 0) atomicAdd(total, block_total);
  }
}

// ===========================================================================
// CSR build.

// counts[r] = row_nnz[rows ? rows[r] : r] for r < n_rows; counts[n_rows] = 0.
__global__ void GatherRowCountsKernel(const int64_t* __restrict__ row_nnz,
                                      const int64_t* __restrict__ rows,
                                      int64_t n_rows, int64_t* __restrict__ counts) {
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; r <= n_rows;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    counts[r] = r < n_rows ? row_nnz[rows != nullptr ? rows[r] : r] : 0;
  }
}

// Row i of op(a) contiguous (transpose_a = false): one warp per CSR row; a
// chunk of 32 columns is read coalesced, a ballot marks the nonzeros and each
// lane writes its nonzero at dst + (nonzeros in lower lanes): ascending
// column order with no atomics. Four chunks in flight per iteration.
constexpr int kFillWarps = 8;

template <typename T>
__global__ void __launch_bounds__(kWarp * kFillWarps)
    FillCsrRowMajorKernel(const T* __restrict__ a, int64_t k,
                          const int64_t* __restrict__ rows, int64_t n_rows,
                          const int64_t* __restrict__ row_ptr,
                          int32_t* __restrict__ col_idx, T* __restrict__ values) {
  const int lane = threadIdx.x & (kWarp - 1);
  const int warp = threadIdx.x / kWarp;
  const unsigned lower = (1u << lane) - 1u;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kFillWarps + warp; r < n_rows;
       r += static_cast<int64_t>(gridDim.x) * kFillWarps) {
    const int64_t i = rows != nullptr ? rows[r] : r;
    const T* src = a + i * k;
    int64_t dst = row_ptr[r];
    for (int64_t c0 = 0; c0 < k; c0 += 4 * kWarp) {
      T v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int64_t c = c0 + u * kWarp + lane;
        v[u] = c < k ? Elem<T>::Ld(src + c) : Elem<T>::Zero();
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int64_t c = c0 + u * kWarp + lane;
        const bool nz = Elem<T>::Nonzero(v[u]);
        const unsigned bal = __ballot_sync(kFullMask, nz);
        if (nz) {
          const int64_t pos = dst + __popc(bal & lower);
          col_idx[pos] = static_cast<int32_t>(c);
          values[pos] = v[u];
        }
        dst += __popc(bal);
      }
    }
  }
}

// Row i of op(a) strided (transpose_a = true; a is [k, m], element (i, c) at
// a[c * m + i]). A block owns a tile of 32 CSR rows and walks k in steps of
// kFillTChunks * 32 columns: its 8 warps first load the [chunk columns x 32
// rows] slab into shared memory (for each c a warp reads 32 consecutive i:
// coalesced when the rows are consecutive), then each warp takes 4 of the 32
// rows and compacts them from shared memory as FillCsrRowMajorKernel does
// (ballot + popc, ascending c, no atomics). Each row is written by one warp
// in ascending column order, so the output is deterministic; every warp of
// the block is busy and the reads of a are coalesced.
constexpr int kFillTWarps = 8;
constexpr int kFillTRows = kWarp;                        // CSR rows per block
constexpr int kFillTRowsPerWarp = kFillTRows / kFillTWarps;
template <typename T>
constexpr int kFillTChunks = static_cast<int>(32 / sizeof(T));  // 33 KB of smem

template <typename T>
__global__ void __launch_bounds__(kWarp * kFillTWarps)
    FillCsrTransposedKernel(const T* __restrict__ a, int64_t k, int64_t m,
                            const int64_t* __restrict__ rows, int64_t n_rows,
                            const int64_t* __restrict__ row_ptr,
                            int32_t* __restrict__ col_idx, T* __restrict__ values) {
  constexpr int kCols = kFillTChunks<T> * kWarp;  // columns per step
  __shared__ T slab[kCols][kFillTRows + 1];        // +1: no bank conflicts
  const int lane = threadIdx.x & (kWarp - 1);
  const int warp = threadIdx.x / kWarp;
  const unsigned lower = (1u << lane) - 1u;
  for (int64_t r0 = static_cast<int64_t>(blockIdx.x) * kFillTRows; r0 < n_rows;
       r0 += static_cast<int64_t>(gridDim.x) * kFillTRows) {
    // This lane's source row for the loads, and this warp's output cursors.
    const int64_t r_load = r0 + lane;
    const int64_t i_load =
        r_load < n_rows ? (rows != nullptr ? rows[r_load] : r_load) : -1;
    int64_t dst[kFillTRowsPerWarp];
#pragma unroll
    for (int q = 0; q < kFillTRowsPerWarp; ++q) {
      const int64_t r = r0 + warp * kFillTRowsPerWarp + q;
      dst[q] = r < n_rows ? row_ptr[r] : 0;
    }
    for (int64_t c0 = 0; c0 < k; c0 += kCols) {
      // Load: warp w reads columns c0 + w, c0 + w + 8, ... (4 in flight).
      for (int cc0 = warp; cc0 < kCols; cc0 += 4 * kFillTWarps) {
        T v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int cc = cc0 + u * kFillTWarps;
          const int64_t c = c0 + cc;
          v[u] = (cc < kCols && c < k && i_load >= 0) ? Elem<T>::Ld(a + c * m + i_load)
                                                      : Elem<T>::Zero();
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int cc = cc0 + u * kFillTWarps;
          if (cc < kCols) slab[cc][lane] = v[u];
        }
      }
      __syncthreads();
      // Compact: warp w owns rows 4w .. 4w+3 of the tile.
#pragma unroll
      for (int q = 0; q < kFillTRowsPerWarp; ++q) {
        const int rr = warp * kFillTRowsPerWarp + q;
        if (r0 + rr >= n_rows) break;  // warp-uniform
#pragma unroll
        for (int ch = 0; ch < kFillTChunks<T>; ++ch) {
          const int cc = ch * kWarp + lane;
          const T v = slab[cc][rr];  // zero beyond k (padded on load)
          const bool nz = Elem<T>::Nonzero(v);
          const unsigned bal = __ballot_sync(kFullMask, nz);
          if (nz) {
            const int64_t pos = dst[q] + __popc(bal & lower);
            col_idx[pos] = static_cast<int32_t>(c0 + cc);
            values[pos] = v;
          }
          dst[q] += __popc(bal);
        }
      }
      __syncthreads();
    }
  }
}

// ===========================================================================
// Gathers and row moves.

// out[r, c] = op(a)[rows[r], cols[c]] in 32x32 tiles (block 32 x 8). For the
// transposed read the tile goes through shared memory so that both the read
// (along op(a)'s rows = a's contiguous dimension) and the write are coalesced.
template <typename T, bool kTransposed>
__global__ void __launch_bounds__(kWarp * 8)
    GatherSubmatrixKernel(const T* __restrict__ a, int64_t lda,
                          const int64_t* __restrict__ rows, int64_t n_rows,
                          const int64_t* __restrict__ cols, int64_t n_cols,
                          T* __restrict__ out) {
  __shared__ T tile[kWarp][kWarp + 1];
  const int tx = threadIdx.x;
  const int ty = threadIdx.y;
  for (int64_t r0 = static_cast<int64_t>(blockIdx.y) * kWarp; r0 < n_rows;
       r0 += static_cast<int64_t>(gridDim.y) * kWarp) {
    for (int64_t c0 = static_cast<int64_t>(blockIdx.x) * kWarp; c0 < n_cols;
         c0 += static_cast<int64_t>(gridDim.x) * kWarp) {
      if (!kTransposed) {
        for (int dy = ty; dy < kWarp; dy += 8) {
          const int64_t r = r0 + dy;
          const int64_t c = c0 + tx;
          if (r < n_rows && c < n_cols) {
            const int64_t sr = rows != nullptr ? rows[r] : r;
            const int64_t sc = cols != nullptr ? cols[c] : c;
            out[r * n_cols + c] = Elem<T>::Ld(a + sr * lda + sc);
          }
        }
      } else {
        for (int dy = ty; dy < kWarp; dy += 8) {
          const int64_t c = c0 + dy;
          const int64_t r = r0 + tx;
          if (r < n_rows && c < n_cols) {
            const int64_t sr = rows != nullptr ? rows[r] : r;
            const int64_t sc = cols != nullptr ? cols[c] : c;
            tile[dy][tx] = Elem<T>::Ld(a + sc * lda + sr);
          }
        }
        __syncthreads();
        for (int dy = ty; dy < kWarp; dy += 8) {
          const int64_t r = r0 + dy;
          const int64_t c = c0 + tx;
          if (r < n_rows && c < n_cols) out[r * n_cols + c] = tile[tx][dy];
        }
        __syncthreads();
      }
    }
  }
}

// c[out_rows[r], j] = src ? src[r * n + j] : 0 (block 256 over j, grid.y over r).
template <typename T>
__global__ void ScatterRowsKernel(const T* __restrict__ src,
                                  const int64_t* __restrict__ out_rows,
                                  int64_t n_rows, int64_t n, T* __restrict__ c,
                                  int64_t ldc) {
  for (int64_t r = blockIdx.y; r < n_rows; r += gridDim.y) {
    T* dst = c + out_rows[r] * ldc;
    for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n;
         j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      dst[j] = src != nullptr ? src[r * n + j] : Elem<T>::Zero();
    }
  }
}

// ===========================================================================
// Compressed-rows x dense: out row r (= c row out_rows[r] or r) is
//   sum_{p in [ptr[r], ptr[r+1])} val[p] * b[(b_rows ? b_rows[idx[p]] : idx[p]), :]
// This one kernel is the CSR SpMM (b_rows = null) and, fed a CSC, the SpMM^T
// (out rows = columns of A, b_rows maps CSR rows to dY rows).
// One warp per (row, strip of 32 * V columns). See the header for the design.
constexpr int kSpmmWarps = 4;

template <typename T, typename IndexT, int V, bool kAccumulate>
__global__ void __launch_bounds__(kWarp * kSpmmWarps, 4)
    CompressedTimesDenseKernel(const int64_t* __restrict__ ptr,
                               const IndexT* __restrict__ idx,
                               const T* __restrict__ val, int64_t n_rows,
                               const int64_t* __restrict__ out_rows,
                               const int64_t* __restrict__ b_rows,
                               const T* __restrict__ b, int64_t n, int64_t ldb,
                               T* __restrict__ c, int64_t ldc) {
  typedef Acc<T> A;  // float32 for float and the 16-bit types
  const int lane = threadIdx.x & (kWarp - 1);
  const int warp = threadIdx.x / kWarp;
  constexpr int64_t kStrip = static_cast<int64_t>(kWarp) * V;
  const int64_t n_strips = (n + kStrip - 1) / kStrip;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kSpmmWarps + warp; row < n_rows;
       row += static_cast<int64_t>(gridDim.x) * kSpmmWarps) {
    const int64_t beg = ptr[row];
    const int64_t end = ptr[row + 1];
    const int64_t crow = out_rows != nullptr ? out_rows[row] : row;
    for (int64_t s = blockIdx.y; s < n_strips; s += gridDim.y) {
      const int64_t col = s * kStrip + static_cast<int64_t>(lane) * V;
      const bool active = col < n;  // V divides n on the vector path
      A acc[V];
#pragma unroll
      for (int v = 0; v < V; ++v) acc[v] = A(0);
      for (int64_t p0 = beg; p0 < end; p0 += kWarp) {
        const int cnt = static_cast<int>(end - p0 < kWarp ? end - p0 : kWarp);
        int64_t my_off = 0;
        A my_val = A(0);
        if (lane < cnt) {
          const int64_t j = static_cast<int64_t>(idx[p0 + lane]);
          my_off = (b_rows != nullptr ? b_rows[j] : j) * ldb;
          my_val = Elem<T>::ToAcc(val[p0 + lane]);
        }
        int t = 0;
        for (; t + 4 <= cnt; t += 4) {  // cnt is warp-uniform
          int64_t off[4];
          A w[4];
          A bv[4][V];
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            off[u] = __shfl_sync(kFullMask, my_off, t + u);
            w[u] = __shfl_sync(kFullMask, my_val, t + u);
          }
          if (active) {
#pragma unroll
            for (int u = 0; u < 4; ++u) LoadRO(b + off[u] + col, bv[u]);
#pragma unroll
            for (int u = 0; u < 4; ++u) {
#pragma unroll
              for (int v = 0; v < V; ++v) acc[v] = fma(w[u], bv[u][v], acc[v]);
            }
          }
        }
        for (; t < cnt; ++t) {
          const int64_t off = __shfl_sync(kFullMask, my_off, t);
          const A w = __shfl_sync(kFullMask, my_val, t);
          if (active) {
            A bv[V];
            LoadRO(b + off + col, bv);
#pragma unroll
            for (int v = 0; v < V; ++v) acc[v] = fma(w, bv[v], acc[v]);
          }
        }
      }
      if (active) {
        T* dst = c + crow * ldc + col;
        if (kAccumulate) {
          A old[V];
          Load(dst, old);
#pragma unroll
          for (int v = 0; v < V; ++v) acc[v] = old[v] + acc[v];
        }
        Store(dst, acc);
      }
    }
  }
}

// Small n (n <= 16 * kVec16<T>, where a warp of the kernel above would leave
// at least half its lanes idle): the warp splits into P = 32 / L groups of L
// lanes (L = the power of two with L * kVec16 >= n, so one group covers the
// row of b with up to kVec16 columns per lane), and group g takes the
// nonzeros q of the row with (q - beg) % P == g, in ascending order; the P
// partial sums are then combined by a fixed xor butterfly (offsets L, 2L,
// ..., 16). A warp thus streams P rows of b at once. The summation order
// depends on n only (P is chosen from n, not from the load width), so the
// vector (kVecLoad, 16-byte loads of contiguous columns) and scalar (columns
// lig, lig + L, ...) variants give the same bits.
template <typename T, typename IndexT, int P, bool kVecLoad, bool kAccumulate>
__global__ void __launch_bounds__(kWarp * kSpmmWarps, 4)
    CompressedTimesDenseSmallNKernel(const int64_t* __restrict__ ptr,
                                     const IndexT* __restrict__ idx,
                                     const T* __restrict__ val, int64_t n_rows,
                                     const int64_t* __restrict__ out_rows,
                                     const int64_t* __restrict__ b_rows,
                                     const T* __restrict__ b, int64_t n, int64_t ldb,
                                     T* __restrict__ c, int64_t ldc) {
  typedef Acc<T> A;
  constexpr int L = kWarp / P;    // lanes per group
  constexpr int C = kVec16<T>;    // columns per lane
  const int lane = threadIdx.x & (kWarp - 1);
  const int warp = threadIdx.x / kWarp;
  const int grp = lane / L;       // 0 .. P-1
  const int lig = lane % L;       // lane in group
  // Column of this lane's v-th accumulator.
  auto col_of = [&](int v) -> int64_t {
    return kVecLoad ? static_cast<int64_t>(lig) * C + v : static_cast<int64_t>(lig) + L * v;
  };
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kSpmmWarps + warp; row < n_rows;
       row += static_cast<int64_t>(gridDim.x) * kSpmmWarps) {
    const int64_t beg = ptr[row];
    const int64_t end = ptr[row + 1];
    const int64_t crow = out_rows != nullptr ? out_rows[row] : row;
    A acc[C];
#pragma unroll
    for (int v = 0; v < C; ++v) acc[v] = A(0);
    for (int64_t p0 = beg; p0 < end; p0 += kWarp) {
      const int cnt = static_cast<int>(end - p0 < kWarp ? end - p0 : kWarp);
      int64_t my_off = 0;
      A my_val = A(0);
      if (lane < cnt) {
        const int64_t j = static_cast<int64_t>(idx[p0 + lane]);
        my_off = (b_rows != nullptr ? b_rows[j] : j) * ldb;
        my_val = Elem<T>::ToAcc(val[p0 + lane]);
      }
      // Step s: group g handles nonzero t = s * P + g (two steps in flight).
      for (int t0 = 0; t0 < cnt; t0 += 2 * P) {  // warp-uniform
        int64_t off[2];
        A w[2];
        bool ok[2];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int t = t0 + u * P + grp;  // < 32 always (P divides 32)
          off[u] = __shfl_sync(kFullMask, my_off, t & (kWarp - 1));
          w[u] = __shfl_sync(kFullMask, my_val, t & (kWarp - 1));
          ok[u] = t < cnt;
        }
        A bv[2][C];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          if (kVecLoad) {
            if (ok[u] && col_of(0) < n) {
              LoadRO(b + off[u] + col_of(0), bv[u]);
            } else {
#pragma unroll
              for (int v = 0; v < C; ++v) bv[u][v] = A(0);
            }
          } else {
#pragma unroll
            for (int v = 0; v < C; ++v) {
              bv[u][v] = (ok[u] && col_of(v) < n)
                             ? Elem<T>::ToAcc(Elem<T>::Ld(b + off[u] + col_of(v)))
                             : A(0);
            }
          }
        }
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          if (ok[u]) {
#pragma unroll
            for (int v = 0; v < C; ++v) acc[v] = fma(w[u], bv[u][v], acc[v]);
          }
        }
      }
    }
    // Combine the P groups (fixed tree; every group ends with the sum).
#pragma unroll
    for (int off = L; off < kWarp; off <<= 1) {
#pragma unroll
      for (int v = 0; v < C; ++v) acc[v] += __shfl_xor_sync(kFullMask, acc[v], off);
    }
    if (grp == 0) {
      T* dst = c + crow * ldc;
      if (kVecLoad) {
        if (col_of(0) < n) {
          if (kAccumulate) {
            A old[C];
            Load(dst + col_of(0), old);
#pragma unroll
            for (int v = 0; v < C; ++v) acc[v] = old[v] + acc[v];
          }
          Store(dst + col_of(0), acc);
        }
      } else {
#pragma unroll
        for (int v = 0; v < C; ++v) {
          const int64_t col = col_of(v);
          if (col < n) {
            dst[col] = Elem<T>::FromAcc(kAccumulate ? Elem<T>::ToAcc(dst[col]) + acc[v] : acc[v]);
          }
        }
      }
    }
  }
}

// Groups P for the small-n kernel (1: use the strip kernel). Depends on n and
// T only, so that the summation order does not depend on alignment.
template <typename T>
int SmallNGroups(int64_t n) {
  const int64_t lanes = (n + kVec16<T> - 1) / kVec16<T>;
  int L = 1;
  while (L < lanes && L < kWarp) L <<= 1;
  return kWarp / L;
}

template <typename T, typename IndexT, int P>
cudaError_t LaunchSmallN(const int64_t* ptr, const IndexT* idx, const T* val, int64_t n_rows,
                         const int64_t* out_rows, const int64_t* b_rows, const T* b,
                         int64_t n, int64_t ldb, T* c, int64_t ldc, bool vec, bool accumulate,
                         cudaStream_t stream) {
  const dim3 grid(GridX(CeilDiv(n_rows, kSpmmWarps)));
  const dim3 block(kWarp * kSpmmWarps);
#define TFSS_SMALLN(VEC, ACC)                                                        \
  CompressedTimesDenseSmallNKernel<T, IndexT, P, VEC, ACC><<<grid, block, 0, stream>>>( \
      ptr, idx, val, n_rows, out_rows, b_rows, b, n, ldb, c, ldc)
  if (vec) {
    if (accumulate) TFSS_SMALLN(true, true); else TFSS_SMALLN(true, false);
  } else {
    if (accumulate) TFSS_SMALLN(false, true); else TFSS_SMALLN(false, false);
  }
#undef TFSS_SMALLN
  TFSS_RETURN_LAUNCH_ERROR();
  return cudaSuccess;
}

template <typename T, typename IndexT, int V>
cudaError_t LaunchCompressedTimesDense(const int64_t* ptr, const IndexT* idx,
                                       const T* val, int64_t n_rows,
                                       const int64_t* out_rows,
                                       const int64_t* b_rows, const T* b,
                                       int64_t n, int64_t ldb, T* c, int64_t ldc,
                                       bool accumulate, cudaStream_t stream) {
  const dim3 grid(GridX(CeilDiv(n_rows, kSpmmWarps)),
                  GridY(CeilDiv(n, static_cast<int64_t>(kWarp) * V)));
  const dim3 block(kWarp * kSpmmWarps);
  if (accumulate) {
    CompressedTimesDenseKernel<T, IndexT, V, true><<<grid, block, 0, stream>>>(
        ptr, idx, val, n_rows, out_rows, b_rows, b, n, ldb, c, ldc);
  } else {
    CompressedTimesDenseKernel<T, IndexT, V, false><<<grid, block, 0, stream>>>(
        ptr, idx, val, n_rows, out_rows, b_rows, b, n, ldb, c, ldc);
  }
  TFSS_RETURN_LAUNCH_ERROR();
  return cudaSuccess;
}

// Picks the small-n kernel when n <= 16 * kVec16<T>, else the strip kernel;
// the 16-byte path when n, ldb, ldc and both base pointers allow it.
template <typename T, typename IndexT>
cudaError_t CompressedTimesDense(const int64_t* ptr, const IndexT* idx,
                                 const T* val, int64_t n_rows,
                                 const int64_t* out_rows, const int64_t* b_rows,
                                 const T* b, int64_t n, int64_t ldb, T* c,
                                 int64_t ldc, bool accumulate,
                                 cudaStream_t stream) {
  constexpr int V = kVec16<T>;
  const bool vec = n % V == 0 && ldb % V == 0 && ldc % V == 0 && Aligned16(b) && Aligned16(c);
  switch (SmallNGroups<T>(n)) {
#define TFSS_SMALLN_CASE(P)                                                                    \
  case P:                                                                                      \
    return LaunchSmallN<T, IndexT, P>(ptr, idx, val, n_rows, out_rows, b_rows, b, n, ldb, c, \
                                      ldc, vec, accumulate, stream);
    TFSS_SMALLN_CASE(2)
    TFSS_SMALLN_CASE(4)
    TFSS_SMALLN_CASE(8)
    TFSS_SMALLN_CASE(16)
    TFSS_SMALLN_CASE(32)
#undef TFSS_SMALLN_CASE
    default:
      break;  // P = 1: the strip kernel
  }
  if (vec) {
    return LaunchCompressedTimesDense<T, IndexT, V>(ptr, idx, val, n_rows, out_rows, b_rows,
                                                    b, n, ldb, c, ldc, accumulate, stream);
  }
  return LaunchCompressedTimesDense<T, IndexT, 1>(ptr, idx, val, n_rows, out_rows, b_rows, b,
                                                  n, ldb, c, ldc, accumulate, stream);
}

// ===========================================================================
// CSR -> CSC.

__global__ void IotaKernel(int64_t* __restrict__ out, int64_t count) {
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < count;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[p] = p;
  }
}

// col_ptr[j] = number of sorted keys < j, for j in [0, n_cols] (binary search;
// no atomics, no scan).
__global__ void ColPtrFromSortedKeysKernel(const uint32_t* __restrict__ keys,
                                           int64_t nnz, int64_t n_cols,
                                           int64_t* __restrict__ col_ptr) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j <= n_cols;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t lo = 0, hi = nnz;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (static_cast<int64_t>(keys[mid]) < j) lo = mid + 1; else hi = mid;
    }
    col_ptr[j] = lo;
  }
}

// For CSC slot q holding CSR position p = perm[q]: its CSR row is the last r
// with row_ptr[r] <= p (binary search; empty rows share offsets and are
// skipped by taking the last), and its value is values[p].
template <typename T>
__global__ void GatherCscKernel(const int64_t* __restrict__ perm, int64_t nnz,
                                const int64_t* __restrict__ row_ptr, int64_t n_rows,
                                const T* __restrict__ values,
                                int32_t* __restrict__ csc_row_idx,
                                T* __restrict__ csc_values) {
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; q < nnz;
       q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t p = perm[q];
    int64_t lo = 0, hi = n_rows + 1;  // first index with row_ptr > p
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (row_ptr[mid] <= p) lo = mid + 1; else hi = mid;
    }
    csc_row_idx[q] = static_cast<int32_t>(lo - 1);
    csc_values[q] = values[p];
  }
}

// Number of key bits the radix sort must look at for keys in [0, n_cols).
inline int KeyBits(int64_t n_cols) {
  int bits = 1;
  while (bits < 32 && (int64_t{1} << bits) < n_cols) ++bits;
  return bits;
}

struct CscScratch {
  uint32_t* keys_out;
  int64_t* perm_in;
  int64_t* perm_out;
  void* cub_temp;
  size_t cub_bytes;
};

// Lays out CsrToCsc's scratch in `base` (null: only computes the size).
cudaError_t LayoutCscScratch(void* base, int64_t n_cols, int64_t nnz, CscScratch* s,
                             size_t* total) {
  size_t cub_bytes = 0;
  if (nnz > 0) {
    TFSS_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairs(
        nullptr, cub_bytes, static_cast<const uint32_t*>(nullptr),
        static_cast<uint32_t*>(nullptr), static_cast<const int64_t*>(nullptr),
        static_cast<int64_t*>(nullptr), nnz, 0, KeyBits(n_cols)));
  }
  const size_t n = static_cast<size_t>(nnz);
  const size_t keys_bytes = AlignUp(n * sizeof(uint32_t));
  const size_t perm_bytes = AlignUp(n * sizeof(int64_t));
  *total = keys_bytes + 2 * perm_bytes + AlignUp(cub_bytes);
  if (s != nullptr) {
    char* p = static_cast<char*>(base);
    s->keys_out = reinterpret_cast<uint32_t*>(p);
    s->perm_in = reinterpret_cast<int64_t*>(p + keys_bytes);
    s->perm_out = reinterpret_cast<int64_t*>(p + keys_bytes + perm_bytes);
    s->cub_temp = p + keys_bytes + 2 * perm_bytes;
    s->cub_bytes = cub_bytes;
  }
  return cudaSuccess;
}

// ===========================================================================
// SDDMM.
constexpr int kSddmmWarps = 8;

// n > 32: the warp computes each live dot together. Lane l accumulates the
// groups of G = 16 / sizeof(T) elements starting at G * l, G * (l + 32), ...
// in order, then a fixed butterfly sums the lanes. kVecLoad only selects
// 16-byte loads (when n % G == 0 and x, y are 16-byte aligned); the order of
// the sum is the same either way, so the bits depend on n alone, not on the
// alignment of the buffers.
template <typename T, bool kVecLoad>
__global__ void __launch_bounds__(kWarp * kSddmmWarps)
    SddmmWarpDotKernel(const T* __restrict__ mask, const T* __restrict__ x,
                       const T* __restrict__ y, int64_t m, int64_t k, int64_t n,
                       T* __restrict__ out) {
  typedef Acc<T> A;
  const int lane = threadIdx.x & (kWarp - 1);
  const int warp = threadIdx.x / kWarp;
  const int64_t tiles_per_row = (k + kWarp - 1) / kWarp;
  const int64_t n_tiles = m * tiles_per_row;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * kSddmmWarps + warp; g < n_tiles;
       g += static_cast<int64_t>(gridDim.x) * kSddmmWarps) {
    const int64_t i = g / tiles_per_row;
    const int64_t j0 = (g - i * tiles_per_row) * kWarp;
    const int64_t j = j0 + lane;
    const bool live = j < k && Elem<T>::Nonzero(Elem<T>::Ld(mask + i * k + j));
    unsigned bal = __ballot_sync(kFullMask, live);
    const T* xi = x + i * n;
    A res = A(0);
    while (bal != 0u) {  // warp-uniform
      const int src = __ffs(bal) - 1;
      bal &= bal - 1u;
      const T* yj = y + (j0 + src) * n;
      A part = A(0);
      constexpr int G = kVec16<T>;
      for (int64_t t = static_cast<int64_t>(lane) * G; t < n; t += static_cast<int64_t>(kWarp) * G) {
        if (kVecLoad) {
          A xv[G], yv[G];
          LoadRO(xi + t, xv);
          LoadRO(yj + t, yv);
#pragma unroll
          for (int v = 0; v < G; ++v) part = fma(xv[v], yv[v], part);
        } else {
#pragma unroll
          for (int v = 0; v < G; ++v) {
            if (t + v < n) {
              part = fma(Elem<T>::ToAcc(Elem<T>::Ld(xi + t + v)),
                         Elem<T>::ToAcc(Elem<T>::Ld(yj + t + v)), part);
            }
          }
        }
      }
#pragma unroll
      for (int off = kWarp / 2; off > 0; off >>= 1) {
        part += __shfl_xor_sync(kFullMask, part, off);
      }
      if (lane == src) res = part;
    }
    if (j < k) out[i * k + j] = Elem<T>::FromAcc(res);
  }
}

// n <= 32: each lane computes its own live dot serially (x[i, :] is a warp
// broadcast; the 32 rows of y a warp reads are contiguous in memory).
template <typename T>
__global__ void __launch_bounds__(kWarp * kSddmmWarps)
    SddmmLaneDotKernel(const T* __restrict__ mask, const T* __restrict__ x,
                       const T* __restrict__ y, int64_t m, int64_t k, int64_t n,
                       T* __restrict__ out) {
  typedef Acc<T> A;
  const int lane = threadIdx.x & (kWarp - 1);
  const int warp = threadIdx.x / kWarp;
  const int64_t tiles_per_row = (k + kWarp - 1) / kWarp;
  const int64_t n_tiles = m * tiles_per_row;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * kSddmmWarps + warp; g < n_tiles;
       g += static_cast<int64_t>(gridDim.x) * kSddmmWarps) {
    const int64_t i = g / tiles_per_row;
    const int64_t j = (g - i * tiles_per_row) * kWarp + lane;
    if (j >= k) continue;
    A res = A(0);
    if (Elem<T>::Nonzero(Elem<T>::Ld(mask + i * k + j))) {
      const T* xi = x + i * n;
      const T* yj = y + j * n;
      for (int64_t t = 0; t < n; ++t) {
        res = fma(Elem<T>::ToAcc(Elem<T>::Ld(xi + t)), Elem<T>::ToAcc(Elem<T>::Ld(yj + t)), res);
      }
    }
    out[i * k + j] = Elem<T>::FromAcc(res);
  }
}

}  // namespace

// ===========================================================================
// Public entry points.

template <typename T>
cudaError_t CountNonzerosGpu(const T* a, int64_t phys_rows, int64_t phys_cols,
                             bool transpose_a, int64_t* row_nnz, int64_t* col_nnz,
                             int64_t* total_nnz, cudaStream_t stream) {
  if (phys_rows < 0 || phys_cols < 0) return cudaErrorInvalidValue;
  const int64_t m = transpose_a ? phys_cols : phys_rows;
  const int64_t k = transpose_a ? phys_rows : phys_cols;
  if ((m > 0 && row_nnz == nullptr) || (k > 0 && col_nnz == nullptr) ||
      (m > 0 && k > 0 && a == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (m > 0) TFSS_RETURN_IF_ERROR(cudaMemsetAsync(row_nnz, 0, m * sizeof(int64_t), stream));
  if (k > 0) TFSS_RETURN_IF_ERROR(cudaMemsetAsync(col_nnz, 0, k * sizeof(int64_t), stream));
  if (total_nnz != nullptr) {
    TFSS_RETURN_IF_ERROR(cudaMemsetAsync(total_nnz, 0, sizeof(int64_t), stream));
  }
  if (m == 0 || k == 0) return cudaSuccess;
  // Counts of physical rows / columns; op(a)'s are these or swapped.
  int64_t* phys_row = transpose_a ? col_nnz : row_nnz;
  int64_t* phys_col = transpose_a ? row_nnz : col_nnz;
  const dim3 grid(GridX(CeilDiv(phys_cols, kWarp)), GridY(CeilDiv(phys_rows, kCountRowsPerBlock)));
  const dim3 block(kWarp, kCountWarps);
  CountNonzerosKernel<T><<<grid, block, 0, stream>>>(
      a, phys_rows, phys_cols, reinterpret_cast<unsigned long long*>(phys_row),
      reinterpret_cast<unsigned long long*>(phys_col),
      reinterpret_cast<unsigned long long*>(total_nnz));
  TFSS_RETURN_LAUNCH_ERROR();
  return cudaSuccess;
}

cudaError_t BuildCsrRowPtrWorkspaceBytes(int64_t n_rows, size_t* bytes) {
  if (n_rows < 0 || bytes == nullptr) return cudaErrorInvalidValue;
  size_t cub_bytes = 0;
  TFSS_RETURN_IF_ERROR(cub::DeviceScan::ExclusiveSum(
      nullptr, cub_bytes, static_cast<const int64_t*>(nullptr), static_cast<int64_t*>(nullptr),
      n_rows + 1));
  *bytes = AlignUp(static_cast<size_t>(n_rows + 1) * sizeof(int64_t)) + AlignUp(cub_bytes);
  return cudaSuccess;
}

cudaError_t BuildCsrRowPtrGpu(const int64_t* row_nnz, const int64_t* rows, int64_t n_rows,
                              int64_t* row_ptr, void* workspace, size_t workspace_bytes,
                              cudaStream_t stream) {
  if (n_rows < 0 || row_ptr == nullptr || (n_rows > 0 && row_nnz == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (n_rows == 0) return cudaMemsetAsync(row_ptr, 0, sizeof(int64_t), stream);
  size_t need = 0;
  TFSS_RETURN_IF_ERROR(BuildCsrRowPtrWorkspaceBytes(n_rows, &need));
  if (workspace == nullptr || workspace_bytes < need) return cudaErrorInvalidValue;
  int64_t* counts = static_cast<int64_t*>(workspace);
  const size_t counts_bytes = AlignUp(static_cast<size_t>(n_rows + 1) * sizeof(int64_t));
  void* cub_temp = static_cast<char*>(workspace) + counts_bytes;
  size_t cub_bytes = workspace_bytes - counts_bytes;
  GatherRowCountsKernel<<<GridX(CeilDiv(n_rows + 1, 256)), 256, 0, stream>>>(row_nnz, rows,
                                                                           n_rows, counts);
  TFSS_RETURN_LAUNCH_ERROR();
  return cub::DeviceScan::ExclusiveSum(cub_temp, cub_bytes, static_cast<const int64_t*>(counts),
                                       row_ptr, n_rows + 1,
                                       stream);
}

template <typename T>
cudaError_t FillCsrGpu(const T* a, int64_t phys_rows, int64_t phys_cols, bool transpose_a,
                       const int64_t* rows, int64_t n_rows, const int64_t* row_ptr,
                       int32_t* col_idx, T* values, cudaStream_t stream) {
  if (phys_rows < 0 || phys_cols < 0 || n_rows < 0) return cudaErrorInvalidValue;
  const int64_t m = transpose_a ? phys_cols : phys_rows;
  const int64_t k = transpose_a ? phys_rows : phys_cols;
  if (k > INT32_MAX) return cudaErrorInvalidValue;  // int32 column indices
  if (rows == nullptr && n_rows > m) return cudaErrorInvalidValue;
  if (n_rows == 0 || k == 0) return cudaSuccess;   // no entries to write
  if (m == 0 || a == nullptr || row_ptr == nullptr) return cudaErrorInvalidValue;
  if (!transpose_a) {
    FillCsrRowMajorKernel<T><<<GridX(CeilDiv(n_rows, kFillWarps)), kWarp * kFillWarps, 0,
                               stream>>>(a, k, rows, n_rows, row_ptr, col_idx, values);
  } else {
    FillCsrTransposedKernel<T><<<GridX(CeilDiv(n_rows, kFillTRows)), kWarp * kFillTWarps, 0,
                                 stream>>>(a, k, m, rows, n_rows, row_ptr, col_idx, values);
  }
  TFSS_RETURN_LAUNCH_ERROR();
  return cudaSuccess;
}

template <typename T>
cudaError_t GatherSubmatrixGpu(const T* a, int64_t phys_rows, int64_t phys_cols,
                               bool transpose_a, const int64_t* rows, int64_t n_rows,
                               const int64_t* cols, int64_t n_cols, T* out,
                               cudaStream_t stream) {
  if (phys_rows < 0 || phys_cols < 0 || n_rows < 0 || n_cols < 0) return cudaErrorInvalidValue;
  const int64_t m = transpose_a ? phys_cols : phys_rows;
  const int64_t k = transpose_a ? phys_rows : phys_cols;
  if ((rows == nullptr && n_rows > m) || (cols == nullptr && n_cols > k)) {
    return cudaErrorInvalidValue;
  }
  if (n_rows == 0 || n_cols == 0) return cudaSuccess;
  if (a == nullptr || out == nullptr) return cudaErrorInvalidValue;
  const dim3 grid(GridX(CeilDiv(n_cols, kWarp)), GridY(CeilDiv(n_rows, kWarp)));
  const dim3 block(kWarp, 8);
  if (!transpose_a) {
    GatherSubmatrixKernel<T, false><<<grid, block, 0, stream>>>(a, phys_cols, rows, n_rows,
                                                                cols, n_cols, out);
  } else {
    GatherSubmatrixKernel<T, true><<<grid, block, 0, stream>>>(a, phys_cols, rows, n_rows, cols,
                                                               n_cols, out);
  }
  TFSS_RETURN_LAUNCH_ERROR();
  return cudaSuccess;
}

template <typename T>
cudaError_t CompactColumnsGpu(const T* a, int64_t a_phys_rows, int64_t a_phys_cols,
                              bool transpose_a, const T* b, int64_t b_phys_rows,
                              int64_t b_phys_cols, bool transpose_b, const int64_t* cols,
                              int64_t n_cols, T* a_out, T* b_out, cudaStream_t stream) {
  if (n_cols < 0 || (n_cols > 0 && cols == nullptr)) return cudaErrorInvalidValue;
  const int64_t m = transpose_a ? a_phys_cols : a_phys_rows;
  const int64_t n = transpose_b ? b_phys_rows : b_phys_cols;
  // a_out = op(a)[:, cols]; b_out = op(b)[cols, :] (cols index op(b)'s rows).
  TFSS_RETURN_IF_ERROR(GatherSubmatrixGpu<T>(a, a_phys_rows, a_phys_cols, transpose_a, nullptr,
                                             m, cols, n_cols, a_out, stream));
  return GatherSubmatrixGpu<T>(b, b_phys_rows, b_phys_cols, transpose_b, cols, n_cols, nullptr,
                               n, b_out, stream);
}

template <typename T>
cudaError_t ScatterRowsGpu(const T* src, const int64_t* out_rows, int64_t n_rows, int64_t n,
                           T* c, int64_t ldc, cudaStream_t stream) {
  if (n_rows < 0 || n < 0 || ldc < n) return cudaErrorInvalidValue;
  if (n_rows == 0 || n == 0) return cudaSuccess;
  if (src == nullptr || out_rows == nullptr || c == nullptr) return cudaErrorInvalidValue;
  ScatterRowsKernel<T><<<dim3(GridX(CeilDiv(n, 256)), GridY(n_rows)), 256, 0, stream>>>(
      src, out_rows, n_rows, n, c, ldc);
  TFSS_RETURN_LAUNCH_ERROR();
  return cudaSuccess;
}

template <typename T>
cudaError_t ZeroRowsGpu(const int64_t* out_rows, int64_t n_rows, int64_t n, T* c, int64_t ldc,
                        cudaStream_t stream) {
  if (n_rows < 0 || n < 0 || ldc < n) return cudaErrorInvalidValue;
  if (n_rows == 0 || n == 0) return cudaSuccess;
  if (out_rows == nullptr || c == nullptr) return cudaErrorInvalidValue;
  ScatterRowsKernel<T><<<dim3(GridX(CeilDiv(n, 256)), GridY(n_rows)), 256, 0, stream>>>(
      nullptr, out_rows, n_rows, n, c, ldc);
  TFSS_RETURN_LAUNCH_ERROR();
  return cudaSuccess;
}

template <typename T>
cudaError_t CsrSpmmGpu(const GpuCsr<T>& csr, const int64_t* out_rows, const T* b, int64_t n,
                       int64_t ldb, T* c, int64_t ldc, cudaStream_t stream) {
  if (csr.n_rows < 0 || csr.n_cols < 0 || csr.nnz < 0 || n < 0 || ldb < n || ldc < n) {
    return cudaErrorInvalidValue;
  }
  if (csr.n_rows == 0 || n == 0) return cudaSuccess;
  if (csr.row_ptr == nullptr || c == nullptr ||
      (csr.nnz > 0 && (csr.col_idx == nullptr || csr.values == nullptr || b == nullptr))) {
    return cudaErrorInvalidValue;
  }
  return CompressedTimesDense<T, int32_t>(csr.row_ptr, csr.col_idx, csr.values, csr.n_rows,
                                          out_rows, nullptr, b, n, ldb, c, ldc,
                                          /*accumulate=*/false, stream);
}

cudaError_t CsrToCscWorkspaceBytes(int64_t n_rows, int64_t n_cols, int64_t nnz, size_t* bytes) {
  if (n_rows < 0 || n_cols < 0 || nnz < 0 || bytes == nullptr) return cudaErrorInvalidValue;
  return LayoutCscScratch(nullptr, n_cols, nnz, nullptr, bytes);
}

template <typename T>
cudaError_t CsrToCscGpu(const GpuCsr<T>& csr, int64_t* csc_col_ptr, int32_t* csc_row_idx,
                        T* csc_values, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream) {
  if (csr.n_rows < 0 || csr.n_cols < 0 || csr.nnz < 0 || csc_col_ptr == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (csr.n_rows > INT32_MAX || csr.n_cols > INT32_MAX) return cudaErrorInvalidValue;
  if (csr.nnz == 0) {
    return cudaMemsetAsync(csc_col_ptr, 0, (csr.n_cols + 1) * sizeof(int64_t), stream);
  }
  if (csr.row_ptr == nullptr || csr.col_idx == nullptr || csr.values == nullptr ||
      csc_row_idx == nullptr || csc_values == nullptr) {
    return cudaErrorInvalidValue;
  }
  CscScratch s;
  size_t need = 0;
  TFSS_RETURN_IF_ERROR(LayoutCscScratch(workspace, csr.n_cols, csr.nnz, &s, &need));
  if (workspace == nullptr || workspace_bytes < need) return cudaErrorInvalidValue;
  const int64_t nnz = csr.nnz;
  IotaKernel<<<GridX(CeilDiv(nnz, 256)), 256, 0, stream>>>(s.perm_in, nnz);
  TFSS_RETURN_LAUNCH_ERROR();
  // Stable LSD radix sort by column: equal columns keep CSR (row-major) order,
  // i.e. ascending row. Column indices are >= 0, so the int32 array is read as
  // uint32 keys with identical order.
  size_t cub_bytes = s.cub_bytes;
  TFSS_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairs(
      s.cub_temp, cub_bytes, reinterpret_cast<const uint32_t*>(csr.col_idx), s.keys_out,
      static_cast<const int64_t*>(s.perm_in), s.perm_out, nnz, 0, KeyBits(csr.n_cols), stream));
  ColPtrFromSortedKeysKernel<<<GridX(CeilDiv(csr.n_cols + 1, 256)), 256, 0, stream>>>(
      s.keys_out, nnz, csr.n_cols, csc_col_ptr);
  TFSS_RETURN_LAUNCH_ERROR();
  GatherCscKernel<T><<<GridX(CeilDiv(nnz, 256)), 256, 0, stream>>>(
      s.perm_out, nnz, csr.row_ptr, csr.n_rows, csr.values, csc_row_idx, csc_values);
  TFSS_RETURN_LAUNCH_ERROR();
  return cudaSuccess;
}

template <typename T>
cudaError_t CscSpmmTransposeGpu(const GpuCsc<T>& csc, const int64_t* dy_rows, const T* dy,
                                int64_t n, int64_t lddy, T* dw, int64_t lddw, bool accumulate,
                                cudaStream_t stream) {
  if (csc.n_rows < 0 || csc.n_cols < 0 || csc.nnz < 0 || n < 0 || lddy < n || lddw < n) {
    return cudaErrorInvalidValue;
  }
  if (csc.n_cols == 0 || n == 0) return cudaSuccess;
  if (csc.col_ptr == nullptr || dw == nullptr ||
      (csc.nnz > 0 && (csc.row_idx == nullptr || csc.values == nullptr || dy == nullptr))) {
    return cudaErrorInvalidValue;
  }
  return CompressedTimesDense<T, int32_t>(csc.col_ptr, csc.row_idx, csc.values, csc.n_cols,
                                          nullptr, dy_rows, dy, n, lddy, dw, lddw, accumulate,
                                          stream);
}

template <typename T>
cudaError_t CsrSpmmTransposeWorkspaceBytes(int64_t n_rows, int64_t n_cols, int64_t nnz,
                                           size_t* bytes) {
  if (bytes == nullptr) return cudaErrorInvalidValue;
  size_t scratch = 0;
  TFSS_RETURN_IF_ERROR(CsrToCscWorkspaceBytes(n_rows, n_cols, nnz, &scratch));
  const size_t n = static_cast<size_t>(nnz);
  *bytes = AlignUp(static_cast<size_t>(n_cols + 1) * sizeof(int64_t)) +
           AlignUp(n * sizeof(int32_t)) + AlignUp(n * sizeof(T)) + scratch;
  return cudaSuccess;
}

template <typename T>
cudaError_t CsrSpmmTransposeGpu(const GpuCsr<T>& csr, const int64_t* dy_rows, const T* dy,
                                int64_t n, int64_t lddy, T* dw, int64_t lddw, bool accumulate,
                                void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (csr.n_rows < 0 || csr.n_cols < 0 || csr.nnz < 0 || n < 0 || lddy < n || lddw < n) {
    return cudaErrorInvalidValue;
  }
  if (csr.n_cols == 0 || n == 0) return cudaSuccess;
  size_t need = 0;
  TFSS_RETURN_IF_ERROR(CsrSpmmTransposeWorkspaceBytes<T>(csr.n_rows, csr.n_cols, csr.nnz, &need));
  if (workspace == nullptr || workspace_bytes < need) return cudaErrorInvalidValue;
  const size_t nz = static_cast<size_t>(csr.nnz);
  char* p = static_cast<char*>(workspace);
  int64_t* col_ptr = reinterpret_cast<int64_t*>(p);
  p += AlignUp(static_cast<size_t>(csr.n_cols + 1) * sizeof(int64_t));
  int32_t* row_idx = reinterpret_cast<int32_t*>(p);
  p += AlignUp(nz * sizeof(int32_t));
  T* vals = reinterpret_cast<T*>(p);
  p += AlignUp(nz * sizeof(T));
  const size_t used = static_cast<size_t>(p - static_cast<char*>(workspace));
  TFSS_RETURN_IF_ERROR(
      CsrToCscGpu<T>(csr, col_ptr, row_idx, vals, p, workspace_bytes - used, stream));
  GpuCsc<T> csc;
  csc.col_ptr = col_ptr;
  csc.row_idx = row_idx;
  csc.values = vals;
  csc.n_rows = csr.n_rows;
  csc.n_cols = csr.n_cols;
  csc.nnz = csr.nnz;
  return CscSpmmTransposeGpu<T>(csc, dy_rows, dy, n, lddy, dw, lddw, accumulate, stream);
}

template <typename T>
cudaError_t SddmmGpu(const T* mask, const T* x, const T* y, int64_t m, int64_t k, int64_t n,
                     T* out, cudaStream_t stream) {
  if (m < 0 || k < 0 || n < 0) return cudaErrorInvalidValue;
  if (m == 0 || k == 0) return cudaSuccess;
  if (mask == nullptr || out == nullptr || (n > 0 && (x == nullptr || y == nullptr))) {
    return cudaErrorInvalidValue;
  }
  const int64_t n_tiles = m * CeilDiv(k, kWarp);
  const unsigned grid = GridX(CeilDiv(n_tiles, kSddmmWarps));
  const unsigned block = kWarp * kSddmmWarps;
  constexpr int G = kVec16<T>;
  if (n <= kWarp) {  // the kernel (and so the summation order) depends on n only
    SddmmLaneDotKernel<T><<<grid, block, 0, stream>>>(mask, x, y, m, k, n, out);
  } else if (n % G == 0 && Aligned16(x) && Aligned16(y)) {
    SddmmWarpDotKernel<T, true><<<grid, block, 0, stream>>>(mask, x, y, m, k, n, out);
  } else {
    SddmmWarpDotKernel<T, false><<<grid, block, 0, stream>>>(mask, x, y, m, k, n, out);
  }
  TFSS_RETURN_LAUNCH_ERROR();
  return cudaSuccess;
}

// ===========================================================================
// Explicit instantiations.
#define TFSS_INSTANTIATE(T)                                                                    \
  template cudaError_t CountNonzerosGpu<T>(const T*, int64_t, int64_t, bool, int64_t*,         \
                                           int64_t*, int64_t*, cudaStream_t);                  \
  template cudaError_t FillCsrGpu<T>(const T*, int64_t, int64_t, bool, const int64_t*,         \
                                     int64_t, const int64_t*, int32_t*, T*, cudaStream_t);     \
  template cudaError_t GatherSubmatrixGpu<T>(const T*, int64_t, int64_t, bool, const int64_t*, \
                                             int64_t, const int64_t*, int64_t, T*,             \
                                             cudaStream_t);                                    \
  template cudaError_t CompactColumnsGpu<T>(const T*, int64_t, int64_t, bool, const T*,        \
                                            int64_t, int64_t, bool, const int64_t*, int64_t,   \
                                            T*, T*, cudaStream_t);                             \
  template cudaError_t ScatterRowsGpu<T>(const T*, const int64_t*, int64_t, int64_t, T*,       \
                                         int64_t, cudaStream_t);                               \
  template cudaError_t ZeroRowsGpu<T>(const int64_t*, int64_t, int64_t, T*, int64_t,           \
                                      cudaStream_t);                                           \
  template cudaError_t CsrSpmmGpu<T>(const GpuCsr<T>&, const int64_t*, const T*, int64_t,      \
                                     int64_t, T*, int64_t, cudaStream_t);                      \
  template cudaError_t CsrToCscGpu<T>(const GpuCsr<T>&, int64_t*, int32_t*, T*, void*, size_t, \
                                      cudaStream_t);                                           \
  template cudaError_t CscSpmmTransposeGpu<T>(const GpuCsc<T>&, const int64_t*, const T*,      \
                                              int64_t, int64_t, T*, int64_t, bool,             \
                                              cudaStream_t);                                   \
  template cudaError_t CsrSpmmTransposeWorkspaceBytes<T>(int64_t, int64_t, int64_t, size_t*);  \
  template cudaError_t CsrSpmmTransposeGpu<T>(const GpuCsr<T>&, const int64_t*, const T*,      \
                                              int64_t, int64_t, T*, int64_t, bool, void*,      \
                                              size_t, cudaStream_t);                           \
  template cudaError_t SddmmGpu<T>(const T*, const T*, const T*, int64_t, int64_t, int64_t,    \
                                   T*, cudaStream_t);

TFSS_INSTANTIATE(float)
TFSS_INSTANTIATE(double)
TFSS_INSTANTIATE(__half)
TFSS_INSTANTIATE(__nv_bfloat16)

#undef TFSS_INSTANTIATE
#undef TFSS_RETURN_LAUNCH_ERROR
#undef TFSS_RETURN_IF_ERROR

}  // namespace tf_sparse_split

#endif  // defined(__CUDACC__) && (!defined(GOOGLE_CUDA) || GOOGLE_CUDA)
