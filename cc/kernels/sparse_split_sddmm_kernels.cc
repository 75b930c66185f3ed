// SparseSplitSddmm: CPU kernel (registration in cc/ops/sparse_split_sddmm_ops.cc).
//
// product = (x * op(b)^T) restricted to the nonzeros of mask: the input
// gradient dA = dY * op(b)^T of a product a * op(b) where a came through a
// ReLU-family activation (its gradient is zero wherever a is), exploiting
// the zeros of the activation in the gradient as well (R. Sun and L. Zhang,
// "Dynamic Sparse Method for Deep Learning Execution", 2019: sparsity per
// layer and per component of training). The rows of the mask are split like
// the rows of a SparseSplitMatMul activation (split_runtime.h): rows above
// the threshold go to TF's own MatMul (x rows * op(b)^T), whose output is
// then masked; the others to the CSR SDDMM of cc/core (one dot of length n
// per nonzero of the mask). The cost model (cc/core/cost_model.h,
// SddmmSplitShape) chooses the split for a negative threshold, after
// choosing how much of the mask to count (SplitCall::ChooseAnalysis: all of
// it, a strided sample or nothing when the GEMM stays the choice).
#include <algorithm>
#include <numeric>
#include <vector>

#include "cc/core/cost_model.h"
#include "cc/core/sparse_matmul.h"
#include "cc/kernels/sparse_split_matmul_common.h"
#include "cc/kernels/core_types.h"
#include "cc/kernels/split_runtime.h"
#include "cc/kernels/tf_kernel.h"
#include "cc/kernels/transposed_product.h"
#include "cc/kernels/tf_parallel_for.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace tf_sparse_split {

namespace tf = ::tensorflow;

namespace {

// Checks ranks and sizes: mask [m, k], x [m, n], op(b) [k, n], a scalar
// threshold in [0, 1] or negative; InvalidArgument naming the shapes.
absl::Status ValidateSddmm(const tf::Tensor& mask, const tf::Tensor& x,
                           const tf::Tensor& b, const tf::Tensor& threshold,
                           bool tb, MatMulProblem* p) {
  for (const auto& [t, name] :
       {std::pair<const tf::Tensor*, const char*>{&mask, "mask"},
        {&x, "x"}, {&b, "b"}}) {
    if (!tf::TensorShapeUtils::IsMatrix(t->shape()))
      return tf::errors::InvalidArgument(
          "SparseSplitSddmm: ", name, " must be a matrix (rank 2), got shape ",
          t->shape().DebugString());
  }
  if (!tf::TensorShapeUtils::IsScalar(threshold.shape()))
    return tf::errors::InvalidArgument(
        "SparseSplitSddmm: threshold must be a scalar, got shape ",
        threshold.shape().DebugString());
  p->threshold = threshold.scalar<float>()();
  if (std::isnan(p->threshold) || p->threshold > 1.0f)
    return tf::errors::InvalidArgument(
        "SparseSplitSddmm: threshold must be in [0, 1] or negative "
        "(automatic), got ", p->threshold);
  p->m = mask.dim_size(0);
  p->k = mask.dim_size(1);
  p->n = x.dim_size(1);
  const int64_t bk = b.dim_size(tb ? 1 : 0), bn = b.dim_size(tb ? 0 : 1);
  if (x.dim_size(0) != p->m || bk != p->k || bn != p->n)
    return tf::errors::InvalidArgument(
        "SparseSplitSddmm: shapes must be mask [m, k], x [m, n] and b [k, n] "
        "([n, k] with transpose_b); got mask ", mask.shape().DebugString(),
        ", x ", x.shape().DebugString(), ", b ", b.shape().DebugString(),
        " (transpose_b=", tb, ")");
  if (p->k >= (int64_t{1} << 31))
    return tf::errors::InvalidArgument(
        "SparseSplitSddmm: mask has ", p->k,
        " columns, more than the 2^31-1 supported by the CSR indices");
  return absl::OkStatus();
}

// The calibration functor of split_runtime.h: samples are the first rows of
// the mask (rows of x alike); the dense path is TF's MatMul of the rows of x
// by op(b)^T, then masked; the sparse path builds the rows' CSR and runs the
// SDDMM.
template <typename T>
struct SddmmPaths {
  tf::OpKernelContext* ctx;
  const tf::Tensor& mask;
  const tf::Tensor& x;
  const tf::Tensor& b;
  bool tb;
  int64_t k, n;
  const TfKernel& gemm;  // x * op(b)^T
  const ParallelFor& pfor;
  TransposedProductChoice* swap;  // how to run x b^T (b [k, n], !tb)

  absl::Status Sample(int64_t rows, tf::Tensor* sample) {
    *sample = mask.Slice(0, rows);
    return absl::OkStatus();
  }

  absl::Status RunDense(const tf::Tensor& sample) {
    const int64_t rows = sample.dim_size(0);
    const tf::Tensor xs = x.Slice(0, rows);
    tf::Tensor product;
    TF_RETURN_IF_ERROR(
        tb ? gemm.Run(ctx, {&xs, &b}, &product)
           : RunTransposedProduct<T>(ctx, gemm, xs, b, swap, &product));
    CoreType<T>* c = AsCore(product.flat<T>().data());
    MaskedCopyRows<CoreType<T>>(AsCore(sample.flat<T>().data()), k, nullptr, rows, c,
                             c, k, pfor);
    return absl::OkStatus();
  }

  absl::Status RunSparse(const tf::Tensor& sample, const int64_t* row_nnz) {
    std::vector<int64_t> idx;
    Csr<CoreType<T>> csr;
    SampleCsr<T>(sample, k, row_nnz, pfor, &idx, &csr);
    const int64_t rows = sample.dim_size(0);
    tf::Tensor bt_t;
    const T* y = nullptr;
    TF_RETURN_IF_ERROR(OperandY(&bt_t, &y));
    tf::Tensor c;  // CsrSddmm writes every value of its rows, zeros too
    TF_RETURN_IF_ERROR(CalibrationOutput<T>(ctx, rows * k, &c));
    CsrSddmm<CoreType<T>>(csr, idx.data(), rows, AsCore(x.flat<T>().data()), n,
                       AsCore(y), n, k, n, AsCore(c.flat<T>().data()), k,
                       pfor);
    return absl::OkStatus();
  }

  absl::Status OperandY(tf::Tensor* bt_t, const T** y) {
    return RowMajorOpB<T>(ctx, b, tb, k, n, pfor, bt_t, y);
  }
};

}  // namespace

template <typename T>
class SparseSplitSddmmOp : public tf::OpKernel {
 public:
  explicit SparseSplitSddmmOp(tf::OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("transpose_b", &tb_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("full_stats", &full_stats_));
    // x [m, n] * op(b)^T: b [k, n] read transposed, or b [n, k] as is.
    OP_REQUIRES_OK(ctx, InitTfMatMul(ctx, tf::DEVICE_CPU,
                                     tf::DataTypeToEnum<T>::value, false, !tb_,
                                     &gemm_));
  }

  void Compute(tf::OpKernelContext* ctx) override {
    const tf::Tensor& mask = ctx->input(0);
    const tf::Tensor& x = ctx->input(1);
    const tf::Tensor& b = ctx->input(2);
    MatMulProblem prob;
    OP_REQUIRES_OK(ctx, ValidateSddmm(mask, x, b, ctx->input(3), tb_, &prob));
    const int64_t m = prob.m, k = prob.k, n = prob.n;
    SplitCall call(ctx, 1, m, k, n, prob.threshold);
    OP_REQUIRES_OK(ctx, call.status());
    // Sparse rows and compaction only where the calibration's terms agree
    // (DecisionPolicy::calibration, cost_model.h).
    call.set_calibration_check(true);
    const tf::TensorShape out_shape({m, k});
    const CoreType<T>* mask_ptr = AsCore(mask.flat<T>().data());
    ParallelFor pfor = TfParallelFor(ctx);

    const tf::DataType dt = tf::DataTypeToEnum<T>::value;
    FamilyModel& family = families_.Get(kFamilySddmmCpu, dt, m, k, n, tb_);

    // --- How much to count: everything, a sample, or nothing. -------------
    if (m > 0 && n > 0 && k > 0) {
      const SplitShape dense_shape = SddmmSplitShape(m, k, k, n);
      const AnalysisMode mode =
          call.ChooseAnalysis(dense_shape, &family, &plans_, full_stats_);
      if (mode == AnalysisMode::kSkip) {
        call.SkipAnalysis(dense_shape, &family, &plans_);
      } else if (mode == AnalysisMode::kSample) {
        const int64_t stride = call.SampleStrideFor(dense_shape, &family, m, k);
        if (stride > 1) {
          SampledCounts sc;
          CountSample<CoreType<T>>(mask_ptr, m, k, false, stride, pfor, &sc);
          call.AcceptSample(dense_shape, sc, &family, &plans_);
        }
      }
      if (call.dense_without_count()) {
        // TF's GEMM on every row, then masked (the mask is read anyway).
        tf::Tensor product;
        OP_REQUIRES_OK(ctx, Product(ctx, x, b, &product));
        CoreType<T>* c = AsCore(product.flat<T>().data());
        MaskedCopyRows<CoreType<T>>(mask_ptr, k, nullptr, m, c, c, k, pfor);
        ctx->set_output(0, product);
        call.DenseDone();
        call.SparseDone();
        call.Finish(0, 0);
        return;
      }
    }

    // --- Analysis: densities of the mask's rows. ---------------------------
    std::vector<int64_t> row_nnz(m), col_nnz(k);
    const int64_t nnz =
        m > 0 && k > 0 ? CountNonzeros<CoreType<T>>(mask_ptr, m, k, false, row_nnz.data(),
                                          col_nnz.data(), pfor)
                       : 0;
    if (call.automatic()) call.CountDone(&family, static_cast<double>(m) * k);
    if (m == 0 || k == 0 || n == 0 || nnz == 0) {
      // No dot to compute: every output is 0.
      tf::Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, out_shape, &out));
      out->flat<T>().setZero();
      call.FinishEmpty(m, k, k > 0 ? row_nnz.data() : nullptr);
      return;
    }
    const int64_t k_live = static_cast<int64_t>(
        std::count_if(col_nnz.begin(), col_nnz.end(),
                      [](int64_t c) { return c != 0; }));

    // --- Decision (cost model, calibrated on the first automatic call). ---
    SddmmPaths<T> paths{ctx, mask, x, b, tb_, k, n, gemm_, pfor, &swap_};
    OP_REQUIRES_OK(ctx, call.Decide<T>(ctx, paths,
                                       SddmmSplitShape(m, k, k_live, n),
                                       row_nnz.data(), &family, &plans_, pfor));
    const std::vector<int64_t>& dense_rows = call.split().dense_rows;
    const std::vector<int64_t>& sparse_rows = call.split().sparse_rows;
    const int64_t rd = call.rows_dense(), rs = call.rows_sparse();

    // --- Dense part: TF's MatMul on the dense rows of x, then masked. ------
    tf::Tensor* out = nullptr;
    if (rd == m) {
      tf::Tensor product;
      OP_REQUIRES_OK(ctx, Product(ctx, x, b, &product));
      CoreType<T>* c = AsCore(product.flat<T>().data());
      MaskedCopyRows<CoreType<T>>(mask_ptr, k, nullptr, m, c, c, k, pfor);
      ctx->set_output(0, product);
    } else {
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, out_shape, &out));
      if (rd > 0) {
        tf::Tensor xd, cd;
        OP_REQUIRES_OK(ctx, ctx->allocate_temp(x.dtype(),
                                               tf::TensorShape({rd, n}), &xd));
        GatherSubmatrix<CoreType<T>>(AsCore(x.flat<T>().data()), m, n, false,
                                  dense_rows.data(), rd, nullptr, n,
                                  AsCore(xd.flat<T>().data()), pfor);
        OP_REQUIRES_OK(ctx, Product(ctx, xd, b, &cd));
        MaskedCopyRows<CoreType<T>>(mask_ptr, k, dense_rows.data(), rd,
                                 AsCore(cd.flat<T>().data()),
                                 AsCore(out->flat<T>().data()), k, pfor);
      }
    }
    call.DenseDone();

    // --- Sparse part: CSR of the sparse rows, SDDMM. -----------------------
    if (rs > 0) {
      CoreType<T>* c = AsCore(out->flat<T>().data());
      if (call.split().nnz_sparse == 0) {
        ZeroRows<CoreType<T>>(sparse_rows.data(), rs, k, c, k, pfor);
      } else {
        Csr<CoreType<T>> csr;
        BuildCsr<CoreType<T>>(mask_ptr, m, k, false, sparse_rows.data(), rs,
                    row_nnz.data(), col_nnz.data(), &csr, pfor);
        tf::Tensor bt_t;
        const T* y = nullptr;
        OP_REQUIRES_OK(ctx, paths.OperandY(&bt_t, &y));
        CsrSddmm<CoreType<T>>(csr, sparse_rows.data(), rs, AsCore(x.flat<T>().data()), n, AsCore(y), n,
                    k, n, c, k, pfor);
      }
    }
    call.SparseDone();
    call.Finish(nnz, 0);
  }

 private:
  // x op(b)^T by TF's MatMul: with b [k, n] read transposed (!tb_), as is
  // or swapped, the way this op chose for the shape (transposed_product.h).
  absl::Status Product(tf::OpKernelContext* ctx, const tf::Tensor& x,
                       const tf::Tensor& b, tf::Tensor* product) {
    if (tb_) return gemm_.Run(ctx, {&x, &b}, product);
    return RunTransposedProduct<T>(ctx, gemm_, x, b, &swap_, product);
  }

  bool tb_ = false;
  bool full_stats_ = true;
  TfKernel gemm_;
  TransposedProductChoice swap_;  // per shape, for b read transposed
  FamilyCache families_;  // the cost-model family of the last call's sizes
  PlanMemory plans_;  // this op's last plan (hysteresis)
};

#define TFSS_REGISTER_CPU(T)                                        \
  REGISTER_KERNEL_BUILDER(Name("TfSparseSplit>SparseSplitSddmm")    \
                              .Device(tf::DEVICE_CPU)               \
                              .TypeConstraint<T>("T")               \
                              .HostMemory("threshold")              \
                              .HostMemory("stats"),                 \
                          SparseSplitSddmmOp<T>);
TFSS_REGISTER_CPU(float)
TFSS_REGISTER_CPU(double)
TFSS_REGISTER_CPU(Eigen::bfloat16)
TFSS_REGISTER_CPU(Eigen::half)
#undef TFSS_REGISTER_CPU

}  // namespace tf_sparse_split
