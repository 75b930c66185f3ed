// The bias + activation epilogue of a matrix product (layer 1 of DESIGN.md:
// framework-free, no TensorFlow headers): c[i, :] = act(c[i, :] + bias) on
// the rows of a row-major output, in place, one pass over each row.
//
// SparseSplitMatMul applies it after both parts of a split have written
// their rows (cc/kernels/epilogue.h), so every output row is read and
// written exactly once more, by the thread that owns its block of rows.
// The loops are plain element-wise code that the compiler vectorises
// (-O3 -march=native: one vector add + max/min per 16 floats).
//
// Activations and their values (as tf.nn.relu / tf.nn.relu6):
//   kNone:  x
//   kRelu:  x < 0 ? 0 : x            (NaN stays NaN)
//   kRelu6: x < 0 ? 0 : (x > 6 ? 6 : x)   (NaN stays NaN)
// Deterministic: each element is computed independently, with the same
// operations whatever the thread count.
#ifndef TF_SPARSE_SPLIT_CC_CORE_EPILOGUE_H_
#define TF_SPARSE_SPLIT_CC_CORE_EPILOGUE_H_

#include <cstdint>
#include <string>

#include "cc/core/parallel_for.h"

namespace tf_sparse_split {

enum class Activation : int { kNone = 0, kRelu = 1, kRelu6 = 2 };

// "none" / "relu" / "relu6" (the op attr's values); false for anything else.
inline bool ParseActivation(const std::string& name, Activation* act) {
  if (name == "none") {
    *act = Activation::kNone;
  } else if (name == "relu") {
    *act = Activation::kRelu;
  } else if (name == "relu6") {
    *act = Activation::kRelu6;
  } else {
    return false;
  }
  return true;
}

namespace epilogue_internal {

// One row: c[j] = act(c[j] + bias[j]) for j < n (bias may be null).
template <typename T, Activation kAct, bool kBias>
inline void Row(T* __restrict c, const T* __restrict bias, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    T v = c[j];
    if (kBias) v += bias[j];
    if (kAct == Activation::kRelu || kAct == Activation::kRelu6) {
      v = v < T(0) ? T(0) : v;
    }
    if (kAct == Activation::kRelu6) v = v > T(6) ? T(6) : v;
    c[j] = v;
  }
}

template <typename T, Activation kAct, bool kBias>
void Rows(T* c, int64_t ldc, const int64_t* rows, int64_t n_rows, int64_t n,
          const T* bias, const ParallelFor& pfor) {
  pfor(n_rows, 2 * n + 8, [=](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t i = rows == nullptr ? r : rows[r];
      Row<T, kAct, kBias>(c + i * ldc, bias, n);
    }
  });
}

template <typename T, bool kBias>
void RowsAct(T* c, int64_t ldc, const int64_t* rows, int64_t n_rows,
             int64_t n, const T* bias, Activation act, const ParallelFor& pfor) {
  switch (act) {
    case Activation::kNone:
      Rows<T, Activation::kNone, kBias>(c, ldc, rows, n_rows, n, bias, pfor);
      break;
    case Activation::kRelu:
      Rows<T, Activation::kRelu, kBias>(c, ldc, rows, n_rows, n, bias, pfor);
      break;
    case Activation::kRelu6:
      Rows<T, Activation::kRelu6, kBias>(c, ldc, rows, n_rows, n, bias, pfor);
      break;
  }
}

}  // namespace epilogue_internal

// Applies c[i, :] = act(c[i, :] + bias) in place to the rows `rows[0 ..
// n_rows)` of the row-major matrix c (leading dimension ldc >= n), or to
// rows 0 .. n_rows-1 when `rows` is null. bias: [n] or null (no bias). With
// no bias and kNone it does nothing.
template <typename T>
void BiasActivationRows(T* c, int64_t ldc, const int64_t* rows,
                        int64_t n_rows, int64_t n, const T* bias,
                        Activation act, const ParallelFor& pfor) {
  if (n_rows <= 0 || n <= 0) return;
  if (bias == nullptr && act == Activation::kNone) return;
  if (bias != nullptr) {
    epilogue_internal::RowsAct<T, true>(c, ldc, rows, n_rows, n, bias, act,
                                        pfor);
  } else {
    epilogue_internal::RowsAct<T, false>(c, ldc, rows, n_rows, n, nullptr,
                                         act, pfor);
  }
}

}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_CORE_EPILOGUE_H_
