// BiasFatRelu and BiasFatReluGrad: op registrations and shape functions
// (CPU kernels in cc/kernels/fat_relu_kernels.cc, loops in
// cc/core/fat_relu.h).
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tf_sparse_split {

namespace tf = ::tensorflow;
using tf::shape_inference::DimensionHandle;
using tf::shape_inference::InferenceContext;
using tf::shape_inference::ShapeHandle;

REGISTER_OP("TfSparseSplit>BiasFatRelu")
    .Input("x: T")
    .Input("bias: T")
    .Input("threshold: T")
    .Output("y: T")
    .Output("sum: T")
    .Attr("T: {float, double, bfloat16, half}")
    .SetShapeFn([](InferenceContext* c) -> absl::Status {
      ShapeHandle x, bias, thr;
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 1, &x));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &bias));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 0, &thr));
      DimensionHandle unused;
      TF_RETURN_IF_ERROR(
          c->Merge(c->Dim(x, -1), c->Dim(bias, 0), &unused));
      c->set_output(0, x);
      c->set_output(1, c->Scalar());
      return absl::OkStatus();
    })
    .Doc(R"doc(
Bias + forced-activation-threshold ReLU in one pass, and the sum of its
output. With v = x + bias (bias broadcast over the last dimension),
y = v > threshold ? v : 0 and sum = sum(y).

x: [..., C].
bias: [C].
threshold: scalar >= 0 (not NaN).
y: the shape of x.
sum: scalar, the sum of y (for an L1 penalty).
T: float32, float64, bfloat16 or float16. In bfloat16 and float16, v is
  rounded once to T (as BiasAdd in T) before the comparison, and the sum is
  accumulated in float32 (blocks in float64) and rounded once to T.
)doc");

REGISTER_OP("TfSparseSplit>BiasFatReluGrad")
    .Input("dy: T")
    .Input("y: T")
    .Input("offset: T")
    .Output("dx: T")
    .Output("dbias: T")
    .Attr("T: {float, double, bfloat16, half}")
    .SetShapeFn([](InferenceContext* c) -> absl::Status {
      ShapeHandle dy, y, off;
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 1, &dy));
      TF_RETURN_IF_ERROR(c->Merge(dy, c->input(1), &y));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 0, &off));
      c->set_output(0, y);
      c->set_output(1, c->Vector(c->Dim(y, -1)));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Gradient of BiasFatRelu: dx = y > 0 ? dy + offset : 0 (the kept elements are
those with y > 0, as threshold >= 0), dbias = dx summed over all dimensions
but the last.

dy: gradient of y, [..., C].
y: the forward output, same shape.
offset: scalar added to the gradient of every kept element (the gradient
  of the sum output).
dx: gradient of x, same shape.
dbias: [C].
T: float32, float64, bfloat16 or float16. In bfloat16 and float16, dx is
  T(dy + offset), rounded once; dbias is accumulated in float32 and rounded
  once to T.
)doc");

}  // namespace tf_sparse_split
