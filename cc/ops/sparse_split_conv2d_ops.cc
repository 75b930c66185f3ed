// SparseSplitConv2D and SparseSplitConv2DBackpropFilter: op registrations and
// shape functions (CPU kernels in cc/kernels/sparse_split_conv2d_kernels.cc).
#include "tensorflow/core/framework/common_shape_fns.h"
#include "cc/core/stats.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tf_sparse_split {

namespace tf = ::tensorflow;
using tf::shape_inference::InferenceContext;
using tf::shape_inference::ShapeHandle;

REGISTER_OP("TfSparseSplit>SparseSplitConv2D")
    .Input("input: T")
    .Input("filter: T")
    .Input("threshold: float")
    .Output("output: T")
    .Output("stats: float64")
    .Attr("T: {float, double}")
    .Attr("strides: list(int)")
    .Attr("padding: {'SAME', 'VALID', 'EXPLICIT'}")
    .Attr("explicit_paddings: list(int) = []")
    .Attr("dilations: list(int) = [1, 1, 1, 1]")
    .SetShapeFn([](InferenceContext* c) -> absl::Status {
      ShapeHandle thr;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 0, &thr));
      // TensorFlow's own Conv2D shape function (NHWC, HWIO when the op has
      // no data_format / filter_format attrs).
      TF_RETURN_IF_ERROR(
          tf::shape_inference::Conv2DShapeWithExplicitPadding(c));
      c->set_output(1, c->Vector(kNumStats));
      return absl::OkStatus();
    })
    .Doc(R"doc(
2-D convolution as tf.nn.conv2d (NHWC, HWIO) that exploits the input's zeros.

input: [N, H, W, C_in].
filter: [KH, KW, C_in, C_out].
threshold: scalar float32 image-density threshold in [0, 1]; images with
  density nnz / (H*W*C_in) above it go to a dense convolution, the rest to a
  sparse kernel. Negative: chosen automatically by the cost model of
  cc/core/cost_model.h (calibrated on the first such call for this layer
  geometry; the dense path unless the sparse one is predicted clearly
  faster). Never changes the answer.
output: [N, OH, OW, C_out].
stats: float64 [kNumStats] per-call statistics, laid out as in
  cc/core/stats.h (tf_sparse_split/tuning/stats.py).
)doc");

REGISTER_OP("TfSparseSplit>SparseSplitConv2DBackpropFilter")
    .Input("input: T")
    .Input("filter_sizes: int32")
    .Input("out_backprop: T")
    .Input("threshold: float")
    .Output("filter_backprop: T")
    .Output("stats: float64")
    .Attr("T: {float, double}")
    .Attr("strides: list(int)")
    .Attr("padding: {'SAME', 'VALID', 'EXPLICIT'}")
    .Attr("explicit_paddings: list(int) = []")
    .Attr("dilations: list(int) = [1, 1, 1, 1]")
    .SetShapeFn([](InferenceContext* c) -> absl::Status {
      ShapeHandle in, sizes, dy, thr, out;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 4, &in));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &sizes));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 4, &dy));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 0, &thr));
      TF_RETURN_IF_ERROR(c->MakeShapeFromShapeTensor(1, &out));
      TF_RETURN_IF_ERROR(c->WithRank(out, 4, &out));
      c->set_output(0, out);
      c->set_output(1, c->Vector(kNumStats));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Filter gradient of SparseSplitConv2D (as Conv2DBackpropFilter, NHWC/HWIO),
with cost proportional to the input's nonzeros on the sparse path.

input: [N, H, W, C_in].
filter_sizes: int32 [4] = [KH, KW, C_in, C_out].
out_backprop: [N, OH, OW, C_out].
threshold: as in SparseSplitConv2D.
filter_backprop: [KH, KW, C_in, C_out].
stats: float64 [kNumStats] per-call statistics, laid out as in
  cc/core/stats.h (tf_sparse_split/tuning/stats.py).
)doc");

}  // namespace tf_sparse_split
