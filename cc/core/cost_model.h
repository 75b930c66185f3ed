// The one cost model of the sparse-split ops (framework-free, layer 1).
//
// Every op splits an activation operand of `m` rows of `k` values (matmul:
// rows of op(a); convolution: images of H*W*C_in values) three ways: all-zero
// columns compacted away, rows of density (nnz / k) above a threshold to a
// dense kernel, the others to a sparse kernel. This header predicts the time
// of each choice from a few measured terms and picks the fastest plan:
//
//   dense part  = dense_fixed_s * (kc / k) + flops_dense / dense_rate
//                 + copy_s_per_elem * (gathered + scattered elements)
//                 (kc: the columns the dense GEMM multiplies, k_live when
//                 compacting, else k)
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
// median of the last calls' measured/predicted ratios. Those ratios correct
// only a path that runs, so an op instance whose plan stays on one side
// re-times the other side's plan now and then when it is predicted
// close (RetimePolicy, PlanMemory::DecideAndRetime).
//
// The ops use it through cc/kernels/split_runtime.h; Python reaches it
// through the pybind11 module (tf_sparse_split._kernels: decide_split,
// fit_calibration, SplitFamilyModel).
#ifndef TF_SPARSE_SPLIT_CC_CORE_COST_MODEL_H_
#define TF_SPARSE_SPLIT_CC_CORE_COST_MODEL_H_

#include <array>
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
  // Contiguous values per run of that gather: n where it copies whole rows
  // of op(b) (a product whose b is not transposed), else 0 (an indexed
  // gather, every value at the copy term). A gather of runs of r values
  // costs one indexed access per run (copy_s_per_elem) and a row copy per
  // value (CostTerms::row_copy_s_per_elem). Not in the statistics vector
  // (ReadCostStats gives 0).
  double weight_run_elems = 0.0;
  bool can_compact = true;     // the dense path supports compaction
  bool dense_allowed = true;   // the dense path exists for this call
};

// The shape of a product op(a) [m, k] * op(b) [k, n]: 2n flop per
// multiplied value on both paths, an output row of n values scattered per
// dense row of a split, a row of op(b) (n values) gathered per live column
// when compacting -- a copy of whole rows where b is not transposed
// (`weight_rows`: weight_run_elems n), else an indexed gather.
SplitShape MatMulSplitShape(int64_t m, int64_t k, int64_t k_live, int64_t n,
                            bool weight_rows = false);

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
  // Per value of a copy of whole rows (memcpy), the gather of op(b)'s live
  // rows when compacting (SplitShape::weight_run_elems); 0: unknown, priced
  // at copy_s_per_elem. The indexed copy term priced that gather 4-6x
  // above its time, and at batch 1 the hidden layer of an MLP (2048 ->
  // 2048, 31% of its columns live) ran the plain GEMV, 1.4x slower than
  // the compacted one. Not in the statistics vector (ReadCostStats gives 0).
  double row_copy_s_per_elem = 0.0;
  bool heterogeneous = false;       // the two parts overlap (max, not sum)
  // Multiplies the predicted seconds of a dense part that compacts
  // (PredictDenseSeconds): the median of such parts' measured / predicted
  // (FamilyModel), 1 until one ran. Its own scale, not the dense ratio:
  // at small m the compacted GEMM reads the gathered rows of op(b) from
  // cache while the plain one reads op(b) from memory. One window held
  // both at 1 x 784 -> 2048 (164 live columns): the compacted GEMV
  // (predicted 36 us + 190 us of gathers) ran in 240 us, ratio 1.06, the
  // plain one (predicted 170 us) in 500 us, ratio 3.0; the median moved
  // with the plan it came from and the compaction choice with it, the
  // plain GEMV (2.1x slower) running half the calls. Not in the
  // statistics vector (ReadCostStats gives 1).
  double compact_scale = 1.0;

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
  // For calls predicted under min_gain_s / min_gain_fraction all-dense (333
  // us by default) the least saving of sparse rows is this fraction of the
  // all-dense time instead, at least min_gain_floor_s (MinGainSeconds):
  // 100 us would exceed any saving
  // there, keeping a batch-1 convolution over a 79%-zero MNIST image dense
  // although its sparse path ran 1.4x faster; predicted gains of 10-20%
  // (the losses measured above) stay below it.
  double min_gain_fraction = 0.3;
  // ... but never less than this (seconds): in calls of a few tens of
  // microseconds every path is a few fixed costs, and a predicted gain of
  // a few microseconds is timing noise.
  double min_gain_floor_s = 2e-5;
  // Seconds of analysis a plan with sparse rows pays per call that the
  // all-dense plan does not (0: none): an op that may count cheaply
  // (full_stats false) counts nothing or a small sample while it stays
  // all-dense (ChooseAnalysis), but every value on every call of a plan
  // with sparse rows -- SplitCall::Decide sets it to the family's full
  // count time. Added to those plans' predictions in the entry and stay
  // tests (not to predicted_s: that is the parts' time). Measured: a
  // 128 x 2048 -> 10 bfloat16 product at 99% zeros entered the all-sparse
  // plan (parts predicted 58 us against 66-79 us dense) and ran at
  // 0.41-0.57x of TF's kernel, its full count taking 30-40 us per call.
  double analysis_s = 0.0;
  // Seconds of analysis an all-sparse plan pays per call instead of
  // analysis_s, where the op decides such calls on a sample
  // (AnalysisMode::kSampleSparse: the convolutions' direct kernel reads no
  // counts) and counts fully only every FullCountPeriod calls: the sample
  // plus the periodic full count, amortised. Negative: analysis_s. The
  // entry and stay tests charge each plan its own analysis, and an
  // all-sparse plan that beats the best plan once both analyses are
  // added is taken instead. Measured on the filter gradient of 32x56x56x64
  // -> 64 at 50% zeros (2-core Xeon): the all-sparse calls ran 20-22 ms
  // against 23.5-27 ms all-dense, but the full count (1.4 ms) charged on
  // every call kept the plan out, and the automatic op ran at 1.00x of
  // TF's kernel where all-sparse ran 1.17x.
  double all_sparse_analysis_s = -1.0;
  // The family's calibration terms (FamilyModel::BaseTerms: both paths
  // timed interleaved on the same rows, best of a few rounds, so a burst of
  // load slows both), or unknown (the default: no check). When known, a
  // plan with sparse rows is entered, kept or re-timed only where these
  // terms too predict it no slower than all-dense (within
  // calibration_max_loss), and a compaction only where they too predict it
  // saving min_gain_s (CalibrationAllows, ChooseCompaction). The current
  // terms are the calibration's scaled by each path's measured ratios, and
  // a path gets ratios only while it runs, so a burst of load seen by one
  // path alone moves the comparison: on the hidden layer of the CLI's MLP
  // at its natural sparsity (76% nonzeros, 256 x 2048 -> 2048, under load)
  // the dense ratios had put the plain GEMM at 53 ms and the compacted one
  // at 26 ms, and a split sending 253 of the 256 rows sparse was entered
  // at a predicted 23 ms; the calibration's terms put all-dense at 21 ms,
  // every plan with sparse rows behind it (that split at 34 ms, the one
  // sending the 13 sparsest rows at 22.5 ms) and the compaction 0.14 ms
  // behind, and in the step the op's forward ran at 1.2x the time of TF's
  // kernel. The matmul and SDDMM CPU kernels set it
  // (SplitCall::set_calibration_check).
  CostTerms calibration;
  // 0: the calibration must not predict a loss. Conservative where its
  // line fit is optimistic for the dense path (it takes the faster
  // per-row point, since noise only inflates timings): at 50% nonzeros the
  // same layer's calibration put all-sparse 12% behind all-dense although
  // its own timings at the full sample had it 17% ahead (24 against 29 ms).
  double calibration_max_loss = 0.0;
};

// Whether `policy.calibration` lets candidate `bucket` (>= 0: a plan with
// sparse rows) of profile p run: true when those terms are unknown, else
// when they predict it at most calibration_max_loss slower than all-dense
// (both without compaction).
bool CalibrationAllows(const SplitShape& s, const DensityProfile& p,
                       const DecisionPolicy& policy, int bucket);

// The least saving (seconds) a plan with sparse rows must promise against
// an all-dense call predicted at `all_dense_s`: min(min_gain_s,
// max(min_gain_floor_s, min_gain_fraction * all_dense_s)).
double MinGainSeconds(const DecisionPolicy& policy, double all_dense_s);

// Whether candidate `bucket` of profile p sends every row sparse (a plan
// of kind kAllSparse; -1 never does).
bool BucketAllSparse(const DensityProfile& p, int bucket);

// The analysis seconds a plan of candidate `bucket` pays per call beyond
// the all-dense plan's (DecisionPolicy::analysis_s, or
// all_sparse_analysis_s for an all-sparse candidate when that is set).
double PlanAnalysisSeconds(const DecisionPolicy& policy,
                           const DensityProfile& p, int bucket);

// Predicted seconds of the dense part with `rows_dense` rows (compacted or
// not) and of the sparse part with `rows_sparse` rows holding `nnz_sparse`.
// The dense fixed term scales with the columns the GEMM multiplies (k_live
// of k when compacting): calibration fits it as the intercept of the dense
// time against rows, and at small m that intercept is the read of op(b)'s
// k x n values, which compaction shrinks to k_live x n (measured at
// 32 x 784 -> 2048 with 331 dead columns: 604 us fitted on all columns, the
// compacted GEMM ran in 570 us with its weight gather).
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

// The plan of the other side of `decided` (a DecideSplit result) that a
// re-time runs: for a plan with sparse rows, the all-dense plan with its
// compaction choice; for the all-dense plan, every row sparse (a split that
// sends a few rows sparse would time mostly fixed costs, not the sparse
// path's rate). Its predicted_s is set, all_dense_s and best_sparse_s as in
// DecideSplit. False when there is none (terms unknown, no dense path, no
// row with nonzeros).
bool OtherSidePlan(const SplitShape& s, const DensityProfile& p,
                   const CostTerms& t, const DecisionPolicy& policy,
                   const Plan& decided, Plan* other);

// ---- Re-timing the path that stopped running --------------------------------
//
// The measured/predicted ratios (FamilyModel) correct only the path that
// runs. When the terms overestimate the path that is not taken -- its few
// observations held a oneDNN primitive creation or a burst of load, or the
// calibration timed the other path with its operand warm in cache (the
// sparse path of 32 x 784 -> 2048 timed 322 us there and 685 us in the model,
// where a 16 MB hidden layer evicts the weights between calls) -- nothing
// corrects them and the op keeps the slower path for good. So an op
// instance whose decided plan stays on one side (all-dense, or a plan with
// sparse rows) while the other side's plan (OtherSidePlan) is
// predicted at most `max_ratio` times slower runs that plan for one call
// now and then, and its measured time enters the family's ratios: the
// first time `first_period` automatic decisions after the side last
// changed, then after periods doubling up to `max_period` for as long as
// the side stays (the re-timed plan kept losing). The result is the same on
// every path (the threshold changes speed only); a re-time costs at most
// (max_ratio - 1) of one call as predicted, and c decisions on one side
// hold at most log2(c / first_period + 1) + c / max_period re-times.
// Deterministic: a call counter, no randomness. An all-dense call
// predicted under its least saving (MinGainSeconds: a few tens of
// microseconds) is never re-timed: no sparse terms could make it leave.
struct RetimePolicy {
  // 3x, not less: the second dense call of a shape can still run 2x its
  // steady time (a converted MLP's output layer: 139 us, then 63 us), and a
  // path estimated beyond max_ratio is never timed again.
  double max_ratio = 3.0;
  int64_t first_period = 4;
  int64_t max_period = 256;
  // A change of side is taken only once the side it changes to has run at
  // least this many calls since the current side began (re-times, or the
  // confirming runs below), each recorded before the decision: until then
  // a call whose decision changes side runs the new side's plan as a
  // re-time and the remembered plan stays. Three, because a path with
  // fewer than 3 ratios counts by its smallest (FamilyModel::Terms): from
  // the third run on the median of its observations decides, so one fast
  // re-timed observation cannot flip the plan alone. A right change costs
  // nothing (the confirming calls run the new side). 0 or 1: at once.
  int64_t confirm_runs = 3;
  // A side is left only after its own plan ran at least this many calls
  // since the side began (the confirming runs of the change that began it
  // included): until then a call whose decision changes side runs the
  // remembered plan (not a re-time; the decision is not remembered).
  // The mirror of confirm_runs for the side being left: its first runs are
  // judged by the smallest of fewer than 3 ratios, so one slow first call
  // (the first full-batch run of a path after calibration) must not flip
  // the plan alone. 0 (the default, the matmul ops): no hold; the
  // convolutions hold (ConvRetimePolicy, conv_cost.h).
  int64_t hold_runs = 0;
};

// The re-time schedule of one op instance.
struct RetimeState {
  int side = -1;              // 0: all-dense, 1: sparse rows, -1: no call yet
  int64_t calls_on_side = 0;  // decisions since the side last changed
  int64_t next_retime = 0;    // calls_on_side of the next re-time
  int64_t period = 0;         // the current period
  int64_t retimes = 0;        // re-times so far (all sides)
  int64_t other_runs = 0;     // calls that ran the other side since `side`
                              // began (re-times and confirming runs)
  int64_t confirmations = 0;  // confirming runs so far (all sides)
  int64_t side_runs = 0;      // calls that ran `side`'s plan since it began
                              // (the confirming runs of the change included)
  int64_t holds = 0;          // changes of side held (hold_runs; all sides)
};

// Counts one decision on `side` (0 all-dense, 1 sparse rows) and returns
// whether it re-times the other side; `close`: the other side's plan
// exists and is predicted within max_ratio. A change of side restarts the
// schedule at first_period. first_period <= 0 disables re-timing.
bool RetimeDue(RetimeState* st, int side, bool close, const RetimePolicy& rp);

// Whether the dense part of `rows_dense` rows should compact the all-zero
// columns: by predicted time (saving at least min_gain_s) when the terms are
// known -- by the `calibration` terms too when given and known
// (DecisionPolicy::calibration) -- else when at least
// 1/16 of the columns are dead or the rows are gathered anyway. Never when
// every column is dead (the dense kernels refuse an empty inner dimension;
// such rows are all-zero and cost nothing on the sparse path).
bool ChooseCompaction(const SplitShape& s, const CostTerms& t,
                      double rows_dense, double min_gain_s = kMinGainSeconds,
                      const CostTerms* calibration = nullptr);

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
  double row_copy_elems = 0, row_copy_s = 0;  // whole rows copied (memcpy)
};

// Values the calibration's copy timing gathers at least (2^16). The copy
// term is a per-value cost: timed on the few hundred values of a one-row
// sample (a 1 x 784 product: 392 values in 0.41 us) it was mostly the
// gather's fixed cost (the thread pool's dispatch), 1.0-1.7 ns a value
// against 0.56 ns on 12544 values or more; at batch 1 that priced the
// compaction's gather of the live rows of op(b) (164 x 2048 values) at 350
// us, and the dense GEMV over all 784 rows of op(b) ran instead of the
// compacted one, 1.3x slower.
constexpr int64_t kCalibrationCopyElems = int64_t{1} << 16;

// Rows of k values (k >= 1) the calibration's copy timing gathers every
// other column of: at least `rows_full` (the sample's rows) and enough for
// kCalibrationCopyElems values; rows past the sample repeat its rows.
int64_t CalibrationCopyRows(int64_t k, int64_t rows_full);

// Fits CostTerms to calibration timings (two-point line fits, every term
// kept >= 0; a fit that noise makes negative falls back to a line through
// the origin). Uses s.k, s.dense_flops_per_elem, s.sparse_flops_per_nnz.
CostTerms FitCalibration(const SplitShape& s, const CalibrationTimings& c);

// ---- How much of the analysis a call pays ---------------------------------
//
// Counting the nonzeros of every row and column of the activation is one
// pass over it (M*K values), paid before the decision. On a layer that stays
// dense that pass is pure overhead: at small N it is a large share of the
// dense GEMM itself. An automatic call therefore picks first how much to
// count (ChooseAnalysis), from its family's terms and what the op's last
// full count saw:
//   kSkip:   no plan other than the plain all-dense one can save its
//            minimum (MaxSavingSeconds: sparse rows MinGainSeconds, a
//            compaction min_gain_s), whatever the zeros: count nothing,
//            run TF's GEMM;
//   kSample: count a strided sample of the physical rows (SampleStride), and
//            count fully only when the estimate is near the break-even of
//            the decision (SampleSaysDense is false); samples that keep
//            saying all-dense come further apart (the calls between count
//            nothing: AnalysisPolicy::max_sample_period);
//   kFull:   count everything (the first calls, after a plan with sparse
//            rows or compaction, every AnalysisPolicy period-th call so the
//            statistics and the model stay fresh, explicit thresholds,
//            callers that want exact statistics);
//   kSampleSparse: after an all-sparse plan without compaction, in an op
//            whose sparse kernel needs no counts (AnalysisPolicy::
//            sample_all_sparse: the convolution's zero-skipping direct
//            kernel tests every value itself), count a strided sample and
//            decide on its estimate; a full count still comes every
//            FullCountPeriod calls (against the plan's predicted time) and
//            on the call a re-time falls due on.
enum class AnalysisMode : int {
  kFull = 0,
  kSample = 1,
  kSkip = 2,
  kSampleSparse = 3
};

struct AnalysisPolicy {
  // A full count at least every `min_period` automatic calls; the period
  // grows (up to max_period) while a full count would cost more than
  // `full_budget` of the predicted dense time per call, amortised.
  int min_period = 16;
  int max_period = 256;
  double full_budget = 0.01;
  // A sample costs at most this fraction of the predicted dense time ...
  double sample_budget = 0.005;
  // ... and holds at least this many physical rows (when there are twice
  // as many); a stride below 2 means the full count.
  int64_t min_sample_rows = 4;
  // The sampled estimate leads to a full count when a plan with sparse rows
  // or compaction comes within this fraction of the entry test (the enter
  // margin is lowered by it and min_gain_s halved).
  double near_margin = 0.25;
  // The full counts such samples ask for are rationed: a call may count
  // fully on a sample's request only while the counts since the last full
  // one cost at most `escalate_budget` of the predicted dense time per call
  // (count_s <= escalate_budget * dense_s * (calls since the full count +
  // 1)), unless the op's last decision wanted the other side (a change
  // pending); otherwise the call runs all-dense on the sample (the
  // convolutions: SplitCall::SampleMayCountFully). A 1x1 convolution whose
  // count is half its dense call (16x16x16x256 -> 64 at 50% zeros on the
  // 2-core Xeon: 0.2-0.4 ms against 0.6 ms) otherwise counted every value
  // on every fourth to eighth call near the break-even, 4% of its time;
  // 32x56x56x64 -> 64 (a 2 ms count, 22 ms dense) may still count every
  // fifth call.
  double escalate_budget = 0.02;
  // After s samples in a row said all-dense (since the last full count),
  // the next sample comes min(2^s, max_sample_period) calls after the last
  // one and the calls between count nothing: a layer that stays dense pays
  // its sample's fixed costs (column counts, the decision on the estimate:
  // 14-43 us a call measured, against a 0.5% budget) on a sixteenth of its
  // calls, and a change of its zeros is still seen within 16 calls (or at
  // the next full count). 1: a sample on every such call.
  int max_sample_period = 16;
  // The op can run an all-sparse plan on a sample's estimate
  // (kSampleSparse): its sparse kernel reads no counts, and a wrong
  // estimate changes which kernel runs an image, not the result. Off by
  // default (the matmul ops build a CSR from exact counts); the
  // convolution forward sets it. On 32x56x56x64 -> 64 the full count is
  // one pass over 25.7 MB, 1.1-1.4 ms of one core against 0.1 ms for a
  // sample of every 17th pixel, ~5% of the direct kernel's call at 50%
  // zeros.
  bool sample_all_sparse = false;
};

// After a near-break-even sample that the op's rules kept all-dense
// (PlanMemory::NoteAllDenseWithoutCount's near_break_even), the back-off
// period is capped at 2^kNearBreakEvenSampleRun = 4 calls (until a sample
// says all-dense clearly or a full count resets the back-off). A layer
// near the break-even may cross it with its next batches, and a sample every 16
// calls hid a change for that long: the forward at 32x56x56x64 -> 64,
// moved from 50% to 70% zeros on the same op, ran its next 12-20 calls
// all-dense (1.00x of TF's kernel, where all-sparse ran 1.6x); every 4
// calls, the sample costs ~0.5% of the dense call there.
constexpr int64_t kNearBreakEvenSampleRun = 2;

// What an op instance's last full count saw, and calls since.
struct AnalysisHistory {
  bool seen_full = false;
  int64_t calls_since_full = 0;
  double zero_row_frac = 0.0;  // all-zero rows of op(a) / m
  double dead_col_frac = 0.0;  // all-zero columns of op(a) / k
  int64_t samples_dense = 0;   // samples in a row that said all-dense
  int64_t calls_since_sample = 0;  // calls since the last of them
  // The last of them was near the break-even, kept all-dense by the op's
  // rules (kNearBreakEvenSampleRun caps the back-off).
  bool near_break_even = false;
};

// Upper bound of the seconds any plan other than plain all-dense can save
// on a call of shape `s` (k_live = k): all-zero rows (zero_row_frac of them)
// save at most their dense GEMM rows, rows with nonzeros at most their dense
// rows less their conversion (convert_s_per_elem * k) and the sparse fixed
// cost, compaction at most dead_col_frac of the dense flops; never more than
// the whole all-dense time. 0 when the terms are unknown.
double MaxSavingSeconds(const SplitShape& s, const CostTerms& t,
                        double zero_row_frac, double dead_col_frac);

// Full-count period of an op instance whose full count costs `count_s` and
// whose dense call is predicted `dense_s` (see AnalysisPolicy).
int FullCountPeriod(double count_s, double dense_s, const AnalysisPolicy& ap);

// The share of a full count that an all-sparse plan deciding on samples
// (AnalysisMode::kSampleSparse) pays per call, at most: its full count
// every FullCountPeriod calls (>= ap.min_period) plus a sample of every
// `sample_stride`-th value on the others (DecisionPolicy::
// all_sparse_analysis_s = this share times the full count's seconds).
double SampledAllSparseCountShare(const AnalysisPolicy& ap,
                                  int64_t sample_stride);

// Whether a sample that did not say all-dense may lead to a full count of
// `count_s` seconds on a call predicted `dense_s` all-dense, given the op's
// history and whether its last decision wanted the other side
// (AnalysisPolicy::escalate_budget).
bool SampleMayCountFully(double count_s, double dense_s,
                         const AnalysisHistory& h, bool change_pending,
                         const AnalysisPolicy& ap);

// The analysis of one automatic call. `previous` is the op's last plan
// (null: none yet), `count_s_per_elem` the family's counting cost per value
// (0: unknown), `full_stats` whether the caller wants exact statistics.
// `nothing_to_save` (may be null) receives whether a kSkip came from
// MaxSavingSeconds (no plan but the plain GEMM could save its minimum),
// not from the sample back-off.
AnalysisMode ChooseAnalysis(const SplitShape& s, const CostTerms& t,
                            const DecisionPolicy& policy,
                            const AnalysisPolicy& ap, const AnalysisHistory& h,
                            const Plan* previous, double count_s_per_elem,
                            bool full_stats, bool* nothing_to_save = nullptr);

// Stride over the `phys_rows` physical rows (each `phys_cols` values) of a
// sample that costs at most ap.sample_budget * dense_s at count_s_per_elem
// seconds per value, and holds at least ap.min_sample_rows rows; 1 (= count
// everything) when no stride of 2 or more fits.
int64_t SampleStride(int64_t phys_rows, int64_t phys_cols, double dense_s,
                     double count_s_per_elem, const AnalysisPolicy& ap);

// The estimated profile of rows_total rows of k_total values from counts
// row_nnz[rows] of `rows` of them over `k_counted` of their values each:
// densities row_nnz / k_counted, rows scaled by rows_total / rows, nonzeros
// by (rows_total / rows) * (k_total / k_counted).
DensityProfile EstimateProfile(const int64_t* row_nnz, int64_t rows,
                               int64_t k_counted, int64_t rows_total,
                               int64_t k_total, int buckets);

// Whether a sampled estimate (profile `p_est`, s_est.k_live = the columns
// live in the sample scaled to k: a lower bound, so that compaction is
// judged optimistically) is clear enough to run the plain all-dense plan
// with no full count: DecideSplit under `policy` relaxed by ap.near_margin
// (no previous plan) returns all-dense without compaction.
bool SampleSaysDense(const SplitShape& s_est, const DensityProfile& p_est,
                     const CostTerms& t, const DecisionPolicy& policy,
                     const AnalysisPolicy& ap);

// The last `capacity` values (at most kMaxCapacity), and their median. The
// values live in the object itself: adding one, or taking the median or the
// smallest, allocates nothing. They are kept sorted as well (Add moves at
// most `capacity` of them), so the median and the smallest are read, not
// searched: FamilyModel takes them after every recorded call, and four
// nth_element passes there cost ~0.8 us of an all-dense call's ~3 us of own
// time at 128 x 2048 -> 10.
class MedianWindow {
 public:
  static constexpr int kMaxCapacity = 15;
  explicit MedianWindow(int capacity = kMaxCapacity)
      : capacity_(capacity < 1 ? 1
                  : capacity > kMaxCapacity ? kMaxCapacity : capacity) {}
  void Add(double v);
  double Median(double if_empty) const;
  double Min(double if_empty) const;
  int size() const { return size_; }

 private:
  int capacity_;
  int next_ = 0;
  int size_ = 0;
  std::array<double, kMaxCapacity> values_{};  // in arrival order (a ring)
  std::array<double, kMaxCapacity> sorted_{};  // the same, ascending
};

// The measured terms of one problem family (thread-safe): calibrated base
// terms and the median ratio measured/predicted of each path over the last
// calls, which scales the base terms.
//
// What a call reads -- whether the family is calibrated, its scaled terms
// and its counting cost -- is kept computed (after every change, under the
// lock) in the first bytes of the object, so that one lock and two cache
// lines serve a call's decision (Snapshot): no median is taken and nothing
// is allocated per call.
class alignas(64) FamilyModel {
 public:
  // calibrated(), Terms() and CountSecondsPerElem() of one moment.
  struct Snapshot {
    bool calibrated = false;
    CostTerms terms;
    double count_s_per_elem = 0.0;
  };
  Snapshot Get() const;
  bool calibrated() const;
  // Sets the base terms once (later calls keep the first calibration).
  void SetCalibration(const CostTerms& t);
  // Replaces the base terms by a new calibration and forgets the measured
  // ratios (they scaled the old terms); the counting cost is kept.
  void Recalibrate(const CostTerms& t);
  // Base terms scaled by the recent measured/predicted ratios of each path:
  // their median, or the smallest while a path has fewer than 3 (as
  // calibration keeps the best of its timings: one slow call -- a burst of
  // load, a one-time cost -- must not make a path that rarely runs look
  // several times slower until it runs again).
  CostTerms Terms() const;
  // The calibration's terms, unscaled by the measured ratios (zero terms
  // before calibration).
  CostTerms BaseTerms() const;
  // Records one call's measured part times against the base prediction:
  // a dense part that compacted against the prediction of the terms as
  // they stand (compact_scale 1) into its own window (CostTerms::
  // compact_scale), any other dense part into the dense ratios.
  // A path whose base terms are unknown is initialised from its
  // observation (a rate through the origin): the GPU kernel learns this way.
  // `dense_one_time`: the caller knows the dense time holds a one-time
  // cost, and it is not recorded on a known dense path (the ops pass the
  // first all-dense call of each op instance at each shape,
  // PlanMemory::NoteDenseShape: it pays TF's oneDNN primitive creation for
  // that shape -- measured 1655 us against 570 us later at 32 x 453 ->
  // 2048, 195 us against 15-46 us at 32 x 2048 -> 10 -- which later calls
  // of the shape do not pay). `sparse_one_time`: likewise for the sparse
  // time on a known sparse path (the convolutions pass their first call
  // with sparse rows at each batch size, PlanMemory::NoteSparseShape).
  // Returns whether the dense observation entered the ratios.
  bool Record(const SplitShape& s, double rows_dense, bool compact,
              double dense_seconds, double rows_sparse, double nnz_sparse,
              double sparse_seconds, bool dense_one_time = false,
              bool sparse_one_time = false);
  // Records one full count of `elems` values that took `seconds`.
  void RecordCount(double elems, double seconds);
  // Median seconds per counted value of the last full counts (0: none).
  double CountSecondsPerElem() const;

 private:
  // Recomputes hot_ from base_ and the windows (mu_ held).
  void Refresh();
  // Recomputes hot_.terms from base_ and the paths' scales (mu_ held):
  // after a Record, whose window's scale alone was taken again.
  void RefreshTerms();

  mutable std::mutex mu_;
  Snapshot hot_;  // what calls read, kept current by Refresh
  // Each path's scale as Refresh takes it from its window (Robust).
  double dense_scale_ = 1.0, sparse_scale_ = 1.0, compact_scale_ = 1.0;
  CostTerms base_;
  MedianWindow dense_ratio_, sparse_ratio_, count_per_elem_;
  MedianWindow compact_ratio_;  // compacted dense parts (compact_scale)
};

// When a calibrated family times its paths again (SplitCall::Decide). Terms
// fitted at one density extrapolate poorly to a very different one (the
// split of a path's time into per-value and per-nonzero costs is a fit to
// a few noisy timings), and the measured/predicted ratios correct only the
// paths that run: a family calibrated on early, denser activations -- before
// a sparsity target took effect -- would keep predicting its sparse path
// from that fit and never run it. Recalibrating is due when the call's
// density (nnz / (m k)) has moved by `density_factor` either way and by at
// least `min_density_change` since the last calibration, after at least
// `min_calls` automatic calls, at most `max_recalibrations` times per family.
struct RecalibrationPolicy {
  double density_factor = 2.0;
  double min_density_change = 0.05;
  int64_t min_calls = 32;
  int max_recalibrations = 8;
};

bool RecalibrationDue(double calibrated_density, double density,
                      int64_t calls_since, int recalibrations,
                      const RecalibrationPolicy& p = RecalibrationPolicy());

// The records of the recalibration rule. A family is shared by every op
// instance of its key, and those can run at very different densities: in an
// MLP the weight gradients of the first two layers (x^T dY over the input
// pixels, about 19% nonzero, and h^T dY over a hidden layer's outputs, 7%
// under a 90% sparsity target) have one family (k = batch, the same N
// bucket, M >= 512). Compared against one density per family, their calls
// alternately looked "moved 2.7x" and recalibrated the family every 32
// calls until the limit, each time on the other op's rows, resetting the
// measured ratios of both. So the density that has to move is each op
// instance's own: its reference is its density on its first call after the
// family's latest calibration (the calibrating call's density for the op
// that calibrated).
struct FamilyCalibrationRecord {
  int64_t generation = 0;  // calibrations of the family seen so far
  int recalibrations = 0;
};
struct OpCalibrationRecord {
  int64_t generation = -1;  // the family generation `density` refers to
  double density = -1.0;
  int64_t calls = 0;        // automatic calls since
};

// A calibration (first or not) of the family on a call of `op` at `density`.
void NoteCalibration(FamilyCalibrationRecord* family, OpCalibrationRecord* op,
                     double density);

// Counts one automatic call of `op` at `density` on a calibrated family;
// true when the family should recalibrate now on this call's rows (the
// records then restart from it, as NoteCalibration). Not thread-safe: the
// caller serialises the calls on one family.
bool CountCallRecalibrationDue(
    FamilyCalibrationRecord* family, OpCalibrationRecord* op, double density,
    const RecalibrationPolicy& p = RecalibrationPolicy());

// The last plan of one op instance (thread-safe): each layer keeps its own,
// so layers of one family with different sparsity do not disturb each
// other's hysteresis.
class PlanMemory {
 public:
  // DecideSplit against the remembered plan; remembers the result.
  Plan Decide(const SplitShape& s, const DensityProfile& p,
              const CostTerms& t, const DecisionPolicy& policy);
  // Decide, then the re-time rule (RetimeDue, OtherSidePlan): returns the
  // plan to run on this call -- the decided plan, or on a re-time the other
  // side's plan (*retimed true). The decided plan is remembered either
  // way (the hysteresis never sees a re-time); *decided (may be null)
  // receives it. A decision that changes side is confirmed first
  // (RetimePolicy::confirm_runs): until the new side has run that many
  // calls since the current side began, the call runs the new decision's
  // plan as a re-time and the previous plan stays decided.
  Plan DecideAndRetime(const SplitShape& s, const DensityProfile& p,
                       const CostTerms& t, const DecisionPolicy& policy,
                       const RetimePolicy& rp, bool* retimed,
                       Plan* decided = nullptr);
  // This op instance's re-time schedule.
  RetimeState retime_state();
  // Whether this is one of the op instance's first `one_time_calls`
  // all-dense calls at (m, columns multiplied kc, compacted) -- its time
  // holds a one-time cost (FamilyModel::Record) -- counting it; at most
  // kShapesRemembered shapes are remembered, later new ones count as seen.
  // The default, 1, is the call that creates TF's oneDNN primitive; the
  // convolutions pass more (kConvDenseOneTimeCalls of conv_cost.h: their
  // next calls still run up to 2x their steady time).
  bool NoteDenseShape(int64_t m, int64_t kc, bool compact,
                      int64_t one_time_calls = 1);
  // The same for the op instance's calls that run sparse rows at m rows
  // (whatever their split): whether this is one of the first
  // `one_time_calls` of them, counting it (0: never; kept in the same
  // kShapesRemembered entries). The convolutions pass
  // kConvSparseOneTimeCalls (conv_cost.h).
  bool NoteSparseShape(int64_t m, int64_t one_time_calls);
  static constexpr int kShapesRemembered = 64;
  // Remembers an all-dense plan taken without a full count (a veto of
  // sparse rows). `continue_backoff_from` >= 0: the call's full count was
  // one a sample asked for or one amid the sample back-off (ChooseAnalysis'
  // *samples_dense_before), and the back-off goes on from it as after
  // RecordAnalysis' `continue_backoff_from`.
  void RememberAllDense(int64_t continue_backoff_from = -1);
  // What an automatic call that runs all-dense on a sample (`sampled`: a
  // sample that said all-dense, AnalysisPolicy::max_sample_period) or no
  // count notes, under one lock: the all-dense plan, RecordAnalysis(false),
  // and the call in the re-time schedule as a decision on the all-dense
  // side that re-timed nothing (RetimeState::calls_on_side), so that the
  // back-off does not stretch the schedule (ChooseAnalysis counts fully on
  // the call a re-time falls due on).
  // `near_break_even`: a sample that did not say all-dense but whose
  // estimate the op's own rules keep all-dense anyway (the convolutions'
  // vetoed samples, SplitCall::AcceptVetoedSample): it counts as a sample
  // that said all-dense, but the next sample comes at most four calls
  // later (kNearBreakEvenSampleRun).
  void NoteAllDenseWithoutCount(bool sampled = false,
                                bool near_break_even = false);

  // ChooseAnalysis against this op's history and last plan, under one lock:
  // the call at which a re-time falls due on the all-dense side
  // (RetimeFallsDue) counts fully, for the decision a re-time needs,
  // unless no plan but the GEMM could save its minimum (a kSkip of
  // MaxSavingSeconds: its re-time waits for the next periodic full count).
  // `samples_dense_before` (may be null) receives the history's
  // samples_dense before this call (the back-off RecordAnalysis /
  // RememberAllDense continue).
  AnalysisMode ChooseAnalysis(const SplitShape& s, const CostTerms& t,
                              const DecisionPolicy& policy,
                              const AnalysisPolicy& ap,
                              double count_s_per_elem, bool full_stats,
                              int64_t* samples_dense_before = nullptr);
  // Records the outcome of one automatic call's analysis: a full count
  // (with its all-zero row and column fractions) or not. A full count
  // resets the sample back-off, unless `continue_backoff_from` >= 0: the
  // count was one a sample asked for (SampleSaysDense false) or a periodic
  // one amid the back-off, and the call ran all-dense without compaction;
  // it then counts as one more sample that said all-dense, so that the
  // back-off (AnalysisPolicy::max_sample_period) goes on from
  // `continue_backoff_from` samples: near the break-even every sample asks
  // for the full count, and an op kept all-dense by the decision's margins
  // otherwise counted every value on every call (SplitCall::Decide passes
  // it for every op). Not when the call's decision wanted the other side
  // and was held or confirming (change_pending_): the back-off resets, so
  // the decisions that complete the change come on the next calls -- a
  // forward at 32x56x56x64 -> 64 moved from 50% to 70% zeros on the same
  // op otherwise stayed all-dense for 20 calls (one decision a back-off
  // period apart, three held ones needed), at 1.00x of TF's kernel where
  // all-sparse ran 1.6x.
  void RecordAnalysis(bool full, double zero_row_frac, double dead_col_frac,
                      int64_t continue_backoff_from = -1);
  // The back-off continuation of RecordAnalysis alone (for replays).
  void NoteSampledFullStayedDense(int64_t samples_dense);
  // The re-time count of NoteAllDenseWithoutCount alone (for replays).
  void NoteDenseCallWithoutDecision();
  // Whether the next decision on the all-dense side is the one a re-time
  // falls due on (calls_on_side + 1 == next_retime).
  bool RetimeFallsDue();
  AnalysisHistory history();
  // Whether the last full count's decision wanted the other side and was
  // held or confirming (the back-off reset it caused is still in force).
  bool change_pending();
  // SampleMayCountFully (above) on this op's history and pending change,
  // read under one lock.
  bool SampleMayCountFully(double count_s, double dense_s,
                           const AnalysisPolicy& ap);

  // This op instance's record of the recalibration rule (guarded by the
  // caller's lock on the family records, not by this object's mutex).
  OpCalibrationRecord* calibration_record() { return &calibration_; }

 private:
  // What an all-dense call reads and writes first (the lock, the last plan,
  // the analysis history), then the rest; the shapes seen live in the
  // object, so no call allocates.
  std::mutex mu_;
  bool has_last_ = false;
  AnalysisHistory history_;
  Plan last_;
  RetimeState retime_;
  // The last DecideAndRetime wanted the other side but held the remembered
  // plan or ran the new side as a confirming re-time: a full count on such
  // a call does not continue the sample back-off (RecordAnalysis,
  // RememberAllDense), so the decisions that complete the change come on
  // the next calls, not a back-off period apart.
  bool change_pending_ = false;
  OpCalibrationRecord calibration_;
  // NoteDenseShape / NoteSparseShape on the key (m, kc, c).
  bool NoteShape(int64_t m, int64_t kc, int64_t c, int64_t one_time_calls);
  // All-dense shapes run: (m, kc, compact, calls so far); the calls with
  // sparse rows: (m, -1, 2, calls so far).
  int dense_shape_count_ = 0;
  std::array<std::array<int64_t, 4>, kShapesRemembered> dense_shapes_{};
};

// Process-wide family models, keyed by whatever identifies a problem
// family for an op (dtype, sizes, attrs). Entries live for the process.
FamilyModel& FamilyFor(const std::vector<int64_t>& key);

// Bucket of n for family keys: n itself up to 64, then powers of two (so
// small N, where the dense GEMM is least efficient, is calibrated exactly).
int64_t NBucket(int64_t n);

// Bucket of m (rows of the activation) for family keys: the next power of
// two, 512 and above in one bucket. A GEMM's rate depends on M as much as on
// N (at M = 1 it is a matrix-vector product bound by reading op(b)): terms
// calibrated at one batch size must not decide for another.
int64_t MBucket(int64_t m);

// The family key of a SparseSplitMatMul / SparseSplitSddmm call on the CPU:
// (family_op, dtype, k, NBucket(n), transpose_b, MBucket(m)).
std::vector<int64_t> MatMulFamilyKey(int64_t family_op, int64_t dtype,
                                     int64_t m, int64_t k, int64_t n,
                                     bool transpose_b);

// ---- The cost problem in the statistics vector -----------------------------
//
// Every call writes its SplitShape and its family's current CostTerms into
// the statistics vector (entries kStatKLive .. kStatCalibrated of
// cc/core/stats.h). That is how the terms of the one estimator, the family
// models of the op library, reach the Python tuner: the pybind11 module is
// a separate shared object with its own FamilyFor registry, which the ops
// never fill.

// Writes s.k_live, the per-unit fields of `s`, `t` and `calibrated` into
// stats[kNumStats] (m and k are kStatM / kStatK, written by the call).
void WriteCostStats(const SplitShape& s, const CostTerms& t, bool calibrated,
                    double* stats);

// The inverse of WriteCostStats on one statistics vector (or a mean of
// several): m, k, k_live rounded to integers and clamped (0 <= k_live <=
// k), every term clamped to >= 0 (NaN read as 0: unknown), heterogeneous
// when stats[kStatHeterogeneous] is kHeteroRan; returns whether the family
// was calibrated (stats[kStatCalibrated] >= 0.5).
bool ReadCostStats(const double* stats, SplitShape* s, CostTerms* t);

}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_CORE_COST_MODEL_H_
