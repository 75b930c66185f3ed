// The one cost model of the sparse-split ops; see cost_model.h.
#include "cc/core/cost_model.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "cc/core/stats.h"

namespace tf_sparse_split {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Rows of the profile sent sparse by candidate `bucket` (buckets 0..bucket)
// and their nonzeros.
void SparseShare(const DensityProfile& p, int bucket, double* rows,
                 double* nnz) {
  *rows = 0.0;
  *nnz = 0.0;
  for (int j = 0; j <= bucket && j < static_cast<int>(p.rows.size()); ++j) {
    *rows += p.rows[j];
    *nnz += p.nnz[j];
  }
}

double TotalRows(const DensityProfile& p) {
  double r = 0.0;
  for (double v : p.rows) r += v;
  return r;
}

// The faster compaction choice for `bucket`: returns its time, sets
// *compact.
double BestOfCompaction(const SplitShape& s, const DensityProfile& p,
                        const CostTerms& t, int bucket,
                        const DecisionPolicy& policy, bool* compact) {
  const double min_gain_s = policy.min_gain_s;
  const double plain = PredictPlanSeconds(s, p, t, bucket, false);
  *compact = false;
  if (s.can_compact && s.k_live > 0 && s.k_live < s.k) {
    const double packed = PredictPlanSeconds(s, p, t, bucket, true);
    const CostTerms& c = policy.calibration;
    // The calibration's terms must agree (DecisionPolicy::calibration).
    const bool agreed =
        !c.dense_known() ||
        PredictPlanSeconds(s, p, c, bucket, true) <
            PredictPlanSeconds(s, p, c, bucket, false) - min_gain_s;
    if (packed < plain - min_gain_s && agreed) {
      *compact = true;
      return packed;
    }
  }
  return plain;
}

Plan MakePlan(const SplitShape& s, const DensityProfile& p, int bucket,
              bool compact, double predicted) {
  Plan plan;
  plan.bucket = bucket;
  plan.compact = compact;
  plan.predicted_s = predicted;
  if (bucket < 0) {
    plan.kind = PlanKind::kAllDense;
    plan.threshold = 0.0;
    return plan;
  }
  const int b = p.buckets();
  double rows, nnz;
  SparseShare(p, bucket, &rows, &nnz);
  plan.threshold = b > 0 ? static_cast<double>(bucket) / b : 1.0;
  // The threshold stays the bucket's edge even when every row of this call
  // falls below it: the next call's rows are judged by the same edge.
  plan.kind = rows >= TotalRows(p) ? PlanKind::kAllSparse : PlanKind::kSplit;
  if (plan.kind == PlanKind::kAllSparse) plan.compact = false;
  (void)s;
  return plan;
}

}  // namespace

SplitShape MatMulSplitShape(int64_t m, int64_t k, int64_t k_live,
                             int64_t n, bool weight_rows) {
  SplitShape s;
  s.m = m;
  s.k = k;
  s.k_live = k_live;
  s.dense_flops_per_elem = 2.0 * static_cast<double>(n);
  s.sparse_flops_per_nnz = 2.0 * static_cast<double>(n);
  s.row_copy_elems = static_cast<double>(n);
  s.weight_elems_per_col = static_cast<double>(n);
  s.weight_run_elems = weight_rows ? static_cast<double>(n) : 0.0;
  return s;
}

SplitShape SddmmSplitShape(int64_t m, int64_t k, int64_t k_live,
                           int64_t n) {
  SplitShape s = MatMulSplitShape(m, k, k_live, n);
  // PredictDenseSeconds charges k values per gathered row (here: the masked
  // scatter of the output row) plus row_copy_elems (the gather of x's row).
  s.row_copy_elems = static_cast<double>(n);
  s.weight_elems_per_col = 0.0;
  s.can_compact = false;
  return s;
}

DensityProfile ProfileFromRowNnz(const int64_t* row_nnz, int64_t m, int64_t k,
                                 int buckets) {
  DensityProfile p;
  p.rows.assign(buckets + 1, 0.0);
  p.nnz.assign(buckets + 1, 0.0);
  for (int64_t i = 0; i < m; ++i) {
    const int64_t z = row_nnz[i];
    int j = 0;
    if (z > 0 && k > 0) {
      // Smallest j with z / k <= j / buckets, in integers (exact).
      j = static_cast<int>((z * buckets + k - 1) / k);
      j = std::min(std::max(j, 1), buckets);
    }
    p.rows[j] += 1.0;
    p.nnz[j] += static_cast<double>(z);
  }
  return p;
}

DensityProfile ProfileFromHistogram(const double* hist, int bins, int64_t k,
                                    double total_nnz) {
  DensityProfile p;
  p.rows.assign(bins + 1, 0.0);
  p.nnz.assign(bins + 1, 0.0);
  double estimate = 0.0;
  for (int i = 0; i < bins; ++i) {
    p.rows[i + 1] = hist[i];
    p.nnz[i + 1] = hist[i] * (i + 0.5) / bins * static_cast<double>(k);
    estimate += p.nnz[i + 1];
  }
  if (total_nnz >= 0.0 && estimate > 0.0) {
    for (double& v : p.nnz) v *= total_nnz / estimate;
  }
  return p;
}

double PredictDenseSeconds(const SplitShape& s, const CostTerms& t,
                           double rows_dense, bool compact) {
  if (rows_dense <= 0.0) return 0.0;
  const double kc = compact ? static_cast<double>(s.k_live)
                            : static_cast<double>(s.k);
  const double flops = rows_dense * kc * s.dense_flops_per_elem;
  double copied = 0.0;
  const bool split = rows_dense < static_cast<double>(s.m);
  if (compact || split) copied += rows_dense * kc;  // gather of the rows
  double weight_s = 0.0;
  if (compact) {
    const double w = static_cast<double>(s.k_live) * s.weight_elems_per_col;
    if (s.weight_run_elems > 1.0 && t.row_copy_s_per_elem > 0.0) {
      // Whole rows copied: one indexed access per run, a row copy per value.
      weight_s = w * t.row_copy_s_per_elem +
                 w / s.weight_run_elems * t.copy_s_per_elem;
    } else {
      copied += w;
    }
  }
  if (split) copied += rows_dense * s.row_copy_elems;
  const double rate = t.dense_rate > 0.0 ? t.dense_rate : 1.0;
  // The fixed term is the read of op(b) at small m: k_live of its k rows
  // when compacting (see the header).
  const double fixed =
      compact && s.k > 0 ? t.dense_fixed_s * kc / static_cast<double>(s.k)
                         : t.dense_fixed_s;
  const double seconds =
      fixed + flops / rate + copied * t.copy_s_per_elem + weight_s;
  return compact && t.compact_scale > 0.0 ? seconds * t.compact_scale
                                          : seconds;
}

double PredictSparseSeconds(const SplitShape& s, const CostTerms& t,
                            double rows_sparse, double nnz_sparse) {
  if (rows_sparse <= 0.0) return 0.0;
  if (nnz_sparse <= 0.0) {
    // All-zero rows: their output is zeroed, nothing converted.
    return rows_sparse * s.row_copy_elems * t.copy_s_per_elem;
  }
  const double rate = t.sparse_rate > 0.0 ? t.sparse_rate : 1.0;
  return t.sparse_fixed_s +
         t.convert_s_per_elem * rows_sparse * static_cast<double>(s.k) +
         nnz_sparse * s.sparse_flops_per_nnz / rate;
}

double PredictPlanSeconds(const SplitShape& s, const DensityProfile& p,
                          const CostTerms& t, int bucket, bool compact) {
  double rows_sparse = 0.0, nnz_sparse = 0.0;
  if (bucket >= 0) SparseShare(p, bucket, &rows_sparse, &nnz_sparse);
  const double rows_dense = std::max(0.0, TotalRows(p) - rows_sparse);
  const double td = PredictDenseSeconds(s, t, rows_dense, compact);
  const double ts = PredictSparseSeconds(s, t, rows_sparse, nnz_sparse);
  return t.heterogeneous ? std::max(td, ts) : td + ts;
}

bool ChooseCompaction(const SplitShape& s, const CostTerms& t,
                      double rows_dense, double min_gain_s,
                      const CostTerms* calibration) {
  if (!s.can_compact || rows_dense <= 0.0 || s.k_live <= 0 || s.k_live >= s.k)
    return false;
  if (!t.dense_known()) {
    return rows_dense < static_cast<double>(s.m) ||
           (s.k - s.k_live) * 16 >= s.k;
  }
  if (calibration != nullptr && calibration->dense_known() &&
      !(PredictDenseSeconds(s, *calibration, rows_dense, true) <
        PredictDenseSeconds(s, *calibration, rows_dense, false) - min_gain_s))
    return false;
  return PredictDenseSeconds(s, t, rows_dense, true) <
         PredictDenseSeconds(s, t, rows_dense, false) - min_gain_s;
}

bool CalibrationAllows(const SplitShape& s, const DensityProfile& p,
                       const DecisionPolicy& policy, int bucket) {
  const CostTerms& c = policy.calibration;
  if (bucket < 0 || !c.dense_known() || !c.sparse_known()) return true;
  const double dense = PredictPlanSeconds(s, p, c, -1, false);
  const double plan = PredictPlanSeconds(s, p, c, bucket, false);
  return plan <= dense * (1.0 + policy.calibration_max_loss);
}

bool BucketAllSparse(const DensityProfile& p, int bucket) {
  if (bucket < 0) return false;
  double rows, nnz;
  SparseShare(p, bucket, &rows, &nnz);
  return rows >= TotalRows(p);
}

double PlanAnalysisSeconds(const DecisionPolicy& policy,
                           const DensityProfile& p, int bucket) {
  if (bucket < 0) return 0.0;
  if (policy.all_sparse_analysis_s >= 0.0 && BucketAllSparse(p, bucket))
    return policy.all_sparse_analysis_s;
  return std::max(0.0, policy.analysis_s);
}

double MinGainSeconds(const DecisionPolicy& policy, double all_dense_s) {
  double rel = policy.min_gain_fraction * all_dense_s;
  if (!(rel >= 0.0)) rel = policy.min_gain_s;  // NaN (0 * inf)
  return std::min(policy.min_gain_s, std::max(policy.min_gain_floor_s, rel));
}

namespace {

// The fastest plan with sparse rows; among those within tie_margin of it,
// the one with the most dense rows (the smallest bucket). *best: the
// fastest time (inf when there is no candidate); false when none.
bool BestSparsePlan(const SplitShape& s, const DensityProfile& p,
                    const CostTerms& t, const DecisionPolicy& policy,
                    Plan* plan, double* best_s) {
  const int b = p.buckets();
  *best_s = kInf;
  if (b < 0) return false;
  std::vector<double> times(b + 1, kInf);
  std::vector<char> packs(b + 1, 0);
  double best = kInf;
  double prev_rows = -1.0;
  for (int j = 0; j <= b; ++j) {
    double rows, nnz;
    SparseShare(p, j, &rows, &nnz);
    if (rows <= 0.0 || rows == prev_rows) continue;  // same split as j-1
    prev_rows = rows;
    // A plan the calibration's terms predict a clear loss is no candidate
    // (DecisionPolicy::calibration).
    if (!CalibrationAllows(s, p, policy, j)) continue;
    bool c = false;
    times[j] = BestOfCompaction(s, p, t, j, policy, &c);
    packs[j] = c;
    best = std::min(best, times[j]);
  }
  *best_s = best;
  if (!(best < kInf)) return false;
  int pick = -1;
  for (int j = 0; j <= b; ++j) {
    if (times[j] <= best * (1.0 + policy.tie_margin)) {
      pick = j;
      break;
    }
  }
  *plan = MakePlan(s, p, pick, packs[pick], times[pick]);
  return true;
}

}  // namespace

Plan DecideSplit(const SplitShape& s, const DensityProfile& p,
                 const CostTerms& t, const DecisionPolicy& policy,
                 const Plan* previous) {
  const int b = p.buckets();
  if (!s.dense_allowed) {
    Plan plan = MakePlan(s, p, b, false, 0.0);
    plan.kind = PlanKind::kAllSparse;
    plan.threshold = 1.0;
    if (t.sparse_known()) plan.predicted_s = PredictPlanSeconds(s, p, t, b, false);
    plan.all_dense_s = kInf;
    plan.best_sparse_s = plan.predicted_s;
    return plan;
  }
  bool dense_compact = false;
  const double all_dense =
      t.dense_known() ? BestOfCompaction(s, p, t, -1, policy, &dense_compact) : 0.0;
  Plan dense_plan = MakePlan(s, p, -1, dense_compact, all_dense);
  dense_plan.all_dense_s = all_dense;
  dense_plan.best_sparse_s = kInf;
  if (!t.dense_known() || !t.sparse_known() || b < 0) return dense_plan;

  double best = kInf;
  Plan best_plan;
  const bool has_best = BestSparsePlan(s, p, t, policy, &best_plan, &best);
  dense_plan.best_sparse_s = best;
  if (!has_best) return dense_plan;
  double t_best = best_plan.predicted_s;
  // Each plan pays its own analysis (DecisionPolicy::all_sparse_analysis_s):
  // where an all-sparse call counts only a sample, the all-sparse plan may
  // beat a faster split that counts every value.
  double analysis = PlanAnalysisSeconds(policy, p, best_plan.bucket);
  if (best_plan.kind != PlanKind::kAllSparse &&
      policy.all_sparse_analysis_s >= 0.0 && b >= 0 &&
      CalibrationAllows(s, p, policy, b)) {
    const double t_all = PredictPlanSeconds(s, p, t, b, false);
    const double a_all = PlanAnalysisSeconds(policy, p, b);
    if (t_all + a_all < t_best + analysis) {
      best_plan = MakePlan(s, p, b, false, t_all);
      t_best = t_all;
      analysis = a_all;
    }
  }
  best_plan.all_dense_s = all_dense;
  best_plan.best_sparse_s = best;

  const bool had_sparse = previous != nullptr &&
                          previous->kind != PlanKind::kAllDense &&
                          previous->bucket >= 0 && previous->bucket <= b;
  // Entry into a plan with sparse rows: only for a safe predicted win,
  // its analysis included (DecisionPolicy::analysis_s).
  const double min_gain = MinGainSeconds(policy, all_dense);
  const bool enters =
      t_best + analysis <= all_dense * (1.0 - policy.enter_margin) &&
      t_best + analysis <= all_dense - min_gain;
  if (!had_sparse) return enters ? best_plan : dense_plan;
  // The previous split, re-predicted on this call's rows.
  bool prev_compact = false;
  const double t_prev =
      BestOfCompaction(s, p, t, previous->bucket, policy, &prev_compact);
  const double prev_analysis = PlanAnalysisSeconds(policy, p, previous->bucket);
  if (!(t_prev + prev_analysis <= all_dense * (1.0 - policy.stay_margin)) ||
      !(t_prev + prev_analysis <= all_dense - 0.5 * min_gain) ||
      !CalibrationAllows(s, p, policy, previous->bucket)) {
    // The kept plan no longer wins safely; switch only to a plan that
    // passes the entry test, else go dense.
    return enters ? best_plan : dense_plan;
  }
  if (t_best + analysis - prev_analysis <
      t_prev * (1.0 - policy.switch_margin))
    return best_plan;
  Plan kept = MakePlan(s, p, previous->bucket, prev_compact, t_prev);
  kept.all_dense_s = all_dense;
  kept.best_sparse_s = best;
  return kept;
}

bool OtherSidePlan(const SplitShape& s, const DensityProfile& p,
                   const CostTerms& t, const DecisionPolicy& policy,
                   const Plan& decided, Plan* other) {
  if (!s.dense_allowed || !t.dense_known() || !t.sparse_known()) return false;
  bool dense_compact = false;
  const double all_dense =
      BestOfCompaction(s, p, t, -1, policy, &dense_compact);
  double best = kInf;
  Plan best_plan;
  const bool has_best = BestSparsePlan(s, p, t, policy, &best_plan, &best);
  if (decided.kind == PlanKind::kAllDense) {
    // Every row sparse: a split that sends a few rows sparse (the best plan
    // with sparse rows when the sparse terms look slow) measures mostly
    // fixed costs, not the sparse path's rate.
    const int b = p.buckets();
    if (!has_best || b < 0) return false;
    // Nor when the calibration's terms predict it a clear loss: no call
    // could then enter it (DecisionPolicy::calibration), and a re-time
    // would cost up to max_ratio calls' time for nothing.
    if (!CalibrationAllows(s, p, policy, b)) return false;
    *other = MakePlan(s, p, b, false, PredictPlanSeconds(s, p, t, b, false));
  } else {
    *other = MakePlan(s, p, -1, dense_compact, all_dense);
  }
  other->all_dense_s = all_dense;
  other->best_sparse_s = best;
  return true;
}

bool RetimeDue(RetimeState* st, int side, bool close, const RetimePolicy& rp) {
  if (side != st->side) {
    st->side = side;
    st->calls_on_side = 0;
    st->period = rp.first_period;
    st->next_retime = rp.first_period;
    st->other_runs = 0;
  }
  ++st->calls_on_side;
  if (!close || rp.first_period <= 0 || st->calls_on_side < st->next_retime)
    return false;
  st->period = std::max<int64_t>(
      1, std::min<int64_t>(2 * st->period, std::max(rp.max_period,
                                                    rp.first_period)));
  st->next_retime = st->calls_on_side + st->period;
  ++st->retimes;
  return true;
}

namespace {

// Slope and intercept of the line through (x0, y0), (x1, y1), both >= 0;
// when noise makes either negative (or x0 == x1) the line goes through the
// origin and the larger point.
void TwoPointFit(double x0, double y0, double x1, double y1, double* slope,
                 double* intercept) {
  if (x1 < x0) {
    std::swap(x0, x1);
    std::swap(y0, y1);
  }
  *slope = -1.0;
  if (x1 > x0 * 1.2) {
    *slope = (y1 - y0) / (x1 - x0);
    *intercept = y1 - *slope * x1;
  }
  if (!(*slope > 0.0) || !(*intercept >= 0.0)) {
    // A line through the origin. A negative intercept means the larger
    // sample ran more per unit than the smaller one: noise (a burst of load,
    // a one-time cost) only inflates timings, so the point with the smaller
    // per-unit cost is kept (a calibration whose full dense sample took
    // 2.7 ms against 0.22 ms for a quarter of it -- 85 against 28 us per
    // image, the steady time 10 us -- otherwise predicted the dense path
    // beyond the re-time range, and the op never ran it again).
    const double per1 = x1 > 0.0 ? y1 / x1 : 0.0;
    const double per0 = x0 > 0.0 ? y0 / x0 : 0.0;
    *slope = (*slope > 0.0 && per0 > 0.0 && per0 < per1) ? per0 : per1;
    *intercept = 0.0;
  }
}

}  // namespace

int64_t CalibrationCopyRows(int64_t k, int64_t rows_full) {
  const int64_t half = std::max<int64_t>(1, k / 2);
  return std::max<int64_t>(std::max<int64_t>(1, rows_full),
                           (kCalibrationCopyElems + half - 1) / half);
}

CostTerms FitCalibration(const SplitShape& s, const CalibrationTimings& c) {
  CostTerms t;
  const double k = static_cast<double>(std::max<int64_t>(s.k, 1));
  // Dense: seconds per row and fixed seconds per call.
  double per_row, fixed;
  TwoPointFit(c.rows_part, c.dense_part_s, c.rows_full, c.dense_full_s,
              &per_row, &fixed);
  if (per_row > 0.0) {
    t.dense_rate = k * s.dense_flops_per_elem / per_row;
    t.dense_fixed_s = fixed;
  }
  // Sparse: seconds per nonzero from the thinned sample (same rows, so the
  // conversion and fixed costs cancel), then the per-row (conversion) and
  // fixed costs from the partial sample.
  double per_nnz = -1.0;
  if (c.nnz_full > c.nnz_thin * 1.2 && c.sparse_full_s > c.sparse_thin_s) {
    per_nnz = (c.sparse_full_s - c.sparse_thin_s) / (c.nnz_full - c.nnz_thin);
  }
  if (per_nnz > 0.0) {
    const double a_full = std::max(0.0, c.sparse_full_s - per_nnz * c.nnz_full);
    const double a_part = std::max(0.0, c.sparse_part_s - per_nnz * c.nnz_part);
    double per_row_sp, fixed_sp;
    TwoPointFit(c.rows_part, a_part, c.rows_full, a_full, &per_row_sp,
                &fixed_sp);
    t.convert_s_per_elem = per_row_sp / k;
    t.sparse_fixed_s = fixed_sp;
  } else if (c.nnz_full > 0.0) {
    // Timing noise: attribute the whole sparse time to the nonzeros.
    per_nnz = c.sparse_full_s / c.nnz_full;
  }
  if (per_nnz > 0.0) t.sparse_rate = s.sparse_flops_per_nnz / per_nnz;
  if (c.copy_elems > 0.0) t.copy_s_per_elem = c.copy_s / c.copy_elems;
  if (c.row_copy_elems > 0.0)
    t.row_copy_s_per_elem = c.row_copy_s / c.row_copy_elems;
  return t;
}

double MaxSavingSeconds(const SplitShape& s, const CostTerms& t,
                        double zero_row_frac, double dead_col_frac) {
  if (!t.dense_known() || !t.sparse_known()) return kInf;
  if (s.m <= 0 || s.k <= 0 || !s.dense_allowed) return 0.0;
  const double m = static_cast<double>(s.m), k = static_cast<double>(s.k);
  const double z = std::min(1.0, std::max(0.0, zero_row_frac));
  const double d = std::min(1.0, std::max(0.0, dead_col_frac));
  // Dense seconds per row (the fixed cost is paid by every plan that keeps
  // a dense row, so it is no saving).
  const double row_s = k * s.dense_flops_per_elem / t.dense_rate;
  double save = z * m * row_s;
  const double live =
      (1.0 - z) * m * std::max(0.0, row_s - t.convert_s_per_elem * k);
  save += std::max(0.0, live - t.sparse_fixed_s);
  // Compaction also shrinks the dense fixed term (PredictDenseSeconds).
  if (s.can_compact) save += d * (m * row_s + t.dense_fixed_s);
  return std::min(PredictDenseSeconds(s, t, m, false), save);
}

int FullCountPeriod(double count_s, double dense_s, const AnalysisPolicy& ap) {
  const int lo = std::max(1, ap.min_period);
  const int hi = std::max(lo, ap.max_period);
  if (!(count_s > 0.0) || !(dense_s > 0.0) || !(ap.full_budget > 0.0)) return lo;
  const double want = std::ceil(count_s / (ap.full_budget * dense_s));
  if (!(want < hi)) return hi;
  return std::max(lo, static_cast<int>(want));
}

double SampledAllSparseCountShare(const AnalysisPolicy& ap,
                                  int64_t sample_stride) {
  const double period = static_cast<double>(std::max(1, ap.min_period));
  const double stride = static_cast<double>(std::max<int64_t>(1, sample_stride));
  return std::min(1.0, 1.0 / period + 1.0 / stride);
}

bool SampleMayCountFully(double count_s, double dense_s,
                         const AnalysisHistory& h, bool change_pending,
                         const AnalysisPolicy& ap) {
  if (change_pending || !h.seen_full) return true;
  if (!(count_s > 0.0) || !(dense_s > 0.0) || !(ap.escalate_budget > 0.0))
    return true;
  return count_s <= ap.escalate_budget * dense_s *
                        static_cast<double>(h.calls_since_full + 1);
}

AnalysisMode ChooseAnalysis(const SplitShape& s, const CostTerms& t,
                            const DecisionPolicy& policy,
                            const AnalysisPolicy& ap, const AnalysisHistory& h,
                            const Plan* previous, double count_s_per_elem,
                            bool full_stats, bool* nothing_to_save) {
  if (nothing_to_save != nullptr) *nothing_to_save = false;
  if (full_stats || !s.dense_allowed || !t.dense_known() ||
      !t.sparse_known() || !h.seen_full || !(count_s_per_elem > 0.0))
    return AnalysisMode::kFull;
  if (previous != nullptr && previous->kind == PlanKind::kAllSparse &&
      !previous->compact && ap.sample_all_sparse) {
    // An all-sparse plan decides on a sample's estimate between periodic
    // full counts (weighed against the plan's own predicted time).
    const double count_s = count_s_per_elem * static_cast<double>(s.m) *
                           static_cast<double>(s.k);
    if (h.calls_since_full + 1 >=
        FullCountPeriod(count_s, previous->predicted_s, ap))
      return AnalysisMode::kFull;
    return AnalysisMode::kSampleSparse;
  }
  // In a regime with sparse rows or compaction the exact counts decide.
  if (previous == nullptr || previous->kind != PlanKind::kAllDense ||
      previous->compact)
    return AnalysisMode::kFull;
  const double dense_s =
      PredictDenseSeconds(s, t, static_cast<double>(s.m), false);
  const double count_s = count_s_per_elem * static_cast<double>(s.m) *
                         static_cast<double>(s.k);
  if (h.calls_since_full + 1 >= FullCountPeriod(count_s, dense_s, ap))
    return AnalysisMode::kFull;
  // Sparse rows (zero rows among them) must save MinGainSeconds, a
  // compaction min_gain_s (DecideSplit, ChooseCompaction): skip when
  // neither can.
  const double rows_save = MaxSavingSeconds(s, t, h.zero_row_frac, 0.0);
  const double all_save =
      MaxSavingSeconds(s, t, h.zero_row_frac, h.dead_col_frac);
  if (rows_save < MinGainSeconds(policy, dense_s) &&
      all_save < policy.min_gain_s) {
    if (nothing_to_save != nullptr) *nothing_to_save = true;
    return AnalysisMode::kSkip;
  }
  // Samples that kept saying all-dense come further apart (doubling up to
  // max_sample_period calls); the calls between count nothing.
  if (h.samples_dense > 0 && ap.max_sample_period > 1) {
    int64_t longest = ap.max_sample_period;
    if (h.near_break_even)
      longest = std::min<int64_t>(longest, int64_t{1} << kNearBreakEvenSampleRun);
    const int64_t period = std::min<int64_t>(
        longest, int64_t{1} << std::min<int64_t>(h.samples_dense, 30));
    if (h.calls_since_sample + 1 < period) return AnalysisMode::kSkip;
  }
  return AnalysisMode::kSample;
}

int64_t SampleStride(int64_t phys_rows, int64_t phys_cols, double dense_s,
                     double count_s_per_elem, const AnalysisPolicy& ap) {
  const int64_t min_rows = std::max<int64_t>(1, ap.min_sample_rows);
  if (phys_rows < 2 * min_rows || phys_cols <= 0) return 1;
  double rows = static_cast<double>(phys_rows) / 2.0;
  if (count_s_per_elem > 0.0 && dense_s > 0.0) {
    rows = std::floor(ap.sample_budget * dense_s /
                      (count_s_per_elem * static_cast<double>(phys_cols)));
  }
  rows = std::max(static_cast<double>(min_rows), rows);
  if (rows * 2.0 > static_cast<double>(phys_rows)) return 1;
  const int64_t r = static_cast<int64_t>(rows);
  const int64_t stride = (phys_rows + r - 1) / r;
  return stride >= 2 ? stride : 1;
}

DensityProfile EstimateProfile(const int64_t* row_nnz, int64_t rows,
                               int64_t k_counted, int64_t rows_total,
                               int64_t k_total, int buckets) {
  DensityProfile p = ProfileFromRowNnz(row_nnz, rows, k_counted, buckets);
  if (rows <= 0 || k_counted <= 0) return p;
  const double row_scale =
      static_cast<double>(rows_total) / static_cast<double>(rows);
  const double nnz_scale = row_scale * static_cast<double>(k_total) /
                           static_cast<double>(k_counted);
  for (double& v : p.rows) v *= row_scale;
  for (double& v : p.nnz) v *= nnz_scale;
  return p;
}

bool SampleSaysDense(const SplitShape& s_est, const DensityProfile& p_est,
                     const CostTerms& t, const DecisionPolicy& policy,
                     const AnalysisPolicy& ap) {
  DecisionPolicy relaxed = policy;
  relaxed.enter_margin = policy.enter_margin - ap.near_margin;
  relaxed.min_gain_s = 0.5 * policy.min_gain_s;
  const Plan plan = DecideSplit(s_est, p_est, t, relaxed, nullptr);
  return plan.kind == PlanKind::kAllDense && !plan.compact;
}

void MedianWindow::Add(double v) {
  if (!(v > 0.0) || !std::isfinite(v)) return;
  // The sorted copy: drop the value the ring overwrites (when full), then
  // insert v in order.
  int n = size_;
  if (size_ == capacity_) {
    const double old = values_[next_];
    int i = 0;
    while (sorted_[i] != old) ++i;  // present: every value is finite
    for (; i + 1 < n; ++i) sorted_[i] = sorted_[i + 1];
    --n;
  }
  int i = n;
  for (; i > 0 && sorted_[i - 1] > v; --i) sorted_[i] = sorted_[i - 1];
  sorted_[i] = v;
  values_[next_] = v;
  if (size_ < capacity_) ++size_;
  next_ = (next_ + 1) % capacity_;
}

double MedianWindow::Median(double if_empty) const {
  if (size_ == 0) return if_empty;
  // The mid-th smallest; of an even count, the mean with the one below
  // (the same expression nth_element + max_element gave).
  const int mid = size_ / 2;
  double med = sorted_[mid];
  if (size_ % 2 == 0) med = 0.5 * (med + sorted_[mid - 1]);
  return med;
}

double MedianWindow::Min(double if_empty) const {
  if (size_ == 0) return if_empty;
  return sorted_[0];
}

FamilyModel::Snapshot FamilyModel::Get() const {
  std::lock_guard<std::mutex> lock(mu_);
  return hot_;
}

bool FamilyModel::calibrated() const {
  std::lock_guard<std::mutex> lock(mu_);
  return hot_.calibrated;
}

void FamilyModel::SetCalibration(const CostTerms& t) {
  std::lock_guard<std::mutex> lock(mu_);
  if (hot_.calibrated) return;
  base_ = t;
  hot_.calibrated = true;
  Refresh();
}

void FamilyModel::Recalibrate(const CostTerms& t) {
  std::lock_guard<std::mutex> lock(mu_);
  base_ = t;
  hot_.calibrated = true;
  dense_ratio_ = MedianWindow();
  sparse_ratio_ = MedianWindow();
  compact_ratio_ = MedianWindow();
  Refresh();
}

bool RecalibrationDue(double calibrated_density, double density,
                      int64_t calls_since, int recalibrations,
                      const RecalibrationPolicy& p) {
  if (!(calibrated_density >= 0.0) || !(density >= 0.0) ||
      calls_since < p.min_calls || recalibrations >= p.max_recalibrations)
    return false;
  const double lo = std::min(calibrated_density, density);
  const double hi = std::max(calibrated_density, density);
  return hi - lo >= p.min_density_change && hi >= p.density_factor * lo;
}

void NoteCalibration(FamilyCalibrationRecord* family, OpCalibrationRecord* op,
                     double density) {
  ++family->generation;
  op->generation = family->generation;
  op->density = density;
  op->calls = 0;
}

bool CountCallRecalibrationDue(FamilyCalibrationRecord* family,
                               OpCalibrationRecord* op, double density,
                               const RecalibrationPolicy& p) {
  if (op->generation != family->generation) {
    // First call of this op since the family's latest calibration (or the
    // family was calibrated before any record): its reference starts here.
    op->generation = family->generation;
    op->density = density;
    op->calls = 0;
    return false;
  }
  ++op->calls;
  if (!RecalibrationDue(op->density, density, op->calls,
                        family->recalibrations, p))
    return false;
  ++family->recalibrations;
  NoteCalibration(family, op, density);
  return true;
}

CostTerms FamilyModel::BaseTerms() const {
  std::lock_guard<std::mutex> lock(mu_);
  return base_;
}

namespace {

CostTerms Scaled(const CostTerms& base, double sd, double ss) {
  CostTerms t = base;
  t.dense_fixed_s *= sd;
  if (t.dense_rate > 0.0) t.dense_rate /= sd;
  t.sparse_fixed_s *= ss;
  t.convert_s_per_elem *= ss;
  if (t.sparse_rate > 0.0) t.sparse_rate /= ss;
  return t;
}

// A path's scale from its window: the median, or the smallest of fewer
// than 3 ratios (see the header).
double Robust(const MedianWindow& w) {
  return w.size() < 3 ? w.Min(1.0) : w.Median(1.0);
}

}  // namespace

void FamilyModel::Refresh() {
  dense_scale_ = Robust(dense_ratio_);
  sparse_scale_ = Robust(sparse_ratio_);
  compact_scale_ = Robust(compact_ratio_);
  RefreshTerms();
  hot_.count_s_per_elem = count_per_elem_.Median(0.0);
}

void FamilyModel::RefreshTerms() {
  hot_.terms = Scaled(base_, dense_scale_, sparse_scale_);
  hot_.terms.compact_scale = compact_scale_;
}

CostTerms FamilyModel::Terms() const {
  std::lock_guard<std::mutex> lock(mu_);
  return hot_.terms;
}

bool FamilyModel::Record(const SplitShape& s, double rows_dense, bool compact,
                         double dense_seconds, double rows_sparse,
                         double nnz_sparse, double sparse_seconds,
                         bool dense_one_time, bool sparse_one_time) {
  std::lock_guard<std::mutex> lock(mu_);
  bool dense_recorded = false;
  if (rows_dense > 0.0 && dense_seconds > 0.0) {
    if (!base_.dense_known()) {
      const double kc = compact ? s.k_live : s.k;
      const double flops = rows_dense * kc * s.dense_flops_per_elem;
      if (flops > 0.0) base_.dense_rate = flops / dense_seconds;
      dense_recorded = flops > 0.0;
    } else if (dense_one_time) {
      // Kept out (see the header).
    } else if (compact) {
      // Against the terms as they stand (dense ratio applied), without
      // the compacted parts' own scale.
      CostTerms now = hot_.terms;
      now.compact_scale = 1.0;
      const double pred = PredictDenseSeconds(s, now, rows_dense, true);
      if (pred > 0.0) {
        compact_ratio_.Add(dense_seconds / pred);
        compact_scale_ = Robust(compact_ratio_);
        dense_recorded = true;
      }
    } else {
      const double pred = PredictDenseSeconds(s, base_, rows_dense, compact);
      if (pred > 0.0) {
        dense_ratio_.Add(dense_seconds / pred);
        dense_scale_ = Robust(dense_ratio_);
        dense_recorded = true;
      }
    }
  }
  bool sparse_recorded = false;
  if (rows_sparse > 0.0 && nnz_sparse > 0.0 && sparse_seconds > 0.0) {
    if (!base_.sparse_known()) {
      base_.sparse_rate = nnz_sparse * s.sparse_flops_per_nnz / sparse_seconds;
      sparse_recorded = true;
    } else if (sparse_one_time) {
      // Kept out (see the header).
    } else {
      const double pred =
          PredictSparseSeconds(s, base_, rows_sparse, nnz_sparse);
      if (pred > 0.0) {
        sparse_ratio_.Add(sparse_seconds / pred);
        sparse_scale_ = Robust(sparse_ratio_);
        sparse_recorded = true;
      }
    }
  }
  // Only the window that changed had its scale taken again (the counting
  // cost's median is RecordCount's).
  if (dense_recorded || sparse_recorded) RefreshTerms();
  return dense_recorded;
}

void FamilyModel::RecordCount(double elems, double seconds) {
  if (!(elems > 0.0) || !(seconds > 0.0)) return;
  std::lock_guard<std::mutex> lock(mu_);
  count_per_elem_.Add(seconds / elems);
  hot_.count_s_per_elem = count_per_elem_.Median(0.0);
}

double FamilyModel::CountSecondsPerElem() const {
  std::lock_guard<std::mutex> lock(mu_);
  return hot_.count_s_per_elem;
}

namespace {

// NoteSampledFullStayedDense on a history (the caller holds the lock).
void ContinueBackoff(AnalysisHistory* h, int64_t samples_dense) {
  h->samples_dense = std::max<int64_t>(0, samples_dense) + 1;
  h->calls_since_sample = 0;
}

// Whether the next decision on the all-dense side re-times (the caller
// holds the lock).
bool RetimeFallsDueOn(const RetimeState& r) {
  return r.side == 0 && r.next_retime > 0 &&
         r.calls_on_side + 1 == r.next_retime;
}

}  // namespace

void PlanMemory::RememberAllDense(int64_t continue_backoff_from) {
  std::lock_guard<std::mutex> lock(mu_);
  last_ = Plan();
  has_last_ = true;
  if (continue_backoff_from >= 0 && !change_pending_)
    ContinueBackoff(&history_, continue_backoff_from);
}

void PlanMemory::NoteAllDenseWithoutCount(bool sampled, bool near_break_even) {
  std::lock_guard<std::mutex> lock(mu_);
  last_ = Plan();
  has_last_ = true;
  ++history_.calls_since_full;
  if (sampled) {
    ++history_.samples_dense;
    history_.near_break_even = near_break_even;
    history_.calls_since_sample = 0;
  } else {
    ++history_.calls_since_sample;
  }
  // A decision on the all-dense side that re-timed nothing.
  if (retime_.side == 0) ++retime_.calls_on_side;
}

AnalysisMode PlanMemory::ChooseAnalysis(const SplitShape& s,
                                        const CostTerms& t,
                                        const DecisionPolicy& policy,
                                        const AnalysisPolicy& ap,
                                        double count_s_per_elem,
                                        bool full_stats,
                                        int64_t* samples_dense_before) {
  std::lock_guard<std::mutex> lock(mu_);
  bool nothing_to_save = false;
  AnalysisMode mode = tf_sparse_split::ChooseAnalysis(
      s, t, policy, ap, history_, has_last_ ? &last_ : nullptr,
      count_s_per_elem, full_stats, &nothing_to_save);
  if (mode != AnalysisMode::kFull && !nothing_to_save &&
      RetimeFallsDueOn(retime_))
    mode = AnalysisMode::kFull;
  if (samples_dense_before != nullptr)
    *samples_dense_before = history_.samples_dense;
  return mode;
}

void PlanMemory::RecordAnalysis(bool full, double zero_row_frac,
                                double dead_col_frac,
                                int64_t continue_backoff_from) {
  std::lock_guard<std::mutex> lock(mu_);
  if (full) {
    history_.seen_full = true;
    history_.calls_since_full = 0;
    history_.zero_row_frac = zero_row_frac;
    history_.dead_col_frac = dead_col_frac;
    history_.samples_dense = 0;
    history_.calls_since_sample = 0;
    if (continue_backoff_from >= 0 && !change_pending_)
      ContinueBackoff(&history_, continue_backoff_from);
    else
      history_.near_break_even = false;
  } else {
    ++history_.calls_since_full;
    ++history_.calls_since_sample;
  }
}

void PlanMemory::NoteSampledFullStayedDense(int64_t samples_dense) {
  std::lock_guard<std::mutex> lock(mu_);
  ContinueBackoff(&history_, samples_dense);
}

void PlanMemory::NoteDenseCallWithoutDecision() {
  std::lock_guard<std::mutex> lock(mu_);
  if (retime_.side == 0) ++retime_.calls_on_side;
}

bool PlanMemory::RetimeFallsDue() {
  std::lock_guard<std::mutex> lock(mu_);
  return RetimeFallsDueOn(retime_);
}

AnalysisHistory PlanMemory::history() {
  std::lock_guard<std::mutex> lock(mu_);
  return history_;
}

bool PlanMemory::change_pending() {
  std::lock_guard<std::mutex> lock(mu_);
  return change_pending_;
}

bool PlanMemory::SampleMayCountFully(double count_s, double dense_s,
                                     const AnalysisPolicy& ap) {
  std::lock_guard<std::mutex> lock(mu_);
  return ::tf_sparse_split::SampleMayCountFully(count_s, dense_s, history_,
                                                change_pending_, ap);
}

Plan PlanMemory::Decide(const SplitShape& s, const DensityProfile& p,
                        const CostTerms& t, const DecisionPolicy& policy) {
  std::lock_guard<std::mutex> lock(mu_);
  Plan plan = DecideSplit(s, p, t, policy, has_last_ ? &last_ : nullptr);
  last_ = plan;
  has_last_ = true;
  return plan;
}

Plan PlanMemory::DecideAndRetime(const SplitShape& s, const DensityProfile& p,
                                 const CostTerms& t,
                                 const DecisionPolicy& policy,
                                 const RetimePolicy& rp, bool* retimed,
                                 Plan* decided) {
  std::lock_guard<std::mutex> lock(mu_);
  const Plan fresh = DecideSplit(s, p, t, policy, has_last_ ? &last_ : nullptr);
  *retimed = false;
  const int fresh_side = fresh.kind == PlanKind::kAllDense ? 0 : 1;
  if (has_last_ && retime_.side >= 0 && fresh_side != retime_.side &&
      rp.first_period > 0 && retime_.side_runs < rp.hold_runs) {
    // A change of side before the current side's own plan ran hold_runs
    // calls: run the remembered plan again (its time enters the ratios).
    ++retime_.side_runs;
    ++retime_.holds;
    ++retime_.calls_on_side;
    change_pending_ = true;
    if (decided != nullptr) *decided = last_;
    return last_;
  }
  if (has_last_ && retime_.side >= 0 && fresh_side != retime_.side &&
      rp.first_period > 0 && retime_.other_runs < rp.confirm_runs) {
    // A change of side not yet confirmed by enough runs of the new side:
    // run it as a re-time (its time enters the ratios), keep the plan.
    ++retime_.other_runs;
    ++retime_.confirmations;
    ++retime_.calls_on_side;
    change_pending_ = true;
    if (decided != nullptr) *decided = last_;
    *retimed = true;
    return fresh;
  }
  change_pending_ = false;
  const Plan plan = fresh;
  last_ = plan;
  has_last_ = true;
  if (decided != nullptr) *decided = plan;
  Plan other;
  // An all-dense call predicted under its least saving (MinGainSeconds)
  // can never enter a plan with sparse rows, whatever the sparse terms:
  // timing its sparse path would change nothing.
  const bool can_leave = plan.kind != PlanKind::kAllDense ||
                         plan.all_dense_s >
                             MinGainSeconds(policy, plan.all_dense_s);
  const bool close =
      can_leave && OtherSidePlan(s, p, t, policy, plan, &other) &&
      plan.predicted_s > 0.0 &&
      other.predicted_s <= rp.max_ratio * plan.predicted_s;
  const int side = plan.kind == PlanKind::kAllDense ? 0 : 1;
  // The runs that confirmed a change of side are the new side's first.
  const int64_t carried = side != retime_.side ? retime_.other_runs : -1;
  const bool due = RetimeDue(&retime_, side, close, rp);
  if (carried >= 0) retime_.side_runs = carried;
  if (!due) {
    ++retime_.side_runs;
    return plan;
  }
  ++retime_.other_runs;
  *retimed = true;
  return other;
}

bool PlanMemory::NoteSparseShape(int64_t m, int64_t one_time_calls) {
  if (one_time_calls <= 0) return false;
  // Kept among the dense shapes under the key (m, -1, 2), which no
  // all-dense call has (its kc >= 0, compact 0 or 1).
  return NoteShape(m, -1, 2, one_time_calls);
}

bool PlanMemory::NoteDenseShape(int64_t m, int64_t kc, bool compact,
                                int64_t one_time_calls) {
  return NoteShape(m, kc, compact ? 1 : 0, one_time_calls);
}

bool PlanMemory::NoteShape(int64_t m, int64_t kc, int64_t c,
                           int64_t one_time_calls) {
  std::lock_guard<std::mutex> lock(mu_);
  for (int i = 0; i < dense_shape_count_; ++i) {
    auto& e = dense_shapes_[i];
    if (e[0] == m && e[1] == kc && e[2] == c) {
      // e[3]: this shape's all-dense calls so far, saturating just past
      // the one-time ones.
      if (e[3] <= one_time_calls) ++e[3];
      return e[3] <= one_time_calls;
    }
  }
  if (dense_shape_count_ >= kShapesRemembered) return false;
  dense_shapes_[dense_shape_count_++] = {m, kc, c, 1};
  return one_time_calls >= 1;
}

RetimeState PlanMemory::retime_state() {
  std::lock_guard<std::mutex> lock(mu_);
  return retime_;
}

FamilyModel& FamilyFor(const std::vector<int64_t>& key) {
  static std::mutex* mu = new std::mutex;
  static auto* models =
      new std::map<std::vector<int64_t>, std::unique_ptr<FamilyModel>>;
  std::lock_guard<std::mutex> lock(*mu);
  std::unique_ptr<FamilyModel>& m = (*models)[key];
  if (!m) m.reset(new FamilyModel);
  return *m;
}

int64_t NBucket(int64_t n) {
  if (n <= 64) return n;
  int64_t b = 64;
  while (b < n) b *= 2;
  return b;
}

int64_t MBucket(int64_t m) {
  if (m >= 512) return 512;
  int64_t b = 1;
  while (b < m) b *= 2;
  return b;
}

std::vector<int64_t> MatMulFamilyKey(int64_t family_op, int64_t dtype,
                                     int64_t m, int64_t k, int64_t n,
                                     bool transpose_b) {
  return {family_op, dtype, k, NBucket(n), transpose_b ? 1 : 0, MBucket(m)};
}

void WriteCostStats(const SplitShape& s, const CostTerms& t, bool calibrated,
                    double* stats) {
  stats[kStatKLive] = static_cast<double>(s.k_live);
  stats[kStatDenseFlopsPerElem] = s.dense_flops_per_elem;
  stats[kStatSparseFlopsPerNnz] = s.sparse_flops_per_nnz;
  stats[kStatRowCopyElems] = s.row_copy_elems;
  stats[kStatWeightElemsPerCol] = s.weight_elems_per_col;
  stats[kStatCanCompact] = s.can_compact ? 1.0 : 0.0;
  stats[kStatDenseAllowed] = s.dense_allowed ? 1.0 : 0.0;
  stats[kStatTermDenseFixed] = t.dense_fixed_s;
  stats[kStatTermDenseRate] = t.dense_rate;
  stats[kStatTermSparseFixed] = t.sparse_fixed_s;
  stats[kStatTermConvert] = t.convert_s_per_elem;
  stats[kStatTermSparseRate] = t.sparse_rate;
  stats[kStatTermCopy] = t.copy_s_per_elem;
  stats[kStatCalibrated] = calibrated ? 1.0 : 0.0;
}

namespace {

// A finite value >= 0 (NaN, negative and infinite values read as 0).
double NonNegative(double v) { return std::isfinite(v) && v > 0.0 ? v : 0.0; }

int64_t RoundCount(double v) {
  return static_cast<int64_t>(std::llround(NonNegative(v)));
}

}  // namespace

bool ReadCostStats(const double* stats, SplitShape* s, CostTerms* t) {
  *s = SplitShape();
  s->m = RoundCount(stats[kStatM]);
  s->k = RoundCount(stats[kStatK]);
  s->k_live = std::min(s->k, RoundCount(stats[kStatKLive]));
  s->dense_flops_per_elem = NonNegative(stats[kStatDenseFlopsPerElem]);
  s->sparse_flops_per_nnz = NonNegative(stats[kStatSparseFlopsPerNnz]);
  s->row_copy_elems = NonNegative(stats[kStatRowCopyElems]);
  s->weight_elems_per_col = NonNegative(stats[kStatWeightElemsPerCol]);
  s->can_compact = stats[kStatCanCompact] >= 0.5;
  s->dense_allowed = stats[kStatDenseAllowed] >= 0.5;
  *t = CostTerms();
  t->dense_fixed_s = NonNegative(stats[kStatTermDenseFixed]);
  t->dense_rate = NonNegative(stats[kStatTermDenseRate]);
  t->sparse_fixed_s = NonNegative(stats[kStatTermSparseFixed]);
  t->convert_s_per_elem = NonNegative(stats[kStatTermConvert]);
  t->sparse_rate = NonNegative(stats[kStatTermSparseRate]);
  t->copy_s_per_elem = NonNegative(stats[kStatTermCopy]);
  t->heterogeneous = stats[kStatHeterogeneous] == kHeteroRan;
  return stats[kStatCalibrated] >= 0.5;
}

}  // namespace tf_sparse_split
