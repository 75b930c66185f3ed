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
  // is all zero (nothing was counted). The other fields are exact either
  // way: such a call runs every row dense and compacts nothing, so
  // kStatRowsSparse, kStatNnzSparse and kStatZeroColsSkipped are 0.
  kStatAnalysis = 13 + kDensityBins,
  kNumStats = 14 + kDensityBins,
};

// Values of stats[kStatHeterogeneous].
constexpr double kHeteroOff = 0.0;          // not requested
constexpr double kHeteroRan = 1.0;          // GPU kernel: dense rows on the
                                            // GPU, sparse rows on the CPU
constexpr double kHeteroCpuFallback = 2.0;  // requested, but the CPU kernel
                                            // ran: the normal CPU split

// Values of stats[kStatAnalysis].
constexpr double kAnalysisFull = 0.0;     // every value counted: exact
constexpr double kAnalysisSampled = 1.0;  // a strided sample of the rows
                                          // counted; all-dense
constexpr double kAnalysisSkipped = 2.0;  // nothing counted (the cost model
                                          // showed no other plan can win);
                                          // all-dense

}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_CORE_STATS_H_
