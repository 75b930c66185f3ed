// CPU implementations of the kernels declared in sparse_conv2d.h.
#include "cc/core/sparse_conv2d.h"
#include "cc/core/compress.h"
#include "cc/core/simd_vec.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tf_sparse_split {

namespace {

using simd::Broadcast;
using simd::LoadV;
using simd::StoreV;
template <typename T>
using Vec = simd::Vec<T>;

// Nonzeros of px[0..n); sets live[c] = 1 for each nonzero channel c. NaN
// counts as nonzero.
template <typename T>
inline int64_t CountPixel(const T* px, int64_t n, uint8_t* live) {
  int64_t k = 0;
  for (int64_t c = 0; c < n; ++c) {
    const bool nz = px[c] != T(0);
    k += nz;
    live[c] |= nz;
  }
  return k;
}

#if defined(__AVX512F__) && defined(__AVX512VL__) && defined(__AVX512BW__)
template <>
inline int64_t CountPixel<float>(const float* px, int64_t n, uint8_t* live) {
  int64_t k = 0, c = 0;
  const __m512 zero = _mm512_setzero_ps();
  const __m128i ones = _mm_set1_epi8(1);
  for (; c + 16 <= n; c += 16) {
    const __mmask16 mk =
        _mm512_cmp_ps_mask(_mm512_loadu_ps(px + c), zero, _CMP_NEQ_UQ);
    k += __builtin_popcount(mk);
    _mm_mask_storeu_epi8(live + c, mk, ones);
  }
  for (; c < n; ++c) {
    const bool nz = px[c] != 0.0f;
    k += nz;
    live[c] |= nz;
  }
  return k;
}

#endif

// The 16-bit storage types: zero is +-0 in the bits (IsZero).
template <typename T>
inline int64_t CountPixelBits(const T* px, int64_t n, uint8_t* live) {
  int64_t k = 0;
  for (int64_t c = 0; c < n; ++c) {
    const bool nz = !IsZero(px[c]);
    k += nz;
    live[c] |= nz;
  }
  return k;
}

#if defined(__x86_64__)
// 32 values per compare, chosen at run time (Cpu().avx512bw).
__attribute__((target("avx512f,avx512bw"))) int64_t CountPixelBitsAvx512(
    const uint16_t* px, int64_t n, uint8_t* live) {
  int64_t k = 0, c = 0;
  const __m512i magnitude = _mm512_set1_epi16(0x7fff);
  for (; c + 32 <= n; c += 32) {
    const __mmask32 mk = _mm512_test_epi16_mask(
        _mm512_loadu_si512(reinterpret_cast<const void*>(px + c)), magnitude);
    k += __builtin_popcount(mk);
    const __m256i nz = _mm512_castsi512_si256(
        _mm512_maskz_set1_epi8(static_cast<__mmask64>(mk), 1));
    __m256i* lv = reinterpret_cast<__m256i*>(live + c);
    _mm256_storeu_si256(lv, _mm256_or_si256(_mm256_loadu_si256(lv), nz));
  }
  for (; c < n; ++c) {
    const bool nz = (px[c] & 0x7fffu) != 0;
    k += nz;
    live[c] |= nz;
  }
  return k;
}
#endif

template <>
inline int64_t CountPixel<bf16>(const bf16* px, int64_t n, uint8_t* live) {
#if defined(__x86_64__)
  if (Cpu().avx512bw)
    return CountPixelBitsAvx512(reinterpret_cast<const uint16_t*>(px), n, live);
#endif
  return CountPixelBits(px, n, live);
}
template <>
inline int64_t CountPixel<f16>(const f16* px, int64_t n, uint8_t* live) {
#if defined(__x86_64__)
  if (Cpu().avx512bw)
    return CountPixelBitsAvx512(reinterpret_cast<const uint16_t*>(px), n, live);
#endif
  return CountPixelBits(px, n, live);
}

// Nonzeros of the pixels p = 0, stride, 2 * stride, ... < hw of an image of
// ci < 16 channels (float, double); sets live[c] = 1 for each nonzero
// channel c. The channels' flags are bits of a register (CountPixel's byte
// stores would chain every pixel through live[c]); at stride 1 (float,
// AVX-512) the image is counted 16 values per compare, in chunks of
// lcm(16, ci) values (a whole number of pixels: ci / gcd(16, ci) vectors,
// one lane mask kept per vector), lane l of the chunk's vector v being
// channel (16 v + l) % ci. This covers RGB inputs (ci = 3, every image
// model's first convolution): the full count of 16x64x64x3 (a training
// call) takes ~18 us on Zen 4 this way, ~320 us in the scalar loop.
template <typename T>
inline int64_t CountImageFewChannels(const T* img, int64_t hw, int64_t ci,
                                     int64_t stride, uint8_t* live) {
  int64_t k = 0;
  uint32_t seen = 0;
  int64_t p = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same<T, float>::value) {
    if (stride == 1) {
      const __m512 zero = _mm512_setzero_ps();
      const int64_t n = hw * ci;
      int64_t period = ci;  // vectors per chunk: ci / gcd(16, ci)
      while (period % 2 == 0) period /= 2;
      const int64_t chunk = 16 * period;
      uint32_t lanes[16] = {0};
      int64_t j = 0;
      for (; j + chunk <= n; j += chunk) {
        for (int64_t v = 0; v < period; ++v) {
          const __mmask16 mk = _mm512_cmp_ps_mask(
              _mm512_loadu_ps(img + j + 16 * v), zero, _CMP_NEQ_UQ);
          k += __builtin_popcount(mk);
          lanes[v] |= mk;
        }
      }
      for (int64_t v = 0; v < period; ++v)
        for (int l = 0; l < 16; ++l)
          if ((lanes[v] >> l) & 1) seen |= uint32_t{1} << ((16 * v + l) % ci);
      p = j / ci;  // j is a multiple of lcm(16, ci): whole pixels
    }
  }
#endif
  for (; p < hw; p += stride) {
    const T* px = img + p * ci;
    for (int64_t c = 0; c < ci; ++c) {
      const bool nz = px[c] != T(0);
      k += nz;
      seen |= static_cast<uint32_t>(nz) << c;
    }
  }
  for (int64_t c = 0; c < ci; ++c) live[c] |= (seen >> c) & 1;
  return k;
}

// Most full vectors kept in registers per output chunk.
constexpr int kMaxVecs = 8;

// One tap of an output pixel's window: input pixel index into the PixelCsr
// and offset of filter row f[kh, kw, 0, 0].
struct Tap {
  int64_t pix;
  int64_t fofs;
};

// out[0 .. NV*lanes) = sum over taps and their nonzeros of val * f row.
template <typename T, int NV>
inline void ForwardChunk(const Tap* taps, int ntaps, const int64_t* ptr,
                         const int32_t* chan, const T* val, const T* f,
                         int64_t co0, int64_t c_out, T* out) {
  using V = typename Vec<T>::V;
  constexpr int L = Vec<T>::kLanes;
  // Two accumulator sets (even / odd nonzero of each tap) halve the FMA
  // dependency chains; their split depends only on the data, so the
  // summation order is fixed.
  V acc[NV], acc2[NV];
  for (int v = 0; v < NV; ++v) acc[v] = acc2[v] = V{};
  for (int t = 0; t < ntaps; ++t) {
    const int64_t b = ptr[taps[t].pix], e = ptr[taps[t].pix + 1];
    const T* fb = f + taps[t].fofs + co0;
    int64_t q = b;
    for (; q + 1 < e; q += 2) {
      const V xv = Broadcast<T>(val[q]);
      const V xv2 = Broadcast<T>(val[q + 1]);
      const T* fr = fb + static_cast<int64_t>(chan[q]) * c_out;
      const T* fr2 = fb + static_cast<int64_t>(chan[q + 1]) * c_out;
      for (int v = 0; v < NV; ++v) {
        acc[v] += xv * LoadV<V>(fr + v * L);
        acc2[v] += xv2 * LoadV<V>(fr2 + v * L);
      }
    }
    if (q < e) {
      const V xv = Broadcast<T>(val[q]);
      const T* fr = fb + static_cast<int64_t>(chan[q]) * c_out;
      for (int v = 0; v < NV; ++v) acc[v] += xv * LoadV<V>(fr + v * L);
    }
  }
  for (int v = 0; v < NV; ++v) StoreV(out + co0 + v * L, acc[v] + acc2[v]);
}

// Scalar tail: out[co0 .. c_out) (fewer than one vector).
template <typename T>
inline void ForwardTail(const Tap* taps, int ntaps, const int64_t* ptr,
                        const int32_t* chan, const T* val, const T* f,
                        int64_t co0, int64_t c_out, T* out) {
  constexpr int L = Vec<T>::kLanes;
  T acc[L] = {};
  const int64_t nt = c_out - co0;
  for (int t = 0; t < ntaps; ++t) {
    const int64_t b = ptr[taps[t].pix], e = ptr[taps[t].pix + 1];
    const T* fb = f + taps[t].fofs + co0;
    for (int64_t q = b; q < e; ++q) {
      const T x = val[q];
      const T* fr = fb + static_cast<int64_t>(chan[q]) * c_out;
      for (int64_t j = 0; j < nt; ++j) acc[j] += x * fr[j];
    }
  }
  for (int64_t j = 0; j < nt; ++j) out[co0 + j] = acc[j];
}

template <typename T>
void ForwardPixel(const Tap* taps, int ntaps, const int64_t* ptr,
                  const int32_t* chan, const T* val, const T* f,
                  int64_t c_out, T* out) {
  constexpr int L = Vec<T>::kLanes;
  int64_t co0 = 0;
  for (; co0 + kMaxVecs * L <= c_out; co0 += kMaxVecs * L)
    ForwardChunk<T, kMaxVecs>(taps, ntaps, ptr, chan, val, f, co0, c_out, out);
  const int64_t rest = (c_out - co0) / L;
  switch (rest) {
    case 7: ForwardChunk<T, 7>(taps, ntaps, ptr, chan, val, f, co0, c_out, out); break;
    case 6: ForwardChunk<T, 6>(taps, ntaps, ptr, chan, val, f, co0, c_out, out); break;
    case 5: ForwardChunk<T, 5>(taps, ntaps, ptr, chan, val, f, co0, c_out, out); break;
    case 4: ForwardChunk<T, 4>(taps, ntaps, ptr, chan, val, f, co0, c_out, out); break;
    case 3: ForwardChunk<T, 3>(taps, ntaps, ptr, chan, val, f, co0, c_out, out); break;
    case 2: ForwardChunk<T, 2>(taps, ntaps, ptr, chan, val, f, co0, c_out, out); break;
    case 1: ForwardChunk<T, 1>(taps, ntaps, ptr, chan, val, f, co0, c_out, out); break;
    default: break;
  }
  co0 += rest * L;
  if (co0 < c_out) ForwardTail<T>(taps, ntaps, ptr, chan, val, f, co0, c_out, out);
}

// Filter-gradient chunk: out[co0 .. co0 + NV*lanes) += sum over the entries
// [b, e) of channel c of val * dy row at (oh, ow) of the tap (kh, kw).
template <typename T, int NV>
inline void BackpropChunk(const ChannelCsr<T>& csc, int64_t b, int64_t e,
                          const int64_t* oh_of, const int64_t* ow_of,
                          const int64_t* img_base, const T* dy, int64_t c_out,
                          int64_t co0, T* out) {
  using V = typename Vec<T>::V;
  constexpr int L = Vec<T>::kLanes;
  V acc[NV];
  for (int v = 0; v < NV; ++v) acc[v] = V{};
  for (int64_t q = b; q < e; ++q) {
    const int64_t oh = oh_of[csc.row[q]];
    if (oh < 0) continue;
    const int64_t ow = ow_of[csc.col[q]];
    if (ow < 0) continue;
    const T* d = dy + img_base[csc.img[q]] + oh + ow + co0;
    const V xv = Broadcast<T>(csc.val[q]);
    for (int v = 0; v < NV; ++v) acc[v] += xv * LoadV<V>(d + v * L);
  }
  for (int v = 0; v < NV; ++v) {
    V o = LoadV<V>(out + co0 + v * L);
    StoreV(out + co0 + v * L, o + acc[v]);
  }
}

template <typename T>
inline void BackpropTail(const ChannelCsr<T>& csc, int64_t b, int64_t e,
                         const int64_t* oh_of, const int64_t* ow_of,
                         const int64_t* img_base, const T* dy, int64_t c_out,
                         int64_t co0, T* out) {
  constexpr int L = Vec<T>::kLanes;
  T acc[L] = {};
  const int64_t nt = c_out - co0;
  for (int64_t q = b; q < e; ++q) {
    const int64_t oh = oh_of[csc.row[q]];
    if (oh < 0) continue;
    const int64_t ow = ow_of[csc.col[q]];
    if (ow < 0) continue;
    const T* d = dy + img_base[csc.img[q]] + oh + ow + co0;
    const T x = csc.val[q];
    for (int64_t j = 0; j < nt; ++j) acc[j] += x * d[j];
  }
  for (int64_t j = 0; j < nt; ++j) out[co0 + j] += acc[j];
}


// dfrow[0 .. c_out) += x * d[0 .. c_out), with d held in registers by the
// caller's chunking: one pixel's nonzeros all use the same dy row.
template <typename T, int NV>
inline void PixelTapChunk(const int64_t b, const int64_t e, const int32_t* chan,
                          const T* val, const T* d, T* fbase, int64_t c_out,
                          int64_t co0) {
  using V = typename Vec<T>::V;
  constexpr int L = Vec<T>::kLanes;
  V dv[NV];
  for (int v = 0; v < NV; ++v) dv[v] = LoadV<V>(d + co0 + v * L);
  for (int64_t q = b; q < e; ++q) {
    const V xv = Broadcast<T>(val[q]);
    T* o = fbase + static_cast<int64_t>(chan[q]) * c_out + co0;
    for (int v = 0; v < NV; ++v)
      StoreV(o + v * L, LoadV<V>(o + v * L) + xv * dv[v]);
  }
}

template <typename T>
inline void PixelTap(const int64_t b, const int64_t e, const int32_t* chan,
                     const T* val, const T* d, T* fbase, int64_t c_out) {
  constexpr int L = Vec<T>::kLanes;
  int64_t co0 = 0;
  for (; co0 + kMaxVecs * L <= c_out; co0 += kMaxVecs * L)
    PixelTapChunk<T, kMaxVecs>(b, e, chan, val, d, fbase, c_out, co0);
  const int64_t rest = (c_out - co0) / L;
  switch (rest) {
#define TFSS_CASE(NV) \
  case NV: PixelTapChunk<T, NV>(b, e, chan, val, d, fbase, c_out, co0); break;
    TFSS_CASE(7) TFSS_CASE(6) TFSS_CASE(5) TFSS_CASE(4) TFSS_CASE(3)
    TFSS_CASE(2) TFSS_CASE(1)
#undef TFSS_CASE
    default: break;
  }
  co0 += rest * L;
  if (co0 < c_out) {
    for (int64_t q = b; q < e; ++q) {
      const T x = val[q];
      T* o = fbase + static_cast<int64_t>(chan[q]) * c_out;
      for (int64_t j = co0; j < c_out; ++j) o[j] += x * d[j];
    }
  }
}

}  // namespace

int64_t FilterGradBlocks(const Conv2DGeometry& g, int64_t n_images) {
  if (n_images <= 1) return 1;
  const int64_t fsize = std::max<int64_t>(1, g.kh * g.kw * g.c_in * g.c_out);
  // A private copy (zeroed, then added into df) costs about as much as
  // one pass over its df values per input pixel of the block. So where df
  // is over 16K values (64 KB in float32; smaller copies stay in L2 and
  // cost little) a block takes at least 3136 input pixels (16 images of
  // 14x14), with at least two blocks (work for two threads) where there
  // are two images; at most 4M copied values. Direct kernel, 3x3, 50%
  // zeros, 2-core Xeon, two interleaved runs, against blocks of any size
  // (up to 16): 16x16x16x64 -> 64 1.19-1.29 / 2.30-2.67 ms, 16x8x8x128 ->
  // 128 1.38-1.50 / 2.13-2.58 ms, 16x8x8x256 -> 256 5.2-5.4 / 6.1-6.2 ms,
  // 32x14x14x64 -> 128 3.0-3.1 / 3.6-3.9 ms, 8x28x28x128 -> 128 5.4-5.5 /
  // 6.1-6.4 ms, 4x14x14x256 -> 256 3.8-3.9 / 4.6-4.7 ms; 32x28x28x128,
  // 32x14x14x256 and 32x56x56x64 even.
  // One tap (1x1): its work per pixel is one pass over its df rows, so at
  // least 1024 pixels and at most 1M copied values a block; against the
  // rule before it (4M values, any pixels): 16x8x8x128 -> 512 0.67-0.78 /
  // 1.04-1.29 ms, 16x4x4x256 -> 1024 0.83-0.86 / 2.25-2.47 ms,
  // 16x16x16x128 -> 512 2.02-2.03 / 2.55-2.57 ms, 16x8x8x512 -> 128
  // 0.91-0.92 / 1.21-1.26 ms; 32x14x14x256 -> 1024 and 32x28x28x64 -> 256
  // even.
  const bool one_tap = g.kh == 1 && g.kw == 1;
  const int64_t pixels = n_images * g.h * g.w;
  const int64_t by_memory =
      std::max<int64_t>(1, (int64_t{1} << (one_tap ? 20 : 22)) / fsize);
  const int64_t by_pixels =
      one_tap ? std::max<int64_t>(1, pixels / 1024)
      : fsize > 16384 ? std::max<int64_t>(2, pixels / 3136)
                      : n_images;
  const int64_t cap = std::max<int64_t>(
      1, std::min<int64_t>({n_images, 16, by_memory, by_pixels}));
  // Equal blocks: the largest power of two within the cap, and no empty
  // blocks (ceil(n / per) of them). A cap of 7 on 32 images used to give
  // blocks of 5, 5, 5, 5, 5, 5, 2 images -- 4 blocks (20 images) on one of
  // two threads, 3 (12 images) on the other.
  int64_t pow2 = 1;
  while (pow2 * 2 <= cap) pow2 *= 2;
  const int64_t per = (n_images + pow2 - 1) / pow2;
  return std::max<int64_t>(1, (n_images + per - 1) / per);
}

template <typename T>
void SparseConv2DBackpropFilterPixels(const PixelCsr<T>& csr,
                                      const Conv2DGeometry& g,
                                      const int64_t* images, int64_t n_images,
                                      const T* dy, T* df,
                                      const ParallelFor& pfor) {
  const int64_t ci = g.c_in, co = g.c_out, hw = g.h * g.w;
  const int64_t fsize = g.kh * g.kw * ci * co;
  const int64_t blocks = FilterGradBlocks(g, n_images);
  const int64_t per = (n_images + blocks - 1) / blocks;
  std::vector<T> part(blocks * fsize, T(0));
  const int64_t* ptr = csr.ptr.data();
  const int32_t* chan = csr.chan.data();
  const T* val = csr.val.data();
  const int64_t nnz = ptr[n_images * hw];
  const int64_t cost = 1 + (nnz / blocks) * g.kh * g.kw * (co + 4);
  pfor(blocks, cost, [&](int64_t bb, int64_t be) {
    for (int64_t blk = bb; blk < be; ++blk) {
      T* acc = part.data() + blk * fsize;
      const int64_t i0 = std::min(n_images, blk * per);
      const int64_t i1 = std::min(n_images, i0 + per);
      for (int64_t i = i0; i < i1; ++i) {
        const T* dyi = dy + images[i] * g.out_h * g.out_w * co;
        for (int64_t h = 0; h < g.h; ++h) {
          for (int64_t kh = 0; kh < g.kh; ++kh) {
            const int64_t nh = h + g.pad_top - kh * g.dil_h;
            if (nh < 0 || nh % g.stride_h) continue;
            const int64_t oh = nh / g.stride_h;
            if (oh >= g.out_h) continue;
            for (int64_t w = 0; w < g.w; ++w) {
              const int64_t p = (i * g.h + h) * g.w + w;
              const int64_t b = ptr[p], e = ptr[p + 1];
              if (b == e) continue;
              for (int64_t kw = 0; kw < g.kw; ++kw) {
                const int64_t nw = w + g.pad_left - kw * g.dil_w;
                if (nw < 0 || nw % g.stride_w) continue;
                const int64_t ow = nw / g.stride_w;
                if (ow >= g.out_w) continue;
                PixelTap<T>(b, e, chan, val, dyi + (oh * g.out_w + ow) * co,
                            acc + (kh * g.kw + kw) * ci * co, co);
              }
            }
          }
        }
      }
    }
  });
  // Deterministic reduction: df += part[0] + part[1] + ... in block order.
  pfor(fsize, blocks + 1, [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j) {
      T s = df[j];
      for (int64_t blk = 0; blk < blocks; ++blk) s += part[blk * fsize + j];
      df[j] = s;
    }
  });
}

bool ConvOutputSize(int64_t in, int64_t k, int64_t stride, int64_t dilation,
                    int padding, int64_t pad_before, int64_t pad_after,
                    int64_t* out, int64_t* pad_lead, const char** error) {
  const int64_t ek = (k - 1) * dilation + 1;  // effective filter size
  if (padding == 1) {  // SAME
    *out = (in + stride - 1) / stride;
    const int64_t total = std::max<int64_t>((*out - 1) * stride + ek - in, 0);
    *pad_lead = total / 2;
    return true;
  }
  const int64_t pb = padding == 2 ? pad_before : 0;
  const int64_t pa = padding == 2 ? pad_after : 0;
  const int64_t padded = in + pb + pa;
  // As TensorFlow (GetWindowedOutputSizeFromDimsV2): a filter up to
  // `stride - 1` larger than the padded input gives an empty output, a
  // larger one an error.
  if ((padded - ek + stride) / stride < 0) {
    *error = "the (padded) input is smaller than the dilated filter";
    return false;
  }
  *out = padded < ek ? 0 : (padded - ek) / stride + 1;
  *pad_lead = pb;
  return true;
}

// A sampled pixel's wait on memory in the ParallelFor cost unit (about
// 0.1 ns: ~70 ns).
constexpr int64_t kSampledPixelWaitCost = 640;

int64_t ConvSampledPixels(const Conv2DGeometry& g, int64_t pixel_stride) {
  const int64_t hw = g.h * g.w, s = pixel_stride < 1 ? 1 : pixel_stride;
  return (hw + s - 1) / s;
}

template <typename T>
int64_t CountConvNonzerosStrided(const T* x, const Conv2DGeometry& g,
                                 int64_t pixel_stride, int64_t* image_nnz,
                                 int64_t* channel_nnz, const ParallelFor& pfor) {
  const int64_t hw = g.h * g.w, ci = g.c_in;
  const int64_t stride = pixel_stride < 1 ? 1 : pixel_stride;
  std::vector<uint8_t> live(g.n * ci, 0);
  // Work per image for the thread pool's split: its values, and for a
  // sample also the wait on memory of every sampled pixel (each in
  // another page at 64 float channels and stride 17: on the 2-core Xeon
  // ~70 ns a pixel, 0.4-0.5 ms on one core for 32x56x56x64, which the
  // values alone priced under the pool's threshold, so it ran on the
  // calling thread).
  const int64_t per_pixel = ci + (stride > 1 ? kSampledPixelWaitCost : 0);
  pfor(g.n, ConvSampledPixels(g, stride) * per_pixel, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      const T* img = x + n * hw * ci;
      uint8_t* lv = live.data() + n * ci;
      if constexpr (std::is_same<T, float>::value ||
                    std::is_same<T, double>::value) {
        if (ci < 16) {
          image_nnz[n] = CountImageFewChannels<T>(img, hw, ci, stride, lv);
          continue;
        }
      }
      int64_t s = 0;
      for (int64_t p = 0; p < hw; p += stride)
        s += CountPixel<T>(img + p * ci, ci, lv);
      image_nnz[n] = s;
    }
  });
  std::fill(channel_nnz, channel_nnz + ci, 0);
  int64_t total = 0;
  for (int64_t n = 0; n < g.n; ++n) {
    for (int64_t c = 0; c < ci; ++c) channel_nnz[c] += live[n * ci + c];
    total += image_nnz[n];
  }
  return total;
}

template <typename T>
int64_t CountConvNonzeros(const T* x, const Conv2DGeometry& g,
                          int64_t* image_nnz, int64_t* channel_nnz,
                          const ParallelFor& pfor) {
  return CountConvNonzerosStrided<T>(x, g, 1, image_nnz, channel_nnz, pfor);
}

template <typename T>
void BuildPixelCsr(const T* x, const Conv2DGeometry& g, const int64_t* images,
                   int64_t n_images, const int64_t* image_nnz,
                   PixelCsr<T>* csr, const ParallelFor& pfor) {
  const int64_t hw = g.h * g.w, ci = g.c_in;
  std::vector<int64_t> start(n_images + 1, 0);
  for (int64_t i = 0; i < n_images; ++i)
    start[i + 1] = start[i] + image_nnz[images[i]];
  csr->ptr.assign(n_images * hw + 1, 0);
  csr->chan.resize(start[n_images]);
  csr->val.resize(start[n_images]);
  pfor(n_images, hw * ci * 3, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const T* img = x + images[i] * hw * ci;
      int64_t q = start[i];
      int64_t* ptr = csr->ptr.data() + i * hw;
      int32_t* ch = csr->chan.data();
      T* vl = csr->val.data();
      for (int64_t p = 0; p < hw; ++p) {
        ptr[p] = q;
        q += CompressRow<T>(img + p * ci, ci, ch + q, vl + q);
      }
    }
  });
  csr->ptr[n_images * hw] = start[n_images];
}

template <typename T>
void SparseConv2DForward(const PixelCsr<T>& csr, const Conv2DGeometry& g,
                         const int64_t* images, int64_t n_images, const T* f,
                         T* y, const ParallelFor& pfor) {
  const int64_t hw = g.h * g.w;
  const int64_t co = g.c_out, ci = g.c_in;
  const int64_t out_img = g.out_h * g.out_w * co;
  const int64_t* ptr = csr.ptr.data();
  const int32_t* chan = csr.chan.data();
  const T* val = csr.val.data();
  const int64_t nnz = ptr[n_images * hw];
  const double per_row =
      (static_cast<double>(nnz) / std::max<int64_t>(1, n_images * g.out_h)) *
          g.kh * g.kw * co / (g.stride_h * g.stride_w) +
      g.out_w * (g.kh * g.kw + co);
  const int64_t cost = static_cast<int64_t>(std::min(per_row, 1e12)) + 1;
  pfor(n_images * g.out_h, cost, [&](int64_t b, int64_t e) {
    std::vector<Tap> taps(g.kh * g.kw);
    std::vector<int64_t> hs(g.kh), khs(g.kh);
    for (int64_t r = b; r < e; ++r) {
      const int64_t i = r / g.out_h, oh = r % g.out_h;
      T* yrow = y + images[i] * out_img + oh * g.out_w * co;
      if (ptr[i * hw] == ptr[(i + 1) * hw]) {  // all-zero image
        std::fill(yrow, yrow + g.out_w * co, T(0));
        continue;
      }
      int nkh = 0;
      for (int64_t kh = 0; kh < g.kh; ++kh) {
        const int64_t h = oh * g.stride_h - g.pad_top + kh * g.dil_h;
        if (h < 0 || h >= g.h) continue;
        hs[nkh] = h;
        khs[nkh] = kh;
        ++nkh;
      }
      for (int64_t ow = 0; ow < g.out_w; ++ow) {
        int ntaps = 0;
        for (int a = 0; a < nkh; ++a) {
          const int64_t pix_row = (i * g.h + hs[a]) * g.w;
          for (int64_t kw = 0; kw < g.kw; ++kw) {
            const int64_t w = ow * g.stride_w - g.pad_left + kw * g.dil_w;
            if (w < 0 || w >= g.w) continue;
            const int64_t pix = pix_row + w;
            if (ptr[pix] == ptr[pix + 1]) continue;  // empty input pixel
            taps[ntaps].pix = pix;
            taps[ntaps].fofs = (khs[a] * g.kw + kw) * ci * co;
            ++ntaps;
          }
        }
        ForwardPixel<T>(taps.data(), ntaps, ptr, chan, val, f, co,
                        yrow + ow * co);
      }
    }
  });
}

template <typename T>
void BuildChannelCsr(const T* x, const Conv2DGeometry& g,
                     const int64_t* images, int64_t n_images,
                     ChannelCsr<T>* csc, const ParallelFor& pfor) {
  const int64_t hw = g.h * g.w, ci = g.c_in;
  const int64_t shards = std::max<int64_t>(1, std::min<int64_t>(n_images, 64));
  const int64_t per = (n_images + shards - 1) / std::max<int64_t>(1, shards);
  std::vector<int64_t> count(shards * ci, 0);
  auto shard_range = [&](int64_t s, int64_t* b, int64_t* e) {
    *b = std::min(n_images, s * per);
    *e = std::min(n_images, *b + per);
  };
  pfor(shards, per * hw * ci, [&](int64_t sb, int64_t se) {
    for (int64_t s = sb; s < se; ++s) {
      int64_t b, e;
      shard_range(s, &b, &e);
      int64_t* cnt = count.data() + s * ci;
      for (int64_t i = b; i < e; ++i) {
        const T* img = x + images[i] * hw * ci;
        for (int64_t p = 0; p < hw; ++p)
          for (int64_t c = 0; c < ci; ++c) cnt[c] += img[p * ci + c] != T(0);
      }
    }
  });
  // offset[s][c] = ptr[c] + sum over earlier shards of count[s'][c].
  csc->ptr.assign(ci + 1, 0);
  std::vector<int64_t> offset(shards * ci);
  int64_t run = 0;
  for (int64_t c = 0; c < ci; ++c) {
    csc->ptr[c] = run;
    for (int64_t s = 0; s < shards; ++s) {
      offset[s * ci + c] = run;
      run += count[s * ci + c];
    }
  }
  csc->ptr[ci] = run;
  csc->img.resize(run);
  csc->row.resize(run);
  csc->col.resize(run);
  csc->val.resize(run);
  pfor(shards, per * hw * ci * 2, [&](int64_t sb, int64_t se) {
    for (int64_t s = sb; s < se; ++s) {
      int64_t b, e;
      shard_range(s, &b, &e);
      int64_t* off = offset.data() + s * ci;
      for (int64_t i = b; i < e; ++i) {
        const T* img = x + images[i] * hw * ci;
        for (int64_t h = 0; h < g.h; ++h)
          for (int64_t w = 0; w < g.w; ++w) {
            const T* px = img + (h * g.w + w) * ci;
            for (int64_t c = 0; c < ci; ++c) {
              const T v = px[c];
              if (v != T(0)) {
                const int64_t q = off[c]++;
                csc->img[q] = static_cast<int32_t>(i);
                csc->row[q] = static_cast<int32_t>(h);
                csc->col[q] = static_cast<int32_t>(w);
                csc->val[q] = v;
              }
            }
          }
      }
    }
  });
}

template <typename T>
void SparseConv2DBackpropFilter(const ChannelCsr<T>& csc,
                                const Conv2DGeometry& g, const int64_t* images,
                                const T* dy, T* df, const ParallelFor& pfor) {
  constexpr int L = Vec<T>::kLanes;
  const int64_t ci = g.c_in, co = g.c_out;
  // oh_of[kh][h]: offset (oh * OW * C_out) of the output row input row h
  // feeds through filter row kh, or -1; likewise ow_of[kw][w] (ow * C_out).
  std::vector<int64_t> oh_of(g.kh * g.h, -1), ow_of(g.kw * g.w, -1);
  for (int64_t kh = 0; kh < g.kh; ++kh)
    for (int64_t h = 0; h < g.h; ++h) {
      const int64_t num = h + g.pad_top - kh * g.dil_h;
      if (num >= 0 && num % g.stride_h == 0 && num / g.stride_h < g.out_h)
        oh_of[kh * g.h + h] = (num / g.stride_h) * g.out_w * co;
    }
  for (int64_t kw = 0; kw < g.kw; ++kw)
    for (int64_t w = 0; w < g.w; ++w) {
      const int64_t num = w + g.pad_left - kw * g.dil_w;
      if (num >= 0 && num % g.stride_w == 0 && num / g.stride_w < g.out_w)
        ow_of[kw * g.w + w] = (num / g.stride_w) * co;
    }
  int64_t n_img = 0;
  for (int64_t q = 0; q < static_cast<int64_t>(csc.img.size()); ++q)
    n_img = std::max<int64_t>(n_img, csc.img[q] + 1);
  std::vector<int64_t> img_base(n_img);
  for (int64_t i = 0; i < n_img; ++i)
    img_base[i] = images[i] * g.out_h * g.out_w * co;
  const int64_t tasks = ci * g.kh * g.kw;
  const int64_t nnz = csc.ptr[ci];
  const int64_t cost = 1 + (nnz / std::max<int64_t>(1, ci)) * (co + 8);
  pfor(tasks, cost, [&](int64_t tb, int64_t te) {
    for (int64_t t = tb; t < te; ++t) {
      const int64_t c = t / (g.kh * g.kw), r = t % (g.kh * g.kw);
      const int64_t kh = r / g.kw, kw = r % g.kw;
      const int64_t b = csc.ptr[c], e = csc.ptr[c + 1];
      if (b == e) continue;
      const int64_t* ohp = oh_of.data() + kh * g.h;
      const int64_t* owp = ow_of.data() + kw * g.w;
      T* out = df + ((kh * g.kw + kw) * ci + c) * co;
      int64_t co0 = 0;
      for (; co0 + kMaxVecs * L <= co; co0 += kMaxVecs * L)
        BackpropChunk<T, kMaxVecs>(csc, b, e, ohp, owp, img_base.data(), dy,
                                   co, co0, out);
      const int64_t rest = (co - co0) / L;
      switch (rest) {
#define TFSS_CASE(NV)                                                     \
  case NV:                                                               \
    BackpropChunk<T, NV>(csc, b, e, ohp, owp, img_base.data(), dy, co,   \
                         co0, out);                                      \
    break;
        TFSS_CASE(7) TFSS_CASE(6) TFSS_CASE(5) TFSS_CASE(4) TFSS_CASE(3)
        TFSS_CASE(2) TFSS_CASE(1)
#undef TFSS_CASE
        default: break;
      }
      co0 += rest * L;
      if (co0 < co)
        BackpropTail<T>(csc, b, e, ohp, owp, img_base.data(), dy, co, co0,
                        out);
    }
  });
}

template <typename T>
void GatherImagesChannels(const T* x, const Conv2DGeometry& g,
                          const int64_t* images, int64_t n_images,
                          const int64_t* chans, int64_t n_chans, T* out,
                          const ParallelFor& pfor) {
  const int64_t hw = g.h * g.w, ci = g.c_in;
  pfor(n_images * g.h, g.w * n_chans + 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const int64_t i = r / g.h, h = r % g.h;
      const int64_t src_img = images ? images[i] : i;
      const T* src = x + (src_img * hw + h * g.w) * ci;
      T* dst = out + (i * hw + h * g.w) * n_chans;
      if (!chans) {
        std::memcpy(dst, src, sizeof(T) * g.w * ci);
        continue;
      }
      for (int64_t w = 0; w < g.w; ++w)
        for (int64_t j = 0; j < n_chans; ++j)
          dst[w * n_chans + j] = src[w * ci + chans[j]];
    }
  });
}

template <typename T>
void GatherFilterChannels(const T* f, const Conv2DGeometry& g,
                          const int64_t* chans, int64_t n_chans, T* out) {
  const int64_t co = g.c_out;
  for (int64_t t = 0; t < g.kh * g.kw; ++t)
    for (int64_t j = 0; j < n_chans; ++j)
      std::memcpy(out + (t * n_chans + j) * co,
                  f + (t * g.c_in + chans[j]) * co, sizeof(T) * co);
}

template <typename T>
void ScatterFilterChannels(const T* src, const Conv2DGeometry& g,
                           const int64_t* chans, int64_t n_chans, T* df,
                           bool overwrite) {
  const int64_t co = g.c_out;
  for (int64_t t = 0; t < g.kh * g.kw; ++t)
    for (int64_t j = 0; j < n_chans; ++j) {
      const T* s = src + (t * n_chans + j) * co;
      T* d = df + (t * g.c_in + chans[j]) * co;
      if (overwrite) {
        std::memcpy(d, s, sizeof(T) * co);
      } else if constexpr (IsLowPrecision<T>::value) {
        for (int64_t k = 0; k < co; ++k)
          d[k] = FromFloat<T>(ToFloat(d[k]) + ToFloat(s[k]));
      } else {
        for (int64_t k = 0; k < co; ++k) d[k] += s[k];
      }
    }
}

template <typename T>
void ScatterImages(const T* src, const Conv2DGeometry& g,
                   const int64_t* images, int64_t n_images, T* y,
                   const ParallelFor& pfor) {
  const int64_t out_img = g.out_h * g.out_w * g.c_out;
  pfor(n_images, out_img + 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      std::memcpy(y + images[i] * out_img, src + i * out_img,
                  sizeof(T) * out_img);
  });
}

template <typename T>
void ConvBiasGrad(const T* dy, const Conv2DGeometry& g, const int64_t* images,
                  int64_t n_images, typename Accum<T>::type* db,
                  const ParallelFor& pfor) {
  using A = typename Accum<T>::type;
  const int64_t c = g.c_out, pixels = g.out_h * g.out_w;
  const int64_t rows = n_images * pixels;
  if (c <= 0 || rows <= 0) return;
  // About 2^16 values per block: few enough blocks that their partial sums
  // cost little, enough that both cores share a ResNet-sized gradient.
  const int64_t rows_per_block = std::max<int64_t>(1, (int64_t{1} << 16) / c);
  const int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
  std::vector<A> part(static_cast<size_t>(blocks * c), A(0));
  pfor(blocks, rows_per_block * c, [&](int64_t b, int64_t e) {
    std::vector<float> buf(IsLowPrecision<T>::value ? c : 0);
    for (int64_t blk = b; blk < e; ++blk) {
      A* __restrict acc = part.data() + blk * c;
      const int64_t r0 = blk * rows_per_block;
      const int64_t r1 = std::min(rows, r0 + rows_per_block);
      int64_t i = r0 / pixels, p = r0 % pixels;
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t img = images ? images[i] : i;
        const T* __restrict row = dy + (img * pixels + p) * c;
        if constexpr (IsLowPrecision<T>::value) {
          WidenToFloat(row, buf.data(), c);
          const float* __restrict v = buf.data();
          for (int64_t j = 0; j < c; ++j) acc[j] += v[j];
        } else {
          for (int64_t j = 0; j < c; ++j) acc[j] += row[j];
        }
        if (++p == pixels) {
          p = 0;
          ++i;
        }
      }
    }
  });
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const A* acc = part.data() + blk * c;
    for (int64_t j = 0; j < c; ++j) db[j] += acc[j];
  }
}

#define TFSS_INSTANTIATE_COUNT_COPY(T)                                        \
  template int64_t CountConvNonzeros<T>(const T*, const Conv2DGeometry&,      \
                                        int64_t*, int64_t*,                   \
                                        const ParallelFor&);                  \
  template int64_t CountConvNonzerosStrided<T>(                               \
      const T*, const Conv2DGeometry&, int64_t, int64_t*, int64_t*,           \
      const ParallelFor&);                                                    \
  template void GatherImagesChannels<T>(const T*, const Conv2DGeometry&,      \
                                        const int64_t*, int64_t,              \
                                        const int64_t*, int64_t, T*,          \
                                        const ParallelFor&);                  \
  template void GatherFilterChannels<T>(const T*, const Conv2DGeometry&,      \
                                        const int64_t*, int64_t, T*);         \
  template void ScatterFilterChannels<T>(const T*, const Conv2DGeometry&,     \
                                         const int64_t*, int64_t, T*, bool);  \
  template void ScatterImages<T>(const T*, const Conv2DGeometry&,             \
                                 const int64_t*, int64_t, T*,                 \
                                 const ParallelFor&);                         \
  template void ConvBiasGrad<T>(const T*, const Conv2DGeometry&,              \
                                const int64_t*, int64_t,                      \
                                typename Accum<T>::type*, const ParallelFor&);
TFSS_INSTANTIATE_COUNT_COPY(float)
TFSS_INSTANTIATE_COUNT_COPY(double)
TFSS_INSTANTIATE_COUNT_COPY(bf16)
TFSS_INSTANTIATE_COUNT_COPY(f16)
#undef TFSS_INSTANTIATE_COUNT_COPY

#define TFSS_INSTANTIATE(T)                                                   \
  template void BuildPixelCsr<T>(const T*, const Conv2DGeometry&,             \
                                 const int64_t*, int64_t, const int64_t*,     \
                                 PixelCsr<T>*, const ParallelFor&);           \
  template void SparseConv2DForward<T>(const PixelCsr<T>&,                    \
                                       const Conv2DGeometry&, const int64_t*, \
                                       int64_t, const T*, T*,                 \
                                       const ParallelFor&);                   \
  template void BuildChannelCsr<T>(const T*, const Conv2DGeometry&,           \
                                   const int64_t*, int64_t, ChannelCsr<T>*,   \
                                   const ParallelFor&);                       \
  template void SparseConv2DBackpropFilter<T>(                                \
      const ChannelCsr<T>&, const Conv2DGeometry&, const int64_t*, const T*,  \
      T*, const ParallelFor&);                                                \
  template void SparseConv2DBackpropFilterPixels<T>(                          \
      const PixelCsr<T>&, const Conv2DGeometry&, const int64_t*, int64_t,     \
      const T*, T*, const ParallelFor&);
TFSS_INSTANTIATE(float)
TFSS_INSTANTIATE(double)
#undef TFSS_INSTANTIATE

}  // namespace tf_sparse_split
