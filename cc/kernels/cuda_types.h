// TensorFlow's element types mapped to the CUDA kernels' (cc/core/cuda/,
// layer 1 of docs/ARCHITECTURE.md, GPU side): float32 and float64 as they
// are, Eigen::bfloat16 to __nv_bfloat16 and Eigen::half to __half. Each pair
// is one 16-bit word with the same bit layout (bfloat16: the upper half of
// an IEEE float32; half: IEEE binary16), so a GPU kernel passes its tensors'
// data with AsCuda(ptr), a bit-exact reinterpretation. Only for builds with
// GOOGLE_CUDA (needs the CUDA headers; compiles with a plain C++ compiler).
#ifndef TF_SPARSE_SPLIT_CC_KERNELS_CUDA_TYPES_H_
#define TF_SPARSE_SPLIT_CC_KERNELS_CUDA_TYPES_H_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "tensorflow/core/framework/numeric_types.h"

namespace tf_sparse_split {

template <typename T>
struct CudaTypeOf {
  typedef T type;
};
template <>
struct CudaTypeOf<Eigen::bfloat16> {
  typedef __nv_bfloat16 type;
};
template <>
struct CudaTypeOf<Eigen::half> {
  typedef __half type;
};
template <typename T>
using CudaType = typename CudaTypeOf<T>::type;

static_assert(sizeof(Eigen::bfloat16) == 2 && sizeof(__nv_bfloat16) == 2 &&
                  alignof(Eigen::bfloat16) == alignof(__nv_bfloat16),
              "__nv_bfloat16 must be layout-compatible with Eigen::bfloat16");
static_assert(sizeof(Eigen::half) == 2 && sizeof(__half) == 2 &&
                  alignof(Eigen::half) == alignof(__half),
              "__half must be layout-compatible with Eigen::half");

template <typename T>
inline const CudaType<T>* AsCuda(const T* p) {
  return reinterpret_cast<const CudaType<T>*>(p);
}
template <typename T>
inline CudaType<T>* AsCuda(T* p) {
  return reinterpret_cast<CudaType<T>*>(p);
}

}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_KERNELS_CUDA_TYPES_H_
