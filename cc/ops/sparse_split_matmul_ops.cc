// SparseSplitMatMul: registration, shape function and CPU kernel.
//
// product = op(a) * op(b), where op(a) [m, k] is the activation operand whose
// zeros are exploited (K.-Y. Peng, NTU 2017): rows of op(a) whose density
// (nnz / k) is above `threshold` go to a dense Eigen GEMM on TF's intra-op
// thread pool, the others to the CSR SpMM of cc/kernels, and all-zero columns
// of op(a) are compacted away from the dense part together with the matching
// rows of op(b). A negative threshold lets the op choose it from rates it
// measured on this machine.
#define EIGEN_USE_THREADS

#include <atomic>
#include <chrono>
#include <cmath>
#include <mutex>
#include <random>
#include <vector>

#include "cc/kernels/sparse_matmul.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "unsupported/Eigen/CXX11/Tensor"

namespace tf_sparse_split {

namespace tf = ::tensorflow;
using tf::shape_inference::DimensionHandle;
using tf::shape_inference::InferenceContext;
using tf::shape_inference::ShapeHandle;

REGISTER_OP("SparseSplitMatMul")
    .Input("a: T")
    .Input("b: T")
    .Input("threshold: float")
    .Output("product: T")
    .Output("stats: float64")
    .Attr("transpose_a: bool = false")
    .Attr("transpose_b: bool = false")
    .Attr("T: {float, double}")
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
  negative value chooses it automatically. The answer does not depend on it.
product: [m, n].
stats: float64 [28] per-call statistics (see tf_sparse_split/stats.py).
)doc");

namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point t0, Clock::time_point t1) {
  return std::chrono::duration<double>(t1 - t0).count();
}

ParallelFor MakeParallelFor(tf::OpKernelContext* ctx) {
  auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  return [pool](int64_t total, int64_t cost,
                const std::function<void(int64_t, int64_t)>& fn) {
    if (total <= 0) return;
    pool->ParallelFor(total, cost, fn);
  };
}

template <typename T>
using ConstMap =
    Eigen::TensorMap<Eigen::Tensor<const T, 2, Eigen::RowMajor, Eigen::DenseIndex>>;
template <typename T>
using Map = Eigen::TensorMap<Eigen::Tensor<T, 2, Eigen::RowMajor, Eigen::DenseIndex>>;

// c[m, n] = op(a) * op(b) through an Eigen contraction on the device.
template <typename T>
void DenseGemm(const Eigen::ThreadPoolDevice& d, const T* a, int64_t a_rows,
               int64_t a_cols, bool ta, const T* b, int64_t b_rows,
               int64_t b_cols, bool tb, T* c, int64_t m, int64_t n) {
  ConstMap<T> am(a, a_rows, a_cols);
  ConstMap<T> bm(b, b_rows, b_cols);
  Map<T> cm(c, m, n);
  Eigen::array<Eigen::IndexPair<Eigen::DenseIndex>, 1> dims;
  dims[0] = Eigen::IndexPair<Eigen::DenseIndex>(ta ? 0 : 1, tb ? 1 : 0);
  cm.device(d) = am.contract(bm, dims);
}

// Measured throughputs of the two paths on this machine, per dtype: dense
// GEMM flop/s and SpMM useful flop/s (2 * nnz * n per second). Seeded by a
// short calibration the first time an automatic threshold is needed, then
// refined by an exponential moving average of every call's own timings.
struct RateModel {
  std::mutex mu;
  bool calibrated = false;
  double dense_rate = 0.0;
  double sparse_rate = 0.0;

  void Update(double* rate, double flops, double seconds) {
    // Too-small parts are dominated by fixed overheads; skip them.
    if (flops < 2e7 || seconds <= 0.0) return;
    const double r = flops / seconds;
    std::lock_guard<std::mutex> lock(mu);
    *rate = *rate > 0.0 ? 0.8 * *rate + 0.2 * r : r;
  }
};

template <typename T>
RateModel& Rates() {
  static RateModel* model = new RateModel;
  return *model;
}

template <typename T>
void Calibrate(const Eigen::ThreadPoolDevice& d, const ParallelFor& pfor,
               RateModel* model) {
  constexpr int64_t m = 256, k = 1024, n = 256;
  std::mt19937 gen(1234);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<T> a(m * k), b(k * n), c(m * n);
  for (auto& v : a) v = u(gen) < 0.9 ? T(0) : T(u(gen) + 0.5);
  for (auto& v : b) v = T(u(gen) - 0.5);
  std::vector<int64_t> row_nnz(m), col_nnz(k), rows(m);
  for (int64_t i = 0; i < m; ++i) rows[i] = i;
  const int64_t nnz =
      CountNonzeros<T>(a.data(), m, k, false, row_nnz.data(), col_nnz.data(), pfor);
  Csr<T> csr;
  BuildCsr<T>(a.data(), m, k, false, rows.data(), m, row_nnz.data(), &csr, pfor);
  double best_d = 1e30, best_s = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    auto t0 = Clock::now();
    DenseGemm<T>(d, a.data(), m, k, false, b.data(), k, n, false, c.data(), m, n);
    auto t1 = Clock::now();
    CsrSpmm<T>(csr, rows.data(), m, b.data(), k, n, n, c.data(), n, pfor);
    auto t2 = Clock::now();
    best_d = std::min(best_d, Seconds(t0, t1));
    best_s = std::min(best_s, Seconds(t1, t2));
  }
  std::lock_guard<std::mutex> lock(model->mu);
  if (model->calibrated) return;
  model->dense_rate = 2.0 * m * k * n / std::max(best_d, 1e-9);
  model->sparse_rate = 2.0 * nnz * n / std::max(best_s, 1e-9);
  model->calibrated = true;
}

}  // namespace

template <typename T>
class SparseSplitMatMulOp : public tf::OpKernel {
 public:
  explicit SparseSplitMatMulOp(tf::OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("transpose_a", &ta_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("transpose_b", &tb_));
  }

  void Compute(tf::OpKernelContext* ctx) override {
    const auto t_start = Clock::now();
    const tf::Tensor& a = ctx->input(0);
    const tf::Tensor& b = ctx->input(1);
    const tf::Tensor& thr_t = ctx->input(2);
    OP_REQUIRES(ctx, tf::TensorShapeUtils::IsMatrix(a.shape()),
                tf::errors::InvalidArgument(
                    "SparseSplitMatMul: a must be a matrix (rank 2), got shape ",
                    a.shape().DebugString()));
    OP_REQUIRES(ctx, tf::TensorShapeUtils::IsMatrix(b.shape()),
                tf::errors::InvalidArgument(
                    "SparseSplitMatMul: b must be a matrix (rank 2), got shape ",
                    b.shape().DebugString()));
    OP_REQUIRES(ctx, tf::TensorShapeUtils::IsScalar(thr_t.shape()),
                tf::errors::InvalidArgument(
                    "SparseSplitMatMul: threshold must be a scalar, got shape ",
                    thr_t.shape().DebugString()));
    const float thr_in = thr_t.scalar<float>()();
    OP_REQUIRES(ctx, !std::isnan(thr_in) && thr_in <= 1.0f,
                tf::errors::InvalidArgument(
                    "SparseSplitMatMul: threshold must be in [0, 1] or negative "
                    "(automatic), got ", thr_in));
    const int64_t m = a.dim_size(ta_ ? 1 : 0), k = a.dim_size(ta_ ? 0 : 1);
    const int64_t kb = b.dim_size(tb_ ? 1 : 0), n = b.dim_size(tb_ ? 0 : 1);
    OP_REQUIRES(
        ctx, k == kb,
        tf::errors::InvalidArgument(
            "SparseSplitMatMul: inner dimensions differ: a shape ",
            a.shape().DebugString(), " (transpose_a=", ta_, ") and b shape ",
            b.shape().DebugString(), " (transpose_b=", tb_, ") give ", k,
            " vs ", kb));
    OP_REQUIRES(ctx, k < (int64_t{1} << 31),
                tf::errors::InvalidArgument(
                    "SparseSplitMatMul: inner dimension ", k,
                    " exceeds the 2^31-1 supported by the CSR indices"));

    tf::Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tf::TensorShape({m, n}), &out));
    tf::Tensor* stats_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, tf::TensorShape({kNumStats}),
                                             &stats_t));
    double* stats = stats_t->flat<double>().data();
    std::fill(stats, stats + kNumStats, 0.0);
    stats[kStatM] = m;
    stats[kStatK] = k;
    stats[kStatN] = n;
    stats[kStatThreshold] = thr_in < 0 ? 0.0 : thr_in;
    if (m == 0 || n == 0) return;
    T* c = out->flat<T>().data();
    const T* a_ptr = a.flat<T>().data();
    const T* b_ptr = b.flat<T>().data();
    const int64_t a_rows = a.dim_size(0), a_cols = a.dim_size(1);
    const int64_t b_rows = b.dim_size(0), b_cols = b.dim_size(1);
    ParallelFor pfor = MakeParallelFor(ctx);
    if (k == 0) {
      std::fill(c, c + m * n, T(0));
      stats[kStatRowsSparse] = m;
      stats[kStatHistogram] = m;
      return;
    }
    const auto& dev = ctx->eigen_device<Eigen::ThreadPoolDevice>();

    // --- Analysis: densities, live columns, threshold, row split. ---------
    std::vector<int64_t> row_nnz(m), col_nnz(k);
    const int64_t nnz = CountNonzeros<T>(a_ptr, a_rows, a_cols, ta_,
                                         row_nnz.data(), col_nnz.data(), pfor);
    std::vector<int64_t> live_cols;
    live_cols.reserve(k);
    for (int64_t j = 0; j < k; ++j)
      if (col_nnz[j] != 0) live_cols.push_back(j);
    const int64_t k_live = static_cast<int64_t>(live_cols.size());

    RateModel& rates = Rates<T>();
    double thr = thr_in;
    if (thr_in < 0) {
      if (!rates.calibrated) Calibrate<T>(dev, pfor, &rates);
      double ratio;
      {
        std::lock_guard<std::mutex> lock(rates.mu);
        ratio = rates.sparse_rate / std::max(rates.dense_rate, 1.0);
      }
      thr = std::min(1.0, std::max(0.0, ratio * k_live / static_cast<double>(k)));
    }
    std::vector<int64_t> dense_rows, sparse_rows;
    dense_rows.reserve(m);
    sparse_rows.reserve(m);
    int64_t nnz_sparse = 0;
    for (int64_t i = 0; i < m; ++i) {
      const double density = static_cast<double>(row_nnz[i]) / k;
      stats[kStatHistogram + DensityBin(density)] += 1;
      if (density > thr) {
        dense_rows.push_back(i);
      } else {
        sparse_rows.push_back(i);
        nnz_sparse += row_nnz[i];
      }
    }
    const int64_t rd = dense_rows.size(), rs = sparse_rows.size();
    const auto t_analyzed = Clock::now();

    // --- Dense part. --------------------------------------------------------
    double dense_flops = 0.0;
    // Compaction costs a gather of op(a) and op(b); when rows are gathered
    // anyway it is nearly free, otherwise require enough dead columns.
    const bool compact =
        rd > 0 && k_live < k && (rd < m || (k - k_live) * 16 >= k);
    if (rd > 0) {
      const bool all_rows = rd == m;
      const int64_t kc = compact ? k_live : k;
      dense_flops = 2.0 * rd * kc * n;
      if (all_rows && !compact) {
        DenseGemm<T>(dev, a_ptr, a_rows, a_cols, ta_, b_ptr, b_rows, b_cols,
                     tb_, c, m, n);
      } else {
        tf::Tensor ad_t, bc_t, cd_t;
        OP_REQUIRES_OK(ctx, ctx->allocate_temp(tf::DataTypeToEnum<T>::value,
                                               tf::TensorShape({rd, kc}), &ad_t));
        T* ad = ad_t.flat<T>().data();
        GatherSubmatrix<T>(a_ptr, a_rows, a_cols, ta_,
                           all_rows ? nullptr : dense_rows.data(), rd,
                           compact ? live_cols.data() : nullptr, kc, ad, pfor);
        const T* bc = b_ptr;
        int64_t bc_rows = b_rows, bc_cols = b_cols;
        bool bc_t_flag = tb_;
        if (compact) {
          // Rows live_cols of op(b): gather from b (transposed if tb).
          OP_REQUIRES_OK(ctx, ctx->allocate_temp(tf::DataTypeToEnum<T>::value,
                                                 tf::TensorShape({kc, n}), &bc_t));
          T* bcw = bc_t.flat<T>().data();
          GatherSubmatrix<T>(b_ptr, b_rows, b_cols, tb_, live_cols.data(), kc,
                             nullptr, n, bcw, pfor);
          bc = bcw;
          bc_rows = kc;
          bc_cols = n;
          bc_t_flag = false;
        }
        if (all_rows) {
          DenseGemm<T>(dev, ad, rd, kc, false, bc, bc_rows, bc_cols, bc_t_flag,
                       c, m, n);
        } else {
          OP_REQUIRES_OK(ctx, ctx->allocate_temp(tf::DataTypeToEnum<T>::value,
                                                 tf::TensorShape({rd, n}), &cd_t));
          T* cd = cd_t.flat<T>().data();
          DenseGemm<T>(dev, ad, rd, kc, false, bc, bc_rows, bc_cols, bc_t_flag,
                       cd, rd, n);
          ScatterRows<T>(cd, dense_rows.data(), rd, n, c, n, pfor);
        }
      }
    }
    const auto t_dense = Clock::now();

    // --- Sparse part. -------------------------------------------------------
    if (rs > 0) {
      if (nnz_sparse == 0) {
        ZeroRows<T>(sparse_rows.data(), rs, n, c, n, pfor);
      } else {
        Csr<T> csr;
        BuildCsr<T>(a_ptr, a_rows, a_cols, ta_, sparse_rows.data(), rs,
                    row_nnz.data(), &csr, pfor);
        const T* bd = b_ptr;
        tf::Tensor bt_t;
        if (tb_) {
          // The SpMM reads rows of op(b): materialise b^T once.
          OP_REQUIRES_OK(ctx, ctx->allocate_temp(tf::DataTypeToEnum<T>::value,
                                                 tf::TensorShape({k, n}), &bt_t));
          T* bt = bt_t.flat<T>().data();
          GatherSubmatrix<T>(b_ptr, b_rows, b_cols, true, nullptr, k, nullptr,
                             n, bt, pfor);
          bd = bt;
        }
        CsrSpmm<T>(csr, sparse_rows.data(), rs, bd, k, n, n, c, n, pfor);
      }
    }
    const auto t_sparse = Clock::now();

    const double time_dense = Seconds(t_analyzed, t_dense);
    const double time_sparse = Seconds(t_dense, t_sparse);
    rates.Update(&rates.dense_rate, dense_flops, time_dense);
    rates.Update(&rates.sparse_rate, 2.0 * nnz_sparse * n, time_sparse);

    stats[kStatRowsDense] = rd;
    stats[kStatRowsSparse] = rs;
    stats[kStatNnz] = nnz;
    // The SpMM never touches all-zero columns; the dense part skips them
    // only when it compacts.
    stats[kStatZeroColsSkipped] = (rd == 0 || compact) ? k - k_live : 0;
    stats[kStatTimeDense] = time_dense;
    stats[kStatTimeSparse] = time_sparse;
    stats[kStatTimeAnalyze] = Seconds(t_start, t_analyzed);
    stats[kStatThreshold] = thr;
    stats[kStatNnzSparse] = nnz_sparse;
  }

 private:
  bool ta_ = false, tb_ = false;
};

#define TFSS_REGISTER_CPU(T)                                             \
  REGISTER_KERNEL_BUILDER(Name("SparseSplitMatMul")                      \
                              .Device(tf::DEVICE_CPU)                    \
                              .TypeConstraint<T>("T")                    \
                              .HostMemory("threshold")                   \
                              .HostMemory("stats"),                      \
                          SparseSplitMatMulOp<T>);
TFSS_REGISTER_CPU(float)
TFSS_REGISTER_CPU(double)
#undef TFSS_REGISTER_CPU

}  // namespace tf_sparse_split
