// CPU implementation of the kernels declared in count.h.
#include "cc/core/count.h"
#include "cc/core/low_precision.h"
#include "cc/core/uninit_vector.h"

#include <algorithm>

namespace tf_sparse_split {

namespace {

// Splits [0, total) into at most max_blocks equal contiguous blocks; the
// partition depends only on (total, max_blocks), never on the thread count,
// so results computed per block are deterministic.
struct Blocks {
  int64_t total, count, size;
  Blocks(int64_t total_, int64_t max_blocks) : total(total_) {
    count = std::max<int64_t>(1, std::min(total_, max_blocks));
    size = total_ == 0 ? 0 : (total_ + count - 1) / count;
    if (size > 0) count = (total_ + size - 1) / size;
  }
  int64_t begin(int64_t b) const { return std::min(total, b * size); }
  int64_t end(int64_t b) const { return std::min(total, (b + 1) * size); }
};

constexpr int64_t kCountBlocks = 64;

// CountNonzeros over phys_rows rows of phys_cols values, row r starting at
// a + r * pitch (pitch = phys_cols: the whole matrix; stride * phys_cols:
// every stride-th row).
template <typename T>
int64_t CountNonzerosPitched(const T* a, int64_t phys_rows, int64_t phys_cols,
                             int64_t pitch, bool transpose_a, int64_t* row_nnz,
                             int64_t* col_nnz, const ParallelFor& pfor) {
  // Physical row / column counts of a; for transpose_a the roles swap.
  int64_t* prow = transpose_a ? col_nnz : row_nnz;
  int64_t* pcol = transpose_a ? row_nnz : col_nnz;
  std::fill(prow, prow + phys_rows, 0);
  std::fill(pcol, pcol + phys_cols, 0);
  if (phys_rows == 0 || phys_cols == 0) return 0;
  // Enough blocks to feed a thread pool, few enough that the partial column
  // counts of a small matrix stay small (no page-faulting fresh memory).
  const int64_t elems = phys_rows * phys_cols;
  Blocks blocks(phys_rows, std::max<int64_t>(
                               1, std::min<int64_t>(kCountBlocks, elems >> 16)));
  // Per-block partial column counts (int32: a block has < 2^31 rows).
  UninitVector<int32_t> partial(static_cast<size_t>(blocks.count) * phys_cols);
  pfor(blocks.count, phys_cols * std::max<int64_t>(1, blocks.size) * 2,
       [&](int64_t b0, int64_t b1) {
         for (int64_t b = b0; b < b1; ++b) {
           int32_t* pc = partial.data() + b * phys_cols;
           std::fill(pc, pc + phys_cols, 0);
           for (int64_t i = blocks.begin(b); i < blocks.end(b); ++i) {
             const T* row = a + i * pitch;
             int32_t cnt = 0;
             for (int64_t j = 0; j < phys_cols; ++j) {
               const int32_t nz = !IsZero(row[j]);
               cnt += nz;
               pc[j] += nz;
             }
             prow[i] = cnt;
           }
         }
       });
  // Reduce the partial column counts, in parallel over columns.
  pfor(phys_cols, blocks.count * 2, [&](int64_t j0, int64_t j1) {
    for (int64_t b = 0; b < blocks.count; ++b) {
      const int32_t* pc = partial.data() + b * phys_cols;
      for (int64_t j = j0; j < j1; ++j) pcol[j] += pc[j];
    }
  });
  int64_t total = 0;
  for (int64_t i = 0; i < phys_rows; ++i) total += prow[i];
  return total;
}

}  // namespace

template <typename T>
int64_t CountNonzeros(const T* a, int64_t phys_rows, int64_t phys_cols,
                      bool transpose_a, int64_t* row_nnz, int64_t* col_nnz,
                      const ParallelFor& pfor) {
  return CountNonzerosPitched<T>(a, phys_rows, phys_cols, phys_cols,
                                 transpose_a, row_nnz, col_nnz, pfor);
}

template <typename T>
int64_t CountNonzerosStrided(const T* a, int64_t phys_rows, int64_t phys_cols,
                             int64_t stride, bool transpose_a,
                             int64_t* row_nnz, int64_t* col_nnz,
                             const ParallelFor& pfor) {
  stride = std::max<int64_t>(1, stride);
  const int64_t rows = (phys_rows + stride - 1) / stride;
  return CountNonzerosPitched<T>(a, rows, phys_cols, stride * phys_cols,
                                 transpose_a, row_nnz, col_nnz, pfor);
}

#define TFSS_INSTANTIATE(T)                                                   \
  template int64_t CountNonzeros<T>(const T*, int64_t, int64_t, bool,         \
                                    int64_t*, int64_t*, const ParallelFor&);  \
  template int64_t CountNonzerosStrided<T>(const T*, int64_t, int64_t,        \
                                           int64_t, bool, int64_t*, int64_t*, \
                                           const ParallelFor&);

TFSS_INSTANTIATE(float)
TFSS_INSTANTIATE(double)
TFSS_INSTANTIATE(bf16)
TFSS_INSTANTIATE(f16)
#undef TFSS_INSTANTIATE

}  // namespace tf_sparse_split
