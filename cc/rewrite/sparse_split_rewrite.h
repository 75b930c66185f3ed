// Graph-rewrite pass: replaces dense ops whose activation input can be sparse
// (a ReLU output, a dropout result, ...) with their sparse-split versions,
// e.g. MatMul -> SparseSplitMatMul (K.-Y. Peng, "Adaptive runtime exploiting
// sparsity in tensor of deep learning on heterogeneous systems", NTU 2017).
//
// The pass is a tensorflow::GraphOptimizationPass registered in the
// PRE_PLACEMENT grouping (after the lowering of functional control flow), so
// it sees every tf.function / SavedModel function graph TensorFlow
// instantiates once the op library is loaded. It is off until configured on
// (SparseSplitRewriteConfig op, called from tf_sparse_split/rewrite.py).
//
// Contract:
//  * A candidate node is replaced only when the replacement computes the same
//    values (to float rounding): same inputs, same attrs, a kernel for the
//    node's device, no XLA / TPU involvement. Anything else is left alone and
//    the reason is logged at VLOG(1) and into the rewrite log.
//  * The new node keeps the original name, requested and assigned device,
//    control inputs and every consumer edge (data and control); its extra
//    `stats` output is unused. A fused replacement (the node with its bias
//    add and ReLU/ReLU6, each the only consumer of the value before it)
//    takes the last absorbed node's name, consumers and control edges. An
//    input-gradient MatMul feeding only ReluGrad(., F) becomes a
//    SparseSplitSddmm masked by F (same values: ReluGrad zeroes the rest). The threshold input is a new scalar float32
//    Const "<name>/tfss_threshold[_N]" on the same device, with a control
//    edge from the activation's producer (so it lives in the same
//    control-flow frame).
//  * Errors never reach the user's graph: the pass works on a copy and
//    installs it only when every replacement succeeded.
#ifndef TF_SPARSE_SPLIT_CC_REWRITE_SPARSE_SPLIT_REWRITE_H_
#define TF_SPARSE_SPLIT_CC_REWRITE_SPARSE_SPLIT_REWRITE_H_

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "tensorflow/core/common_runtime/optimization_registry.h"
#include "tensorflow/core/framework/graph.pb.h"

namespace tf_sparse_split {
namespace rewrite {

// What the pass does; set from Python through SparseSplitRewriteConfig.
struct RewriteConfig {
  bool enabled = false;
  // Threshold given to every replacement (negative: the op chooses).
  float threshold = -1.0f;
  // Candidates whose statically known FLOP count is below this are skipped
  // (unknown dimensions never cause a skip).
  double min_flops = 0.0;
  // Source op types to rewrite ("MatMul", "Conv2D", "Conv2DBackpropFilter";
  // opt-in "Conv2DBackpropInput").
  std::set<std::string> ops = {"MatMul", "Conv2D", "Conv2DBackpropFilter"};
  // Producer op types of the activation input that make it "sparse";
  // "Dropout" stands for the dropout pattern, "Input" for the graph's
  // inputs (_Arg, Placeholder, IteratorGetNext: data known to be sparse,
  // e.g. image pixels), "*" for any producer.
  std::set<std::string> producers = {"Relu", "Relu6", "ReluGrad", "Relu6Grad",
                                     "Dropout"};
};

// One entry of the rewrite table: source op -> sparse-split op.
struct RewriteEntry {
  const char* source_op;   // e.g. "MatMul"
  const char* target_op;   // e.g. "TfSparseSplit>SparseSplitMatMul"
  int activation_input;    // index of the input whose zeros are exploited
  int num_data_inputs;     // data inputs of source_op, copied in order
  // The threshold input goes right after the copied data inputs.
};

// The table; entries whose target op is not registered are inactive.
const std::vector<RewriteEntry>& RewriteTable();
// Source op types of the table entries that are active right now.
std::vector<std::string> ActiveSourceOps();

void SetConfig(const RewriteConfig& config);
RewriteConfig GetConfig();

// Nodes rewritten since the library was loaded (or the last reset), by
// source op type.
std::map<std::string, int64_t> Counters();
void ResetCounters();

// Records of what the pass did (one string per rewritten or declined node,
// "key=value" fields separated by tabs), oldest first; bounded in size.
std::vector<std::string> LogRecords(bool clear);

// Records ("action=missed", one per function graph) of the function graphs
// holding MatMul/Conv2D nodes that TensorFlow instantiated while the pass was
// off (they keep their ops), since the last call; they are in the log too.
std::vector<std::string> TakeMissed();

// Dry run: the pass's decision for every MatMul/Conv2D node of `graph_def`
// (a plain graph on this process's CPU, `cfg.enabled` ignored), without
// changing anything. One record per node, fields as in the log:
// action=would_rewrite (op, new_op, name, producer) or action=declined (op,
// name, reason, producer = the activation's producer when it was found),
// plus declined records for nodes inside XLA-compiled callees.
absl::Status DryRun(const ::tensorflow::GraphDef& graph_def,
                    const RewriteConfig& cfg, std::vector<std::string>* records);

class SparseSplitRewritePass : public ::tensorflow::GraphOptimizationPass {
 public:
  absl::Status Run(
      const ::tensorflow::GraphOptimizationPassOptions& options) override;
};

}  // namespace rewrite
}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_REWRITE_SPARSE_SPLIT_REWRITE_H_
