// SparseSplitSddmm: op registration and shape function (the CPU kernel is
// cc/kernels/sparse_split_sddmm_kernels.cc).
#include "cc/core/stats.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tf_sparse_split {

namespace tf = ::tensorflow;
using tf::shape_inference::DimensionHandle;
using tf::shape_inference::InferenceContext;
using tf::shape_inference::ShapeHandle;

REGISTER_OP("TfSparseSplit>SparseSplitSddmm")
    .Input("mask: T")
    .Input("x: T")
    .Input("b: T")
    .Input("threshold: float")
    .Output("product: T")
    .Output("stats: float64")
    .Attr("transpose_b: bool = false")
    .Attr("T: {float, double, bfloat16, half}")
    .Attr("full_stats: bool = true")
    .SetShapeFn([](InferenceContext* c) -> absl::Status {
      ShapeHandle mask, x, b, thr;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &mask));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &x));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 2, &b));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 0, &thr));
      bool tb;
      TF_RETURN_IF_ERROR(c->GetAttr("transpose_b", &tb));
      DimensionHandle m, k, n;
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(mask, 0), c->Dim(x, 0), &m));
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(mask, 1), c->Dim(b, tb ? 1 : 0), &k));
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(x, 1), c->Dim(b, tb ? 0 : 1), &n));
      c->set_output(0, c->Matrix(m, k));
      c->set_output(1, c->Vector(kNumStats));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Sampled product (x * op(b)^T) restricted to the nonzeros of mask (SDDMM).

product[i, j] = mask[i, j] != 0 ? sum_t x[i, t] * op(b)[j, t] : 0. With
mask = a, x = dY and b the weights of a product a * op(b), this is the
gradient of a where a is nonzero: the whole gradient when whatever produced
a has zero gradient wherever a is zero (ReLU, FATReLU, dropout of them).
Rows of mask with density above threshold go to TF's GEMM (then masked), the
others to the CSR SDDMM of cc/core (cost proportional to nnz(mask) * n).

mask: [m, k]; only its zero pattern is used.
x: [m, n].
b: [k, n] (or [n, k] with transpose_b): op(b) is [k, n].
threshold: scalar float32 row-density threshold in [0, 1] on the rows of
  mask, or negative: chosen by the cost model of cc/core/cost_model.h. The
  answer does not depend on it (to float rounding).
full_stats: with an automatic threshold, false lets a call that the cost
  model keeps all-dense count only a strided sample of the mask's rows, or
  nothing; its statistics then hold estimates (kStatAnalysis). True (the
  default): every value counted, exact statistics.
product: [m, k].
stats: float64 [kNumStats] per-call statistics (cc/core/stats.h) describing
  the split of the mask's rows.
T: float32, float64, bfloat16 or float16. In bfloat16 and float16 the
  values are stored in T and every dot is accumulated in float32 and rounded
  once to T (round-to-nearest-even), on both paths (TF's CPU MatMul for the
  dense rows does the same).
)doc");

}  // namespace tf_sparse_split
