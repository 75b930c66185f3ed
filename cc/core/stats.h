// Layout of the per-call statistics vector (float64 [kNumStats]) that every
// sparse-split op emits as its `stats` output. This header is the one source
// of the layout: the pybind11 module exports these constants and
// tf_sparse_split/tuning/stats.py is checked against them by a test.
#ifndef TF_SPARSE_SPLIT_CC_CORE_STATS_H_
#define TF_SPARSE_SPLIT_CC_CORE_STATS_H_

namespace tf_sparse_split {

// Number of bins of the row-density histogram in the statistics vector.
constexpr int kDensityBins = 16;

// Bin of a row density d in [0, 1]: floor(d * kDensityBins), 1.0 in the last.
inline int DensityBin(double d) {
  int b = static_cast<int>(d * kDensityBins);
  return b < 0 ? 0 : (b >= kDensityBins ? kDensityBins - 1 : b);
}

// Layout of the per-call statistics vector (float64) that SparseSplitMatMul
// emits as its second output. Times are wall-clock seconds.
enum StatIndex : int {
  kStatRowsDense = 0,       // rows of op(a) sent to the dense GEMM
  kStatRowsSparse = 1,      // rows sent to the CSR SpMM (incl. all-zero rows)
  kStatNnz = 2,             // nonzeros of op(a)
  kStatZeroColsSkipped = 3, // all-zero columns of op(a) compacted away
  kStatTimeDense = 4,       // seconds in the dense part (gather+GEMM+scatter)
  kStatTimeSparse = 5,      // seconds in the sparse part (CSR build + SpMM)
  kStatTimeAnalyze = 6,     // seconds measuring densities and deciding
  kStatThreshold = 7,       // density threshold actually used, in [0, 1]
  kStatM = 8,               // m: rows of op(a)
  kStatK = 9,               // k: columns of op(a)
  kStatN = 10,              // n: columns of op(b)
  kStatNnzSparse = 11,      // nonzeros in the rows sent sparse
  kStatHistogram = 12,      // [12, 12 + kDensityBins): rows per density bin
  // Heterogeneous split (attr heterogeneous): kHeteroOff, kHeteroRan or
  // kHeteroCpuFallback below.
  kStatHeterogeneous = 12 + kDensityBins,
  // How the call analysed its activation: kAnalysisFull, kAnalysisSampled
  // or kAnalysisSkipped below. Under kAnalysisSampled, kStatNnz and the
  // histogram are estimates scaled up from the counted sample (fractional
  // row counts); under kAnalysisSkipped, kStatNnz is NaN and the histogram
  // is all zero (nothing was counted). Such a call compacts nothing
  // (kStatZeroColsSkipped 0) and, except a convolution that decided its
  // all-sparse plan on the sample (AnalysisMode::kSampleSparse: rows split
  // by the estimated counts, kStatNnzSparse an estimate too), runs every
  // row dense (kStatRowsSparse and kStatNnzSparse 0).
  kStatAnalysis = 13 + kDensityBins,
  // The call's cost problem, as the op's cost model (cost_model.h) saw it:
  // the SplitShape of the call and its problem family's CostTerms after the
  // call was recorded (WriteCostStats / ReadCostStats). Every call with a
  // problem family writes them (automatic or not); a call without one (an
  // empty problem) leaves them 0, which reads as unknown terms. This is how
  // the terms leave the op library: the pybind11 module is a separate
  // shared object with its own (empty) FamilyFor registry, and the vector
  // reaches Python in graphs, under tf.distribute and across workers.
  kStatKLive = 14 + kDensityBins,  // values per row outside all-zero
                                   // columns (k when not counted)
  kStatDenseFlopsPerElem,   // SplitShape::dense_flops_per_elem (flop)
  kStatSparseFlopsPerNnz,   // SplitShape::sparse_flops_per_nnz (flop)
  kStatRowCopyElems,        // SplitShape::row_copy_elems (values)
  kStatWeightElemsPerCol,   // SplitShape::weight_elems_per_col (values)
  kStatCanCompact,          // SplitShape::can_compact (1 or 0)
  kStatDenseAllowed,        // SplitShape::dense_allowed (1 or 0)
  kStatTermDenseFixed,      // CostTerms::dense_fixed_s (seconds)
  kStatTermDenseRate,       // CostTerms::dense_rate (flop/s; 0: unknown)
  kStatTermSparseFixed,     // CostTerms::sparse_fixed_s (seconds)
  kStatTermConvert,         // CostTerms::convert_s_per_elem (seconds)
  kStatTermSparseRate,      // CostTerms::sparse_rate (flop/s; 0: unknown)
  kStatTermCopy,            // CostTerms::copy_s_per_elem (seconds)
  kStatCalibrated,          // 1: the family was calibrated (its first
                            // automatic call); 0: terms learnt from the
                            // calls' observations only, or no family
  kNumStats = 28 + kDensityBins,
};

// The entries kStatKLive .. kStatCalibrated: per-call values that are the
// same for every call of a family at one moment (a sum over calls divided
// by the calls is their mean).
constexpr int kStatCostFirst = kStatKLive;
constexpr int kStatCostLast = kStatCalibrated;
static_assert(kStatCostLast + 1 == kNumStats,
              "the cost entries end the statistics vector");

// Values of stats[kStatHeterogeneous].
constexpr double kHeteroOff = 0.0;          // not requested
constexpr double kHeteroRan = 1.0;          // GPU kernel: dense rows on the
                                            // GPU, sparse rows on the CPU
constexpr double kHeteroCpuFallback = 2.0;  // requested, but the CPU kernel
                                            // ran: the normal CPU split

// Values of stats[kStatAnalysis].
constexpr double kAnalysisFull = 0.0;     // every value counted: exact
constexpr double kAnalysisSampled = 1.0;  // a strided sample of the rows
                                          // counted; all-dense (or a
                                          // convolution's sampled
                                          // all-sparse plan)
constexpr double kAnalysisSkipped = 2.0;  // nothing counted (the cost model
                                          // showed no other plan can win);
                                          // all-dense

}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_CORE_STATS_H_
