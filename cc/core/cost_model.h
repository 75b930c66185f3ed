// The one cost model of the sparse-split ops (framework-free, layer 1).
//
// Every op splits an activation operand of `m` rows of `k` values (matmul:
// rows of op(a); convolution: images of H*W*C_in values) three ways: all-zero
// columns compacted away, rows of density (nnz / k) above a threshold to a
// dense kernel, the others to a sparse kernel. This header predicts the time
// of each choice from a few measured terms and picks the fastest plan:
//
//   dense part  = dense_fixed_s + flops_dense / dense_rate
//                 + copy_s_per_elem * (gathered + scattered elements)
//   sparse part = sparse_fixed_s + convert_s_per_elem * rows_sparse * k
//                 + useful_flops_sparse / sparse_rate
//   call        = dense part + sparse part   (heterogeneous: the max of the
//                 two, they run concurrently on two devices)
//
// The conversion term (CSR build: it scans every value of a sparse row, so
// it grows with rows * k, not with nnz) and the fixed per-call terms make
// small-N products come out dense. The decision only leaves the dense path
// when the sparse-containing plan is predicted to win by a safe margin, and
// keeps its previous plan unless another one is predicted to be better by a
// margin (hysteresis): the same shape and sparsity give the same plan call
// after call and run after run. Rates are robust estimates: calibrated once
// per problem family from the best of a few timings, then scaled by the
// median of the last calls' measured/predicted ratios.
//
// The ops use it through cc/kernels/split_runtime.h; Python reaches it
// through the pybind11 module (tf_sparse_split._kernels: decide_split,
// fit_calibration, SplitFamilyModel).
#ifndef TF_SPARSE_SPLIT_CC_CORE_COST_MODEL_H_
#define TF_SPARSE_SPLIT_CC_CORE_COST_MODEL_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace tf_sparse_split {

// Sizes and per-unit work of one call's split problem.
struct SplitShape {
  int64_t m = 0;       // rows (matmul: rows of op(a); conv: images)
  int64_t k = 0;       // values per row (matmul: k; conv: H*W*C_in)
  int64_t k_live = 0;  // values per row in columns that are not all-zero
  // Flop of the dense path per (row, column) it multiplies (matmul 2n).
  double dense_flops_per_elem = 0.0;
  // Useful flop of the sparse path per nonzero (matmul 2n).
  double sparse_flops_per_nnz = 0.0;
  // Values copied per dense row when the rows are split (the scatter of its
  // output row; the filter gradient's gather of its dY image).
  double row_copy_elems = 0.0;
  // Weight values gathered per live column when compacting (matmul n).
  double weight_elems_per_col = 0.0;
  bool can_compact = true;     // the dense path supports compaction
  bool dense_allowed = true;   // the dense path exists for this call
};

// The shape of a product op(a) [m, k] * op(b) [k, n]: 2n flop per
// multiplied value on both paths, an output row of n values scattered per
// dense row of a split, a row of op(b) (n values) gathered per live column
// when compacting.
SplitShape MatMulSplitShape(int64_t m, int64_t k, int64_t k_live, int64_t n);

// The shape of an SDDMM (mask [m, k], x [m, n], op(b) [k, n]; the rows of
// the mask are split): 2n flop per output value on the dense path (a GEMM
// row of x * op(b)^T, then masked) and per nonzero of the mask on the sparse
// path (one dot of length n); a split gathers the n values of a dense row of
// x and scatters its k output values; no compaction.
SplitShape SddmmSplitShape(int64_t m, int64_t k, int64_t k_live, int64_t n);

// Rows grouped by density for the decision. Bucket 0 holds the rows of
// density 0; bucket j in [1, B] those of density in ((j-1)/B, j/B]. The
// threshold of candidate j is j/B: buckets 0..j go sparse.
struct DensityProfile {
  std::vector<double> rows;  // [B + 1] rows per bucket
  std::vector<double> nnz;   // [B + 1] nonzeros in those rows
  int buckets() const { return static_cast<int>(rows.size()) - 1; }
};

// The exact profile of one call from its row nonzero counts (B buckets).
DensityProfile ProfileFromRowNnz(const int64_t* row_nnz, int64_t m, int64_t k,
                                 int buckets);

// An approximate profile from the statistics' row-density histogram
// (hist[bins], bin i = density in [i/bins, (i+1)/bins)); each bin's rows go
// to the bucket of its upper edge with nnz at its center density, scaled to
// add up to `total_nnz` when total_nnz >= 0.
DensityProfile ProfileFromHistogram(const double* hist, int bins, int64_t k,
                                    double total_nnz);

// The measured terms of one problem family (seconds, flop/s).
struct CostTerms {
  double dense_fixed_s = 0.0;       // per call that runs the dense path
  double dense_rate = 0.0;          // dense flop/s (0: unknown)
  double sparse_fixed_s = 0.0;      // per call that runs the sparse path
  double convert_s_per_elem = 0.0;  // per value of the rows sent sparse
  double sparse_rate = 0.0;         // useful sparse flop/s (0: unknown)
  double copy_s_per_elem = 0.0;     // gathers and scatters
  bool heterogeneous = false;       // the two parts overlap (max, not sum)

  bool dense_known() const { return dense_rate > 0.0; }
  bool sparse_known() const { return sparse_rate > 0.0; }
};

enum class PlanKind : int { kAllDense = 0, kSplit = 1, kAllSparse = 2 };

// A decision: which rows go where, whether to compact, and its prediction.
struct Plan {
  PlanKind kind = PlanKind::kAllDense;
  int bucket = -1;          // candidate j (threshold j/B); -1 for all-dense
  double threshold = 0.0;   // density threshold: rows above it go dense
  bool compact = false;     // compact all-zero columns of the dense part
  double predicted_s = 0.0;     // predicted seconds of this plan
  double all_dense_s = 0.0;     // predicted seconds of the all-dense plan
  double best_sparse_s = 0.0;   // best plan with sparse rows (inf if none)
};

// The default DecisionPolicy::min_gain_s: 100 microseconds. Below about a
// millisecond per call, allocation, sub-kernel launches and timing noise
// are of this order and not in the model (measured: a predicted 10-20%
// gain of a zero-row split with compaction at 512x2048 x N<=16 was a
// 10-40% loss).
constexpr double kMinGainSeconds = 1e-4;

// Margins of the decision (fractions of predicted time).
struct DecisionPolicy {
  // A plan with sparse rows replaces all-dense only when predicted at least
  // this much faster (prediction error and noise must not make us lose).
  double enter_margin = 0.10;
  // A plan with sparse rows is kept while predicted at least this much
  // faster than all-dense (hysteresis: enter at 10%, leave at 5%).
  double stay_margin = 0.05;
  // Another sparse-containing plan replaces the previous one only when
  // predicted this much faster than it.
  double switch_margin = 0.05;
  // Among plans predicted within this fraction of the fastest, the one with
  // the most dense rows is taken (noise in the terms does not move it).
  double tie_margin = 0.02;
  // Seconds a change (sparse rows instead of all-dense, or compaction) must
  // save at least, whatever the fractions above: in tiny calls every path
  // is a few fixed costs and their differences are timing noise.
  double min_gain_s = kMinGainSeconds;
};

// Predicted seconds of the dense part with `rows_dense` rows (compacted or
// not) and of the sparse part with `rows_sparse` rows holding `nnz_sparse`.
double PredictDenseSeconds(const SplitShape& s, const CostTerms& t,
                           double rows_dense, bool compact);
double PredictSparseSeconds(const SplitShape& s, const CostTerms& t,
                            double rows_sparse, double nnz_sparse);

// Predicted seconds of candidate `bucket` (-1: all-dense) of profile p.
double PredictPlanSeconds(const SplitShape& s, const DensityProfile& p,
                          const CostTerms& t, int bucket, bool compact);

// The plan minimising predicted time under `policy`; `previous` (may be
// null) is the plan the family used last (hysteresis). All-dense whenever
// the terms of either path are unknown or the dense path is the safe choice;
// all-sparse when the dense path is not allowed.
Plan DecideSplit(const SplitShape& s, const DensityProfile& p,
                 const CostTerms& t, const DecisionPolicy& policy,
                 const Plan* previous);

// Whether the dense part of `rows_dense` rows should compact the all-zero
// columns: by predicted time (saving at least min_gain_s) when the terms are
// known, else when at least
// 1/16 of the columns are dead or the rows are gathered anyway. Never when
// every column is dead (the dense kernels refuse an empty inner dimension;
// such rows are all-zero and cost nothing on the sparse path).
bool ChooseCompaction(const SplitShape& s, const CostTerms& t,
                      double rows_dense, double min_gain_s = kMinGainSeconds);

// Timings of one calibration (best of a few runs each) on a sample of the
// call's own rows: the dense path on rows_full and rows_part rows, the
// sparse path on rows_full rows (nnz_full), on the same rows thinned to
// nnz_thin nonzeros, and on rows_part rows (nnz_part), and a copy of
// copy_elems values.
struct CalibrationTimings {
  double rows_full = 0, rows_part = 0;
  double dense_full_s = 0, dense_part_s = 0;
  double nnz_full = 0, nnz_thin = 0, nnz_part = 0;
  double sparse_full_s = 0, sparse_thin_s = 0, sparse_part_s = 0;
  double copy_elems = 0, copy_s = 0;
};

// Fits CostTerms to calibration timings (two-point line fits, every term
// kept >= 0; a fit that noise makes negative falls back to a line through
// the origin). Uses s.k, s.dense_flops_per_elem, s.sparse_flops_per_nnz.
CostTerms FitCalibration(const SplitShape& s, const CalibrationTimings& c);

// The last `capacity` values, and their median.
class MedianWindow {
 public:
  explicit MedianWindow(int capacity = 15) : capacity_(capacity) {}
  void Add(double v);
  double Median(double if_empty) const;
  int size() const { return static_cast<int>(values_.size()); }

 private:
  int capacity_;
  int next_ = 0;
  std::vector<double> values_;
};

// The measured terms of one problem family (thread-safe): calibrated base
// terms and the median ratio measured/predicted of each path over the last
// calls, which scales the base terms.
class FamilyModel {
 public:
  bool calibrated() const;
  // Sets the base terms once (later calls keep the first calibration).
  void SetCalibration(const CostTerms& t);
  // Base terms scaled by the recent measured/predicted medians.
  CostTerms Terms() const;
  // Records one call's measured part times against the base prediction.
  // A path whose base terms are unknown is initialised from its
  // observation (a rate through the origin): the GPU kernel learns this way.
  void Record(const SplitShape& s, double rows_dense, bool compact,
              double dense_seconds, double rows_sparse, double nnz_sparse,
              double sparse_seconds);

 private:
  mutable std::mutex mu_;
  bool calibrated_ = false;
  CostTerms base_;
  MedianWindow dense_ratio_, sparse_ratio_;
};

// The last plan of one op instance (thread-safe): each layer keeps its own,
// so layers of one family with different sparsity do not disturb each
// other's hysteresis.
class PlanMemory {
 public:
  // DecideSplit against the remembered plan; remembers the result.
  Plan Decide(const SplitShape& s, const DensityProfile& p,
              const CostTerms& t, const DecisionPolicy& policy);

 private:
  std::mutex mu_;
  bool has_last_ = false;
  Plan last_;
};

// Process-wide family models, keyed by whatever identifies a problem
// family for an op (dtype, sizes, attrs). Entries live for the process.
FamilyModel& FamilyFor(const std::vector<int64_t>& key);

// Bucket of n for family keys: n itself up to 64, then powers of two (so
// small N, where the dense GEMM is least efficient, is calibrated exactly).
int64_t NBucket(int64_t n);

}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_CORE_COST_MODEL_H_
