// CPU implementations of the kernels declared in direct_conv2d.h.
#include "cc/core/direct_conv2d.h"
#include "cc/core/simd_vec.h"
#include "cc/core/uninit_vector.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <new>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TFSS_DIRECT_AVX512 1
#endif

#define TFSS_INLINE inline __attribute__((always_inline))
#define TFSS_INLINE_LAMBDA __attribute__((always_inline))

namespace tf_sparse_split {

namespace {

template <typename T>
using DVec = simd::Vec<T>;

// 64-byte aligned storage: the kernels' vector loads of packed filters,
// accumulator buffers and padded copies then never split a cache line.
template <typename T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <typename U>
  Aligned64(const Aligned64<U>&) noexcept {}
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64)));
  }
  void deallocate(T* p, size_t) noexcept {
    ::operator delete(p, std::align_val_t(64));
  }
  template <typename U>
  bool operator==(const Aligned64<U>&) const noexcept { return true; }
  template <typename U>
  bool operator!=(const Aligned64<U>&) const noexcept { return false; }
};
template <typename T>
using AVector = std::vector<T, Aligned64<T>>;

// Aligned64 whose resize() leaves new values unwritten (uninit_vector.h),
// for the packed filters, whose Build writes every value itself.
template <typename T>
using AUninitVector = std::vector<T, DefaultInitOf<Aligned64, T>>;

// Writes the kn values at src to dst and zeros dst[kn, vl): one slot of a
// packed filter (its lanes past C_out stay zero).
template <typename T>
inline void PackSlot(T* dst, const T* src, int64_t kn, int64_t vl) {
  std::memcpy(dst, src, sizeof(T) * kn);
  if (kn < vl) std::fill(dst + kn, dst + vl, T(0));
}
using simd::LoadV;
using simd::StoreV;
template <typename T>
TFSS_INLINE typename DVec<T>::V Bcast(T x) {
  return simd::Broadcast<T>(x);
}
#ifdef TFSS_DIRECT_AVX512
template <>
TFSS_INLINE DVec<float>::V Bcast<float>(float x) {
  return reinterpret_cast<DVec<float>::V>(_mm512_set1_ps(x));
}
template <>
TFSS_INLINE DVec<double>::V Bcast<double>(double x) {
  return reinterpret_cast<DVec<double>::V>(_mm512_set1_pd(x));
}
#endif

// Calls f(std::integral_constant<int, I>) for I = 0 .. N-1, unrolled in the
// source: accumulator arrays indexed only by such constants are kept in
// registers (GCC scalarises them before its loop unrolling runs, so an
// array indexed by a loop variable stays in memory across loops).
template <typename F, int... I>
TFSS_INLINE void UnrollImpl(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, typename F>
TFSS_INLINE void Unroll(F&& f) {
  UnrollImpl(f, std::make_integer_sequence<int, N>{});
}

// Bit c of the result: p[c] != 0 (NaN counts as nonzero), c < n <= 64.
template <typename T>
TFSS_INLINE uint64_t NonzeroMask(const T* p, int64_t n) {
  uint64_t m = 0;
  for (int64_t c = 0; c < n; ++c)
    m |= static_cast<uint64_t>(p[c] != T(0)) << c;
  return m;
}

#ifdef TFSS_DIRECT_AVX512
template <>
TFSS_INLINE uint64_t NonzeroMask<float>(const float* p, int64_t n) {
  const __m512 z = _mm512_setzero_ps();
  uint64_t m = 0;
  int64_t c = 0;
  for (; c + 16 <= n; c += 16)
    m |= static_cast<uint64_t>(_mm512_cmp_ps_mask(_mm512_loadu_ps(p + c), z,
                                                  _CMP_NEQ_UQ))
         << c;
  if (c < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - c)) - 1u);
    m |= static_cast<uint64_t>(_mm512_mask_cmp_ps_mask(
             k, _mm512_maskz_loadu_ps(k, p + c), z, _CMP_NEQ_UQ))
         << c;
  }
  return m;
}
template <>
TFSS_INLINE uint64_t NonzeroMask<double>(const double* p, int64_t n) {
  const __m512d z = _mm512_setzero_pd();
  uint64_t m = 0;
  int64_t c = 0;
  for (; c + 8 <= n; c += 8)
    m |= static_cast<uint64_t>(_mm512_cmp_pd_mask(_mm512_loadu_pd(p + c), z,
                                                  _CMP_NEQ_UQ))
         << c;
  if (c < n) {
    const __mmask8 k = static_cast<__mmask8>((1u << (n - c)) - 1u);
    m |= static_cast<uint64_t>(_mm512_mask_cmp_pd_mask(
             k, _mm512_maskz_loadu_pd(k, p + c), z, _CMP_NEQ_UQ))
         << c;
  }
  return m;
}
#endif

// Stores the first n lanes of v to p.
template <typename T>
TFSS_INLINE void StorePart(T* p, const typename DVec<T>::V& v, int64_t n) {
  if (n >= DVec<T>::kLanes) {
    StoreV(p, v);
  } else if (n > 0) {
    T tmp[DVec<T>::kLanes];
    StoreV(tmp, v);
    std::memcpy(p, tmp, sizeof(T) * n);
  }
}

// act(c + bias) on n_rows rows of n values, ldc apart, serial, with the
// semantics of DirectConvEpilogue (bias already offset to the rows' first
// channel, or null).
template <typename T>
void EpilogueRows(T* c, int64_t ldc, int64_t n_rows, int64_t n,
                  const T* bias, const DirectConvEpilogue<T>& ep) {
  if (ep.nan_to_zero && ep.act != Activation::kNone) {
    BiasClampRows<T>(c, ldc, n_rows, n, bias, ep.act);
  } else {
    BiasActivationRows<T>(c, ldc, nullptr, n_rows, n, bias, ep.act,
                          SerialFor);
  }
}

// The epilogue on channels [k0, k0 + kn) of the out_w pixels of one output
// row (yrow points at channel k0 of its first pixel).
template <typename T>
void EpilogueRow(T* yrow, int64_t out_w, int64_t co, int64_t k0, int64_t kn,
                 const DirectConvEpilogue<T>& ep) {
  EpilogueRows<T>(yrow, co, out_w, kn,
                  ep.bias != nullptr ? ep.bias + k0 : nullptr, ep);
}

// ---------------------------------------------------------------------------
// Forward.

// Whether a 1x1 convolution's forward takes blocks of 8 vectors (tiles of
// 3 pixels, 24 accumulators) instead of 4 (tiles of 7 pixels): C_out a
// multiple of 8 vectors (128 floats). A 1x1 filter gives each input
// nonzero one tap, so a block of V vectors is V multiply-adds per
// broadcast and bit-scan step; at V = 4 one pixel's chain of nonzeros
// waits on the FMA latency (4 multiply-adds a nonzero) and every block
// scans the pixel's bits again. Kernel time at 50% zeros (ReLU of a
// Gaussian), 8-vector against 4-vector blocks, two runs each on the
// 2-core Xeon: 16x16x16x64 -> 256 0.74-0.76 / 0.92-1.00 ms, 32x28x28x64
// -> 256 3.8-4.1 / 4.4-5.4 ms, 32x14x14x256 -> 1024 12.8-13.0 / 16.5-17.1
// ms, 16x8x8x256 -> 1024 2.3-3.7 / 4.1-4.3 ms; 16x16x16x128 -> 512 and
// 16x8x8x512 -> 128 even within the runs' spread.
template <typename T>
bool WideOneByOneBlocks(const Conv2DGeometry& g) {
  constexpr int64_t L = DVec<T>::kLanes;
  return g.kh == 1 && g.kw == 1 && g.c_out % (8 * L) == 0;
}

// The L1 budget (bytes) of a forward pass's packed filter slice: 48 KB,
// 32 KB for 8-vector blocks (whose 48 KB slices, 96 channels of 512
// bytes, left too little of L1 to the input rows and the outputs: at
// 16x16x16x128 -> 512, 2.9-3.4 ms in passes of 96 + 32 channels against
// 2.4-3.6 ms in two of 64).
inline int64_t FwdSliceBudget(int64_t vecs) {
  return (vecs >= 8 ? 32 : 48) * 1024;
}

// Output-channel blocking of the forward kernel: blocks of kVecs vectors
// (the last one may hold fewer), each with its packed filter
// [KH][C_in][KW][V*lanes].
template <typename T>
struct FwdBlocks {
  static constexpr int L = DVec<T>::kLanes;
  int64_t vecs = 1;   // vectors per full block
  int64_t count = 0;  // number of blocks
  std::vector<int64_t> offset;  // packed offset of each block
  AUninitVector<T> packed;      // every value written by Build

  void Build(const T* f, const Conv2DGeometry& g) {
    const int64_t co = g.c_out;
    const int64_t total_vecs = (co + L - 1) / L;
    vecs = std::min<int64_t>(4, std::max<int64_t>(1, total_vecs));
    if (WideOneByOneBlocks<T>(g)) vecs = 8;
    count = (total_vecs + vecs - 1) / vecs;
    offset.assign(count + 1, 0);
    const int64_t taps_c = g.kh * g.c_in * g.kw;
    for (int64_t b = 0; b < count; ++b)
      offset[b + 1] = offset[b] + taps_c * Vecs(b, g) * L;
    packed.resize(offset[count]);
    for (int64_t b = 0; b < count; ++b) {
      const int64_t k0 = b * vecs * L, vl = Vecs(b, g) * L;
      const int64_t kn = std::min<int64_t>(co - k0, vl);
      T* dst = packed.data() + offset[b];
      for (int64_t kh = 0; kh < g.kh; ++kh)
        for (int64_t c = 0; c < g.c_in; ++c)
          for (int64_t kw = 0; kw < g.kw; ++kw)
            PackSlot(dst + ((kh * g.c_in + c) * g.kw + kw) * vl,
                     f + ((kh * g.kw + kw) * g.c_in + c) * co + k0, kn, vl);
    }
  }
  int64_t Vecs(int64_t b, const Conv2DGeometry& g) const {
    const int64_t total_vecs = (g.c_out + L - 1) / L;
    return std::min<int64_t>(vecs, total_vecs - b * vecs);
  }
};

// Output columns per tile for V vectors: B*V accumulators <= 28 of 32 zmm.
template <int V>
struct TileWidth {
  static constexpr int value =
      V >= 8 ? 3 : V >= 4 ? 7 : V == 3 ? 9 : V == 2 ? 12 : 16;
};

// Column j of a stride-1, dilation-1 tile: the nonzeros of input pixel px
// (C_in values) feed outputs b = j - kw of the tile for kw in [0, KW).
template <typename T, int V, int B, int KW, int J>
TFSS_INLINE void FwdColumnS1(const T* px, int64_t cb, int64_t ce, const T* wk,
                             typename DVec<T>::V (&acc)[B][V]) {
  using Vt = typename DVec<T>::V;
  constexpr int L = DVec<T>::kLanes;
  constexpr int RW = KW * V * L;  // packed values per (kh, c)
  for (int64_t c0 = cb; c0 < ce; c0 += 64) {
    uint64_t m = NonzeroMask<T>(px + c0, std::min<int64_t>(64, ce - c0));
    while (m) {
      const int64_t c = c0 + __builtin_ctzll(m);
      m &= m - 1;
      const Vt xv = Bcast<T>(px[c]);
      const T* wr = wk + c * RW;
      // Keeps wr in a register: the loads below then use base + offset
      // addressing, which stays one fused uop with the FMA (an indexed
      // address would split it in two).
      asm("" : "+r"(wr));
#pragma GCC unroll 8
      for (int kw = 0; kw < KW; ++kw) {
        const int b = J - kw;
        if (b < 0 || b >= B) continue;
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v)
          acc[b][v] += xv * LoadV<Vt>(wr + (kw * V + v) * L);
      }
    }
  }
}

template <typename T, int V, int B, int KW, int J, int JEnd>
struct FwdColumnsS1 {
  static TFSS_INLINE void Run(const T* xrow, int64_t wbase, int64_t w_in,
                              int64_t ci, int64_t cb, int64_t ce, const T* wk,
                              typename DVec<T>::V (&acc)[B][V]) {
    const int64_t w = wbase + J;
    if (w >= 0 && w < w_in)
      FwdColumnS1<T, V, B, KW, J>(xrow + w * ci, cb, ce, wk, acc);
    FwdColumnsS1<T, V, B, KW, J + 1, JEnd>::Run(xrow, wbase, w_in, ci, cb, ce,
                                                wk, acc);
  }
};
template <typename T, int V, int B, int KW, int JEnd>
struct FwdColumnsS1<T, V, B, KW, JEnd, JEnd> {
  static TFSS_INLINE void Run(const T*, int64_t, int64_t, int64_t, int64_t,
                              int64_t, const T*, typename DVec<T>::V (&)[B][V]) {}
};

// The channels of one input pixel px whose bits are set in m (bit i =
// channel c0 + i), each multiplied into column b of the tile: one
// broadcast and V multiply-adds a nonzero.
template <typename T, int V, int B, int Bc>
TFSS_INLINE void FwdPixelBits(uint64_t m, int64_t c0, const T* px,
                              const T* wk, int64_t rw,
                              typename DVec<T>::V (&acc)[B][V]) {
  using Vt = typename DVec<T>::V;
  constexpr int L = DVec<T>::kLanes;
  while (m) {
    const int64_t c = c0 + __builtin_ctzll(m);
    m &= m - 1;
    const Vt xv = Bcast<T>(px[c]);
    const T* wr = wk + c * rw;
    asm("" : "+r"(wr));  // base + offset addressing (see FwdColumnS1)
    Unroll<V>([&](auto v) TFSS_INLINE_LAMBDA {
      acc[Bc][v] += xv * LoadV<Vt>(wr + v * L);
    });
  }
}

// Generic column b of a tile (any stride, dilation, KW): one tap (kh, kw)
// of output ow0 + b.
template <typename T, int V, int B, int Bi, int BEnd>
struct FwdColumnsGeneric {
  static TFSS_INLINE void Run(const T* xrow, int64_t w_first, int64_t sw,
                              int64_t w_in, int nb, int64_t ci, int64_t cb,
                              int64_t ce, int64_t rw, const T* wk,
                              typename DVec<T>::V (&acc)[B][V]) {
    const int64_t w = w_first + Bi * sw;
    if (Bi < nb && w >= 0 && w < w_in) {
      const T* px = xrow + w * ci;
      for (int64_t c0 = cb; c0 < ce; c0 += 64)
        FwdPixelBits<T, V, B, Bi>(
            NonzeroMask<T>(px + c0, std::min<int64_t>(64, ce - c0)), c0, px,
            wk, rw, acc);
    }
    FwdColumnsGeneric<T, V, B, Bi + 1, BEnd>::Run(xrow, w_first, sw, w_in, nb,
                                                  ci, cb, ce, rw, wk, acc);
  }
};
template <typename T, int V, int B, int BEnd>
struct FwdColumnsGeneric<T, V, B, BEnd, BEnd> {
  static TFSS_INLINE void Run(const T*, int64_t, int64_t, int64_t, int, int64_t,
                              int64_t, int64_t, int64_t, const T*,
                              typename DVec<T>::V (&)[B][V]) {}
};

// Columns Bi and Bi + 1 of a generic tile (FwdColumnsGeneric), with the
// paired sweep's idea: a channel nonzero in both pixels loads each filter
// vector once for both; the channels nonzero in one pixel only are taken
// one of each pixel per iteration while both pixels have some, so that the
// two pixels' accumulator chains alternate (one pixel's V multiply-adds a
// nonzero wait on the latency of its previous ones: at V = 4 and KW = 1,
// four multiply-adds a nonzero, half the FMA ports' rate).
template <typename T, int V, int B, int Bi, int BEnd>
struct FwdColumnPairsGeneric {
  static TFSS_INLINE void Run(const T* xrow, int64_t w_first, int64_t sw,
                              int64_t w_in, int nb, int64_t ci, int64_t cb,
                              int64_t ce, int64_t rw, const T* wk,
                              typename DVec<T>::V (&acc)[B][V]) {
    if constexpr (Bi + 1 >= BEnd) {
      if constexpr (Bi < BEnd)
        FwdColumnsGeneric<T, V, B, Bi, BEnd>::Run(xrow, w_first, sw, w_in, nb,
                                                  ci, cb, ce, rw, wk, acc);
    } else {
      using Vt = typename DVec<T>::V;
      constexpr int L = DVec<T>::kLanes;
      const int64_t w0 = w_first + Bi * sw, w1 = w0 + sw;
      const bool in0 = Bi < nb && w0 >= 0 && w0 < w_in;
      const bool in1 = Bi + 1 < nb && w1 >= 0 && w1 < w_in;
      if (in0 || in1) {
        const T* p0 = xrow + (in0 ? w0 : 0) * ci;
        const T* p1 = xrow + (in1 ? w1 : 0) * ci;
        for (int64_t c0 = cb; c0 < ce; c0 += 64) {
          const int64_t n = std::min<int64_t>(64, ce - c0);
          const uint64_t m0 = in0 ? NonzeroMask<T>(p0 + c0, n) : 0;
          const uint64_t m1 = in1 ? NonzeroMask<T>(p1 + c0, n) : 0;
          uint64_t both = m0 & m1, only0 = m0 & ~m1, only1 = m1 & ~m0;
          while (both) {
            const int64_t c = c0 + __builtin_ctzll(both);
            both &= both - 1;
            const Vt x0 = Bcast<T>(p0[c]), x1 = Bcast<T>(p1[c]);
            const T* wr = wk + c * rw;
            asm("" : "+r"(wr));  // base + offset addressing (see above)
            Unroll<V>([&](auto v) TFSS_INLINE_LAMBDA {
              const Vt wv = LoadV<Vt>(wr + v * L);
              acc[Bi][v] += x0 * wv;
              acc[Bi + 1][v] += x1 * wv;
            });
          }
          while (only0 && only1) {
            const int64_t c = c0 + __builtin_ctzll(only0);
            const int64_t d = c0 + __builtin_ctzll(only1);
            only0 &= only0 - 1;
            only1 &= only1 - 1;
            const Vt x0 = Bcast<T>(p0[c]), x1 = Bcast<T>(p1[d]);
            const T* wr = wk + c * rw;
            const T* ws = wk + d * rw;
            asm("" : "+r"(wr), "+r"(ws));
            Unroll<V>([&](auto v) TFSS_INLINE_LAMBDA {
              acc[Bi][v] += x0 * LoadV<Vt>(wr + v * L);
              acc[Bi + 1][v] += x1 * LoadV<Vt>(ws + v * L);
            });
          }
          // The rest of one pixel's channels.
          FwdPixelBits<T, V, B, Bi>(only0, c0, p0, wk, rw, acc);
          FwdPixelBits<T, V, B, Bi + 1>(only1, c0, p1, wk, rw, acc);
        }
      }
      FwdColumnPairsGeneric<T, V, B, Bi + 2, BEnd>::Run(
          xrow, w_first, sw, w_in, nb, ci, cb, ce, rw, wk, acc);
    }
  }
};

// Output rows [r0, r1) (row r = image r / OH of the list, output row
// r % OH) of one channel block [k0, k0 + kn): tiles of B columns, their
// B x V accumulators in registers. When the packed filter slice of all
// input channels of a filter row (C_in * KW * V vectors) exceeds 48 KB, the
// work runs in passes over (filter row kh, input-channel chunk) so that a
// pass's slice stays in L1 while every tile of the rows uses it; between
// passes the accumulators wait in acc_buf [rows][tiles*B][V*L]. In one
// pass (the usual case) a tile's accumulators start at zero in registers
// and go straight to y.
template <typename T, int V>
void FwdRows(const T* x, const Conv2DGeometry& g, const int64_t* images,
             int64_t r0, int64_t r1, const T* wp, T* y, int64_t k0,
             int64_t kn, int64_t chunk, AVector<T>* acc_buf,
             const DirectConvEpilogue<T>& ep, bool pairs) {
  using Vt = typename DVec<T>::V;
  constexpr int L = DVec<T>::kLanes;
  constexpr int B = TileWidth<V>::value;
  const int64_t ci = g.c_in;
  const bool s1 = g.kw == 3 && g.stride_w == 1 && g.dil_w == 1;
  const int64_t rw = g.kw * V * L;
  const int64_t tiles = (g.out_w + B - 1) / B;
  const int64_t row_vals = tiles * B * V * L;
  // All filter rows in one pass (accumulators in registers throughout) when
  // one chunk holds every channel, else one filter row per pass.
  const int64_t khg = chunk >= ci ? g.kh : 1;
  const bool one_pass = chunk >= ci;
  if (!one_pass) acc_buf->assign((r1 - r0) * row_vals, T(0));
  for (int64_t kh0 = 0; kh0 < g.kh; kh0 += khg) {
    for (int64_t cb = 0; cb < ci; cb += chunk) {
      const int64_t ce = std::min(ci, cb + chunk);
      const bool first = kh0 == 0 && cb == 0;
      const bool last = kh0 + khg >= g.kh && ce >= ci;
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t i = r / g.out_h, oh = r % g.out_h;
        const int64_t img = images ? images[i] : i;
        T* rb = one_pass ? nullptr : acc_buf->data() + (r - r0) * row_vals;
        T* yrow = y + ((img * g.out_h + oh) * g.out_w) * g.c_out + k0;
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t ow0 = t * B;
          const int nb = static_cast<int>(std::min<int64_t>(B, g.out_w - ow0));
          T* ab = one_pass ? nullptr : rb + t * B * V * L;
          Vt acc[B][V];
          for (int b = 0; b < B; ++b)
            for (int v = 0; v < V; ++v)
              acc[b][v] = first ? Vt{} : LoadV<Vt>(ab + (b * V + v) * L);
          for (int64_t kh = kh0; kh < std::min(g.kh, kh0 + khg); ++kh) {
            const int64_t h = oh * g.stride_h - g.pad_top + kh * g.dil_h;
            if (h < 0 || h >= g.h) continue;
            const T* xrow = x + (img * g.h + h) * g.w * ci;
            const T* wk = wp + kh * ci * rw;
            if (s1) {
              FwdColumnsS1<T, V, B, 3, 0, B + 2>::Run(
                  xrow, ow0 - g.pad_left, g.w, ci, cb, ce, wk, acc);
            } else {
              for (int64_t kw = 0; kw < g.kw; ++kw) {
                const int64_t wf = ow0 * g.stride_w - g.pad_left + kw * g.dil_w;
                if (pairs)
                  FwdColumnPairsGeneric<T, V, B, 0, B>::Run(
                      xrow, wf, g.stride_w, g.w, nb, ci, cb, ce, rw,
                      wk + kw * V * L, acc);
                else
                  FwdColumnsGeneric<T, V, B, 0, B>::Run(
                      xrow, wf, g.stride_w, g.w, nb, ci, cb, ce, rw,
                      wk + kw * V * L, acc);
              }
            }
          }
          if (last) {
            // Output pixels ow0 + b of the row, lanes [0, kn) of the block.
            T* yo = yrow + ow0 * g.c_out;
            if (kn == V * L) {
              for (int b = 0; b < nb; ++b)
                for (int v = 0; v < V; ++v)
                  StoreV(yo + b * g.c_out + v * L, acc[b][v]);
            } else {
              for (int b = 0; b < nb; ++b)
                for (int v = 0; v < V; ++v)
                  StorePart<T>(yo + b * g.c_out + v * L, acc[b][v], kn - v * L);
            }
          } else {
            for (int b = 0; b < B; ++b)
              for (int v = 0; v < V; ++v)
                StoreV(ab + (b * V + v) * L, acc[b][v]);
          }
        }
        if (last && ep.active()) EpilogueRow<T>(yrow, g.out_w, g.c_out, k0, kn, ep);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Forward, row scatter (thin inputs: stride 1 and dilation 1 in width, any
// filter size, height stride and dilation; chosen by ScatterForward).
//
// The sliding and tiled kernels pay a vector compare, a bit-scan setup and
// a flush per output pixel and pass, however few input channels a pixel
// has; with one to a few channels (a network's first layer, on images
// whose background is zero) that fixed cost is most of the call. Here an
// output row of one channel block is summed in an L1 buffer [OW][V*lanes]:
// for each filter row kh, the nonzeros of the input row (W * C_in
// contiguous values, one vector compare per 16 floats) are visited by a
// bit-scan, and each is broadcast and multiplied into the KW output pixels
// it feeds (KW * V multiply-adds into the buffer). Work per output row:
// OW * V vectors zeroed and stored, W * C_in / 16 compares per filter row,
// and nnz * KW * V multiply-adds, so an all-zero stretch of the input
// costs one compare per 16 values. Each output value is summed in a fixed
// order (kh, then input column and channel, then kw), whatever the
// sharding.

// When kAuto takes the row scatter (ScatterForward). Kernel time against
// the paired sliding window (3-wide filters) or the tiled kernel (other
// widths) on the 2-core Xeon, 2 threads, 32x28x28 inputs at 50 / 80 / 95%
// zeros, interleaved, two runs where given:
//   3x3, C_in 1 -> 16: 0.54-0.62 / 0.57-0.74 / 0.59-0.74 of the time;
//   C_in 1 -> 32: 0.76-1.02 / 0.74-1.04 / 0.68-0.90; C_in 1 -> 64:
//   1.19 / 1.15 / 0.95 (not taken); C_in 2 -> 16: 0.90 / 0.62 / 0.53
//   (32x14x14x2 -> 16: 0.88 / 0.60 / 0.45; 8x14x14x2 -> 16: 1.22 / 0.78 /
//   0.63, the rule's slower edge, 35 against 29 us);
//   C_in 3 -> 32: 1.47 / 1.05 / 1.03 (not taken);
//   5x5 and 7x7 (the tiled kernel's): C_in 1 -> 32 0.22 / 0.18 / 0.16,
//   C_in 3 -> 32 0.33 / 0.26 / 0.18, C_in 8 -> 32 0.55 / 0.40 / 0.22,
//   C_in 16 -> 32 0.81 / 0.53 / 0.31, 7x7 C_in 3 -> 64 0.47 / 0.33 /
//   0.23, 5x5 C_in 8 -> 128 0.93 / 0.63 / 0.46;
//   1x1: C_in 1 -> 16 0.56 / 0.63 / 0.72; C_in 4 -> 64 1.06 / 0.98 / 1.00;
//   C_in 8 -> 256 1.41 / 1.27 / 1.12 (not taken).
constexpr int64_t kScatterWideMaxCin = 16;   // filters 4 or more wide
constexpr int64_t kScatterThinMaxCin = 2;    // any width, with
constexpr int64_t kScatterThinMaxCout = 32;  // at most this C_out

// act(s + b) on one vector with the semantics of EpilogueRows (the same
// operations in the same order, so the same values): with kNanToZero, relu
// and relu6 as max(v, 0) (NaN -> 0, -0 -> +0), else as tf.nn.relu /
// tf.nn.relu6 (NaN stays NaN).
template <typename T, Activation kAct, bool kNanToZero>
TFSS_INLINE typename DVec<T>::V ActVec(typename DVec<T>::V s) {
  using Vt = typename DVec<T>::V;
  if (kAct == Activation::kNone) return s;
  const Vt zero{};
  const Vt six = zero + T(6);
  if (kNanToZero) {
    s = s > zero ? s : zero;
    if (kAct == Activation::kRelu6) s = s < six ? s : six;
  } else {
    s = s < zero ? zero : s;
    if (kAct == Activation::kRelu6) s = s > six ? six : s;
  }
  return s;
}

// y[o, (0, kn)] = act(buf[o] + bias) for the ow_n pixels of one output row
// of a channel block (pixel stride co in y, V*lanes in buf); bias: the
// block's V vectors (lanes past C_out zero), or null.
template <typename T, int V, Activation kAct, bool kNanToZero, bool kBias>
void ScatterCopyOut(const T* buf, T* yrow, int64_t ow_n, int64_t co,
                    int64_t kn, const T* bias) {
  using Vt = typename DVec<T>::V;
  constexpr int L = DVec<T>::kLanes;
  constexpr int VL = V * L;
  Vt bv[V];
  Unroll<V>([&](auto v) TFSS_INLINE_LAMBDA {
    bv[v] = kBias ? LoadV<Vt>(bias + v * L) : Vt{};
  });
  // No bias: nothing added (a -0.0 sum stays -0.0, as in EpilogueRows).
  auto val = [&](int64_t o, int v) TFSS_INLINE_LAMBDA {
    const Vt s = LoadV<Vt>(buf + o * VL + v * L);
    return ActVec<T, kAct, kNanToZero>(kBias ? s + bv[v] : s);
  };
  if (kn == VL) {
    for (int64_t o = 0; o < ow_n; ++o)
      Unroll<V>([&](auto v) TFSS_INLINE_LAMBDA {
        StoreV(yrow + o * co + v * L, val(o, v));
      });
  } else {
    for (int64_t o = 0; o < ow_n; ++o)
      for (int v = 0; v < V; ++v)
        StorePart<T>(yrow + o * co + v * L, val(o, v), kn - v * L);
  }
}

template <typename T, int V, bool kBias>
void ScatterCopyOutAct(const T* buf, T* yrow, int64_t ow_n, int64_t co,
                       int64_t kn, const T* bias,
                       const DirectConvEpilogue<T>& ep) {
  const bool z = ep.nan_to_zero;
  switch (ep.act) {
    case Activation::kRelu:
      if (z) ScatterCopyOut<T, V, Activation::kRelu, true, kBias>(buf, yrow, ow_n, co, kn, bias);
      else ScatterCopyOut<T, V, Activation::kRelu, false, kBias>(buf, yrow, ow_n, co, kn, bias);
      break;
    case Activation::kRelu6:
      if (z) ScatterCopyOut<T, V, Activation::kRelu6, true, kBias>(buf, yrow, ow_n, co, kn, bias);
      else ScatterCopyOut<T, V, Activation::kRelu6, false, kBias>(buf, yrow, ow_n, co, kn, bias);
      break;
    default:
      ScatterCopyOut<T, V, Activation::kNone, false, kBias>(buf, yrow, ow_n, co, kn, bias);
  }
}

// The epilogue's activation and bias as template arguments (no branch or
// reload per pixel: under perf the runtime form took a third of the
// kernel's samples on 32x28x28x1 -> 16).
template <typename T, int V>
void ScatterCopyOutAs(const T* buf, T* yrow, int64_t ow_n, int64_t co,
                      int64_t kn, const T* bias, const DirectConvEpilogue<T>& ep) {
  if (bias != nullptr)
    ScatterCopyOutAct<T, V, true>(buf, yrow, ow_n, co, kn, bias, ep);
  else
    ScatterCopyOutAct<T, V, false>(buf, yrow, ow_n, co, kn, bias, ep);
}

template <typename T, int V>
void ScatterRows(const T* x, const Conv2DGeometry& g, const int64_t* images,
                 int64_t r0, int64_t r1, const T* wp, const int32_t* col_of,
                 T* y, int64_t k0, int64_t kn, T* buf, const T* bias,
                 const DirectConvEpilogue<T>& ep) {
  using Vt = typename DVec<T>::V;
  constexpr int L = DVec<T>::kLanes;
  constexpr int VL = V * L;
  const int64_t ci = g.c_in, kw_n = g.kw, ow_n = g.out_w;
  const int64_t row_vals = g.w * ci;
  const int64_t rw = kw_n * VL;  // packed values per (filter row, channel)
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t i = r / g.out_h, oh = r % g.out_h;
    const int64_t img = images ? images[i] : i;
    for (int64_t o = 0; o < ow_n * V; ++o) StoreV(buf + o * L, Vt{});
    for (int64_t kh = 0; kh < g.kh; ++kh) {
      const int64_t h = oh * g.stride_h - g.pad_top + kh * g.dil_h;
      if (h < 0 || h >= g.h) continue;
      const T* xrow = x + (img * g.h + h) * row_vals;
      const T* wk = wp + kh * ci * rw;
      for (int64_t q = 0; q < row_vals; q += 64) {
        uint64_t m = NonzeroMask<T>(xrow + q, std::min<int64_t>(64, row_vals - q));
        while (m) {
          const int64_t e = q + __builtin_ctzll(m);
          m &= m - 1;
          const int64_t w = ci == 1 ? e : col_of[e];
          const Vt xv = Bcast<T>(xrow[e]);
          const T* wc = wk + (e - w * ci) * rw;
          // Input column w feeds outputs o = w + pad_left - kw.
          const int64_t base = w + g.pad_left;
          const int64_t kw_lo = std::max<int64_t>(0, base - (ow_n - 1));
          const int64_t kw_hi = std::min<int64_t>(kw_n - 1, base);
          for (int64_t kw = kw_lo; kw <= kw_hi; ++kw) {
            T* bo = buf + (base - kw) * VL;
            const T* wv = wc + kw * VL;
            Unroll<V>([&](auto v) TFSS_INLINE_LAMBDA {
              StoreV(bo + v * L,
                     LoadV<Vt>(bo + v * L) + xv * LoadV<Vt>(wv + v * L));
            });
          }
        }
      }
    }
    ScatterCopyOutAs<T, V>(buf, y + ((img * g.out_h + oh) * ow_n) * g.c_out + k0,
                           ow_n, g.c_out, kn, bias, ep);
  }
}

// ---------------------------------------------------------------------------
// Forward, sliding window (KW == 3, stride 1 and dilation 1 in width).
//
// One output row of one channel block is swept left to right over the
// input columns j. Input column j feeds outputs j + pl - kw (kw = 0, 1, 2),
// so three output pixels of V vectors each (3V accumulators) live in
// registers as a ring: after column j, output j + pl - 2 has all its
// contributions of the pass and leaves the ring (stored, or added to y),
// and its slot starts the next output at zero. No output tile has edges:
// every nonzero of an interior column feeds all 3V accumulators.
//
// A pass covers a group of up to kSlideRows filter rows (one row from
// output width kSlideOneRowMinWidth on) and a chunk of
// input channels (a multiple of 16) whose packed filter slice
// [filter row][channel][kw][V*lanes] stays in L1 (<= 36 KB at V = 4); the
// nonzeros of the column's pixels in all the filter rows of the pass are
// one bitmask (bit = filter row * chunk + channel, <= 64 bits), visited by
// one bit-scan loop (tzcnt / clear lowest bit). Each nonzero is one
// broadcast and 3V multiply-adds whose filter vectors are contiguous.
// Passes after the first add their sums to y (fixed pass order, so the bits
// do not depend on the thread count).

constexpr int kSlideRows = 3;
// From this output width on, a pass covers one filter row (and up to 48
// input channels at V = 4: the same 36 KB slice, the column's bitmask over
// one pixel's channels). Single-thread kernel time at 32x56x56x64 -> 64,
// measured interleaved under load: 0.75x of three rows x 16 channels at 50%
// zeros, 0.66x at 70%; 0.94x on 32x28x28x128 -> 128 and 0.79x on
// 1x14x14x256 -> 256 at 50%; but 1.23x on 32x7x7x512 -> 512, which keeps
// three rows.
constexpr int64_t kSlideOneRowMinWidth = 14;
// Whether the passes cover one filter row: from kSlideOneRowMinWidth on,
// unless C_in fits one 16-channel chunk, where three filter rows make one
// pass (one write of y) instead of three (a write and two read-modify-writes):
// single-thread kernel time 0.60x on 32x28x28x1 -> 64 and 0.88x on
// 32x14x14x16 -> 32 at 80% / 14% zeros (MNIST CNN layers, under load).
inline bool OneRowPasses(const Conv2DGeometry& g) {
  return g.out_w >= kSlideOneRowMinWidth && g.c_in > 16;
}

template <typename T>
struct SlidePlan {
  static constexpr int L = DVec<T>::kLanes;
  int64_t vecs = 1;    // vectors per full block (<= 4)
  int64_t count = 0;   // channel blocks
  int64_t nkh = 1;     // filter rows per pass
  int64_t ngroups = 1; // filter-row groups
  int64_t chunk = 16;  // input channels per pass (multiple of 16)
  int64_t nchunks = 1;
  std::vector<int64_t> offset;  // packed offset of each block
  AUninitVector<T> packed;      // every value written by Build

  int64_t Vecs(int64_t b, const Conv2DGeometry& g) const {
    const int64_t total_vecs = (g.c_out + L - 1) / L;
    return std::min<int64_t>(vecs, total_vecs - b * vecs);
  }
  // Values of one pass slice of a block of v vectors.
  int64_t Slice(int64_t v) const { return nkh * chunk * 3 * v * L; }

  void Build(const T* f, const Conv2DGeometry& g) {
    const int64_t co = g.c_out, ci = g.c_in;
    const int64_t total_vecs = (co + L - 1) / L;
    vecs = std::min<int64_t>(4, std::max<int64_t>(1, total_vecs));
    count = (total_vecs + vecs - 1) / vecs;
    nkh = std::min<int64_t>(OneRowPasses(g) ? 1 : kSlideRows, g.kh);
    ngroups = (g.kh + nkh - 1) / nkh;
    // bits = nkh * chunk <= 64; slice nkh * chunk * 3 * vecs vectors of
    // 64 bytes <= 36 KB (576 vectors).
    const int64_t by_bits = 64 / nkh;
    const int64_t by_l1 = 576 / (nkh * 3 * vecs);
    chunk = std::max<int64_t>(16, std::min(by_bits, by_l1) / 16 * 16);
    nchunks = (ci + chunk - 1) / chunk;
    offset.assign(count + 1, 0);
    for (int64_t b = 0; b < count; ++b)
      offset[b + 1] = offset[b] + ngroups * nchunks * Slice(Vecs(b, g));
    // Every value is written below (no zero pass over the whole pack
    // first: at 3x3x256 -> 256 that pass alone was ~8% of a batch-1 call):
    // the filter's taps, zeros in the lanes past C_out and in the slots
    // past the last filter row or input channel.
    packed.resize(offset[count]);
    for (int64_t b = 0; b < count; ++b) {
      const int64_t v = Vecs(b, g), vl = v * L;
      const int64_t k0 = b * vecs * L;
      const int64_t kn = std::min<int64_t>(co - k0, vl);
      for (int64_t kg = 0; kg < ngroups; ++kg)
        for (int64_t q = 0; q < nchunks; ++q) {
          T* dst = packed.data() + offset[b] + (kg * nchunks + q) * Slice(v);
          for (int64_t kl = 0; kl < nkh; ++kl) {
            const int64_t kh = kg * nkh + kl;
            for (int64_t cl = 0; cl < chunk; ++cl) {
              const int64_t c = q * chunk + cl;
              T* slot = dst + (kl * chunk + cl) * 3 * vl;
              if (kh >= g.kh || c >= ci) {
                std::fill(slot, slot + 3 * vl, T(0));
                continue;
              }
              for (int64_t kw = 0; kw < 3; ++kw)
                PackSlot(slot + kw * vl,
                         f + ((kh * g.kw + kw) * ci + c) * co + k0, kn, vl);
            }
          }
        }
    }
  }
};

// Loads the first n (< lanes) values of p into a vector, the rest zero.
template <typename T>
TFSS_INLINE typename DVec<T>::V LoadPart(const T* p, int64_t n) {
  T tmp[DVec<T>::kLanes] = {};
  std::memcpy(tmp, p, sizeof(T) * n);
  return LoadV<typename DVec<T>::V>(tmp);
}

// One output pixel leaves the ring: lanes [0, kn) of acc to yo (First: the
// first pass) or added to them (Full: kn == V * lanes); acc restarts at 0.
template <typename T, int V, bool First, bool Full>
TFSS_INLINE void SlideFlush(typename DVec<T>::V (&acc)[V], T* yo, int64_t kn) {
  using Vt = typename DVec<T>::V;
  constexpr int L = DVec<T>::kLanes;
  if (Full) {
    Unroll<V>([&](auto v) TFSS_INLINE_LAMBDA {
      if (First)
        StoreV(yo + v * L, acc[v]);
      else
        StoreV(yo + v * L, acc[v] + LoadV<Vt>(yo + v * L));
    });
  } else {
    for (int v = 0; v < V; ++v) {
      const int64_t n = kn - v * L;
      if (n <= 0) break;
      Vt s = acc[v];
      if (!First)
        s += n >= L ? LoadV<Vt>(yo + v * L) : LoadPart<T>(yo + v * L, n);
      StorePart<T>(yo + v * L, s, n);
    }
  }
  Unroll<V>([&](auto v) TFSS_INLINE_LAMBDA { acc[v] = Vt{}; });
}

// The nonzero bits of column jc / C_in of a pass: bit kl * chunk + c is
// channel c of the pass (cn of them) in filter row kl (xr[kl], null where
// the row is padding).
template <typename T>
TFSS_INLINE uint64_t ColumnMask(const T* const* xr, int64_t nkh, int64_t chunk,
                                int64_t cn, int64_t jc) {
  uint64_t m = 0;
  if (cn == 16) {
    for (int64_t kl = 0; kl < nkh; ++kl)
      if (xr[kl] != nullptr)
        m |= NonzeroMask<T>(xr[kl] + jc, 16) << (kl * chunk);
  } else {
    for (int64_t kl = 0; kl < nkh; ++kl) {
      if (xr[kl] == nullptr) continue;
      for (int64_t c = 0; c < cn; c += 16)
        m |= NonzeroMask<T>(xr[kl] + jc + c, std::min<int64_t>(16, cn - c))
             << (kl * chunk + c);
    }
  }
  return m;
}

// xoff[bit]: offset of the bit's value from the returned base (the first
// row that is not padding) + column * C_in.
template <typename T>
const T* BitOffsets(const T* const* xr, int64_t nkh, int64_t chunk,
                    int64_t* xoff) {
  const T* xbase = nullptr;
  for (int64_t kl = 0; kl < nkh; ++kl)
    if (xr[kl] != nullptr && xbase == nullptr) xbase = xr[kl];
  for (int64_t kl = 0; kl < nkh; ++kl)
    for (int64_t c = 0; c < chunk; ++c)
      xoff[kl * chunk + c] = xr[kl] != nullptr ? (xr[kl] - xbase) + c : 0;
  return xbase;
}

// Column j of the sweep, ring rotation R = (j + pl) mod 3: slot R takes
// kw = 0, slot (R + 2) % 3 kw = 1, slot (R + 1) % 3 kw = 2 (and leaves the
// ring afterwards as output o = j + pl - 2). Checked: j may lie outside the
// input and o outside the output row (the sweep's first and last columns).
template <typename T, int V, int R, bool Checked, bool First, bool Full>
TFSS_INLINE void SlideStep(const T* const* xr, int64_t nkh, int64_t chunk,
                           int64_t cn, int64_t ci, int64_t j, int64_t w_in,
                           int64_t o, int64_t ow_n, const T* wq, T* yrow,
                           int64_t co, int64_t kn, const T* xbase,
                           const int64_t* xoff,
                           typename DVec<T>::V (&acc)[3][V]) {
  using Vt = typename DVec<T>::V;
  constexpr int L = DVec<T>::kLanes;
  constexpr int RW = 3 * V * L;  // packed values per (filter row, channel)
  constexpr int S0 = R, S1 = (R + 2) % 3, S2 = (R + 1) % 3;
  if (!Checked || (j >= 0 && j < w_in)) {
    const int64_t jc = j * ci;
    uint64_t m = ColumnMask<T>(xr, nkh, chunk, cn, jc);
    auto madd = [&](const Vt xv, const T* wr) TFSS_INLINE_LAMBDA {
      asm("" : "+r"(wr));  // base + offset addressing (see FwdColumnS1)
      Unroll<V>([&](auto v) TFSS_INLINE_LAMBDA {
        acc[S0][v] += xv * LoadV<Vt>(wr + v * L);
        acc[S1][v] += xv * LoadV<Vt>(wr + (V + v) * L);
        acc[S2][v] += xv * LoadV<Vt>(wr + (2 * V + v) * L);
      });
    };
    if (nkh == 1) {
      // One filter row: bit b is channel b of the pixel itself.
      const T* xj = xr[0] + jc;
      while (m) {
        const int64_t b = __builtin_ctzll(m);
        m &= m - 1;
        madd(Bcast<T>(xj[b]), wq + b * RW);
      }
    } else {
      const T* xj = xbase + jc;
      while (m) {
        const int64_t b = __builtin_ctzll(m);
        m &= m - 1;
        madd(Bcast<T>(xj[xoff[b]]), wq + b * RW);
      }
    }
  }
  if (!Checked || (o >= 0 && o < ow_n)) {
    SlideFlush<T, V, First, Full>(acc[S2], yrow + o * co, kn);
  } else {
    Unroll<V>([&](auto v) TFSS_INLINE_LAMBDA { acc[S2][v] = Vt{}; });
  }
}

// The bounds of a sweep over one output row: step t reads input column
// t - pl and completes output t - 2 (steps [0, steps)); the steps in
// [t_lo, t_hi) have both inside the row.
struct SweepBounds {
  int64_t pl, steps, ci, w_in, ow_n, co, t_lo, t_hi;
  explicit SweepBounds(const Conv2DGeometry& g)
      : pl(g.pad_left), steps(g.out_w + 2), ci(g.c_in), w_in(g.w),
        ow_n(g.out_w), co(g.c_out), t_lo(std::max<int64_t>(g.pad_left, 2)),
        t_hi(std::min<int64_t>(g.w + g.pad_left, g.out_w + 2)) {}
};

// Zeroes a ring of S output pixels x V accumulator vectors.
template <typename T, int S, int V>
TFSS_INLINE void ZeroRing(typename DVec<T>::V (&acc)[S][V]) {
  using Vt = typename DVec<T>::V;
  Unroll<S>([&](auto r) TFSS_INLINE_LAMBDA {
    Unroll<V>([&](auto v) TFSS_INLINE_LAMBDA { acc[r][v] = Vt{}; });
  });
}

// Columns j and j + 1 of the paired sweep (step t = j + pl, even; ring
// rotation R = t mod 4, 0 or 2): slot R holds output t, (R + 3) % 4 output
// t - 1, (R + 2) % 4 output t - 2 and (R + 1) % 4 output t + 1. Column j
// feeds outputs t, t - 1, t - 2 (kw = 0, 1, 2), column j + 1 outputs t + 1,
// t, t - 1. The channels nonzero in both pixels load each filter vector
// once for two multiply-adds (one per pixel); those nonzero in one pixel
// only run the single-column multiply-adds: no product with a zero. After
// the step outputs t - 2 and t - 1 (o and o + 1) are complete and leave
// the ring. Checked: either column may lie outside the input and either
// output outside the row.
template <typename T, int V, int R, bool Checked, bool First, bool Full>
TFSS_INLINE void SlidePairStep(const T* const* xr, int64_t nkh, int64_t chunk,
                               int64_t cn, int64_t ci, int64_t j,
                               int64_t w_in, int64_t o, int64_t ow_n,
                               const T* wq, T* yrow, int64_t co, int64_t kn,
                               const T* xbase, const int64_t* xoff,
                               typename DVec<T>::V (&acc)[4][V]) {
  using Vt = typename DVec<T>::V;
  constexpr int L = DVec<T>::kLanes;
  constexpr int RW = 3 * V * L;  // packed values per (filter row, channel)
  constexpr int SA = R, SB = (R + 3) % 4, SC = (R + 2) % 4, SD = (R + 1) % 4;
  const bool in0 = !Checked || (j >= 0 && j < w_in);
  const bool in1 = !Checked || (j + 1 >= 0 && j + 1 < w_in);
  if (in0 || in1) {
    const int64_t jc = j * ci;
    const uint64_t m0 = in0 ? ColumnMask<T>(xr, nkh, chunk, cn, jc) : 0;
    const uint64_t m1 = in1 ? ColumnMask<T>(xr, nkh, chunk, cn, jc + ci) : 0;
    auto sweep = [&](auto one_row) TFSS_INLINE_LAMBDA {
      // The bit's value in column j (p = its row) or j + 1 (p + C_in).
      const T* p = (one_row ? xr[0] : xbase) + jc;
      auto at = [&](const T* q, int64_t b) TFSS_INLINE_LAMBDA {
        return one_row ? q[b] : q[xoff[b]];
      };
      uint64_t both = m0 & m1, only0 = m0 & ~m1, only1 = m1 & ~m0;
      while (both) {
        const int64_t b = __builtin_ctzll(both);
        both &= both - 1;
        const Vt x0 = Bcast<T>(at(p, b)), x1 = Bcast<T>(at(p + ci, b));
        const T* wr = wq + b * RW;
        asm("" : "+r"(wr));  // base + offset addressing (see FwdColumnS1)
        Unroll<V>([&](auto v) TFSS_INLINE_LAMBDA {
          const Vt w0 = LoadV<Vt>(wr + v * L);
          const Vt w1 = LoadV<Vt>(wr + (V + v) * L);
          const Vt w2 = LoadV<Vt>(wr + (2 * V + v) * L);
          acc[SA][v] += x0 * w0;
          acc[SB][v] += x0 * w1;
          acc[SC][v] += x0 * w2;
          acc[SD][v] += x1 * w0;
          acc[SA][v] += x1 * w1;
          acc[SB][v] += x1 * w2;
        });
      }
      // The channels nonzero in one column only (q: its values), into the
      // slots of its outputs for kw = 0, 1, 2.
      auto one = [&](uint64_t m, const T* q, auto s0, auto s1, auto s2)
          TFSS_INLINE_LAMBDA {
        while (m) {
          const int64_t b = __builtin_ctzll(m);
          m &= m - 1;
          const Vt xv = Bcast<T>(at(q, b));
          const T* wr = wq + b * RW;
          asm("" : "+r"(wr));
          Unroll<V>([&](auto v) TFSS_INLINE_LAMBDA {
            acc[s0][v] += xv * LoadV<Vt>(wr + v * L);
            acc[s1][v] += xv * LoadV<Vt>(wr + (V + v) * L);
            acc[s2][v] += xv * LoadV<Vt>(wr + (2 * V + v) * L);
          });
        }
      };
      using SlotA = std::integral_constant<int, SA>;
      using SlotB = std::integral_constant<int, SB>;
      one(only0, p, SlotA{}, SlotB{}, std::integral_constant<int, SC>{});
      one(only1, p + ci, std::integral_constant<int, SD>{}, SlotA{}, SlotB{});
    };
    if (nkh == 1)
      sweep(std::true_type{});
    else
      sweep(std::false_type{});
  }
  auto leave = [&](auto s, int64_t out) TFSS_INLINE_LAMBDA {
    if (!Checked || (out >= 0 && out < ow_n))
      SlideFlush<T, V, First, Full>(acc[s], yrow + out * co, kn);
    else
      Unroll<V>([&](auto v) TFSS_INLINE_LAMBDA { acc[s][v] = Vt{}; });
  };
  leave(std::integral_constant<int, SC>{}, o);
  leave(std::integral_constant<int, SB>{}, o + 1);
}

// SlideRow's sweep two columns a step (SlidePairStep): steps t = 0, 2, ...
// (columns t - pl and t + 1 - pl, completing outputs t - 2 and t - 1); the
// steps with both columns and both outputs inside the row run unchecked,
// two at a time (rotations 0 and 2).
template <typename T, int V, bool First, bool Full>
void SlideRowPairs(const T* const* xr, int64_t nkh, int64_t chunk, int64_t cn,
                   const Conv2DGeometry& g, const T* wq, T* yrow, int64_t kn) {
  int64_t xoff[64];
  const T* xbase = BitOffsets<T>(xr, nkh, chunk, xoff);
  typename DVec<T>::V acc[4][V];
  ZeroRing<T, 4, V>(acc);
  const SweepBounds b(g);
  const int64_t pl = b.pl, ci = b.ci, w_in = b.w_in, ow_n = b.ow_n, co = b.co;
  auto checked = [&](int64_t t) TFSS_INLINE_LAMBDA {
    if (t % 4 == 0)
      SlidePairStep<T, V, 0, true, First, Full>(xr, nkh, chunk, cn, ci, t - pl,
                                                w_in, t - 2, ow_n, wq, yrow,
                                                co, kn, xbase, xoff, acc);
    else
      SlidePairStep<T, V, 2, true, First, Full>(xr, nkh, chunk, cn, ci, t - pl,
                                                w_in, t - 2, ow_n, wq, yrow,
                                                co, kn, xbase, xoff, acc);
  };
  int64_t t = 0;
  for (; t < b.steps && (t < b.t_lo || t % 4 != 0); t += 2) checked(t);
  for (; t + 4 <= b.t_hi; t += 4) {
    SlidePairStep<T, V, 0, false, First, Full>(xr, nkh, chunk, cn, ci, t - pl,
                                               w_in, t - 2, ow_n, wq, yrow, co,
                                               kn, xbase, xoff, acc);
    SlidePairStep<T, V, 2, false, First, Full>(xr, nkh, chunk, cn, ci,
                                               t + 2 - pl, w_in, t, ow_n, wq,
                                               yrow, co, kn, xbase, xoff, acc);
  }
  for (; t < b.steps; t += 2) checked(t);
}

// One output row of one pass (xr: the input rows of the pass's filter
// rows, null where the row is padding; at least one is not). Step t of the
// sweep is input column j = t - pl and completes output o = t - 2
// (rotation t mod 3); the steps with both inside the row run unchecked,
// three at a time.
template <typename T, int V, bool First, bool Full>
void SlideRow(const T* const* xr, int64_t nkh, int64_t chunk, int64_t cn,
              const Conv2DGeometry& g, const T* wq, T* yrow, int64_t kn) {
  int64_t xoff[64];
  const T* xbase = BitOffsets<T>(xr, nkh, chunk, xoff);
  typename DVec<T>::V acc[3][V];
  ZeroRing<T, 3, V>(acc);
  const SweepBounds b(g);
  const int64_t pl = b.pl, ci = b.ci, w_in = b.w_in, ow_n = b.ow_n, co = b.co;
  const int64_t steps = b.steps, t_lo = b.t_lo, t_hi = b.t_hi;
  auto checked = [&](int64_t t) TFSS_INLINE_LAMBDA {
    const int64_t j = t - pl, o = t - 2;
    switch (t % 3) {
      case 0:
        SlideStep<T, V, 0, true, First, Full>(xr, nkh, chunk, cn, ci, j, w_in,
                                              o, ow_n, wq, yrow, co, kn, xbase,
                                              xoff, acc);
        break;
      case 1:
        SlideStep<T, V, 1, true, First, Full>(xr, nkh, chunk, cn, ci, j, w_in,
                                              o, ow_n, wq, yrow, co, kn, xbase,
                                              xoff, acc);
        break;
      default:
        SlideStep<T, V, 2, true, First, Full>(xr, nkh, chunk, cn, ci, j, w_in,
                                              o, ow_n, wq, yrow, co, kn, xbase,
                                              xoff, acc);
        break;
    }
  };
  int64_t t = 0;
  for (; t < steps && (t < t_lo || t % 3 != 0); ++t) checked(t);
  for (; t + 3 <= t_hi; t += 3) {
    SlideStep<T, V, 0, false, First, Full>(xr, nkh, chunk, cn, ci, t - pl,
                                           w_in, t - 2, ow_n, wq, yrow, co, kn,
                                           xbase, xoff, acc);
    SlideStep<T, V, 1, false, First, Full>(xr, nkh, chunk, cn, ci, t + 1 - pl,
                                           w_in, t - 1, ow_n, wq, yrow, co, kn,
                                           xbase, xoff, acc);
    SlideStep<T, V, 2, false, First, Full>(xr, nkh, chunk, cn, ci, t + 2 - pl,
                                           w_in, t, ow_n, wq, yrow, co, kn,
                                           xbase, xoff, acc);
  }
  for (; t < steps; ++t) checked(t);
}

// One output row of one pass by the paired or the one-column sweep, with
// the row's first-pass and full-block flags as template arguments.
template <typename T, int V>
void SlideRowBy(bool pairs, bool first, bool full, const T* const* xr,
                int64_t nkh, int64_t chunk, int64_t cn,
                const Conv2DGeometry& g, const T* wq, T* yrow, int64_t kn) {
  auto run = [&](auto first_c, auto full_c) {
    constexpr bool kFirst = decltype(first_c)::value;
    constexpr bool kFull = decltype(full_c)::value;
    if (pairs)
      SlideRowPairs<T, V, kFirst, kFull>(xr, nkh, chunk, cn, g, wq, yrow, kn);
    else
      SlideRow<T, V, kFirst, kFull>(xr, nkh, chunk, cn, g, wq, yrow, kn);
  };
  if (full) {
    if (first)
      run(std::true_type{}, std::true_type{});
    else
      run(std::false_type{}, std::true_type{});
  } else {
    if (first)
      run(std::true_type{}, std::false_type{});
    else
      run(std::false_type{}, std::false_type{});
  }
}

// Output rows [r0, r1) of the list (row r: image r / OH of the list, output
// row r % OH) of channel block b: passes over (filter-row group, channel
// chunk), each over every row of the range.
template <typename T, int V>
void SlideRows(const T* x, const Conv2DGeometry& g, const int64_t* images,
               int64_t r0, int64_t r1, const SlidePlan<T>& plan, int64_t b,
               bool pairs, T* y, const DirectConvEpilogue<T>& ep) {
  constexpr int L = DVec<T>::kLanes;
  const int64_t k0 = b * plan.vecs * L;
  const int64_t kn = std::min<int64_t>(g.c_out - k0, V * L);
  const T* wb = plan.packed.data() + plan.offset[b];
  const int64_t slice = plan.Slice(V);
  const T* xr[kSlideRows];
  for (int64_t kg = 0; kg < plan.ngroups; ++kg) {
    for (int64_t q = 0; q < plan.nchunks; ++q) {
      const bool first = kg == 0 && q == 0;
      const bool last = kg + 1 == plan.ngroups && q + 1 == plan.nchunks &&
                        ep.active();
      const int64_t c0 = q * plan.chunk;
      const int64_t cn = std::min(plan.chunk, g.c_in - c0);
      const T* wq = wb + (kg * plan.nchunks + q) * slice;
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t i = r / g.out_h, oh = r % g.out_h;
        const int64_t img = images ? images[i] : i;
        bool any = false;
        for (int64_t kl = 0; kl < plan.nkh; ++kl) {
          const int64_t kh = kg * plan.nkh + kl;
          const int64_t h = oh * g.stride_h - g.pad_top + kh * g.dil_h;
          const bool ok = kh < g.kh && h >= 0 && h < g.h;
          xr[kl] = ok ? x + (img * g.h + h) * g.w * g.c_in + c0 : nullptr;
          any |= ok;
        }
        T* yrow = y + (img * g.out_h + oh) * g.out_w * g.c_out + k0;
        if (!any) {
          // Every filter row of the pass is padding: nothing to add, and
          // zeros on the first pass.
          if (first)
            for (int64_t ow = 0; ow < g.out_w; ++ow)
              std::fill_n(yrow + ow * g.c_out, kn, T(0));
          if (last) EpilogueRow<T>(yrow, g.out_w, g.c_out, k0, kn, ep);
          continue;
        }
        SlideRowBy<T, V>(pairs, first, kn == V * L, xr, plan.nkh, plan.chunk, cn, g,
                         wq, yrow, kn);
        // The row's sums are complete: the epilogue while it is in L1.
        if (last) EpilogueRow<T>(yrow, g.out_w, g.c_out, k0, kn, ep);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Filter gradient.

// One pass over channels [c0, c1) of one input row segment: NR rows of
// taps (filter rows kh), each of NK consecutive filter columns, and V
// output-channel vectors: NR*NK*V df accumulators in registers per input
// channel. For input position r of the segment, tap (row a, column k) reads
// dy at rowp[a] + ptab[r] - k * kstep. Positions of pm[c] in `interior`
// feed every tap; those in `any` but not `interior` only the taps whose
// column's bit of vm[k] is set.
// One input row segment of a pass: its values (pixel stride C_in), the
// position bitmask of each channel of the pass, and the dy row of each tap
// row (NR at most).
template <typename T>
struct FgRow {
  const T* xseg;
  const uint64_t* pm;
  const T* rowp[3];
};

template <typename T, int NR, int NK, int V>
void FgradPass(const FgRow<T>* rows, int nq, int64_t ci, int64_t c0,
               int64_t c1, const int64_t* ptab, int64_t kstep,
               const uint64_t* vm, uint64_t interior, uint64_t any,
               T* const* dfp_in, int64_t dfk, int64_t cop) {
  using Vt = typename DVec<T>::V;
  constexpr int L = DVec<T>::kLanes;
  T* dfp[NR];
  uint64_t tvm[NK];
  for (int a = 0; a < NR; ++a) dfp[a] = dfp_in[a];
  for (int k = 0; k < NK; ++k) tvm[k] = vm[k];
  for (int64_t c = c0; c < c1; ++c) {
    uint64_t live = 0;
    for (int q = 0; q < nq; ++q) live |= rows[q].pm[c - c0];
    if ((live & any) == 0) continue;
    Vt acc[NR][NK][V];
    for (int a = 0; a < NR; ++a)
      for (int k = 0; k < NK; ++k)
        for (int v = 0; v < V; ++v) acc[a][k][v] = Vt{};
    for (int q = 0; q < nq; ++q) {
      const uint64_t m = rows[q].pm[c - c0];
      uint64_t mi = m & interior, me = m & any & ~interior;
      const T* rowp[NR];
      for (int a = 0; a < NR; ++a) rowp[a] = rows[q].rowp[a];
      const T* xc = rows[q].xseg + c;
      while (mi) {
        const int r = __builtin_ctzll(mi);
        mi &= mi - 1;
        const Vt xv = Bcast<T>(xc[r * ci]);
        const int64_t q0 = ptab[r];
#pragma GCC unroll 3
        for (int a = 0; a < NR; ++a) {
          const T* p = rowp[a] + q0;
#pragma GCC unroll 3
          for (int k = 0; k < NK; ++k) {
#pragma GCC unroll 8
            for (int v = 0; v < V; ++v)
              acc[a][k][v] += xv * LoadV<Vt>(p + v * L);
            p -= kstep;
          }
        }
      }
      while (me) {
        const int r = __builtin_ctzll(me);
        me &= me - 1;
        const Vt xv = Bcast<T>(xc[r * ci]);
        const int64_t q0 = ptab[r];
#pragma GCC unroll 3
        for (int a = 0; a < NR; ++a) {
          const T* p = rowp[a] + q0;
#pragma GCC unroll 3
          for (int k = 0; k < NK; ++k) {
            if ((tvm[k] >> r) & 1) {
#pragma GCC unroll 8
              for (int v = 0; v < V; ++v)
                acc[a][k][v] += xv * LoadV<Vt>(p + v * L);
            }
            p -= kstep;
          }
        }
      }
    }
    for (int a = 0; a < NR; ++a)
      for (int k = 0; k < NK; ++k) {
        T* o = dfp[a] + k * dfk + c * cop;
        for (int v = 0; v < V; ++v)
          StoreV(o + v * L, LoadV<Vt>(o + v * L) + acc[a][k][v]);
      }
  }
}

template <typename T, int V>
void FgradPassDispatch(int nr, int nk, const FgRow<T>* rows, int nq,
                       int64_t ci, int64_t c0, int64_t c1, const int64_t* ptab,
                       int64_t kstep, const uint64_t* vm, uint64_t interior,
                       uint64_t any, T* const* dfp, int64_t dfk, int64_t cop) {
  switch (nr * 4 + nk) {
#define TFSS_CASE(R, K)                                                     \
  case R * 4 + K:                                                          \
    FgradPass<T, R, K, V>(rows, nq, ci, c0, c1, ptab, kstep, vm, interior, \
                          any, dfp, dfk, cop);                             \
    break;
    TFSS_CASE(1, 1) TFSS_CASE(1, 2) TFSS_CASE(1, 3)
    TFSS_CASE(2, 1) TFSS_CASE(2, 2) TFSS_CASE(2, 3)
    TFSS_CASE(3, 1) TFSS_CASE(3, 2) TFSS_CASE(3, 3)
#undef TFSS_CASE
    default: break;
  }
}

// Vectors per output-channel block of a one-tap (1x1) filter gradient:
// with a single tap a nonzero of x feeds V accumulators only, so blocks of
// 2 vectors (what 3x3 taps x 2 vectors = 18 accumulators allow) spend a
// broadcast, a bit-scan step and a position lookup on every 2
// multiply-adds; blocks of 8 spend them on 8. Kernel time at 50% zeros,
// 2-core Xeon, 8-vector against 2-vector blocks: 32x14x14x256 -> 1024
// 14.5 / 22.4 ms, 16x16x16x128 -> 512 2.6 / 3.7 ms, 32x28x28x64 -> 256
// 4.1 / 5.4 ms, 16x8x8x128 -> 512 1.15 / 1.53 ms.
constexpr int kOneTapVecs = 8;

template <typename T>
void FgradOneTapDispatch(int64_t v, const FgRow<T>* rows, int nq, int64_t ci,
                         int64_t c0, int64_t c1, const int64_t* ptab,
                         int64_t kstep, const uint64_t* vm, uint64_t interior,
                         uint64_t any, T* const* dfp, int64_t dfk,
                         int64_t cop) {
  switch (v) {
#define TFSS_CASE(V)                                                         \
  case V:                                                                   \
    FgradPass<T, 1, 1, V>(rows, nq, ci, c0, c1, ptab, kstep, vm, interior,  \
                          any, dfp, dfk, cop);                              \
    break;
    TFSS_CASE(1) TFSS_CASE(2) TFSS_CASE(3) TFSS_CASE(4)
    TFSS_CASE(5) TFSS_CASE(6) TFSS_CASE(7) TFSS_CASE(8)
#undef TFSS_CASE
    default: break;
  }
}

// pm[c - c0] = bitmask over r in [0, nw) of xseg[r * ci + c] != 0.
template <typename T>
void PositionMasks(const T* xseg, int64_t ci, int64_t nw, int64_t c0,
                   int64_t c1, uint64_t* pm, uint8_t* scratch) {
  (void)scratch;
  for (int64_t c = c0; c < c1; ++c) pm[c - c0] = 0;
  for (int64_t r = 0; r < nw; ++r) {
    const T* px = xseg + r * ci;
    for (int64_t c = c0; c < c1; ++c)
      pm[c - c0] |= static_cast<uint64_t>(px[c] != T(0)) << r;
  }
}

#ifdef TFSS_DIRECT_AVX512
// AVX-512: a 16-bit compare mask per pixel and 16 channels, its two bytes
// stored position-major (scratch[(byte group) * 64 + r]), then one byte
// test per channel over the 64 positions.
template <>
void PositionMasks<float>(const float* xseg, int64_t ci, int64_t nw,
                          int64_t c0, int64_t c1, uint64_t* pm,
                          uint8_t* scratch) {
  const int64_t nc = c1 - c0;
  const int64_t groups = (nc + 7) / 8;
  std::memset(scratch, 0, groups * 64);
  for (int64_t r = 0; r < nw; ++r) {
    const float* px = xseg + r * ci + c0;
    for (int64_t c = 0; c < nc; c += 16) {
      const uint64_t m = NonzeroMask<float>(px + c, std::min<int64_t>(16, nc - c));
      scratch[(c / 8) * 64 + r] = static_cast<uint8_t>(m);
      if (c + 8 < nc) scratch[(c / 8 + 1) * 64 + r] = static_cast<uint8_t>(m >> 8);
    }
  }
  for (int64_t gq = 0; gq < groups; ++gq) {
    const __m512i bytes = _mm512_loadu_si512(scratch + gq * 64);
    const int64_t nb = std::min<int64_t>(8, nc - gq * 8);
    for (int64_t bit = 0; bit < nb; ++bit)
      pm[gq * 8 + bit] = _mm512_test_epi8_mask(
          bytes, _mm512_set1_epi8(static_cast<char>(1 << bit)));
  }
}
#endif

// dst[kb - kb0][ow][0, VL) = src[ow][kb * VL + (0, VL)] for the blocks kb
// in [kb0, kb1) (a block's lanes past cop are not written and not read),
// for the ow pixels of one dy row (pixel stride cop, a multiple of L).
template <typename T>
void PackDyRow(const T* src, int64_t ow_n, int64_t cop, int64_t VL,
               int64_t kb0, int64_t kb1, T* dst) {
  using Vt = typename DVec<T>::V;
  constexpr int L = DVec<T>::kLanes;
  // One or two vectors a pixel (the kernel's blocks), copied by explicit
  // vector moves: as a loop over vk, GCC turned each pixel's copy into a
  // call of memcpy (64-128 bytes), 3.6% of the filter gradient's samples
  // under perf on 32x56x56x64 -> 64 at 50% zeros (kernel time 20.9-21.5
  // ms after, 21.2-22.2 before, three runs each on the 2-core Xeon).
  for (int64_t kb = kb0; kb < kb1; ++kb) {
    const int64_t k0 = kb * VL, vk = std::min(VL, cop - k0) / L;
    T* d = dst + (kb - kb0) * ow_n * VL;
    const T* sp = src + k0;
    if (vk == 2) {
      for (int64_t ow = 0; ow < ow_n; ++ow, sp += cop, d += VL) {
        const Vt a = LoadV<Vt>(sp), b = LoadV<Vt>(sp + L);
        StoreV(d, a);
        StoreV(d + L, b);
      }
    } else if (vk == 1) {
      for (int64_t ow = 0; ow < ow_n; ++ow, sp += cop, d += VL)
        StoreV(d, LoadV<Vt>(sp));
    } else {
      for (int64_t ow = 0; ow < ow_n; ++ow, sp += cop, d += VL)
        for (int64_t v = 0; v < vk; ++v)
          StoreV(d + v * L, LoadV<Vt>(sp + v * L));
    }
  }
}

// Most tap rows and columns per pass (3 x 3 taps x 2 vectors = 18
// accumulators).
constexpr int kMaxTapRows = 3;
constexpr int kMaxTapCols = 3;
// Input rows whose df contributions share one read-modify-write (default,
// and the most).
constexpr int kRowGroup = 3;
constexpr int kMaxRowGroup = 4;

// The filter gradient of images [i0, i1) of the list (image numbers from
// `images`, null = identity), input channels [c0, c1), output-channel
// blocks [kb0, kb1), summed into buf [KH*KW][C_in][cop]. Input rows go in
// groups of up to kRowGroup consecutive rows with the same filter rows
// (every interior row at stride 1), whose sums for a channel meet in the
// same registers: one read-modify-write of that channel's df rows per
// group instead of per row.
template <typename T>
void FgradRows(const T* x, const Conv2DGeometry& g, const T* dyp,
               bool dy_by_list, const int64_t* images, int64_t i0, int64_t i1,
               int64_t c0, int64_t c1, int64_t kb0, int64_t kb1, int64_t cop,
               int64_t vecs, T* buf) {
  constexpr int L = DVec<T>::kLanes;
  const int64_t ci = g.c_in, nc = c1 - c0;
  const int RG = kRowGroup;
  std::vector<uint64_t> pm(RG * nc);
  std::vector<uint8_t> scratch(((nc + 7) / 8) * 64 + 64);
  std::vector<int64_t> khs, ohs, khs_next, ohs_next;
  std::vector<int64_t> group_ohs(RG * g.kh);
  const int64_t out_img = g.out_h * g.out_w * cop;
  const int64_t dfk = ci * cop;  // df stride of one filter column
  // With several output-channel blocks a block's slice of a dy row is every
  // (cop / VL)-th piece of VL values, which maps to a fraction of the L1
  // sets; the dy rows are then copied into a ring of contiguous
  // [block][OW][VL] rows of the blocks [kb0, kb1) this call sums (each row
  // once per image). Slot oh % S: the dy rows of one row group lie within
  // S consecutive rows.
  const int64_t VL = vecs * L;
  const int64_t nkb_all = (cop / L + vecs - 1) / vecs;
  const int64_t S = (g.kh - 1) * g.dil_h / g.stride_h + RG;
  const int64_t row_pk = (kb1 - kb0) * g.out_w * VL;
  const bool pack = nkb_all > 1 &&
                    S * row_pk * static_cast<int64_t>(sizeof(T)) <= (int64_t{1} << 20);
  AVector<T> ring(pack ? S * row_pk : 0);
  std::vector<int64_t> ring_oh(pack ? S : 0);
  const int64_t pix = pack ? VL : cop;  // dy pixel stride the passes read
  // Filter rows kh whose output row exists for input row h, and those rows.
  auto taps_of = [&](int64_t h, std::vector<int64_t>* ks,
                     std::vector<int64_t>* os) {
    ks->clear();
    os->clear();
    for (int64_t kh = 0; kh < g.kh; ++kh) {
      const int64_t num = h + g.pad_top - kh * g.dil_h;
      if (num < 0 || num % g.stride_h) continue;
      if (num / g.stride_h >= g.out_h) continue;
      ks->push_back(kh);
      os->push_back(num / g.stride_h);
    }
  };
  // Per 64-wide segment of an input row (they depend on the geometry
  // only, so they are built once): colmask[seg * KW + kw], the positions
  // whose output column exists for filter column kw, and ptab[(seg * KW +
  // kw0) * 64 + r], the dy offset of position r for the pass starting at
  // filter column kw0.
  const int64_t nseg = (g.w + 63) / 64;
  std::vector<uint64_t> colmask(nseg * g.kw);
  std::vector<int64_t> ptab(nseg * g.kw * 64, 0);
  for (int64_t sg = 0; sg < nseg; ++sg) {
    const int64_t w0 = sg * 64, nw = std::min<int64_t>(64, g.w - w0);
    for (int64_t kw = 0; kw < g.kw; ++kw) {
      uint64_t m = 0;
      for (int64_t r = 0; r < nw; ++r) {
        const int64_t num = w0 + r + g.pad_left - kw * g.dil_w;
        if (num >= 0 && num % g.stride_w == 0 && num / g.stride_w < g.out_w)
          m |= uint64_t{1} << r;
        ptab[(sg * g.kw + kw) * 64 + r] =
            (g.stride_w == 1 ? num : (num >= 0 ? num / g.stride_w : 0)) * pix;
      }
      colmask[sg * g.kw + kw] = m;
    }
  }
  FgRow<T> rows[kMaxRowGroup];
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t img = images ? images[i] : i;
    std::fill(ring_oh.begin(), ring_oh.end(), int64_t{-1});
    const T* ximg = x + img * g.h * g.w * ci;
    const T* dyimg = dyp + (dy_by_list ? i : img) * out_img;
    for (int64_t h = 0; h < g.h;) {
      // A group of up to RG consecutive input rows with the same filter
      // rows: their contributions to a channel's df rows are summed in
      // registers before one read-modify-write of df.
      taps_of(h, &khs, &ohs);
      int nq = 1;
      for (int64_t j = 0; j < g.kh && j < static_cast<int64_t>(ohs.size()); ++j)
        group_ohs[j] = ohs[j];
      while (!khs.empty() && nq < RG && h + nq < g.h) {
        taps_of(h + nq, &khs_next, &ohs_next);
        if (khs_next != khs) break;
        for (size_t j = 0; j < ohs_next.size(); ++j)
          group_ohs[nq * g.kh + j] = ohs_next[j];
        ++nq;
      }
      const int64_t h0 = h;
      h += nq;
      if (khs.empty()) continue;
      const size_t ntaps = khs.size();
      if (pack) {
        for (int q = 0; q < nq; ++q)
          for (size_t j = 0; j < ntaps; ++j) {
            const int64_t oh = group_ohs[q * g.kh + j];
            int64_t& tag = ring_oh[oh % S];
            if (tag == oh) continue;
            tag = oh;
            PackDyRow<T>(dyimg + oh * g.out_w * cop, g.out_w, cop, VL, kb0,
                         kb1, ring.data() + (oh % S) * row_pk);
          }
      }
      for (int64_t w0 = 0; w0 < g.w; w0 += 64) {
        const int64_t nw = std::min<int64_t>(64, g.w - w0);
        uint64_t anynz = 0;
        for (int q = 0; q < nq; ++q) {
          const T* xseg = ximg + ((h0 + q) * g.w + w0) * ci;
          uint64_t* pq = pm.data() + q * nc;
          PositionMasks<T>(xseg, ci, nw, c0, c1, pq, scratch.data());
          for (int64_t c = 0; c < nc; ++c) anynz |= pq[c];
          rows[q].xseg = xseg;
          rows[q].pm = pq;
        }
        if (anynz == 0) continue;
        const uint64_t* colm = colmask.data() + (w0 / 64) * g.kw;
        // Passes: at stride 1 (width) up to 3 consecutive filter columns
        // (dy of column kw+1 is one pixel left of column kw's); otherwise
        // one column. Up to 3 filter rows each.
        const int64_t kcols = g.stride_w == 1 ? kMaxTapCols : 1;
        for (int64_t kw0 = 0; kw0 < g.kw; kw0 += kcols) {
          const int nk = static_cast<int>(std::min<int64_t>(kcols, g.kw - kw0));
          uint64_t interior = ~uint64_t{0}, any = 0;
          for (int k = 0; k < nk; ++k) {
            interior &= colm[kw0 + k];
            any |= colm[kw0 + k];
          }
          if (any == 0) continue;
          const int64_t* pt = ptab.data() + ((w0 / 64) * g.kw + kw0) * 64;
          const int64_t kstep = g.dil_w * pix;
          for (size_t a0 = 0; a0 < ntaps; a0 += kMaxTapRows) {
            const int nr = static_cast<int>(
                std::min<size_t>(kMaxTapRows, ntaps - a0));
            for (int64_t kb = kb0; kb < kb1; ++kb) {
              const int64_t k0 = kb * vecs * L;
              T* dfp[kMaxTapRows];
              for (int a = 0; a < nr; ++a) {
                dfp[a] = buf + (khs[a0 + a] * g.kw + kw0) * dfk + k0;
                for (int q = 0; q < nq; ++q) {
                  const int64_t oh = group_ohs[q * g.kh + a0 + a];
                  rows[q].rowp[a] =
                      pack ? ring.data() + (oh % S) * row_pk +
                                 (kb - kb0) * g.out_w * VL
                           : dyimg + oh * g.out_w * cop + k0;
                }
              }
              const int64_t v = std::min<int64_t>(vecs, (cop - k0) / L);
              if (vecs > 2)
                // One tap (1x1 filter, OneTapFilterGradVecs): blocks of up
                // to kOneTapVecs vectors.
                FgradOneTapDispatch<T>(v, rows, nq, ci, c0, c1, pt, kstep,
                                       colm + kw0, interior, any, dfp, dfk,
                                       cop);
              else if (v == 2)
                FgradPassDispatch<T, 2>(nr, nk, rows, nq, ci, c0, c1, pt,
                                        kstep, colm + kw0, interior, any,
                                        dfp, dfk, cop);
              else
                FgradPassDispatch<T, 1>(nr, nk, rows, nq, ci, c0, c1, pt,
                                        kstep, colm + kw0, interior, any,
                                        dfp, dfk, cop);
            }
          }
        }
      }
    }
  }
}

}  // namespace

SparseKernelRate FitSparseKernel(double values, double nnz_full, double t_full,
                                 double nnz_thin, double t_thin) {
  SparseKernelRate r;
  const double dn = nnz_full - nnz_thin;
  r.per_nnz = dn > 0 ? std::max(0.0, (t_full - t_thin) / dn) : 0.0;
  r.per_value = (t_full - r.per_nnz * nnz_full) / std::max(1.0, values);
  if (r.per_value < 0) {
    r.per_value = 0;
    r.per_nnz = t_full / std::max(1.0, nnz_full);
  }
  return r;
}

bool DirectPredictedFaster(const SparseKernelRate& direct,
                           const SparseKernelRate& csr, double values,
                           double nnz) {
  return direct.Seconds(values, nnz) <= csr.Seconds(values, nnz);
}

DirectForwardKernel DirectForwardKernelChoice() {
  const char* v = std::getenv("TFSS_DIRECT_FWD_KERNEL");
  if (v == nullptr) return DirectForwardKernel::kAuto;
  const std::string s(v);
  if (s == "tiles") return DirectForwardKernel::kTiles;
  if (s == "columns") return DirectForwardKernel::kSlidingColumns;
  if (s == "pairs") return DirectForwardKernel::kSlidingPairs;
  if (s == "scatter") return DirectForwardKernel::kScatter;
  return DirectForwardKernel::kAuto;
}

bool ScatterForward(const Conv2DGeometry& g, DirectForwardKernel kernel) {
  if (g.stride_w != 1 || g.dil_w != 1) return false;
  if (kernel == DirectForwardKernel::kScatter) return true;
  if (kernel != DirectForwardKernel::kAuto) return false;
  return (g.kw >= 4 && g.c_in <= kScatterWideMaxCin) ||
         (g.c_in <= kScatterThinMaxCin && g.c_out <= kScatterThinMaxCout);
}

bool DirectConv2DUsesAvx512() {
#ifdef TFSS_DIRECT_AVX512
  return true;
#else
  return false;
#endif
}

template <typename T>
void ApplyDirectConvEpilogue(T* y, int64_t pixels, int64_t c_out,
                             const DirectConvEpilogue<T>& epilogue) {
  if (!epilogue.active()) return;
  EpilogueRows<T>(y, c_out, pixels, c_out, epilogue.bias, epilogue);
}

// Task order of the forward's (channel block, row group) tasks. Row
// groups outer (the blocks of a row group in consecutive tasks) when the
// call's input outweighs its filter: the group's input rows then stay in
// L1/L2 from one block to the next instead of streaming from L3 once per
// block. Blocks outer when the filter is the larger: each thread then
// reads its own blocks' filter slices, not every block's. Kernel time at
// 50% zeros (ReLU of a Gaussian), 2-core Xeon, rows outer against blocks
// outer: 1x1 16x16x16x64 -> 256 0.52-0.54 / 0.67 ms, 32x28x28x64 -> 256
// 2.80-2.86 / 3.72-3.88 ms, 16x16x16x128 -> 512 1.98-2.02 / 2.31-2.33
// ms; 3x3 32x28x28x128 -> 128 17.5-17.8 / 23.1 ms, 32x56x56x64 -> 128
// 38.3-39.8 / 45.6-46.3 ms, 8x28x28x128 -> 128 4.3-4.4 / 5.2-5.5 ms; but
// 1.03-1.05 / 0.98 ms at 1x14x14x256 -> 256 3x3 and 13.1-13.3 / 12.8 ms
// at 32x7x7x512 -> 2048 1x1, where the filter is the larger.
inline bool RowGroupsOuter(const Conv2DGeometry& g, int64_t n_images) {
  return n_images * g.h * g.w * g.c_in >= g.kh * g.kw * g.c_in * g.c_out;
}

// (channel block, row group) of task t of blocks x groups tasks in the
// order RowGroupsOuter chose.
inline std::pair<int64_t, int64_t> ForwardTask(int64_t t, int64_t blocks,
                                               int64_t groups,
                                               bool rows_outer) {
  return rows_outer ? std::make_pair(t % blocks, t / blocks)
                    : std::make_pair(t / groups, t % groups);
}

// Task t of the forward's (channel block, row group) tasks over FwdBlocks:
// block b (channels [k0, k0 + kn), packed filter wp) and rows [r0, r1).
template <typename T>
struct BlockTask {
  int64_t b, r0, r1, k0, kn;
  const T* wp;
  BlockTask(const FwdBlocks<T>& blocks, const Conv2DGeometry& g, int64_t t,
            int64_t groups, int64_t group, int64_t rows, bool rows_outer) {
    constexpr int L = DVec<T>::kLanes;
    const auto [bb, q] = ForwardTask(t, blocks.count, groups, rows_outer);
    b = bb;
    r0 = q * group;
    r1 = std::min(rows, r0 + group);
    k0 = b * blocks.vecs * L;
    kn = std::min<int64_t>(g.c_out - k0, blocks.vecs * L);
    wp = blocks.packed.data() + blocks.offset[b];
  }
};

template <typename T>
void DirectConv2DForward(const T* x, const Conv2DGeometry& g, const T* f,
                         const int64_t* images, int64_t n_images, T* y,
                         const ParallelFor& pfor,
                         const DirectConvEpilogue<T>& epilogue) {
  if (!images) n_images = g.n;
  if (n_images <= 0 || g.out_h <= 0 || g.out_w <= 0 || g.c_out <= 0) return;
  const int64_t out_img = g.out_h * g.out_w * g.c_out;
  if (g.c_in == 0 || g.h == 0 || g.w == 0) {
    for (int64_t i = 0; i < n_images; ++i) {
      T* yi = y + (images ? images[i] : i) * out_img;
      std::fill(yi, yi + out_img, T(0));
      ApplyDirectConvEpilogue<T>(yi, g.out_h * g.out_w, g.c_out, epilogue);
    }
    return;
  }
  constexpr int L = DVec<T>::kLanes;
  const int64_t rows = n_images * g.out_h;
  const DirectForwardKernel kernel = DirectForwardKernelChoice();
  if (ScatterForward(g, kernel)) {
    FwdBlocks<T> blocks;
    blocks.Build(f, g);
    // Input column of each value of an input row (C_in > 1).
    std::vector<int32_t> col_of(g.c_in > 1 ? g.w * g.c_in : 0);
    for (int64_t e = 0; e < static_cast<int64_t>(col_of.size()); ++e)
      col_of[e] = static_cast<int32_t>(e / g.c_in);
    // Rows per task: about 224 output pixels, fewer when that leaves under
    // 16 tasks.
    int64_t group = std::max<int64_t>(1, (224 + g.out_w - 1) / g.out_w);
    group = std::max<int64_t>(1, std::min(group, rows * blocks.count / 16));
    const int64_t groups = (rows + group - 1) / group;
    // Cost per task in the pool's units (1e6 ~ 100 us of work): about 70
    // a pixel and vector at 3x3, C_in 1 (32x28x28x1 -> 16: 170 us on one
    // thread). Estimated low, a call of that size ran inline on the
    // calling thread, and its whole output then sat in one core's L2: the
    // next op's threads read it across cores (a Mul reading the 1.6 MB
    // output took 125 us against 85 us after TF's convolution).
    const int64_t cost = 1 + group * g.out_w * blocks.vecs *
                                 (30 + 4 * g.kh * g.kw * g.c_in);
    const bool rows_outer = RowGroupsOuter(g, n_images);
    // The bias of each block, its lanes past C_out zero (whole vectors).
    AVector<T> bias_pad(epilogue.bias ? blocks.count * blocks.vecs * L : 0,
                        T(0));
    if (epilogue.bias) std::copy(epilogue.bias, epilogue.bias + g.c_out, bias_pad.begin());
    pfor(blocks.count * groups, cost, [&](int64_t tb, int64_t te) {
      AVector<T> buf(g.out_w * blocks.vecs * L);
      for (int64_t t = tb; t < te; ++t) {
        const BlockTask<T> k(blocks, g, t, groups, group, rows, rows_outer);
        const T* bias = epilogue.bias ? bias_pad.data() + k.k0 : nullptr;
        switch (blocks.Vecs(k.b, g)) {
          case 8: ScatterRows<T, 8>(x, g, images, k.r0, k.r1, k.wp, col_of.data(), y, k.k0, k.kn, buf.data(), bias, epilogue); break;
          case 4: ScatterRows<T, 4>(x, g, images, k.r0, k.r1, k.wp, col_of.data(), y, k.k0, k.kn, buf.data(), bias, epilogue); break;
          case 3: ScatterRows<T, 3>(x, g, images, k.r0, k.r1, k.wp, col_of.data(), y, k.k0, k.kn, buf.data(), bias, epilogue); break;
          case 2: ScatterRows<T, 2>(x, g, images, k.r0, k.r1, k.wp, col_of.data(), y, k.k0, k.kn, buf.data(), bias, epilogue); break;
          default: ScatterRows<T, 1>(x, g, images, k.r0, k.r1, k.wp, col_of.data(), y, k.k0, k.kn, buf.data(), bias, epilogue); break;
        }
      }
    });
    return;
  }
  if (g.kw == 3 && g.stride_w == 1 && g.dil_w == 1 &&
      kernel != DirectForwardKernel::kTiles) {
    const bool pairs = kernel != DirectForwardKernel::kSlidingColumns;
    SlidePlan<T> plan;
    plan.Build(f, g);
    // Rows per task: about 224 output pixels (a pass's filter slice is
    // loaded into L1 once per task and pass), fewer when that leaves
    // under 16 tasks.
    int64_t group = std::max<int64_t>(1, (224 + g.out_w - 1) / g.out_w);
    group = std::max<int64_t>(
        1, std::min(group, rows * plan.count / 16));
    const int64_t groups = (rows + group - 1) / group;
    // Cost per task (1e6 ~ 100 us): the multiply-adds, and about 150 a
    // pixel, vector and pass for the column's mask, bit-scan and flush
    // (32x28x28x1 -> 16 at 80% zeros: 19 ns a pixel on one thread), so
    // that small calls of many pixels do not run inline (see the scatter's
    // cost above).
    const int64_t cost =
        1 + group * g.out_w *
                (g.kh * 3 * (g.c_in / 2 + 1) * plan.vecs * 2 +
                 150 * plan.vecs * plan.ngroups * plan.nchunks);
    const bool rows_outer = RowGroupsOuter(g, n_images);
    pfor(plan.count * groups, cost, [&](int64_t tb, int64_t te) {
      for (int64_t t = tb; t < te; ++t) {
        const auto [b, q] = ForwardTask(t, plan.count, groups, rows_outer);
        const int64_t r0 = q * group, r1 = std::min(rows, r0 + group);
        switch (plan.Vecs(b, g)) {
          case 4: SlideRows<T, 4>(x, g, images, r0, r1, plan, b, pairs, y, epilogue); break;
          case 3: SlideRows<T, 3>(x, g, images, r0, r1, plan, b, pairs, y, epilogue); break;
          case 2: SlideRows<T, 2>(x, g, images, r0, r1, plan, b, pairs, y, epilogue); break;
          default: SlideRows<T, 1>(x, g, images, r0, r1, plan, b, pairs, y, epilogue); break;
        }
      }
    });
    return;
  }
  const bool pairs_tiles = kernel != DirectForwardKernel::kSlidingColumns;
  FwdBlocks<T> blocks;
  blocks.Build(f, g);
  // Input-channel chunk of a pass: the whole C_in when its filter slice
  // (C_in * KW * V vectors) fits in 48 KB (32 KB for 8-vector blocks,
  // FwdSliceBudget), else multiples of 16 channels within it (64
  // channels at V = 4 and KW = 3: a 64-bit mask per
  // column; 32-channel chunks doubled the column loops and measured 3-18%
  // slower on 28x28x128 and 7x7x512 layers).
  const int64_t per_chan = g.kw * blocks.vecs * L * sizeof(T);
  int64_t chunk = g.c_in;
  const int64_t budget = FwdSliceBudget(blocks.vecs);
  if (g.c_in * per_chan > budget)
    chunk = std::max<int64_t>(16, (budget / per_chan) / 16 * 16);
  // Rows per task: enough tiles (about 8) to reuse each pass's filter slice.
  const int64_t tiles = (g.out_w + 6) / 7;
  const int64_t group = std::max<int64_t>(1, std::min<int64_t>(8, (8 + tiles - 1) / tiles));
  const int64_t groups = (rows + group - 1) / group;
  const int64_t cost =
      1 + group * g.out_w * g.kh * g.kw * (g.c_in / 2 + 1) * blocks.vecs * 2;
  const bool rows_outer = RowGroupsOuter(g, n_images);
  pfor(blocks.count * groups, cost, [&](int64_t tb, int64_t te) {
    AVector<T> acc_buf;
    for (int64_t t = tb; t < te; ++t) {
      const BlockTask<T> k(blocks, g, t, groups, group, rows, rows_outer);
      switch (blocks.Vecs(k.b, g)) {
        case 8: FwdRows<T, 8>(x, g, images, k.r0, k.r1, k.wp, y, k.k0, k.kn, chunk, &acc_buf, epilogue, pairs_tiles); break;
        case 4: FwdRows<T, 4>(x, g, images, k.r0, k.r1, k.wp, y, k.k0, k.kn, chunk, &acc_buf, epilogue, pairs_tiles); break;
        case 3: FwdRows<T, 3>(x, g, images, k.r0, k.r1, k.wp, y, k.k0, k.kn, chunk, &acc_buf, epilogue, pairs_tiles); break;
        case 2: FwdRows<T, 2>(x, g, images, k.r0, k.r1, k.wp, y, k.k0, k.kn, chunk, &acc_buf, epilogue, pairs_tiles); break;
        default: FwdRows<T, 1>(x, g, images, k.r0, k.r1, k.wp, y, k.k0, k.kn, chunk, &acc_buf, epilogue, pairs_tiles); break;
      }
    }
  });
}

// Vectors per output-channel block of the filter gradient for C_out
// padded to `vecs_total` vectors: up to kOneTapVecs for a 1x1 filter (one
// tap), else 2 (3 x 3 taps x 2 vectors of accumulators).
inline int64_t OneTapFilterGradVecs(const Conv2DGeometry& g,
                                    int64_t vecs_total) {
  if (g.kh == 1 && g.kw == 1)
    return std::min<int64_t>(kOneTapVecs, vecs_total);
  return vecs_total > 1 ? 2 : 1;
}

template <typename T>
void DirectConv2DBackpropFilter(const T* x, const Conv2DGeometry& g,
                                const T* dy, const int64_t* images,
                                int64_t n_images, T* df,
                                const ParallelFor& pfor) {
  constexpr int L = DVec<T>::kLanes;
  if (!images) n_images = g.n;
  const int64_t ci = g.c_in, co = g.c_out;
  if (n_images <= 0 || ci == 0 || co == 0 || g.out_h <= 0 || g.out_w <= 0 ||
      g.h == 0 || g.w == 0)
    return;
  const int64_t cop = (co + L - 1) / L * L;
  const int64_t vecs = OneTapFilterGradVecs(g, cop / L);
  const int64_t nkb = (cop / L + vecs - 1) / vecs;
  // dy rows must hold whole vectors: pad a copy when C_out is not a multiple
  // of the vector length (the listed images only).
  AVector<T> dy_pad;
  const T* dyp = dy;
  bool dy_by_list = false;
  const int64_t opix = g.out_h * g.out_w;
  if (cop != co) {
    dy_pad.assign(n_images * opix * cop, T(0));
    pfor(n_images, opix * cop, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const T* src = dy + (images ? images[i] : i) * opix * co;
        T* dst = dy_pad.data() + i * opix * cop;
        for (int64_t p = 0; p < opix; ++p)
          std::memcpy(dst + p * cop, src + p * co, sizeof(T) * co);
      }
    });
    dyp = dy_pad.data();
    dy_by_list = true;
  }
  const int64_t fsize = g.kh * g.kw * ci * cop;
  const int64_t blocks = FilterGradBlocks(g, n_images);
  const int64_t work = 1 + g.h * g.w * ci * g.kh * g.kw * cop / 8;
  AVector<T> buf;
  int64_t nbuf = 1;
  if (blocks >= 2) {
    // Fixed blocks of images, each with a private padded df.
    nbuf = blocks;
    buf.assign(blocks * fsize, T(0));
    const int64_t per = (n_images + blocks - 1) / blocks;
    pfor(blocks, work * per, [&](int64_t bb, int64_t be) {
      for (int64_t blk = bb; blk < be; ++blk) {
        const int64_t i0 = std::min(n_images, blk * per);
        const int64_t i1 = std::min(n_images, i0 + per);
        FgradRows<T>(x, g, dyp, dy_by_list, images, i0, i1, 0, ci, 0, nkb, cop,
                     vecs, buf.data() + blk * fsize);
      }
    });
  } else {
    // (input-channel group, output-channel block) tasks owning their slice:
    // of df itself when C_out needs no padding (nothing to copy or add
    // afterwards), else of one padded buffer.
    const bool in_place = cop == co;
    if (!in_place) buf.assign(fsize, T(0));
    T* out = in_place ? df : buf.data();
    const int64_t cg = 64, ngroups = (ci + cg - 1) / cg;
    pfor(ngroups * nkb, work * n_images / (ngroups * nkb) + 1,
         [&](int64_t tb, int64_t te) {
           for (int64_t t = tb; t < te; ++t) {
             const int64_t gq = t / nkb, kb = t % nkb;
             FgradRows<T>(x, g, dyp, dy_by_list, images, 0, n_images, gq * cg,
                          std::min(ci, (gq + 1) * cg), kb, kb + 1, cop, vecs,
                          out);
           }
         });
    if (in_place) return;
  }
  // df += the buffers in block order (padding lanes dropped): per element
  // ((df + buf_0) + buf_1) + ..., vectorised over the output channels.
  const int64_t rows = g.kh * g.kw * ci;
  pfor(rows, co * nbuf + 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      T* d = df + r * co;
      for (int64_t blk = 0; blk < nbuf; ++blk) {
        const T* src = buf.data() + blk * fsize + r * cop;
        for (int64_t k = 0; k < co; ++k) d[k] += src[k];
      }
    }
  });
}

#define TFSS_INSTANTIATE(T)                                                  \
  template void DirectConv2DForward<T>(const T*, const Conv2DGeometry&,      \
                                       const T*, const int64_t*, int64_t, T*, \
                                       const ParallelFor&,                   \
                                       const DirectConvEpilogue<T>&);        \
  template void ApplyDirectConvEpilogue<T>(T*, int64_t, int64_t,             \
                                           const DirectConvEpilogue<T>&);    \
  template void DirectConv2DBackpropFilter<T>(                               \
      const T*, const Conv2DGeometry&, const T*, const int64_t*, int64_t, T*, \
      const ParallelFor&);
TFSS_INSTANTIATE(float)
TFSS_INSTANTIATE(double)
#undef TFSS_INSTANTIATE

}  // namespace tf_sparse_split
