// The row split of a sparse-split call (layer 2, shared by every op kernel
// through split_runtime.h): which rows of the activation operand op(a) go to
// the dense GEMM and which to the sparse kernel, at a density threshold, and
// the row-density histogram of the call's statistics.
#ifndef TF_SPARSE_SPLIT_CC_KERNELS_ROW_SPLIT_H_
#define TF_SPARSE_SPLIT_CC_KERNELS_ROW_SPLIT_H_

#include <cstdint>
#include <vector>

#include "cc/core/stats.h"

namespace tf_sparse_split {

// The rows of op(a) [m, k] split at density threshold `thr`: density above
// it dense, at or below it sparse -- except that, with
// dense_zero_rows_rule (a threshold given by the caller; the cost model
// weighs this itself), when the only sparse rows are all-zero and fewer than
// 1/8 of the rows, every row goes dense (cheaper than gathering the others
// around them; same zero rows). Adds the row-density histogram to
// stats[kStatHistogram...].
struct RowSplit {
  std::vector<int64_t> dense_rows, sparse_rows;
  int64_t nnz_sparse = 0;
};

// Sends every row to the dense part.
inline void AllRowsDense(int64_t m, RowSplit* s) {
  s->dense_rows.resize(m);
  for (int64_t i = 0; i < m; ++i) s->dense_rows[i] = i;
  s->sparse_rows.clear();
  s->nnz_sparse = 0;
}

inline RowSplit SplitRows(const int64_t* row_nnz, int64_t m, int64_t k,
                          double thr, double* stats,
                          bool dense_zero_rows_rule = true) {
  RowSplit s;
  s.dense_rows.reserve(m);
  s.sparse_rows.reserve(m);
  for (int64_t i = 0; i < m; ++i) {
    const double density = static_cast<double>(row_nnz[i]) / k;
    stats[kStatHistogram + DensityBin(density)] += 1;
    if (density > thr) {
      s.dense_rows.push_back(i);
    } else {
      s.sparse_rows.push_back(i);
      s.nnz_sparse += row_nnz[i];
    }
  }
  if (dense_zero_rows_rule && !s.dense_rows.empty() && s.nnz_sparse == 0 &&
      static_cast<int64_t>(s.sparse_rows.size()) * 8 < m) {
    AllRowsDense(m, &s);
  }
  return s;
}

}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_KERNELS_ROW_SPLIT_H_
