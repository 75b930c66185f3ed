// Zero-skipping direct convolution kernels in the dense NHWC layout
// (framework-free, layer 1 of docs/ARCHITECTURE.md).
//
// Method (SparseTrain: Z. Gong, H. Ji, C. W. Fletcher, C. J. Hughes and
// J. Torrellas, "SparseTrain: Leveraging Dynamic Sparsity in Training DNNs on
// General-Purpose SIMD Processors", 2019, arXiv 1911.10175): the input is
// tested for zeros inside a direct convolution, in its own dense layout --
// no CSR, no index arrays, nothing converted. A vector compare gives a
// bitmask of the nonzero input channels of a pixel (AVX-512; a scalar loop
// in other builds), and a bit-scan loop visits only the nonzeros; each one is
// broadcast and multiplied into output-channel vectors kept in registers.
// Work ~ nnz * KH*KW*C_out / (sh*sw) multiply-adds plus a compare per input
// value and tile it feeds.
//
// Layouts as sparse_conv2d.h (tf.nn.conv2d, data_format NHWC):
//   x [N, H, W, C_in], f [KH, KW, C_in, C_out] (HWIO), y [N, OH, OW, C_out],
//   any strides, dilations and leading paddings of Conv2DGeometry.
//
// Non-finite values: NaN/Inf in x are nonzeros and propagate as in the dense
// convolution; products with exact zeros of x are skipped, so a NaN/Inf in
// the filter (forward) or in dy (filter gradient) that only meets zeros of x
// gives 0, not NaN (as tf.sparse and the CSR kernels of sparse_conv2d.h).
//
// Determinism: every output value is summed by exactly one task in an order
// fixed by the sizes (never by the thread count), so the bits do not depend
// on how ParallelFor shards the work.
#ifndef TF_SPARSE_SPLIT_CC_CORE_DIRECT_CONV2D_H_
#define TF_SPARSE_SPLIT_CC_CORE_DIRECT_CONV2D_H_

#include <cstdint>

#include "cc/core/epilogue.h"
#include "cc/core/parallel_for.h"
#include "cc/core/sparse_conv2d.h"

namespace tf_sparse_split {

// The bias + activation the forward kernel applies to each output value
// once its sum is complete: y = act(y + bias[c]). With nan_to_zero, relu
// and relu6 compute max(v, 0) (NaN -> 0, -0 -> +0) as oneDNN's post-ops;
// otherwise as tf.nn.relu / tf.nn.relu6 (NaN stays NaN). Nothing is applied
// when bias is null and act is kNone.
template <typename T>
struct DirectConvEpilogue {
  const T* bias = nullptr;  // [C_out], or null: no bias
  Activation act = Activation::kNone;
  bool nan_to_zero = false;
  bool active() const { return bias != nullptr || act != Activation::kNone; }
};

// y[p, :] = act(y[p, :] + bias) on `pixels` rows of c_out values, in place
// (serial; e.g. the output of an all-zero image).
template <typename T>
void ApplyDirectConvEpilogue(T* y, int64_t pixels, int64_t c_out,
                             const DirectConvEpilogue<T>& epilogue);

// Forward: for i in [0, n_images), y[images[i]] = conv(x[images[i]], f)
// (overwritten; other images of y untouched; images == null: all g.n).
//
// KW == 3 with stride 1 and dilation 1 in width (the usual 3x3 layer):
// the sliding-window kernel. Parallel over (64-channel output block, group
// of output rows) tasks; an output row is swept left to right with the
// three output pixels its current input column feeds in registers (3 x V
// vectors, V <= 4), so every nonzero of an interior column is one
// broadcast and 3V multiply-adds, with no tile edges. By default the
// sweep takes two input columns a step (four output pixels in registers):
// a channel nonzero in both pixels loads each of its 3V filter vectors
// once for two multiply-adds, one nonzero in one pixel only runs that
// pixel's 3V (no product with a zero). This halves the filter loads where
// both are nonzero; the single-column sweep is bound by them (one vector
// load per multiply-add). Kernel time against the single-column sweep on
// the 2-core Xeon (both cores, 9 interleaved rounds, i.i.d. and ReLU-like
// zeros): 0.91-0.92 on 32x56x56x64 -> 64 and 0.91-0.95 on 28x28x128 -> 128
// at 50% zeros, 0.94-1.01 at 70%, 0.96-1.05 at 90%; 0.86-0.89 on
// 32x7x7x512 -> 512 at 50% and 0.75-0.78 at 90%. The work runs in
// passes over (up to 3 filter rows, 16 input channels; from output width
// 14 on, 1 filter row and up to 48 channels) whose packed filter slice
// ([row][channel][kw][16V], <= 36 KB) stays in cache; the nonzeros of
// the pass's input pixels under a column are one bitmask (<= 48 bits)
// visited by one bit-scan loop; passes after the first add into y (in a
// fixed order). Single-thread kernel time at 50% zeros, measured under
// load: 0.80-0.87 of the tiled kernel's on 56x56x64, ~0.93 on 28x28x128,
// the same on 14x14x256 and 7x7x512 (these two are bound by streaming
// their 2.4 / 9.4 MB filters).
//
// Thin inputs (ScatterForward: C_in <= 2 with C_out <= 32, or filters 4 or
// more wide with C_in <= 16; stride 1 and dilation 1 in width): the row
// scatter, parallel over (channel block, group of output rows) tasks. An
// output row is summed in an L1 buffer from the nonzeros of its input rows
// (a bit-scan over one vector compare per 16 values of a W x C_in row, each
// nonzero multiplied into the KW output pixels it feeds), then copied out
// with the epilogue: no per-pixel mask or flush, so the zeros of a
// one-channel image cost one compare per 16 pixels. Kernel time 0.54-0.74
// of the sliding window's on 3x3 C_in 1 -> 16 and 0.16-0.81 of the tiled
// kernel's on 5x5 and 7x7 filters with C_in 1-16 (direct_conv2d.cc).
//
// Other geometries (and every geometry with TFSS_DIRECT_FWD_KERNEL=tiles):
// the tiled kernel, parallel over (output-channel block, image, output
// row) tasks: an output row of 16*V channels is tiled by B output columns,
// the B x V accumulator vectors stay in registers (V <= 4, B = 7 at
// V = 4). At stride 1 and dilation 1 in width with a 3-wide filter, each
// nonzero input is multiplied into all the outputs of the tile it feeds
// (up to 3 x V vectors per nonzero); otherwise output by output (V vectors
// per nonzero and tap), two output pixels at a time by default
// (FwdColumnPairsGeneric: a channel nonzero in both loads its filter
// vectors once; the others alternate between the two pixels' accumulators
// instead of waiting on one pixel's; TFSS_DIRECT_FWD_KERNEL=columns: one
// pixel at a time). Kernel time on 1x1 convolutions at 50% zeros on the
// 2-core Xeon (16x16x16x256 -> 64, 16x8x8x512 -> 128, 16x4x4x1024 -> 256,
// 32x28x28x96 -> 16, 16x2x2x2048 -> 512): 0.83-0.94 of one pixel at a
// time. The filter is repacked per call ([block][KH][C_in][KW][16V],
// zero-padded lanes, 64-byte aligned).
//
// `epilogue` (optional): act(y + bias) applied by the task that completes
// an output row, right after its last pass while the row is in L1 (no
// separate pass over y); the values are those of a separate pass.
template <typename T>
void DirectConv2DForward(const T* x, const Conv2DGeometry& g, const T* f,
                         const int64_t* images, int64_t n_images, T* y,
                         const ParallelFor& pfor,
                         const DirectConvEpilogue<T>& epilogue = {});

// Filter gradient: for every nonzero x[images[i], h, w, c] and every tap
// (kh, kw) whose output (oh, ow) exists,
//   df[kh, kw, c, :] += x[images[i], h, w, c] * dy[images[i], oh, ow, :]
// (accumulated into df: the caller zeroes it or puts the dense part there).
// Per input row, a bitmask over positions is built for every input channel
// from vector compares; for each channel the set bits of a group of up to
// three consecutive input rows are visited with the df rows of up to 9 taps
// x 2 output-channel vectors in registers (one read-modify-write of df per
// channel and group). dy rows are read in place when C_out fits one
// 32-channel block, else from a ring of per-block contiguous copies (a
// block's slice of a wide dy row would map to few L1 sets). Parallel either over fixed blocks of images, each
// summing into a private copy of df that is added in block order, or --
// when df is too large to copy or there are few images -- over (input
// channel group, output-channel block) tasks that own their slice of df
// (summed into df itself when C_out is a multiple of the vector length).
// The choice depends on the sizes only (FilterGradBlocks).
template <typename T>
void DirectConv2DBackpropFilter(const T* x, const Conv2DGeometry& g,
                                const T* dy, const int64_t* images,
                                int64_t n_images, T* df,
                                const ParallelFor& pfor);

// Seconds of one sparse convolution kernel on a call: per value scanned
// (the direct kernel's zero tests; the pixel CSR's build) and per nonzero
// (the multiply-adds). The convolution ops time both kernels once per
// problem family and take, per call, the one predicted faster.
struct SparseKernelRate {
  double per_value = 0.0;  // seconds per input value of the sparse images
  double per_nnz = 0.0;    // seconds per nonzero of the sparse images
  double Seconds(double values, double nnz) const {
    return per_value * values + per_nnz * nnz;
  }
};

// Two-point fit of t = per_value * values + per_nnz * nnz (both >= 0) from
// the timings (seconds) of one kernel on the same `values` input values
// holding nnz_full and nnz_thin nonzeros. Noise that makes a term negative
// falls back to the other term alone.
SparseKernelRate FitSparseKernel(double values, double nnz_full, double t_full,
                                 double nnz_thin, double t_thin);

// Whether the direct kernel is predicted at least as fast as the pixel CSR
// on `values` input values holding `nnz` nonzeros.
bool DirectPredictedFaster(const SparseKernelRate& direct,
                           const SparseKernelRate& csr, double values,
                           double nnz);

// Whether the kernels above use their AVX-512 code (the build's ISA).
bool DirectConv2DUsesAvx512();

// The forward kernel DirectConv2DForward runs, from the environment
// variable TFSS_DIRECT_FWD_KERNEL, read on every call (A/B benchmarks and
// tests): unset (or any other value), kAuto: the row scatter for thin
// inputs (ScatterForward), else the sliding window two input columns a
// step where the geometry allows it (KW == 3, stride 1 and dilation 1 in
// width; a filter vector loaded once serves both pixels where a channel is
// nonzero in both), else the tiled kernel; "pairs", kSlidingPairs: kAuto
// without the row scatter; "columns", the sliding window one column a step
// (and the tiled kernel one output pixel at a time); "tiles", the tiled
// kernel for every geometry; "scatter", the row scatter wherever the
// width's stride and dilation are 1.
enum class DirectForwardKernel {
  kAuto, kSlidingPairs, kSlidingColumns, kTiles, kScatter
};
DirectForwardKernel DirectForwardKernelChoice();

// Whether DirectConv2DForward runs the row scatter for this geometry under
// `kernel`: stride 1 and dilation 1 in width, and kScatter, or kAuto with
// thin inputs (filters 4 or more wide: C_in <= 16; any width: C_in <= 2
// and C_out <= 32), where its measured kernel time is below the other
// kernels' (direct_conv2d.cc).
bool ScatterForward(const Conv2DGeometry& g, DirectForwardKernel kernel);

}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_CORE_DIRECT_CONV2D_H_
