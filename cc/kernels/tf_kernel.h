// Runs one of TensorFlow's own kernels (MatMul, Conv2D, their oneDNN forms)
// in-process inside our op kernels, so that the dense part of a split runs
// exactly the code tf.matmul / tf.nn.conv2d run (a plain Eigen contraction
// compiled into a custom op was measured 2.7x slower than tf.matmul).
#ifndef TF_SPARSE_SPLIT_CC_KERNELS_TF_KERNEL_H_
#define TF_SPARSE_SPLIT_CC_KERNELS_TF_KERNEL_H_

#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <exception>

#include "absl/container/inlined_vector.h"
#include "absl/types/span.h"
#include "tensorflow/core/framework/node_def_util.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "cc/core/low_precision.h"

namespace tf_sparse_split {

// A TensorFlow kernel created once per op instance and run on a sub-context
// of the calling op's context: same device, thread pool, allocator and (on a
// GPU) device context, hence the same stream.
class TfKernel {
 public:
  // Creates the kernel of `op_name` on `device_type` with `num_inputs` inputs
  // and the attrs `add_attrs` sets (defaults filled in); a non-empty `label`
  // selects a labelled kernel (e.g. oneDNN's "MklNameChangeOp").
  absl::Status Init(::tensorflow::OpKernelConstruction* ctx,
                    const ::tensorflow::DeviceType& device_type,
                    const std::string& op_name, const std::string& label,
                    int num_inputs,
                    const std::function<void(::tensorflow::NodeDef*)>& add_attrs) {
    namespace tf = ::tensorflow;
    tf::NodeDef def;
    def.set_name(absl::StrCat(ctx->def().name(), "/tfss_dense_", op_name));
    def.set_op(op_name);
    for (int i = 0; i < num_inputs; ++i) def.add_input(absl::StrCat("in", i));
    add_attrs(&def);
    if (!label.empty()) tf::AddNodeAttr("_kernel", label, &def);
    const tf::OpDef* op_def = nullptr;
    TF_RETURN_IF_ERROR(tf::OpRegistry::Global()->LookUpOpDef(op_name, &op_def));
    tf::AddDefaultsToNodeDef(*op_def, &def);
    absl::Status status;
    kernel_ = tf::CreateOpKernel(device_type, ctx->device(),
                                 ctx->device()->GetAllocator({}), def,
                                 ctx->graph_def_version(), &status);
    if (!status.ok()) kernel_.reset();
    return status;
  }

  bool ok() const { return kernel_ != nullptr; }

  // Runs the kernel on the calling op's own context, with no sub-context:
  // its inputs are ctx's first inputs, in order, and its output 0 is ctx's
  // output 0 (allocated by the kernel; it must have ctx's output 0 dtype).
  // For the all-dense call whose operands are the op's inputs as given:
  // nothing is built per call (no Params, no sub-context, no output copy).
  absl::Status RunOnContext(::tensorflow::OpKernelContext* ctx) const {
    TF_RETURN_IF_ERROR(Compute(ctx));
    TF_RETURN_IF_ERROR(ctx->status());
    if (ctx->mutable_output(0) == nullptr)
      return absl::InternalError(
          absl::StrCat(kernel_->name(), " did not set output 0"));
    return absl::OkStatus();
  }

  // Runs the kernel on `ins`; *out = its output 0 (a new tensor, enqueued on
  // the stream on a GPU). Per call this builds only the sub-context (no heap
  // allocation for up to kMaxInputs inputs): the kernel itself was created
  // once, in Init.
  absl::Status Run(::tensorflow::OpKernelContext* ctx,
                   absl::Span<const ::tensorflow::Tensor* const> ins,
                   ::tensorflow::Tensor* out) const {
    return RunOutputs(ctx, ins, {out});
  }

  // As Run, for a kernel with outs.size() outputs: *outs[i] = its output i.
  absl::Status RunOutputs(
      ::tensorflow::OpKernelContext* ctx,
      absl::Span<const ::tensorflow::Tensor* const> ins,
      absl::Span<::tensorflow::Tensor* const> outs) const {
    namespace tf = ::tensorflow;
    absl::InlinedVector<tf::TensorValue, kMaxInputs> inputs;
    for (const tf::Tensor* t : ins)
      inputs.emplace_back(const_cast<tf::Tensor*>(t));
    absl::InlinedVector<tf::AllocatorAttributes, kMaxInputs> in_attrs(
        ins.size());
    absl::InlinedVector<tf::AllocatorAttributes, 2> out_attrs(outs.size());
    tf::OpKernelContext::Params p;
    p.device = ctx->device();
    p.op_kernel = kernel_.get();
    // On a GPU the sub-context builds its Eigen GPU device from this device
    // context (the same stream); ~Params frees it.
    p.op_device_context = ctx->op_device_context();
    p.inputs = absl::MakeConstSpan(inputs);
    p.input_alloc_attrs = absl::MakeConstSpan(in_attrs);
    p.output_attr_array = out_attrs.data();
    p.runner = ctx->runner();
    p.step_container = ctx->step_container();
    p.resource_manager = ctx->resource_manager();
    p.function_library = ctx->function_library();
    p.cancellation_manager = ctx->cancellation_manager();
    p.frame_iter = ctx->frame_iter();
    tf::OpKernelContext sub(&p, static_cast<int>(outs.size()));
    TF_RETURN_IF_ERROR(Compute(&sub));
    TF_RETURN_IF_ERROR(sub.status());
    for (size_t i = 0; i < outs.size(); ++i) {
      const tf::Tensor* o = sub.mutable_output(static_cast<int>(i));
      if (o == nullptr)
        return absl::InternalError(
            absl::StrCat(kernel_->name(), " did not set output ", i));
      *outs[i] = *o;
    }
    return absl::OkStatus();
  }

 private:
  // The kernel's Compute, with a C++ exception thrown inside it (oneDNN
  // throws dnnl::error for a primitive this CPU cannot run) returned as an
  // error status: let through, it would unwind into TensorFlow's executor
  // and abort the process.
  absl::Status Compute(::tensorflow::OpKernelContext* ctx) const {
    try {
      kernel_->Compute(ctx);
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrCat(
          kernel_->name(), " (", kernel_->type_string(), ") threw: ", e.what()));
    } catch (...) {
      return absl::InternalError(absl::StrCat(
          kernel_->name(), " (", kernel_->type_string(), ") threw"));
    }
    return absl::OkStatus();
  }

  static constexpr int kMaxInputs = 4;
  std::unique_ptr<::tensorflow::OpKernel> kernel_;
};

// Whether TF's oneDNN kernels are on (TF's default on x86 unless
// TF_ENABLE_ONEDNN_OPTS is 0/false).
inline bool OneDnnEnabled() {
  const char* env = std::getenv("TF_ENABLE_ONEDNN_OPTS");
  if (env == nullptr) return true;
  const std::string v(env);
  return !(v == "0" || v == "false" || v == "False" || v == "FALSE");
}

// Whether TF runs its oneDNN kernels (MatMul, convolutions and their fused
// forms) in dtype dt on this CPU, as its graph rewrite does (CPUID, read at
// run time): float32 always (oneDNN on); bfloat16 with AVX-512F (oneDNN's
// bf16 kernels: native AVX512_BF16 / AMX where present, emulated on
// AVX-512F otherwise); half only with AVX512_FP16 (on AVX-512 CPUs without
// it, e.g. AMD Zen 4, oneDNN's half matmul primitive throws). Elsewhere
// TF's Eigen kernels run that dtype.
inline bool OneDnnRunsDtype(::tensorflow::DataType dt) {
  namespace tf = ::tensorflow;
  if (!OneDnnEnabled()) return dt == tf::DT_FLOAT;
  switch (dt) {
    case tf::DT_FLOAT:
      return true;
    case tf::DT_BFLOAT16:
      return Cpu().avx512f;
    case tf::DT_HALF:
      return Cpu().avx512fp16;
    default:
      return false;
  }
}

// The attrs of TF's MatMul-family kernels: T, transpose_a, transpose_b.
inline void AddMatMulAttrs(::tensorflow::DataType dtype, bool ta, bool tb,
                           ::tensorflow::NodeDef* def) {
  ::tensorflow::AddNodeAttr("T", dtype, def);
  ::tensorflow::AddNodeAttr("transpose_a", ta, def);
  ::tensorflow::AddNodeAttr("transpose_b", tb, def);
}

// TF's MatMul kernel for op(a) * op(b) on `device_type`: on the CPU with
// oneDNN on, the oneDNN kernel "_MklMatMul" that tf.matmul runs in graphs
// where it exists for the dtype and this CPU runs it (OneDnnRunsDtype),
// else the plain "MatMul" (Eigen), as TF's own graph does.
inline absl::Status InitTfMatMul(::tensorflow::OpKernelConstruction* ctx,
                                 const ::tensorflow::DeviceType& device_type,
                                 ::tensorflow::DataType dtype, bool ta, bool tb,
                                 TfKernel* kernel) {
  namespace tf = ::tensorflow;
  auto attrs = [&](tf::NodeDef* def) { AddMatMulAttrs(dtype, ta, tb, def); };
  if (device_type == tf::DEVICE_CPU && OneDnnRunsDtype(dtype) &&
      kernel->Init(ctx, device_type, "_MklMatMul", "MklNameChangeOp", 2, attrs)
          .ok()) {
    return absl::OkStatus();
  }
  return kernel->Init(ctx, device_type, "MatMul", "", 2, attrs);
}

// TF's fused MatMul + BiasAdd (+ activation) kernel on the CPU: the kernel
// tf.nn.relu(tf.matmul(a, b) + bias) runs in a graph once Grappler's
// remapper has fused it into "_FusedMatMul" -- with oneDNN on, the layout
// pass renames that to "_MklNativeFusedMatMul" (label "MklNameChangeOp"),
// else (or where this CPU does not run oneDNN in the dtype, OneDnnRunsDtype)
// the Eigen "_FusedMatMul". Both take (a, b, bias) and exist on the CPU
// for float32, bfloat16 and half in TF 2.21 (not float64: there TF's graph
// runs MatMul, BiasAdd and Relu). `fused_ops` is {"BiasAdd"} or {"BiasAdd",
// "Relu"} / {"BiasAdd", "Relu6"}. An error (no such kernel) leaves *kernel
// unusable (ok() false); callers fall back to MatMul plus their own
// epilogue. *onednn (optional): whether the kernel is oneDNN's, whose
// relu/relu6 post-ops compute max(x, 0) (NaN -> 0).
inline absl::Status InitTfFusedMatMul(
    ::tensorflow::OpKernelConstruction* ctx,
    const ::tensorflow::DeviceType& device_type, ::tensorflow::DataType dtype,
    bool ta, bool tb, const std::vector<std::string>& fused_ops,
    TfKernel* kernel, bool* onednn = nullptr) {
  namespace tf = ::tensorflow;
  auto attrs = [&](tf::NodeDef* def) {
    AddMatMulAttrs(dtype, ta, tb, def);
    tf::AddNodeAttr("num_args", 1, def);
    tf::AddNodeAttr("fused_ops", fused_ops, def);
  };
  if (onednn != nullptr) *onednn = false;
  if (device_type == tf::DEVICE_CPU && OneDnnRunsDtype(dtype) &&
      kernel->Init(ctx, device_type, "_MklNativeFusedMatMul",
                   "MklNameChangeOp", 3, attrs)
          .ok()) {
    if (onednn != nullptr) *onednn = true;
    return absl::OkStatus();
  }
  return kernel->Init(ctx, device_type, "_FusedMatMul", "", 3, attrs);
}

}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_KERNELS_TF_KERNEL_H_
