// The one split runtime of the sparse-split op kernels (layer 2).
//
// Every op kernel (SparseSplitMatMul on CPU and GPU, SparseSplitConv2D,
// SparseSplitConv2DBackpropFilter) reads the same way:
//
//   SplitCall call(ctx, ...)        timer started, statistics allocated
//                                   (when an op consumes them)
//   call.ChooseAnalysis(...)        automatic calls: count everything, a
//                                   strided sample, or nothing (the cost
//                                   model's AnalysisMode); a sample or no
//                                   count that keeps every row dense ends
//                                   in the all-dense path at once
//   analyse: count nonzeros per row (and per column), live columns
//   call.Decide(...)                threshold, row split, compaction: the
//                                   cost model of cc/core/cost_model.h,
//                                   calibrated on the first automatic call
//   dense part  -> call.DenseDone()
//   sparse part -> call.SparseDone()
//   call.Finish(...)                statistics tail, the family's rates,
//                                   the call's shape and the family's
//                                   terms (for the Python tuner)
//
// The op-specific work lives in a small functor per op (the contract below,
// after tensorflow/addons' functor headers): how to take a sample of its
// activation rows and how to run its dense and sparse paths on a sample.
// The runtime owns everything that is the same for all ops: timing, the
// decision, calibration, statistics and rate updates.
#ifndef TF_SPARSE_SPLIT_CC_KERNELS_SPLIT_RUNTIME_H_
#define TF_SPARSE_SPLIT_CC_KERNELS_SPLIT_RUNTIME_H_

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <vector>

#include "cc/core/cost_model.h"
#include "cc/core/parallel_for.h"
#include "cc/core/sparse_matmul.h"
#include "cc/core/stats.h"
#include "cc/kernels/interleaved_timing.h"
#include "cc/kernels/row_split.h"
#include "cc/kernels/sparse_split_matmul_common.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/logging.h"

namespace tf_sparse_split {

// Density buckets of the automatic decision (thresholds j / 32).
constexpr int kDecisionBuckets = 32;

// First entry of every family key (FamilyFor): which op and device.
enum FamilyOp : int64_t {
  kFamilyMatMulCpu = 0,
  kFamilyMatMulGpu = 1,
  kFamilyConv2DForward = 2,
  kFamilyConv2DFilterGrad = 3,
  kFamilySddmmCpu = 4,
  kFamilyConv2DInputGrad = 5,
};

// The calibration contract of an op (a functor with these members; T is
// the element type):
//
//   // The first `rows` activation rows of this call as a tensor whose dim
//   // 0 is the row and whose rows hold shape.k contiguous values each.
//   absl::Status Sample(int64_t rows, tensorflow::Tensor* sample);
//   // Runs the op's dense path on every row of `sample` (a Sample() or a
//   // tensor of its shape, possibly a dim-0 slice).
//   absl::Status RunDense(const tensorflow::Tensor& sample);
//   // Runs the op's sparse path (conversion + sparse kernel) on every row
//   // of `sample`; row_nnz[r] = nonzeros of row r.
//   absl::Status RunSparse(const tensorflow::Tensor& sample,
//                          const int64_t* row_nnz);
//
// Calibrate<T>() times them on a sample of the call's own rows (and on a
// thinned copy of it, to separate per-nonzero from per-row costs) and fits
// the family's CostTerms.

namespace split_runtime_internal {

template <typename T>
int64_t CountRows(const T* x, int64_t rows, int64_t k, int64_t* row_nnz) {
  int64_t total = 0;
  for (int64_t r = 0; r < rows; ++r) {
    int64_t z = 0;
    const T* row = x + r * k;
    for (int64_t j = 0; j < k; ++j) z += row[j] != T(0);
    row_nnz[r] = z;
    total += z;
  }
  return total;
}

// Per-family records of the recalibration rule (FamilyCalibrationRecord of
// cost_model.h: calibrations and recalibrations so far); each op instance
// keeps its own reference density in its PlanMemory. Process-wide, like
// FamilyFor; one mutex guards the family records and the op records.
inline std::mutex& CalibrationRecordsMutex() {
  static std::mutex* mu = new std::mutex;
  return *mu;
}

inline std::map<const FamilyModel*, FamilyCalibrationRecord>&
CalibrationRecords() {
  static auto* records =
      new std::map<const FamilyModel*, FamilyCalibrationRecord>;
  return *records;
}

// The mutex that serialises the first calibration of `family`: ops of one
// family that run at once (an MLP's two weight gradients, in parallel under
// TF's inter-op pool) would otherwise both calibrate it, each timing its
// paths while the other loads the same cores, and the first to finish --
// with the inflated timings -- would set the terms.
inline std::mutex& FirstCalibrationMutex(const FamilyModel* family) {
  static std::mutex* mu = new std::mutex;
  static auto* mutexes = new std::map<const FamilyModel*, std::mutex>;
  std::lock_guard<std::mutex> lock(*mu);
  return (*mutexes)[family];
}

// A (first) calibration of `family` on a call of the op owning `memory`.
inline void NoteCalibration(const FamilyModel* family, PlanMemory* memory,
                            double density) {
  std::lock_guard<std::mutex> lock(CalibrationRecordsMutex());
  ::tf_sparse_split::NoteCalibration(&CalibrationRecords()[family],
                                     memory->calibration_record(), density);
}

// Counts one automatic call of a calibrated family by the op owning
// `memory` at this density; true when it should recalibrate now (the
// records then restart here).
inline bool CountCallRecalibrationDue(const FamilyModel* family,
                                      PlanMemory* memory, double density) {
  std::lock_guard<std::mutex> lock(CalibrationRecordsMutex());
  return ::tf_sparse_split::CountCallRecalibrationDue(
      &CalibrationRecords()[family], memory->calibration_record(), density);
}

// One line per calibration at VLOG level 1
// (TF_CPP_VMODULE=split_runtime=1): the call, its timings and the terms.
inline void LogCalibration(const char* what, const FamilyModel* family,
                           const SplitShape& s, double density,
                           const CalibrationTimings& c, const CostTerms& t) {
  VLOG(1) << "tf_sparse_split " << what << " family " << family << " m "
          << s.m << " k " << s.k << " k_live " << s.k_live << " density "
          << density << " | rows " << c.rows_full << "/" << c.rows_part
          << " nnz " << c.nnz_full << "/" << c.nnz_thin << "/" << c.nnz_part
          << " dense_s " << c.dense_full_s << "/" << c.dense_part_s
          << " sparse_s " << c.sparse_full_s << "/" << c.sparse_thin_s << "/"
          << c.sparse_part_s << " copy " << c.copy_elems << "/" << c.copy_s
          << " rowcopy " << c.row_copy_elems << "/" << c.row_copy_s
          << " | terms dense " << t.dense_fixed_s << " + 1/" << t.dense_rate
          << " sparse " << t.sparse_fixed_s << " + " << t.convert_s_per_elem
          << "/elem + 1/" << t.sparse_rate << " copy " << t.copy_s_per_elem
          << " rowcopy " << t.row_copy_s_per_elem;
}

}  // namespace split_runtime_internal

// The counts of a strided sample of an activation's physical rows (see
// CountNonzerosStrided): row_nnz[rows] counts `rows` rows of op(a) over
// k_counted of their values each; k_live_est estimates op(a)'s live columns
// (those live in the sample, scaled to k: a lower bound in expectation) and
// nnz_est its nonzeros.
struct SampledCounts {
  std::vector<int64_t> row_nnz;
  int64_t rows = 0, k_counted = 0, k_live_est = 0;
  double nnz_est = 0.0;
};

// Counts every `stride`-th physical row of a (row-major phys_rows x
// phys_cols; op(a) = a^T when transpose_a) into *out.
template <typename T>
void CountSample(const T* a, int64_t phys_rows, int64_t phys_cols,
                 bool transpose_a, int64_t stride, const ParallelFor& pfor,
                 SampledCounts* out) {
  const int64_t sampled = (phys_rows + stride - 1) / stride;
  const int64_t m = transpose_a ? phys_cols : phys_rows;
  const int64_t k = transpose_a ? phys_rows : phys_cols;
  out->rows = transpose_a ? m : sampled;
  out->k_counted = transpose_a ? sampled : k;
  out->row_nnz.assign(out->rows, 0);
  std::vector<int64_t> cols(transpose_a ? sampled : k, 0);
  const int64_t nnz = CountNonzerosStrided<T>(a, phys_rows, phys_cols, stride,
                                              transpose_a, out->row_nnz.data(),
                                              cols.data(), pfor);
  const int64_t live = static_cast<int64_t>(
      std::count_if(cols.begin(), cols.end(), [](int64_t c) { return c != 0; }));
  out->k_live_est = transpose_a
                        ? std::min<int64_t>(k, (live * k + sampled - 1) / sampled)
                        : live;
  const double counted =
      static_cast<double>(out->rows) * static_cast<double>(out->k_counted);
  out->nnz_est = counted > 0.0 ? static_cast<double>(nnz) *
                                     (static_cast<double>(m) * k) / counted
                               : 0.0;
}

// An output buffer of `elems` values for a timed calibration run of a
// sparse kernel (the ops' RunSparse, the convolutions' kernel choice):
// from TF's allocator and left unwritten, as the op's own output is (the
// sparse kernels write every value of the rows or images they are given).
// A zero-filled std::vector paid the fill and, at MB sizes, fresh pages on
// every run: MNIST's first convolution at batch 32 (1.6 MB of output)
// calibrated its row scatter at 377 us where its calls ran 100-310 us
// (median ~150), against 331 us for TF's kernel, and the family stayed
// all-dense; in four processes after the change it timed 103-196 us.
template <typename T>
absl::Status CalibrationOutput(tensorflow::OpKernelContext* ctx,
                               int64_t elems, tensorflow::Tensor* out) {
  return ctx->allocate_temp(tensorflow::DataTypeToEnum<T>::value,
                            tensorflow::TensorShape({elems}), out);
}

// Calibrates a family from the call's own rows: returns the fitted terms.
template <typename T, typename Functor>
absl::Status Calibrate(tensorflow::OpKernelContext* ctx, Functor& op,
                       const SplitShape& shape, const ParallelFor& pfor,
                       CostTerms* terms,
                       CalibrationTimings* timings = nullptr) {
  namespace tf = ::tensorflow;
  using split_runtime_internal::CountRows;
  const int64_t k = std::max<int64_t>(1, shape.k);
  // About 2^20 values (4 MB of float): enough work that the fixed costs do
  // not dominate, little enough to stay a few calls' worth of time.
  const int64_t rows_full = std::max<int64_t>(
      1, std::min<int64_t>(shape.m, ((int64_t{1} << 20) + k - 1) / k));
  const int64_t rows_part = std::max<int64_t>(1, rows_full / 4);
  tf::Tensor sample;
  TF_RETURN_IF_ERROR(op.Sample(rows_full, &sample));
  std::vector<int64_t> nnz_full(rows_full), nnz_thin(rows_full);
  double total = CountRows<T>(sample.flat<T>().data(), rows_full, k,
                              nnz_full.data());
  if (total < 0.05 * rows_full * k) {
    // Rows this sparse hardly exercise the sparse kernel's multiply-adds
    // (its time is conversion): time its rate on a deterministic random
    // sample at 10% density of the same shape instead.
    tf::Tensor filled;
    TF_RETURN_IF_ERROR(ctx->allocate_temp(sample.dtype(), sample.shape(),
                                          &filled));
    T* x = filled.flat<T>().data();
    std::mt19937 gen(1234);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    for (int64_t i = 0; i < rows_full * k; ++i)
      x[i] = u(gen) < 0.1 ? T(u(gen) + 0.5) : T(0);
    sample = filled;
    total = CountRows<T>(x, rows_full, k, nnz_full.data());
  }
  // The same rows keeping every 8th nonzero: same conversion work, 1/8 of
  // the multiply-adds.
  tf::Tensor thin;
  TF_RETURN_IF_ERROR(ctx->allocate_temp(sample.dtype(), sample.shape(), &thin));
  {
    const T* x = sample.flat<T>().data();
    T* y = thin.flat<T>().data();
    for (int64_t r = 0; r < rows_full; ++r) {
      int64_t seen = 0;
      for (int64_t j = 0; j < k; ++j) {
        const T v = x[r * k + j];
        y[r * k + j] = (v != T(0) && (seen++ % 8) == 0) ? v : T(0);
      }
    }
  }
  CalibrationTimings c;
  c.rows_full = rows_full;
  c.rows_part = rows_part;
  c.nnz_full = total;
  c.nnz_thin = CountRows<T>(thin.flat<T>().data(), rows_full, k,
                            nnz_thin.data());
  for (int64_t r = 0; r < rows_part; ++r) c.nnz_part += nnz_full[r];
  const tf::Tensor part = sample.Slice(0, rows_part);
  // Gathers and scatters: timed as a gather of every other column (the
  // compaction's indexed copy, slower than a row copy: erring towards the
  // plain dense path), of at least kCalibrationCopyElems values
  // (CalibrationCopyRows: the sample's rows repeated), so that the copy's
  // fixed cost is not counted per value.
  const int64_t half = std::max<int64_t>(1, k / 2);
  const int64_t copy_rows = CalibrationCopyRows(k, rows_full);
  c.copy_elems = static_cast<double>(copy_rows) * half;
  tf::Tensor copy, copy_src;
  TF_RETURN_IF_ERROR(ctx->allocate_temp(
      sample.dtype(), tf::TensorShape({copy_rows, half}), &copy));
  const T* copy_from = sample.flat<T>().data();
  if (copy_rows > rows_full) {
    TF_RETURN_IF_ERROR(ctx->allocate_temp(
        sample.dtype(), tf::TensorShape({copy_rows * k}), &copy_src));
    T* dst = copy_src.flat<T>().data();
    for (int64_t r = 0; r < copy_rows; ++r)
      std::copy(copy_from + (r % rows_full) * k,
                copy_from + (r % rows_full + 1) * k, dst + r * k);
    copy_from = dst;
  }
  // Copies of whole rows (the compaction's gather of op(b)'s live rows,
  // CostTerms::row_copy_s_per_elem): every other row of the same values.
  const int64_t row_copy_rows = std::max<int64_t>(1, copy_rows / 2);
  c.row_copy_elems = static_cast<double>(row_copy_rows) * k;
  tf::Tensor row_copy;
  TF_RETURN_IF_ERROR(ctx->allocate_temp(
      sample.dtype(), tf::TensorShape({row_copy_rows, k}), &row_copy));
  std::vector<std::function<absl::Status()>> fns = {
      [&] { return op.RunSparse(sample, nnz_full.data()); },
      [&] { return op.RunSparse(thin, nnz_thin.data()); },
      [&] { return op.RunSparse(part, nnz_full.data()); },
      [&] {
        const T* x = copy_from;
        T* y = copy.flat<T>().data();
        pfor(copy_rows, 2 * half, [&](int64_t b, int64_t e) {
          for (int64_t r = b; r < e; ++r)
            for (int64_t j = 0; j < half; ++j)
              y[r * half + j] = x[r * k + std::min(2 * j, k - 1)];
        });
        return absl::OkStatus();
      },
      [&] {
        const T* x = copy_from;
        T* y = row_copy.flat<T>().data();
        pfor(row_copy_rows, 2 * k, [&](int64_t b, int64_t e) {
          for (int64_t r = b; r < e; ++r) {
            const int64_t src = (2 * r) % copy_rows;
            std::memcpy(y + r * k, x + src * k, k * sizeof(T));
          }
        });
        return absl::OkStatus();
      }};
  if (shape.dense_allowed) {
    fns.push_back([&] { return op.RunDense(sample); });
    fns.push_back([&] { return op.RunDense(part); });
  }
  std::vector<double> best;
  TF_RETURN_IF_ERROR(BestSecondsInterleaved(fns, &best));
  c.sparse_full_s = best[0];
  c.sparse_thin_s = best[1];
  c.sparse_part_s = best[2];
  c.copy_s = best[3];
  c.row_copy_s = best[4];
  if (shape.dense_allowed) {
    c.dense_full_s = best[5];
    c.dense_part_s = best[6];
  }
  *terms = FitCalibration(shape, c);
  if (timings != nullptr) *timings = c;
  return absl::OkStatus();
}

// One call of a split op: its statistics, phase timer and decision.
class SplitCall {
 public:
  // Allocates the statistics (output `stats_output`, float64 [kNumStats])
  // and records the sizes (m, k, n as the statistics define them for the
  // op) and the threshold as given (0 for automatic until decided). When
  // nothing consumes that output (ctx->output_required false: a gradient
  // product, a caller that drops the statistics) the statistics go to a
  // buffer of the call instead, and the output is left unset, as
  // OpKernelContext allows: one allocation less on every call.
  SplitCall(tensorflow::OpKernelContext* ctx, int stats_output, int64_t m,
            int64_t k, int64_t n, float threshold)
      : start_(Clock::now()), threshold_in_(threshold) {
    if (ctx->output_required(stats_output)) {
      tensorflow::Tensor* t = nullptr;
      status_ = ctx->allocate_output(
          stats_output, tensorflow::TensorShape({kNumStats}), &t);
      if (!status_.ok()) return;
      stats_ = t->flat<double>().data();
    } else {
      stats_ = local_stats_;
    }
    std::fill(stats_, stats_ + kNumStats, 0.0);
    stats_[kStatM] = m;
    stats_[kStatK] = k;
    stats_[kStatN] = n;
    stats_[kStatThreshold] = threshold < 0 ? 0.0 : threshold;
  }

  SplitCall(const SplitCall&) = delete;  // stats_ may point into the call
  SplitCall& operator=(const SplitCall&) = delete;

  const absl::Status& status() const { return status_; }
  double* stats() { return stats_; }
  bool automatic() const { return threshold_in_ < 0; }

  // How much of the analysis this call pays (cost_model.h, AnalysisMode):
  // kFull for a given threshold or when the caller wants exact statistics
  // (full_stats); else the op's PlanMemory chooses from the family's terms
  // (PlanMemory::ChooseAnalysis: the call a re-time falls due on counts
  // fully). `shape` is the call's SplitShape with k_live = k (nothing
  // counted yet). The runtime keeps the sample back-off and the re-time
  // schedule for every op: a call without a full count counts in the
  // schedule (SkipAnalysis, AcceptSample), and a full count that a sample
  // asked for, or a periodic one amid the back-off, that runs all-dense
  // without compaction continues the back-off (Decide, VetoSparseRows).
  AnalysisMode ChooseAnalysis(const SplitShape& shape, FamilyModel* family,
                              PlanMemory* memory, bool full_stats,
                              const AnalysisPolicy& ap = AnalysisPolicy()) {
    if (!automatic() || family == nullptr || memory == nullptr)
      return AnalysisMode::kFull;
    // One read of the family for the whole analysis choice (its terms are
    // kept computed: FamilyModel::Snapshot).
    const FamilyModel::Snapshot snap = family->Get();
    if (!snap.calibrated) return AnalysisMode::kFull;
    terms_ = snap.terms;
    have_terms_ = true;
    count_s_per_elem_ = snap.count_s_per_elem;
    cheap_analysis_ = !full_stats;
    int64_t samples_dense = 0;
    const AnalysisMode mode =
        memory->ChooseAnalysis(shape, terms_, DecisionPolicy(), ap,
                               count_s_per_elem_, full_stats, &samples_dense);
    // A sample that does not say all-dense (AcceptSample false, or no
    // stride) leads to the full count; so does a periodic one amid the
    // back-off.
    samples_dense_before_ = samples_dense;
    backoff_full_ = mode == AnalysisMode::kSample ||
                    (mode == AnalysisMode::kFull && samples_dense > 0);
    return mode;
  }

  // The stride of this call's sample over `phys_rows` physical rows of
  // `phys_cols` values (1: count everything instead); call after
  // ChooseAnalysis returned kSample.
  int64_t SampleStrideFor(const SplitShape& shape, FamilyModel* family,
                          int64_t phys_rows, int64_t phys_cols,
                          const AnalysisPolicy& ap = AnalysisPolicy()) const {
    const double dense_s = PredictDenseSeconds(
        shape, have_terms_ ? terms_ : family->Terms(),
        static_cast<double>(shape.m), false);
    return SampleStride(phys_rows, phys_cols, dense_s, count_s_per_elem_, ap);
  }

  // A call that counts nothing (ChooseAnalysis returned kSkip): every row
  // dense, nothing compacted; kStatNnz NaN, no histogram.
  void SkipAnalysis(const SplitShape& shape, FamilyModel* family,
                    PlanMemory* memory) {
    SetAllDense(shape, family, memory, kAnalysisSkipped,
                std::numeric_limits<double>::quiet_NaN());
  }

  // After a sampled count: when the estimate is clear of the break-even
  // (SampleSaysDense), sets the call up as all-dense -- kStatNnz and the
  // histogram estimated from the sample -- and returns true; else false
  // (count everything and Decide).
  bool AcceptSample(const SplitShape& shape, const SampledCounts& c,
                    FamilyModel* family, PlanMemory* memory,
                    const AnalysisPolicy& ap = AnalysisPolicy()) {
    if (c.rows <= 0 || c.k_counted <= 0) return false;
    SplitShape est = shape;
    est.k_live = std::min(shape.k, std::max<int64_t>(0, c.k_live_est));
    const DensityProfile p =
        EstimateProfile(c.row_nnz.data(), c.rows, c.k_counted, shape.m,
                        shape.k, kDecisionBuckets);
    if (!have_terms_) {
      terms_ = family->Terms();
      have_terms_ = true;
    }
    if (!SampleSaysDense(est, p, terms_, DecisionPolicy(), ap)) return false;
    RunSampleAllDense(shape, c, family, memory);
    return true;
  }

  // Whether a sample that did not say all-dense (AcceptSample false) may
  // lead to this call's full count: the op's rationing of such counts
  // (cost_model.h, SampleMayCountFully: their cost since the last full
  // count within AnalysisPolicy::escalate_budget of the predicted dense
  // time per call, unless a change of side is pending). Call after
  // ChooseAnalysis; false: the caller runs the call all-dense on the sample
  // (AcceptVetoedSample).
  bool SampleMayCountFully(const SplitShape& shape, FamilyModel* family,
                           PlanMemory* memory,
                           const AnalysisPolicy& ap = AnalysisPolicy()) const {
    if (memory == nullptr) return true;
    const double m = static_cast<double>(shape.m);
    const double dense_s = PredictDenseSeconds(
        shape, have_terms_ ? terms_ : family->Terms(), m, false);
    const double count_s =
        count_s_per_elem_ * m * static_cast<double>(shape.k);
    return memory->SampleMayCountFully(count_s, dense_s, ap);
  }

  // After a sampled count that did not say all-dense (AcceptSample false)
  // but whose estimate the op's own rules keep all-dense anyway (the
  // convolutions' agreement and zero-free rules veto every plan with
  // sparse images on it): the call runs all-dense as on a sample that said
  // so -- kStatNnz and the histogram estimated, and the op's back-off goes
  // on, near the break-even only up to a sample every 4 calls
  // (kNearBreakEvenSampleRun), the calls between counting nothing. Marked
  // skipped instead, such a layer sampled on every call: 32x56x56x64 -> 64
  // at 50% zeros on the 2-core Xeon, 0.4-0.6 ms of a 22-23 ms call (the
  // automatic op at 0.97x of TF's kernel).
  void AcceptVetoedSample(const SplitShape& shape, const SampledCounts& c,
                          FamilyModel* family, PlanMemory* memory) {
    RunSampleAllDense(shape, c, family, memory, true);
  }

  // Records a full count of `elems` values that took since the call's
  // start (the family's counting cost, which ChooseAnalysis weighs).
  void CountDone(FamilyModel* family, double elems) {
    CountDone(family, elems, start_);
  }
  // The same for a count that began at `since` (an op whose call does
  // one-time work before its count: the convolutions calibrate their
  // sparse-kernel choice on the family's first call, which a record from
  // the call's start counted as the count's, 1.7 ms for a 784-value count
  // of 2-3 us, and sparse plans were then charged that much a call).
  void CountDone(FamilyModel* family, double elems, Clock::time_point since) {
    if (family != nullptr)
      family->RecordCount(elems, Seconds(since, Clock::now()));
  }

  // Whether the call runs all-dense without a full count (SkipAnalysis or
  // AcceptSample).
  bool dense_without_count() const { return dense_now_; }

  // The op counted a strided sample instead of every value and goes on to
  // Decide on its estimated row counts (AnalysisMode::kSampleSparse, or a
  // given threshold of 1 where the op's sparse kernel needs no counts):
  // the statistics say kAnalysisSampled (kStatNnz the estimate Finish is
  // given), and the op's memory counts the call as one without a full
  // count (its periodic full count comes on schedule).
  void MarkSampledCount() {
    stats_[kStatAnalysis] = kAnalysisSampled;
    sampled_count_ = true;
  }
  bool sampled_count() const { return sampled_count_; }

  // Before Decide, by an op that runs an automatic all-sparse plan on a
  // sample's estimate between periodic full counts (AnalysisMode::
  // kSampleSparse): the share of the full count such a plan pays per call
  // (SampledAllSparseCountShare), so that the decision charges it that
  // instead of a full count (DecisionPolicy::all_sparse_analysis_s).
  // Negative (the default): every call of a plan with sparse rows counts
  // fully.
  void set_all_sparse_count_share(double share) {
    all_sparse_count_share_ = share;
  }
  // The analysis seconds a plan with sparse rows pays per call on top of
  // the all-dense plan's, for a full count of `count_s` seconds: count_s,
  // or its all-sparse share for an all-sparse plan (`all_sparse`) where
  // set_all_sparse_count_share set one.
  double SparsePlanAnalysisSeconds(double count_s, bool all_sparse) const {
    return all_sparse && all_sparse_count_share_ >= 0.0
               ? count_s * all_sparse_count_share_
               : count_s;
  }
  // The threshold the call was given (< 0: automatic).
  float threshold_in() const { return threshold_in_; }

  // Statistics of a call with no work on m rows whose nonzeros are
  // row_nnz[m] (null: none counted, every row in the lowest bin).
  void FinishEmpty(int64_t m, int64_t k, const int64_t* row_nnz) {
    stats_[kStatRowsSparse] = m;
    double nnz = 0.0;
    for (int64_t i = 0; i < m; ++i) {
      const double d = (row_nnz != nullptr && k > 0)
                           ? static_cast<double>(row_nnz[i]) / k : 0.0;
      stats_[kStatHistogram + DensityBin(d)] += 1;
      if (row_nnz != nullptr) nnz += row_nnz[i];
    }
    stats_[kStatNnz] = nnz;
    stats_[kStatNnzSparse] = nnz;
  }

  // Decides this call's split: the threshold as given (or from the cost
  // model when automatic, calibrating the family with `op` first if
  // needed), the rows (histogram into the statistics) and the compaction.
  // row_nnz[shape.m] are the rows' nonzeros; shape.k_live is set.
  template <typename T, typename Functor>
  absl::Status Decide(tensorflow::OpKernelContext* ctx, Functor& op,
                      const SplitShape& shape, const int64_t* row_nnz,
                      FamilyModel* family, PlanMemory* memory,
                      const ParallelFor& pfor) {
    shape_ = shape;
    family_ = family;
    double thr = threshold_in_;
    bool all_dense = false;
    if (!shape.dense_allowed) {
      thr = 1.0;
    } else if (automatic()) {
      const double density = Density(row_nnz, shape);
      if (!family->calibrated()) {
        std::lock_guard<std::mutex> lock(
            split_runtime_internal::FirstCalibrationMutex(family));
        if (!family->calibrated()) {  // not by an op that held the lock
          CostTerms fitted;
          CalibrationTimings timings;
          TF_RETURN_IF_ERROR(
              Calibrate<T>(ctx, op, shape, pfor, &fitted, &timings));
          family->SetCalibration(fitted);
          split_runtime_internal::NoteCalibration(family, memory, density);
          split_runtime_internal::LogCalibration("calibration", family, shape,
                                                 density, timings, fitted);
        }  // else: this op's reference starts at its next call
      } else if (split_runtime_internal::CountCallRecalibrationDue(
                     family, memory, density)) {
        // This op's activation density moved far from its density at the
        // family's last calibration (RecalibrationPolicy): time both paths
        // again on this call's rows.
        CostTerms fitted;
        CalibrationTimings timings;
        TF_RETURN_IF_ERROR(
            Calibrate<T>(ctx, op, shape, pfor, &fitted, &timings));
        family->Recalibrate(fitted);
        split_runtime_internal::LogCalibration("recalibration", family,
                                               shape, density, timings,
                                               fitted);
      }
      // The decided plan, or now and then the other side's plan
      // (PlanMemory::DecideAndRetime): its time corrects the family's
      // terms for a path that stopped running.
      const DensityProfile profile =
          ProfileFromRowNnz(row_nnz, shape.m, shape.k, kDecisionBuckets);
      // Read once (after any calibration above): the decision and the
      // compaction (Apply) use the same terms.
      terms_ = family->Terms();
      have_terms_ = true;
      const CostTerms& terms = terms_;
      Plan decided;
      // A plan with sparse rows counts every value on every call; an op
      // that may count cheaply counts (almost) nothing while all-dense.
      DecisionPolicy policy;
      if (calibration_check_) {
        // The calibration's terms must agree with a plan with sparse rows
        // or a compaction (DecisionPolicy::calibration).
        calibration_ = family->BaseTerms();
        policy.calibration = calibration_;
      }
      if (cheap_analysis_ && count_s_per_elem_ > 0.0) {
        policy.analysis_s = count_s_per_elem_ *
                            static_cast<double>(shape.m) *
                            static_cast<double>(shape.k);
        if (all_sparse_count_share_ >= 0.0)
          policy.all_sparse_analysis_s =
              SparsePlanAnalysisSeconds(policy.analysis_s, true);
      }
      const Plan plan =
          memory->DecideAndRetime(shape, profile, terms, policy,
                                  retime_policy_, &retimed_, &decided);
      memory_ = memory;
      if (retimed_) {
        VLOG(1) << "tf_sparse_split retime family " << family << " op "
                << memory << " m " << shape.m << " k " << shape.k
                << " k_live " << shape.k_live << " | decided "
                << static_cast<int>(decided.kind) << " thr "
                << decided.threshold << " compact " << decided.compact
                << " predicted " << decided.predicted_s << " | runs "
                << static_cast<int>(plan.kind) << " thr " << plan.threshold
                << " compact " << plan.compact << " predicted "
                << plan.predicted_s;
      }
      if (VLOG_IS_ON(2)) {
        // The call's density profile (bucket:rows:nnz), for recordings.
        std::ostringstream os;
        for (int j = 0; j <= profile.buckets(); ++j)
          if (profile.rows[j] > 0.0)
            os << " " << j << ":" << profile.rows[j] << ":" << profile.nnz[j];
        VLOG(2) << "tf_sparse_split decide family " << family << " op "
                << memory << " m " << shape.m << " k " << shape.k
                << " k_live " << shape.k_live << " n "
                << shape.weight_elems_per_col << " terms "
                << terms.dense_fixed_s << " " << terms.dense_rate << " "
                << terms.sparse_fixed_s << " " << terms.convert_s_per_elem
                << " " << terms.sparse_rate << " " << terms.copy_s_per_elem
                << " decided " << static_cast<int>(decided.kind) << " "
                << decided.predicted_s << " " << decided.all_dense_s << " "
                << decided.best_sparse_s << " retimed " << retimed_
                << " profile" << os.str();
      }
      thr = plan.threshold;
      all_dense = plan.kind == PlanKind::kAllDense;
      TF_RETURN_IF_ERROR(Apply(row_nnz, thr, all_dense));
      // What this full count saw, for the next calls' ChooseAnalysis; a
      // full count the back-off led to that runs all-dense without
      // compaction (a re-time runs sparse rows) continues the back-off.
      int64_t zero_rows = 0;
      for (int64_t i = 0; i < shape.m; ++i) zero_rows += row_nnz[i] == 0;
      memory->RecordAnalysis(
          !sampled_count_,
          shape.m > 0 ? static_cast<double>(zero_rows) / shape.m : 0.0,
          shape.k > 0 ? static_cast<double>(shape.k - shape.k_live) / shape.k
                      : 0.0,
          ContinueBackoffFrom());
      return absl::OkStatus();
    }
    return Apply(row_nnz, thr, all_dense);
  }

  // nnz / (m k) of the call's activation from its row counts.
  static double Density(const int64_t* row_nnz, const SplitShape& shape) {
    if (shape.m <= 0 || shape.k <= 0) return 0.0;
    double nnz = 0.0;
    for (int64_t i = 0; i < shape.m; ++i) nnz += static_cast<double>(row_nnz[i]);
    return nnz / (static_cast<double>(shape.m) * static_cast<double>(shape.k));
  }

  // Applies an already chosen threshold (the GPU kernel decides its own
  // exploration): rows split, histogram, compaction.
  absl::Status Apply(const int64_t* row_nnz, double thr, bool all_dense) {
    split_ = SplitRows(row_nnz, shape_.m, shape_.k, thr, stats_,
                       /*dense_zero_rows_rule=*/!automatic());
    if (all_dense) AllRowsDense(shape_.m, &split_);
    threshold_ = all_dense ? 0.0 : thr;
    // Compaction: by the cost model for an automatic threshold; by a fixed
    // rule of the zero pattern for a given one (the same input then always
    // takes the same path, whatever the timings).
    CostTerms terms;
    if (automatic() && family_ != nullptr) {
      if (have_terms_) {
        terms = terms_;
      } else {
        const FamilyModel::Snapshot snap = family_->Get();
        if (snap.calibrated) terms = snap.terms;
      }
    }
    compact_ = ChooseCompaction(
        shape_, terms, static_cast<double>(split_.dense_rows.size()),
        kMinGainSeconds,
        calibration_check_ && have_terms_ ? &calibration_ : nullptr);
    analyzed_ = Clock::now();
    return absl::OkStatus();
  }

  // Runs this call all-dense after Decide chose sparse rows (an op's own
  // rule vetoes them: the convolutions' zero-free rule, conv_cost.h): every
  // row dense, threshold 0, compaction chosen as Apply does; the op's
  // memory remembers the all-dense plan (its hysteresis and analysis
  // choice then start from it). The statistics' histogram stays.
  void VetoSparseRows() {
    AllRowsDense(shape_.m, &split_);
    threshold_ = 0.0;
    const CostTerms terms =
        family_ != nullptr && family_->calibrated() ? family_->Terms()
                                                    : CostTerms();
    compact_ = ChooseCompaction(shape_, terms, static_cast<double>(shape_.m));
    if (memory_ != nullptr) memory_->RememberAllDense(ContinueBackoffFrom());
  }

  // For Apply() without Decide(): the call's shape and family.
  void SetProblem(const SplitShape& shape, FamilyModel* family) {
    shape_ = shape;
    family_ = family;
  }

  // The row split. After SkipAnalysis / AcceptSample (every row dense, no
  // count) its row lists are empty: no index vector is built for a call
  // that runs TF's kernel on the op's inputs; rows_dense() is m.
  const RowSplit& split() const { return split_; }
  int64_t rows_dense() const {
    return dense_now_ ? shape_.m
                      : static_cast<int64_t>(split_.dense_rows.size());
  }
  int64_t rows_sparse() const { return split_.sparse_rows.size(); }
  bool compact() const { return compact_; }
  double threshold() const { return threshold_; }
  // Whether this call runs a re-timed plan (PlanMemory::DecideAndRetime).
  bool retimed() const { return retimed_; }
  void set_compact(bool c) { compact_ = c; }

  // How many of the op instance's first all-dense calls at each shape hold
  // one-time costs and stay out of the family's ratios (default 1: the
  // primitive creation; PlanMemory::NoteDenseShape). A re-timed all-dense
  // call counts only the first.
  void set_dense_one_time_calls(int64_t calls) { dense_one_time_calls_ = calls; }
  // How many of the op instance's first calls with sparse rows at each m
  // stay out of the family's sparse ratios (default 0: none;
  // PlanMemory::NoteSparseShape).
  void set_sparse_one_time_calls(int64_t calls) { sparse_one_time_calls_ = calls; }
  // The re-time rule's policy of the op (default RetimePolicy(); the
  // convolutions hold a side for a few runs, ConvRetimePolicy).
  void set_retime_policy(const RetimePolicy& rp) { retime_policy_ = rp; }
  // Whether an automatic call's plan with sparse rows or compaction must
  // also be predicted a win by the family's calibration terms
  // (DecisionPolicy::calibration; default false; the matmul and SDDMM
  // CPU kernels set it).
  void set_calibration_check(bool on) { calibration_check_ = on; }
  int64_t dense_one_time_calls() const { return dense_one_time_calls_; }

  void DenseDone() { dense_done_ = Clock::now(); }
  void SparseDone() { sparse_done_ = Clock::now(); }

  // Writes the statistics tail and records the parts' times (the phase
  // timer's) in the family model. `nnz` = nonzeros of the whole activation;
  // `skipped` = values per row of all-zero columns the call skipped.
  void Finish(int64_t nnz, double skipped) {
    FinishWithTimes(nnz, skipped, Seconds(analyzed_, dense_done_),
                    Seconds(dense_done_, sparse_done_));
  }

  // The same with part times measured by the caller (a device kernel's
  // event times); NaN when not known yet: written as NaN, not recorded.
  void FinishWithTimes(int64_t nnz, double skipped, double dense_s,
                       double sparse_s) {
    stats_[kStatRowsDense] = rows_dense();
    stats_[kStatRowsSparse] = rows_sparse();
    stats_[kStatNnz] = dense_without_count() ? nnz_estimate_ : nnz;
    stats_[kStatZeroColsSkipped] = skipped;
    stats_[kStatTimeDense] = dense_s;
    stats_[kStatTimeSparse] = sparse_s;
    stats_[kStatTimeAnalyze] = Seconds(start_, analyzed_);
    stats_[kStatThreshold] = threshold_;
    stats_[kStatNnzSparse] = split_.nnz_sparse;
    if (family_ != nullptr && !std::isnan(dense_s) && !std::isnan(sparse_s)) {
      // The op's first all-dense call at a shape pays TF's primitive
      // creation for it: kept out of the ratios (FamilyModel::Record), as
      // are its next ones up to dense_one_time_calls() (a re-time: only
      // the first).
      const bool one_time =
          memory_ != nullptr && rows_dense() > 0 && rows_dense() == shape_.m &&
          memory_->NoteDenseShape(shape_.m, compact_ ? shape_.k_live : shape_.k,
                                  compact_, retimed_ ? 1 : dense_one_time_calls_);
      // Likewise the op's first calls with sparse rows at m (the
      // convolutions': sparse_one_time_calls_).
      const bool sparse_one_time =
          memory_ != nullptr && rows_sparse() > 0 &&
          memory_->NoteSparseShape(shape_.m, sparse_one_time_calls_);
      const bool dense_recorded = family_->Record(
          shape_, rows_dense(), compact_, dense_s, rows_sparse(),
          split_.nnz_sparse, sparse_s, one_time, sparse_one_time);
      // One line per automatic call at VLOG level 2 (the path it ran and
      // its part times): the recordings of tests/data are made of these.
      VLOG(2) << "tf_sparse_split call family " << family_ << " op "
              << memory_ << " m " << shape_.m << " k " << shape_.k
              << " k_live " << shape_.k_live << " rows_dense " << rows_dense()
              << " rows_sparse " << rows_sparse() << " compact " << compact_
              << " nnz_sparse " << split_.nnz_sparse << " dense_s " << dense_s
              << " sparse_s " << sparse_s << " analyze_s "
              << Seconds(start_, analyzed_) << " retimed " << retimed_
              << " dense_recorded " << dense_recorded << " sparse_one_time "
              << sparse_one_time << " analysis "
              << stats_[kStatAnalysis];
    }
    // The call's cost problem and its family's terms as they stand after
    // this record (stats.h, kStatKLive .. kStatCalibrated): what the Python
    // tuner decides and reports with. Only when a node reads the
    // statistics (the terms are kept computed: one lock).
    if (family_ != nullptr && stats_consumed()) {
      const FamilyModel::Snapshot snap = family_->Get();
      WriteCostStats(shape_, snap.terms, snap.calibrated, stats_);
    }
  }

  // Whether the statistics go to the op's output (a node consumes them),
  // not to the call's own buffer.
  bool stats_consumed() const { return stats_ != local_stats_; }

  const SplitShape& shape() const { return shape_; }

 private:
  // All dense on sample `c` (c.rows > 0, c.k_counted > 0): the histogram
  // estimated from its rows, kStatNnz from c.nnz_est.
  void RunSampleAllDense(const SplitShape& shape, const SampledCounts& c,
                         FamilyModel* family, PlanMemory* memory,
                         bool near_break_even = false) {
    const double scale =
        static_cast<double>(shape.m) / static_cast<double>(c.rows);
    for (int64_t i = 0; i < c.rows; ++i)
      stats_[kStatHistogram +
             DensityBin(static_cast<double>(c.row_nnz[i]) / c.k_counted)] +=
          scale;
    SetAllDense(shape, family, memory, kAnalysisSampled, c.nnz_est,
                near_break_even);
  }

  void SetAllDense(const SplitShape& shape, FamilyModel* family,
                   PlanMemory* memory, double analysis, double nnz_estimate,
                   bool near_break_even = false) {
    shape_ = shape;
    family_ = family;
    dense_now_ = true;  // every row dense: no row lists (rows_dense())
    threshold_ = 0.0;
    compact_ = false;
    nnz_estimate_ = nnz_estimate;
    stats_[kStatAnalysis] = analysis;
    memory_ = memory;
    memory->NoteAllDenseWithoutCount(analysis == kAnalysisSampled,
                                     near_break_even);
    analyzed_ = Clock::now();
  }

  // After a full count: the back-off count it continues from
  // (PlanMemory::RecordAnalysis), or -1 (it resets the back-off).
  int64_t ContinueBackoffFrom() const {
    return backoff_full_ && rows_sparse() == 0 && !compact_
               ? samples_dense_before_
               : -1;
  }

  Clock::time_point start_, analyzed_, dense_done_, sparse_done_;
  float threshold_in_;
  absl::Status status_;
  double* stats_ = nullptr;
  double local_stats_[kNumStats];  // the statistics when no one reads them
  SplitShape shape_;
  FamilyModel* family_ = nullptr;
  RowSplit split_;
  double threshold_ = 0.0;
  bool compact_ = false;
  double count_s_per_elem_ = 0.0;
  double nnz_estimate_ = 0.0;
  CostTerms terms_;          // the family's terms as this call read them
  bool have_terms_ = false;  // terms_ set (read once per call)
  bool calibration_check_ = false;  // set_calibration_check
  CostTerms calibration_;    // the family's calibration terms (Decide)
  bool dense_now_ = false;   // all dense without a count (SetAllDense)
  bool sampled_count_ = false;  // MarkSampledCount
  bool cheap_analysis_ = false;  // ChooseAnalysis ran with full_stats false
  double all_sparse_count_share_ = -1.0;  // set_all_sparse_count_share
  // ChooseAnalysis: the back-off led to a full count (a sample, or a
  // periodic count amid it), and the history's samples_dense before it.
  bool backoff_full_ = false;
  int64_t samples_dense_before_ = 0;
  bool retimed_ = false;           // this call runs a re-timed plan
  int64_t dense_one_time_calls_ = 1;
  int64_t sparse_one_time_calls_ = 0;
  RetimePolicy retime_policy_;
  PlanMemory* memory_ = nullptr;   // the op's memory (automatic calls)
};

}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_KERNELS_SPLIT_RUNTIME_H_
