// SparseSplitConv2D and SparseSplitConv2DBackpropFilter: CPU kernels
// (registration and shape functions in cc/ops/sparse_split_conv2d_ops.cc).
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
//
// Statistics (float64 [kNumStats], StatIndex of sparse_matmul.h) with rows = images
// and columns = the H*W*C_in values of an image (an all-zero input channel is
// H*W all-zero columns): M = N, K = H*W*C_in, N = KH*KW*C_out (flops / 2 per
// input nonzero on the sparse path), ZERO_COLS_SKIPPED = H*W * (all-zero
// channels skipped), NNZ / NNZ_SPARSE = nonzero input values.
#include <chrono>
#include <cmath>
#include <map>
#include <mutex>
#include <random>
#include <vector>
#include "cc/core/sparse_conv2d.h"
#include "cc/core/sparse_matmul.h"
#include "cc/kernels/sparse_split_matmul_common.h"
#include "cc/kernels/tf_kernel.h"
#include "cc/kernels/tf_parallel_for.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/node_def_util.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace tf_sparse_split {

namespace tf = ::tensorflow;
using tf::shape_inference::InferenceContext;
using tf::shape_inference::ShapeHandle;


namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point t0, Clock::time_point t1) {
  return std::chrono::duration<double>(t1 - t0).count();
}


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
    if (strides.size() != 4)
      return tf::errors::InvalidArgument(op, ": strides must have 4 entries "
                                         "(NHWC), got ", list(strides));
    if (strides[0] != 1 || strides[3] != 1)
      return tf::errors::InvalidArgument(
          op, ": strides on the batch and channel dimensions must be 1, got ",
          list(strides));
    if (strides[1] <= 0 || strides[2] <= 0)
      return tf::errors::InvalidArgument(op, ": strides must be positive, got ",
                                         list(strides));
    if (dilations.size() != 4)
      return tf::errors::InvalidArgument(op, ": dilations must have 4 entries "
                                         "(NHWC), got ", list(dilations));
    if (dilations[0] != 1 || dilations[3] != 1)
      return tf::errors::InvalidArgument(
          op, ": dilations on the batch and channel dimensions must be 1, got ",
          list(dilations));
    if (dilations[1] <= 0 || dilations[2] <= 0)
      return tf::errors::InvalidArgument(
          op, ": dilations must be positive, got ", list(dilations));
    if (padding_code == 2) {
      if (explicit_paddings.size() != 8)
        return tf::errors::InvalidArgument(
            op, ": padding EXPLICIT needs explicit_paddings of 8 entries "
            "(before/after for N, H, W, C), got ", list(explicit_paddings));
      for (auto p : explicit_paddings)
        if (p < 0 || p > (int64_t{1} << 30))
          return tf::errors::InvalidArgument(
              op, ": explicit_paddings must be >= 0, got ",
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

  // Fills g's output size and padding from its input/filter sizes.
  absl::Status Geometry(Conv2DGeometry* g, const char* op) const {
    g->stride_h = strides[1];
    g->stride_w = strides[2];
    g->dil_h = dilations[1];
    g->dil_w = dilations[2];
    const char* err = nullptr;
    const int64_t pt = padding_code == 2 ? explicit_paddings[2] : 0;
    const int64_t pb = padding_code == 2 ? explicit_paddings[3] : 0;
    const int64_t pl = padding_code == 2 ? explicit_paddings[4] : 0;
    const int64_t pr = padding_code == 2 ? explicit_paddings[5] : 0;
    if (!ConvOutputSize(g->h, g->kh, g->stride_h, g->dil_h, padding_code, pt,
                        pb, &g->out_h, &g->pad_top, &err) ||
        !ConvOutputSize(g->w, g->kw, g->stride_w, g->dil_w, padding_code, pl,
                        pr, &g->out_w, &g->pad_left, &err)) {
      return tf::errors::InvalidArgument(
          op, ": ", err, ": input spatial size ", g->h, "x", g->w,
          ", filter ", g->kh, "x", g->kw, ", dilations ", g->dil_h, "x",
          g->dil_w, ", padding ", padding);
    }
    return absl::OkStatus();
  }
};


// Creates TF's kernel for `op` (oneDNN's labelled "_MklNative<op>" for
// float32 when available, else the plain one).
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
  if (dt == tf::DT_FLOAT) {
    if (k->Init(ctx, tf::DEVICE_CPU, "_MklNative" + op, "MklNameChangeOp",
                num_inputs, attrs)
            .ok()) {
      if (is_onednn) *is_onednn = true;
      return absl::OkStatus();
    }
  }
  return k->Init(ctx, tf::DEVICE_CPU, op, "", num_inputs, attrs);
}

// Measured costs of the two paths for one problem family: dense flop/s
// (2*rows*OH*OW*KH*KW*C_in_live*C_out per second); for the sparse path a
// fixed cost per image (seconds: window look-ups over every output pixel,
// which do not shrink with the nonzeros) plus useful flop/s
// (2*nnz*KH*KW*C_out per second). Calibrated once at two densities, then the
// rates follow an exponential moving average of each call's own timings.
struct RateModel {
  std::mutex mu;
  bool calibrated = false;
  double dense_rate = 0.0;
  double sparse_rate = 0.0;
  double sparse_image_s = 0.0;

  void UpdateSparse(double flops, double seconds, int64_t images) {
    double fixed;
    {
      std::lock_guard<std::mutex> lock(mu);
      fixed = sparse_image_s * images;
    }
    Update(&sparse_rate, flops, std::max(seconds - fixed, 0.1 * seconds));
  }

  // Sets the model from calibration timings: dense seconds for
  // `dense_flops`, sparse seconds t_hi / t_lo on `images` images holding
  // nnz_hi / nnz_lo nonzeros, `per_nnz` useful flop per nonzero.
  void Calibrated(double dense_flops, double t_dense, double t_hi,
                  double nnz_hi, double t_lo, double nnz_lo, int64_t images,
                  double per_nnz) {
    double a = nnz_hi > nnz_lo ? (t_hi - t_lo) / (nnz_hi - nnz_lo) : 0.0;
    double c = a > 0 ? (t_lo - a * nnz_lo) / std::max<int64_t>(1, images) : 0;
    if (!(a > 0)) {  // timing noise: one-term model
      a = t_hi / std::max(nnz_hi, 1.0);
      c = 0.0;
    }
    std::lock_guard<std::mutex> lock(mu);
    if (calibrated) return;
    dense_rate = dense_flops / std::max(t_dense, 1e-9);
    sparse_rate = per_nnz / std::max(a, 1e-15);
    sparse_image_s = std::max(c, 0.0);
    calibrated = true;
  }

  void Update(double* rate, double flops, double seconds) {
    if (flops < 2e7 || seconds <= 0.0) return;
    const double r = flops / seconds;
    std::lock_guard<std::mutex> lock(mu);
    *rate = *rate > 0.0 ? 0.8 * *rate + 0.2 * r : r;
  }
};

RateModel& Rates(std::vector<int64_t> key) {
  static std::mutex* mu = new std::mutex;
  static auto* models = new std::map<std::vector<int64_t>, RateModel>;
  std::lock_guard<std::mutex> lock(*mu);
  return (*models)[key];
}

std::vector<int64_t> FamilyKey(int which, tf::DataType dt,
                               const Conv2DGeometry& g) {
  return {which,      static_cast<int64_t>(dt), g.h,        g.w,
          g.c_in,     g.kh,     g.kw,       g.c_out,    g.stride_h,
          g.stride_w, g.dil_h,  g.dil_w,    g.pad_top,  g.pad_left,
          g.out_h,    g.out_w};
}

// Threshold from the model: image i is cheaper sparse when
//   image_s + 2*nnz_i*KH*KW*C_out / sparse_rate
//     < 2*OH*OW*KH*KW*C_in_live*C_out / dense_rate.
double AutoThreshold(RateModel* r, const Conv2DGeometry& g, int64_t c_live) {
  double dense_rate, sparse_rate, image_s;
  {
    std::lock_guard<std::mutex> lock(r->mu);
    dense_rate = std::max(r->dense_rate, 1.0);
    sparse_rate = r->sparse_rate;
    image_s = r->sparse_image_s;
  }
  const double per_nnz = 2.0 * g.kh * g.kw * g.c_out;
  const double dense_image_s =
      per_nnz * g.out_h * g.out_w * c_live / dense_rate;
  const double nnz_max = (dense_image_s - image_s) * sparse_rate / per_nnz;
  const double t =
      nnz_max / static_cast<double>(std::max<int64_t>(1, g.h * g.w * g.c_in));
  return std::min(1.0, std::max(0.0, t));
}

// Fills x (n*h*w*c values) with about `density` nonzeros in [0.5, 1.5).
template <typename T>
void FillRandom(T* x, int64_t total, double density, unsigned seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int64_t i = 0; i < total; ++i)
    x[i] = u(gen) < density ? T(u(gen) + 0.5) : T(0);
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

// Images used to calibrate: enough for ~2^18 input values (a few images of
// a small layer would time mostly fixed overheads), at least 8, at most the
// batch.
int64_t CalibrationImages(const Conv2DGeometry& g) {
  const int64_t per = std::max<int64_t>(1, g.h * g.w * g.c_in);
  return std::min<int64_t>(g.n, std::max<int64_t>(8, (int64_t{1} << 18) / per));
}

// Splits the images by density and fills the histogram.
void SplitImages(const std::vector<int64_t>& image_nnz, int64_t per_image,
                 double thr, double* stats, std::vector<int64_t>* dense,
                 std::vector<int64_t>* sparse, int64_t* nnz_sparse) {
  *nnz_sparse = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(image_nnz.size()); ++i) {
    const double d = static_cast<double>(image_nnz[i]) / per_image;
    stats[kStatHistogram + DensityBin(d)] += 1;
    if (d > thr) {
      dense->push_back(i);
    } else {
      sparse->push_back(i);
      *nnz_sparse += image_nnz[i];
    }
  }
}

// Allocates the statistics output (*stats) and records the sizes and the
// threshold as given. For a problem with no work it also writes the zero
// output 0 of `out_shape` and sets *done.
template <typename T>
absl::Status StartCall(tf::OpKernelContext* ctx, const Conv2DGeometry& g,
                       float thr_in, const tf::TensorShape& out_shape,
                       double** stats, bool* done) {
  tf::Tensor* stats_t = nullptr;
  TF_RETURN_IF_ERROR(
      ctx->allocate_output(1, tf::TensorShape({kNumStats}), &stats_t));
  double* st = stats_t->flat<double>().data();
  std::fill(st, st + kNumStats, 0.0);
  st[kStatM] = g.n;
  st[kStatK] = g.h * g.w * g.c_in;
  st[kStatN] = g.kh * g.kw * g.c_out;
  st[kStatThreshold] = thr_in < 0 ? 0.0 : thr_in;
  *stats = st;
  *done = g.n == 0 || g.out_h == 0 || g.out_w == 0 || g.c_out == 0 ||
          g.h * g.w * g.c_in == 0;
  if (*done) {
    tf::Tensor* out = nullptr;
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, out_shape, &out));
    out->flat<T>().setZero();
    st[kStatRowsSparse] = g.n;
    if (g.n > 0) st[kStatHistogram] = g.n;
  }
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

}  // namespace

template <typename T>
class SparseSplitConv2DOp : public tf::OpKernel {
 public:
  explicit SparseSplitConv2DOp(tf::OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, attrs_.Init(ctx, "SparseSplitConv2D"));
    OP_REQUIRES_OK(ctx, InitDenseKernel(ctx, tf::DataTypeToEnum<T>::value,
                                        "Conv2D", 2, attrs_, &conv_));
  }

  void Compute(tf::OpKernelContext* ctx) override {
    static constexpr const char* kOp = "SparseSplitConv2D";
    const auto t_start = Clock::now();
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
    g.n = x.dim_size(0);
    g.h = x.dim_size(1);
    g.w = x.dim_size(2);
    g.c_in = x.dim_size(3);
    g.kh = f.dim_size(0);
    g.kw = f.dim_size(1);
    g.c_out = f.dim_size(3);
    OP_REQUIRES_OK(ctx, CheckFilter(g, x.shape(), f.shape(), kOp));
    OP_REQUIRES_OK(ctx, attrs_.Geometry(&g, kOp));

    const tf::TensorShape out_shape({g.n, g.out_h, g.out_w, g.c_out});
    const int64_t per_image = g.h * g.w * g.c_in;
    double* stats = nullptr;
    bool done = false;
    OP_REQUIRES_OK(ctx, StartCall<T>(ctx, g, thr_in, out_shape, &stats, &done));
    if (done) return;
    const T* xp = x.flat<T>().data();
    const T* fp = f.flat<T>().data();
    ParallelFor pfor = TfParallelFor(ctx);

    // --- Analysis. ----------------------------------------------------------
    std::vector<int64_t> image_nnz(g.n), chan_nnz(g.c_in);
    const int64_t nnz = CountConvNonzeros<T>(xp, g, image_nnz.data(),
                                             chan_nnz.data(), pfor);
    const std::vector<int64_t> live = LiveColumns(chan_nnz.data(), g.c_in);
    const int64_t c_live = static_cast<int64_t>(live.size());
    RateModel& rates = Rates(FamilyKey(0, tf::DataTypeToEnum<T>::value, g));
    double thr = thr_in;
    if (thr_in < 0) {
      if (!rates.calibrated) OP_REQUIRES_OK(ctx, Calibrate(ctx, f, g, pfor, &rates));
      thr = AutoThreshold(&rates, g, c_live);
    }
    std::vector<int64_t> dense, sparse;
    int64_t nnz_sparse = 0;
    SplitImages(image_nnz, per_image, thr, stats, &dense, &sparse, &nnz_sparse);
    const int64_t rd = dense.size(), rs = sparse.size();
    const auto t_analyzed = Clock::now();

    // --- Dense part. --------------------------------------------------------
    const bool compact = rd > 0 && c_live < g.c_in &&
                         (rd < g.n || (g.c_in - c_live) * 16 >= g.c_in);
    tf::Tensor* out = nullptr;
    if (rd < g.n) OP_REQUIRES_OK(ctx, ctx->allocate_output(0, out_shape, &out));
    if (rd > 0) {
      tf::Tensor result;
      if (rd == g.n && !compact) {
        OP_REQUIRES_OK(ctx, conv_.Run(ctx, {&x, &f},
                                      &result));
      } else {
        const int64_t kc = compact ? c_live : g.c_in;
        const tf::DataType dt = tf::DataTypeToEnum<T>::value;
        tf::Tensor xd, fc;
        OP_REQUIRES_OK(ctx, ctx->allocate_temp(
                                dt, tf::TensorShape({rd, g.h, g.w, kc}), &xd));
        GatherImagesChannels<T>(xp, g, rd == g.n ? nullptr : dense.data(), rd,
                                compact ? live.data() : nullptr, kc,
                                xd.flat<T>().data(), pfor);
        const tf::Tensor* fin = &f;
        if (compact) {
          OP_REQUIRES_OK(ctx, ctx->allocate_temp(
                                  dt, tf::TensorShape({g.kh, g.kw, kc, g.c_out}),
                                  &fc));
          GatherFilterChannels<T>(fp, g, live.data(), kc, fc.flat<T>().data());
          fin = &fc;
        }
        OP_REQUIRES_OK(ctx, conv_.Run(ctx, {&xd, fin}, &result));
      }
      if (rd == g.n) {
        ctx->set_output(0, result);
      } else {
        ScatterImages<T>(result.flat<T>().data(), g, dense.data(), rd,
                         out->flat<T>().data(), pfor);
      }
    }
    const auto t_dense = Clock::now();

    // --- Sparse part. -------------------------------------------------------
    if (rs > 0) {
      PixelCsr<T> csr;
      BuildPixelCsr<T>(xp, g, sparse.data(), rs, image_nnz.data(), &csr, pfor);
      SparseConv2DForward<T>(csr, g, sparse.data(), rs, fp,
                             out->flat<T>().data(), pfor);
    }
    const auto t_sparse = Clock::now();

    const int64_t kc = (rd == 0 || compact) ? c_live : g.c_in;
    const double time_dense = Seconds(t_analyzed, t_dense);
    const double time_sparse = Seconds(t_dense, t_sparse);
    rates.Update(&rates.dense_rate,
                 2.0 * rd * g.out_h * g.out_w * g.kh * g.kw * kc * g.c_out,
                 time_dense);
    rates.UpdateSparse(2.0 * nnz_sparse * g.kh * g.kw * g.c_out, time_sparse,
                       rs);
    stats[kStatRowsDense] = rd;
    stats[kStatRowsSparse] = rs;
    stats[kStatNnz] = nnz;
    stats[kStatZeroColsSkipped] = static_cast<double>(g.c_in - kc) * g.h * g.w;
    stats[kStatTimeDense] = time_dense;
    stats[kStatTimeSparse] = time_sparse;
    stats[kStatTimeAnalyze] = Seconds(t_start, t_analyzed);
    stats[kStatThreshold] = thr;
    stats[kStatNnzSparse] = nnz_sparse;
  }

 private:
  // Times both paths on CalibrationImages(g) synthetic images of this
  // geometry: dense at 90% sparsity, sparse at 90% and 99% (best of 2 runs
  // each) to separate its per-image and per-nonzero costs.
  absl::Status Calibrate(tf::OpKernelContext* ctx, const tf::Tensor& f,
                         Conv2DGeometry g, const ParallelFor& pfor,
                         RateModel* model) const {
    g.n = CalibrationImages(g);
    const tf::DataType dt = tf::DataTypeToEnum<T>::value;
    tf::Tensor xt;
    TF_RETURN_IF_ERROR(
        ctx->allocate_temp(dt, tf::TensorShape({g.n, g.h, g.w, g.c_in}), &xt));
    T* xs = xt.flat<T>().data();
    const int64_t total = g.n * g.h * g.w * g.c_in;
    std::vector<int64_t> image_nnz(g.n), chan_nnz(g.c_in), imgs(g.n);
    for (int64_t i = 0; i < g.n; ++i) imgs[i] = i;
    std::vector<T> y(g.n * g.out_h * g.out_w * g.c_out);
    double best_d = 1e30, t_sp[2] = {1e30, 1e30}, nnz[2] = {0, 0};
    const double density[2] = {0.1, 0.01};
    for (int k = 0; k < 2; ++k) {
      FillRandom<T>(xs, total, density[k], 1234 + k);
      nnz[k] = CountConvNonzeros<T>(xs, g, image_nnz.data(), chan_nnz.data(),
                                    pfor);
      for (int rep = 0; rep < 2; ++rep) {
        const auto t0 = Clock::now();
        if (k == 0) {
          tf::Tensor result;
          TF_RETURN_IF_ERROR(
              conv_.Run(ctx, {&xt, &f}, &result));
        }
        const auto t1 = Clock::now();
        PixelCsr<T> csr;
        BuildPixelCsr<T>(xs, g, imgs.data(), g.n, image_nnz.data(), &csr,
                         pfor);
        SparseConv2DForward<T>(csr, g, imgs.data(), g.n, f.flat<T>().data(),
                               y.data(), pfor);
        const auto t2 = Clock::now();
        if (k == 0) best_d = std::min(best_d, Seconds(t0, t1));
        t_sp[k] = std::min(t_sp[k], Seconds(t1, t2));
      }
    }
    model->Calibrated(
        2.0 * g.n * g.out_h * g.out_w * g.kh * g.kw * g.c_in * g.c_out, best_d,
        t_sp[0], nnz[0], t_sp[1], nnz[1], g.n, 2.0 * g.kh * g.kw * g.c_out);
    return absl::OkStatus();
  }

  ConvAttrs attrs_;
  TfKernel conv_;
};

template <typename T>
class SparseSplitConv2DBackpropFilterOp : public tf::OpKernel {
 public:
  explicit SparseSplitConv2DBackpropFilterOp(tf::OpKernelConstruction* ctx)
      : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, attrs_.Init(ctx, "SparseSplitConv2DBackpropFilter"));
    const absl::Status s =
        InitDenseKernel(ctx, tf::DataTypeToEnum<T>::value,
                        "Conv2DBackpropFilter", 3, attrs_, &bf_, &bf_onednn_);
    // TF's non-oneDNN CPU Conv2DBackpropFilter (float64) refuses dilations
    // > 1; the sparse kernel handles any, so such calls run all-sparse.
    const bool dilated = attrs_.dilations[1] > 1 || attrs_.dilations[2] > 1;
    if (!dilated) OP_REQUIRES_OK(ctx, s);
    // oneDNN's refuses dilations > 1 with EXPLICIT padding (as does
    // tf.nn.conv2d's own gradient in TF 2.21).
    dense_ok_ = s.ok() && (!dilated || (bf_onednn_ && attrs_.padding_code != 2));
  }

  void Compute(tf::OpKernelContext* ctx) override {
    static constexpr const char* kOp = "SparseSplitConv2DBackpropFilter";
    const auto t_start = Clock::now();
    const tf::Tensor& x = ctx->input(0);
    const tf::Tensor& sizes = ctx->input(1);
    const tf::Tensor& dy = ctx->input(2);
    OP_REQUIRES_OK(ctx, CheckInput(x, kOp));
    OP_REQUIRES(ctx,
                tf::TensorShapeUtils::IsVector(sizes.shape()) &&
                    sizes.NumElements() == 4,
                tf::errors::InvalidArgument(
                    kOp, ": filter_sizes must be an int32 vector of 4 "
                    "[KH, KW, C_in, C_out], got shape ",
                    sizes.shape().DebugString()));
    auto sz = sizes.vec<tf::int32>();
    for (int i = 0; i < 4; ++i)
      OP_REQUIRES(ctx, sz(i) >= 0,
                  tf::errors::InvalidArgument(kOp, ": filter_sizes must be "
                                              ">= 0, got ", sz(i)));
    const tf::TensorShape fshape({sz(0), sz(1), sz(2), sz(3)});
    float thr_in;
    OP_REQUIRES_OK(ctx, CheckThreshold(ctx->input(3), kOp, &thr_in));
    Conv2DGeometry g;
    g.n = x.dim_size(0);
    g.h = x.dim_size(1);
    g.w = x.dim_size(2);
    g.c_in = x.dim_size(3);
    g.kh = sz(0);
    g.kw = sz(1);
    g.c_out = sz(3);
    OP_REQUIRES_OK(ctx, CheckFilter(g, x.shape(), fshape, kOp));
    OP_REQUIRES_OK(ctx, attrs_.Geometry(&g, kOp));
    const tf::TensorShape dy_expected({g.n, g.out_h, g.out_w, g.c_out});
    OP_REQUIRES(ctx, dy.shape() == dy_expected,
                tf::errors::InvalidArgument(
                    kOp, ": out_backprop has shape ", dy.shape().DebugString(),
                    " but input ", x.shape().DebugString(), " and filter ",
                    fshape.DebugString(), " give ",
                    dy_expected.DebugString()));

    const int64_t per_image = g.h * g.w * g.c_in;
    double* stats = nullptr;
    bool done = false;
    OP_REQUIRES_OK(ctx, StartCall<T>(ctx, g, thr_in, fshape, &stats, &done));
    if (done) return;
    const T* xp = x.flat<T>().data();
    ParallelFor pfor = TfParallelFor(ctx);

    std::vector<int64_t> image_nnz(g.n), chan_nnz(g.c_in);
    const int64_t nnz = CountConvNonzeros<T>(xp, g, image_nnz.data(),
                                             chan_nnz.data(), pfor);
    const std::vector<int64_t> live = LiveColumns(chan_nnz.data(), g.c_in);
    const int64_t c_live = static_cast<int64_t>(live.size());
    RateModel& rates = Rates(FamilyKey(1, tf::DataTypeToEnum<T>::value, g));
    double thr = thr_in;
    if (!dense_ok_) {
      thr = 1.0;
    } else if (thr_in < 0) {
      if (!rates.calibrated)
        OP_REQUIRES_OK(ctx, Calibrate(ctx, dy, g, pfor, &rates));
      thr = AutoThreshold(&rates, g, c_live);
    }
    std::vector<int64_t> dense, sparse;
    int64_t nnz_sparse = 0;
    SplitImages(image_nnz, per_image, thr, stats, &dense, &sparse, &nnz_sparse);
    const int64_t rd = dense.size(), rs = sparse.size();
    const auto t_analyzed = Clock::now();

    const bool compact = rd > 0 && c_live < g.c_in &&
                         (rd < g.n || (g.c_in - c_live) * 16 >= g.c_in);
    const int64_t kc = compact ? c_live : g.c_in;
    const tf::DataType dt = tf::DataTypeToEnum<T>::value;
    tf::Tensor* out = nullptr;
    bool out_set = false;
    if (rd > 0) {
      tf::Tensor result;
      tf::Tensor sizes_t(tf::DT_INT32, tf::TensorShape({4}));
      auto sv = sizes_t.vec<tf::int32>();
      sv(0) = g.kh;
      sv(1) = g.kw;
      sv(2) = kc;
      sv(3) = g.c_out;
      if (rd == g.n && !compact) {
        OP_REQUIRES_OK(ctx, bf_.Run(ctx, {&x, &sizes_t, &dy},
                                    &result));
      } else {
        tf::Tensor xd, dyd;
        OP_REQUIRES_OK(ctx, ctx->allocate_temp(
                                dt, tf::TensorShape({rd, g.h, g.w, kc}), &xd));
        GatherImagesChannels<T>(xp, g, rd == g.n ? nullptr : dense.data(), rd,
                                compact ? live.data() : nullptr, kc,
                                xd.flat<T>().data(), pfor);
        const tf::Tensor* dyin = &dy;
        if (rd < g.n) {
          Conv2DGeometry gy;
          gy.n = g.n;
          gy.h = g.out_h;
          gy.w = g.out_w;
          gy.c_in = g.c_out;
          OP_REQUIRES_OK(ctx, ctx->allocate_temp(
                                  dt, tf::TensorShape({rd, g.out_h, g.out_w,
                                                       g.c_out}),
                                  &dyd));
          GatherImagesChannels<T>(dy.flat<T>().data(), gy, dense.data(), rd,
                                  nullptr, g.c_out, dyd.flat<T>().data(), pfor);
          dyin = &dyd;
        }
        OP_REQUIRES_OK(ctx, bf_.Run(ctx, {&xd, &sizes_t, dyin}, &result));
      }
      if (!compact) {
        if (rs == 0) {
          ctx->set_output(0, result);
          out_set = true;
        } else {
          // The dense part becomes the output buffer the sparse part adds to.
          OP_REQUIRES_OK(ctx, ctx->allocate_output(0, fshape, &out));
          std::copy_n(result.flat<T>().data(), fshape.num_elements(),
                      out->flat<T>().data());
        }
      } else {
        OP_REQUIRES_OK(ctx, ctx->allocate_output(0, fshape, &out));
        out->flat<T>().setZero();
        ScatterFilterChannels<T>(result.flat<T>().data(), g, live.data(), kc,
                                 out->flat<T>().data(), true);
      }
    } else {
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, fshape, &out));
      out->flat<T>().setZero();
    }
    const auto t_dense = Clock::now();

    if (rs > 0 && nnz_sparse > 0) {
      SparseFilterGrad<T>(xp, g, sparse.data(), rs, image_nnz.data(),
                          dy.flat<T>().data(), out->flat<T>().data(), pfor);
    }
    (void)out_set;
    const auto t_sparse = Clock::now();

    const int64_t kc_used = (rd == 0 || compact) ? c_live : g.c_in;
    const double time_dense = Seconds(t_analyzed, t_dense);
    const double time_sparse = Seconds(t_dense, t_sparse);
    rates.Update(&rates.dense_rate,
                 2.0 * rd * g.out_h * g.out_w * g.kh * g.kw * kc_used * g.c_out,
                 time_dense);
    rates.UpdateSparse(2.0 * nnz_sparse * g.kh * g.kw * g.c_out, time_sparse,
                       rs);
    stats[kStatRowsDense] = rd;
    stats[kStatRowsSparse] = rs;
    stats[kStatNnz] = nnz;
    stats[kStatZeroColsSkipped] =
        static_cast<double>(g.c_in - kc_used) * g.h * g.w;
    stats[kStatTimeDense] = time_dense;
    stats[kStatTimeSparse] = time_sparse;
    stats[kStatTimeAnalyze] = Seconds(t_start, t_analyzed);
    stats[kStatThreshold] = thr;
    stats[kStatNnzSparse] = nnz_sparse;
  }

 private:
  absl::Status Calibrate(tf::OpKernelContext* ctx, const tf::Tensor& dy,
                         Conv2DGeometry g, const ParallelFor& pfor,
                         RateModel* model) const {
    g.n = CalibrationImages(g);
    const tf::DataType dt = tf::DataTypeToEnum<T>::value;
    tf::Tensor xt, dyt;
    TF_RETURN_IF_ERROR(
        ctx->allocate_temp(dt, tf::TensorShape({g.n, g.h, g.w, g.c_in}), &xt));
    TF_RETURN_IF_ERROR(ctx->allocate_temp(
        dt, tf::TensorShape({g.n, g.out_h, g.out_w, g.c_out}), &dyt));
    std::copy_n(dy.flat<T>().data(), dyt.NumElements(), dyt.flat<T>().data());
    T* xs = xt.flat<T>().data();
    const int64_t total = g.n * g.h * g.w * g.c_in;
    std::vector<int64_t> image_nnz(g.n), chan_nnz(g.c_in), imgs(g.n);
    for (int64_t i = 0; i < g.n; ++i) imgs[i] = i;
    tf::Tensor sizes_t(tf::DT_INT32, tf::TensorShape({4}));
    auto sv = sizes_t.vec<tf::int32>();
    sv(0) = g.kh;
    sv(1) = g.kw;
    sv(2) = g.c_in;
    sv(3) = g.c_out;
    std::vector<T> df(g.kh * g.kw * g.c_in * g.c_out);
    double best_d = 1e30, t_sp[2] = {1e30, 1e30}, nnz[2] = {0, 0};
    const double density[2] = {0.1, 0.01};
    for (int k = 0; k < 2; ++k) {
      FillRandom<T>(xs, total, density[k], 1234 + k);
      nnz[k] = CountConvNonzeros<T>(xs, g, image_nnz.data(), chan_nnz.data(),
                                    pfor);
      for (int rep = 0; rep < 2; ++rep) {
        const auto t0 = Clock::now();
        if (k == 0) {
          tf::Tensor result;
          TF_RETURN_IF_ERROR(bf_.Run(ctx, {&xt, &sizes_t, &dyt}, &result));
        }
        const auto t1 = Clock::now();
        SparseFilterGrad<T>(xs, g, imgs.data(), g.n, image_nnz.data(),
                            dyt.flat<T>().data(), df.data(), pfor);
        const auto t2 = Clock::now();
        if (k == 0) best_d = std::min(best_d, Seconds(t0, t1));
        t_sp[k] = std::min(t_sp[k], Seconds(t1, t2));
      }
    }
    model->Calibrated(
        2.0 * g.n * g.out_h * g.out_w * g.kh * g.kw * g.c_in * g.c_out, best_d,
        t_sp[0], nnz[0], t_sp[1], nnz[1], g.n, 2.0 * g.kh * g.kw * g.c_out);
    return absl::OkStatus();
  }

  ConvAttrs attrs_;
  TfKernel bf_;
  bool bf_onednn_ = false, dense_ok_ = true;
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
                          SparseSplitConv2DBackpropFilterOp<T>);
TFSS_REGISTER_CPU(float)
TFSS_REGISTER_CPU(double)
#undef TFSS_REGISTER_CPU

}  // namespace tf_sparse_split
