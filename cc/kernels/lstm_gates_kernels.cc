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
//
// Dtypes: float32 and float64 compute in their own type. bfloat16 and half
// are storage only (cc/core/low_precision.h): each row's inputs are widened
// to float32 (WidenToFloat, CPUID-dispatched), the whole step is computed in
// float32 as for float32 inputs, and every output is rounded once to T
// (NarrowFromFloat, round-to-nearest-even) -- where Keras' LSTM cell under a
// mixed policy rounds after each of its elementwise ops.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "Eigen/Core"
#include "cc/core/low_precision.h"
#include "cc/kernels/core_types.h"
#include "cc/kernels/tf_parallel_for.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"

namespace tf_sparse_split {

namespace tf = ::tensorflow;

namespace {

template <typename T>
using Vec = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>;
template <typename T>
using ConstVec = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>;

// The type the math runs in: T for float32/float64, float32 for the 16-bit
// storage types (CoreType of cc/kernels/core_types.h maps TF's to the core's).
template <typename T>
using MathT = typename Accum<CoreType<T>>::type;

// One row's view of a tensor in the math type: float32/float64 data is used
// in place; bfloat16/half data is widened into (inputs) or narrowed from
// (outputs) a per-thread buffer.
template <typename T>
class RowIn {
 public:
  typedef CoreType<T> S;
  typedef MathT<T> A;
  explicit RowIn(int64_t n) : buf_(IsLowPrecision<S>::value ? n : 0) {}
  // The n values at `p`, in the math type.
  const A* Read(const T* p, int64_t n) {
    if constexpr (IsLowPrecision<S>::value) {
      WidenToFloat(reinterpret_cast<const S*>(p), buf_.data(), n);
      return buf_.data();
    } else {
      return p;
    }
  }

 private:
  std::vector<A> buf_;
};

template <typename T>
class RowOut {
 public:
  typedef CoreType<T> S;
  typedef MathT<T> A;
  explicit RowOut(int64_t n) : buf_(IsLowPrecision<S>::value ? n : 0) {}
  // Where to write the n values destined for `p` (then call Flush).
  A* Target(T* p) {
    if constexpr (IsLowPrecision<S>::value) {
      return buf_.data();
    } else {
      return p;
    }
  }
  // Rounds what was written to Target(p) into `p` (no-op in place).
  void Flush(T* p, int64_t n) {
    if constexpr (IsLowPrecision<S>::value)
      NarrowFromFloat(buf_.data(), reinterpret_cast<S*>(p), n);
  }

 private:
  std::vector<A> buf_;
};

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
    typedef MathT<T> A;
    TfParallelFor(ctx)(rows, RowCost(u), [&](int64_t begin, int64_t end) {
      RowIn<T> in_a(4 * u), in_b(4 * u), in_c(u);
      RowOut<T> out_s(6 * u), out_c(u), out_h(u);
      for (int64_t r = begin; r < end; ++r) {
        const A* a = in_a.Read(zx_p + r * 4 * u, 4 * u);
        const A* b = in_b.Read(zh_p + r * 4 * u, 4 * u);
        const A* cp_r = in_c.Read(cp_p + r * u, u);
        T* const s_t = s_p + r * 6 * u;
        T* const c_t = c_p + r * u;
        T* const h_t = h_p + r * u;
        A* s = out_s.Target(s_t);
        Vec<A> sig(s, 3 * u), cand(s + 3 * u, u), tc(s + 4 * u, u),
            cp_saved(s + 5 * u, u), c_new(out_c.Target(c_t), u),
            h_new(out_h.Target(h_t), u);
        const ConstVec<A> cp(cp_r, u);
        sig = (ConstVec<A>(a, 3 * u) + ConstVec<A>(b, 3 * u)).logistic();
        cand = (ConstVec<A>(a + 3 * u, u) + ConstVec<A>(b + 3 * u, u)).tanh();
        c_new = sig.segment(u, u) * cp + sig.segment(0, u) * cand;
        tc = c_new.tanh();
        h_new = sig.segment(2 * u, u) * tc;
        cp_saved = cp;
        out_s.Flush(s_t, 6 * u);
        out_c.Flush(c_t, u);
        out_h.Flush(h_t, u);
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
    typedef MathT<T> A;
    TfParallelFor(ctx)(rows, RowCost(u), [&](int64_t begin, int64_t end) {
      std::vector<A> dh_buf(u), dct_buf(u);
      Vec<A> dh(dh_buf.data(), u), dct(dct_buf.data(), u);
      RowIn<T> in_s(6 * u), in_r(k), in_o(u), in_c(u);
      RowOut<T> out_z(4 * u), out_c(u);
      for (int64_t r = begin; r < end; ++r) {
        const A* s = in_s.Read(s_p + r * 6 * u, 6 * u);
        const ConstVec<A> si(s, u), sf(s + u, u), so(s + 2 * u, u),
            a(s + 3 * u, u), tc(s + 4 * u, u), cp(s + 5 * u, u);
        dh = ConstVec<A>(in_o.Read(do_p + r * u, u), u);
        if (k > 0) dh.head(k) += ConstVec<A>(in_r.Read(dr_p + r * k, k), k);
        dct = ConstVec<A>(in_c.Read(dc_p + r * u, u), u) +
              dh * so * (A(1) - tc * tc);
        T* const z_t = dz_p + r * 4 * u;
        T* const dcp_t = dcp_p + r * u;
        A* z = out_z.Target(z_t);
        Vec<A>(z, u) = dct * a * si * (A(1) - si);
        Vec<A>(z + u, u) = dct * cp * sf * (A(1) - sf);
        Vec<A>(z + 2 * u, u) = dh * tc * so * (A(1) - so);
        Vec<A>(z + 3 * u, u) = dct * si * (A(1) - a * a);
        Vec<A>(out_c.Target(dcp_t), u) = dct * sf;
        out_z.Flush(z_t, 4 * u);
        out_c.Flush(dcp_t, u);
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
TFSS_REGISTER_LSTM_GATES(Eigen::bfloat16)
TFSS_REGISTER_LSTM_GATES(Eigen::half)
#undef TFSS_REGISTER_LSTM_GATES

}  // namespace tf_sparse_split
