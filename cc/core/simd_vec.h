// 64-byte vector types (GCC/Clang vector extensions) shared by the
// convolution kernels (sparse_conv2d.cc, direct_conv2d.cc): one zmm with
// AVX-512, two ymm with AVX2, four xmm with SSE2 -- the compiler maps them
// to the ISA the library is built for. Unaligned loads and stores go
// through memcpy (one vector move once optimised).
#ifndef TF_SPARSE_SPLIT_CC_CORE_SIMD_VEC_H_
#define TF_SPARSE_SPLIT_CC_CORE_SIMD_VEC_H_

#include <cstring>

namespace tf_sparse_split {
namespace simd {

template <typename T>
struct Vec;
template <>
struct Vec<float> {
  typedef float V __attribute__((vector_size(64)));
  static constexpr int kLanes = 16;
};
template <>
struct Vec<double> {
  typedef double V __attribute__((vector_size(64)));
  static constexpr int kLanes = 8;
};

template <typename V>
inline __attribute__((always_inline)) V LoadV(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}
template <typename V>
inline __attribute__((always_inline)) void StoreV(void* p, const V& v) {
  std::memcpy(p, &v, sizeof(V));
}
// All lanes x.
template <typename T>
inline __attribute__((always_inline)) typename Vec<T>::V Broadcast(T x) {
  typename Vec<T>::V v = {};
  return v + x;
}

}  // namespace simd
}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_CORE_SIMD_VEC_H_
