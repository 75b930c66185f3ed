// CUDA version of the bias + activation epilogue of ../epilogue.h (layer 1
// of docs/ARCHITECTURE.md, GPU side; framework-free, only the CUDA runtime headers).
//
// c[i, :] = act(c[i, :] + bias) in place on every row of the row-major
// device matrix c [m, n] (leading dimension ldc >= n); bias is a device
// vector [n] or null. `act` is the value of tf_sparse_split::Activation
// (0 none, 1 relu, 2 relu6), with the same element values as the CPU loop
// (NaN stays NaN). Enqueued on `stream`; returns cudaErrorInvalidValue for
// bad sizes or an unknown activation, else the launch status. Instantiated
// for float, double, __half and __nv_bfloat16; the 16-bit values are widened
// to float32, added and activated there, and rounded once to T (round-to-
// nearest-even). Nothing is launched when there is nothing to do (an empty
// matrix, or no bias and no activation). Deterministic: element-wise.
//
// Build: epilogue.cu.cc is compiled by nvcc (`-x cu`); this header may be
// included from plain C++.
#ifndef TF_SPARSE_SPLIT_CC_CORE_CUDA_EPILOGUE_CUDA_H_
#define TF_SPARSE_SPLIT_CC_CORE_CUDA_EPILOGUE_CUDA_H_

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

namespace tf_sparse_split {

template <typename T>
cudaError_t BiasActivationGpu(T* c, int64_t m, int64_t n, int64_t ldc,
                              const T* bias, int act, cudaStream_t stream);

}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_CORE_CUDA_EPILOGUE_CUDA_H_
