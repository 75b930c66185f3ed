// The fused bias + activation epilogue of SparseSplitMatMul and
// SparseSplitConv2D, TensorFlow side: reads the op's `num_bias` /
// `activation` attrs and its optional `bias` input, validates them, and
// applies out = act(out + bias) in place once the kernel has written the
// rows (matmul: every row of the product, the dense rows from TF's GEMM,
// the sparse rows from the CSR SpMM; convolution: the images the sparse
// kernel wrote, the dense images coming finished from TF's fused
// convolution). The loops are cc/core/epilogue.h (CPU) and
// cc/core/cuda/epilogue_cuda.h (GPU).
//
// SparseSplitConv2D (cc/kernels/sparse_split_conv2d_kernels.cc) does run
// TF's fused kernel for its dense images (_MklNativeFusedConv2D in float32
// with oneDNN): oneDNN applies bias and ReLU as post-ops while the output
// block is still in registers, and an all-dense call must be exactly what
// TF's graph runs for Conv2D + BiasAdd + Relu (Grappler's remapper fuses
// them in inference graphs). For the matmul the reasoning below holds.
//
// Why one pass after the product rather than running TF's "_FusedMatMul"
// for the dense rows (on the CPU, TF's graph for tf.nn.relu(tf.matmul(a, b)
// + bias) runs oneDNN's "_MklNativeFusedMatMul", float32/bf16/half only;
// float64 runs MatMul, BiasAdd and Relu): the pass costs ~19 us for a
// 128 x 2048 float32 output (bias + relu, one thread, ~107 GB/s, L2-resident;
// benchmarks/bench_epilogue_pass.cc), under 1% of that layer's GEMM (128 x
// 784 x 2048: ~2 ms), which is all a fused post-op could save, and in
// benchmarks/bench_epilogue.py the op with and without the epilogue and TF's
// fused and plain MatMul differ by less than the run-to-run noise. The fused
// kernel would only apply when every row is dense, nothing is compacted, a
// bias is present and the dtype is float32; the pass covers every case
// (float64, gathered/compacted dense parts, sparse rows) with one code path
// and keeps the kernels' Compute() unchanged apart from one call.
#ifndef TF_SPARSE_SPLIT_CC_KERNELS_EPILOGUE_H_
#define TF_SPARSE_SPLIT_CC_KERNELS_EPILOGUE_H_

#include <cstdint>
#include <string>

#include "cc/core/epilogue.h"
#include "cc/kernels/tf_parallel_for.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"

#if GOOGLE_CUDA
#include "cc/core/cuda/epilogue_cuda.h"
#include "cc/kernels/cuda_types.h"
#endif

namespace tf_sparse_split {

// The attrs, the bias input and the CPU/GPU passes shared by the fused
// epilogues of SparseSplitMatMul and SparseSplitConv2D (both ops declare
// `bias: num_bias * T` after their threshold input, and the attrs
// `num_bias: int >= 0 = 0`, `activation: {'none', 'relu', 'relu6'} = 'none'`).
class BiasActivationEpilogue {
 public:
  // Input index of `bias` (after the two operands and the threshold).
  static constexpr int kBiasInput = 3;

  // `op` names the op in error messages.
  explicit BiasActivationEpilogue(const char* op) : op_(op) {}

  // Reads the attrs: num_bias must be 0 or 1, activation one of
  // 'none'/'relu'/'relu6' (the op registration restricts it too).
  absl::Status Init(::tensorflow::OpKernelConstruction* ctx) {
    namespace tf = ::tensorflow;
    int num_bias = 0;
    TF_RETURN_IF_ERROR(ctx->GetAttr("num_bias", &num_bias));
    if (num_bias < 0 || num_bias > 1)
      return tf::errors::InvalidArgument(op_, ": num_bias must be 0 or 1, got ",
                                         num_bias);
    has_bias_ = num_bias == 1;
    std::string act;
    TF_RETURN_IF_ERROR(ctx->GetAttr("activation", &act));
    if (!ParseActivation(act, &act_))
      return tf::errors::InvalidArgument(
          op_, ": activation must be 'none', 'relu' or 'relu6', got '", act,
          "'");
    return absl::OkStatus();
  }

  bool active() const { return has_bias_ || act_ != Activation::kNone; }
  bool has_bias() const { return has_bias_; }
  Activation activation() const { return act_; }

  // Checks the bias input (when present) against the output's n channels
  // (columns): a vector [n] of the output's dtype. `symbol` names n in the
  // message and `what` describes it.
  absl::Status Validate(::tensorflow::OpKernelContext* ctx, int64_t n,
                        const char* symbol = "n",
                        const char* what = "columns of the product") const {
    namespace tf = ::tensorflow;
    if (!has_bias_) return absl::OkStatus();
    const tf::Tensor& bias = ctx->input(kBiasInput);
    if (!tf::TensorShapeUtils::IsVector(bias.shape()) || bias.dim_size(0) != n)
      return tf::errors::InvalidArgument(
          op_, ": bias must be a vector [", symbol, "] = [", n, "] (", symbol,
          " = ", what, "), got shape ", bias.shape().DebugString());
    return absl::OkStatus();
  }

  // The bias input (null without one).
  template <typename T>
  const T* BiasPtr(::tensorflow::OpKernelContext* ctx) const {
    return has_bias_ ? ctx->input(kBiasInput).flat<T>().data() : nullptr;
  }

  // relu / relu6 as oneDNN's eltwise post-ops compute them (max(x, 0):
  // NaN -> 0, -0 -> +0) instead of tf.nn.relu's NaN-propagating form. Set
  // where the op's dense part is oneDNN's fused kernel, so that the other
  // part of a split gives the same values and the threshold never changes
  // the answer.
  void set_nan_to_zero(bool v) { nan_to_zero_ = v; }
  bool nan_to_zero() const { return nan_to_zero_; }

  // c[r, :] = act(c[r, :] + bias) on the rows 0 .. rows-1 of the row-major
  // matrix c [rows, n] (the whole output of a matmul; the N*OH*OW pixels of
  // a convolution's NHWC output, n = C_out).
  template <typename T>
  void ApplyRows(::tensorflow::OpKernelContext* ctx, T* c, int64_t rows,
                 int64_t n, const ParallelFor& pfor) const {
    if (!active() || rows <= 0 || n <= 0) return;
    if (nan_to_zero_ && act_ != Activation::kNone) {
      const T* bias = BiasPtr<T>(ctx);
      const Activation act = act_;
      pfor(rows, 2 * n + 8, [&](int64_t b, int64_t e) {
        BiasClampRows<T>(c + b * n, n, e - b, n, bias, act);
      });
      return;
    }
    BiasActivationRows<T>(c, n, nullptr, rows, n, BiasPtr<T>(ctx), act_, pfor);
  }

  // The same on the listed images only: image images[i] is the
  // rows_per_image rows starting at row images[i] * rows_per_image of c
  // [*, n]. Parallel over images, each image's rows in one pass.
  template <typename T>
  void ApplyImages(::tensorflow::OpKernelContext* ctx, T* c,
                   const int64_t* images, int64_t n_images,
                   int64_t rows_per_image, int64_t n,
                   const ParallelFor& pfor) const {
    if (!active() || n_images <= 0 || rows_per_image <= 0 || n <= 0) return;
    const T* bias = BiasPtr<T>(ctx);
    const Activation act = act_;
    const ParallelFor serial = SerialFor;
    const bool clamp = nan_to_zero_ && act != Activation::kNone;
    pfor(n_images, 2 * rows_per_image * n + 8, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        T* img = c + images[i] * rows_per_image * n;
        if (clamp) {
          BiasClampRows<T>(img, n, rows_per_image, n, bias, act);
        } else {
          BiasActivationRows<T>(img, n, nullptr, rows_per_image, n, bias, act,
                                serial);
        }
      }
    });
  }

 protected:
  const char* op_;
  bool has_bias_ = false;
  bool nan_to_zero_ = false;
  Activation act_ = Activation::kNone;
};

// The epilogue of SparseSplitMatMul: output 0 is the product [m, n].
class MatMulEpilogue : public BiasActivationEpilogue {
 public:
  MatMulEpilogue() : BiasActivationEpilogue("SparseSplitMatMul") {}

  // product = act(product + bias), in place on output 0 (already set).
  template <typename T>
  absl::Status ApplyCpu(::tensorflow::OpKernelContext* ctx) const {
    if (!active()) return absl::OkStatus();
    ::tensorflow::Tensor* out = ctx->mutable_output(0);
    if (out == nullptr || out->NumElements() == 0) return absl::OkStatus();
    const int64_t m = out->dim_size(0), n = out->dim_size(1);
    ApplyRows<T>(ctx, out->flat<T>().data(), m, n, TfParallelFor(ctx));
    return absl::OkStatus();
  }

#if GOOGLE_CUDA
  // The same on the GPU, enqueued on `stream` (the op's stream).
  template <typename T>
  absl::Status ApplyGpu(::tensorflow::OpKernelContext* ctx,
                        cudaStream_t stream) const {
    namespace tf = ::tensorflow;
    if (!active()) return absl::OkStatus();
    tf::Tensor* out = ctx->mutable_output(0);
    if (out == nullptr || out->NumElements() == 0) return absl::OkStatus();
    const int64_t m = out->dim_size(0), n = out->dim_size(1);
    const cudaError_t err = BiasActivationGpu<CudaType<T>>(
        AsCuda(out->flat<T>().data()), m, n, n, AsCuda(BiasPtr<T>(ctx)),
        static_cast<int>(act_), stream);
    if (err != cudaSuccess)
      return tf::errors::Internal("SparseSplitMatMul (GPU): epilogue failed: ",
                                  cudaGetErrorName(err), ": ",
                                  cudaGetErrorString(err));
    return absl::OkStatus();
  }
#endif  // GOOGLE_CUDA
};

}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_KERNELS_EPILOGUE_H_
