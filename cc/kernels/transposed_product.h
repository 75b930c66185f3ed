// Products whose second operand is read transposed, x [r, k] times y^T
// (y [c, k]), on the CPU: TF's MatMul kernel with transpose_b, run either
// as is or swapped, (y x^T)^T -- the same kernel on the operands in the
// other order, its [c, r] result transposed into [r, c].
//
// Why: TF's oneDNN MatMul treats its second operand as the weights, and
// with that operand read transposed (oneDNN's "ba" weights layout, known
// to be slow there) it runs far below its rate on the same operand as is.
// Where that operand is a large matrix and the product has few rows:
// dY [32, 2048] times a 2048 x 2048 kernel transposed (the input gradient
// of a Dense layer, dY W^T, which Keras' own graph runs the same way) took
// 4.0x the swapped product's time, 1.4-1.8x at 64-128 rows on 0.5-16 MB;
// swapped, the transposed operand is the small one. At thousands
// of rows or on a small matrix the swap's extra transpose of the result
// loses (0.7-0.9x). So each op instance times both ways on the first call
// of each shape (best of interleaved runs, BestSecondsInterleaved) and
// keeps the faster, the swap only where it is at least
// kSwapMinSpeedup faster (timed again on the shape's 16th and 256th calls
// after the first); products whose transposed operand has fewer
// than kSwapMinOperandElems values always run as is. The environment
// variable TFSS_TRANSPOSED_PRODUCT=as_is or =swapped, read when the op's
// kernel is created, fixes the way for every such product of the op, of
// any size (for tests and A/B timings).
#ifndef TF_SPARSE_SPLIT_CC_KERNELS_TRANSPOSED_PRODUCT_H_
#define TF_SPARSE_SPLIT_CC_KERNELS_TRANSPOSED_PRODUCT_H_

#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "cc/core/gather.h"
#include "cc/kernels/core_types.h"
#include "cc/kernels/interleaved_timing.h"
#include "cc/kernels/tf_kernel.h"
#include "cc/kernels/tf_parallel_for.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/logging.h"

namespace tf_sparse_split {

// Below this many values in the transposed operand the product runs as is
// (the transposed read costs little there, and timing both ways more than
// the swap could save).
constexpr int64_t kSwapMinOperandElems = int64_t{1} << 17;
// The swapped product must time at least this much faster.
constexpr double kSwapMinSpeedup = 1.10;

// How an op instance runs each shape of its transposed products.
class TransposedProductChoice {
 public:
  enum class Way { kUnknown, kDirect, kSwapped };

  TransposedProductChoice() {
    const char* env = std::getenv("TFSS_TRANSPOSED_PRODUCT");
    const std::string v = env == nullptr ? "" : env;
    if (v == "as_is") forced_ = Way::kDirect;
    if (v == "swapped") forced_ = Way::kSwapped;
  }

  // The way TFSS_TRANSPOSED_PRODUCT fixes, else kUnknown.
  Way forced() const { return forced_; }

  // Whether x [r, k] times y^T, y [c, k], may run swapped: not an empty
  // product nor one fixed as is; fixed swapped, or (the way unfixed) a
  // transposed operand of at least kSwapMinOperandElems values, where the
  // two ways are timed. Otherwise it runs as is.
  bool MaySwap(int64_t r, int64_t k, int64_t c) const {
    if (r == 0 || k == 0 || c == 0 || forced_ == Way::kDirect) return false;
    return forced_ == Way::kSwapped || c * k >= kSwapMinOperandElems;
  }

  // The way for the shape, counting the call; kUnknown for a shape not
  // timed yet, and again on its kRetimeCalls-th calls: a first timing
  // taken while other ops of the step loaded the cores, or before the
  // kernels' steady state, is not kept for good.
  Way Get(int64_t r, int64_t k, int64_t c) {
    std::lock_guard<std::mutex> lock(mu_);
    for (Entry& e : entries_) {
      if (e.r == r && e.k == k && e.c == c) {
        ++e.calls;
        for (int64_t at : kRetimeCalls)
          if (e.calls == at) return Way::kUnknown;
        return e.way;
      }
    }
    return Way::kUnknown;
  }

  void Set(int64_t r, int64_t k, int64_t c, Way way) {
    std::lock_guard<std::mutex> lock(mu_);
    for (Entry& e : entries_) {
      if (e.r == r && e.k == k && e.c == c) {
        e.way = way;
        return;
      }
    }
    // A layer calls with one or two shapes (its batch, the last partial
    // batch); an op fed ever new shapes forgets the oldest.
    if (entries_.size() >= kMaxShapes) entries_.erase(entries_.begin());
    entries_.push_back({r, k, c, way, 0});
  }

  // The calls of a shape (after its first) on which both ways are timed
  // again.
  static constexpr int64_t kRetimeCalls[] = {16, 256};

 private:
  static constexpr size_t kMaxShapes = 16;
  struct Entry {
    int64_t r, k, c;
    Way way;
    int64_t calls;  // calls of the shape since its first timing
  };
  Way forced_ = Way::kUnknown;
  std::mutex mu_;
  std::vector<Entry> entries_;
};

namespace transposed_product_internal {

// *out = (y x^T)^T by `gemm` (MatMul with transpose_b) on (y, x), then a
// transpose of its [c, r] result.
template <typename T>
absl::Status RunSwapped(::tensorflow::OpKernelContext* ctx,
                        const TfKernel& gemm, const ::tensorflow::Tensor& x,
                        const ::tensorflow::Tensor& y,
                        ::tensorflow::Tensor* out) {
  namespace tf = ::tensorflow;
  const int64_t r = x.dim_size(0), c = y.dim_size(0);
  tf::Tensor ct;
  TF_RETURN_IF_ERROR(gemm.Run(ctx, {&y, &x}, &ct));
  TF_RETURN_IF_ERROR(
      ctx->allocate_temp(x.dtype(), tf::TensorShape({r, c}), out));
  GatherSubmatrix<CoreType<T>>(AsCore(ct.flat<T>().data()), c, r, true,
                               nullptr, r, nullptr, c,
                               AsCore(out->flat<T>().data()),
                               TfParallelFor(ctx));
  return absl::OkStatus();
}

}  // namespace transposed_product_internal

// *out = x y^T, [r, c], for x [r, k] and y [c, k] (row-major, the dtype
// T of both): `gemm` is TF's MatMul with transpose_a false and
// transpose_b true. The way is this op's choice for the shape, timed on
// this call when it has none yet.
template <typename T>
absl::Status RunTransposedProduct(::tensorflow::OpKernelContext* ctx,
                                  const TfKernel& gemm,
                                  const ::tensorflow::Tensor& x,
                                  const ::tensorflow::Tensor& y,
                                  TransposedProductChoice* choice,
                                  ::tensorflow::Tensor* out) {
  using Way = TransposedProductChoice::Way;
  const int64_t r = x.dim_size(0), k = x.dim_size(1), c = y.dim_size(0);
  if (choice == nullptr || !choice->MaySwap(r, k, c))
    return gemm.Run(ctx, {&x, &y}, out);
  Way way = choice->forced();
  if (way == Way::kUnknown) way = choice->Get(r, k, c);
  if (way == Way::kDirect) return gemm.Run(ctx, {&x, &y}, out);
  if (way == Way::kSwapped)
    return transposed_product_internal::RunSwapped<T>(ctx, gemm, x, y, out);
  // First call of the shape: time both ways, keep the faster, and return
  // its (last) result.
  ::tensorflow::Tensor direct, swapped;
  std::vector<double> best;
  TF_RETURN_IF_ERROR(BestSecondsInterleaved(
      {[&] { return gemm.Run(ctx, {&x, &y}, &direct); },
       [&] {
         return transposed_product_internal::RunSwapped<T>(ctx, gemm, x, y,
                                                           &swapped);
       }},
      &best));
  way = best[1] * kSwapMinSpeedup <= best[0] ? Way::kSwapped : Way::kDirect;
  choice->Set(r, k, c, way);
  VLOG(1) << "tf_sparse_split transposed product " << r << "x" << k
          << " times (" << c << "x" << k << ")^T: as is " << best[0]
          << " s, swapped " << best[1] << " s -> "
          << (way == Way::kSwapped ? "swapped" : "as is");
  *out = way == Way::kSwapped ? swapped : direct;
  return absl::OkStatus();
}

}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_KERNELS_TRANSPOSED_PRODUCT_H_
