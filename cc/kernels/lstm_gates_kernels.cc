// LstmGates / LstmGatesGrad: CPU kernels (registration and the math in
// cc/ops/lstm_gates_ops.cc). One LSTM time step's elementwise gate math in
// one op each way: the per-step loop of SparseSplitLSTM otherwise runs about
// ten small TF ops per step forward and twenty backward, whose executor
// overhead outweighs their arithmetic at LSTM sizes. Rows (all leading
// dimensions flattened) are independent and split over the intra-op pool;
// each value is computed by the same expression whatever the split, so the
// bits do not depend on the thread count. The row loops are Eigen array
// expressions (vectorized logistic/tanh, AVX-512 with -march=native): the
// same functors as tf.sigmoid and tf.tanh.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "Eigen/Core"
#include "cc/kernels/tf_parallel_for.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace tf_sparse_split {

namespace tf = ::tensorflow;

namespace {

template <typename T>
using Vec = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>;
template <typename T>
using ConstVec = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>;

// Rough cycles per row of `units` for ParallelFor's sharding (about 25 per
// transcendental).
int64_t RowCost(int64_t units) { return 150 * units; }

// The leading dimensions of `t` (all but the last).
tf::TensorShape Prefix(const tf::Tensor& t) {
  tf::TensorShape p = t.shape();
  p.RemoveLastDims(1);
  return p;
}

// `prefix` + [last].
tf::TensorShape WithLast(tf::TensorShape prefix, int64_t last) {
  prefix.AddDim(last);
  return prefix;
}

absl::Status CheckRank(const char* op, const char* name, const tf::Tensor& t) {
  if (t.dims() < 1)
    return tf::errors::InvalidArgument(op, ": ", name,
                                       " must have rank >= 1, got shape ",
                                       t.shape().DebugString());
  return absl::OkStatus();
}

absl::Status CheckShape(const char* op, const char* name, const tf::Tensor& t,
                        const tf::TensorShape& want) {
  if (t.shape() != want)
    return tf::errors::InvalidArgument(op, ": ", name, " must have shape ",
                                       want.DebugString(), ", got ",
                                       t.shape().DebugString());
  return absl::OkStatus();
}

}  // namespace

template <typename T>
class LstmGatesOp : public tf::OpKernel {
 public:
  explicit LstmGatesOp(tf::OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(tf::OpKernelContext* ctx) override {
    static constexpr char kOp[] = "LstmGates";
    const tf::Tensor& zx = ctx->input(0);
    const tf::Tensor& zh = ctx->input(1);
    const tf::Tensor& c_prev = ctx->input(2);
    OP_REQUIRES_OK(ctx, CheckRank(kOp, "zx", zx));
    OP_REQUIRES_OK(ctx, CheckShape(kOp, "zh (the shape of zx)", zh,
                                   zx.shape()));
    const int64_t four_units = zx.dim_size(zx.dims() - 1);
    OP_REQUIRES(ctx, four_units % 4 == 0,
                tf::errors::InvalidArgument(
                    kOp, ": the last dimension of zx (4 * units) must be a "
                    "multiple of 4, got shape ", zx.shape().DebugString()));
    const int64_t units = four_units / 4;
    const tf::TensorShape prefix = Prefix(zx);
    OP_REQUIRES_OK(ctx, CheckShape(kOp, "c_prev", c_prev,
                                   WithLast(prefix, units)));
    tf::Tensor *h = nullptr, *c = nullptr, *saved = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, c_prev.shape(), &h));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, c_prev.shape(), &c));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, WithLast(prefix, 6 * units),
                                             &saved));
    const int64_t rows = prefix.num_elements();
    if (rows == 0 || units == 0) return;
    const T* zx_p = zx.flat<T>().data();
    const T* zh_p = zh.flat<T>().data();
    const T* cp_p = c_prev.flat<T>().data();
    T* h_p = h->flat<T>().data();
    T* c_p = c->flat<T>().data();
    T* s_p = saved->flat<T>().data();
    const int64_t u = units;
    TfParallelFor(ctx)(rows, RowCost(u), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* a = zx_p + r * 4 * u;
        const T* b = zh_p + r * 4 * u;
        T* s = s_p + r * 6 * u;
        Vec<T> sig(s, 3 * u), cand(s + 3 * u, u), tc(s + 4 * u, u),
            cp_saved(s + 5 * u, u), c_new(c_p + r * u, u), h_new(h_p + r * u, u);
        const ConstVec<T> cp(cp_p + r * u, u);
        sig = (ConstVec<T>(a, 3 * u) + ConstVec<T>(b, 3 * u)).logistic();
        cand = (ConstVec<T>(a + 3 * u, u) + ConstVec<T>(b + 3 * u, u)).tanh();
        c_new = sig.segment(u, u) * cp + sig.segment(0, u) * cand;
        tc = c_new.tanh();
        h_new = sig.segment(2 * u, u) * tc;
        cp_saved = cp;
      }
    });
  }
};

template <typename T>
class LstmGatesGradOp : public tf::OpKernel {
 public:
  explicit LstmGatesGradOp(tf::OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(tf::OpKernelContext* ctx) override {
    static constexpr char kOp[] = "LstmGatesGrad";
    const tf::Tensor& saved = ctx->input(0);
    const tf::Tensor& dh_rec = ctx->input(1);
    const tf::Tensor& dh_out = ctx->input(2);
    const tf::Tensor& dc = ctx->input(3);
    OP_REQUIRES_OK(ctx, CheckRank(kOp, "saved", saved));
    const int64_t six_units = saved.dim_size(saved.dims() - 1);
    OP_REQUIRES(ctx, six_units % 6 == 0,
                tf::errors::InvalidArgument(
                    kOp, ": the last dimension of saved (6 * units) must be a "
                    "multiple of 6, got shape ", saved.shape().DebugString()));
    const int64_t units = six_units / 6;
    const tf::TensorShape prefix = Prefix(saved);
    const tf::TensorShape state = WithLast(prefix, units);
    OP_REQUIRES_OK(ctx, CheckShape(kOp, "dh_out", dh_out, state));
    OP_REQUIRES_OK(ctx, CheckShape(kOp, "dc", dc, state));
    OP_REQUIRES_OK(ctx, CheckRank(kOp, "dh_rec", dh_rec));
    const int64_t k = dh_rec.dim_size(dh_rec.dims() - 1);
    OP_REQUIRES(ctx, Prefix(dh_rec) == prefix && k <= units,
                tf::errors::InvalidArgument(
                    kOp, ": dh_rec must have shape ", prefix.DebugString(),
                    " + [k] with k <= units = ", units, ", got ",
                    dh_rec.shape().DebugString()));
    tf::Tensor *dz = nullptr, *dc_prev = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, WithLast(prefix, 4 * units),
                                             &dz));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, state, &dc_prev));
    const int64_t rows = prefix.num_elements();
    if (rows == 0 || units == 0) return;
    const T* s_p = saved.flat<T>().data();
    const T* dr_p = dh_rec.flat<T>().data();
    const T* do_p = dh_out.flat<T>().data();
    const T* dc_p = dc.flat<T>().data();
    T* dz_p = dz->flat<T>().data();
    T* dcp_p = dc_prev->flat<T>().data();
    const int64_t u = units;
    TfParallelFor(ctx)(rows, RowCost(u), [&](int64_t begin, int64_t end) {
      std::vector<T> dh_buf(u), dct_buf(u);
      Vec<T> dh(dh_buf.data(), u), dct(dct_buf.data(), u);
      for (int64_t r = begin; r < end; ++r) {
        const T* s = s_p + r * 6 * u;
        const ConstVec<T> si(s, u), sf(s + u, u), so(s + 2 * u, u),
            a(s + 3 * u, u), tc(s + 4 * u, u), cp(s + 5 * u, u);
        dh = ConstVec<T>(do_p + r * u, u);
        if (k > 0) dh.head(k) += ConstVec<T>(dr_p + r * k, k);
        dct = ConstVec<T>(dc_p + r * u, u) + dh * so * (T(1) - tc * tc);
        T* z = dz_p + r * 4 * u;
        Vec<T>(z, u) = dct * a * si * (T(1) - si);
        Vec<T>(z + u, u) = dct * cp * sf * (T(1) - sf);
        Vec<T>(z + 2 * u, u) = dh * tc * so * (T(1) - so);
        Vec<T>(z + 3 * u, u) = dct * si * (T(1) - a * a);
        Vec<T>(dcp_p + r * u, u) = dct * sf;
      }
    });
  }
};

#define TFSS_REGISTER_LSTM_GATES(T)                                        \
  REGISTER_KERNEL_BUILDER(Name("TfSparseSplit>LstmGates")                 \
                              .Device(tf::DEVICE_CPU)                      \
                              .TypeConstraint<T>("T"),                     \
                          LstmGatesOp<T>);                                 \
  REGISTER_KERNEL_BUILDER(Name("TfSparseSplit>LstmGatesGrad")             \
                              .Device(tf::DEVICE_CPU)                      \
                              .TypeConstraint<T>("T"),                     \
                          LstmGatesGradOp<T>);
TFSS_REGISTER_LSTM_GATES(float)
TFSS_REGISTER_LSTM_GATES(double)
#undef TFSS_REGISTER_LSTM_GATES

}  // namespace tf_sparse_split
