// Small stateful ops through which Python configures the rewrite pass and
// reads what it did. They live in the op library so that they share the
// pass's state (a separate pybind11 module would have its own copy).
// Meant to be run eagerly by tf_sparse_split/rewrite.py.
#include <string>
#include <vector>

#include "cc/rewrite/sparse_split_rewrite.h"
#include "tensorflow/core/framework/graph.pb.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"

namespace tf_sparse_split {
namespace rewrite {

namespace tf = ::tensorflow;
using tf::shape_inference::InferenceContext;

namespace {

// Shape function of every op here: each output is a vector of unknown length.
absl::Status UnknownVectorOutputs(InferenceContext* c) {
  for (int i = 0; i < c->num_outputs(); ++i) {
    c->set_output(i, c->Vector(InferenceContext::kUnknownDim));
  }
  return absl::OkStatus();
}

}  // namespace

REGISTER_OP("TfSparseSplit>SparseSplitRewriteConfig")
    .Input("enable: bool")
    .Input("threshold: float")
    .Input("min_flops: double")
    .Input("ops: string")
    .Input("producers: string")
    .Output("active_ops: string")
    .SetIsStateful()
    .SetShapeFn(UnknownVectorOutputs)
    .Doc(R"doc(
Configures the sparse-split graph-rewrite pass for graphs optimized from now on.

enable: bool scalar; false switches the pass off.
threshold: float32 scalar given to every SparseSplit* op the pass adds
  (negative: automatic).
min_flops: float64 scalar; nodes with fewer statically known FLOPs are left alone.
ops: string vector of source op types to rewrite ("MatMul", "Conv2D",
  "Conv2DBackpropFilter").
producers: string vector of activation producer op types ("Relu", ...,
  "Dropout" for the dropout pattern, "Input" for graph inputs, "*" for any).
active_ops: string vector of source op types whose replacement op is registered.
)doc");

REGISTER_OP("TfSparseSplit>SparseSplitRewriteCounters")
    .Input("reset: bool")
    .Output("op_types: string")
    .Output("counts: int64")
    .SetIsStateful()
    .SetShapeFn(UnknownVectorOutputs)
    .Doc(R"doc(
Nodes rewritten by the sparse-split pass since load (or the last reset), by source op type.

reset: bool scalar; if true the counters are zeroed after being read.
op_types: string vector [n].
counts: int64 vector [n].
)doc");

REGISTER_OP("TfSparseSplit>SparseSplitRewriteLog")
    .Input("clear: bool")
    .Output("records: string")
    .SetIsStateful()
    .SetShapeFn(UnknownVectorOutputs)
    .Doc(R"doc(
What the sparse-split pass did: one tab-separated key=value record per node it rewrote or declined.

clear: bool scalar; if true the log is emptied after being read.
records: string vector.
)doc");

REGISTER_OP("TfSparseSplit>SparseSplitRewriteMissed")
    .Output("records: string")
    .SetIsStateful()
    .SetShapeFn(UnknownVectorOutputs)
    .Doc(R"doc(
Function graphs with MatMul/Conv2D nodes instantiated while the pass was off, since the last call.

records: string vector, one "action=missed" log record per function graph;
  reading empties the list (the log keeps them).
)doc");

REGISTER_OP("TfSparseSplit>SparseSplitRewriteDryRun")
    .Input("graph_def: string")
    .Input("min_flops: double")
    .Input("ops: string")
    .Input("producers: string")
    .Output("records: string")
    .SetIsStateful()
    .SetShapeFn(UnknownVectorOutputs)
    .Doc(R"doc(
What the sparse-split pass would do to a graph, without changing it.

graph_def: string scalar, a serialized GraphDef (its function library is used
  to look into called functions).
min_flops, ops, producers: as in SparseSplitRewriteConfig.
records: string vector, one tab-separated key=value record per MatMul/Conv2D
  node: action=would_rewrite or action=declined (with reason), op, name,
  producer.
)doc");

namespace {

absl::Status ScalarInput(tf::OpKernelContext* ctx, int i, const char* name) {
  if (!tf::TensorShapeUtils::IsScalar(ctx->input(i).shape())) {
    return tf::errors::InvalidArgument(name, " must be a scalar, got shape ",
                                       ctx->input(i).shape().DebugString());
  }
  return absl::OkStatus();
}

std::set<std::string> StringSet(const tf::Tensor& t) {
  std::set<std::string> out;
  auto v = t.flat<tf::tstring>();
  for (int64_t i = 0; i < v.size(); ++i) out.insert(std::string(v(i)));
  return out;
}

// Reads the inputs `min_flops` (a float64 scalar, input i), `ops` and
// `producers` (string vectors, inputs i + 1 and i + 2) that both the config
// and the dry-run op take into cfg.
absl::Status NodeFilterInputs(tf::OpKernelContext* ctx, int i,
                              RewriteConfig* cfg) {
  TF_RETURN_IF_ERROR(ScalarInput(ctx, i, "min_flops"));
  const tf::Tensor& ops = ctx->input(i + 1);
  const tf::Tensor& producers = ctx->input(i + 2);
  if (ops.dims() != 1 || producers.dims() != 1) {
    return tf::errors::InvalidArgument(
        "ops and producers must be vectors, got shapes ",
        ops.shape().DebugString(), " and ", producers.shape().DebugString());
  }
  cfg->min_flops = ctx->input(i).scalar<double>()();
  cfg->ops = StringSet(ops);
  cfg->producers = StringSet(producers);
  return absl::OkStatus();
}

void StringVector(tf::OpKernelContext* ctx, int index,
                  const std::vector<std::string>& values) {
  tf::Tensor* out = nullptr;
  OP_REQUIRES_OK(ctx, ctx->allocate_output(
                          index, tf::TensorShape({(int64_t)values.size()}), &out));
  auto v = out->flat<tf::tstring>();
  for (size_t i = 0; i < values.size(); ++i) v(i) = values[i];
}

class SparseSplitRewriteConfigOp : public tf::OpKernel {
 public:
  using tf::OpKernel::OpKernel;
  void Compute(tf::OpKernelContext* ctx) override {
    OP_REQUIRES_OK(ctx, ScalarInput(ctx, 0, "enable"));
    OP_REQUIRES_OK(ctx, ScalarInput(ctx, 1, "threshold"));
    RewriteConfig cfg;
    OP_REQUIRES_OK(ctx, NodeFilterInputs(ctx, 2, &cfg));
    cfg.enabled = ctx->input(0).scalar<bool>()();
    cfg.threshold = ctx->input(1).scalar<float>()();
    OP_REQUIRES(ctx, !(cfg.threshold > 1.0f) && cfg.threshold == cfg.threshold,
                tf::errors::InvalidArgument(
                    "threshold must be in [0, 1] or negative, got ", cfg.threshold));
    SetConfig(cfg);
    StringVector(ctx, 0, ActiveSourceOps());
  }
};

class SparseSplitRewriteCountersOp : public tf::OpKernel {
 public:
  using tf::OpKernel::OpKernel;
  void Compute(tf::OpKernelContext* ctx) override {
    OP_REQUIRES_OK(ctx, ScalarInput(ctx, 0, "reset"));
    auto counters = Counters();
    if (ctx->input(0).scalar<bool>()()) ResetCounters();
    std::vector<std::string> names;
    tf::Tensor* counts = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            1, tf::TensorShape({(int64_t)counters.size()}), &counts));
    auto c = counts->flat<int64_t>();
    int64_t i = 0;
    for (const auto& kv : counters) {
      names.push_back(kv.first);
      c(i++) = kv.second;
    }
    StringVector(ctx, 0, names);
  }
};

class SparseSplitRewriteLogOp : public tf::OpKernel {
 public:
  using tf::OpKernel::OpKernel;
  void Compute(tf::OpKernelContext* ctx) override {
    OP_REQUIRES_OK(ctx, ScalarInput(ctx, 0, "clear"));
    StringVector(ctx, 0, LogRecords(ctx->input(0).scalar<bool>()()));
  }
};

class SparseSplitRewriteMissedOp : public tf::OpKernel {
 public:
  using tf::OpKernel::OpKernel;
  void Compute(tf::OpKernelContext* ctx) override {
    StringVector(ctx, 0, TakeMissed());
  }
};

class SparseSplitRewriteDryRunOp : public tf::OpKernel {
 public:
  using tf::OpKernel::OpKernel;
  void Compute(tf::OpKernelContext* ctx) override {
    OP_REQUIRES_OK(ctx, ScalarInput(ctx, 0, "graph_def"));
    RewriteConfig cfg;
    OP_REQUIRES_OK(ctx, NodeFilterInputs(ctx, 1, &cfg));
    tf::GraphDef graph_def;
    OP_REQUIRES(ctx,
                graph_def.ParseFromString(
                    std::string(ctx->input(0).scalar<tf::tstring>()())),
                tf::errors::InvalidArgument(
                    "graph_def is not a serialized GraphDef"));
    cfg.enabled = true;
    std::vector<std::string> records;
    OP_REQUIRES_OK(ctx, DryRun(graph_def, cfg, &records));
    StringVector(ctx, 0, records);
  }
};

}  // namespace

REGISTER_KERNEL_BUILDER(Name("TfSparseSplit>SparseSplitRewriteMissed").Device(tf::DEVICE_CPU),
                        SparseSplitRewriteMissedOp);
REGISTER_KERNEL_BUILDER(Name("TfSparseSplit>SparseSplitRewriteDryRun").Device(tf::DEVICE_CPU),
                        SparseSplitRewriteDryRunOp);
REGISTER_KERNEL_BUILDER(Name("TfSparseSplit>SparseSplitRewriteConfig").Device(tf::DEVICE_CPU),
                        SparseSplitRewriteConfigOp);
REGISTER_KERNEL_BUILDER(Name("TfSparseSplit>SparseSplitRewriteCounters").Device(tf::DEVICE_CPU),
                        SparseSplitRewriteCountersOp);
REGISTER_KERNEL_BUILDER(Name("TfSparseSplit>SparseSplitRewriteLog").Device(tf::DEVICE_CPU),
                        SparseSplitRewriteLogOp);

}  // namespace rewrite
}  // namespace tf_sparse_split
