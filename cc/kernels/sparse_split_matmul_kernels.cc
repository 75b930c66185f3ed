// SparseSplitMatMul: CPU kernel (registration in cc/ops/sparse_split_matmul_ops.cc).
//
// product = op(a) * op(b), where op(a) [m, k] is the activation operand whose
// zeros are exploited (K.-Y. Peng, NTU 2017): rows of op(a) whose density
// (nnz / k) is above `threshold` go to TensorFlow's own CPU MatMul kernel
// (run in-process, on TF's intra-op thread pool), the others to the CSR SpMM
// of cc/core, and all-zero columns of op(a) are compacted away from the dense
// part together with the matching rows of op(b). The call runs through the
// split runtime (split_runtime.h): analyse -> decide -> dense -> sparse ->
// record. A negative threshold lets the cost model of cc/core/cost_model.h
// choose the split from terms measured on this machine; such a call first
// asks how much of the analysis it needs (SplitCall::ChooseAnalysis): on a
// layer that stays dense it counts a strided sample of the activation, or
// nothing at all, and runs TF's kernel at once. An all-dense call with a
// bias and no activation (float32) runs TF's fused MatMul + BiasAdd kernel
// (what Grappler fuses tf.matmul + bias into) instead of MatMul and the
// epilogue pass.
#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "cc/core/cost_model.h"
#include "cc/core/sparse_matmul.h"
#include "cc/kernels/core_types.h"
#include "cc/kernels/epilogue.h"
#include "cc/kernels/sparse_split_matmul_common.h"
#include "cc/kernels/split_runtime.h"
#include "cc/kernels/tf_kernel.h"
#include "cc/kernels/tf_parallel_for.h"
#include "cc/kernels/transposed_product.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace tf_sparse_split {

namespace tf = ::tensorflow;

namespace {

// The calibration functor of split_runtime.h for a product: samples are
// gathered rows of op(a) [rows, k]; the dense path is TF's MatMul on them
// and b; the sparse path builds their CSR and runs the SpMM (materialising
// op(b) = b^T first when transpose_b, as a call does).
template <typename T>
struct MatMulPaths {
  tf::OpKernelContext* ctx;
  const tf::Tensor& a;
  const tf::Tensor& b;
  bool ta, tb;
  int64_t k, n;
  const TfKernel& gemm_gathered;  // op(sample) = sample, op(b) as given
  const ParallelFor& pfor;
  TransposedProductChoice* swap;  // how to run sample b^T (tb)

  absl::Status Sample(int64_t rows, tf::Tensor* sample) {
    if (!ta) {
      *sample = a.Slice(0, rows);
      return absl::OkStatus();
    }
    TF_RETURN_IF_ERROR(ctx->allocate_temp(a.dtype(), tf::TensorShape({rows, k}),
                                          sample));
    GatherSubmatrix<CoreType<T>>(AsCore(a.flat<T>().data()), a.dim_size(0),
                              a.dim_size(1), true, nullptr, rows, nullptr, k,
                              AsCore(sample->flat<T>().data()), pfor);
    return absl::OkStatus();
  }

  absl::Status RunDense(const tf::Tensor& sample) {
    tf::Tensor product;
    if (tb)
      return RunTransposedProduct<T>(ctx, gemm_gathered, sample, b, swap,
                                     &product);
    return gemm_gathered.Run(ctx, {&sample, &b}, &product);
  }

  absl::Status RunSparse(const tf::Tensor& sample, const int64_t* row_nnz) {
    std::vector<int64_t> idx;
    Csr<CoreType<T>> csr;
    SampleCsr<T>(sample, k, row_nnz, pfor, &idx, &csr);
    const int64_t rows = sample.dim_size(0);
    tf::Tensor bt_t;
    const T* bd = nullptr;
    TF_RETURN_IF_ERROR(OperandB(&bt_t, &bd));
    tf::Tensor c;  // CsrSpmm overwrites the rows it is given
    TF_RETURN_IF_ERROR(CalibrationOutput<T>(ctx, rows * n, &c));
    CsrSpmm<CoreType<T>>(csr, idx.data(), rows, AsCore(bd), k, n, n,
                      AsCore(c.flat<T>().data()), n, pfor);
    return absl::OkStatus();
  }

  absl::Status OperandB(tf::Tensor* bt_t, const T** bd) {
    return RowMajorOpB<T>(ctx, b, tb, k, n, pfor, bt_t, bd);
  }
};

// The CPU's gather and scatter for RunMatMulDensePart.
template <typename T>
struct CpuDevice {
  const ParallelFor& pfor;

  absl::Status Gather(const tf::Tensor& src, bool transpose,
                      const int64_t* rows, int64_t n_rows, const int64_t* cols,
                      int64_t n_cols, tf::Tensor* out) {
    GatherSubmatrix<CoreType<T>>(AsCore(src.flat<T>().data()), src.dim_size(0),
                              src.dim_size(1), transpose, rows, n_rows, cols,
                              n_cols, AsCore(out->flat<T>().data()), pfor);
    return absl::OkStatus();
  }
  absl::Status Scatter(const tf::Tensor& src, const int64_t* rows,
                       int64_t n_rows, int64_t n, tf::Tensor* out) {
    ScatterRows<CoreType<T>>(AsCore(src.flat<T>().data()), rows, n_rows, n,
                          AsCore(out->flat<T>().data()), n, pfor);
    return absl::OkStatus();
  }
};

}  // namespace

template <typename T>
class SparseSplitMatMulOp : public tf::OpKernel {
 public:
  explicit SparseSplitMatMulOp(tf::OpKernelConstruction* ctx) : OpKernel(ctx) {
    // No GPU in this kernel: a heterogeneous split falls back to the normal
    // CPU split (same result) and says so in the statistics.
    OP_REQUIRES_OK(ctx, mm_.Init(ctx, tf::DEVICE_CPU, tf::DataTypeToEnum<T>::value));
    OP_REQUIRES_OK(ctx, epilogue_.Init(ctx));  // optional bias + activation
    OP_REQUIRES_OK(ctx, ctx->GetAttr("full_stats", &full_stats_));
    // TF's fused kernel for the all-dense calls with a bias: BiasAdd, and
    // Relu/Relu6, as its post-ops -- what a tf.function graph that
    // Grappler fused runs. With an activation only oneDNN's kernel: its
    // eltwise relu/relu6 maps NaN to 0 (max(x, 0)), and the epilogue of the
    // split and sparse plans then does the same (set_nan_to_zero), so the
    // answer never depends on the plan and equals the fused graph's. Where
    // TF has no oneDNN kernel for the dtype (float64; float16 on CPUs
    // without it) its graph runs MatMul, BiasAdd and Relu, which keep NaN:
    // so do all plans here (MatMul + the epilogue's one pass).
    int num_bias = 0;
    std::string act;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_bias", &num_bias));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("activation", &act));
    if (num_bias == 1) {
      std::vector<std::string> fused_ops = {"BiasAdd"};
      if (act == "relu") fused_ops.push_back("Relu");
      if (act == "relu6") fused_ops.push_back("Relu6");
      const bool with_act = fused_ops.size() > 1;
      bool onednn = false;
      if (!InitTfFusedMatMul(ctx, tf::DEVICE_CPU, tf::DataTypeToEnum<T>::value,
                             mm_.ta, mm_.tb, fused_ops, &fused_, &onednn)
               .ok() ||
          (with_act && !onednn)) {
        fused_ = TfKernel();
      }
      epilogue_.set_nan_to_zero(fused_.ok() && with_act);
    }
  }

  void Compute(tf::OpKernelContext* ctx) override {
    const tf::Tensor& a = ctx->input(0);
    const tf::Tensor& b = ctx->input(1);
    MatMulProblem prob;
    OP_REQUIRES_OK(ctx, ValidateMatMul(a, b, ctx->input(2), mm_.ta, mm_.tb, &prob));
    OP_REQUIRES_OK(ctx, epilogue_.Validate(ctx, prob.n));
    const int64_t m = prob.m, k = prob.k, n = prob.n;
    SplitCall call(ctx, 1, m, k, n, prob.threshold);
    OP_REQUIRES_OK(ctx, call.status());
    call.stats()[kStatHeterogeneous] = mm_.hetero ? kHeteroCpuFallback : kHeteroOff;
    // Sparse rows and compaction only where the calibration's terms agree
    // (DecisionPolicy::calibration, cost_model.h).
    call.set_calibration_check(true);
    const CoreType<T>* a_ptr = AsCore(a.flat<T>().data());
    const int64_t a_rows = a.dim_size(0), a_cols = a.dim_size(1);

    const tf::DataType dt = tf::DataTypeToEnum<T>::value;
    FamilyModel& family =
        families_.Get(kFamilyMatMulCpu, dt, m, k, n, mm_.tb);

    // --- How much to count: everything, a sample, or nothing. -------------
    if (m > 0 && n > 0 && k > 0) {
      const SplitShape dense_shape = MatMulSplitShape(m, k, k, n, !mm_.tb);
      const AnalysisMode mode =
          call.ChooseAnalysis(dense_shape, &family, &plans_, full_stats_);
      if (mode == AnalysisMode::kSkip) {
        call.SkipAnalysis(dense_shape, &family, &plans_);
      } else if (mode == AnalysisMode::kSample) {
        const int64_t stride =
            call.SampleStrideFor(dense_shape, &family, a_rows, a_cols);
        if (stride > 1) {
          SampledCounts sc;
          CountSample<CoreType<T>>(a_ptr, a_rows, a_cols, mm_.ta, stride,
                                   TfParallelFor(ctx), &sc);
          call.AcceptSample(dense_shape, sc, &family, &plans_);
        }
      }
      if (call.dense_without_count()) {
        OP_REQUIRES_OK(ctx, RunAllDense(ctx, a, b, m, n, &call));
        return;
      }
    }

    // --- Analysis: densities, live columns. --------------------------------
    // The thread-pool hook and the output shape are built here, after the
    // all-dense return above, which needs neither (a small product's call
    // is ~100 us, and its own time beyond TF's kernel is what it loses).
    ParallelFor pfor = TfParallelFor(ctx);
    const tf::TensorShape out_shape({m, n});
    std::vector<int64_t> row_nnz(m), col_nnz(k);
    const int64_t nnz =
        m > 0 && k > 0 ? CountNonzeros<CoreType<T>>(a_ptr, a_rows, a_cols, mm_.ta,
                                          row_nnz.data(), col_nnz.data(), pfor)
                       : 0;
    if (call.automatic()) call.CountDone(&family, static_cast<double>(m) * k);
    if (m == 0 || n == 0 || k == 0) {
      tf::Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, out_shape, &out));
      out->flat<T>().setZero();
      // No work, but the statistics still describe op(a).
      call.FinishEmpty(m, k, k > 0 ? row_nnz.data() : nullptr);
      OP_REQUIRES_OK(ctx, epilogue_.ApplyCpu<T>(ctx));  // act(0 + bias)
      return;
    }
    const std::vector<int64_t> live_cols = LiveColumns(col_nnz.data(), k);
    const int64_t k_live = static_cast<int64_t>(live_cols.size());

    // --- Decision (cost model, calibrated on the first automatic call). ---
    MatMulPaths<T> paths{ctx, a,    b,           mm_.ta, mm_.tb,
                         k,   n,    mm_.gathered, pfor,  &swap_};
    OP_REQUIRES_OK(ctx, call.Decide<T>(ctx, paths,
                                       MatMulSplitShape(m, k, k_live, n, !mm_.tb),
                                       row_nnz.data(), &family, &plans_, pfor));
    const std::vector<int64_t>& dense_rows = call.split().dense_rows;
    const std::vector<int64_t>& sparse_rows = call.split().sparse_rows;
    const int64_t rd = call.rows_dense(), rs = call.rows_sparse();
    const bool compact = call.compact();

    if (rd == m && !compact && fused_.ok()) {
      // All dense: TF's fused kernel does product, bias and activation.
      OP_REQUIRES_OK(ctx, RunFused(ctx, a, b));
      call.DenseDone();
      call.SparseDone();
      call.Finish(nnz, 0);
      return;
    }

    // --- Dense part. --------------------------------------------------------
    const int64_t kc = compact ? k_live : k;
    tf::Tensor* out = nullptr;
    if (rd < m) {
      // A split: the dense rows are scattered into (and the sparse rows
      // written straight to) an output buffer of our own.
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, out_shape, &out));
    }
    if (rd == m && !compact) {
      // Every row dense, nothing compacted: TF's MatMul on a and b as they
      // are, on this op's context (TfKernel::RunOnContext), or swapped.
      OP_REQUIRES_OK(ctx, RunDirect(ctx, a, b));
    } else {
      CpuDevice<T> dev{pfor};
      // Gathered rows of op(a) times b^T: as is or swapped (tb).
      std::function<absl::Status(const tf::Tensor&, tf::Tensor*)>
          gathered_product;
      if (mm_.tb) {
        gathered_product = [&](const tf::Tensor& ad, tf::Tensor* cd) {
          return RunTransposedProduct<T>(ctx, mm_.gathered, ad, b, &swap_,
                                         cd);
        };
      }
      OP_REQUIRES_OK(ctx, RunMatMulDensePart(
                              ctx, mm_, a, b, m, n, rd, compact, kc,
                              dense_rows.data(), live_cols.data(), dev, out,
                              mm_.tb ? &gathered_product : nullptr));
    }
    call.DenseDone();

    // --- Sparse part. -------------------------------------------------------
    if (rs > 0) {
      CoreType<T>* c = AsCore(out->flat<T>().data());
      if (call.split().nnz_sparse == 0) {
        ZeroRows<CoreType<T>>(sparse_rows.data(), rs, n, c, n, pfor);
      } else {
        Csr<CoreType<T>> csr;
        BuildCsr<CoreType<T>>(a_ptr, a_rows, a_cols, mm_.ta, sparse_rows.data(), rs,
                    row_nnz.data(), col_nnz.data(), &csr, pfor);
        tf::Tensor bt_t;
        const T* bd = nullptr;
        OP_REQUIRES_OK(ctx, paths.OperandB(&bt_t, &bd));
        CsrSpmm<CoreType<T>>(csr, sparse_rows.data(), rs, AsCore(bd), k, n, n, c, n,
                          pfor);
      }
    }
    call.SparseDone();
    // The SpMM never touches all-zero columns; the dense part skips them
    // only when it compacts.
    call.Finish(nnz, (rd == 0 || compact) ? k - k_live : 0);
    // product = act(product + bias) on every row, after both parts.
    OP_REQUIRES_OK(ctx, epilogue_.ApplyCpu<T>(ctx));
  }

 private:
  // act(op(a) op(b) + bias) by TF's fused kernel (fused_.ok()), as output 0.
  absl::Status RunFused(tf::OpKernelContext* ctx, const tf::Tensor& a,
                        const tf::Tensor& b) {
    tf::Tensor product;
    TF_RETURN_IF_ERROR(fused_.Run(
        ctx, {&a, &b, &ctx->input(MatMulEpilogue::kBiasInput)}, &product));
    ctx->set_output(0, product);
    return absl::OkStatus();
  }

  // A call that runs every row dense without a full count: TF's fused
  // kernel, or its MatMul and the epilogue; then the statistics.
  absl::Status RunAllDense(tf::OpKernelContext* ctx, const tf::Tensor& a,
                           const tf::Tensor& b, int64_t m, int64_t n,
                           SplitCall* call) {
    if (fused_.ok()) {
      TF_RETURN_IF_ERROR(RunFused(ctx, a, b));
    } else {
      TF_RETURN_IF_ERROR(RunDirect(ctx, a, b));
    }
    call->DenseDone();
    call->SparseDone();
    call->Finish(0, 0);
    if (!fused_.ok()) TF_RETURN_IF_ERROR(epilogue_.ApplyCpu<T>(ctx));
    return absl::OkStatus();
  }

  // op(a) op(b) on the inputs as given, as output 0: TF's MatMul on this
  // op's own context (a and b are its inputs 0 and 1, its output 0 is ours,
  // as TfKernel::RunOnContext needs; no sub-context, no output copy), or,
  // for a b read transposed, the way this op chose for the shape
  // (transposed_product.h).
  absl::Status RunDirect(tf::OpKernelContext* ctx, const tf::Tensor& a,
                         const tf::Tensor& b) {
    if (!mm_.ta && mm_.tb &&
        swap_.MaySwap(a.dim_size(0), a.dim_size(1), b.dim_size(0))) {
      tf::Tensor product;
      TF_RETURN_IF_ERROR(
          RunTransposedProduct<T>(ctx, mm_.direct, a, b, &swap_, &product));
      ctx->set_output(0, product);
      return absl::OkStatus();
    }
    return mm_.direct.RunOnContext(ctx);
  }

  MatMulKernels mm_;  // attrs and TF's MatMul kernels
  TransposedProductChoice swap_;  // per shape, for b read transposed
  MatMulEpilogue epilogue_;
  TfKernel fused_;    // TF's _FusedMatMul (bias given, float32), else unset
  FamilyCache families_;  // the cost-model family of the last call's sizes
  bool full_stats_ = true;
  PlanMemory plans_;  // this op's last plan (hysteresis)
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
TFSS_REGISTER_CPU(Eigen::bfloat16)
TFSS_REGISTER_CPU(Eigen::half)
#undef TFSS_REGISTER_CPU

}  // namespace tf_sparse_split
