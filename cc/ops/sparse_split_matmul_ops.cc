// SparseSplitMatMul: op registration and shape function (the CPU kernel is
// cc/kernels/sparse_split_matmul_kernels.cc, the GPU kernel
// cc/kernels/sparse_split_matmul_kernels_gpu.cc).
#include "cc/core/stats.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tf_sparse_split {

namespace tf = ::tensorflow;
using tf::shape_inference::DimensionHandle;
using tf::shape_inference::InferenceContext;
using tf::shape_inference::ShapeHandle;

REGISTER_OP("TfSparseSplit>SparseSplitMatMul")
    .Input("a: T")
    .Input("b: T")
    .Input("threshold: float")
    .Input("bias: num_bias * T")
    .Output("product: T")
    .Output("stats: float64")
    .Attr("transpose_a: bool = false")
    .Attr("transpose_b: bool = false")
    .Attr("T: {float, double, bfloat16, half}")
    .Attr("heterogeneous: bool = false")
    .Attr("grad_a_live_only: bool = false")
    .Attr("num_bias: int >= 0 = 0")
    .Attr("activation: {'none', 'relu', 'relu6'} = 'none'")
    .Attr("full_stats: bool = true")
    .SetShapeFn([](InferenceContext* c) -> absl::Status {
      ShapeHandle a, b, thr;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &a));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &b));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 0, &thr));
      bool ta, tb;
      TF_RETURN_IF_ERROR(c->GetAttr("transpose_a", &ta));
      TF_RETURN_IF_ERROR(c->GetAttr("transpose_b", &tb));
      DimensionHandle m = c->Dim(a, ta ? 1 : 0);
      DimensionHandle ka = c->Dim(a, ta ? 0 : 1);
      DimensionHandle kb = c->Dim(b, tb ? 1 : 0);
      DimensionHandle n = c->Dim(b, tb ? 0 : 1);
      DimensionHandle merged;
      TF_RETURN_IF_ERROR(c->Merge(ka, kb, &merged));
      int num_bias;
      TF_RETURN_IF_ERROR(c->GetAttr("num_bias", &num_bias));
      if (num_bias > 1)
        return tf::errors::InvalidArgument(
            "SparseSplitMatMul: num_bias must be 0 or 1, got ", num_bias);
      if (num_bias == 1) {
        ShapeHandle bias;
        TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 1, &bias));
        TF_RETURN_IF_ERROR(c->Merge(c->Dim(bias, 0), n, &n));
      }
      c->set_output(0, c->Matrix(m, n));
      c->set_output(1, c->Vector(kNumStats));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Matrix product op(a) * op(b) that exploits the zeros of the activation a.

a: [m, k] (or [k, m] with transpose_a), the activation operand.
b: [k, n] (or [n, k] with transpose_b).
threshold: scalar float32 row-density threshold in [0, 1]; rows of op(a)
  with density above it go to a dense GEMM, the rest to a CSR SpMM. A
  negative value chooses it automatically with the cost model of
  cc/core/cost_model.h (calibrated on the first such call per dtype, k,
  n bucket and m bucket: fixed, conversion, flop-rate and copy terms; the
  dense GEMM unless a split is predicted at least 10% faster). The answer
  does not depend on it.
bias: optional (num_bias = 1) vector [n] added to every row of the product.
product: [m, n], act(op(a) * op(b) + bias): by TF's fused MatMul + BiasAdd
  (+ Relu/Relu6) kernel when every row is dense, nothing is compacted and
  there is a bias (with an activation: oneDNN's kernel only), else by the
  epilogue (cc/kernels/epilogue.h) after both parts of the split have
  written their rows.
num_bias: 0 (no bias) or 1.
activation: 'none', 'relu' (max(x, 0)) or 'relu6' (min(max(x, 0), 6)),
  applied after the bias; NaN propagates, except with a bias where TF's
  fused kernel is oneDNN's (float32, bfloat16): its post-ops map NaN to 0,
  as TF's fused graph does, and so do the split plans.
heterogeneous: on the GPU kernel, multiply the sparse rows on the CPU (copied
  to host memory) while the dense rows run on the GPU (Peng 2017). The CPU
  kernel ignores it (normal CPU split) and records kHeteroCpuFallback in the
  kStatHeterogeneous entry of stats.
full_stats: with an automatic threshold, false lets a call that the cost
  model keeps all-dense count only a strided sample of a's rows, or
  nothing (cc/core/cost_model.h, ChooseAnalysis); its statistics then hold
  estimates (kStatAnalysis says which). True (the default) counts every
  value on every call: exact statistics.
stats: float64 [kNumStats] per-call statistics, laid out as in
  cc/core/stats.h (tf_sparse_split/tuning/stats.py).
T: float32, float64, bfloat16 or float16. In bfloat16 and float16, a, b,
  bias and the product are stored in T; the product is accumulated in
  float32 and rounded once to T (round-to-nearest-even) on every path: TF's
  CPU MatMul (oneDNN, AMX/AVX512_BF16 where the CPU has them) for the dense
  rows, the CSR SpMM (values kept in T, widened to float32, fused
  multiply-adds in ascending k) for the sparse ones. The bias and
  activation then round once more, as TF's BiasAdd in T does (the fused
  all-dense kernel adds the bias before its rounding).
)doc");

}  // namespace tf_sparse_split
