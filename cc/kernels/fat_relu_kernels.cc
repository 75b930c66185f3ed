// BiasFatRelu and BiasFatReluGrad: CPU kernels (registration in
// cc/ops/fat_relu_ops.cc; loops in cc/core/fat_relu.h).
#include <cmath>

#include "cc/core/fat_relu.h"
#include "cc/kernels/core_types.h"
#include "cc/kernels/tf_parallel_for.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace tf_sparse_split {

namespace tf = ::tensorflow;

template <typename T>
class BiasFatReluOp : public tf::OpKernel {
 public:
  explicit BiasFatReluOp(tf::OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(tf::OpKernelContext* ctx) override {
    static constexpr const char* kOp = "BiasFatRelu";
    const tf::Tensor& x = ctx->input(0);
    const tf::Tensor& bias = ctx->input(1);
    const tf::Tensor& thr = ctx->input(2);
    OP_REQUIRES(ctx, x.dims() >= 1,
                tf::errors::InvalidArgument(kOp, ": x must have rank >= 1, "
                                            "got shape ", x.shape().DebugString()));
    const int64_t c = x.dim_size(x.dims() - 1);
    OP_REQUIRES(ctx,
                tf::TensorShapeUtils::IsVector(bias.shape()) &&
                    bias.dim_size(0) == c,
                tf::errors::InvalidArgument(
                    kOp, ": bias must be a vector of the last dimension of x (",
                    c, "), got shape ", bias.shape().DebugString()));
    OP_REQUIRES(ctx, tf::TensorShapeUtils::IsScalar(thr.shape()),
                tf::errors::InvalidArgument(kOp, ": threshold must be a "
                                            "scalar, got shape ",
                                            thr.shape().DebugString()));
    const T t = thr.scalar<T>()();
    OP_REQUIRES(ctx, t >= T(0),  // false for NaN too
                tf::errors::InvalidArgument(
                    kOp, ": threshold must be >= 0, got ",
                    static_cast<double>(t)));
    tf::Tensor* y = nullptr;
    tf::Tensor* sum = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &y));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, tf::TensorShape({}), &sum));
    const int64_t rows = c == 0 ? 0 : x.NumElements() / c;
    sum->scalar<T>()() = static_cast<T>(BiasFatReluForward<CoreType<T>>(
        AsCore(x.flat<T>().data()), AsCore(bias.flat<T>().data()), rows, c,
        *AsCore(&t), AsCore(y->flat<T>().data()), TfParallelFor(ctx)));
  }
};

template <typename T>
class BiasFatReluGradOp : public tf::OpKernel {
 public:
  explicit BiasFatReluGradOp(tf::OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(tf::OpKernelContext* ctx) override {
    static constexpr const char* kOp = "BiasFatReluGrad";
    const tf::Tensor& dy = ctx->input(0);
    const tf::Tensor& y = ctx->input(1);
    const tf::Tensor& off = ctx->input(2);
    OP_REQUIRES(ctx, dy.dims() >= 1 && dy.shape() == y.shape(),
                tf::errors::InvalidArgument(
                    kOp, ": dy and y must have the same shape of rank >= 1, "
                    "got ", dy.shape().DebugString(), " and ",
                    y.shape().DebugString()));
    OP_REQUIRES(ctx, tf::TensorShapeUtils::IsScalar(off.shape()),
                tf::errors::InvalidArgument(kOp, ": offset must be a scalar, "
                                            "got shape ",
                                            off.shape().DebugString()));
    const int64_t c = y.dim_size(y.dims() - 1);
    tf::Tensor* dx = nullptr;
    tf::Tensor* dbias = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, y.shape(), &dx));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, tf::TensorShape({c}), &dbias));
    const int64_t rows = c == 0 ? 0 : y.NumElements() / c;
    const T offset = off.scalar<T>()();
    BiasFatReluBackward<CoreType<T>>(
        AsCore(dy.flat<T>().data()), AsCore(y.flat<T>().data()), rows, c,
        *AsCore(&offset), AsCore(dx->flat<T>().data()),
        AsCore(dbias->flat<T>().data()), TfParallelFor(ctx));
  }
};

#define TFSS_REGISTER_CPU(T)                                         \
  REGISTER_KERNEL_BUILDER(Name("TfSparseSplit>BiasFatRelu")          \
                              .Device(tf::DEVICE_CPU)                \
                              .TypeConstraint<T>("T"),               \
                          BiasFatReluOp<T>);                         \
  REGISTER_KERNEL_BUILDER(Name("TfSparseSplit>BiasFatReluGrad")      \
                              .Device(tf::DEVICE_CPU)                \
                              .TypeConstraint<T>("T"),               \
                          BiasFatReluGradOp<T>);
TFSS_REGISTER_CPU(float)
TFSS_REGISTER_CPU(double)
TFSS_REGISTER_CPU(Eigen::bfloat16)
TFSS_REGISTER_CPU(Eigen::half)
#undef TFSS_REGISTER_CPU

}  // namespace tf_sparse_split
