// SparseSplitMatMul: GPU kernel (layer 2 of DESIGN.md, GPU side).
//
// Compiled into the op library only for a CUDA TensorFlow (setup.py defines
// GOOGLE_CUDA=1 and links the nvcc objects of cc/core/cuda and -lcudart);
// in a CPU-only build this file is an empty translation unit.
//
// Same contract as the CPU kernel in sparse_split_matmul_kernels.cc: product
// = op(a) * op(b), rows of op(a) with density above the threshold go to a
// dense GEMM (TensorFlow's own GPU "MatMul" kernel, i.e. cuBLAS, run
// in-process on a sub-context on the op's stream), the other rows to the CUDA
// CSR SpMM of cc/core/cuda, and all-zero columns of op(a) are compacted away
// from the dense part. Everything is enqueued on the op's CUDA stream (taken
// from the TF GPU device context, as TF's own GPU kernels do).
//
// Host waits. The host waits once for the row/column counts (the split is
// decided on the host, and the sizes of the parts are needed to allocate
// them). It waits a second time at the end only when the `stats` output (host
// memory) is consumed (ctx->output_required(1)): its TIME_DENSE/TIME_SPARSE
// are this call's GPU times, read from CUDA events. When nothing consumes the
// statistics (e.g. a graph that drops them, or nodes made by the rewrite
// pass), the op returns with the GEMM and SpMM still queued, as TF's own GPU
// kernels do; the time fields are then NaN, and the in-op rate model reads
// the events at a later call, once the stream has passed them.
//
// Buffer lifetime. Pinned host buffers (index lists, the heterogeneous
// part's copies) are owned by a HostTemps object that is handed to TF's
// EventMgr (ThenExecute on the op's stream, as TF's own GPU kernels keep
// host buffers alive) on EVERY exit path, error returns included: no copy or
// kernel can still be using the memory when TF's pinned allocator hands it
// out again. Device temporaries follow
// TF's stream semantics (freed on the host, reused only by work enqueued
// later on the same stream); work on the side stream (heterogeneous mode) is
// joined back into the op's stream before the op returns, on every path.
//
// heterogeneous = true (K.-Y. Peng, NTU 2017): the sparse rows are gathered
// on the GPU and copied, with b, to pinned host memory on a side stream, so
// the dense GEMM on the op's stream does not wait for the copies; the host
// multiplies them with the CPU CSR SpMM of cc/core on TF's CPU thread pool
// while the GPU runs the dense rows, uploads the result on the side stream,
// and the op's stream waits for it (an event) before scattering it into the
// output. TIME_DENSE is the GPU time of the dense part (CUDA events),
// TIME_SPARSE the host time from enqueueing the copies to the end of the CPU
// SpMM (it includes the device-to-host transfer).
//
// A negative threshold picks the split from the rates this kernel measured
// for the problem family (dtype, k, n, transpose_b, heterogeneous): until the
// dense rate is known every nonzero row goes dense, then one call sends every
// row sparse to measure the sparse rate, then the threshold is
// (sparse rate / dense rate) * k_live / k as in the CPU kernel, or, for a
// heterogeneous split, the density-bin edge that minimises
// max(T_dense_gpu, T_sparse_cpu) (both devices finish together).
//
// Determinism and precision (the GPU contract; README "GPU" section):
//  * A fixed threshold in [0, 1] makes the split a function of the input's
//    zero pattern only, so the same inputs give the same bits on every call
//    (the CUDA kernels are deterministic; cuBLAS is run-to-run reproducible
//    on one GPU model).
//  * A negative (automatic) threshold depends on measured timings, so a row
//    may go to cuBLAS on one call and to the CSR kernel on the next: results
//    can then differ in the last bits (or at TF32 precision, below). When
//    op determinism is enabled (tf.config.experimental.
//    enable_op_determinism()), the automatic threshold is fixed to
//    kDeterministicThreshold (0: all-zero rows skipped, every other row to
//    TF's MatMul; all-zero columns still compacted away), independent of
//    timings and of call history (so heterogeneous=True then sends nothing
//    to the CPU; a fixed threshold splits deterministically).
//  * float32 dense rows run through TF's MatMul, which uses TF32 tensor
//    cores on Ampere and later while tf.config.experimental.
//    enable_tensor_float_32_execution is on (TF's default): they are exactly
//    as precise as tf.matmul (relative error ~1e-3). Sparse rows are always
//    full FP32 (fused multiply-adds in ascending k). float64 never uses TF32.
#if GOOGLE_CUDA

#define EIGEN_USE_GPU

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "cc/core/cuda/sparse_matmul_cuda.h"
#include "cc/core/sparse_matmul.h"
#include "cc/kernels/epilogue.h"
#include "cc/kernels/sparse_split_matmul_common.h"
#include "cc/kernels/tf_kernel.h"
#include "cc/kernels/tf_parallel_for.h"
#include "tensorflow/core/common_runtime/device/device_event_mgr.h"
#include "tensorflow/core/framework/node_def_util.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/util/determinism.h"
#include "unsupported/Eigen/CXX11/Tensor"

namespace tf_sparse_split {

namespace tf = ::tensorflow;

// The automatic threshold used while op determinism is required (see the
// contract at the top of the file): every row with a nonzero goes dense.
constexpr double kDeterministicThreshold = 0.0;

namespace {

using Clock = std::chrono::steady_clock;

absl::Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return tf::errors::Internal("SparseSplitMatMul (GPU): ", what, " failed: ",
                              cudaGetErrorName(err), ": ",
                              cudaGetErrorString(err));
}

#define TFSS_CUDA_OK(ctx, expr) OP_REQUIRES_OK(ctx, CudaStatus((expr), #expr))

// Pinned (page-locked) host memory through TF's allocator, for async copies.
tf::AllocatorAttributes PinnedHost() {
  tf::AllocatorAttributes attr;
  attr.set_on_host(true);
  attr.set_gpu_compatible(true);
  return attr;
}

// A CUDA event destroyed with its owner (cudaEventDestroy of an event that
// is still pending is allowed: CUDA frees it once it completes).
struct Event {
  cudaEvent_t ev = nullptr;
  Event() = default;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaError_t Create(bool timing = true) {
    return cudaEventCreateWithFlags(
        &ev, timing ? cudaEventDefault : cudaEventDisableTiming);
  }
  ~Event() {
    if (ev != nullptr) cudaEventDestroy(ev);
  }
};

// Seconds between two recorded events; a negative value if either has not
// completed (or was never recorded).
double ElapsedSeconds(const Event& a, const Event& b) {
  if (a.ev == nullptr || b.ev == nullptr) return -1.0;
  float ms = 0.f;
  if (cudaEventElapsedTime(&ms, a.ev, b.ev) != cudaSuccess) {
    cudaGetLastError();  // not ready / not recorded: not a sticky error
    return -1.0;
  }
  return ms * 1e-3;
}

// Measured rates of one problem family on this GPU (flop/s); EMA of calls.
struct GpuRates {
  std::mutex mu;
  double dense_rate = 0.0;
  double sparse_rate = 0.0;

  void Update(double* rate, double flops, double seconds) {
    if (flops < 2e7 || seconds <= 0.0) return;  // overhead-dominated
    const double r = flops / seconds;
    std::lock_guard<std::mutex> lock(mu);
    *rate = *rate > 0.0 ? 0.8 * *rate + 0.2 * r : r;
  }
};

GpuRates& RatesFor(tf::DataType dtype, int64_t k, int64_t n, bool tb,
                   bool hetero) {
  static std::mutex* mu = new std::mutex;
  static auto* models =
      new std::map<std::tuple<int, int64_t, int64_t, bool, bool>, GpuRates>;
  std::lock_guard<std::mutex> lock(*mu);
  return (*models)[std::make_tuple(static_cast<int>(dtype), k, n, tb, hetero)];
}

// One call's timing events and work, kept until the events can be read.
struct CallTiming {
  Event d0, d1, s0, s1;          // dense part / sparse part on the op's stream
  double dense_flops = 0.0;
  double sparse_flops = 0.0;
  double host_sparse_seconds = -1.0;  // heterogeneous: CPU SpMM wall time
  GpuRates* rates = nullptr;

  // Reads the events and updates the rate model; false if not yet complete.
  bool Harvest() {
    if (cudaEventQuery(d1.ev) != cudaSuccess || cudaEventQuery(s1.ev) != cudaSuccess) {
      cudaGetLastError();  // cudaErrorNotReady is not sticky; clear it
      return false;
    }
    const double t_dense = ElapsedSeconds(d0, d1);
    const double t_sparse =
        host_sparse_seconds >= 0.0 ? host_sparse_seconds : ElapsedSeconds(s0, s1);
    rates->Update(&rates->dense_rate, dense_flops, t_dense);
    rates->Update(&rates->sparse_rate, sparse_flops, t_sparse);
    return true;
  }
};

// Pinned host temporaries of one call. Released only in stream order (see
// StreamOrderedRelease), never while a copy may still use them.
struct HostTemps {
  tf::Tensor counts, idx, a_sparse, b, c_sparse;
};

// Owns a HostTemps; its destructor (on every exit path of Compute) hands it
// to TF's EventMgr (ThenExecute: deleted on the EventMgr's thread once the
// stream has passed every copy enqueued before it), as TF's own GPU kernels
// keep host buffers alive. Not a cudaLaunchHostFunc: freeing into TF's
// pinned allocator from CUDA's callback thread could deadlock with a thread
// that holds the allocator while synchronising. Without an EventMgr it waits
// for the stream and frees the buffers then.
class StreamOrderedRelease {
 public:
  StreamOrderedRelease(tf::OpKernelContext* ctx, cudaStream_t stream)
      : ctx_(ctx), stream_(stream), temps_(new HostTemps) {}
  StreamOrderedRelease(const StreamOrderedRelease&) = delete;
  StreamOrderedRelease& operator=(const StreamOrderedRelease&) = delete;
  ~StreamOrderedRelease() {
    HostTemps* t = temps_.release();
    const auto* info = ctx_->device()->tensorflow_accelerator_device_info();
    stream_executor::Stream* se_stream =
        ctx_->op_device_context() != nullptr ? ctx_->op_device_context()->stream()
                                             : nullptr;
    if (info != nullptr && info->event_mgr != nullptr && se_stream != nullptr) {
      info->event_mgr->ThenExecute(se_stream, [t] { delete t; });
      return;
    }
    cudaStreamSynchronize(stream_);
    delete t;
  }
  HostTemps* get() const { return temps_.get(); }

 private:
  tf::OpKernelContext* ctx_;
  cudaStream_t stream_;
  std::unique_ptr<HostTemps> temps_;
};

// Joins a side stream back into the op's stream on destruction (every exit
// path): work enqueued on the op's stream afterwards -- including whatever
// reuses device memory this op freed -- waits for the side stream's work.
class SideStreamJoin {
 public:
  explicit SideStreamJoin(cudaStream_t main) : main_(main) {}
  SideStreamJoin(const SideStreamJoin&) = delete;
  SideStreamJoin& operator=(const SideStreamJoin&) = delete;
  void Arm(cudaStream_t side) { side_ = side; }
  // Enqueues the join now (idempotent); returns the first error.
  cudaError_t Join() {
    if (side_ == nullptr) return cudaSuccess;
    const cudaStream_t side = side_;
    side_ = nullptr;
    Event e;
    cudaError_t err = e.Create(/*timing=*/false);
    if (err == cudaSuccess) err = cudaEventRecord(e.ev, side);
    if (err == cudaSuccess) err = cudaStreamWaitEvent(main_, e.ev, 0);
    if (err != cudaSuccess) {  // cannot order: wait on the host instead
      cudaStreamSynchronize(side);
    }
    return err;
  }
  ~SideStreamJoin() { Join(); }

 private:
  cudaStream_t main_;
  cudaStream_t side_ = nullptr;
};

}  // namespace

template <typename T>
class SparseSplitMatMulGpuOp : public tf::OpKernel {
 public:
  explicit SparseSplitMatMulGpuOp(tf::OpKernelConstruction* ctx)
      : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("transpose_a", &ta_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("transpose_b", &tb_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("heterogeneous", &hetero_));
    OP_REQUIRES_OK(ctx, epilogue_.Init(ctx));  // optional bias + activation
    const tf::DataType dt = tf::DataTypeToEnum<T>::value;
    OP_REQUIRES_OK(ctx, InitTfMatMul(ctx, tf::DEVICE_GPU, dt, ta_, tb_, &gemm_direct_));
    OP_REQUIRES_OK(ctx, InitTfMatMul(ctx, tf::DEVICE_GPU, dt, false, tb_, &gemm_gathered_));
    OP_REQUIRES_OK(ctx, InitTfMatMul(ctx, tf::DEVICE_GPU, dt, false, false,
                                     &gemm_compacted_));
  }

  ~SparseSplitMatMulGpuOp() override {
    if (side_stream_ != nullptr) cudaStreamDestroy(side_stream_);
  }

  void Compute(tf::OpKernelContext* ctx) override {
    const auto t_start = Clock::now();
    const tf::Tensor& a = ctx->input(0);
    const tf::Tensor& b = ctx->input(1);
    const tf::Tensor& thr_t = ctx->input(2);  // host memory
    MatMulProblem prob;
    OP_REQUIRES_OK(ctx, ValidateMatMul(a, b, thr_t, ta_, tb_, &prob));
    OP_REQUIRES_OK(ctx, epilogue_.Validate(ctx, prob.n));
    const int64_t m = prob.m, k = prob.k, n = prob.n;
    const float thr_in = prob.threshold;

    tf::Tensor* stats_t = nullptr;  // host memory
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, tf::TensorShape({kNumStats}),
                                             &stats_t));
    double* stats = stats_t->flat<double>().data();
    InitStats(prob, stats);
    stats[kStatHeterogeneous] = hetero_ ? kHeteroRan : kHeteroOff;
    // The op's stream, as TF's own GPU kernels get it (eigen_device<Eigen::GpuDevice>()
    // returns this same device; the inline accessor needs no exported symbol).
    const cudaStream_t stream = ctx->eigen_gpu_device().stream();
    const tf::TensorShape out_shape({m, n});
    const tf::DataType dt = tf::DataTypeToEnum<T>::value;
    if (m == 0 || n == 0 || k == 0) {
      tf::Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, out_shape, &out));
      if (m * n > 0) {
        TFSS_CUDA_OK(ctx, cudaMemsetAsync(out->flat<T>().data(), 0,
                                          sizeof(T) * m * n, stream));
      }
      stats[kStatRowsSparse] = m;
      if (m > 0) stats[kStatHistogram] = m;
      OP_REQUIRES_OK(ctx, epilogue_.ApplyGpu<T>(ctx, stream));  // act(0 + bias)
      return;
    }
    const T* a_ptr = a.flat<T>().data();
    const T* b_ptr = b.flat<T>().data();
    const int64_t a_rows = a.dim_size(0), a_cols = a.dim_size(1);
    const int64_t b_rows = b.dim_size(0), b_cols = b.dim_size(1);

    // Declaration order matters: destructors run in reverse, so on any exit
    // the side stream is joined (join) BEFORE the pinned buffers' release is
    // enqueued (release), which therefore also waits for side-stream copies.
    StreamOrderedRelease release(ctx, stream);
    HostTemps* host = release.get();
    SideStreamJoin join(stream);

    // --- Analysis: counts on the GPU, the split decided on the host. -------
    tf::Tensor counts_d;
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(tf::DT_INT64,
                                           tf::TensorShape({m + k}), &counts_d));
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(tf::DT_INT64,
                                           tf::TensorShape({m + k}), &host->counts,
                                           PinnedHost()));
    int64_t* row_nnz_d = counts_d.flat<int64_t>().data();
    TFSS_CUDA_OK(ctx, CountNonzerosGpu<T>(a_ptr, a_rows, a_cols, ta_, row_nnz_d,
                                          row_nnz_d + m, nullptr, stream));
    const int64_t* row_nnz = host->counts.flat<int64_t>().data();
    const int64_t* col_nnz = row_nnz + m;
    TFSS_CUDA_OK(ctx, cudaMemcpyAsync(host->counts.flat<int64_t>().data(), row_nnz_d,
                                      sizeof(int64_t) * (m + k),
                                      cudaMemcpyDeviceToHost, stream));
    TFSS_CUDA_OK(ctx, cudaStreamSynchronize(stream));
    // The stream has drained: earlier calls' timing events can be read.
    HarvestTimings();
    int64_t nnz = 0;
    for (int64_t i = 0; i < m; ++i) nnz += row_nnz[i];
    const std::vector<int64_t> live_cols = LiveColumns(col_nnz, k);
    const int64_t k_live = static_cast<int64_t>(live_cols.size());

    GpuRates& rates = RatesFor(dt, k, n, tb_, hetero_);
    double thr = thr_in;
    if (thr_in < 0 && tf::OpDeterminismRequired()) {
      thr = kDeterministicThreshold;  // no dependence on timings or history
    } else if (thr_in < 0) {
      thr = AutoThreshold(rates, row_nnz, m, k, k_live, n);
    }
    RowSplit split = SplitRows(row_nnz, m, k, thr, stats);
    const std::vector<int64_t>& dense_rows = split.dense_rows;
    const std::vector<int64_t>& sparse_rows = split.sparse_rows;
    const int64_t nnz_sparse = split.nnz_sparse;
    const int64_t rd = dense_rows.size(), rs = sparse_rows.size();
    const bool compact =
        rd > 0 && k_live < k && (rd < m || (k - k_live) * 16 >= k);
    const int64_t kc = compact ? k_live : k;

    // Row and column index lists on the device: [dense | sparse | live].
    const int64_t n_idx = rd + rs + (compact ? kc : 0);
    tf::Tensor idx_d;
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(tf::DT_INT64,
                                           tf::TensorShape({n_idx}), &host->idx,
                                           PinnedHost()));
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(tf::DT_INT64,
                                           tf::TensorShape({n_idx}), &idx_d));
    int64_t* ih = host->idx.flat<int64_t>().data();
    std::copy(dense_rows.begin(), dense_rows.end(), ih);
    std::copy(sparse_rows.begin(), sparse_rows.end(), ih + rd);
    if (compact) std::copy(live_cols.begin(), live_cols.end(), ih + rd + rs);
    TFSS_CUDA_OK(ctx, cudaMemcpyAsync(idx_d.flat<int64_t>().data(), ih,
                                      sizeof(int64_t) * n_idx,
                                      cudaMemcpyHostToDevice, stream));
    const int64_t* dense_rows_d = idx_d.flat<int64_t>().data();
    const int64_t* sparse_rows_d = dense_rows_d + rd;
    const int64_t* live_cols_d = sparse_rows_d + rs;
    const auto t_analyzed = Clock::now();

    tf::Tensor* out = nullptr;
    if (rd < m) OP_REQUIRES_OK(ctx, ctx->allocate_output(0, out_shape, &out));

    // --- Heterogeneous: ship the sparse rows and b to the host on a side
    // stream, so that the dense GEMM below does not queue behind the copies.
    const bool cpu_sparse = hetero_ && rs > 0 && nnz_sparse > 0;
    tf::Tensor as_d;
    Event gathered, copied;
    cudaStream_t side = nullptr;
    if (cpu_sparse) {
      OP_REQUIRES_OK(ctx, SideStream(&side));
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(dt, tf::TensorShape({rs, k}), &as_d));
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(dt, tf::TensorShape({rs, k}),
                                             &host->a_sparse, PinnedHost()));
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(dt, b.shape(), &host->b, PinnedHost()));
      TFSS_CUDA_OK(ctx, GatherSubmatrixGpu<T>(a_ptr, a_rows, a_cols, ta_,
                                              sparse_rows_d, rs, nullptr, k,
                                              as_d.flat<T>().data(), stream));
      // The side stream starts after the gather (and so after the producers
      // of a and b, which ran earlier on the op's stream).
      TFSS_CUDA_OK(ctx, gathered.Create(/*timing=*/false));
      TFSS_CUDA_OK(ctx, cudaEventRecord(gathered.ev, stream));
      join.Arm(side);
      TFSS_CUDA_OK(ctx, cudaStreamWaitEvent(side, gathered.ev, 0));
      TFSS_CUDA_OK(ctx, cudaMemcpyAsync(host->a_sparse.flat<T>().data(),
                                        as_d.flat<T>().data(), sizeof(T) * rs * k,
                                        cudaMemcpyDeviceToHost, side));
      TFSS_CUDA_OK(ctx, cudaMemcpyAsync(host->b.flat<T>().data(), b_ptr,
                                        sizeof(T) * b_rows * b_cols,
                                        cudaMemcpyDeviceToHost, side));
      TFSS_CUDA_OK(ctx, copied.Create(/*timing=*/false));
      TFSS_CUDA_OK(ctx, cudaEventRecord(copied.ev, side));
    }

    // --- Dense part on the GPU (enqueued, not waited for). ------------------
    auto timing = std::make_shared<CallTiming>();
    timing->rates = &rates;
    TFSS_CUDA_OK(ctx, timing->d0.Create());
    TFSS_CUDA_OK(ctx, timing->d1.Create());
    TFSS_CUDA_OK(ctx, timing->s0.Create());
    TFSS_CUDA_OK(ctx, timing->s1.Create());
    TFSS_CUDA_OK(ctx, cudaEventRecord(timing->d0.ev, stream));
    if (rd == m && !compact) {
      tf::Tensor product;
      OP_REQUIRES_OK(ctx, gemm_direct_.Run(ctx, {&a, &b}, &product));
      ctx->set_output(0, product);
    } else if (rd > 0) {
      tf::Tensor ad_t, bc_t, cd_t;
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(dt, tf::TensorShape({rd, kc}), &ad_t));
      TFSS_CUDA_OK(ctx, GatherSubmatrixGpu<T>(
                            a_ptr, a_rows, a_cols, ta_,
                            rd == m ? nullptr : dense_rows_d, rd,
                            compact ? live_cols_d : nullptr, kc,
                            ad_t.flat<T>().data(), stream));
      if (compact) {
        OP_REQUIRES_OK(ctx, ctx->allocate_temp(dt, tf::TensorShape({kc, n}), &bc_t));
        TFSS_CUDA_OK(ctx, GatherSubmatrixGpu<T>(b_ptr, b_rows, b_cols, tb_,
                                                live_cols_d, kc, nullptr, n,
                                                bc_t.flat<T>().data(), stream));
        OP_REQUIRES_OK(ctx, gemm_compacted_.Run(ctx, {&ad_t, &bc_t}, &cd_t));
      } else {
        OP_REQUIRES_OK(ctx, gemm_gathered_.Run(ctx, {&ad_t, &b}, &cd_t));
      }
      if (rd == m) {
        ctx->set_output(0, cd_t);
      } else {
        TFSS_CUDA_OK(ctx, ScatterRowsGpu<T>(cd_t.flat<T>().data(), dense_rows_d,
                                            rd, n, out->flat<T>().data(), n,
                                            stream));
      }
    }
    TFSS_CUDA_OK(ctx, cudaEventRecord(timing->d1.ev, stream));

    // --- Sparse part: CPU (heterogeneous) or GPU CSR SpMM. ------------------
    TFSS_CUDA_OK(ctx, cudaEventRecord(timing->s0.ev, stream));
    tf::Tensor c_d, row_ptr_d, col_idx_d, values_d, ws_d, bt_d;
    if (rs > 0 && nnz_sparse == 0) {
      TFSS_CUDA_OK(ctx, ZeroRowsGpu<T>(sparse_rows_d, rs, n,
                                       out->flat<T>().data(), n, stream));
    } else if (cpu_sparse) {
      // The GPU keeps running the dense GEMM; the host waits for the copies
      // only, then multiplies on TF's CPU thread pool.
      TFSS_CUDA_OK(ctx, cudaEventSynchronize(copied.ev));
      ParallelFor pfor = TfParallelFor(ctx);
      std::vector<int64_t> rows(rs), sp_nnz(rs);
      std::iota(rows.begin(), rows.end(), int64_t{0});
      for (int64_t r = 0; r < rs; ++r) sp_nnz[r] = row_nnz[sparse_rows[r]];
      Csr<T> csr;
      BuildCsr<T>(host->a_sparse.flat<T>().data(), rs, k, false, rows.data(), rs,
                  sp_nnz.data(), nullptr, &csr, pfor);
      const T* bd = host->b.flat<T>().data();
      std::vector<T> bt;
      if (tb_) {  // the SpMM reads rows of op(b) = b^T
        bt.resize(k * n);
        GatherSubmatrix<T>(bd, n, k, true, nullptr, k, nullptr, n, bt.data(),
                           pfor);
        bd = bt.data();
      }
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(dt, tf::TensorShape({rs, n}),
                                             &host->c_sparse, PinnedHost()));
      CsrSpmm<T>(csr, rows.data(), rs, bd, k, n, n, host->c_sparse.flat<T>().data(), n,
                 pfor);
      timing->host_sparse_seconds =
          std::chrono::duration<double>(Clock::now() - t_analyzed).count();
      // Upload on the side stream (overlapping the GEMM if it still runs),
      // then the op's stream waits for it before the scatter.
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(dt, tf::TensorShape({rs, n}), &c_d));
      TFSS_CUDA_OK(ctx, cudaMemcpyAsync(c_d.flat<T>().data(),
                                        host->c_sparse.flat<T>().data(),
                                        sizeof(T) * rs * n,
                                        cudaMemcpyHostToDevice, side));
      TFSS_CUDA_OK(ctx, join.Join());
      TFSS_CUDA_OK(ctx, ScatterRowsGpu<T>(c_d.flat<T>().data(), sparse_rows_d,
                                          rs, n, out->flat<T>().data(), n,
                                          stream));
    } else if (rs > 0) {
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(tf::DT_INT64,
                                             tf::TensorShape({rs + 1}), &row_ptr_d));
      size_t ws_bytes = 0;
      TFSS_CUDA_OK(ctx, BuildCsrRowPtrWorkspaceBytes(rs, &ws_bytes));
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(
                              tf::DT_INT8,
                              tf::TensorShape({static_cast<int64_t>(
                                  std::max<size_t>(ws_bytes, 1))}),
                              &ws_d));
      int64_t* row_ptr = row_ptr_d.flat<int64_t>().data();
      TFSS_CUDA_OK(ctx, BuildCsrRowPtrGpu(row_nnz_d, sparse_rows_d, rs, row_ptr,
                                          ws_d.flat<int8_t>().data(), ws_bytes,
                                          stream));
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(
                              tf::DT_INT32, tf::TensorShape({nnz_sparse}),
                              &col_idx_d));
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(dt, tf::TensorShape({nnz_sparse}),
                                             &values_d));
      TFSS_CUDA_OK(ctx, FillCsrGpu<T>(a_ptr, a_rows, a_cols, ta_, sparse_rows_d,
                                      rs, row_ptr, col_idx_d.flat<int32_t>().data(),
                                      values_d.flat<T>().data(), stream));
      const T* bd = b_ptr;
      if (tb_) {  // op(b) = b^T materialised once, row-major [k, n]
        OP_REQUIRES_OK(ctx, ctx->allocate_temp(dt, tf::TensorShape({k, n}), &bt_d));
        TFSS_CUDA_OK(ctx, GatherSubmatrixGpu<T>(b_ptr, b_rows, b_cols, true,
                                                nullptr, k, nullptr, n,
                                                bt_d.flat<T>().data(), stream));
        bd = bt_d.flat<T>().data();
      }
      GpuCsr<T> csr;
      csr.row_ptr = row_ptr;
      csr.col_idx = col_idx_d.flat<int32_t>().data();
      csr.values = values_d.flat<T>().data();
      csr.n_rows = rs;
      csr.n_cols = k;
      csr.nnz = nnz_sparse;
      TFSS_CUDA_OK(ctx, CsrSpmmGpu<T>(csr, sparse_rows_d, bd, n, n,
                                      out->flat<T>().data(), n, stream));
    }
    TFSS_CUDA_OK(ctx, cudaEventRecord(timing->s1.ev, stream));
    timing->dense_flops = 2.0 * rd * kc * n;
    timing->sparse_flops = 2.0 * nnz_sparse * n;

    stats[kStatRowsDense] = rd;
    stats[kStatRowsSparse] = rs;
    stats[kStatNnz] = nnz;
    stats[kStatZeroColsSkipped] = (rd == 0 || compact) ? k - k_live : 0;
    stats[kStatTimeAnalyze] =
        std::chrono::duration<double>(t_analyzed - t_start).count();
    stats[kStatThreshold] = thr;
    stats[kStatNnzSparse] = nnz_sparse;
    // product = act(product + bias) on every row, enqueued after both parts.
    OP_REQUIRES_OK(ctx, epilogue_.ApplyGpu<T>(ctx, stream));

    if (ctx->output_required(1)) {
      // The statistics (host memory) carry this call's GPU times: wait.
      TFSS_CUDA_OK(ctx, cudaStreamSynchronize(stream));
      const double time_dense = ElapsedSeconds(timing->d0, timing->d1);
      const double time_sparse = timing->host_sparse_seconds >= 0.0
                                     ? timing->host_sparse_seconds
                                     : ElapsedSeconds(timing->s0, timing->s1);
      timing->Harvest();
      stats[kStatTimeDense] = time_dense;
      stats[kStatTimeSparse] = time_sparse;
    } else {
      // Nobody reads the statistics: return with the work queued (TF's
      // stream semantics); a later call reads the events.
      stats[kStatTimeDense] = std::numeric_limits<double>::quiet_NaN();
      stats[kStatTimeSparse] = std::numeric_limits<double>::quiet_NaN();
      std::lock_guard<std::mutex> lock(mu_);
      pending_.push_back(std::move(timing));
      while (pending_.size() > kMaxPending) pending_.pop_front();
    }
  }

 private:
  static constexpr size_t kMaxPending = 16;

  // The automatic threshold from the measured rates (see the file comment).
  double AutoThreshold(GpuRates& rates, const int64_t* row_nnz, int64_t m,
                       int64_t k, int64_t k_live, int64_t n) const {
    double dense_rate, sparse_rate;
    {
      std::lock_guard<std::mutex> lock(rates.mu);
      dense_rate = rates.dense_rate;
      sparse_rate = rates.sparse_rate;
    }
    if (dense_rate <= 0.0) return 0.0;   // explore: every nonzero row dense
    if (sparse_rate <= 0.0) return 1.0;  // explore: every row sparse
    if (!hetero_) {
      return std::min(1.0, std::max(0.0, sparse_rate / dense_rate * k_live /
                                             static_cast<double>(k)));
    }
    // The two devices run concurrently: pick the density-bin edge that
    // minimises the later finishing time, max(T_dense, T_sparse), as
    // CostModel.best_threshold(heterogeneous=True) does.
    std::vector<double> bin_rows(kDensityBins, 0.0), bin_nnz(kDensityBins, 0.0);
    for (int64_t i = 0; i < m; ++i) {
      const int bin = DensityBin(static_cast<double>(row_nnz[i]) / k);
      bin_rows[bin] += 1;
      bin_nnz[bin] += row_nnz[i];
    }
    double best = std::numeric_limits<double>::infinity(), rows_sparse = 0,
           nnz_sp = 0, thr = 0.0;
    for (int edge = 0; edge <= kDensityBins; ++edge) {
      if (edge > 0) {  // bins below `edge` go sparse
        rows_sparse += bin_rows[edge - 1];
        nnz_sp += bin_nnz[edge - 1];
      }
      const double t_dense = 2.0 * (m - rows_sparse) * k_live * n / dense_rate;
      const double t_sparse = 2.0 * nnz_sp * n / sparse_rate;
      const double t = std::max(t_dense, t_sparse);
      if (t < best) {
        best = t;
        thr = static_cast<double>(edge) / kDensityBins;
      }
    }
    return thr;
  }

  // Reads the events of earlier calls that returned without waiting.
  void HarvestTimings() {
    std::lock_guard<std::mutex> lock(mu_);
    while (!pending_.empty() && pending_.front()->Harvest()) pending_.pop_front();
  }

  // The per-instance side stream (created on first use, on the current
  // device, non-blocking with respect to the legacy default stream).
  absl::Status SideStream(cudaStream_t* side) {
    std::lock_guard<std::mutex> lock(mu_);
    if (side_stream_ == nullptr) {
      TF_RETURN_IF_ERROR(CudaStatus(
          cudaStreamCreateWithFlags(&side_stream_, cudaStreamNonBlocking),
          "cudaStreamCreateWithFlags"));
    }
    *side = side_stream_;
    return absl::OkStatus();
  }

  bool ta_ = false, tb_ = false, hetero_ = false;
  // TF's GPU MatMul (cuBLAS) on the op's stream.
  TfKernel gemm_direct_, gemm_gathered_, gemm_compacted_;
  std::mutex mu_;  // guards pending_ and side_stream_
  std::deque<std::shared_ptr<CallTiming>> pending_;
  cudaStream_t side_stream_ = nullptr;
  MatMulEpilogue epilogue_;
};

#define TFSS_REGISTER_GPU(T)                                             \
  REGISTER_KERNEL_BUILDER(Name("TfSparseSplit>SparseSplitMatMul")        \
                              .Device(tf::DEVICE_GPU)                    \
                              .TypeConstraint<T>("T")                    \
                              .HostMemory("threshold")                   \
                              .HostMemory("stats"),                      \
                          SparseSplitMatMulGpuOp<T>);
TFSS_REGISTER_GPU(float)
TFSS_REGISTER_GPU(double)
#undef TFSS_REGISTER_GPU
#undef TFSS_CUDA_OK

}  // namespace tf_sparse_split

#endif  // GOOGLE_CUDA
