// Bias + FATReLU epilogue of a convolution and its gradient (layer 1 of
// docs/ARCHITECTURE.md: framework-free, no TensorFlow headers).
//
// Forward, on the rows of a row-major [rows, c] activation (NHWC: rows =
// N*H*W, c = channels):
//   v = x[i, j] + bias[j];   y[i, j] = v > t ? v : 0     (t >= 0)
//   sum = sum of all y
// in one pass (TensorFlow's graph runs BiasAdd, Greater, SelectV2 and Sum:
// four passes). A NaN v gives 0, as where(v > t, v, 0).
//
// Backward, given the forward output y and a scalar `offset` added to the
// gradient of every kept element (the gradient of an L1 penalty on sum):
//   dx[i, j] = y[i, j] > 0 ? dy[i, j] + offset : 0
//   dbias[j] = sum over i of dx[i, j]
// in one pass (Select/ReluGrad, AddV2 and BiasAddGrad in TensorFlow's).
// Because t >= 0, the kept elements (v > t) are exactly those with y > 0.
//
// bfloat16 / half: storage only. v = x + bias is rounded once to T (as
// TensorFlow's BiasAdd in T), compared with t in float32; the sums run in
// float32 (forward: per column, then double over the blocks) and dbias is
// rounded once to T at the end; dx = T(dy + offset) rounded once.
//
// Deterministic: the rows are cut into fixed blocks of kFatReluBlockValues
// values (never a function of the thread count); within a block the sums
// run per column in row order, and the blocks' partial sums are added in
// block order.
#ifndef TF_SPARSE_SPLIT_CC_CORE_FAT_RELU_H_
#define TF_SPARSE_SPLIT_CC_CORE_FAT_RELU_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cc/core/low_precision.h"
#include "cc/core/parallel_for.h"

namespace tf_sparse_split {

constexpr int64_t kFatReluBlockValues = 1 << 15;

// Rows per fixed block for rows of c values.
inline int64_t FatReluRowsPerBlock(int64_t c) {
  return std::max<int64_t>(1, kFatReluBlockValues / std::max<int64_t>(1, c));
}

namespace fat_relu_internal {

// Row loops with restrict-qualified operands, so the compiler vectorises
// them (one vector compare + blend per lane group).
template <typename T>
inline void ForwardRow(const T* __restrict x, const T* __restrict bias,
                       int64_t c, T t, T* __restrict y) {
  for (int64_t j = 0; j < c; ++j) {
    const T v = x[j] + bias[j];
    y[j] = v > t ? v : T(0);
  }
}
template <typename T>
inline void ForwardRowNoBias(const T* __restrict x, int64_t c, T t,
                             T* __restrict y) {
  for (int64_t j = 0; j < c; ++j) y[j] = x[j] > t ? x[j] : T(0);
}
template <typename T>
inline void BackwardRow(const T* __restrict dy, const T* __restrict y,
                        int64_t c, T offset, T* __restrict dx) {
  for (int64_t j = 0; j < c; ++j) dx[j] = y[j] > T(0) ? dy[j] + offset : T(0);
}
template <typename T>
inline void AddRow(const T* __restrict src, int64_t c, T* __restrict acc) {
  for (int64_t j = 0; j < c; ++j) acc[j] += src[j];
}

// The 16-bit rows, through float32 buffers (bulk conversions dispatched from
// CPUID): y = v > t ? v : 0 with v = T(x + bias) (bias_f: the widened bias,
// or null); col += the kept values.
template <typename T>
inline void ForwardRowLp(const T* x, const float* bias_f, int64_t c, float t,
                         T* y, float* buf, float* col) {
  WidenToFloat(x, buf, c);
  if (bias_f) {
    for (int64_t j = 0; j < c; ++j) buf[j] += bias_f[j];
    NarrowFromFloat(buf, y, c);  // v rounded once to T
    WidenToFloat(y, buf, c);
  }
  for (int64_t j = 0; j < c; ++j) {
    const float v = buf[j];
    buf[j] = v > t ? v : 0.0f;
    col[j] += buf[j];
  }
  NarrowFromFloat(buf, y, c);  // exact: every value is a T already
}

// dx = y > 0 ? T(dy + offset) : 0; part += dx (if part).
template <typename T>
inline void BackwardRowLp(const T* dy, const T* y, int64_t c, float offset,
                          T* dx, float* buf, float* ybuf, float* part) {
  WidenToFloat(dy, buf, c);
  WidenToFloat(y, ybuf, c);
  for (int64_t j = 0; j < c; ++j) buf[j] = ybuf[j] > 0.0f ? buf[j] + offset : 0.0f;
  NarrowFromFloat(buf, dx, c);
  if (part) {
    WidenToFloat(dx, buf, c);
    for (int64_t j = 0; j < c; ++j) part[j] += buf[j];
  }
}

}  // namespace fat_relu_internal

// y = (x + bias > t ? x + bias : 0); returns the sum of y (per-column sums
// within a block, then the blocks' totals in block order, in double).
// bias: [c] or null (no bias).
template <typename T>
double BiasFatReluForward(const T* x, const T* bias, int64_t rows, int64_t c,
                          T t, T* y, const ParallelFor& pfor) {
  using namespace fat_relu_internal;
  if (rows <= 0 || c <= 0) return 0.0;
  const int64_t per = FatReluRowsPerBlock(c);
  const int64_t blocks = (rows + per - 1) / per;
  std::vector<double> part(blocks, 0.0);
  if constexpr (IsLowPrecision<T>::value) {
    std::vector<float> bias_f(bias ? c : 0);
    if (bias) WidenToFloat(bias, bias_f.data(), c);
    const float tf = ToFloat(t);
    pfor(blocks, per * c * 4, [&](int64_t b, int64_t e) {
      std::vector<float> col(c), buf(c);
      for (int64_t blk = b; blk < e; ++blk) {
        const int64_t r0 = blk * per, r1 = std::min(rows, r0 + per);
        std::fill(col.begin(), col.end(), 0.0f);
        for (int64_t i = r0; i < r1; ++i)
          ForwardRowLp<T>(x + i * c, bias ? bias_f.data() : nullptr, c, tf,
                          y + i * c, buf.data(), col.data());
        double s = 0.0;
        for (int64_t j = 0; j < c; ++j) s += static_cast<double>(col[j]);
        part[blk] = s;
      }
    });
    double total = 0.0;
    for (double p : part) total += p;
    return total;
  } else {
  pfor(blocks, per * c * 2, [&](int64_t b, int64_t e) {
    std::vector<T> col(c);
    for (int64_t blk = b; blk < e; ++blk) {
      const int64_t r0 = blk * per, r1 = std::min(rows, r0 + per);
      std::fill(col.begin(), col.end(), T(0));
      for (int64_t i = r0; i < r1; ++i) {
        if (bias) {
          ForwardRow<T>(x + i * c, bias, c, t, y + i * c);
        } else {
          ForwardRowNoBias<T>(x + i * c, c, t, y + i * c);
        }
        AddRow<T>(y + i * c, c, col.data());
      }
      double s = 0.0;
      for (int64_t j = 0; j < c; ++j) s += static_cast<double>(col[j]);
      part[blk] = s;
    }
  });
  double total = 0.0;
  for (double p : part) total += p;
  return total;
  }
}

// dx = (y > 0 ? dy + offset : 0); dbias[j] = sum_i dx[i, j] (dbias may be
// null: no bias gradient).
template <typename T>
void BiasFatReluBackward(const T* dy, const T* y, int64_t rows, int64_t c,
                         T offset, T* dx, T* dbias, const ParallelFor& pfor) {
  using namespace fat_relu_internal;
  if (dbias) std::fill(dbias, dbias + std::max<int64_t>(c, 0), T{});
  if (rows <= 0 || c <= 0) return;
  const int64_t per = FatReluRowsPerBlock(c);
  const int64_t blocks = (rows + per - 1) / per;
  if constexpr (IsLowPrecision<T>::value) {
    const float off = ToFloat(offset);
    std::vector<float> part(dbias ? blocks * c : 0, 0.0f);
    pfor(blocks, per * c * 6, [&](int64_t b, int64_t e) {
      std::vector<float> buf(c), ybuf(c);
      for (int64_t blk = b; blk < e; ++blk) {
        const int64_t r0 = blk * per, r1 = std::min(rows, r0 + per);
        for (int64_t i = r0; i < r1; ++i)
          BackwardRowLp<T>(dy + i * c, y + i * c, c, off, dx + i * c,
                           buf.data(), ybuf.data(),
                           dbias ? part.data() + blk * c : nullptr);
      }
    });
    if (!dbias) return;
    std::vector<float> total(c, 0.0f);
    for (int64_t blk = 0; blk < blocks; ++blk)
      AddRow<float>(part.data() + blk * c, c, total.data());
    NarrowFromFloat(total.data(), dbias, c);
    return;
  } else {
  std::vector<T> part(dbias ? blocks * c : 0, T(0));
  pfor(blocks, per * c * 3, [&](int64_t b, int64_t e) {
    for (int64_t blk = b; blk < e; ++blk) {
      const int64_t r0 = blk * per, r1 = std::min(rows, r0 + per);
      for (int64_t i = r0; i < r1; ++i) {
        BackwardRow<T>(dy + i * c, y + i * c, c, offset, dx + i * c);
        if (dbias) AddRow<T>(dx + i * c, c, part.data() + blk * c);
      }
    }
  });
  if (!dbias) return;
  for (int64_t blk = 0; blk < blocks; ++blk)
    AddRow<T>(part.data() + blk * c, c, dbias);
  }
}

}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_CORE_FAT_RELU_H_
