// The bias + activation epilogue of a matrix product (layer 1 of docs/ARCHITECTURE.md:
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
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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

#if defined(__AVX512F__)
// relu6 with AVX-512 max/min: GCC compiles the two selects of the scalar
// loop into mask compares and blends, twice as slow as relu (measured
// 35 vs 19 us on a 128 x 2048 float32 output). vmaxps/vminps return their
// second operand when either is NaN, so max(0, v) then min(6, v) keep NaN
// and give exactly the scalar loop's values (-0.0 included).
template <bool kBias>
inline int64_t Relu6Vector(float* __restrict c, const float* __restrict bias,
                           int64_t n) {
  const __m512 zero = _mm512_setzero_ps(), six = _mm512_set1_ps(6.0f);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    __m512 v = _mm512_loadu_ps(c + j);
    if (kBias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + j));
    _mm512_storeu_ps(c + j, _mm512_min_ps(six, _mm512_max_ps(zero, v)));
  }
  return j;
}
template <bool kBias>
inline int64_t Relu6Vector(double* __restrict c, const double* __restrict bias,
                           int64_t n) {
  const __m512d zero = _mm512_setzero_pd(), six = _mm512_set1_pd(6.0);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m512d v = _mm512_loadu_pd(c + j);
    if (kBias) v = _mm512_add_pd(v, _mm512_loadu_pd(bias + j));
    _mm512_storeu_pd(c + j, _mm512_min_pd(six, _mm512_max_pd(zero, v)));
  }
  return j;
}
#endif  // __AVX512F__

// One row: c[j] = act(c[j] + bias[j]) for j < n (bias may be null).
template <typename T, Activation kAct, bool kBias>
inline void Row(T* __restrict c, const T* __restrict bias, int64_t n) {
  int64_t j0 = 0;
#if defined(__AVX512F__)
  if constexpr (kAct == Activation::kRelu6 &&
                (std::is_same<T, float>::value || std::is_same<T, double>::value)) {
    j0 = Relu6Vector<kBias>(c, bias, n);
  }
#endif
  for (int64_t j = j0; j < n; ++j) {
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

// The same on n_rows rows ldc apart (serial), with relu / relu6 as
// oneDNN's eltwise post-ops compute them: v = c + bias; relu: v > 0 ? v : 0;
// relu6: min of that and 6 (NaN -> 0, -0 -> +0). Used where the other part
// of a split is oneDNN's fused kernel, so that both parts give the same
// values.
template <typename T>
void BiasClampRows(T* c, int64_t ldc, int64_t n_rows, int64_t n,
                   const T* bias, Activation act) {
  const T six = T(6);
  for (int64_t r = 0; r < n_rows; ++r) {
    T* __restrict row = c + r * ldc;
    for (int64_t j = 0; j < n; ++j) {
      T v = row[j];
      if (bias != nullptr) v += bias[j];
      if (act != Activation::kNone) {
        v = v > T(0) ? v : T(0);
        if (act == Activation::kRelu6) v = v < six ? v : six;
      }
      row[j] = v;
    }
  }
}

}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_CORE_EPILOGUE_H_
