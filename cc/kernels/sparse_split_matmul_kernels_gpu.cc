// SparseSplitMatMul: GPU kernel (layer 2 of docs/ARCHITECTURE.md, GPU side).
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
// A negative threshold picks the split with the cost model of
// cc/core/cost_model.h through the split runtime (cc/kernels/split_runtime.h),
// for the problem family (GPU, dtype, k, n bucket, transpose_b,
// heterogeneous): the GPU kernel does not calibrate; until the dense path's
// rate is known every nonzero row goes dense, then one call sends every row
// sparse to learn the sparse path's, and from then on DecideSplit chooses
// (with its margins and hysteresis). For a heterogeneous split the terms are
// marked heterogeneous, so a plan's predicted time is max(T_dense_gpu,
// T_sparse_cpu) (both devices finish together) instead of their sum.
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
//  * bfloat16 and half (the same dtypes and attrs as the CPU kernel): the
//    tensors' data go to the CUDA kernels reinterpreted as __nv_bfloat16 /
//    __half (cuda_types.h; identical 16-bit layouts). Values are stored in
//    the dtype, every product is accumulated in float32 and rounded once
//    (round-to-nearest-even): the CSR SpMM and the epilogue here, cuBLAS
//    (CUBLAS_COMPUTE_32F) in TF's MatMul for the dense rows, as in
//    tf.matmul. The heterogeneous CPU part runs the 16-bit CPU kernels of
//    cc/core (the same contract).
#if GOOGLE_CUDA

#define EIGEN_USE_GPU

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <vector>

#include "cc/core/cost_model.h"
#include "cc/core/cuda/sparse_matmul_cuda.h"
#include "cc/core/sparse_matmul.h"
#include "cc/kernels/core_types.h"
#include "cc/kernels/cuda_types.h"
#include "cc/kernels/epilogue.h"
#include "cc/kernels/sparse_split_matmul_common.h"
#include "cc/kernels/split_runtime.h"
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

// One call's timing events and work, kept until the events can be read.
struct CallTiming {
  Event d0, d1, s0, s1;          // dense part / sparse part on the op's stream
  double host_sparse_seconds = -1.0;  // heterogeneous: CPU SpMM wall time
  // What the call did, for FamilyModel::Record.
  FamilyModel* family = nullptr;
  SplitShape shape;
  double rows_dense = 0, rows_sparse = 0, nnz_sparse = 0;
  bool compact = false;

  // The parts' times (GPU events; the host time of a heterogeneous sparse
  // part); false if the events have not completed yet.
  bool Seconds(double* dense, double* sparse) const {
    if (cudaEventQuery(d1.ev) != cudaSuccess || cudaEventQuery(s1.ev) != cudaSuccess) {
      cudaGetLastError();  // cudaErrorNotReady is not sticky; clear it
      return false;
    }
    *dense = ElapsedSeconds(d0, d1);
    *sparse =
        host_sparse_seconds >= 0.0 ? host_sparse_seconds : ElapsedSeconds(s0, s1);
    return true;
  }

  // Records a call that returned without waiting, once its events are done.
  bool Harvest() {
    double dense, sparse;
    if (!Seconds(&dense, &sparse)) return false;
    family->Record(shape, rows_dense, compact, dense, rows_sparse, nnz_sparse,
                   sparse);
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

// The GPU's gather and scatter for RunMatMulDensePart (index lists in device
// memory, enqueued on the op's stream).
template <typename T>
struct GpuDevice {
  cudaStream_t stream;

  absl::Status Gather(const tf::Tensor& src, bool transpose,
                      const int64_t* rows, int64_t n_rows, const int64_t* cols,
                      int64_t n_cols, tf::Tensor* out) {
    return CudaStatus(
        GatherSubmatrixGpu<CudaType<T>>(AsCuda(src.flat<T>().data()),
                                        src.dim_size(0), src.dim_size(1),
                                        transpose, rows, n_rows, cols, n_cols,
                                        AsCuda(out->flat<T>().data()), stream),
        "GatherSubmatrixGpu");
  }
  absl::Status Scatter(const tf::Tensor& src, const int64_t* rows,
                       int64_t n_rows, int64_t n, tf::Tensor* out) {
    return CudaStatus(
        ScatterRowsGpu<CudaType<T>>(AsCuda(src.flat<T>().data()), rows, n_rows,
                                    n, AsCuda(out->flat<T>().data()), n, stream),
        "ScatterRowsGpu");
  }
};

}  // namespace

template <typename T>
class SparseSplitMatMulGpuOp : public tf::OpKernel {
  typedef CudaType<T> CT;  // the CUDA kernels' element type
  typedef CoreType<T> HT;  // the CPU kernels' (heterogeneous part)

 public:
  explicit SparseSplitMatMulGpuOp(tf::OpKernelConstruction* ctx)
      : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, mm_.Init(ctx, tf::DEVICE_GPU, tf::DataTypeToEnum<T>::value));
    OP_REQUIRES_OK(ctx, epilogue_.Init(ctx));  // optional bias + activation
  }

  ~SparseSplitMatMulGpuOp() override {
    if (side_stream_ != nullptr) cudaStreamDestroy(side_stream_);
  }

  void Compute(tf::OpKernelContext* ctx) override {
    const tf::Tensor& a = ctx->input(0);
    const tf::Tensor& b = ctx->input(1);
    MatMulProblem prob;  // threshold: host memory
    OP_REQUIRES_OK(ctx, ValidateMatMul(a, b, ctx->input(2), mm_.ta, mm_.tb, &prob));
    OP_REQUIRES_OK(ctx, epilogue_.Validate(ctx, prob.n));
    const int64_t m = prob.m, k = prob.k, n = prob.n;
    SplitCall call(ctx, 1, m, k, n, prob.threshold);  // stats: host memory
    OP_REQUIRES_OK(ctx, call.status());
    call.stats()[kStatHeterogeneous] = mm_.hetero ? kHeteroRan : kHeteroOff;
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
      call.FinishEmpty(m, 0, nullptr);
      OP_REQUIRES_OK(ctx, epilogue_.ApplyGpu<T>(ctx, stream));  // act(0 + bias)
      return;
    }
    const CT* a_ptr = AsCuda(a.flat<T>().data());
    const CT* b_ptr = AsCuda(b.flat<T>().data());
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
    TFSS_CUDA_OK(ctx, CountNonzerosGpu<CT>(a_ptr, a_rows, a_cols, mm_.ta, row_nnz_d,
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

    FamilyModel& family = FamilyFor(
        {kFamilyMatMulGpu, dt, k, NBucket(n), mm_.tb ? 1 : 0, mm_.hetero ? 1 : 0});
    call.SetProblem(MatMulSplitShape(m, k, k_live, n), &family);
    double thr = prob.threshold;
    bool all_dense = false;
    if (call.automatic() && tf::OpDeterminismRequired()) {
      thr = kDeterministicThreshold;  // no dependence on timings or history
    } else if (call.automatic()) {
      AutoPlan(family, call.shape(), row_nnz, &thr, &all_dense);
    }
    OP_REQUIRES_OK(ctx, call.Apply(row_nnz, thr, all_dense));
    const std::vector<int64_t>& dense_rows = call.split().dense_rows;
    const std::vector<int64_t>& sparse_rows = call.split().sparse_rows;
    const int64_t nnz_sparse = call.split().nnz_sparse;
    const int64_t rd = call.rows_dense(), rs = call.rows_sparse();
    const bool compact = call.compact();
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
    const auto t_analyzed = Clock::now();  // the host sparse part's start

    tf::Tensor* out = nullptr;
    if (rd < m) OP_REQUIRES_OK(ctx, ctx->allocate_output(0, out_shape, &out));

    // --- Heterogeneous: ship the sparse rows and b to the host on a side
    // stream, so that the dense GEMM below does not queue behind the copies.
    const bool cpu_sparse = mm_.hetero && rs > 0 && nnz_sparse > 0;
    tf::Tensor as_d;
    Event gathered, copied;
    cudaStream_t side = nullptr;
    if (cpu_sparse) {
      OP_REQUIRES_OK(ctx, SideStream(&side));
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(dt, tf::TensorShape({rs, k}), &as_d));
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(dt, tf::TensorShape({rs, k}),
                                             &host->a_sparse, PinnedHost()));
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(dt, b.shape(), &host->b, PinnedHost()));
      TFSS_CUDA_OK(ctx, GatherSubmatrixGpu<CT>(a_ptr, a_rows, a_cols, mm_.ta,
                                               sparse_rows_d, rs, nullptr, k,
                                               AsCuda(as_d.flat<T>().data()), stream));
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
    timing->family = &family;
    TFSS_CUDA_OK(ctx, timing->d0.Create());
    TFSS_CUDA_OK(ctx, timing->d1.Create());
    TFSS_CUDA_OK(ctx, timing->s0.Create());
    TFSS_CUDA_OK(ctx, timing->s1.Create());
    TFSS_CUDA_OK(ctx, cudaEventRecord(timing->d0.ev, stream));
    GpuDevice<T> dev{stream};
    OP_REQUIRES_OK(ctx, RunMatMulDensePart(ctx, mm_, a, b, m, n, rd, compact, kc,
                                           dense_rows_d, live_cols_d, dev, out));
    TFSS_CUDA_OK(ctx, cudaEventRecord(timing->d1.ev, stream));

    // --- Sparse part: CPU (heterogeneous) or GPU CSR SpMM. ------------------
    TFSS_CUDA_OK(ctx, cudaEventRecord(timing->s0.ev, stream));
    tf::Tensor c_d, row_ptr_d, col_idx_d, values_d, ws_d, bt_d;
    if (rs > 0 && nnz_sparse == 0) {
      TFSS_CUDA_OK(ctx, ZeroRowsGpu<CT>(sparse_rows_d, rs, n,
                                        AsCuda(out->flat<T>().data()), n, stream));
    } else if (cpu_sparse) {
      // The GPU keeps running the dense GEMM; the host waits for the copies
      // only, then multiplies on TF's CPU thread pool.
      TFSS_CUDA_OK(ctx, cudaEventSynchronize(copied.ev));
      ParallelFor pfor = TfParallelFor(ctx);
      std::vector<int64_t> rows(rs), sp_nnz(rs);
      std::iota(rows.begin(), rows.end(), int64_t{0});
      for (int64_t r = 0; r < rs; ++r) sp_nnz[r] = row_nnz[sparse_rows[r]];
      Csr<HT> csr;
      BuildCsr<HT>(AsCore(host->a_sparse.flat<T>().data()), rs, k, false,
                   rows.data(), rs, sp_nnz.data(), nullptr, &csr, pfor);
      const HT* bd = AsCore(host->b.flat<T>().data());
      std::vector<HT> bt;
      if (mm_.tb) {  // the SpMM reads rows of op(b) = b^T
        bt.resize(k * n);
        GatherSubmatrix<HT>(bd, n, k, true, nullptr, k, nullptr, n, bt.data(),
                            pfor);
        bd = bt.data();
      }
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(dt, tf::TensorShape({rs, n}),
                                             &host->c_sparse, PinnedHost()));
      CsrSpmm<HT>(csr, rows.data(), rs, bd, k, n, n,
                  AsCore(host->c_sparse.flat<T>().data()), n, pfor);
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
      TFSS_CUDA_OK(ctx, ScatterRowsGpu<CT>(AsCuda(c_d.flat<T>().data()),
                                           sparse_rows_d, rs, n,
                                           AsCuda(out->flat<T>().data()), n,
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
      TFSS_CUDA_OK(ctx, FillCsrGpu<CT>(a_ptr, a_rows, a_cols, mm_.ta, sparse_rows_d,
                                       rs, row_ptr, col_idx_d.flat<int32_t>().data(),
                                       AsCuda(values_d.flat<T>().data()), stream));
      const CT* bd = b_ptr;
      if (mm_.tb) {  // op(b) = b^T materialised once, row-major [k, n]
        OP_REQUIRES_OK(ctx, ctx->allocate_temp(dt, tf::TensorShape({k, n}), &bt_d));
        TFSS_CUDA_OK(ctx, GatherSubmatrixGpu<CT>(b_ptr, b_rows, b_cols, true,
                                                 nullptr, k, nullptr, n,
                                                 AsCuda(bt_d.flat<T>().data()), stream));
        bd = AsCuda(bt_d.flat<T>().data());
      }
      GpuCsr<CT> csr;
      csr.row_ptr = row_ptr;
      csr.col_idx = col_idx_d.flat<int32_t>().data();
      csr.values = AsCuda(values_d.flat<T>().data());
      csr.n_rows = rs;
      csr.n_cols = k;
      csr.nnz = nnz_sparse;
      TFSS_CUDA_OK(ctx, CsrSpmmGpu<CT>(csr, sparse_rows_d, bd, n, n,
                                       AsCuda(out->flat<T>().data()), n, stream));
    }
    TFSS_CUDA_OK(ctx, cudaEventRecord(timing->s1.ev, stream));
    timing->shape = call.shape();
    timing->rows_dense = rd;
    timing->rows_sparse = rs;
    timing->nnz_sparse = nnz_sparse;
    timing->compact = compact;

    // product = act(product + bias) on every row, enqueued after both parts.
    OP_REQUIRES_OK(ctx, epilogue_.ApplyGpu<T>(ctx, stream));

    const double skipped = (rd == 0 || compact) ? k - k_live : 0;
    if (ctx->output_required(1)) {
      // The statistics (host memory) carry this call's GPU times: wait.
      TFSS_CUDA_OK(ctx, cudaStreamSynchronize(stream));
      double time_dense = -1.0, time_sparse = -1.0;
      timing->Seconds(&time_dense, &time_sparse);
      call.FinishWithTimes(nnz, skipped, time_dense, time_sparse);
    } else {
      // Nobody reads the statistics: return with the work queued (TF's
      // stream semantics); a later call reads the events and records them.
      const double nan = std::numeric_limits<double>::quiet_NaN();
      call.FinishWithTimes(nnz, skipped, nan, nan);
      std::lock_guard<std::mutex> lock(mu_);
      pending_.push_back(std::move(timing));
      while (pending_.size() > kMaxPending) pending_.pop_front();
    }
  }

 private:
  static constexpr size_t kMaxPending = 16;

  // The automatic split (see the file comment): explore each path once,
  // then the cost model's plan; heterogeneous terms predict
  // max(T_dense_gpu, T_sparse_cpu).
  void AutoPlan(FamilyModel& family, const SplitShape& shape,
                const int64_t* row_nnz, double* thr, bool* all_dense) {
    CostTerms terms = family.Terms();
    terms.heterogeneous = mm_.hetero;
    *all_dense = false;
    if (!terms.dense_known()) {
      *thr = 0.0;  // explore: every nonzero row dense
    } else if (!terms.sparse_known()) {
      *thr = 1.0;  // explore: every row sparse
    } else {
      const Plan plan = plans_.Decide(
          shape, ProfileFromRowNnz(row_nnz, shape.m, shape.k, kDecisionBuckets),
          terms, DecisionPolicy());
      *thr = plan.threshold;
      *all_dense = plan.kind == PlanKind::kAllDense;
    }
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

  MatMulKernels mm_;  // attrs and TF's GPU MatMul (cuBLAS) on the op's stream
  MatMulEpilogue epilogue_;
  PlanMemory plans_;  // this op's last plan (hysteresis)
  std::mutex mu_;  // guards pending_ and side_stream_
  std::deque<std::shared_ptr<CallTiming>> pending_;
  cudaStream_t side_stream_ = nullptr;
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
TFSS_REGISTER_GPU(Eigen::bfloat16)
TFSS_REGISTER_GPU(Eigen::half)
#undef TFSS_REGISTER_GPU
#undef TFSS_CUDA_OK

}  // namespace tf_sparse_split

#endif  // GOOGLE_CUDA
