// TensorFlow's element types mapped to the framework-free core's (layer 1 of
// docs/ARCHITECTURE.md): float32 and float64 as they are, Eigen::bfloat16 to
// bf16 and Eigen::half to f16 (cc/core/low_precision.h), layout-compatible
// 16-bit storage, so a kernel passes its tensors' data with AsCore(ptr).
#ifndef TF_SPARSE_SPLIT_CC_KERNELS_CORE_TYPES_H_
#define TF_SPARSE_SPLIT_CC_KERNELS_CORE_TYPES_H_

#include "cc/core/low_precision.h"
#include "tensorflow/core/framework/numeric_types.h"

namespace tf_sparse_split {

template <typename T>
struct CoreTypeOf {
  typedef T type;
};
template <>
struct CoreTypeOf<Eigen::bfloat16> {
  typedef bf16 type;
};
template <>
struct CoreTypeOf<Eigen::half> {
  typedef f16 type;
};
template <typename T>
using CoreType = typename CoreTypeOf<T>::type;

static_assert(sizeof(Eigen::bfloat16) == sizeof(bf16) &&
                  alignof(Eigen::bfloat16) == alignof(bf16),
              "bf16 must be layout-compatible with Eigen::bfloat16");
static_assert(sizeof(Eigen::half) == sizeof(f16) &&
                  alignof(Eigen::half) == alignof(f16),
              "f16 must be layout-compatible with Eigen::half");

template <typename T>
inline const CoreType<T>* AsCore(const T* p) {
  return reinterpret_cast<const CoreType<T>*>(p);
}
template <typename T>
inline CoreType<T>* AsCore(T* p) {
  return reinterpret_cast<CoreType<T>*>(p);
}

}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_KERNELS_CORE_TYPES_H_
