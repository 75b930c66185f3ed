// SparseSplitConv2D, SparseSplitConv2DBackpropFilter[WithBias] and
// SparseSplitConv2DBackpropInput: op registrations and shape functions (CPU kernels in cc/kernels/sparse_split_conv2d_kernels.cc).
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
    .Input("bias: num_bias * T")
    .Output("output: T")
    .Output("stats: float64")
    .Attr("T: {float, double, bfloat16, half}")
    .Attr("strides: list(int)")
    .Attr("padding: {'SAME', 'VALID', 'EXPLICIT'}")
    .Attr("explicit_paddings: list(int) = []")
    .Attr("dilations: list(int) = [1, 1, 1, 1]")
    .Attr("num_bias: int >= 0 = 0")
    .Attr("activation: {'none', 'relu', 'relu6'} = 'none'")
    .Attr("full_stats: bool = true")
    .SetShapeFn([](InferenceContext* c) -> absl::Status {
      ShapeHandle thr;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 0, &thr));
      // TensorFlow's own Conv2D shape function (NHWC, HWIO when the op has
      // no data_format / filter_format attrs).
      TF_RETURN_IF_ERROR(
          tf::shape_inference::Conv2DShapeWithExplicitPadding(c));
      int num_bias;
      TF_RETURN_IF_ERROR(c->GetAttr("num_bias", &num_bias));
      if (num_bias > 1)
        return tf::errors::InvalidArgument(
            "SparseSplitConv2D: num_bias must be 0 or 1, got ", num_bias);
      if (num_bias == 1) {
        // bias [C_out]: merged with the output's channel dimension.
        ShapeHandle bias, out = c->output(0);
        TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 1, &bias));
        if (c->RankKnown(out)) {
          tf::shape_inference::DimensionHandle ch;
          TF_RETURN_IF_ERROR(c->Merge(c->Dim(bias, 0), c->Dim(out, 3), &ch));
          TF_RETURN_IF_ERROR(c->ReplaceDim(out, 3, ch, &out));
          c->set_output(0, out);
        }
      }
      c->set_output(1, c->Vector(kNumStats));
      return absl::OkStatus();
    })
    .Doc(R"doc(
2-D convolution as tf.nn.conv2d (NHWC, HWIO) that exploits the input's zeros,
with an optional fused bias + activation: output = act(conv2d(input, filter)
+ bias), as TensorFlow's _FusedConv2D (fused_ops BiasAdd[, Relu | Relu6]).

T: float32, float64, bfloat16 or half (input, filter, bias and output share
  it). In bfloat16 and half, as TensorFlow's CPU kernels for those dtypes:
  values are stored in T, products are accumulated in float32 and each
  output value is rounded once to T (round-to-nearest-even) -- the dense
  part is TensorFlow's own kernel in T (oneDNN's where TensorFlow runs it
  for the dtype on this CPU), the sparse part widens the sparse images and
  the filter to float32 once, runs the float32 sparse kernels and rounds
  the result once (after the bias and activation where the dense part is
  the fused kernel; before them, then the epilogue in T, where it is
  Conv2D + epilogue).
input: [N, H, W, C_in].
filter: [KH, KW, C_in, C_out].
threshold: scalar float32 image-density threshold in [0, 1]; images with
  density nnz / (H*W*C_in) above it go to a dense convolution, the rest to a
  sparse kernel. Negative: chosen automatically by the cost model of
  cc/core/cost_model.h (calibrated on the first such call for this layer
  geometry; the dense path unless the sparse one is predicted clearly
  faster). Never changes the answer.
bias: optional (num_bias = 1) vector [C_out] added to every output pixel.
output: [N, OH, OW, C_out], act(conv2d(input, filter) + bias). A call whose
  plan is all-dense runs TensorFlow's fused kernel (_MklNativeFusedConv2D with
  oneDNN in float32, and in bfloat16 / half where oneDNN runs the dtype on
  this CPU, else _FusedConv2D; float64: Conv2D, then the epilogue of
  cc/kernels/epilogue.h, as TF's graph runs Conv2D, BiasAdd and Relu there);
  otherwise the dense images come from that kernel and the sparse images get
  the epilogue after the sparse kernel.
num_bias: 0 (no bias) or 1.
activation: 'none', 'relu' (max(x, 0)) or 'relu6' (min(max(x, 0), 6)),
  applied after the bias; NaN propagates.
full_stats: with an automatic threshold, false lets a call that the cost
  model keeps all-dense count only a strided sample of every image's
  pixels, or nothing (cc/core/cost_model.h, ChooseAnalysis), and run
  TensorFlow's (fused) kernel on the inputs at once; its statistics then
  hold estimates (kStatAnalysis says which; kStatNnz NaN when nothing was
  counted). An all-sparse plan whose sparse kernel is the direct one, or
  a given threshold of 1, counts a sample of every image's pixels. True
  (the default) counts every value on every call.
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
    .Attr("T: {float, double, bfloat16, half}")
    .Attr("strides: list(int)")
    .Attr("padding: {'SAME', 'VALID', 'EXPLICIT'}")
    .Attr("explicit_paddings: list(int) = []")
    .Attr("dilations: list(int) = [1, 1, 1, 1]")
    .Attr("full_stats: bool = true")
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
filter_backprop: [KH, KW, C_in, C_out]. In bfloat16 and half the sum runs
  in float32 and is rounded once to T, except that a split call adds the
  dense images' part as TensorFlow's kernel rounded it (two roundings).
full_stats: as in SparseSplitConv2D (the gradients pass false).
stats: float64 [kNumStats] per-call statistics, laid out as in
  cc/core/stats.h (tf_sparse_split/tuning/stats.py).
)doc");

REGISTER_OP("TfSparseSplit>SparseSplitConv2DBackpropFilterWithBias")
    .Input("input: T")
    .Input("filter_sizes: int32")
    .Input("out_backprop: T")
    .Input("threshold: float")
    .Output("filter_backprop: T")
    .Output("bias_backprop: T")
    .Output("stats: float64")
    .Attr("T: {float, double, bfloat16, half}")
    .Attr("strides: list(int)")
    .Attr("padding: {'SAME', 'VALID', 'EXPLICIT'}")
    .Attr("explicit_paddings: list(int) = []")
    .Attr("dilations: list(int) = [1, 1, 1, 1]")
    .Attr("full_stats: bool = true")
    .SetShapeFn([](InferenceContext* c) -> absl::Status {
      ShapeHandle in, sizes, dy, thr, out;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 4, &in));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &sizes));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 4, &dy));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 0, &thr));
      TF_RETURN_IF_ERROR(c->MakeShapeFromShapeTensor(1, &out));
      TF_RETURN_IF_ERROR(c->WithRank(out, 4, &out));
      // bias_backprop [C_out]: the filter's and out_backprop's last
      // dimension, where known.
      tf::shape_inference::DimensionHandle co;
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(out, 3), c->Dim(dy, 3), &co));
      c->set_output(0, out);
      c->set_output(1, c->Vector(co));
      c->set_output(2, c->Vector(kNumStats));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Filter and bias gradients of SparseSplitConv2D with a bias, in one op (as
TensorFlow's fused Conv2DBackpropFilterWithBias, NHWC/HWIO):
filter_backprop as SparseSplitConv2DBackpropFilter, bias_backprop[c] = the
sum of out_backprop[:, :, :, c] over N, OH, OW.

The filter gradient splits the images of input as
SparseSplitConv2DBackpropFilter does. The bias gradient is one vectorised
pass over out_backprop (float64 for float64, float32 otherwise,
deterministic block order). With TFSS_CONV_BIAS_GRAD=fused in the
environment when the op is created, the dense images' part comes from
oneDNN's fused kernel (_MklNativeConv2DBackpropFilterWithBias: float32
with oneDNN on, SAME/VALID padding) instead, and the pass sums only the
other images; not the default, as TensorFlow's plain filter gradient plus
the pass was faster on every ResNet50 shape measured.

T: float32, float64, bfloat16 or half. In bfloat16 and half the bias sum
  runs in float32 over all of out_backprop and is rounded once to T; the
  filter gradient as in SparseSplitConv2DBackpropFilter.
input: [N, H, W, C_in].
filter_sizes: int32 [4] = [KH, KW, C_in, C_out].
out_backprop: [N, OH, OW, C_out].
threshold: as in SparseSplitConv2D.
filter_backprop: [KH, KW, C_in, C_out].
bias_backprop: [C_out].
full_stats: as in SparseSplitConv2D (the gradients pass false).
stats: float64 [kNumStats] per-call statistics of input, as those of
  SparseSplitConv2DBackpropFilter (cc/core/stats.h).
)doc");

REGISTER_OP("TfSparseSplit>SparseSplitConv2DBackpropInput")
    .Input("input_sizes: int32")
    .Input("filter: T")
    .Input("out_backprop: T")
    .Input("threshold: float")
    .Output("input_backprop: T")
    .Output("stats: float64")
    .Attr("T: {float, double, bfloat16, half}")
    .Attr("strides: list(int)")
    .Attr("padding: {'SAME', 'VALID', 'EXPLICIT'}")
    .Attr("explicit_paddings: list(int) = []")
    .Attr("dilations: list(int) = [1, 1, 1, 1]")
    .Attr("full_stats: bool = true")
    .SetShapeFn([](InferenceContext* c) -> absl::Status {
      ShapeHandle sizes, f, dy, thr, out;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &sizes));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 4, &f));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 4, &dy));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 0, &thr));
      TF_RETURN_IF_ERROR(c->MakeShapeFromShapeTensor(0, &out));
      TF_RETURN_IF_ERROR(c->WithRank(out, 4, &out));
      // dX [N, H, W, C_in]: N from dy, C_in from the filter, where known.
      tf::shape_inference::DimensionHandle d;
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(out, 0), c->Dim(dy, 0), &d));
      TF_RETURN_IF_ERROR(c->ReplaceDim(out, 0, d, &out));
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(out, 3), c->Dim(f, 2), &d));
      TF_RETURN_IF_ERROR(c->ReplaceDim(out, 3, d, &out));
      tf::shape_inference::DimensionHandle co;
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(dy, 3), c->Dim(f, 3), &co));
      c->set_output(0, out);
      c->set_output(1, c->Vector(kNumStats));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Input gradient of SparseSplitConv2D at stride 1 (as Conv2DBackpropInput,
NHWC/HWIO, on the original filter), exploiting the zeros of out_backprop.

At stride 1, dX is the forward convolution of dY with the filter rotated 180
degrees and its channels swapped ([KH, KW, C_out, C_in]), padded by
(KH-1)*d - pad_top before and (KH-1)*d - pad_bottom after (likewise in
width). Images of dY whose density nnz / (OH*OW*C_out) is above the
threshold go to TensorFlow's own Conv2DBackpropInput kernel on the original
filter (oneDNN's where TensorFlow runs it for the dtype on this CPU); the
others go to the sparse forward kernels of SparseSplitConv2D (direct
zero-skipping or pixel CSR, chosen as there), on a rotated copy of the
filter that the kernel builds only when a sparse part runs. An all-dense
call is exactly TensorFlow's kernel on the op's inputs.

T: float32, float64, bfloat16 or half, with SparseSplitConv2D's contract.
input_sizes: int32 [4] = [N, H, W, C_in], the shape of the convolution's
  input (and of input_backprop).
filter: [KH, KW, C_in, C_out], the convolution's filter (not rotated).
out_backprop: dY [N, OH, OW, C_out], the gradient of the convolution's
  output.
threshold: scalar float32 image-density threshold of dY in [0, 1], or
  negative: automatic (as in SparseSplitConv2D; its own cost-model family).
input_backprop: dX [N, H, W, C_in]. NaN/Inf in dY propagate as in
  Conv2DBackpropInput; where dY is exactly zero the product is skipped on
  the sparse path, so a NaN/Inf filter value facing only zeros gives 0.
strides: must be 1 in every dimension (other strides: TensorFlow's
  Conv2DBackpropInput).
padding, explicit_paddings, dilations: the convolution's. Explicit paddings
  may not exceed the dilated filter's extent (KH-1)*d (KW-1)*d.
full_stats: as in SparseSplitConv2D (the gradients pass false).
stats: float64 [kNumStats] per-call statistics of dY, laid out as those of
  SparseSplitConv2D(dY, rotated filter): rows = images, columns = the
  OH*OW*C_out values of an image of dY, NNZ = dY's nonzeros.
)doc");

}  // namespace tf_sparse_split
