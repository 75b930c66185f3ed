// CUDA bias + activation epilogue (contract in epilogue_cuda.h).
#if defined(__CUDACC__) && (!defined(GOOGLE_CUDA) || GOOGLE_CUDA)

#include "epilogue_cuda.h"

#include "element_cuda.cuh"

#include <climits>
#include <cstdint>

namespace tf_sparse_split {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxGridY = 65535;

// Grid: x over column blocks of kThreads, y over rows (grid-strided); each
// thread handles one column of each of its rows, so bias[j] is loaded once
// per row by one thread (coalesced, read-only cache). The arithmetic is in
// Acc<T> (float32 for float and the 16-bit types, which are widened, added
// and rounded once, round-to-nearest-even, as TF's Eigen::bfloat16 /
// Eigen::half operators do); relu/relu6 commute with that rounding.
template <typename T, int kAct, bool kBias>
__global__ void BiasActivationKernel(T* __restrict__ c, int64_t m, int64_t n,
                                     int64_t ldc, const T* __restrict__ bias) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (j >= n) return;
  typedef cuda_elem::Elem<T> E;
  typedef typename E::Acc A;
  const A b = kBias ? E::ToAcc(E::Ld(bias + j)) : A(0);
  for (int64_t i = blockIdx.y; i < m; i += gridDim.y) {
    A v = E::ToAcc(c[i * ldc + j]);
    if (kBias) v += b;
    if (kAct >= 1) v = v < A(0) ? A(0) : v;  // NaN stays NaN
    if (kAct == 2) v = v > A(6) ? A(6) : v;
    c[i * ldc + j] = E::FromAcc(v);
  }
}

template <typename T, int kAct>
cudaError_t Launch(T* c, int64_t m, int64_t n, int64_t ldc, const T* bias,
                   cudaStream_t stream) {
  const int64_t bx = (n + kThreads - 1) / kThreads;
  if (bx > INT_MAX) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(bx),
                  static_cast<unsigned>(m < kMaxGridY ? m : kMaxGridY));
  if (bias != nullptr) {
    BiasActivationKernel<T, kAct, true><<<grid, kThreads, 0, stream>>>(c, m, n, ldc, bias);
  } else {
    BiasActivationKernel<T, kAct, false><<<grid, kThreads, 0, stream>>>(c, m, n, ldc, nullptr);
  }
  return cudaGetLastError();
}

}  // namespace

template <typename T>
cudaError_t BiasActivationGpu(T* c, int64_t m, int64_t n, int64_t ldc,
                              const T* bias, int act, cudaStream_t stream) {
  if (m < 0 || n < 0 || ldc < n || act < 0 || act > 2) return cudaErrorInvalidValue;
  if (m == 0 || n == 0 || (bias == nullptr && act == 0)) return cudaSuccess;
  if (c == nullptr) return cudaErrorInvalidValue;
  switch (act) {
    case 0: return Launch<T, 0>(c, m, n, ldc, bias, stream);
    case 1: return Launch<T, 1>(c, m, n, ldc, bias, stream);
    default: return Launch<T, 2>(c, m, n, ldc, bias, stream);
  }
}

template cudaError_t BiasActivationGpu<float>(float*, int64_t, int64_t, int64_t,
                                              const float*, int, cudaStream_t);
template cudaError_t BiasActivationGpu<double>(double*, int64_t, int64_t, int64_t,
                                               const double*, int, cudaStream_t);
template cudaError_t BiasActivationGpu<__half>(__half*, int64_t, int64_t, int64_t,
                                               const __half*, int, cudaStream_t);
template cudaError_t BiasActivationGpu<__nv_bfloat16>(__nv_bfloat16*, int64_t, int64_t,
                                                      int64_t, const __nv_bfloat16*, int,
                                                      cudaStream_t);

}  // namespace tf_sparse_split

#endif  // defined(__CUDACC__) && (!defined(GOOGLE_CUDA) || GOOGLE_CUDA)
