#include "cc/core/conv_cost.h"

#include <algorithm>

namespace tf_sparse_split {

int64_t ConvBatchBucket(int64_t n) {
  if (n <= 0) return 0;
  int64_t b = 1;
  while (b < n) b *= 2;
  return b;
}

std::vector<int64_t> ConvFamilyKey(int64_t op, int64_t dtype,
                                   const Conv2DGeometry& g) {
  return {op,         dtype,      ConvBatchBucket(g.n),
          g.h,        g.w,        g.c_in,
          g.kh,       g.kw,       g.c_out,
          g.stride_h, g.stride_w, g.dil_h,
          g.dil_w,    g.pad_top,  g.pad_left,
          g.out_h,    g.out_w};
}

SplitShape ConvSplitShape(const Conv2DGeometry& g, int64_t c_live,
                          bool dense_allowed) {
  SplitShape s;
  const double hw = static_cast<double>(std::max<int64_t>(1, g.h * g.w));
  const double per_channel = 2.0 * g.out_h * g.out_w * g.kh * g.kw * g.c_out;
  s.m = g.n;
  s.k = g.h * g.w * g.c_in;
  s.k_live = g.h * g.w * c_live;
  s.dense_flops_per_elem = per_channel / hw;
  s.sparse_flops_per_nnz = 2.0 * g.kh * g.kw * g.c_out;
  s.row_copy_elems = static_cast<double>(g.out_h) * g.out_w * g.c_out;
  s.weight_elems_per_col = static_cast<double>(g.kh) * g.kw * g.c_out / hw;
  s.dense_allowed = dense_allowed;
  return s;
}

RetimePolicy ConvRetimePolicy() {
  RetimePolicy p;
  p.hold_runs = kConvHoldRuns;
  return p;
}

bool ConvSparseRowsAllowed(const SplitShape& s, const DensityProfile& p,
                           const CostTerms& base, const CostTerms& current,
                           double density) {
  if (!(density >= kConvZeroFreeDensity)) return true;  // NaN: allowed
  for (const CostTerms* t : {&base, &current})
    if (!t->dense_known() || !t->sparse_known()) return false;
  const double dense = std::min(PredictPlanSeconds(s, p, base, -1, false),
                                PredictPlanSeconds(s, p, current, -1, false));
  const double sparse =
      std::max(PredictPlanSeconds(s, p, base, p.buckets(), false),
               PredictPlanSeconds(s, p, current, p.buckets(), false));
  return sparse * kConvZeroFreeMinSpeedup <= dense;
}

bool ConvSplitAgreed(const SplitShape& s, const DensityProfile& p,
                     const CostTerms& base, const CostTerms& current,
                     int bucket, bool compact, double split_extra_s) {
  if (bucket < 0) return true;
  const double extra = std::max(0.0, split_extra_s);
  for (const CostTerms* t : {&base, &current}) {
    if (!t->dense_known() || !t->sparse_known()) return false;
    if ((PredictPlanSeconds(s, p, *t, bucket, compact) + extra) *
            kConvSplitMinSpeedup >
        PredictPlanSeconds(s, p, *t, -1, false))
      return false;
  }
  return true;
}

}  // namespace tf_sparse_split
