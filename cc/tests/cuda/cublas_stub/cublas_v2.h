// COMPILE-CHECK STUB, not cuBLAS. .ci/cuda_compile_check.sh puts this
// directory on the include path only where no real cuBLAS is found, to
// compile (never link or run) the cuBLAS code of harness.cu.cc (the SGEMM
// baselines and the cublasGemmEx dense part of the split tests):
// it declares just the subset of cublas_v2.h the harness uses, with the
// signatures of the real header (CUDA 12/13), so that a typo or a wrong
// argument list in that code fails the check on machines without cuBLAS.
#ifndef TFSS_CUBLAS_COMPILE_CHECK_STUB_H_
#define TFSS_CUBLAS_COMPILE_CHECK_STUB_H_

#include <cuda_runtime_api.h>
#include <library_types.h>  // cudaDataType_t (CUDA_R_16BF, CUDA_R_16F, ...)

struct cublasContext;
typedef struct cublasContext* cublasHandle_t;

typedef enum {
  CUBLAS_STATUS_SUCCESS = 0,
  CUBLAS_STATUS_NOT_INITIALIZED = 1,
} cublasStatus_t;

typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1, CUBLAS_OP_C = 2 } cublasOperation_t;

typedef enum {
  CUBLAS_COMPUTE_16F = 64,
  CUBLAS_COMPUTE_16F_PEDANTIC = 65,
  CUBLAS_COMPUTE_32F = 68,
  CUBLAS_COMPUTE_32F_PEDANTIC = 69,
  CUBLAS_COMPUTE_32F_FAST_16F = 74,
  CUBLAS_COMPUTE_32F_FAST_16BF = 75,
  CUBLAS_COMPUTE_32F_FAST_TF32 = 77,
  CUBLAS_COMPUTE_64F = 70,
  CUBLAS_COMPUTE_64F_PEDANTIC = 71,
} cublasComputeType_t;

typedef enum {
  CUBLAS_GEMM_DFALT = -1,
  CUBLAS_GEMM_DEFAULT = -1,
  CUBLAS_GEMM_DEFAULT_TENSOR_OP = 99,
} cublasGemmAlgo_t;

typedef enum {
  CUBLAS_DEFAULT_MATH = 0,
  CUBLAS_TENSOR_OP_MATH = 1,
  CUBLAS_PEDANTIC_MATH = 2,
  CUBLAS_TF32_TENSOR_OP_MATH = 3,
} cublasMath_t;

extern "C" {
cublasStatus_t cublasCreate_v2(cublasHandle_t* handle);
cublasStatus_t cublasDestroy_v2(cublasHandle_t handle);
cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream);
cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode);
cublasStatus_t cublasSgemm_v2(cublasHandle_t handle, cublasOperation_t transa,
                              cublasOperation_t transb, int m, int n, int k,
                              const float* alpha, const float* A, int lda,
                              const float* B, int ldb, const float* beta, float* C,
                              int ldc);
cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa,
                            cublasOperation_t transb, int m, int n, int k,
                            const void* alpha, const void* A, cudaDataType_t Atype,
                            int lda, const void* B, cudaDataType_t Btype, int ldb,
                            const void* beta, void* C, cudaDataType_t Ctype, int ldc,
                            cublasComputeType_t computeType, cublasGemmAlgo_t algo);
}

#define cublasCreate cublasCreate_v2
#define cublasDestroy cublasDestroy_v2
#define cublasSetStream cublasSetStream_v2
#define cublasSgemm cublasSgemm_v2

#endif  // TFSS_CUBLAS_COMPILE_CHECK_STUB_H_
