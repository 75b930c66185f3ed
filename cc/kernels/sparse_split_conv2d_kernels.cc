// SparseSplitConv2D, SparseSplitConv2DBackpropFilter[WithBias] and
// SparseSplitConv2DBackpropInput: CPU kernels (registration and shape
// functions in cc/ops/sparse_split_conv2d_ops.cc).
//
// output = conv2d(input, filter) as tf.nn.conv2d (NHWC input, HWIO filter,
// strides, SAME/VALID/EXPLICIT padding, dilations), exploiting the zeros of
// the input (K.-Y. Peng, NTU 2017): images whose density nnz / (H*W*C_in) is
// above `threshold` go to TensorFlow's own CPU convolution kernel (oneDNN's
// for float32, the one tf.nn.conv2d runs; Eigen's for float64), run
// in-process on a sub-context; the others go to the gather-form sparse kernel
// of cc/core/sparse_conv2d.h (cost ~ nnz). Input channels that are zero in
// every image are compacted away from the dense part with the matching filter
// slices. A negative threshold lets the op choose it from rates it measured.
//
// The filter gradient op does the same for dF = sum x (*) dY: dense images
// through TF's Conv2DBackpropFilter kernel, sparse ones through a kernel whose
// cost is nnz(x) * KH*KW*C_out (pixel order with private per-block copies of
// dF reduced in block order; channel-parallel when dF is too large to copy).
// Its WithBias form also returns db = sum of dY over N, OH, OW from one
// vectorised pass over dY (ConvBiasGrad; optionally the dense images' part
// from oneDNN's fused filter + bias gradient, TFSS_CONV_BIAS_GRAD=fused).
//
// The input gradient op (stride 1) splits the images of dY: dense ones
// through TF's Conv2DBackpropInput on the original filter, sparse ones
// through the forward sparse kernels on the filter rotated 180 degrees with
// its channels swapped, a copy built in the kernel only when a sparse part
// runs (see "Input gradient" below).
//
// With a bias and/or activation (attrs num_bias, activation) the output is
// act(conv2d(input, filter) + bias): the dense images come finished from
// TF's fused convolution (the kernel TF's own graph runs for Conv2D +
// BiasAdd + Relu; see InitFusedKernel), the sparse images get the epilogue
// of cc/kernels/epilogue.h right after the sparse kernel wrote them. An
// all-dense call is exactly TF's fused kernel on the op's inputs.
//
// Cheap analysis (attr full_stats false, automatic threshold): a call first
// asks the cost model how much to count (SplitCall::ChooseAnalysis): every
// value, a strided sample of every image's pixels (ConvSample), or nothing;
// when the sample clearly says all-dense, or nothing was counted, the call
// runs TF's (fused) kernel on its inputs at once, its statistics marked
// (kStatAnalysis). The forward's and the filter gradient's all-sparse calls
// whose sparse kernel is the direct one (an automatic all-sparse plan between its periodic full
// counts, or a given threshold of 1) count only such a sample too and
// decide on its estimate (AnalysisMode::kSampleSparse): the direct kernel
// reads no counts, and every image it gets is run, none skipped as
// all-zero on an estimate.
//
// Dtypes: float32, float64, bfloat16 and half. The 16-bit dtypes follow TF's
// CPU kernels' contract (stored in T, accumulated in float32, rounded once
// to T): TF's kernels in T for the dense part; the sparse images widened to
// float32 for the float32 sparse kernels, their output rounded once (see
// "16-bit dtypes" below).
//
// Statistics (float64 [kNumStats], StatIndex of sparse_matmul.h) with rows = images
// and columns = the H*W*C_in values of an image (an all-zero input channel is
// H*W all-zero columns): M = N, K = H*W*C_in, N = KH*KW*C_out (flops / 2 per
// input nonzero on the sparse path), ZERO_COLS_SKIPPED = H*W * (all-zero
// channels skipped), NNZ / NNZ_SPARSE = nonzero input values.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <vector>

#include "cc/core/conv_cost.h"
#include "cc/core/cost_model.h"
#include "cc/core/direct_conv2d.h"
#include "cc/core/low_precision.h"
#include "cc/core/sparse_conv2d.h"
#include "cc/core/sparse_matmul.h"
#include "cc/core/uninit_vector.h"
#include "cc/kernels/core_types.h"
#include "cc/kernels/epilogue.h"
#include "cc/kernels/sparse_split_matmul_common.h"
#include "cc/kernels/split_runtime.h"
#include "cc/kernels/tf_kernel.h"
#include "cc/kernels/tf_parallel_for.h"
#include "tensorflow/core/framework/node_def_util.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"

namespace tf_sparse_split {

namespace tf = ::tensorflow;

namespace {

// ---- 16-bit dtypes -------------------------------------------------------
// TensorFlow's bfloat16 / half (Eigen::bfloat16 / Eigen::half) are stored as
// the core's bf16 / f16 (layout-compatible, cc/core/low_precision.h): the
// counts and copies take them as they are; the sparse kernels run in float32
// on the sparse images widened once (WidenToFloat), and their output (or the
// filter gradient's sum) is rounded once to the dtype (NarrowFromFloat,
// round-to-nearest-even). TF's own kernels run the dense part in the dtype.
// Tensor data reaches the core through CoreType/AsCore (core_types.h).
//
// Whether T is a 16-bit dtype whose sparse part runs in float32.
template <typename T>
constexpr bool kLowPrecision = IsLowPrecision<CoreType<T>>::value;

// Images images[0..n) of x, per_image values each, widened to float32 into
// the dense [n, per_image] buffer out.
template <typename T>
void WidenImages(const T* x, int64_t per_image, const int64_t* images,
                 int64_t n, float* out, const ParallelFor& pfor) {
  pfor(n, per_image + 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      WidenToFloat(AsCore(x) + images[i] * per_image, out + i * per_image,
                   per_image);
  });
}

// Images per block of the 16-bit sparse paths: about 2^20 input values
// (4 MB of float32), the size the calibration times, so that the widened
// block and its output stay in cache between widening, kernel and
// narrowing instead of streaming the whole batch through memory three
// times.
inline int64_t LowPrecisionBlock(int64_t per_image) {
  return std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(1, per_image));
}

// act(y + bias) on rows x n float32 values (bias may be null): with
// nan_to_zero as oneDNN's relu/relu6 post-ops (NaN -> 0), else as the core
// epilogue (NaN propagates).
void FloatEpilogue(float* y, int64_t rows, int64_t n, const float* bias,
                   Activation act, bool nan_to_zero, const ParallelFor& pfor) {
  if (rows <= 0 || n <= 0) return;
  if (nan_to_zero && act != Activation::kNone) {
    pfor(rows, 2 * n + 8, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        float* row = y + r * n;
        for (int64_t j = 0; j < n; ++j) {
          float v = row[j];
          if (bias != nullptr) v += bias[j];
          v = v > 0.0f ? v : 0.0f;
          if (act == Activation::kRelu6) v = v < 6.0f ? v : 6.0f;
          row[j] = v;
        }
      }
    });
    return;
  }
  BiasActivationRows<float>(y, n, nullptr, rows, n, bias, act, pfor);
}

absl::Status CheckFilter(const Conv2DGeometry& g, const tf::TensorShape& x,
                         const tf::TensorShape& f, const char* op);

// Strides, dilations and padding of one convolution op, validated.
struct ConvAttrs {
  std::vector<tf::int32> strides, dilations;
  std::vector<tf::int64> explicit_paddings;
  std::string padding;
  int padding_code = 0;  // 0 VALID, 1 SAME, 2 EXPLICIT

  absl::Status Init(tf::OpKernelConstruction* ctx, const char* op) {
    TF_RETURN_IF_ERROR(ctx->GetAttr("strides", &strides));
    TF_RETURN_IF_ERROR(ctx->GetAttr("dilations", &dilations));
    TF_RETURN_IF_ERROR(ctx->GetAttr("padding", &padding));
    TF_RETURN_IF_ERROR(ctx->GetAttr("explicit_paddings", &explicit_paddings));
    padding_code = padding == "VALID" ? 0 : padding == "SAME" ? 1 : 2;
    auto list = [](const auto& v) {
      std::string s = "[";
      for (size_t i = 0; i < v.size(); ++i)
        absl::StrAppend(&s, i ? ", " : "", v[i]);
      return s + "]";
    };
    // strides and dilations: 4 NHWC entries, 1 on N and C, positive on H, W.
    for (const auto* attr : {&strides, &dilations}) {
      const std::vector<tf::int32>& v = *attr;
      const char* name = attr == &strides ? "strides" : "dilations";
      if (v.size() != 4)
        return tf::errors::InvalidArgument(op, ": ", name, " must have 4 "
                                           "entries (NHWC), got ", list(v));
      if (v[0] != 1 || v[3] != 1)
        return tf::errors::InvalidArgument(
            op, ": ", name, " on the batch and channel dimensions must be 1, "
            "got ", list(v));
      if (v[1] <= 0 || v[2] <= 0)
        return tf::errors::InvalidArgument(op, ": ", name,
                                           " must be positive, got ", list(v));
    }
    if (padding_code == 2) {
      if (explicit_paddings.size() != 8)
        return tf::errors::InvalidArgument(
            op, ": padding EXPLICIT needs explicit_paddings of 8 entries "
            "(before/after for N, H, W, C), got ", list(explicit_paddings));
      for (auto p : explicit_paddings)
        if (p < 0 || p > (int64_t{1} << 30))
          return tf::errors::InvalidArgument(
              op, ": explicit_paddings must be in [0, 2^30], got ",
              list(explicit_paddings));
      if (explicit_paddings[0] || explicit_paddings[1] ||
          explicit_paddings[6] || explicit_paddings[7])
        return tf::errors::InvalidArgument(
            op, ": explicit_paddings on the batch and channel dimensions must "
            "be 0, got ", list(explicit_paddings));
    } else if (!explicit_paddings.empty()) {
      return tf::errors::InvalidArgument(
          op, ": explicit_paddings must be empty unless padding is EXPLICIT, "
          "got ", list(explicit_paddings), " with padding ", padding);
    }
    return absl::OkStatus();
  }

  // The geometry of input x [N, H, W, C_in] and filter f [KH, KW, C_in,
  // C_out] under these attrs; InvalidArgument if they do not fit.
  absl::Status Geometry(const tf::TensorShape& x, const tf::TensorShape& f,
                        Conv2DGeometry* g, const char* op) const {
    g->n = x.dim_size(0);
    g->h = x.dim_size(1);
    g->w = x.dim_size(2);
    g->c_in = x.dim_size(3);
    g->kh = f.dim_size(0);
    g->kw = f.dim_size(1);
    g->c_out = f.dim_size(3);
    TF_RETURN_IF_ERROR(CheckFilter(*g, x, f, op));
    return OutputGeometry(g, op);
  }

  // Fills g's output size and padding from its input/filter sizes.
  absl::Status OutputGeometry(Conv2DGeometry* g, const char* op) const {
    g->stride_h = strides[1];
    g->stride_w = strides[2];
    g->dil_h = dilations[1];
    g->dil_w = dilations[2];
    const char* err = nullptr;
    const int64_t pt = padding_code == 2 ? explicit_paddings[2] : 0;
    const int64_t pb = padding_code == 2 ? explicit_paddings[3] : 0;
    const int64_t pl = padding_code == 2 ? explicit_paddings[4] : 0;
    const int64_t pr = padding_code == 2 ? explicit_paddings[5] : 0;
    // TensorFlow's CPU convolutions (the dense part) crash -- a
    // floating-point exception or a segmentation fault, not an error -- on
    // a dilated filter or a padded input side near 2^31 (e.g. dilations of
    // 2^31 - 1 with SAME padding, or explicit paddings of 2^30 on each
    // side), so sides beyond kMaxConvSide are refused first.
    constexpr int64_t kMaxConvSide = int64_t{1} << 30;
    const int64_t ek_h = (g->kh - 1) * g->dil_h + 1;  // kh, dil < 2^31
    const int64_t ek_w = (g->kw - 1) * g->dil_w + 1;
    if (ek_h > kMaxConvSide || ek_w > kMaxConvSide)
      return tf::errors::InvalidArgument(
          op, ": the dilated filter, (K - 1) * dilation + 1 = ", ek_h, "x",
          ek_w, " (filter ", g->kh, "x", g->kw, ", dilations ", g->dil_h,
          "x", g->dil_w, "), exceeds 2^30 per side; reduce the dilations");
    if (!ConvOutputSize(g->h, g->kh, g->stride_h, g->dil_h, padding_code, pt,
                        pb, &g->out_h, &g->pad_top, &err) ||
        !ConvOutputSize(g->w, g->kw, g->stride_w, g->dil_w, padding_code, pl,
                        pr, &g->out_w, &g->pad_left, &err)) {
      return tf::errors::InvalidArgument(
          op, ": ", err, ": input spatial size ", g->h, "x", g->w,
          ", filter ", g->kh, "x", g->kw, ", dilations ", g->dil_h, "x",
          g->dil_w, ", padding ", padding);
    }
    // The padded input: explicit paddings as given; SAME's total as
    // TensorFlow pads, max((out - 1) * stride + ek - in, 0).
    auto padded = [&](int64_t in, int64_t out, int64_t stride, int64_t ek,
                      int64_t before, int64_t after) {
      if (padding_code == 2) return in + before + after;
      if (padding_code == 1)
        return in + std::max<int64_t>((out - 1) * stride + ek - in, 0);
      return in;
    };
    const int64_t ph = padded(g->h, g->out_h, g->stride_h, ek_h, pt, pb);
    const int64_t pw = padded(g->w, g->out_w, g->stride_w, ek_w, pl, pr);
    if (ph > kMaxConvSide || pw > kMaxConvSide)
      return tf::errors::InvalidArgument(
          op, ": the padded input, ", ph, "x", pw, " (input ", g->h, "x",
          g->w, ", padding ", padding, "), exceeds 2^30 per side; reduce the "
          "explicit paddings or the dilations");
    int64_t elems = 0;
    if (__builtin_mul_overflow(g->n, g->out_h, &elems) ||
        __builtin_mul_overflow(elems, g->out_w, &elems) ||
        __builtin_mul_overflow(elems, g->c_out, &elems))
      return tf::errors::InvalidArgument(
          op, ": the output [N, OH, OW, C_out] = [", g->n, ", ", g->out_h,
          ", ", g->out_w, ", ", g->c_out, "] has more than 2^63 values");
    return absl::OkStatus();
  }
};

// Creates TF's kernel for `op` (oneDNN's labelled "_MklNative<op>" where
// OneDnnRunsDtype, else the plain one).
absl::Status InitDenseKernel(tf::OpKernelConstruction* ctx, tf::DataType dt,
                             const std::string& op, int num_inputs,
                             const ConvAttrs& a, TfKernel* k,
                             bool* is_onednn = nullptr) {
  if (is_onednn) *is_onednn = false;
  auto attrs = [&](tf::NodeDef* def) {
    tf::AddNodeAttr("T", dt, def);
    tf::AddNodeAttr("strides", a.strides, def);
    tf::AddNodeAttr("padding", a.padding, def);
    tf::AddNodeAttr("explicit_paddings", a.explicit_paddings, def);
    tf::AddNodeAttr("dilations", a.dilations, def);
    tf::AddNodeAttr("data_format", "NHWC", def);
  };
  // oneDNN's Conv2DBackpropFilter and Conv2DBackpropInput fail to create
  // their primitives for some EXPLICIT paddings (e.g. [1, 0] x [2, 1] with a
  // 3x3 filter); TensorFlow's graph never runs them there either (its
  // oneDNN rewrite leaves them with EXPLICIT padding to the Eigen kernels).
  const bool onednn_ok =
      !((op == "Conv2DBackpropFilter" || op == "Conv2DBackpropInput") &&
        a.padding_code == 2) &&
      OneDnnRunsDtype(dt);
  if (onednn_ok) {
    if (k->Init(ctx, tf::DEVICE_CPU, "_MklNative" + op, "MklNameChangeOp",
                num_inputs, attrs)
            .ok()) {
      if (is_onednn) *is_onednn = true;
      return absl::OkStatus();
    }
  }
  return k->Init(ctx, tf::DEVICE_CPU, op, "", num_inputs, attrs);
}

// TF's gradient kernel `op` ("Conv2DBackpropFilter"/"Conv2DBackpropInput")
// for the dense part of a gradient op. TF's Eigen kernels (float64; half
// without AVX512_FP16) refuse dilations > 1 and oneDNN's refuses them with
// EXPLICIT padding (tf.nn.conv2d has no gradient there in TF 2.21); the
// sparse kernels handle any, so such calls run all-sparse. Fails the
// construction only where no dilation excuses a missing kernel; returns
// whether the dense part may run.
bool InitGradientDenseKernel(tf::OpKernelConstruction* ctx, tf::DataType dt,
                             const std::string& op, const ConvAttrs& a,
                             TfKernel* k, bool* is_onednn) {
  const absl::Status s = InitDenseKernel(ctx, dt, op, 3, a, k, is_onednn);
  const bool dilated = a.dilations[1] > 1 || a.dilations[2] > 1;
  if (!dilated && !s.ok()) {
    ctx->CtxFailure(__FILE__, __LINE__, s);
    return false;
  }
  return s.ok() && (!dilated || (*is_onednn && a.padding_code != 2));
}

// oneDNN's fused filter + bias gradient ("_MklNativeConv2DBackpropFilterWithBias",
// label MklNameChangeOp: outputs dF and db = sum of dY over N, OH, OW, one
// pass), the kernel TF's own graph runs for Conv2DBackpropFilter +
// BiasAddGrad of a Conv2D + BiasAdd once its oneDNN rewrite has fused them.
// Only with TFSS_CONV_BIAS_GRAD=fused (BiasGradOverride: slower than the
// plain kernel + ConvBiasGrad where measured). Used for float32 only (the 16-bit dtypes sum the bias in float32
// themselves, one rounding), with oneDNN on and SAME/VALID padding (the op
// has no explicit_paddings); whether TF registers it is checked here, at
// run time. Returns whether *k is usable.
bool InitFilterGradWithBiasKernel(tf::OpKernelConstruction* ctx,
                                  tf::DataType dt, const ConvAttrs& a,
                                  TfKernel* k) {
  if (dt != tf::DT_FLOAT || !OneDnnEnabled() || a.padding_code == 2)
    return false;
  auto attrs = [&](tf::NodeDef* def) {
    tf::AddNodeAttr("T", dt, def);
    tf::AddNodeAttr("strides", a.strides, def);
    tf::AddNodeAttr("padding", a.padding, def);
    tf::AddNodeAttr("dilations", a.dilations, def);
    tf::AddNodeAttr("data_format", "NHWC", def);
  };
  return k->Init(ctx, tf::DEVICE_CPU, "_MklNativeConv2DBackpropFilterWithBias",
                 "MklNameChangeOp", 3, attrs)
      .ok();
}

// TFSS_CONV_BIAS_GRAD=fused|pass (read when the op is created; tests and
// benchmarks): "fused" makes the filter gradient with bias run oneDNN's
// fused filter + bias gradient for its dense part (where it exists); the
// default ("pass", unset or anything else) runs TF's plain filter gradient
// and sums dY in one vectorised pass (ConvBiasGrad), which was faster on
// every ResNet50 shape measured: the fused kernel took 1.00-1.26x the time
// of the plain kernel + the pass (medians, float32, batch 16, under load).
// Returns 1 for "fused", 2 for "pass", 0 otherwise.
int BiasGradOverride() {
  const char* v = std::getenv("TFSS_CONV_BIAS_GRAD");
  if (v == nullptr) return 0;
  const std::string s(v);
  return s == "fused" ? 1 : s == "pass" ? 2 : 0;
}

// Reads an int32 vector of 4 non-negative sizes (`what`, laid out as
// `layout`) into `shape`.
absl::Status ReadSizes4(const tf::Tensor& sizes, const char* op,
                        const char* what, const char* layout,
                        tf::TensorShape* shape) {
  if (!tf::TensorShapeUtils::IsVector(sizes.shape()) ||
      sizes.NumElements() != 4)
    return tf::errors::InvalidArgument(op, ": ", what,
                                       " must be an int32 vector of 4 ",
                                       layout, ", got shape ",
                                       sizes.shape().DebugString());
  auto sz = sizes.vec<tf::int32>();
  for (int i = 0; i < 4; ++i)
    if (sz(i) < 0)
      return tf::errors::InvalidArgument(op, ": ", what, " must be >= 0, got ",
                                         sz(i));
  // Not the CHECK-ing TensorShape constructor: sizes whose product
  // overflows int64 (e.g. four of 2^31 - 1) are an error, not an abort.
  const absl::Status built = tf::TensorShape::BuildTensorShape(
      {int64_t{sz(0)}, int64_t{sz(1)}, int64_t{sz(2)}, int64_t{sz(3)}}, shape);
  if (!built.ok())
    return tf::errors::InvalidArgument(op, ": ", what, " [", sz(0), ", ",
                                       sz(1), ", ", sz(2), ", ", sz(3),
                                       "] has too many values: ",
                                       built.message());
  return absl::OkStatus();
}

// TF's fused convolution act(conv2d(x, f) + bias) for the dense part of a
// SparseSplitConv2D with a bias: the kernel TF's graph runs for Conv2D +
// BiasAdd [+ Relu | Relu6] once Grappler's remapper has fused them --
// oneDNN's "_MklNativeFusedConv2D" in float32 when oneDNN is on (checked at
// run time in TF 2.21: the partition graph of such a tf.function holds
// _MklNativeFusedConv2D, _kernel MklNameChangeOp), Eigen's "_FusedConv2D"
// in float32 without oneDNN; the same kernels in bfloat16 and half (oneDNN's
// where OneDnnRunsDtype). In float64 TF's graph runs Conv2D, BiasAdd and
// Relu unfused; there (and wherever the fused kernel cannot be created)
// this returns an error and the op runs Conv2D followed by its epilogue.
// *onednn tells whether the kernel is oneDNN's (its relu maps NaN to 0).
absl::Status InitFusedKernel(tf::OpKernelConstruction* ctx, tf::DataType dt,
                             const ConvAttrs& a, Activation act, TfKernel* k,
                             bool* onednn) {
  *onednn = false;
  if (dt == tf::DT_DOUBLE)
    return tf::errors::Unimplemented("no fused CPU convolution for ",
                                     tf::DataTypeString(dt));
  std::vector<std::string> fused_ops = {"BiasAdd"};
  if (act == Activation::kRelu) fused_ops.push_back("Relu");
  if (act == Activation::kRelu6) fused_ops.push_back("Relu6");
  auto attrs = [&](tf::NodeDef* def) {
    tf::AddNodeAttr("T", dt, def);
    tf::AddNodeAttr("TArgs", tf::DataTypeVector{dt}, def);
    tf::AddNodeAttr("num_args", 1, def);
    tf::AddNodeAttr("strides", a.strides, def);
    tf::AddNodeAttr("padding", a.padding, def);
    tf::AddNodeAttr("explicit_paddings", a.explicit_paddings, def);
    tf::AddNodeAttr("dilations", a.dilations, def);
    tf::AddNodeAttr("data_format", "NHWC", def);
    tf::AddNodeAttr("fused_ops", fused_ops, def);
  };
  // Inputs: input, filter, args (the bias); no host_args.
  if (OneDnnEnabled() && OneDnnRunsDtype(dt) &&
      k->Init(ctx, tf::DEVICE_CPU, "_MklNativeFusedConv2D", "MklNameChangeOp",
              3, attrs)
          .ok()) {
    *onednn = true;
    return absl::OkStatus();
  }
  return k->Init(ctx, tf::DEVICE_CPU, "_FusedConv2D", "", 3, attrs);
}

// The family of a convolution: op, dtype, batch bucket and the whole
// geometry but N (cc/core/conv_cost.h).
std::vector<int64_t> FamilyKey(FamilyOp op, tf::DataType dt,
                               const Conv2DGeometry& g) {
  return ConvFamilyKey(op, static_cast<int64_t>(dt), g);
}

absl::Status CheckThreshold(const tf::Tensor& t, const char* op, float* out) {
  if (!tf::TensorShapeUtils::IsScalar(t.shape()))
    return tf::errors::InvalidArgument(op, ": threshold must be a scalar, got "
                                       "shape ", t.shape().DebugString());
  *out = t.scalar<float>()();
  if (std::isnan(*out) || *out > 1.0f)
    return tf::errors::InvalidArgument(
        op, ": threshold must be in [0, 1] or negative (automatic), got ",
        *out);
  return absl::OkStatus();
}

// Validated shapes common to both ops: input [N,H,W,C] and filter sizes.
absl::Status CheckInput(const tf::Tensor& x, const char* op) {
  if (x.dims() != 4)
    return tf::errors::InvalidArgument(op, ": input must be rank 4 [N, H, W, "
                                       "C_in] (NHWC), got shape ",
                                       x.shape().DebugString());
  return absl::OkStatus();
}

absl::Status CheckFilter(const Conv2DGeometry& g, const tf::TensorShape& x,
                         const tf::TensorShape& f, const char* op) {
  if (g.kh <= 0 || g.kw <= 0)
    return tf::errors::InvalidArgument(
        op, ": filter spatial sizes must be positive, got filter shape ",
        f.DebugString());
  if (g.c_in != f.dim_size(2))
    return tf::errors::InvalidArgument(
        op, ": input has ", g.c_in, " channels (shape ", x.DebugString(),
        ") but the filter expects ", f.dim_size(2), " (shape ",
        f.DebugString(), "); grouped convolution is not supported");
  if (g.c_in >= (int64_t{1} << 31) || g.h >= (int64_t{1} << 31) ||
      g.w >= (int64_t{1} << 31))
    return tf::errors::InvalidArgument(op, ": input dimensions too large: ",
                                       x.DebugString());
  return absl::OkStatus();
}

// Sparse filter gradient of the listed images, accumulated into df: the
// pixel-order kernel when it can use at least two private blocks (faster:
// dy rows stay in cache), else the channel-parallel one.
template <typename T>
void SparseFilterGrad(const T* x, const Conv2DGeometry& g,
                      const int64_t* images, int64_t n_images,
                      const int64_t* image_nnz, const T* dy, T* df,
                      const ParallelFor& pfor) {
  if (FilterGradBlocks(g, n_images) >= 2) {
    PixelCsr<T> csr;
    BuildPixelCsr<T>(x, g, images, n_images, image_nnz, &csr, pfor);
    SparseConv2DBackpropFilterPixels<T>(csr, g, images, n_images, dy, df, pfor);
  } else {
    ChannelCsr<T> csc;
    BuildChannelCsr<T>(x, g, images, n_images, &csc, pfor);
    SparseConv2DBackpropFilter<T>(csc, g, images, dy, df, pfor);
  }
}

// ---- Sparse-kernel choice: direct (zero-skipping) or pixel CSR -----------
// The sparse part of both ops runs one of two kernels: the direct kernel of
// cc/core/direct_conv2d.h (SparseTrain, Gong et al. 2019: zeros tested in
// the dense layout, nothing converted; cost ~ a scan per value + work per
// nonzero) or the pixel-CSR kernels of cc/core/sparse_conv2d.h (a CSR build
// per value + work per nonzero). Each family times both once, on the first
// call that may run sparse rows -- the call's first images (about 2^20
// values) and a copy thinned to every 8th nonzero, interleaved, best of up
// to three -- fits seconds = a * values + b * nnz per kernel and then takes,
// per call, the kernel predicted faster for the sparse rows' values and
// nonzeros. The family's cost terms (cost_model.h) are calibrated on the
// kernel this choice takes for the calibration sample.

class SparseKernelChoice {
 public:
  bool calibrated() const {
    std::lock_guard<std::mutex> l(mu_);
    return calibrated_;
  }
  void Set(const SparseKernelRate& direct, const SparseKernelRate& csr) {
    std::lock_guard<std::mutex> l(mu_);
    if (calibrated_) return;
    direct_ = direct;
    csr_ = csr;
    calibrated_ = true;
  }
  // The direct kernel unless calibrated timings predict the CSR faster.
  bool UseDirect(double values, double nnz) const {
    std::lock_guard<std::mutex> l(mu_);
    return !calibrated_ || DirectPredictedFaster(direct_, csr_, values, nnz);
  }

 private:
  mutable std::mutex mu_;
  bool calibrated_ = false;
  SparseKernelRate direct_, csr_;
};

// TFSS_CONV_SPARSE_KERNEL=direct|csr forces one sparse kernel (tests and
// benchmarks); unset or anything else: the calibrated choice.
int SparseKernelOverride() {
  const char* v = std::getenv("TFSS_CONV_SPARSE_KERNEL");
  if (v == nullptr) return 0;
  const std::string s(v);
  return s == "direct" ? 1 : s == "csr" ? 2 : 0;
}

// Whether the sparse part of `values` values holding `nnz` nonzeros runs
// the direct kernel.
bool UseDirectKernel(const SparseKernelChoice& choice, double values,
                     double nnz) {
  const int o = SparseKernelOverride();
  return o == 1 || (o == 0 && choice.UseDirect(values, nnz));
}

// Process-wide choices, one per family key.
SparseKernelChoice& ChoiceFor(const std::vector<int64_t>& key) {
  static std::mutex* mu = new std::mutex;
  static auto* m =
      new std::map<std::vector<int64_t>, std::unique_ptr<SparseKernelChoice>>;
  std::lock_guard<std::mutex> l(*mu);
  auto& c = (*m)[key];
  if (!c) c.reset(new SparseKernelChoice);
  return *c;
}

// The cost-model family (FamilyFor) and sparse-kernel choice (ChoiceFor) of
// an op instance's calls. The process-wide registries (a key vector built,
// a global mutex, a map walk each -- several microseconds with the caches
// cold, as they are between the calls of a Python loop) are asked only when
// the call's geometry or family op differs from the previous call's; a
// layer calls with the same shape step after step. Registry entries live
// for the process, so the cached pointers stay valid.
class ConvFamilyCache {
 public:
  FamilyModel& Family(FamilyOp op, tf::DataType dt, const Conv2DGeometry& g) {
    std::lock_guard<std::mutex> lock(mu_);
    Refresh(op, dt, g);
    return *family_;
  }
  SparseKernelChoice& Choice(FamilyOp op, tf::DataType dt,
                             const Conv2DGeometry& g) {
    std::lock_guard<std::mutex> lock(mu_);
    Refresh(op, dt, g);
    return *choice_;
  }

 private:
  void Refresh(FamilyOp op, tf::DataType dt, const Conv2DGeometry& g) {
    if (family_ != nullptr && op == op_ && dt == dt_ && g == g_) return;
    const std::vector<int64_t> key = FamilyKey(op, dt, g);
    family_ = &FamilyFor(key);
    choice_ = &ChoiceFor(key);
    op_ = op;
    dt_ = dt;
    g_ = g;
  }

  std::mutex mu_;
  FamilyModel* family_ = nullptr;
  SparseKernelChoice* choice_ = nullptr;
  FamilyOp op_{};
  tf::DataType dt_ = tf::DT_INVALID;
  Conv2DGeometry g_;
};

// Calibrates `choice` on the first images of x: run(direct, sample,
// image_nnz) runs one kernel on the images of `sample` (a dim-0 slice of x
// or a thinned copy of it).
template <typename T, typename Run>
absl::Status CalibrateSparseChoice(tf::OpKernelContext* ctx,
                                   const tf::Tensor& x, const Conv2DGeometry& g,
                                   Run run, SparseKernelChoice* choice) {
  const int64_t k = std::max<int64_t>(1, g.h * g.w * g.c_in);
  const int64_t rows = std::max<int64_t>(
      1, std::min<int64_t>(g.n, ((int64_t{1} << 20) + k - 1) / k));
  const tf::Tensor sample = x.Slice(0, rows);
  tf::Tensor thin;
  TF_RETURN_IF_ERROR(ctx->allocate_temp(x.dtype(), sample.shape(), &thin));
  std::vector<int64_t> nnz_full(rows), nnz_thin(rows);
  const T* xs = sample.flat<T>().data();
  T* xt = thin.flat<T>().data();
  double full = 0, thinned = 0;
  for (int64_t r = 0; r < rows; ++r) {
    int64_t seen = 0, kept = 0;
    for (int64_t j = 0; j < k; ++j) {
      const T v = xs[r * k + j];
      const bool nz = v != T(0);
      const bool keep = nz && (seen++ % 8) == 0;
      xt[r * k + j] = keep ? v : T(0);
      kept += keep;
    }
    nnz_full[r] = seen;
    nnz_thin[r] = kept;
    full += seen;
    thinned += kept;
  }
  std::vector<std::function<absl::Status()>> fns = {
      [&] { return run(true, sample, nnz_full.data()); },
      [&] { return run(true, thin, nnz_thin.data()); },
      [&] { return run(false, sample, nnz_full.data()); },
      [&] { return run(false, thin, nnz_thin.data()); }};
  std::vector<double> best;
  TF_RETURN_IF_ERROR(BestSecondsInterleaved(fns, &best));
  const double values = static_cast<double>(rows) * k;
  choice->Set(FitSparseKernel(values, full, best[0], thinned, best[1]),
              FitSparseKernel(values, full, best[2], thinned, best[3]));
  return absl::OkStatus();
}

// Whether a call of geometry g has work (no empty dimension).
bool HasWork(const Conv2DGeometry& g) {
  return g.n > 0 && g.out_h > 0 && g.out_w > 0 && g.c_out > 0 &&
         g.h * g.w * g.c_in > 0;
}

// Sparse forward of the listed images by the chosen kernel. The direct
// kernel applies `epilogue` itself (fused into its last pass); the caller
// applies it after the pixel-CSR kernel.
template <typename T>
void SparseForwardBy(bool direct, const T* x, const Conv2DGeometry& g,
                     const int64_t* images, int64_t n_images,
                     const int64_t* image_nnz, const T* f, T* y,
                     const ParallelFor& pfor,
                     const DirectConvEpilogue<T>& epilogue = {}) {
  if (direct) {
    // All-zero images: zero output (then the epilogue), no scan.
    std::vector<int64_t> live;
    live.reserve(n_images);
    const int64_t out_img = g.out_h * g.out_w * g.c_out;
    for (int64_t i = 0; i < n_images; ++i) {
      if (image_nnz[images[i]] > 0) {
        live.push_back(images[i]);
      } else {
        std::fill_n(y + images[i] * out_img, out_img, T(0));
        ApplyDirectConvEpilogue<T>(y + images[i] * out_img, g.out_h * g.out_w,
                                   g.c_out, epilogue);
      }
    }
    if (live.empty()) return;
    DirectConv2DForward<T>(x, g, f, live.data(),
                           static_cast<int64_t>(live.size()), y, pfor,
                           epilogue);
    return;
  }
  PixelCsr<T> csr;
  BuildPixelCsr<T>(x, g, images, n_images, image_nnz, &csr, pfor);
  SparseConv2DForward<T>(csr, g, images, n_images, f, y, pfor);
}

// Sparse filter gradient of the listed images by the chosen kernel
// (accumulated into df).
template <typename T>
void SparseFilterGradBy(bool direct, const T* x, const Conv2DGeometry& g,
                        const int64_t* images, int64_t n_images,
                        const int64_t* image_nnz, const T* dy, T* df,
                        const ParallelFor& pfor) {
  if (direct) {
    std::vector<int64_t> live;  // all-zero images add nothing
    live.reserve(n_images);
    for (int64_t i = 0; i < n_images; ++i)
      if (image_nnz[images[i]] > 0) live.push_back(images[i]);
    if (live.empty()) return;
    DirectConv2DBackpropFilter<T>(x, g, dy, live.data(),
                                  static_cast<int64_t>(live.size()), df, pfor);
    return;
  }
  SparseFilterGrad<T>(x, g, images, n_images, image_nnz, dy, df, pfor);
}

// The 16-bit dtypes' sparse forward: the listed images of x and the filter
// widened to float32, the float32 kernel chosen above, then (bias_f or act
// given) act(y + bias) in float32, and one rounding of each output value to
// T into the images' place in y, block by block (LowPrecisionBlock). Other
// images of y are untouched.
template <typename T>
void SparseForwardLow(bool direct, const T* x, const Conv2DGeometry& g,
                      const int64_t* images, int64_t n_images,
                      const int64_t* image_nnz, const T* f, T* y,
                      const float* bias_f, Activation act, bool nan_to_zero,
                      const ParallelFor& pfor) {
  if (n_images <= 0) return;
  const int64_t per_in = g.h * g.w * g.c_in;
  const int64_t per_out = g.out_h * g.out_w * g.c_out;
  const int64_t fsize = g.kh * g.kw * g.c_in * g.c_out;
  const int64_t block = std::min(n_images, LowPrecisionBlock(per_in));
  UninitVector<float> ff, xf, yf;
  ff.resize(fsize);
  xf.resize(block * per_in);
  yf.resize(block * per_out);
  WidenToFloat(AsCore(f), ff.data(), fsize);
  std::vector<int64_t> local(block), nnz(block);
  for (int64_t b0 = 0; b0 < n_images; b0 += block) {
    const int64_t nb = std::min(block, n_images - b0);
    const int64_t* imgs = images + b0;
    WidenImages(x, per_in, imgs, nb, xf.data(), pfor);
    for (int64_t i = 0; i < nb; ++i) {
      local[i] = i;
      nnz[i] = image_nnz[imgs[i]];
    }
    Conv2DGeometry gs = g;
    gs.n = nb;
    SparseForwardBy<float>(direct, xf.data(), gs, local.data(), nb,
                           nnz.data(), ff.data(), yf.data(), pfor);
    if (bias_f != nullptr || act != Activation::kNone)
      FloatEpilogue(yf.data(), nb * g.out_h * g.out_w, g.c_out, bias_f, act,
                    nan_to_zero, pfor);
    pfor(nb, per_out + 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i)
        NarrowFromFloat(yf.data() + i * per_out, AsCore(y) + imgs[i] * per_out,
                        per_out);
    });
  }
}

// The 16-bit dtypes' sparse filter gradient: the listed images of x and dy
// widened to float32 block by block (LowPrecisionBlock), the float32 kernel
// accumulating each block into the float32 df [KH, KW, C_in, C_out] (the
// caller rounds the finished sum once).
template <typename T>
void SparseFilterGradLow(bool direct, const T* x, const Conv2DGeometry& g,
                         const int64_t* images, int64_t n_images,
                         const int64_t* image_nnz, const T* dy, float* df,
                         const ParallelFor& pfor) {
  if (n_images <= 0) return;
  const int64_t per_in = g.h * g.w * g.c_in;
  const int64_t per_out = g.out_h * g.out_w * g.c_out;
  const int64_t block = std::min(n_images, LowPrecisionBlock(per_in));
  UninitVector<float> xf, dyf;
  xf.resize(block * per_in);
  dyf.resize(block * per_out);
  std::vector<int64_t> local(block), nnz(block);
  for (int64_t b0 = 0; b0 < n_images; b0 += block) {
    const int64_t nb = std::min(block, n_images - b0);
    const int64_t* imgs = images + b0;
    WidenImages(x, per_in, imgs, nb, xf.data(), pfor);
    WidenImages(dy, per_out, imgs, nb, dyf.data(), pfor);
    for (int64_t i = 0; i < nb; ++i) {
      local[i] = i;
      nnz[i] = image_nnz[imgs[i]];
    }
    Conv2DGeometry gs = g;
    gs.n = nb;
    SparseFilterGradBy<float>(direct, xf.data(), gs, local.data(), nb,
                              nnz.data(), dyf.data(), df, pfor);
  }
}

// Sparse filter gradient in any dtype, added into the T buffer df (used by
// the calibrations; a call's 16-bit sum is assembled in float32 instead).
template <typename T>
void SparseFilterGradAny(bool direct, const T* x, const Conv2DGeometry& g,
                         const int64_t* images, int64_t n_images,
                         const int64_t* image_nnz, const T* dy, T* df,
                         const ParallelFor& pfor) {
  if constexpr (kLowPrecision<T>) {
    const int64_t fsize = g.kh * g.kw * g.c_in * g.c_out;
    std::vector<float> acc(fsize);
    WidenToFloat(AsCore(static_cast<const T*>(df)), acc.data(), fsize);
    SparseFilterGradLow<T>(direct, x, g, images, n_images, image_nnz, dy,
                           acc.data(), pfor);
    NarrowFromFloat(acc.data(), AsCore(df), fsize);
  } else {
    SparseFilterGradBy<T>(direct, x, g, images, n_images, image_nnz, dy, df,
                          pfor);
  }
}

// Sparse forward in any dtype with no epilogue (the sparse-kernel choice's
// timings).
template <typename T>
void SparseForwardAny(bool direct, const T* x, const Conv2DGeometry& g,
                      const int64_t* images, int64_t n_images,
                      const int64_t* image_nnz, const T* f, T* y,
                      const ParallelFor& pfor) {
  if constexpr (kLowPrecision<T>) {
    SparseForwardLow<T>(direct, x, g, images, n_images, image_nnz, f, y,
                        nullptr, Activation::kNone, false, pfor);
  } else {
    SparseForwardBy<T>(direct, x, g, images, n_images, image_nnz, f, y, pfor);
  }
}
// ---- end of the sparse-kernel choice --------------------------------------

// The counts of a strided sample of a convolution input's pixels, as the
// split runtime's SampledCounts (rows = images): every image counted at
// the pixels CountConvNonzerosStrided visits. `stride` is the runtime's
// stride over the N*H*W pixels (SplitCall::SampleStrideFor), raised to be
// coprime with W (so that the sample visits every column, not one column
// of the image), after a cap at H*W / 4 (about four pixels per image at
// least). Returns the stride used (1: nothing sampled, count everything).
template <typename T>
int64_t ConvSample(const T* x, const Conv2DGeometry& g, int64_t stride,
                   const ParallelFor& pfor, SampledCounts* out) {
  const int64_t hw = g.h * g.w;
  stride = std::min<int64_t>(stride, hw / 4);
  if (stride < 2) return 1;
  while (std::gcd(stride, g.w) != 1) ++stride;
  std::vector<int64_t> chan(g.c_in, 0);
  out->row_nnz.assign(g.n, 0);
  const int64_t nnz = CountConvNonzerosStrided<CoreType<T>>(
      AsCore(x), g, stride, out->row_nnz.data(), chan.data(), pfor);
  const int64_t px = ConvSampledPixels(g, stride);
  const int64_t live = static_cast<int64_t>(
      std::count_if(chan.begin(), chan.end(), [](int64_t c) { return c != 0; }));
  out->rows = g.n;
  out->k_counted = px * g.c_in;
  out->k_live_est = hw * live;
  out->nnz_est = static_cast<double>(nnz) * static_cast<double>(hw) /
                 static_cast<double>(std::max<int64_t>(1, px));
  return stride;
}

// The filter_sizes tensor [KH, KW, c, C_out] of TF's Conv2DBackpropFilter.
tf::Tensor FilterSizes(const Conv2DGeometry& g, int64_t c) {
  tf::Tensor t(tf::DT_INT32, tf::TensorShape({4}));
  auto v = t.vec<tf::int32>();
  v(0) = g.kh;
  v(1) = g.kw;
  v(2) = c;
  v(3) = g.c_out;
  return t;
}

// The analysis of one convolution call: nonzeros per image and per input
// channel, the live (not all-zero) channels.
struct ConvAnalysis {
  std::vector<int64_t> image_nnz, chan_nnz, live;
  int64_t nnz = 0, c_live = 0;

  template <typename T>
  void Run(const T* x, const Conv2DGeometry& g, const ParallelFor& pfor) {
    image_nnz.assign(g.n, 0);
    chan_nnz.assign(g.c_in, 0);
    nnz = CountConvNonzeros<CoreType<T>>(AsCore(x), g, image_nnz.data(),
                                      chan_nnz.data(), pfor);
    live = LiveColumns(chan_nnz.data(), g.c_in);
    c_live = static_cast<int64_t>(live.size());
  }

  // The analysis estimated from a strided sample (ConvSample, `stride` the
  // stride it used): each image's sampled count scaled to its H*W pixels
  // and at least 1 (a sample never makes an image all-zero: the direct
  // kernel skips its zeros itself), every channel live (no compaction).
  void Estimate(const SampledCounts& sc, const Conv2DGeometry& g,
                int64_t stride) {
    const int64_t hw = g.h * g.w, k = hw * g.c_in;
    const double scale = static_cast<double>(hw) /
                         static_cast<double>(std::max<int64_t>(
                             1, ConvSampledPixels(g, stride)));
    image_nnz.resize(g.n);
    nnz = 0;
    for (int64_t n = 0; n < g.n; ++n) {
      const int64_t est = static_cast<int64_t>(
          std::llround(static_cast<double>(sc.row_nnz[n]) * scale));
      image_nnz[n] = std::min<int64_t>(k, std::max<int64_t>(1, est));
      nnz += image_nnz[n];
    }
    chan_nnz.assign(g.c_in, 1);
    live.resize(g.c_in);
    std::iota(live.begin(), live.end(), int64_t{0});
    c_live = g.c_in;
  }
};

// The pixel stride of the sample an all-sparse convolution decides on
// (AnalysisMode::kSampleSparse): about 1/16 of each image's pixels
// (ConvSample moves it to the next stride coprime with W). Measured on
// 32x56x56x64 (one core): 0.10 ms at stride 17 against 1.1-1.4 ms for the
// full count.
constexpr int64_t kSparseSampleStride = 16;

// Whether the call has no work (an empty dimension); then it writes the
// zero output 0 of `out_shape` and the statistics.
template <typename T>
absl::Status FinishIfEmpty(tf::OpKernelContext* ctx, const Conv2DGeometry& g,
                           const tf::TensorShape& out_shape, SplitCall* call,
                           bool* done) {
  *done = g.n == 0 || g.out_h == 0 || g.out_w == 0 || g.c_out == 0 ||
          g.h * g.w * g.c_in == 0;
  if (!*done) return absl::OkStatus();
  tf::Tensor* out = nullptr;
  TF_RETURN_IF_ERROR(ctx->allocate_output(0, out_shape, &out));
  out->flat<T>().setZero();
  call->FinishEmpty(g.n, 0, nullptr);
  return absl::OkStatus();
}

// Whether any plan with sparse images (candidates 0..B of profile p, no
// compaction) passes the agreement rule (ConvSplitAgreed, conv_cost.h).
// split_extra_s: the analysis seconds such a plan pays per call;
// all_sparse_extra_s those of an all-sparse candidate (BucketAllSparse).
bool AnySplitAgreed(const SplitShape& s, const DensityProfile& p,
                    const CostTerms& base, const CostTerms& current,
                    double split_extra_s, double all_sparse_extra_s) {
  for (int j = 0; j <= p.buckets(); ++j)
    if (ConvSplitAgreed(s, p, base, current, j, false,
                        BucketAllSparse(p, j) ? all_sparse_extra_s
                                              : split_extra_s))
      return true;
  return false;
}

// The share of a full count that this op's automatic all-sparse calls pay
// (SplitCall::set_all_sparse_count_share), or -1: with a sparse-kernel
// choice (the forward and the filter gradient) whose direct kernel would
// run `values` values holding `nnz` nonzeros, such calls decide on
// samples (AnalysisMode::kSampleSparse) between periodic full counts.
double AllSparseCountShare(const SparseKernelChoice* choice, double values,
                           double nnz) {
  if (choice == nullptr || !UseDirectKernel(*choice, values, nnz)) return -1.0;
  return SampledAllSparseCountShare(AnalysisPolicy(), kSparseSampleStride);
}

// TfParallelFor with four blocks per pool thread instead of one: the
// convolutions' sparse kernels run for tens of milliseconds, and on a busy
// machine a block that waits for its core would hold up the whole call
// (the pool hands the remaining blocks to whichever thread is free). The
// kernels' results do not depend on the sharding (direct_conv2d.h).
ParallelFor ConvParallelFor(tf::OpKernelContext* ctx) {
  return TfParallelFor(ctx, 4);
}

struct ConvSplit {
  SplitCall call;
  ConvAnalysis an;
  ParallelFor pfor;
  // After Prepare: rows (images) per part, compaction and the channels the
  // dense part multiplies.
  int64_t rd = 0, rs = 0, kc = 0;
  bool compact = false;
  // After Prepare: the call counted a sample or nothing and runs TF's
  // kernel on the op's inputs, every image dense (SplitCall::SkipAnalysis /
  // AcceptSample); then Finish with call.Finish(0, 0).
  bool dense_now = false;

  const std::vector<int64_t>& dense() const { return call.split().dense_rows; }
  const std::vector<int64_t>& sparse() const { return call.split().sparse_rows; }

  ConvSplit(tf::OpKernelContext* ctx, const Conv2DGeometry& g, float threshold,
            int stats_output = 1)
      : call(ctx, stats_output, g.n, g.h * g.w * g.c_in, g.kh * g.kw * g.c_out,
             threshold),
        pfor(ConvParallelFor(ctx)) {
    // oneDNN's first calls of a shape run well above its steady time.
    call.set_dense_one_time_calls(kConvDenseOneTimeCalls);
    // Nor does the sparse path's first full-batch run (conv_cost.h).
    call.set_sparse_one_time_calls(kConvSparseOneTimeCalls);
    // A side is left only on a few of its own runs (conv_cost.h).
    call.set_retime_policy(ConvRetimePolicy());
  }

  // Sets *done when nothing is left to do (an empty problem: output 0 of
  // `out_shape` zeroed and statistics written).
  //
  // Automatic calls first ask how much to count (SplitCall::ChooseAnalysis,
  // cost_model.h): everything; a strided sample of the pixels of every
  // image (ConvSample), accepted when it clearly says all-dense; or
  // nothing, where no plan but the dense kernel could save the policy's
  // minimum gain whatever the zeros. full_stats: the caller wants exact
  // statistics (every value counted).
  //
  // sample_choice (null: never): the op's sparse-kernel choice, whose
  // direct kernel needs no counts (UseDirectKernel on the sample's
  // estimate). Where the sample picks it, an all-sparse
  // plan of an automatic call, and a given threshold of 1 (every image
  // sparse) without full_stats, decide on a sample's estimate
  // (AnalysisMode::kSampleSparse, ConvAnalysis::Estimate) instead of a
  // full count.
  template <typename T, typename Paths>
  absl::Status Prepare(
      tf::OpKernelContext* ctx, const tf::Tensor& x, const Conv2DGeometry& g,
      const tf::TensorShape& out_shape, FamilyOp op, bool dense_allowed,
      Paths& paths, PlanMemory* plans, ConvFamilyCache* families,
      bool full_stats, bool* done,
      const SparseKernelChoice* sample_choice = nullptr) {
    TF_RETURN_IF_ERROR(call.status());
    TF_RETURN_IF_ERROR(FinishIfEmpty<T>(ctx, g, out_shape, &call, done));
    if (*done) return absl::OkStatus();
    FamilyModel& family =
        families->Family(op, tf::DataTypeToEnum<T>::value, g);
    const double values =
        static_cast<double>(g.n) * static_cast<double>(g.h * g.w * g.c_in);
    bool sampled = false;  // `an` is a sample's estimate
    if (dense_allowed) {
      // One lock of the op's PlanMemory: the analysis, with the call a
      // re-time falls due on counted fully, and the back-off it continues
      // (SplitCall::ChooseAnalysis; the calls without a decision count in
      // the re-time schedule, SplitCall::SkipAnalysis / AcceptSample).
      const SplitShape dense_shape = ConvSplitShape(g, g.c_in, true);
      AnalysisPolicy ap;
      ap.sample_all_sparse = sample_choice != nullptr;
      const AnalysisMode mode =
          call.ChooseAnalysis(dense_shape, &family, plans, full_stats, ap);
      if (mode == AnalysisMode::kSampleSparse) {
        sampled = SampleForSparse<T>(x, g, *sample_choice);
      } else if (mode == AnalysisMode::kSkip) {
        call.SkipAnalysis(dense_shape, &family, plans);
      } else if (mode == AnalysisMode::kSample) {
        const int64_t stride = call.SampleStrideFor(
            dense_shape, &family, g.n * g.h * g.w, g.c_in);
        SampledCounts sc;
        const bool sampled =
            stride > 1 &&
            ConvSample<T>(x.flat<T>().data(), g, stride, pfor, &sc) > 1;
        const bool dense =
            sampled && call.AcceptSample(dense_shape, sc, &family, plans);
        if (sampled && !dense && !call.stats_consumed()) {
          // A sample near the break-even whose sparse images the zero-free
          // rule would veto anyway, or (every channel live in the sample:
          // no compaction to find) where no plan with sparse images passes
          // the agreement rule (conv_cost.h) on the sample's estimate: no
          // full count, no decision, TF's kernel; the sample counts as one
          // that said all-dense (SplitCall::AcceptVetoedSample: the
          // back-off goes on).
          const double density_est = sc.nnz_est / std::max(1.0, values);
          const DensityProfile est =
              EstimateProfile(sc.row_nnz.data(), sc.rows, sc.k_counted, g.n,
                              dense_shape.k, kDecisionBuckets);
          const double count_s = family.CountSecondsPerElem() * values;
          call.set_all_sparse_count_share(
              AllSparseCountShare(sample_choice, values, sc.nnz_est));
          const bool vetoed =
              density_est >= kConvZeroFreeDensity
                  ? !ConvSparseRowsAllowed(dense_shape, est,
                                           family.BaseTerms(), family.Terms(),
                                           density_est)
                  : sc.k_live_est >= dense_shape.k &&
                        !AnySplitAgreed(dense_shape, est, family.BaseTerms(),
                                        family.Terms(), count_s,
                                        call.SparsePlanAnalysisSeconds(
                                            count_s, true));
          // Full counts asked for by samples that keep coming out near the
          // break-even are rationed (SplitCall::SampleMayCountFully).
          if (vetoed || !call.SampleMayCountFully(dense_shape, &family, plans))
            call.AcceptVetoedSample(dense_shape, sc, &family, plans);
        }
      }
      if (call.dense_without_count()) {
        dense_now = true;
        rd = g.n;
        rs = 0;
        kc = g.c_in;
        return absl::OkStatus();
      }
    }
    if (!sampled && !call.automatic() && call.threshold_in() >= 1.0f &&
        !full_stats && sample_choice != nullptr) {
      // Every image sparse whatever its counts: the sample only estimates
      // the statistics and picks the kernel.
      sampled = SampleForSparse<T>(x, g, *sample_choice);
    }
    if (sampled) {
      call.MarkSampledCount();
    } else {
      const Clock::time_point count_start = Clock::now();
      an.Run<T>(x.flat<T>().data(), g, pfor);
      if (call.automatic())
        call.CountDone(&family, values, count_start);
    }
    const SplitShape shape = ConvSplitShape(g, an.c_live, dense_allowed);
    if (call.automatic() && dense_allowed && !full_stats)
      call.set_all_sparse_count_share(AllSparseCountShare(
          sample_choice, values, static_cast<double>(an.nnz)));
    TF_RETURN_IF_ERROR(call.Decide<T>(ctx, paths, shape, an.image_nnz.data(),
                                      &family, plans, pfor));
    // The zero-free rule (conv_cost.h): an input without (enough) zeros
    // goes sparse only where calibration found the sparse kernels much
    // faster on the same work.
    // Below it, the agreement rule (conv_cost.h): sparse images only where
    // the calibration's terms and the current ones each predict the plan
    // kConvSplitMinSpeedup faster. A re-time runs as decided where its time
    // could change that
    // (the calibration's terms alone agree; they stay until the family
    // recalibrates): where they do not, no current terms can make the plan
    // agreed, and the re-time would only cost its run (conv2 of cnn-small
    // at batch 32: 4 sparse re-times of +50 us in its first 63 calls).
    if (call.automatic() && dense_allowed && call.rows_sparse() > 0) {
      const double density = static_cast<double>(an.nnz) / values;
      const DensityProfile profile = ProfileFromRowNnz(
          an.image_nnz.data(), g.n, shape.k, kDecisionBuckets);
      const CostTerms base = family.BaseTerms();
      const int bucket = static_cast<int>(
          std::lround(call.threshold() * kDecisionBuckets));
      bool allowed;
      if (density >= kConvZeroFreeDensity) {
        allowed = ConvSparseRowsAllowed(shape, profile, base, family.Terms(),
                                        density);
      } else {
        // Where all-dense calls may count cheaply, a plan with sparse
        // images pays the full count on every call, an all-sparse one on
        // the direct kernel its sampled share (as DecideSplit charges
        // them, DecisionPolicy::analysis_s / all_sparse_analysis_s).
        const double count_s =
            full_stats ? 0.0
                       : call.SparsePlanAnalysisSeconds(
                             family.CountSecondsPerElem() * values,
                             call.rows_dense() == 0);
        allowed = ConvSplitAgreed(shape, profile, base,
                                  call.retimed() ? base : family.Terms(),
                                  bucket, call.compact(), count_s);
      }
      if (!allowed) call.VetoSparseRows();
    }
    rd = call.rows_dense();
    rs = call.rows_sparse();
    compact = call.compact();
    kc = compact ? an.c_live : g.c_in;
    // (A full count the back-off led to that stayed all-dense continued the
    // back-off in Decide / VetoSparseRows: near the break-even such counts
    // cost 2-4% of a dense call that TF's kernel does not pay; at
    // 32x56x56x64 -> 64, 1.5-2 ms a call.)
    return absl::OkStatus();
  }

  // Fills `an` from a sample of every kSparseSampleStride-th pixel of each
  // image (ConvSample) when `choice` picks the direct kernel (which needs
  // no counts) for its estimate; false (nothing changed) when the images
  // are too small to sample or it does not.
  template <typename T>
  bool SampleForSparse(const tf::Tensor& x, const Conv2DGeometry& g,
                       const SparseKernelChoice& choice) {
    SampledCounts sc;
    const int64_t stride =
        ConvSample<T>(x.flat<T>().data(), g, kSparseSampleStride, pfor, &sc);
    if (stride < 2) return false;
    if (!UseDirectKernel(choice, static_cast<double>(g.n) * g.h * g.w * g.c_in,
                         sc.nnz_est))
      return false;
    an.Estimate(sc, g, stride);
    return true;
  }

  // Whether the sparse images run the direct kernel: always on a sample's
  // estimated counts (only exact counts may size the pixel CSR or skip an
  // image as all-zero), else as `choice` picks for the sparse part.
  bool SparseRunsDirect(const SparseKernelChoice& choice,
                        const Conv2DGeometry& g) const {
    return call.sampled_count() ||
           UseDirectKernel(choice, static_cast<double>(rs) * g.h * g.w * g.c_in,
                           call.split().nnz_sparse);
  }

  // The dense part's input: the dense images of x with the kept channels,
  // [rd, H, W, kc], gathered into *xd.
  template <typename T>
  absl::Status GatherDense(tf::OpKernelContext* ctx, const tf::Tensor& x,
                           const Conv2DGeometry& g, tf::Tensor* xd) const {
    TF_RETURN_IF_ERROR(ctx->allocate_temp(
        x.dtype(), tf::TensorShape({rd, g.h, g.w, kc}), xd));
    GatherImagesChannels<CoreType<T>>(AsCore(x.flat<T>().data()), g,
                                   rd == g.n ? nullptr : dense().data(), rd,
                                   compact ? an.live.data() : nullptr, kc,
                                   AsCore(xd->flat<T>().data()), pfor);
    return absl::OkStatus();
  }

  // Records the call: statistics tail and the family's rates.
  void Finish(const Conv2DGeometry& g) {
    const int64_t kc_used = (rd == 0 || compact) ? an.c_live : g.c_in;
    call.Finish(an.nnz, static_cast<double>(g.c_in - kc_used) * g.h * g.w);
  }
};

// The calibration functors (split_runtime.h) of the two convolution ops:
// samples are the first images of x (contiguous NHWC, H*W*C_in values per
// row); the dense path is TF's kernel on them, the sparse path the kernels
// of cc/core/sparse_conv2d.h.
struct ConvSamples {
  const tf::Tensor& x;
  const Conv2DGeometry& g;
  tf::OpKernelContext* ctx;
  const ParallelFor& pfor;

  absl::Status Sample(int64_t rows, tf::Tensor* sample) {
    *sample = x.Slice(0, rows);
    return absl::OkStatus();
  }
  // The geometry of `sample` (its N) and its image list 0..N-1.
  Conv2DGeometry Of(const tf::Tensor& sample, std::vector<int64_t>* imgs) const {
    Conv2DGeometry gs = g;
    gs.n = sample.dim_size(0);
    imgs->resize(gs.n);
    std::iota(imgs->begin(), imgs->end(), int64_t{0});
    return gs;
  }
};

// The family's sparse-kernel choice, calibrated (before the family's cost
// terms, which then time the kernel it picks) on the family's first call
// that may run sparse images. run(direct, xs, gs, imgs, nnz) runs one sparse
// kernel on the images `imgs` of the sample `xs` (geometry `gs`) and returns
// its status.
template <typename T, typename RunKernel>
absl::Status FamilySparseKernelChoice(tf::OpKernelContext* ctx, FamilyOp op,
                                      const tf::Tensor& x,
                                      const Conv2DGeometry& g, float thr_in,
                                      ConvSplit& s, RunKernel run,
                                      ConvFamilyCache* families,
                                      SparseKernelChoice** out) {
  SparseKernelChoice& choice =
      families->Choice(op, tf::DataTypeToEnum<T>::value, g);
  *out = &choice;
  // The choice is read first: once calibrated (every call after the
  // family's first), a call reads no environment variable here.
  if (choice.calibrated() || !HasWork(g) || thr_in == 0.0f ||
      SparseKernelOverride() != 0 || !s.call.status().ok()) {
    return absl::OkStatus();
  }
  return CalibrateSparseChoice<T>(
      ctx, x, g,
      [&](bool direct, const tf::Tensor& xs, const int64_t* nnz) {
        std::vector<int64_t> imgs;
        const Conv2DGeometry gs = ConvSamples{xs, g, ctx, s.pfor}.Of(xs, &imgs);
        return run(direct, xs, gs, imgs, nnz);
      },
      &choice);
}

template <typename T>
struct ConvForwardPaths : ConvSamples {
  const tf::Tensor& f;
  const TfKernel& conv;
  // The op's bias + activation: the dense path is TF's fused kernel when
  // there is a bias and it exists (`fused`), else `conv` then the epilogue;
  // the sparse path is the sparse kernel then the epilogue.
  const BiasActivationEpilogue& epilogue;
  const TfKernel& fused;
  const tf::Tensor* bias;  // null without one

  bool use_fused() const { return bias != nullptr && fused.ok(); }

  // act(conv2d(x, f) + bias) of TF's kernels on the op's own inputs, as
  // output 0. Without a fused kernel, TF's Conv2D runs on the op's context
  // (TfKernel::RunOnContext: x and f are inputs 0 and 1 of both ops) and
  // the epilogue on its output in place. TF's fused kernel reads its bias as
  // input 2, which is this op's threshold (the bias is input 3): it runs on
  // a sub-context.
  absl::Status DenseOnInputs() const {
    if (use_fused()) {
      tf::Tensor result;
      TF_RETURN_IF_ERROR(fused.Run(ctx, {&x, &f, bias}, &result));
      ctx->set_output(0, result);
      return absl::OkStatus();
    }
    TF_RETURN_IF_ERROR(conv.RunOnContext(ctx));
    tf::Tensor* out = ctx->mutable_output(0);
    if (epilogue.active() && out->NumElements() > 0) {
      epilogue.ApplyRows<T>(ctx, out->flat<T>().data(),
                            out->NumElements() / g.c_out, g.c_out, pfor);
    }
    return absl::OkStatus();
  }

  // act(conv2d(xin, fin) + bias) of TF's kernels into *result.
  absl::Status Dense(const tf::Tensor& xin, const tf::Tensor& fin,
                     tf::Tensor* result) const {
    if (use_fused()) return fused.Run(ctx, {&xin, &fin, bias}, result);
    TF_RETURN_IF_ERROR(conv.Run(ctx, {&xin, &fin}, result));
    if (epilogue.active() && result->NumElements() > 0) {
      epilogue.ApplyRows<T>(ctx, result->flat<T>().data(),
                            result->NumElements() / g.c_out, g.c_out, pfor);
    }
    return absl::OkStatus();
  }

  const SparseKernelChoice* choice;  // null: the pixel-CSR kernel
  // The kernel of the first sample, kept for the whole calibration (one
  // kernel's timings per fit).
  int kernel = -1;

  absl::Status RunDense(const tf::Tensor& sample) {
    tf::Tensor result;
    return Dense(sample, f, &result);
  }
  absl::Status RunSparse(const tf::Tensor& sample, const int64_t* image_nnz) {
    std::vector<int64_t> imgs;
    const Conv2DGeometry gs = Of(sample, &imgs);
    tf::Tensor y;
    TF_RETURN_IF_ERROR(CalibrationOutput<T>(
        ctx, gs.n * g.out_h * g.out_w * g.c_out, &y));
    const double nnz = std::accumulate(image_nnz, image_nnz + gs.n, 0.0);
    if (kernel < 0)
      kernel = choice && UseDirectKernel(*choice, static_cast<double>(gs.n) *
                                                      g.h * g.w * g.c_in, nnz);
    const bool direct = kernel == 1;
    Sparse(direct, sample.flat<T>().data(), gs, imgs.data(), gs.n, image_nnz,
           y.flat<T>().data());
    return absl::OkStatus();
  }

  // The sparse part on images imgs[0..n) of xin (geometry gs; image_nnz
  // indexed like x's images): act(conv + bias) written to those images of
  // y. In the 16-bit dtypes the kernel runs in float32 (SparseForwardLow);
  // where the dense part is TF's fused kernel (one rounding after the bias
  // and activation) the epilogue runs in float32 before the one rounding,
  // else in T after it, as the dense part's Conv2D + epilogue rounds.
  void Sparse(bool direct, const T* xin, const Conv2DGeometry& gs,
              const int64_t* imgs, int64_t n, const int64_t* image_nnz,
              T* y) const {
    const int64_t pixels = g.out_h * g.out_w;
    if constexpr (kLowPrecision<T>) {
      const bool in_float = use_fused();
      std::vector<float> bias_f;
      if (in_float) {
        bias_f.resize(g.c_out);
        WidenToFloat(AsCore(bias->flat<T>().data()), bias_f.data(), g.c_out);
      }
      SparseForwardLow<T>(direct, xin, gs, imgs, n, image_nnz,
                          f.flat<T>().data(), y,
                          in_float ? bias_f.data() : nullptr,
                          in_float ? epilogue.activation() : Activation::kNone,
                          epilogue.nan_to_zero(), pfor);
      if (!in_float)
        epilogue.ApplyImages<T>(ctx, y, imgs, n, pixels, g.c_out, pfor);
    } else if (direct) {
      // The direct kernel applies act(y + bias) to each output row as it
      // completes it (no second pass over the images).
      DirectConvEpilogue<T> ep;
      ep.bias = epilogue.BiasPtr<T>(ctx);
      ep.act = epilogue.activation();
      ep.nan_to_zero = epilogue.nan_to_zero();
      SparseForwardBy<T>(true, xin, gs, imgs, n, image_nnz,
                         f.flat<T>().data(), y, pfor, ep);
    } else {
      SparseForwardBy<T>(false, xin, gs, imgs, n, image_nnz,
                         f.flat<T>().data(), y, pfor);
      epilogue.ApplyImages<T>(ctx, y, imgs, n, pixels, g.c_out, pfor);
    }
  }
};

template <typename T>
struct ConvFilterGradPaths : ConvSamples {
  const tf::Tensor& dy;
  const TfKernel& backprop_filter;
  const SparseKernelChoice* choice;  // null: the pixel-CSR kernels
  // The kernel of the first sample, kept for the whole calibration (one
  // kernel's timings per fit).
  int kernel = -1;
  // The fused filter + bias gradient the dense part runs instead of
  // backprop_filter (SparseSplitConv2DBackpropFilterWithBias); null: none.
  const TfKernel* with_bias = nullptr;

  absl::Status RunDense(const tf::Tensor& sample) {
    const tf::Tensor dys = dy.Slice(0, sample.dim_size(0));
    const tf::Tensor sizes = FilterSizes(g, g.c_in);
    tf::Tensor result, db;
    if (with_bias)
      return with_bias->RunOutputs(ctx, {&sample, &sizes, &dys},
                                   {&result, &db});
    return backprop_filter.Run(ctx, {&sample, &sizes, &dys}, &result);
  }
  absl::Status RunSparse(const tf::Tensor& sample, const int64_t* image_nnz) {
    std::vector<int64_t> imgs;
    const Conv2DGeometry gs = Of(sample, &imgs);
    std::vector<T> df(g.kh * g.kw * g.c_in * g.c_out, T(0));
    const double nnz = std::accumulate(image_nnz, image_nnz + gs.n, 0.0);
    if (kernel < 0)
      kernel = choice && UseDirectKernel(*choice, static_cast<double>(gs.n) *
                                                      g.h * g.w * g.c_in, nnz);
    const bool direct = kernel == 1;
    SparseFilterGradAny<T>(direct, sample.flat<T>().data(), gs, imgs.data(),
                           gs.n, image_nnz, dy.flat<T>().data(), df.data(),
                           pfor);
    return absl::OkStatus();
  }
};


// ---- Input gradient (SparseSplitConv2DBackpropInput) ----------------------
// At stride 1, dX = conv2d(dY, rot(F)) with rot(F)[a, b, o, i] =
// F[KH-1-a, KW-1-b, i, o] and leading paddings (KH-1)*d - pad_top,
// (KW-1)*d - pad_left. The op splits the images of dY: dense ones through
// TF's Conv2DBackpropInput on F itself, sparse ones through the forward
// sparse kernels on rot(F), which is built here (RotateFilter) only when a
// sparse part runs.

// out [KH, KW, C_out, C_in] = F [KH, KW, C_in, C_out] rotated 180 degrees in
// space with its channel dimensions swapped: per tap, a transpose of the
// C_in x C_out matrix in 32 x 32 tiles, parallel over (tap, tile row).
template <typename V>
void RotateFilter(const V* f, int64_t kh, int64_t kw, int64_t ci, int64_t co,
                  V* out, const ParallelFor& pfor) {
  constexpr int64_t kTile = 32;
  const int64_t taps = kh * kw;
  const int64_t oblocks = (co + kTile - 1) / kTile;
  if (taps == 0 || ci == 0 || co == 0) return;
  pfor(taps * oblocks, kTile * ci * 2, [&](int64_t b, int64_t e) {
    for (int64_t u = b; u < e; ++u) {
      const int64_t t = u / oblocks;
      const int64_t o0 = (u % oblocks) * kTile;
      const int64_t o1 = std::min(co, o0 + kTile);
      const V* src = f + t * ci * co;
      V* dst = out + (taps - 1 - t) * co * ci;  // (KH-1-a, KW-1-b)
      for (int64_t i0 = 0; i0 < ci; i0 += kTile) {
        const int64_t i1 = std::min(ci, i0 + kTile);
        for (int64_t o = o0; o < o1; ++o)
          for (int64_t i = i0; i < i1; ++i) dst[o * ci + i] = src[i * co + o];
      }
    }
  });
}

// out [KH, KW, C_in, n_chans] = F[:, :, :, chans[j]] (the dense part's
// filter once all-zero channels of dY are compacted away).
template <typename V>
void GatherFilterOutChannels(const V* f, int64_t rows, int64_t co,
                             const int64_t* chans, int64_t n_chans, V* out,
                             const ParallelFor& pfor) {
  pfor(rows, n_chans + 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      for (int64_t j = 0; j < n_chans; ++j)
        out[r * n_chans + j] = f[r * co + chans[j]];
  });
}

// The input_sizes tensor [n, H, W, C_in] of TF's Conv2DBackpropInput.
tf::Tensor InputSizes(int64_t n, int64_t h, int64_t w, int64_t c) {
  tf::Tensor t(tf::DT_INT32, tf::TensorShape({4}));
  auto v = t.vec<tf::int32>();
  v(0) = static_cast<tf::int32>(n);
  v(1) = static_cast<tf::int32>(h);
  v(2) = static_cast<tf::int32>(w);
  v(3) = static_cast<tf::int32>(c);
  return t;
}

// The transposed (forward) geometry of the input gradient of the stride-1
// convolution g: input dY [N, OH, OW, C_out], filter rot(F) [KH, KW, C_out,
// C_in], output dX [N, H, W, C_in]. False where g's paddings exceed the
// dilated filter's extent (the leading or trailing padding of the
// transposed convolution would be negative).
bool TransposedGeometry(const Conv2DGeometry& g, Conv2DGeometry* t) {
  const int64_t ek_h = (g.kh - 1) * g.dil_h, ek_w = (g.kw - 1) * g.dil_w;
  // Trailing paddings of g (stride 1): OH = H + top + bottom - ek_h.
  const int64_t pad_bottom = g.out_h + ek_h - g.h - g.pad_top;
  const int64_t pad_right = g.out_w + ek_w - g.w - g.pad_left;
  if (g.pad_top > ek_h || pad_bottom > ek_h || g.pad_left > ek_w ||
      pad_right > ek_w || g.pad_top < 0 || pad_bottom < 0 || g.pad_left < 0 ||
      pad_right < 0)
    return false;
  *t = Conv2DGeometry{};
  t->n = g.n;
  t->h = g.out_h;
  t->w = g.out_w;
  t->c_in = g.c_out;
  t->kh = g.kh;
  t->kw = g.kw;
  t->c_out = g.c_in;
  t->stride_h = t->stride_w = 1;
  t->dil_h = g.dil_h;
  t->dil_w = g.dil_w;
  t->pad_top = ek_h - g.pad_top;
  t->pad_left = ek_w - g.pad_left;
  t->out_h = g.h;
  t->out_w = g.w;
  return true;
}

// The rotated filter of one input-gradient call, built on first use.
template <typename T>
struct LazyRotatedFilter {
  const tf::Tensor& f;  // [KH, KW, C_in, C_out]
  tf::OpKernelContext* ctx;
  const ParallelFor& pfor;
  tf::Tensor rotated;
  bool built = false;

  // rot(F) [KH, KW, C_out, C_in] (built now if not yet).
  absl::Status Get(const T** out) {
    if (!built) {
      TF_RETURN_IF_ERROR(Build(&rotated));
      built = true;
    }
    *out = rotated.flat<T>().data();
    return absl::OkStatus();
  }
  // A fresh rotation into *t (the calibration times one per sparse run: a
  // call's sparse part pays it once).
  absl::Status Build(tf::Tensor* t) const {
    const int64_t kh = f.dim_size(0), kw = f.dim_size(1);
    const int64_t ci = f.dim_size(2), co = f.dim_size(3);
    TF_RETURN_IF_ERROR(
        ctx->allocate_temp(f.dtype(), tf::TensorShape({kh, kw, co, ci}), t));
    RotateFilter<CoreType<T>>(AsCore(f.flat<T>().data()), kh, kw, ci, co,
                              AsCore(t->flat<T>().data()), pfor);
    return absl::OkStatus();
  }
};

// The calibration functor of the input gradient: rows are images of dY
// (ConvSamples over the transposed geometry); the dense path is TF's
// Conv2DBackpropInput on F, the sparse path the rotation plus the forward
// sparse kernel.
template <typename T>
struct ConvInputGradPaths : ConvSamples {
  const tf::Tensor& f;  // the original filter
  const TfKernel& backprop_input;
  LazyRotatedFilter<T>& rot;
  const SparseKernelChoice* choice;
  int kernel = -1;  // the first sample's kernel, kept for the calibration

  // dX of the dY images `dyin` ([n, OH, OW, kc]) and filter `fin` ([KH, KW,
  // C_in, kc]) by TF's kernel.
  absl::Status Dense(const tf::Tensor& dyin, const tf::Tensor& fin,
                     tf::Tensor* result) const {
    const tf::Tensor sizes =
        InputSizes(dyin.dim_size(0), g.out_h, g.out_w, g.c_out);
    return backprop_input.Run(ctx, {&sizes, &fin, &dyin}, result);
  }
  absl::Status RunDense(const tf::Tensor& sample) {
    tf::Tensor result;
    return Dense(sample, f, &result);
  }
  absl::Status RunSparse(const tf::Tensor& sample, const int64_t* image_nnz) {
    std::vector<int64_t> imgs;
    const Conv2DGeometry gs = Of(sample, &imgs);
    tf::Tensor r;
    TF_RETURN_IF_ERROR(rot.Build(&r));
    tf::Tensor y;
    TF_RETURN_IF_ERROR(CalibrationOutput<T>(
        ctx, gs.n * g.out_h * g.out_w * g.c_out, &y));
    const double nnz = std::accumulate(image_nnz, image_nnz + gs.n, 0.0);
    if (kernel < 0)
      kernel = choice && UseDirectKernel(*choice, static_cast<double>(gs.n) *
                                                      g.h * g.w * g.c_in, nnz);
    SparseForwardAny<T>(kernel == 1, sample.flat<T>().data(), gs, imgs.data(),
                        gs.n, image_nnz, r.flat<T>().data(),
                        y.flat<T>().data(), pfor);
    return absl::OkStatus();
  }
};

}  // namespace

// The dense part of a split convolution call over geometry `g` (the
// convolution whose input `in` is split by `s`): with every image dense and
// nothing compacted, `all_dense()` runs TF's kernel on the op's own
// inputs into output 0; otherwise the dense images of `in` are gathered,
// the filter `f` restricted to the live channels by `compact_filter(&fc)`
// where `s` compacts, and `paths.Dense` runs TF's kernel on them. The result is
// output 0 when every image is dense; else `*out` is allocated (shape
// `out_shape`, for the sparse part to fill) and the dense images are
// scattered into it. `*out` stays null when every image is dense.
template <typename T, typename Paths, typename AllDense, typename CompactFilter>
absl::Status RunDensePart(tf::OpKernelContext* ctx, ConvSplit& s,
                          const Conv2DGeometry& g, const tf::Tensor& in,
                          const tf::Tensor& f, const tf::TensorShape& out_shape,
                          Paths& paths, AllDense all_dense,
                          CompactFilter compact_filter, tf::Tensor** out) {
  *out = nullptr;
  const int64_t rd = s.rd;
  if (rd < g.n) TF_RETURN_IF_ERROR(ctx->allocate_output(0, out_shape, out));
  if (rd == 0) return absl::OkStatus();
  if (rd == g.n && !s.compact) return all_dense();
  tf::Tensor result;
  {
    tf::Tensor ind, fc;
    TF_RETURN_IF_ERROR(s.GatherDense<T>(ctx, in, g, &ind));
    const tf::Tensor* fin = &f;
    if (s.compact) {
      TF_RETURN_IF_ERROR(compact_filter(&fc));
      fin = &fc;
    }
    TF_RETURN_IF_ERROR(paths.Dense(ind, *fin, &result));
  }
  if (rd == g.n) {
    ctx->set_output(0, result);
  } else {
    ScatterImages<CoreType<T>>(AsCore(result.flat<T>().data()), g,
                               s.dense().data(), rd,
                               AsCore((*out)->flat<T>().data()), s.pfor);
  }
  return absl::OkStatus();
}

template <typename T>
class SparseSplitConv2DOp : public tf::OpKernel {
 public:
  explicit SparseSplitConv2DOp(tf::OpKernelConstruction* ctx)
      : OpKernel(ctx), epilogue_("SparseSplitConv2D") {
    OP_REQUIRES_OK(ctx, attrs_.Init(ctx, "SparseSplitConv2D"));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("full_stats", &full_stats_));
    OP_REQUIRES_OK(ctx, epilogue_.Init(ctx));  // optional bias + activation
    OP_REQUIRES_OK(ctx, InitDenseKernel(ctx, tf::DataTypeToEnum<T>::value,
                                        "Conv2D", 2, attrs_, &conv_));
    // Without a fused kernel (float64, or where TF cannot create one for the
    // dtype) the dense part is Conv2D + epilogue.
    if (epilogue_.has_bias()) {
      bool onednn = false;
      InitFusedKernel(ctx, tf::DataTypeToEnum<T>::value, attrs_,
                      epilogue_.activation(), &fused_, &onednn)
          .IgnoreError();
      // oneDNN's relu/relu6 post-op maps NaN to 0: the sparse images' epilogue
      // does the same, so the answer never depends on the threshold.
      epilogue_.set_nan_to_zero(fused_.ok() && onednn);
    }
  }

  void Compute(tf::OpKernelContext* ctx) override {
    static constexpr const char* kOp = "SparseSplitConv2D";
    const tf::Tensor& x = ctx->input(0);
    const tf::Tensor& f = ctx->input(1);
    OP_REQUIRES_OK(ctx, CheckInput(x, kOp));
    OP_REQUIRES(ctx, f.dims() == 4,
                tf::errors::InvalidArgument(
                    kOp, ": filter must be rank 4 [KH, KW, C_in, C_out] "
                    "(HWIO), got shape ", f.shape().DebugString()));
    float thr_in;
    OP_REQUIRES_OK(ctx, CheckThreshold(ctx->input(2), kOp, &thr_in));
    Conv2DGeometry g;
    OP_REQUIRES_OK(ctx, attrs_.Geometry(x.shape(), f.shape(), &g, kOp));
    OP_REQUIRES_OK(ctx, epilogue_.Validate(ctx, g.c_out, "C_out",
                                           "output channels of the filter"));
    const tf::Tensor* bias =
        epilogue_.has_bias() ? &ctx->input(BiasActivationEpilogue::kBiasInput)
                             : nullptr;

    const tf::TensorShape out_shape({g.n, g.out_h, g.out_w, g.c_out});
    const int64_t pixels = g.out_h * g.out_w;  // output rows per image
    ConvSplit s(ctx, g, thr_in);
    SparseKernelChoice* choice = nullptr;
    OP_REQUIRES_OK(ctx, FamilySparseKernelChoice<T>(
        ctx, kFamilyConv2DForward, x, g, thr_in, s,
        [&](bool direct, const tf::Tensor& xs, const Conv2DGeometry& gs,
            const std::vector<int64_t>& imgs, const int64_t* nnz) {
          tf::Tensor y;
          TF_RETURN_IF_ERROR(CalibrationOutput<T>(
              ctx, gs.n * g.out_h * g.out_w * g.c_out, &y));
          SparseForwardAny<T>(direct, xs.flat<T>().data(), gs, imgs.data(),
                              gs.n, nnz, f.flat<T>().data(),
                              y.flat<T>().data(), s.pfor);
          return absl::OkStatus();
        },
        &families_, &choice));
    ConvForwardPaths<T> paths{{x, g, ctx, s.pfor}, f, conv_, epilogue_, fused_,
                              bias, choice};
    bool done = false;
    // The direct kernel tests every value itself: an all-sparse plan that
    // runs it may decide on a sample's estimate.
    OP_REQUIRES_OK(ctx, s.Prepare<T>(ctx, x, g, out_shape, kFamilyConv2DForward,
                                     true, paths, &plans_, &families_,
                                     full_stats_, &done, choice));
    if (!done && s.dense_now) {
      // Counted a sample or nothing: exactly TF's (fused) convolution.
      OP_REQUIRES_OK(ctx, paths.DenseOnInputs());
      s.call.DenseDone();
      s.call.SparseDone();
      s.call.Finish(0, 0);
      return;
    }
    if (done) {
      // No input values (C_in = 0) but output pixels: act(0 + bias).
      tf::Tensor* out = ctx->mutable_output(0);
      if (out != nullptr && out->NumElements() > 0)
        epilogue_.ApplyRows<T>(ctx, out->flat<T>().data(), g.n * pixels,
                               g.c_out, s.pfor);
      return;
    }
    const T* xp = x.flat<T>().data();
    const T* fp = f.flat<T>().data();
    const int64_t rs = s.rs, kc = s.kc;

    // --- Dense part: act(conv + bias) of TF's kernels, finished images. ----
    tf::Tensor* out = nullptr;
    OP_REQUIRES_OK(
        ctx, RunDensePart<T>(
                 ctx, s, g, x, f, out_shape, paths,
                 // All dense: exactly TF's (fused) convolution on the inputs.
                 [&]() { return paths.DenseOnInputs(); },
                 [&](tf::Tensor* fc) {
                   TF_RETURN_IF_ERROR(ctx->allocate_temp(
                       x.dtype(), tf::TensorShape({g.kh, g.kw, kc, g.c_out}),
                       fc));
                   GatherFilterChannels<CoreType<T>>(
                       AsCore(fp), g, s.an.live.data(), kc,
                       AsCore(fc->flat<T>().data()));
                   return absl::OkStatus();
                 },
                 &out));
    s.call.DenseDone();

    // --- Sparse part, then the epilogue on its images. ----------------------
    if (rs > 0) {
      const bool direct = s.SparseRunsDirect(*choice, g);
      paths.Sparse(direct, xp, g, s.sparse().data(), rs, s.an.image_nnz.data(),
                   out->flat<T>().data());
    }
    s.call.SparseDone();
    s.Finish(g);
  }

 private:
  ConvAttrs attrs_;
  BiasActivationEpilogue epilogue_;
  TfKernel conv_;
  TfKernel fused_;  // TF's fused conv + bias [+ relu]; !ok(): conv_ + epilogue
  bool full_stats_ = true;
  PlanMemory plans_;  // this op's last plan (hysteresis)
  ConvFamilyCache families_;  // the family of the last call's geometry
};

template <typename T>
class SparseSplitConv2DBackpropFilterOp : public tf::OpKernel {
 public:
  explicit SparseSplitConv2DBackpropFilterOp(tf::OpKernelConstruction* ctx)
      : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, attrs_.Init(ctx, "SparseSplitConv2DBackpropFilter"));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("full_stats", &full_stats_));
    dense_ok_ = InitGradientDenseKernel(ctx, tf::DataTypeToEnum<T>::value,
                                        "Conv2DBackpropFilter", attrs_, &bf_,
                                        &bf_onednn_);
    // SparseSplitConv2DBackpropFilterWithBias: outputs dF, db, stats.
    with_bias_ = ctx->num_outputs() == 3;
    if (with_bias_ && dense_ok_ && BiasGradOverride() == 1)
      bias_fused_ = InitFilterGradWithBiasKernel(
          ctx, tf::DataTypeToEnum<T>::value, attrs_, &bfb_);
  }

  void Compute(tf::OpKernelContext* ctx) override {
    const char* kOp = with_bias_ ? "SparseSplitConv2DBackpropFilterWithBias"
                                 : "SparseSplitConv2DBackpropFilter";
    const tf::Tensor& x = ctx->input(0);
    const tf::Tensor& sizes = ctx->input(1);
    const tf::Tensor& dy = ctx->input(2);
    OP_REQUIRES_OK(ctx, CheckInput(x, kOp));
    tf::TensorShape fshape;
    OP_REQUIRES_OK(ctx, ReadSizes4(sizes, kOp, "filter_sizes",
                                   "[KH, KW, C_in, C_out]", &fshape));
    float thr_in;
    OP_REQUIRES_OK(ctx, CheckThreshold(ctx->input(3), kOp, &thr_in));
    Conv2DGeometry g;
    OP_REQUIRES_OK(ctx, attrs_.Geometry(x.shape(), fshape, &g, kOp));
    const tf::TensorShape dy_expected({g.n, g.out_h, g.out_w, g.c_out});
    OP_REQUIRES(ctx, dy.shape() == dy_expected,
                tf::errors::InvalidArgument(
                    kOp, ": out_backprop has shape ", dy.shape().DebugString(),
                    " but input ", x.shape().DebugString(), " and filter ",
                    fshape.DebugString(), " give ",
                    dy_expected.DebugString()));

    ConvSplit s(ctx, g, thr_in, with_bias_ ? 2 : 1);
    // Bias gradient (with_bias_): the images whose dY the vectorised pass
    // sums (ConvBiasGrad) into db_acc -- every image where the dense part
    // is not the fused kernel, else the sparse ones -- and the dense part's
    // db from the fused kernel.
    using Acc = typename Accum<CoreType<T>>::type;
    std::vector<Acc> db_acc;
    tf::Tensor db_dense;  // set by the fused kernel (a default Tensor counts
                          // as initialized: test has_db_dense)
    bool has_db_dense = false;
    auto sum_bias = [&](const int64_t* imgs, int64_t n) {
      if (db_acc.empty()) db_acc.assign(g.c_out, Acc(0));
      ConvBiasGrad<CoreType<T>>(AsCore(dy.flat<T>().data()), g, imgs, n,
                                db_acc.data(), s.pfor);
    };
    // Writes output 1 = db_dense (if any) + db_acc.
    auto write_bias = [&]() -> absl::Status {
      if (db_acc.empty() && has_db_dense) {
        ctx->set_output(1, db_dense);
        return absl::OkStatus();
      }
      db_acc.resize(g.c_out, Acc(0));
      if (has_db_dense) {
        const T* d = db_dense.flat<T>().data();
        for (int64_t j = 0; j < g.c_out; ++j)
          db_acc[j] += ToFloat(AsCore(d)[j]);
      }
      tf::Tensor* db = nullptr;
      TF_RETURN_IF_ERROR(
          ctx->allocate_output(1, tf::TensorShape({g.c_out}), &db));
      CoreType<T>* o = AsCore(db->flat<T>().data());
      if constexpr (kLowPrecision<T>) {
        NarrowFromFloat(db_acc.data(), o, g.c_out);
      } else {
        for (int64_t j = 0; j < g.c_out; ++j) o[j] = db_acc[j];
      }
      return absl::OkStatus();
    };
    // The dense part's filter gradient (and, fused, its db) of xin, dyin.
    auto run_dense = [&](const tf::Tensor& xin, const tf::Tensor& sizes_t,
                         const tf::Tensor& dyin, tf::Tensor* result) {
      if (bias_fused_) {
        has_db_dense = true;
        return bfb_.RunOutputs(ctx, {&xin, &sizes_t, &dyin},
                               {result, &db_dense});
      }
      return bf_.Run(ctx, {&xin, &sizes_t, &dyin}, result);
    };
    SparseKernelChoice* choice = nullptr;
    OP_REQUIRES_OK(ctx, FamilySparseKernelChoice<T>(
        ctx, kFamilyConv2DFilterGrad, x, g, thr_in, s,
        [&](bool direct, const tf::Tensor& xs, const Conv2DGeometry& gs,
            const std::vector<int64_t>& imgs, const int64_t* nnz) {
          std::vector<T> df(g.kh * g.kw * g.c_in * g.c_out, T(0));
          SparseFilterGradAny<T>(direct, xs.flat<T>().data(), gs, imgs.data(),
                                 gs.n, nnz, dy.flat<T>().data(), df.data(),
                                 s.pfor);
          return absl::OkStatus();
        },
        &families_, &choice));
    ConvFilterGradPaths<T> paths{{x, g, ctx, s.pfor}, dy, bf_, choice};
    if (bias_fused_) paths.with_bias = &bfb_;
    bool done = false;
    // As the forward: the direct kernel needs no counts.
    OP_REQUIRES_OK(ctx, s.Prepare<T>(ctx, x, g, fshape, kFamilyConv2DFilterGrad,
                                     dense_ok_, paths, &plans_, &families_,
                                     full_stats_, &done, choice));
    if (done) {
      // No filter gradient to compute (an empty dimension); dY may still
      // have values (e.g. C_in = 0).
      if (with_bias_) {
        sum_bias(nullptr, g.n);
        OP_REQUIRES_OK(ctx, write_bias());
      }
      return;
    }
    if (s.dense_now) {
      // Counted a sample or nothing: exactly TF's (fused) filter gradient.
      OP_REQUIRES_OK(ctx, RunDenseOnInputs(ctx, run_dense));
      if (with_bias_) {
        if (!bias_fused_) sum_bias(nullptr, g.n);
        OP_REQUIRES_OK(ctx, write_bias());
      }
      s.call.DenseDone();
      s.call.SparseDone();
      s.call.Finish(0, 0);
      return;
    }
    const T* xp = x.flat<T>().data();
    const int64_t rd = s.rd, rs = s.rs, kc = s.kc;

    // --- Dense part: TF's filter gradient over the dense images. ------------
    tf::Tensor* out = nullptr;
    const bool sparse_adds = rs > 0 && s.call.split().nnz_sparse > 0;
    tf::Tensor result;  // the dense part's [KH, KW, kc, C_out]
    bool on_inputs = false;  // output 0 set by TF's kernel on the inputs
    if (rd > 0) {
      if (rd == g.n && !s.compact) {
        // rs == 0: the output is TF's filter gradient of the op's inputs.
        OP_REQUIRES_OK(ctx, RunDenseOnInputs(ctx, run_dense));
        on_inputs = true;
      } else {
        const tf::Tensor sizes_t = FilterSizes(g, kc);
        tf::Tensor xd, dyd;
        OP_REQUIRES_OK(ctx, s.GatherDense<T>(ctx, x, g, &xd));
        const tf::Tensor* dyin = &dy;
        if (rd < g.n) {
          Conv2DGeometry gy;
          gy.n = g.n;
          gy.h = g.out_h;
          gy.w = g.out_w;
          gy.c_in = g.c_out;
          OP_REQUIRES_OK(ctx, ctx->allocate_temp(
                                  x.dtype(), tf::TensorShape({rd, g.out_h, g.out_w,
                                                       g.c_out}),
                                  &dyd));
          GatherImagesChannels<CoreType<T>>(AsCore(dy.flat<T>().data()), gy,
                                         s.dense().data(), rd, nullptr, g.c_out,
                                         AsCore(dyd.flat<T>().data()), s.pfor);
          dyin = &dyd;
        }
        OP_REQUIRES_OK(ctx, run_dense(xd, sizes_t, *dyin, &result));
      }
    }
    // The bias gradient of the images the dense part did not sum: all of
    // them without the fused kernel (or without a dense part), else the
    // sparse images. Summed here, timed with the dense part.
    if (with_bias_) {
      if (!bias_fused_ || rd == 0) {
        sum_bias(nullptr, g.n);
      } else if (rs > 0) {
        sum_bias(s.sparse().data(), rs);
      }
    }
    if constexpr (kLowPrecision<T>) {
      if (sparse_adds) {
        // 16-bit dtypes: the dense part's sum (rounded by TF's kernel) and
        // the sparse images' float32 sum are added in float32 and rounded
        // once into the output.
        const int64_t fsize = fshape.num_elements();
        std::vector<float> df(fsize, 0.0f);
        if (rd > 0) {
          if (s.compact) {
            std::vector<float> part(result.NumElements());
            WidenToFloat(AsCore(result.flat<T>().data()), part.data(),
                         result.NumElements());
            ScatterFilterChannels<float>(part.data(), g, s.an.live.data(), kc,
                                         df.data(), true);
          } else {
            WidenToFloat(AsCore(result.flat<T>().data()), df.data(), fsize);
          }
        }
        s.call.DenseDone();
        const bool direct = s.SparseRunsDirect(*choice, g);
        SparseFilterGradLow<T>(direct, xp, g, s.sparse().data(), rs,
                               s.an.image_nnz.data(), dy.flat<T>().data(),
                               df.data(), s.pfor);
        OP_REQUIRES_OK(ctx, ctx->allocate_output(0, fshape, &out));
        NarrowFromFloat(df.data(), AsCore(out->flat<T>().data()), fsize);
        if (with_bias_) OP_REQUIRES_OK(ctx, write_bias());
        s.call.SparseDone();
        s.Finish(g);
        return;
      }
    }
    if (on_inputs) {
      // Output 0 set above.
    } else if (rd > 0) {
      if (!s.compact && rs == 0) {
        ctx->set_output(0, result);
      } else if (!s.compact) {
        // The dense part becomes the output buffer the sparse part adds to.
        OP_REQUIRES_OK(ctx, ctx->allocate_output(0, fshape, &out));
        std::copy_n(result.flat<T>().data(), fshape.num_elements(),
                    out->flat<T>().data());
      } else {
        OP_REQUIRES_OK(ctx, ctx->allocate_output(0, fshape, &out));
        out->flat<T>().setZero();
        ScatterFilterChannels<CoreType<T>>(AsCore(result.flat<T>().data()), g,
                                        s.an.live.data(), kc,
                                        AsCore(out->flat<T>().data()), true);
      }
    } else {
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, fshape, &out));
      out->flat<T>().setZero();
    }
    s.call.DenseDone();

    // --- Sparse part: adds the sparse images' contribution. -----------------
    if (sparse_adds) {
      const bool direct = s.SparseRunsDirect(*choice, g);
      SparseFilterGradAny<T>(direct, xp, g, s.sparse().data(), rs,
                             s.an.image_nnz.data(), dy.flat<T>().data(),
                             out->flat<T>().data(), s.pfor);
    }
    if (with_bias_) OP_REQUIRES_OK(ctx, write_bias());
    s.call.SparseDone();
    s.Finish(g);
  }

 private:
  // TF's filter gradient of the op's own inputs as output 0: on this op's
  // context (TfKernel::RunOnContext; input, filter_sizes, out_backprop are
  // inputs 0..2 of both ops) unless the dense part is the fused filter +
  // bias gradient, whose bias output goes through write_bias (run_dense on
  // a sub-context).
  template <typename RunDense>
  absl::Status RunDenseOnInputs(tf::OpKernelContext* ctx,
                                RunDense& run_dense) const {
    if (!bias_fused_) return bf_.RunOnContext(ctx);
    const tf::Tensor& x = ctx->input(0);
    const tf::Tensor& dy = ctx->input(2);
    tf::Tensor result;
    TF_RETURN_IF_ERROR(run_dense(x, ctx->input(1), dy, &result));
    ctx->set_output(0, result);
    return absl::OkStatus();
  }

  ConvAttrs attrs_;
  TfKernel bf_;
  TfKernel bfb_;  // oneDNN's fused filter + bias gradient (bias_fused_)
  bool bf_onednn_ = false, dense_ok_ = true;
  bool with_bias_ = false, bias_fused_ = false;
  bool full_stats_ = true;
  PlanMemory plans_;  // this op's last plan (hysteresis)
  ConvFamilyCache families_;  // the family of the last call's geometry
};

// dX of a stride-1 convolution (SparseSplitConv2DBackpropInput; see the
// "Input gradient" block above): the images of dY are split like a forward
// SparseSplitConv2D of dY (statistics, cost-model family
// kFamilyConv2DInputGrad keyed by the transposed geometry), the dense ones
// run TF's Conv2DBackpropInput on the original filter, the sparse ones the
// forward sparse kernels on the rotated filter.
template <typename T>
class SparseSplitConv2DBackpropInputOp : public tf::OpKernel {
 public:
  explicit SparseSplitConv2DBackpropInputOp(tf::OpKernelConstruction* ctx)
      : OpKernel(ctx) {
    static constexpr const char* kOp = "SparseSplitConv2DBackpropInput";
    OP_REQUIRES_OK(ctx, attrs_.Init(ctx, kOp));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("full_stats", &full_stats_));
    OP_REQUIRES(ctx, attrs_.strides[1] == 1 && attrs_.strides[2] == 1,
                tf::errors::InvalidArgument(
                    kOp, ": strides must be 1 (the input gradient of a "
                    "strided convolution is TensorFlow's Conv2DBackpropInput)"
                    ", got [", attrs_.strides[0], ", ", attrs_.strides[1], ", ",
                    attrs_.strides[2], ", ", attrs_.strides[3], "]"));
    bool onednn = false;
    dense_ok_ = InitGradientDenseKernel(ctx, tf::DataTypeToEnum<T>::value,
                                        "Conv2DBackpropInput", attrs_, &bi_,
                                        &onednn);
  }

  void Compute(tf::OpKernelContext* ctx) override {
    static constexpr const char* kOp = "SparseSplitConv2DBackpropInput";
    const tf::Tensor& sizes = ctx->input(0);
    const tf::Tensor& f = ctx->input(1);
    const tf::Tensor& dy = ctx->input(2);
    tf::TensorShape xshape;
    OP_REQUIRES_OK(ctx, ReadSizes4(sizes, kOp, "input_sizes",
                                   "[N, H, W, C_in]", &xshape));
    OP_REQUIRES(ctx, f.dims() == 4,
                tf::errors::InvalidArgument(
                    kOp, ": filter must be rank 4 [KH, KW, C_in, C_out] "
                    "(HWIO), got shape ", f.shape().DebugString()));
    OP_REQUIRES(ctx, dy.dims() == 4,
                tf::errors::InvalidArgument(
                    kOp, ": out_backprop must be rank 4 [N, OH, OW, C_out] "
                    "(NHWC), got shape ", dy.shape().DebugString()));
    float thr_in;
    OP_REQUIRES_OK(ctx, CheckThreshold(ctx->input(3), kOp, &thr_in));
    Conv2DGeometry g;
    OP_REQUIRES_OK(ctx, attrs_.Geometry(xshape, f.shape(), &g, kOp));
    const tf::TensorShape dy_expected({g.n, g.out_h, g.out_w, g.c_out});
    OP_REQUIRES(ctx, dy.shape() == dy_expected,
                tf::errors::InvalidArgument(
                    kOp, ": out_backprop has shape ", dy.shape().DebugString(),
                    " but input_sizes ", xshape.DebugString(), " and filter ",
                    f.shape().DebugString(), " give ",
                    dy_expected.DebugString()));
    OP_REQUIRES(ctx,
                dy.NumElements() < (int64_t{1} << 31) &&
                    xshape.num_elements() < (int64_t{1} << 31),
                tf::errors::InvalidArgument(kOp, ": tensors too large: "
                                            "input_sizes ",
                                            xshape.DebugString(),
                                            ", out_backprop ",
                                            dy.shape().DebugString()));
    Conv2DGeometry gt;  // the forward convolution of dY with rot(F)
    OP_REQUIRES(ctx, TransposedGeometry(g, &gt),
                tf::errors::InvalidArgument(
                    kOp, ": paddings (", attrs_.padding, ") of input ",
                    xshape.DebugString(), " exceed the dilated filter's extent"
                    " (KH-1)*d x (KW-1)*d = ", (g.kh - 1) * g.dil_h, " x ",
                    (g.kw - 1) * g.dil_w,
                    "; use TensorFlow's Conv2DBackpropInput"));

    ConvSplit s(ctx, gt, thr_in);
    LazyRotatedFilter<T> rot{f, ctx, s.pfor};
    SparseKernelChoice* choice = nullptr;
    OP_REQUIRES_OK(ctx, FamilySparseKernelChoice<T>(
        ctx, kFamilyConv2DInputGrad, dy, gt, thr_in, s,
        [&](bool direct, const tf::Tensor& ys, const Conv2DGeometry& gs,
            const std::vector<int64_t>& imgs, const int64_t* nnz) {
          const T* fr = nullptr;
          TF_RETURN_IF_ERROR(rot.Get(&fr));
          tf::Tensor dx;
          TF_RETURN_IF_ERROR(CalibrationOutput<T>(
              ctx, gs.n * gt.out_h * gt.out_w * gt.c_out, &dx));
          SparseForwardAny<T>(direct, ys.flat<T>().data(), gs, imgs.data(),
                              gs.n, nnz, fr, dx.flat<T>().data(), s.pfor);
          return absl::OkStatus();
        },
        &families_, &choice));
    ConvInputGradPaths<T> paths{{dy, gt, ctx, s.pfor}, f, bi_, rot, choice};
    bool done = false;
    OP_REQUIRES_OK(ctx, s.Prepare<T>(ctx, dy, gt, xshape,
                                     kFamilyConv2DInputGrad, dense_ok_, paths,
                                     &plans_, &families_, full_stats_,
                                     &done));
    if (done) return;
    if (s.dense_now) {
      // Counted a sample or nothing: exactly TF's Conv2DBackpropInput, on
      // this op's context (input_sizes, filter, out_backprop are inputs
      // 0..2 of both ops).
      OP_REQUIRES_OK(ctx, bi_.RunOnContext(ctx));
      s.call.DenseDone();
      s.call.SparseDone();
      s.call.Finish(0, 0);
      return;
    }
    const int64_t rs = s.rs, kc = s.kc;

    // --- Dense part: TF's kernel on the dense images of dY, original F. ----
    tf::Tensor* out = nullptr;
    OP_REQUIRES_OK(
        ctx, RunDensePart<T>(
                 ctx, s, gt, dy, f, xshape, paths,
                 [&]() { return bi_.RunOnContext(ctx); },
                 [&](tf::Tensor* fc) {
                   TF_RETURN_IF_ERROR(ctx->allocate_temp(
                       f.dtype(), tf::TensorShape({g.kh, g.kw, g.c_in, kc}),
                       fc));
                   GatherFilterOutChannels<CoreType<T>>(
                       AsCore(f.flat<T>().data()), g.kh * g.kw * g.c_in,
                       g.c_out, s.an.live.data(), kc,
                       AsCore(fc->flat<T>().data()), s.pfor);
                   return absl::OkStatus();
                 },
                 &out));
    s.call.DenseDone();

    // --- Sparse part: the forward sparse kernel on rot(F). -----------------
    if (rs > 0) {
      const T* fr = nullptr;
      OP_REQUIRES_OK(ctx, rot.Get(&fr));
      const bool direct = UseDirectKernel(
          *choice, static_cast<double>(rs) * gt.h * gt.w * gt.c_in,
          s.call.split().nnz_sparse);
      SparseForwardAny<T>(direct, dy.flat<T>().data(), gt, s.sparse().data(),
                          rs, s.an.image_nnz.data(), fr, out->flat<T>().data(),
                          s.pfor);
    }
    s.call.SparseDone();
    s.Finish(gt);
  }

 private:
  ConvAttrs attrs_;
  TfKernel bi_;  // TF's Conv2DBackpropInput
  bool dense_ok_ = true;
  bool full_stats_ = true;
  PlanMemory plans_;  // this op's last plan (hysteresis)
  ConvFamilyCache families_;  // the family of the last call's geometry
};

#define TFSS_REGISTER_CPU(T)                                                \
  REGISTER_KERNEL_BUILDER(Name("TfSparseSplit>SparseSplitConv2D")                         \
                              .Device(tf::DEVICE_CPU)                       \
                              .TypeConstraint<T>("T")                       \
                              .HostMemory("threshold")                      \
                              .HostMemory("stats"),                         \
                          SparseSplitConv2DOp<T>);                          \
  REGISTER_KERNEL_BUILDER(Name("TfSparseSplit>SparseSplitConv2DBackpropFilter")           \
                              .Device(tf::DEVICE_CPU)                       \
                              .TypeConstraint<T>("T")                       \
                              .HostMemory("filter_sizes")                   \
                              .HostMemory("threshold")                      \
                              .HostMemory("stats"),                         \
                          SparseSplitConv2DBackpropFilterOp<T>);           \
  REGISTER_KERNEL_BUILDER(                                                  \
      Name("TfSparseSplit>SparseSplitConv2DBackpropFilterWithBias")          \
          .Device(tf::DEVICE_CPU)                                           \
          .TypeConstraint<T>("T")                                           \
          .HostMemory("filter_sizes")                                       \
          .HostMemory("threshold")                                          \
          .HostMemory("stats"),                                             \
      SparseSplitConv2DBackpropFilterOp<T>);                                \
  REGISTER_KERNEL_BUILDER(Name("TfSparseSplit>SparseSplitConv2DBackpropInput")            \
                              .Device(tf::DEVICE_CPU)                       \
                              .TypeConstraint<T>("T")                       \
                              .HostMemory("input_sizes")                    \
                              .HostMemory("threshold")                      \
                              .HostMemory("stats"),                         \
                          SparseSplitConv2DBackpropInputOp<T>);
TFSS_REGISTER_CPU(float)
TFSS_REGISTER_CPU(double)
TFSS_REGISTER_CPU(Eigen::bfloat16)
TFSS_REGISTER_CPU(Eigen::half)
#undef TFSS_REGISTER_CPU

}  // namespace tf_sparse_split
