// SparseSplitMatMul: CPU kernel (registration in cc/ops/sparse_split_matmul_ops.cc).
//
// product = op(a) * op(b), where op(a) [m, k] is the activation operand whose
// zeros are exploited (K.-Y. Peng, NTU 2017): rows of op(a) whose density
// (nnz / k) is above `threshold` go to TensorFlow's own CPU MatMul kernel
// (run in-process, on TF's intra-op thread pool), the others to the CSR SpMM of cc/kernels, and all-zero columns
// of op(a) are compacted away from the dense part together with the matching
// rows of op(b). A negative threshold lets the op choose it from rates it
// measured on this machine.
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <string>
#include <cmath>
#include <map>
#include <mutex>
#include <tuple>
#include <random>
#include <vector>
#include "cc/core/sparse_matmul.h"
#include "cc/kernels/epilogue.h"
#include "cc/kernels/sparse_split_matmul_common.h"
#include "cc/kernels/tf_kernel.h"
#include "cc/kernels/tf_parallel_for.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/node_def_util.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/public/version.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace tf_sparse_split {

namespace tf = ::tensorflow;
using tf::shape_inference::DimensionHandle;
using tf::shape_inference::InferenceContext;
using tf::shape_inference::ShapeHandle;


namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point t0, Clock::time_point t1) {
  return std::chrono::duration<double>(t1 - t0).count();
}



// Measured throughputs of the two paths on this machine for one problem
// family (dtype, k, n, transpose_b): dense GEMM flop/s and SpMM useful flop/s
// (2 * nnz * n per second). Seeded by a short calibration at that (k, n) the
// first time an automatic threshold is needed, then refined by an
// exponential moving average of every call's own timings.
struct RateModel {
  std::mutex mu;
  bool calibrated = false;
  double dense_rate = 0.0;
  double sparse_rate = 0.0;
  double copy_rate = 0.0;  // elements/s gathered into a dense submatrix

  void Update(double* rate, double flops, double seconds) {
    // Too-small parts are dominated by fixed overheads; skip them.
    if (flops < 2e7 || seconds <= 0.0) return;
    const double r = flops / seconds;
    std::lock_guard<std::mutex> lock(mu);
    *rate = *rate > 0.0 ? 0.8 * *rate + 0.2 * r : r;
  }
};

// The rate model of one problem family; entries live for the process.
RateModel& Rates(tf::DataType dtype, int64_t k, int64_t n, bool tb) {
  static std::mutex* mu = new std::mutex;
  static auto* models =
      new std::map<std::tuple<int, int64_t, int64_t, bool>, RateModel>;
  std::lock_guard<std::mutex> lock(*mu);
  return (*models)[std::make_tuple(static_cast<int>(dtype), k, n, tb)];
}

}  // namespace

template <typename T>
class SparseSplitMatMulOp : public tf::OpKernel {
 public:
  explicit SparseSplitMatMulOp(tf::OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("transpose_a", &ta_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("transpose_b", &tb_));
    // No GPU in this kernel: a heterogeneous split falls back to the normal
    // CPU split (same result) and says so in the statistics.
    OP_REQUIRES_OK(ctx, ctx->GetAttr("heterogeneous", &hetero_));
    OP_REQUIRES_OK(ctx, epilogue_.Init(ctx));  // optional bias + activation
    const tf::DataType dt = tf::DataTypeToEnum<T>::value;
    // op(a) as given; gathered rows of op(a) with op(b) as given; gathered
    // rows and compacted columns (op(b) gathered too, never transposed).
    OP_REQUIRES_OK(ctx, InitTfMatMul(ctx, tf::DEVICE_CPU, dt, ta_, tb_, &gemm_direct_));
    OP_REQUIRES_OK(ctx, InitTfMatMul(ctx, tf::DEVICE_CPU, dt, false, tb_, &gemm_gathered_));
    OP_REQUIRES_OK(ctx, InitTfMatMul(ctx, tf::DEVICE_CPU, dt, false, false,
                                     &gemm_compacted_));
  }

  void Compute(tf::OpKernelContext* ctx) override {
    const auto t_start = Clock::now();
    const tf::Tensor& a = ctx->input(0);
    const tf::Tensor& b = ctx->input(1);
    const tf::Tensor& thr_t = ctx->input(2);
    MatMulProblem prob;
    OP_REQUIRES_OK(ctx, ValidateMatMul(a, b, thr_t, ta_, tb_, &prob));
    OP_REQUIRES_OK(ctx, epilogue_.Validate(ctx, prob.n));
    const int64_t m = prob.m, k = prob.k, n = prob.n;
    const float thr_in = prob.threshold;

    tf::Tensor* stats_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, tf::TensorShape({kNumStats}),
                                             &stats_t));
    double* stats = stats_t->flat<double>().data();
    InitStats(prob, stats);
    stats[kStatHeterogeneous] = hetero_ ? kHeteroCpuFallback : kHeteroOff;
    const tf::TensorShape out_shape({m, n});
    if (m == 0 || n == 0 || k == 0) {
      tf::Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, out_shape, &out));
      out->flat<T>().setZero();
      // No work, but the statistics still describe op(a): its nonzeros and
      // row densities (an empty row, k = 0, counts as density 0).
      stats[kStatRowsSparse] = m;
      if (m > 0 && k > 0) {
        std::vector<int64_t> row_nnz(m), col_nnz(k);
        stats[kStatNnz] = CountNonzeros<T>(
            a.flat<T>().data(), a.dim_size(0), a.dim_size(1), ta_,
            row_nnz.data(), col_nnz.data(), TfParallelFor(ctx));
        for (int64_t i = 0; i < m; ++i)
          stats[kStatHistogram +
                DensityBin(static_cast<double>(row_nnz[i]) / k)] += 1;
        stats[kStatNnzSparse] = stats[kStatNnz];
      } else if (m > 0) {
        stats[kStatHistogram] = m;
      }
      OP_REQUIRES_OK(ctx, epilogue_.ApplyCpu<T>(ctx));  // act(0 + bias)
      return;
    }
    const T* a_ptr = a.flat<T>().data();
    const T* b_ptr = b.flat<T>().data();
    const int64_t a_rows = a.dim_size(0), a_cols = a.dim_size(1);
    const int64_t b_rows = b.dim_size(0), b_cols = b.dim_size(1);
    ParallelFor pfor = TfParallelFor(ctx);

    // --- Analysis: densities, live columns, threshold, row split. ---------
    std::vector<int64_t> row_nnz(m), col_nnz(k);
    const int64_t nnz = CountNonzeros<T>(a_ptr, a_rows, a_cols, ta_,
                                         row_nnz.data(), col_nnz.data(), pfor);
    const std::vector<int64_t> live_cols = LiveColumns(col_nnz.data(), k);
    const int64_t k_live = static_cast<int64_t>(live_cols.size());

    RateModel& rates = Rates(tf::DataTypeToEnum<T>::value, k, n, tb_);
    double thr = thr_in;
    if (thr_in < 0) {
      if (!rates.calibrated) {
        OP_REQUIRES_OK(ctx, Calibrate(ctx, b, k, n, pfor, &rates));
      }
      double ratio;
      {
        std::lock_guard<std::mutex> lock(rates.mu);
        ratio = rates.sparse_rate / std::max(rates.dense_rate, 1.0);
      }
      thr = std::min(1.0, std::max(0.0, ratio * k_live / static_cast<double>(k)));
    }
    RowSplit split = SplitRows(row_nnz.data(), m, k, thr, stats);
    std::vector<int64_t>& dense_rows = split.dense_rows;
    std::vector<int64_t>& sparse_rows = split.sparse_rows;
    if (thr_in < 0 && !dense_rows.empty() && !sparse_rows.empty()) {
      // A split gathers the dense rows and scatters their product; when the
      // predicted saving does not cover that copy, every row goes dense.
      double dense_rate, sparse_rate, copy_rate;
      {
        std::lock_guard<std::mutex> lock(rates.mu);
        dense_rate = std::max(rates.dense_rate, 1.0);
        sparse_rate = std::max(rates.sparse_rate, 1.0);
        copy_rate = std::max(rates.copy_rate, 1.0);
      }
      const double rd_ = dense_rows.size();
      const double all_k = (k - k_live) * 16 >= k ? k_live : k;
      const double t_all = 2.0 * m * all_k * n / dense_rate;
      const double t_split = 2.0 * rd_ * k_live * n / dense_rate +
                             2.0 * split.nnz_sparse * n / sparse_rate +
                             rd_ * (k_live + n) / copy_rate;
      if (t_split >= t_all) {
        AllRowsDense(m, &split);
        thr = 0.0;
      }
    }
    const int64_t rd = dense_rows.size(), rs = sparse_rows.size();
    const auto t_analyzed = Clock::now();

    // --- Dense part. --------------------------------------------------------
    // Compaction saves 2 * rd * (k - k_live) * n flops and costs a gather of
    // the live rows of op(b) (and of op(a) when its rows are not gathered
    // anyway): decided with the measured rates once calibrated, else by a
    // fixed rule (at least 1/16 of the columns dead).
    bool compact = rd > 0 && k_live < k;
    if (compact) {
      std::lock_guard<std::mutex> lock(rates.mu);
      if (rates.calibrated) {
        const double saved = 2.0 * rd * (k - k_live) * n / rates.dense_rate;
        const double copied =
            static_cast<double>(k_live) * n + (rd == m ? rd * k_live : 0.0);
        compact = saved > copied / rates.copy_rate;
      } else {
        compact = rd < m || (k - k_live) * 16 >= k;
      }
    }
    const int64_t kc = compact ? k_live : k;
    tf::Tensor* out = nullptr;
    if (rd < m) {
      // A split: the dense rows are scattered into (and the sparse rows
      // written straight to) an output buffer of our own.
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, out_shape, &out));
    }
    if (rd == m && !compact) {
      // Every row dense, nothing to compact: TF's GEMM on the inputs as
      // they are; its result is the output (no copy).
      tf::Tensor product;
      OP_REQUIRES_OK(ctx, gemm_direct_.Run(ctx, {&a, &b}, &product));
      ctx->set_output(0, product);
    } else if (rd > 0) {
      const tf::DataType dt = tf::DataTypeToEnum<T>::value;
      tf::Tensor ad_t, bc_t, cd_t;
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(dt, tf::TensorShape({rd, kc}), &ad_t));
      GatherSubmatrix<T>(a_ptr, a_rows, a_cols, ta_,
                         rd == m ? nullptr : dense_rows.data(), rd,
                         compact ? live_cols.data() : nullptr, kc,
                         ad_t.flat<T>().data(), pfor);
      if (compact) {
        // Rows live_cols of op(b), gathered from b (read transposed if tb).
        OP_REQUIRES_OK(ctx, ctx->allocate_temp(dt, tf::TensorShape({kc, n}), &bc_t));
        GatherSubmatrix<T>(b_ptr, b_rows, b_cols, tb_, live_cols.data(), kc,
                           nullptr, n, bc_t.flat<T>().data(), pfor);
        OP_REQUIRES_OK(ctx, gemm_compacted_.Run(ctx, {&ad_t, &bc_t}, &cd_t));
      } else {
        OP_REQUIRES_OK(ctx, gemm_gathered_.Run(ctx, {&ad_t, &b}, &cd_t));
      }
      if (rd == m) {
        ctx->set_output(0, cd_t);
      } else {
        ScatterRows<T>(cd_t.flat<T>().data(), dense_rows.data(), rd, n,
                       out->flat<T>().data(), n, pfor);
      }
    }
    const auto t_dense = Clock::now();

    // --- Sparse part. -------------------------------------------------------
    if (rs > 0) {
      T* c = out->flat<T>().data();
      if (split.nnz_sparse == 0) {
        ZeroRows<T>(sparse_rows.data(), rs, n, c, n, pfor);
      } else {
        Csr<T> csr;
        BuildCsr<T>(a_ptr, a_rows, a_cols, ta_, sparse_rows.data(), rs,
                    row_nnz.data(), col_nnz.data(), &csr, pfor);
        const T* bd = b_ptr;
        tf::Tensor bt_t;
        if (tb_) {
          // The SpMM reads rows of op(b): materialise b^T once.
          OP_REQUIRES_OK(ctx, ctx->allocate_temp(tf::DataTypeToEnum<T>::value,
                                                 tf::TensorShape({k, n}), &bt_t));
          GatherSubmatrix<T>(b_ptr, b_rows, b_cols, true, nullptr, k, nullptr,
                             n, bt_t.flat<T>().data(), pfor);
          bd = bt_t.flat<T>().data();
        }
        CsrSpmm<T>(csr, sparse_rows.data(), rs, bd, k, n, n, c, n, pfor);
      }
    }
    const auto t_sparse = Clock::now();

    const double time_dense = Seconds(t_analyzed, t_dense);
    const double time_sparse = Seconds(t_dense, t_sparse);
    rates.Update(&rates.dense_rate, 2.0 * rd * kc * n, time_dense);
    rates.Update(&rates.sparse_rate, 2.0 * split.nnz_sparse * n, time_sparse);

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
    stats[kStatNnzSparse] = split.nnz_sparse;
    // product = act(product + bias) on every row, after both parts.
    OP_REQUIRES_OK(ctx, epilogue_.ApplyCpu<T>(ctx));
  }

 private:
  // Times both paths (and a row gather) once on synthetic data of this
  // call's (k, n): a random op(a) of clamp(2^22 / k, 16, 256) rows at 90%
  // sparsity against the real b, keeping the best of 3 runs each.
  absl::Status Calibrate(tf::OpKernelContext* ctx, const tf::Tensor& b,
                         int64_t k, int64_t n, const ParallelFor& pfor,
                         RateModel* model) const {
    const int64_t m = std::max<int64_t>(16, std::min<int64_t>(256, (1 << 22) / std::max<int64_t>(1, k)));
    const tf::DataType dt = tf::DataTypeToEnum<T>::value;
    tf::Tensor a_t, bt_t;
    TF_RETURN_IF_ERROR(ctx->allocate_temp(dt, tf::TensorShape({m, k}), &a_t));
    T* a = a_t.flat<T>().data();
    std::mt19937 gen(1234);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    for (int64_t i = 0; i < m * k; ++i) a[i] = u(gen) < 0.9 ? T(0) : T(u(gen) + 0.5);
    std::vector<int64_t> row_nnz(m), col_nnz(k), rows(m);
    for (int64_t i = 0; i < m; ++i) rows[i] = i;
    const int64_t nnz =
        CountNonzeros<T>(a, m, k, false, row_nnz.data(), col_nnz.data(), pfor);
    Csr<T> csr;
    BuildCsr<T>(a, m, k, false, rows.data(), m, row_nnz.data(), nullptr, &csr,
                pfor);
    const T* bd = b.flat<T>().data();
    if (tb_) {
      TF_RETURN_IF_ERROR(ctx->allocate_temp(dt, tf::TensorShape({k, n}), &bt_t));
      GatherSubmatrix<T>(bd, n, k, true, nullptr, k, nullptr, n,
                         bt_t.flat<T>().data(), pfor);
      bd = bt_t.flat<T>().data();
    }
    std::vector<T> c(m * n), gathered(m * k);
    double best_d = 1e30, best_s = 1e30, best_c = 1e30;
    for (int rep = 0; rep < 3; ++rep) {
      tf::Tensor product;
      const auto t0 = Clock::now();
      TF_RETURN_IF_ERROR(gemm_gathered_.Run(ctx, {&a_t, &b}, &product));
      const auto t1 = Clock::now();
      CsrSpmm<T>(csr, rows.data(), m, bd, k, n, n, c.data(), n, pfor);
      const auto t2 = Clock::now();
      GatherSubmatrix<T>(a, m, k, false, rows.data(), m, nullptr, k,
                         gathered.data(), pfor);
      const auto t3 = Clock::now();
      best_d = std::min(best_d, Seconds(t0, t1));
      best_s = std::min(best_s, Seconds(t1, t2));
      best_c = std::min(best_c, Seconds(t2, t3));
    }
    std::lock_guard<std::mutex> lock(model->mu);
    if (!model->calibrated) {
      model->dense_rate = 2.0 * m * k * n / std::max(best_d, 1e-9);
      model->sparse_rate = 2.0 * nnz * n / std::max(best_s, 1e-9);
      model->copy_rate = static_cast<double>(m) * k / std::max(best_c, 1e-9);
      model->calibrated = true;
    }
    return absl::OkStatus();
  }

  bool ta_ = false, tb_ = false, hetero_ = false;
  TfKernel gemm_direct_, gemm_gathered_, gemm_compacted_;
  MatMulEpilogue epilogue_;
};

#define TFSS_REGISTER_CPU(T)                                             \
  REGISTER_KERNEL_BUILDER(Name("TfSparseSplit>SparseSplitMatMul")                      \
                              .Device(tf::DEVICE_CPU)                    \
                              .TypeConstraint<T>("T")                    \
                              .HostMemory("threshold")                   \
                              .HostMemory("stats"),                      \
                          SparseSplitMatMulOp<T>);
TFSS_REGISTER_CPU(float)
TFSS_REGISTER_CPU(double)
#undef TFSS_REGISTER_CPU

}  // namespace tf_sparse_split
