// Device-side element helpers shared by the CUDA kernels of this directory
// (sparse_matmul.cu.cc, epilogue.cu.cc); included by nvcc only (`-x cu`).
//
// The kernels are templates over the storage type T: float, double, and the
// 16-bit __half (IEEE binary16, cuda_fp16.h) and __nv_bfloat16 (cuda_bf16.h).
// The 16-bit types are storage only, as on the CPU (../low_precision.h):
// every product is accumulated in Acc<T> = float32 (float64 for double),
// and each output is rounded once to T, round-to-nearest-even
// (__float2half_rn / __float2bfloat16_rn: overflow gives +-Inf, NaN stays
// NaN). Widening bfloat16 is a 16-bit shift, widening half is exact too, so
// the float32 sums see the stored values exactly.
//
// Zero tests (Elem<T>::Nonzero) are on the bits for the 16-bit types:
// (bits & 0x7fff) != 0 -- true for NaN and +-Inf, false for +-0 -- the same
// as x != 0 for float/double and as IsZero in ../low_precision.h. (The
// cuda_fp16 operator!= is an ordered compare, false for NaN, so it is not
// used.)
#ifndef TF_SPARSE_SPLIT_CC_CORE_CUDA_ELEMENT_CUDA_CUH_
#define TF_SPARSE_SPLIT_CC_CORE_CUDA_ELEMENT_CUDA_CUH_

#if !defined(__CUDACC__)
#error "element_cuda.cuh is for nvcc (-x cu) only"
#endif

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace tf_sparse_split {
namespace cuda_elem {

// Loads, conversions and the zero test of one storage type.
template <typename T>
struct Elem {  // float, double: the storage type is the arithmetic type
  typedef T Acc;
  static __device__ __forceinline__ T Ld(const T* p) { return __ldg(p); }
  static __device__ __forceinline__ Acc ToAcc(T x) { return x; }
  static __device__ __forceinline__ T FromAcc(Acc x) { return x; }
  static __device__ __forceinline__ bool Nonzero(T x) { return x != T(0); }
  static __device__ __forceinline__ T Zero() { return T(0); }
};

template <>
struct Elem<__half> {
  typedef float Acc;
  static __device__ __forceinline__ __half Ld(const __half* p) {
    return __ushort_as_half(__ldg(reinterpret_cast<const unsigned short*>(p)));
  }
  static __device__ __forceinline__ float ToAcc(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half FromAcc(float x) { return __float2half_rn(x); }
  static __device__ __forceinline__ bool Nonzero(__half x) {
    return (__half_as_ushort(x) & 0x7fffu) != 0u;
  }
  static __device__ __forceinline__ __half Zero() { return __ushort_as_half(0); }
  // Two packed values (element 0 in the low half of the word, as stored).
  static __device__ __forceinline__ void Unpack2(unsigned w, float* o) {
    o[0] = __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu)));
    o[1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
  }
  static __device__ __forceinline__ unsigned Pack2(float lo, float hi) {
    return static_cast<unsigned>(__half_as_ushort(__float2half_rn(lo))) |
           (static_cast<unsigned>(__half_as_ushort(__float2half_rn(hi))) << 16);
  }
};

template <>
struct Elem<__nv_bfloat16> {
  typedef float Acc;
  static __device__ __forceinline__ __nv_bfloat16 Ld(const __nv_bfloat16* p) {
    return __ushort_as_bfloat16(__ldg(reinterpret_cast<const unsigned short*>(p)));
  }
  static __device__ __forceinline__ float ToAcc(__nv_bfloat16 x) {
    return __uint_as_float(static_cast<unsigned>(__bfloat16_as_ushort(x)) << 16);
  }
  static __device__ __forceinline__ __nv_bfloat16 FromAcc(float x) {
    return __float2bfloat16_rn(x);
  }
  static __device__ __forceinline__ bool Nonzero(__nv_bfloat16 x) {
    return (__bfloat16_as_ushort(x) & 0x7fffu) != 0u;
  }
  static __device__ __forceinline__ __nv_bfloat16 Zero() { return __ushort_as_bfloat16(0); }
  static __device__ __forceinline__ void Unpack2(unsigned w, float* o) {
    o[0] = __uint_as_float(w << 16);
    o[1] = __uint_as_float(w & 0xffff0000u);
  }
  static __device__ __forceinline__ unsigned Pack2(float lo, float hi) {
    return static_cast<unsigned>(__bfloat16_as_ushort(__float2bfloat16_rn(lo))) |
           (static_cast<unsigned>(__bfloat16_as_ushort(__float2bfloat16_rn(hi))) << 16);
  }
};

template <typename T>
using Acc = typename Elem<T>::Acc;

// Elements of T in 16 bytes (one vector load).
template <typename T>
constexpr int kVec16 = static_cast<int>(16 / sizeof(T));

// --- Loads through the read-only cache, widened to Acc<T> ------------------
// One element.
template <typename T>
__device__ __forceinline__ void LoadRO(const T* p, Acc<T> (&o)[1]) {
  o[0] = Elem<T>::ToAcc(Elem<T>::Ld(p));
}
// 16 bytes (p 16-byte aligned).
__device__ __forceinline__ void LoadRO(const float* p, float (&o)[4]) {
  const float4 q = __ldg(reinterpret_cast<const float4*>(p));
  o[0] = q.x; o[1] = q.y; o[2] = q.z; o[3] = q.w;
}
__device__ __forceinline__ void LoadRO(const double* p, double (&o)[2]) {
  const double2 q = __ldg(reinterpret_cast<const double2*>(p));
  o[0] = q.x; o[1] = q.y;
}
template <typename T>
__device__ __forceinline__ void Unpack8(const uint4& q, float (&o)[8]) {
  Elem<T>::Unpack2(q.x, o + 0);
  Elem<T>::Unpack2(q.y, o + 2);
  Elem<T>::Unpack2(q.z, o + 4);
  Elem<T>::Unpack2(q.w, o + 6);
}
template <typename T>
__device__ __forceinline__ uint4 Pack8(const float (&v)[8]) {
  return make_uint4(Elem<T>::Pack2(v[0], v[1]), Elem<T>::Pack2(v[2], v[3]),
                    Elem<T>::Pack2(v[4], v[5]), Elem<T>::Pack2(v[6], v[7]));
}
__device__ __forceinline__ void LoadRO(const __half* p, float (&o)[8]) {
  Unpack8<__half>(__ldg(reinterpret_cast<const uint4*>(p)), o);
}
__device__ __forceinline__ void LoadRO(const __nv_bfloat16* p, float (&o)[8]) {
  Unpack8<__nv_bfloat16>(__ldg(reinterpret_cast<const uint4*>(p)), o);
}

// --- Plain (coherent) loads and rounding stores of an output ---------------
template <typename T>
__device__ __forceinline__ void Load(const T* p, Acc<T> (&o)[1]) {
  o[0] = Elem<T>::ToAcc(*p);
}
__device__ __forceinline__ void Load(const float* p, float (&o)[4]) {
  const float4 q = *reinterpret_cast<const float4*>(p);
  o[0] = q.x; o[1] = q.y; o[2] = q.z; o[3] = q.w;
}
__device__ __forceinline__ void Load(const double* p, double (&o)[2]) {
  const double2 q = *reinterpret_cast<const double2*>(p);
  o[0] = q.x; o[1] = q.y;
}
__device__ __forceinline__ void Load(const __half* p, float (&o)[8]) {
  Unpack8<__half>(*reinterpret_cast<const uint4*>(p), o);
}
__device__ __forceinline__ void Load(const __nv_bfloat16* p, float (&o)[8]) {
  Unpack8<__nv_bfloat16>(*reinterpret_cast<const uint4*>(p), o);
}

template <typename T>
__device__ __forceinline__ void Store(T* p, const Acc<T> (&v)[1]) {
  *p = Elem<T>::FromAcc(v[0]);
}
__device__ __forceinline__ void Store(float* p, const float (&v)[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ void Store(double* p, const double (&v)[2]) {
  *reinterpret_cast<double2*>(p) = make_double2(v[0], v[1]);
}
__device__ __forceinline__ void Store(__half* p, const float (&v)[8]) {
  *reinterpret_cast<uint4*>(p) = Pack8<__half>(v);
}
__device__ __forceinline__ void Store(__nv_bfloat16* p, const float (&v)[8]) {
  *reinterpret_cast<uint4*>(p) = Pack8<__nv_bfloat16>(v);
}

}  // namespace cuda_elem
}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_CORE_CUDA_ELEMENT_CUDA_CUH_
