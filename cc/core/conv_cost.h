// The cost model's view of a convolution (framework-free, layer 1): its
// SplitShape and its problem family. Used by the SparseSplitConv2D kernels
// (cc/kernels/sparse_split_conv2d_kernels.cc) and, for deterministic tests
// on recorded timings, by the pybind11 module (conv_split_shape,
// conv_batch_bucket, conv_family_key).
#ifndef TF_SPARSE_SPLIT_CC_CORE_CONV_COST_H_
#define TF_SPARSE_SPLIT_CC_CORE_CONV_COST_H_

#include <cstdint>
#include <vector>

#include "cc/core/cost_model.h"
#include "cc/core/sparse_conv2d.h"

namespace tf_sparse_split {

// The batch bucket of a convolution family: the smallest power of two >= n
// (1, 2, 4, ..., 64, 128, ...; n <= 0 -> 0). A family's terms are fitted at
// one batch size and must predict the others of its bucket: oneDNN's dense
// convolution runs far below its batched per-image rate at N = 1 or 2 (its
// time is mostly fixed and per-call), so terms calibrated there would send
// a batch of 32 to the sparse path where the dense one is 3x faster. Within
// a bucket N varies by less than 2x, and the calibration's two sample sizes
// (rows_full, rows_full / 4) separate the per-call from the per-image cost.
int64_t ConvBatchBucket(int64_t n);

// The family key of a convolution: op (a FamilyOp of split_runtime.h),
// dtype, the batch bucket and the whole geometry but N.
std::vector<int64_t> ConvFamilyKey(int64_t op, int64_t dtype,
                                   const Conv2DGeometry& g);

// The cost model's view of a convolution: rows are images of H*W*C_in
// values (an all-zero channel is H*W all-zero columns); the dense path does
// 2*OH*OW*KH*KW*C_out flop per input channel of an image, i.e.
// 2*OH*OW*KH*KW*C_out / (H*W) per value; the sparse path 2*KH*KW*C_out per
// nonzero; a split copies an image of OH*OW*C_out per dense image (output
// scatter, or the filter gradient's dY gather); compaction copies
// KH*KW*C_out filter values per live channel. c_live: input channels that
// are not zero in every image.
SplitShape ConvSplitShape(const Conv2DGeometry& g, int64_t c_live,
                          bool dense_allowed);

// How many of a convolution op instance's first all-dense calls at each
// shape stay out of its family's measured/predicted ratios
// (PlanMemory::NoteDenseShape; the matmul ops keep only the first out).
// oneDNN's convolution runs its first calls after the primitive's creation
// well above its steady time -- at 32x28x28x1 -> 16 (bias + relu): 1036,
// 553, 4301, 644, then 285-310 us (steady 250-300 us) -- and three such
// calls, with the sparse path known only from its calibration, made the
// ratios' median send every image to the sparse path, 1.35x slower, where
// it stayed (the dense path re-timed too rarely to bring the median back).
constexpr int64_t kConvDenseOneTimeCalls = 4;

// How many of a convolution op instance's first calls with sparse images at
// each batch size stay out of its family's sparse ratios
// (PlanMemory::NoteSparseShape; the matmul ops keep none out). That call is
// the sparse path's first full-batch run after the calibration's small
// samples -- the calibrating call itself when the calibration chose the
// sparse path, else the first re-time -- and ran well above the path's
// steady time: 32x56x56x64 -> 64 at 50% zeros under load, 58 ms against
// 23-25 ms for the next re-times, and 62-159 ms in calibrating calls
// against 57-89 ms forced all-sparse (medians). Entering the ratios, that
// one slow observation decided alone while it was the only one (the
// smallest of fewer than 3 counts): the op stayed all-dense until the next
// re-time, or left the sparse plan its calibration chose.
constexpr int64_t kConvSparseOneTimeCalls = 1;

// How many calls an op instance's plan runs on a side before a decision may
// leave it (RetimePolicy::hold_runs; the matmul ops hold none). The first
// full-batch run of a path after the family's calibration holds one-time
// costs of its own (buffers of the full batch; the dense path's primitive
// creation is kept out by kConvDenseOneTimeCalls, the sparse path's first
// calls are not): at 32x56x56x64 -> 64 with 50% zeros under load the
// calibrating call's sparse part ran 62-159 ms where the same process's
// forced all-sparse calls took 57-89 ms (medians), and with its one ratio
// deciding alone the op left the sparse plan its calibration chose, ran
// three confirming dense calls and stayed all-dense for most of the next
// 15-30 calls (tests/test_conv2d_side_hold.py). Held for three runs, the
// side's own median decides, as the confirmation does for the side it
// changes to.
constexpr int64_t kConvHoldRuns = 3;

// The re-time policy of the convolution ops: the default with
// hold_runs = kConvHoldRuns.
RetimePolicy ConvRetimePolicy();

// The zero-free rule of the convolutions: an input this dense (nnz / (m k)
// >= kConvZeroFreeDensity) has too few zeros for the sparse kernels to skip
// work, so sending its images to them can win only where they beat
// oneDNN's kernel on the same work -- at batch 1, where oneDNN's per-call
// cost dominates (1x28x28x1 -> 16 without zeros: 24 us against 102 us),
// not at batch 32 (32x28x28x1 -> 16: 390 against 290 us). Calibrating and
// re-timing both paths under load cannot tell those apart reliably: the
// dense path's early calls and its isolated re-times among sparse calls
// ran 1.5-10x its steady time, and families calibrated or drifted to the
// all-sparse plan at batch 32 (0.65-0.84x of TF's kernel). So such a call
// runs images sparse only when the family's calibration terms (not scaled
// by the measured ratios) and its current terms (scaled by them) both
// predict its all-sparse plan at least kConvZeroFreeMinSpeedup times
// faster than its all-dense plan on the call's own profile: the slower
// sparse and the faster dense prediction of the two are compared, so a
// burst of load in the calibration's dense timing (2.7 ms for a 0.3 ms
// call) is overruled once the dense path has run, and slow dense re-times
// cannot make a sparse plan look safe while the calibration says
// otherwise.
constexpr double kConvZeroFreeDensity = 0.95;
// 1.25: the zero-free 1x28x28x1 -> 64 call's sparse kernel ran 1.8x
// faster than oneDNN's, and 1.5 vetoed it in two of three processes
// under load (its calibration saw 1.4-1.6x).
constexpr double kConvZeroFreeMinSpeedup = 1.25;

// The agreement rule of the convolutions, for inputs with zeros (below
// kConvZeroFreeDensity): a plan with sparse images is run (not as a
// re-time) only when the family's calibration terms and its current terms
// each predict it at least kConvSplitMinSpeedup times faster than the
// all-dense plan on the call's own profile (each set on its own: a set's
// two paths were timed under the same conditions, while the calibration's
// fit and the ratios can miss in opposite directions -- cnn-wide's second
// convolution at batch 32, 2x faster sparse, was vetoed when the rule
// compared across the sets as the zero-free rule does: its calibration's
// fit put all-dense at 8.4 ms where it ran 11.8 ms, and bursts slowed the
// sparse runs to 8.4 ms in the current terms). Near
// the break-even the ratio-scaled terms alone follow the machine's load:
// cnn-small's second convolution of benchmarks/bench_inference.py (32x14x
// 14x16 -> 32, 14% zeros) calibrated at 621 us dense against 646 us
// sparse, a burst of load moved its dense terms to 839 us, and the op ran
// all-sparse (668 us, plus a full count every call) on 74% of its later
// calls, where TF's fused kernel ran in 642 us; the first convolution
// (32x28x28x1 -> 16, 79% zeros; calibrated 295 us dense against 323 us
// sparse) likewise on 47%. Where the sparse path really wins both term
// sets say so (cnn-wide's second convolution at batch 1, 47% zeros:
// calibrated 312 us dense against 207 us sparse), and a change of the
// input's zeros is seen through the call's own profile. A re-time of a
// plan with sparse images runs only where the calibration's terms agree
// (where they do not, no current terms can change the verdict until the
// family recalibrates, and the re-time would only cost its run). 1.10,
// the decision's entry margin: a set's 5-10% is within a calibration's
// noise under load (the same convolution once calibrated at 687 us dense,
// a burst in its dense sample, against 623 us sparse, where its steady
// calls ran 629-655 us dense and 663 us sparse, plus a 30-40 us full
// count on every sparse call).
constexpr double kConvSplitMinSpeedup = 1.10;

// Whether each term set (`base`: the family's calibration terms,
// `current`: ratio-scaled) predicts plan candidate `bucket` (DecideSplit's
// j, threshold j / p.buckets(); -1 is all-dense and always agreed) with
// the dense part compacted or not (`compact`), plus `split_extra_s`
// seconds (the full count such a plan pays every call where all-dense
// calls count a sample or nothing), at least kConvSplitMinSpeedup times
// faster than the all-dense plan on profile `p`. Unknown terms: no.
bool ConvSplitAgreed(const SplitShape& s, const DensityProfile& p,
                     const CostTerms& base, const CostTerms& current,
                     int bucket, bool compact, double split_extra_s = 0.0);

// Whether a call of shape `s`, profile `p` and density nnz / (m k) =
// `density` may run images on the sparse path under the zero-free rule,
// with the family's calibration terms `base` and current terms `current`
// (unknown terms: no).
bool ConvSparseRowsAllowed(const SplitShape& s, const DensityProfile& p,
                           const CostTerms& base, const CostTerms& current,
                           double density);

}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_CORE_CONV_COST_H_
