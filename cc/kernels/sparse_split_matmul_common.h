// Pieces shared by the CPU and GPU kernels of SparseSplitMatMul: input
// validation, the dense part, live columns, op(b) in row-major form and the
// calibration sample's CSR. (The row split is in row_split.h.)
#ifndef TF_SPARSE_SPLIT_CC_KERNELS_SPARSE_SPLIT_MATMUL_COMMON_H_
#define TF_SPARSE_SPLIT_CC_KERNELS_SPARSE_SPLIT_MATMUL_COMMON_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <mutex>
#include <numeric>
#include <vector>

#include "cc/core/cost_model.h"
#include "cc/core/sparse_matmul.h"
#include "cc/kernels/core_types.h"
#include "cc/kernels/tf_kernel.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace tf_sparse_split {

// The attrs of a SparseSplitMatMul kernel and the TF MatMul kernels its
// dense part runs (CPU and GPU alike): op(a) * op(b) on the inputs as given
// (`direct`), gathered rows of op(a) times op(b) as given (`gathered`), and
// gathered rows and compacted columns times gathered rows of op(b), never
// transposed (`compacted`).
struct MatMulKernels {
  bool ta = false, tb = false, hetero = false;
  TfKernel direct, gathered, compacted;

  absl::Status Init(::tensorflow::OpKernelConstruction* ctx,
                    const ::tensorflow::DeviceType& device,
                    ::tensorflow::DataType dtype) {
    TF_RETURN_IF_ERROR(ctx->GetAttr("transpose_a", &ta));
    TF_RETURN_IF_ERROR(ctx->GetAttr("transpose_b", &tb));
    TF_RETURN_IF_ERROR(ctx->GetAttr("heterogeneous", &hetero));
    TF_RETURN_IF_ERROR(InitTfMatMul(ctx, device, dtype, ta, tb, &direct));
    TF_RETURN_IF_ERROR(InitTfMatMul(ctx, device, dtype, false, tb, &gathered));
    return InitTfMatMul(ctx, device, dtype, false, false, &compacted);
  }
};

// The FamilyModel (cost_model.h) of an op instance's calls. The
// process-wide registry (FamilyFor: a key vector built, a global mutex, a
// map walk) is asked only when the call's sizes differ from the previous
// call's -- a layer calls with the same shape step after step -- the
// family op, dtype and transpose_b being fixed per op instance. Registry
// entries live for the process, so the cached pointer stays valid.
class FamilyCache {
 public:
  FamilyModel& Get(int64_t family_op, int64_t dtype, int64_t m, int64_t k,
                   int64_t n, bool transpose_b) {
    std::lock_guard<std::mutex> lock(mu_);
    if (model_ == nullptr || m != m_ || k != k_ || n != n_) {
      model_ = &FamilyFor(
          MatMulFamilyKey(family_op, dtype, m, k, n, transpose_b));
      m_ = m;
      k_ = k;
      n_ = n;
    }
    return *model_;
  }

 private:
  std::mutex mu_;
  FamilyModel* model_ = nullptr;
  int64_t m_ = -1, k_ = -1, n_ = -1;
};

// The dense part of a SparseSplitMatMul call, on CPU and GPU alike (`dev`
// supplies the device's gather and scatter:
//   absl::Status Gather(const Tensor& src, bool transpose, const int64_t* rows,
//                       int64_t n_rows, const int64_t* cols, int64_t n_cols,
//                       Tensor* out);   // GatherSubmatrix of op(src) into out
//   absl::Status Scatter(const Tensor& src, const int64_t* rows, int64_t n_rows,
//                        int64_t n, Tensor* out);  // ScatterRows
// with index lists in the device's memory). With every row dense and nothing
// compacted, TF's MatMul runs on a and b as they are and its result is
// output 0 (no copy). Otherwise the dense rows (`dense_rows`, or all m when
// rd == m) and, when compacting, the kc live columns (`live_cols`) of op(a)
// are gathered, with the matching rows of op(b); their product is output 0
// when rd == m, else it is scattered into *out. `gathered_product`, when
// given, computes the uncompacted product of the gathered rows and b
// instead of `mm.gathered` (the CPU's choice of how to run it with a
// transposed b, transposed_product.h).
template <typename Dev>
absl::Status RunMatMulDensePart(
    ::tensorflow::OpKernelContext* ctx, const MatMulKernels& mm,
    const ::tensorflow::Tensor& a, const ::tensorflow::Tensor& b, int64_t m,
    int64_t n, int64_t rd, bool compact, int64_t kc, const int64_t* dense_rows,
    const int64_t* live_cols, Dev& dev, ::tensorflow::Tensor* out,
    const std::function<absl::Status(const ::tensorflow::Tensor&,
                                     ::tensorflow::Tensor*)>*
        gathered_product = nullptr) {
  namespace tf = ::tensorflow;
  if (rd == 0) return absl::OkStatus();
  if (rd == m && !compact) {
    tf::Tensor product;
    TF_RETURN_IF_ERROR(mm.direct.Run(ctx, {&a, &b}, &product));
    ctx->set_output(0, product);
    return absl::OkStatus();
  }
  tf::Tensor ad_t, bc_t, cd_t;
  TF_RETURN_IF_ERROR(
      ctx->allocate_temp(a.dtype(), tf::TensorShape({rd, kc}), &ad_t));
  TF_RETURN_IF_ERROR(dev.Gather(a, mm.ta, rd == m ? nullptr : dense_rows, rd,
                                compact ? live_cols : nullptr, kc, &ad_t));
  if (compact) {
    // Rows live_cols of op(b), gathered from b (read transposed if tb).
    TF_RETURN_IF_ERROR(
        ctx->allocate_temp(b.dtype(), tf::TensorShape({kc, n}), &bc_t));
    TF_RETURN_IF_ERROR(dev.Gather(b, mm.tb, live_cols, kc, nullptr, n, &bc_t));
    TF_RETURN_IF_ERROR(mm.compacted.Run(ctx, {&ad_t, &bc_t}, &cd_t));
  } else if (gathered_product != nullptr) {
    TF_RETURN_IF_ERROR((*gathered_product)(ad_t, &cd_t));
  } else {
    TF_RETURN_IF_ERROR(mm.gathered.Run(ctx, {&ad_t, &b}, &cd_t));
  }
  if (rd == m) {
    ctx->set_output(0, cd_t);
    return absl::OkStatus();
  }
  return dev.Scatter(cd_t, dense_rows, rd, n, out);
}

// The validated problem: op(a) is [m, k], op(b) is [k, n]; threshold as
// given (negative = automatic).
struct MatMulProblem {
  int64_t m = 0, k = 0, n = 0;
  float threshold = -1.0f;
};

// Checks ranks, inner dimensions and the threshold; InvalidArgument naming
// the shapes/values otherwise.
inline absl::Status ValidateMatMul(const ::tensorflow::Tensor& a,
                                   const ::tensorflow::Tensor& b,
                                   const ::tensorflow::Tensor& threshold,
                                   bool ta, bool tb, MatMulProblem* p) {
  namespace tf = ::tensorflow;
  if (!tf::TensorShapeUtils::IsMatrix(a.shape()))
    return tf::errors::InvalidArgument(
        "SparseSplitMatMul: a must be a matrix (rank 2), got shape ",
        a.shape().DebugString());
  if (!tf::TensorShapeUtils::IsMatrix(b.shape()))
    return tf::errors::InvalidArgument(
        "SparseSplitMatMul: b must be a matrix (rank 2), got shape ",
        b.shape().DebugString());
  if (!tf::TensorShapeUtils::IsScalar(threshold.shape()))
    return tf::errors::InvalidArgument(
        "SparseSplitMatMul: threshold must be a scalar, got shape ",
        threshold.shape().DebugString());
  p->threshold = threshold.scalar<float>()();
  if (std::isnan(p->threshold) || p->threshold > 1.0f)
    return tf::errors::InvalidArgument(
        "SparseSplitMatMul: threshold must be in [0, 1] or negative "
        "(automatic), got ", p->threshold);
  p->m = a.dim_size(ta ? 1 : 0);
  p->k = a.dim_size(ta ? 0 : 1);
  const int64_t kb = b.dim_size(tb ? 1 : 0);
  p->n = b.dim_size(tb ? 0 : 1);
  if (p->k != kb)
    return tf::errors::InvalidArgument(
        "SparseSplitMatMul: inner dimensions differ: a shape ",
        a.shape().DebugString(), " (transpose_a=", ta, ") and b shape ",
        b.shape().DebugString(), " (transpose_b=", tb, ") give ", p->k,
        " vs ", kb);
  if (p->k >= (int64_t{1} << 31))
    return tf::errors::InvalidArgument(
        "SparseSplitMatMul: inner dimension ", p->k,
        " exceeds the 2^31-1 supported by the CSR indices");
  return absl::OkStatus();
}

// Live (not all-zero) columns of op(a), from its column counts.
inline std::vector<int64_t> LiveColumns(const int64_t* col_nnz, int64_t k) {
  std::vector<int64_t> live;
  live.reserve(k);
  for (int64_t j = 0; j < k; ++j)
    if (col_nnz[j] != 0) live.push_back(j);
  return live;
}

// op(b) as a row-major [k, n] matrix for the CPU kernels: b itself, or b^T
// materialised in *tmp (allocated from ctx) when transpose_b.
template <typename T>
absl::Status RowMajorOpB(::tensorflow::OpKernelContext* ctx,
                         const ::tensorflow::Tensor& b, bool transpose_b,
                         int64_t k, int64_t n, const ParallelFor& pfor,
                         ::tensorflow::Tensor* tmp, const T** out) {
  *out = b.flat<T>().data();
  if (!transpose_b) return absl::OkStatus();
  TF_RETURN_IF_ERROR(
      ctx->allocate_temp(b.dtype(), ::tensorflow::TensorShape({k, n}), tmp));
  GatherSubmatrix<CoreType<T>>(AsCore(*out), b.dim_size(0), b.dim_size(1), true,
                            nullptr, k, nullptr, n, AsCore(tmp->flat<T>().data()),
                            pfor);
  *out = tmp->flat<T>().data();
  return absl::OkStatus();
}

// The CSR of every row of a row-major [rows, k] calibration sample (row
// counts given), with the identity output-row map in *rows_out.
template <typename T>
void SampleCsr(const ::tensorflow::Tensor& sample, int64_t k,
               const int64_t* row_nnz, const ParallelFor& pfor,
               std::vector<int64_t>* rows_out, Csr<CoreType<T>>* csr) {
  const int64_t rows = sample.dim_size(0);
  rows_out->resize(rows);
  std::iota(rows_out->begin(), rows_out->end(), int64_t{0});
  BuildCsr<CoreType<T>>(AsCore(sample.flat<T>().data()), rows, k, false,
                     rows_out->data(), rows, row_nnz, nullptr, csr, pfor);
}

}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_KERNELS_SPARSE_SPLIT_MATMUL_COMMON_H_
