// The fused bias + activation epilogue of SparseSplitMatMul, TensorFlow
// side: reads the op's `num_bias` / `activation` attrs and its optional
// `bias` input, validates them, and applies product = act(product + bias)
// in place to output 0 once the kernel has written every row of it (the
// dense rows from TF's GEMM, the sparse rows from the CSR SpMM). The loops
// are cc/core/epilogue.h (CPU) and cc/core/cuda/epilogue_cuda.h (GPU).
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
#endif

namespace tf_sparse_split {

class MatMulEpilogue {
 public:
  // Input index of `bias` (after a, b, threshold).
  static constexpr int kBiasInput = 3;

  // Reads the attrs: num_bias must be 0 or 1, activation one of
  // 'none'/'relu'/'relu6' (the op registration restricts it too).
  absl::Status Init(::tensorflow::OpKernelConstruction* ctx) {
    namespace tf = ::tensorflow;
    int num_bias = 0;
    TF_RETURN_IF_ERROR(ctx->GetAttr("num_bias", &num_bias));
    if (num_bias < 0 || num_bias > 1)
      return tf::errors::InvalidArgument(
          "SparseSplitMatMul: num_bias must be 0 or 1, got ", num_bias);
    has_bias_ = num_bias == 1;
    std::string act;
    TF_RETURN_IF_ERROR(ctx->GetAttr("activation", &act));
    if (!ParseActivation(act, &act_))
      return tf::errors::InvalidArgument(
          "SparseSplitMatMul: activation must be 'none', 'relu' or 'relu6', "
          "got '", act, "'");
    return absl::OkStatus();
  }

  bool active() const { return has_bias_ || act_ != Activation::kNone; }

  // Checks the bias input (when present) against the product's n columns:
  // a vector [n] of the product's dtype.
  absl::Status Validate(::tensorflow::OpKernelContext* ctx, int64_t n) const {
    namespace tf = ::tensorflow;
    if (!has_bias_) return absl::OkStatus();
    const tf::Tensor& bias = ctx->input(kBiasInput);
    if (!tf::TensorShapeUtils::IsVector(bias.shape()) || bias.dim_size(0) != n)
      return tf::errors::InvalidArgument(
          "SparseSplitMatMul: bias must be a vector [n] = [", n,
          "] (n = columns of the product), got shape ",
          bias.shape().DebugString());
    return absl::OkStatus();
  }

  // product = act(product + bias), in place on output 0 (already set).
  template <typename T>
  absl::Status ApplyCpu(::tensorflow::OpKernelContext* ctx) const {
    if (!active()) return absl::OkStatus();
    ::tensorflow::Tensor* out = ctx->mutable_output(0);
    if (out == nullptr || out->NumElements() == 0) return absl::OkStatus();
    const int64_t m = out->dim_size(0), n = out->dim_size(1);
    BiasActivationRows<T>(out->flat<T>().data(), n, nullptr, m, n, BiasPtr<T>(ctx),
                          act_, TfParallelFor(ctx));
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
    const cudaError_t err =
        BiasActivationGpu<T>(out->flat<T>().data(), m, n, n, BiasPtr<T>(ctx),
                             static_cast<int>(act_), stream);
    if (err != cudaSuccess)
      return tf::errors::Internal("SparseSplitMatMul (GPU): epilogue failed: ",
                                  cudaGetErrorName(err), ": ",
                                  cudaGetErrorString(err));
    return absl::OkStatus();
  }
#endif  // GOOGLE_CUDA

 private:
  template <typename T>
  const T* BiasPtr(::tensorflow::OpKernelContext* ctx) const {
    return has_bias_ ? ctx->input(kBiasInput).flat<T>().data() : nullptr;
  }

  bool has_bias_ = false;
  Activation act_ = Activation::kNone;
};

}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_KERNELS_EPILOGUE_H_
