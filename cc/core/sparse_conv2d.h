// Framework-free CPU kernels behind SparseSplitConv2D and
// SparseSplitConv2DBackpropFilter (layer 1 of docs/ARCHITECTURE.md).
//
// No TensorFlow headers: plain pointers and sizes, and the ParallelFor hook
// of sparse_matmul.h through which the caller supplies its thread pool.
//
// Layouts (as tf.nn.conv2d with data_format="NHWC"):
//   input  x  [N, H, W, C_in]      row-major, C_in fastest
//   filter f  [KH, KW, C_in, C_out] (HWIO), C_out fastest
//   output y  [N, OH, OW, C_out]
// Output position (oh, ow) reads input (oh*sh - pad_top + kh*dh,
// ow*sw - pad_left + kw*dw) for kh in [0, KH), kw in [0, KW); positions
// outside [0, H) x [0, W) are zero padding.
//
// Method (K.-Y. Peng, "Adaptive runtime exploiting sparsity in tensor of deep
// learning on heterogeneous systems", NTU 2017): measure the zeros of the
// input at run time; images whose density (nnz / (H*W*C_in)) is above a
// threshold go to a dense convolution, the rest to the kernels below, whose
// cost is proportional to the input's nonzeros; input channels that are zero
// in every image are compacted away from the dense part.
//
// Non-finite values: products with exact zeros of x are skipped, so a NaN/Inf
// in the filter that only meets zeros of x gives 0, not NaN (as tf.sparse).
#ifndef TF_SPARSE_SPLIT_CC_CORE_SPARSE_CONV2D_H_
#define TF_SPARSE_SPLIT_CC_CORE_SPARSE_CONV2D_H_

#include <cstdint>
#include <vector>

#include "cc/core/low_precision.h"
#include "cc/core/sparse_matmul.h"

namespace tf_sparse_split {

// Sizes of one 2-D convolution. All fields >= 0; strides and dilations >= 1.
struct Conv2DGeometry {
  int64_t n = 0, h = 0, w = 0, c_in = 0;   // input [n, h, w, c_in]
  int64_t kh = 0, kw = 0, c_out = 0;       // filter [kh, kw, c_in, c_out]
  int64_t stride_h = 1, stride_w = 1;
  int64_t dil_h = 1, dil_w = 1;
  int64_t pad_top = 0, pad_left = 0;       // zero rows/cols before the input
  int64_t out_h = 0, out_w = 0;            // output [n, out_h, out_w, c_out]

  // Every field equal (a field added above must be added here too).
  bool operator==(const Conv2DGeometry& o) const {
    return n == o.n && h == o.h && w == o.w && c_in == o.c_in &&
           kh == o.kh && kw == o.kw && c_out == o.c_out &&
           stride_h == o.stride_h && stride_w == o.stride_w &&
           dil_h == o.dil_h && dil_w == o.dil_w && pad_top == o.pad_top &&
           pad_left == o.pad_left && out_h == o.out_h && out_w == o.out_w;
  }
};

// Output size and leading padding of one spatial dimension, as TensorFlow
// computes them. padding: 0 = VALID, 1 = SAME, 2 = EXPLICIT (pad_before,
// pad_after given). Returns false (and sets *error) when the output size
// would be negative.
bool ConvOutputSize(int64_t in, int64_t k, int64_t stride, int64_t dilation,
                    int padding, int64_t pad_before, int64_t pad_after,
                    int64_t* out, int64_t* pad_lead, const char** error);

// Per-image and per-channel nonzero counts of x in one pass.
//   image_nnz[n]: out, nonzeros of each image.
//   channel_nnz[c_in]: out, number of images in which channel c has a
//                      nonzero (0 = the channel is zero in every image).
// NaN/Inf count as nonzero.
// Returns the total nnz.
template <typename T>
int64_t CountConvNonzeros(const T* x, const Conv2DGeometry& g,
                          int64_t* image_nnz, int64_t* channel_nnz,
                          const ParallelFor& pfor);

// The same counts over a strided sample of each image's pixels: pixels
// p = 0, pixel_stride, 2 * pixel_stride, ... of the H*W pixels (raster
// order) of every image are counted (pixel_stride 1: everything, as
// CountConvNonzeros). image_nnz[n] counts ConvSampledPixels(g, stride) *
// C_in values per image; channel_nnz as above over the sampled pixels (a
// channel live in the sample is live; one zero in the sample may not be).
// Instantiated for float, double and the 16-bit storage types bf16 / f16
// (whose zero test is on the bits, IsZero; vectorised with AVX-512BW when
// CPUID reports it, whatever the build flags). Returns the nnz counted.
template <typename T>
int64_t CountConvNonzerosStrided(const T* x, const Conv2DGeometry& g,
                                 int64_t pixel_stride, int64_t* image_nnz,
                                 int64_t* channel_nnz, const ParallelFor& pfor);

// Pixels of one image that CountConvNonzerosStrided counts at this stride.
int64_t ConvSampledPixels(const Conv2DGeometry& g, int64_t pixel_stride);

// Nonzeros of the listed images grouped by pixel: pixel p = (i*H + h)*W + w
// of the i-th listed image holds entries [ptr[p], ptr[p+1]) of (chan, val),
// channels ascending.
template <typename T>
struct PixelCsr {
  std::vector<int64_t> ptr;    // [n_images*H*W + 1]
  std::vector<int32_t> chan;   // [nnz]
  std::vector<T> val;          // [nnz]
};

// Builds the PixelCsr of images[0..n_images) of x (image_nnz from
// CountConvNonzeros). Parallel over images.
template <typename T>
void BuildPixelCsr(const T* x, const Conv2DGeometry& g, const int64_t* images,
                   int64_t n_images, const int64_t* image_nnz,
                   PixelCsr<T>* csr, const ParallelFor& pfor);

// Sparse forward convolution of the listed images: for i in [0, n_images),
// y[images[i]] = conv(x[images[i]], f), computed from csr (built over the same
// image list). Gather form: each output pixel accumulates, in registers, the
// nonzeros of the input pixels under its window times the matching filter
// rows f[kh, kw, c, :], in the fixed order (kh, kw, c ascending), so the bits
// do not depend on the thread count. Parallel over output rows (image, oh):
// no two threads write the same output. Work ~ nnz * KH*KW*C_out /
// (sh*sw) FMAs plus KH*KW pixel look-ups per output pixel. Other images of y
// are untouched.
template <typename T>
void SparseConv2DForward(const PixelCsr<T>& csr, const Conv2DGeometry& g,
                         const int64_t* images, int64_t n_images, const T* f,
                         T* y, const ParallelFor& pfor);

// Nonzeros of the listed images grouped by input channel: channel c holds
// entries [ptr[c], ptr[c+1]) of (image index i into the list, h, w, val) in
// ascending (i, h, w) order.
template <typename T>
struct ChannelCsr {
  std::vector<int64_t> ptr;  // [c_in + 1]
  std::vector<int32_t> img, row, col;
  std::vector<T> val;
};

// Builds the ChannelCsr of images[0..n_images) of x; deterministic, parallel
// over blocks of images.
template <typename T>
void BuildChannelCsr(const T* x, const Conv2DGeometry& g,
                     const int64_t* images, int64_t n_images,
                     ChannelCsr<T>* csc, const ParallelFor& pfor);

// Sparse filter gradient: for every nonzero x[images[i], h, w, c] and every
// (kh, kw) whose output (oh, ow) exists,
//   df[kh, kw, c, :] += x[images[i], h, w, c] * dy[images[i], oh, ow, :].
// dy is [N, OH, OW, C_out]; df [KH, KW, C_in, C_out] is accumulated into (the
// caller zeroes it or puts the dense part there first). Parallel over
// (c, kh, kw) tasks, each owning one row df[kh, kw, c, :] and summing its
// nonzeros in ascending (i, h, w) order in registers: race-free and
// deterministic. Work ~ nnz * KH*KW*C_out FMAs.
template <typename T>
void SparseConv2DBackpropFilter(const ChannelCsr<T>& csc,
                                const Conv2DGeometry& g, const int64_t* images,
                                const T* dy, T* df, const ParallelFor& pfor);

// Sparse filter gradient, pixel order (the default): the same sum as
// SparseConv2DBackpropFilter, computed from the PixelCsr of the listed images
// (built over the same list). Each input pixel's nonzeros meet the dy rows
// of its window, swept in (image, h, w) order so those rows stay in cache;
// df rows are accumulated in memory (L2-resident). The images are split into
// FilterGradBlocks(g, n_images) fixed blocks -- a number that depends on
// the sizes only, never on the thread count -- each summing into a private
// copy of df; the copies are added into df in block order: race-free and
// deterministic. Work ~ nnz * KH*KW*C_out / (sh*sw) FMAs.
template <typename T>
void SparseConv2DBackpropFilterPixels(const PixelCsr<T>& csr,
                                      const Conv2DGeometry& g,
                                      const int64_t* images, int64_t n_images,
                                      const T* dy, T* df,
                                      const ParallelFor& pfor);

// Number of private df copies SparseConv2DBackpropFilterPixels (and the
// direct filter gradient) uses. The cap is min(n_images, 16, 4M elements /
// df size, and max(2, input pixels / 3136) where df size > 16K), at least
// 1; for a 1x1 filter min(n_images, 16, 1M elements / df size, input
// pixels / 1024). The count is the largest power of two within the cap,
// less any blocks left empty: blocks of per = ceil(n_images / count)
// images, all full but the last, so threads get equal shares.
int64_t FilterGradBlocks(const Conv2DGeometry& g, int64_t n_images);

// The copies and scatters below are also instantiated for the 16-bit storage
// types bf16 and f16 (ScatterFilterChannels' adding form sums in float32 and
// rounds once to nearest even).
//
// Copies images[0..n_images) and channels chans[0..n_chans) of x into the
// dense [n_images, H, W, n_chans] buffer out (null images/chans = all).
template <typename T>
void GatherImagesChannels(const T* x, const Conv2DGeometry& g,
                          const int64_t* images, int64_t n_images,
                          const int64_t* chans, int64_t n_chans, T* out,
                          const ParallelFor& pfor);

// Copies filter rows f[:, :, chans[j], :] into the [KH, KW, n_chans, C_out]
// buffer out.
template <typename T>
void GatherFilterChannels(const T* f, const Conv2DGeometry& g,
                          const int64_t* chans, int64_t n_chans, T* out);

// Adds the [KH, KW, n_chans, C_out] buffer src into df[:, :, chans[j], :]
// (overwrite = true copies instead of adding).
template <typename T>
void ScatterFilterChannels(const T* src, const Conv2DGeometry& g,
                           const int64_t* chans, int64_t n_chans, T* df,
                           bool overwrite);

// Bias gradient of a convolution with a bias: db[c] += sum over the listed
// images and their OH*OW output pixels of dy[image, oh, ow, c], for c in
// [0, C_out). dy is [N, OH, OW, C_out] (g.n, g.out_h, g.out_w, g.c_out);
// images[0..n_images) index its images (null: images 0..n_images-1). The
// sum runs in Accum<T> (float32 for float32 and the 16-bit types, float64
// for float64) over fixed blocks of pixels -- a number that depends on the
// sizes only -- added into db in block order: deterministic whatever the
// thread count. One read of the listed images of dy; the inner loop is a
// vector add over C_out. Instantiated for float, double, bf16 and f16.
template <typename T>
void ConvBiasGrad(const T* dy, const Conv2DGeometry& g, const int64_t* images,
                  int64_t n_images, typename Accum<T>::type* db,
                  const ParallelFor& pfor);

// Copies image i of src [n_images, OH, OW, C_out] to image images[i] of y.
template <typename T>
void ScatterImages(const T* src, const Conv2DGeometry& g,
                   const int64_t* images, int64_t n_images, T* y,
                   const ParallelFor& pfor);

}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_CORE_SPARSE_CONV2D_H_
