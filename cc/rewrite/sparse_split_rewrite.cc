// The sparse-split graph-rewrite pass (see sparse_split_rewrite.h).
#include "cc/rewrite/sparse_split_rewrite.h"

#include <algorithm>
#include <array>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/match.h"
#include "tensorflow/core/common_runtime/device_set.h"
#include "tensorflow/core/framework/graph.pb.h"
#include "tensorflow/core/common_runtime/graph_constructor.h"
#include "tensorflow/core/common_runtime/shape_refiner.h"
#include "tensorflow/core/framework/device.h"
#include "tensorflow/core/framework/function.h"
#include "tensorflow/core/framework/node_def_util.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/graph/algorithm.h"
#include "tensorflow/core/graph/graph.h"
#include "tensorflow/core/platform/logging.h"
#include "tensorflow/core/util/device_name_utils.h"

namespace tf_sparse_split {
namespace rewrite {

namespace tf = ::tensorflow;

namespace {

constexpr size_t kMaxLogRecords = 100000;
constexpr size_t kMaxMissed = 1000;

struct State {
  std::mutex mu;
  RewriteConfig config;
  std::map<std::string, int64_t> counters;
  std::deque<std::string> log;
  std::deque<std::string> missed;  // RecordMissed, until TakeMissed
};

State& GlobalState() {
  static State* state = new State;
  return *state;
}

void AppendLog(std::vector<std::string>* records) {
  State& s = GlobalState();
  std::lock_guard<std::mutex> lock(s.mu);
  for (auto& r : *records) {
    s.log.push_back(std::move(r));
    if (s.log.size() > kMaxLogRecords) s.log.pop_front();
  }
}

const tf::OpDef* LookUpOp(const std::string& name) {
  const tf::OpDef* def = nullptr;
  if (!tf::OpRegistry::Global()->LookUpOpDef(name, &def).ok()) return nullptr;
  return def;
}

// True if `n` is a Const (or ZerosLike) whose value is all zeros.
bool IsZeroConst(const tf::Node* n) {
  if (n->type_string() == "ZerosLike") return true;
  if (n->type_string() != "Const") return false;
  const tf::TensorProto* proto = nullptr;
  if (!tf::TryGetNodeAttr(n->attrs(), "value", &proto) || proto == nullptr) {
    return false;
  }
  tf::Tensor t;
  if (!t.FromProto(*proto)) return false;
  if (t.NumElements() > 4096) return false;
  switch (t.dtype()) {
    case tf::DT_FLOAT: {
      auto v = t.flat<float>();
      for (int64_t i = 0; i < v.size(); ++i) if (v(i) != 0.0f) return false;
      return true;
    }
    case tf::DT_DOUBLE: {
      auto v = t.flat<double>();
      for (int64_t i = 0; i < v.size(); ++i) if (v(i) != 0.0) return false;
      return true;
    }
    default:
      return false;
  }
}

const tf::Node* InputNode(const tf::Node* n, int index, int* port) {
  const tf::Edge* e = nullptr;
  if (!n->input_edge(index, &e).ok() || e == nullptr) return nullptr;
  if (port != nullptr) *port = e->src_output();
  return e->src();
}

// The dropout pattern of tf.nn.dropout / Keras: SelectV2(mask, x*scale, 0),
// or x * Cast(bool mask).
bool IsDropout(const tf::Node* n) {
  const std::string& op = n->type_string();
  if (op == "SelectV2" || op == "Select") {
    const tf::Node* t = InputNode(n, 1, nullptr);
    const tf::Node* e = InputNode(n, 2, nullptr);
    return (t != nullptr && IsZeroConst(t)) || (e != nullptr && IsZeroConst(e));
  }
  if (op == "Mul") {
    for (int i = 0; i < 2; ++i) {
      const tf::Node* in = InputNode(n, i, nullptr);
      if (in == nullptr || in->type_string() != "Cast") continue;
      tf::DataType src_t;
      if (tf::TryGetNodeAttr(in->attrs(), "SrcT", &src_t) &&
          src_t == tf::DT_BOOL) {
        return true;
      }
    }
  }
  return false;
}

// ---------------------------------------------------------------------------
// Sparse producers, seen through zero-preserving ops.
//
// An op is "look-through" when its output is zero wherever the data it takes
// from its look-through inputs is zero, so a sparse activation stays sparse:
//  * identities, casts and layout changes (Identity, Reshape -- Keras
//    Flatten --, Transpose, ExpandDims, Squeeze, SpaceToDepth, ...);
//  * subsets and tilings: Slice, StridedSlice, GatherV2 (of the params), Tile;
//  * zero padding: Pad, and PadV2 whose constant value is a zero Const
//    (Keras ZeroPadding2D), not MirrorPad;
//  * ConcatV2 / Concat / Pack when every value input is sparse;
//  * pooling: MaxPool and AvgPool. On the non-negative outputs of
//    ReLU/ReLU6 both give 0 exactly where the whole window is 0 (max and
//    mean of non-negative values), so they keep the all-zero regions of the
//    feature map; isolated zeros inside a window with a nonzero are lost.
//    That is less sparsity than the input had, but every remaining zero is
//    one the op can skip, and the op measures the density per call and
//    keeps the dense kernel where too little is left (the answer is the same
//    either way). On a signed input (dropout of a linear layer) they keep
//    at least the all-zero windows.
// The look-through inputs of `n` reached from its output `port` (empty: not
// look-through).
std::vector<int> LookThroughInputs(const tf::Node* n, int port) {
  static const std::set<std::string>* unary = new std::set<std::string>{
      "Identity", "Snapshot", "StopGradient", "PreventGradient", "Enter",
      "Exit", "Switch", "RefSwitch", "Reshape", "Cast", "Transpose",
      "EnsureShape", "CheckNumerics", "ExpandDims", "Squeeze",
      "SpaceToDepth", "DepthToSpace", "Slice", "StridedSlice", "GatherV2",
      "Gather", "Tile", "Pad", "MaxPool", "MaxPoolV2", "AvgPool"};
  const std::string& op = n->type_string();
  if (unary->count(op)) return {0};
  if (op == "IdentityN") return {port};
  if (op == "PadV2") {
    const tf::Node* value = InputNode(n, 2, nullptr);
    if (value != nullptr && IsZeroConst(value)) return {0};
    return {};
  }
  if (op == "ConcatV2" || op == "Concat" || op == "Pack") {
    int num = 0;
    if (!tf::TryGetNodeAttr(n->attrs(), "N", &num) || num <= 0) return {};
    std::vector<int> out;
    const int first = op == "Concat" ? 1 : 0;  // Concat: axis first
    for (int i = 0; i < num; ++i) out.push_back(first + i);
    return out;
  }
  return {};
}

// Where an activation's zeros come from: the listed producers found (in
// order, without repeats; "Dropout" for the dropout pattern), the
// look-through ops passed on the way, and, when it is not sparse, the op
// type that stopped the search.
struct SparseTrace {
  std::vector<std::string> producers;
  std::vector<std::string> via;
  std::string seen;
  int visited = 0;
};

void AddUnique(std::vector<std::string>* v, const std::string& s) {
  if (std::find(v->begin(), v->end(), s) == v->end()) v->push_back(s);
}

// True if output `port` of `src` is a sparse activation: a listed producer
// ("Input" standing for a graph's inputs: _Arg, Placeholder,
// IteratorGetNext), or a look-through op all of whose look-through inputs
// are sparse.
bool TraceSparse(const tf::Node* src, int port,
                 const std::set<std::string>& producers, int depth,
                 SparseTrace* t) {
  if (src == nullptr) {
    t->seen = "<none>";
    return false;
  }
  const std::string& op = src->type_string();
  if (producers.count(op)) {
    AddUnique(&t->producers, op);
    return true;
  }
  if (producers.count("Dropout") && IsDropout(src)) {
    AddUnique(&t->producers, "Dropout");
    return true;
  }
  if (producers.count("Input") &&
      (op == "_Arg" || op == "Placeholder" || op == "IteratorGetNext" ||
       op == "IteratorGetNextSync")) {
    AddUnique(&t->producers, "Input");
    return true;
  }
  const std::vector<int> inputs = LookThroughInputs(src, port);
  // Bounded search: a chain of 32 ops, 256 nodes in all (concat trees).
  if (inputs.empty() || depth >= 32 || ++t->visited > 256) {
    t->seen = op;
    return false;
  }
  AddUnique(&t->via, op);
  for (int i : inputs) {
    int p = 0;
    const tf::Node* in = InputNode(src, i, &p);
    if (!TraceSparse(in, p, producers, depth + 1, t)) return false;
  }
  return true;
}

// The producer under which input `input` of `n` counts as sparse ("Relu",
// "Dropout", "Relu+Dropout" for a concat of both, "any:<op>" with producers
// "*"), or "" with t->seen set to what was found.
std::string SparseProducer(const tf::Node* n, int input,
                           const std::set<std::string>& producers,
                           SparseTrace* t) {
  int port = 0;
  const tf::Node* src = InputNode(n, input, &port);
  if (TraceSparse(src, port, producers, 0, t)) {
    return absl::StrJoin(t->producers, "+");
  }
  if (producers.count("*")) return absl::StrCat("any:", t->seen);
  return "";
}

std::string DeviceTypeOf(const std::string& device) {
  tf::DeviceNameUtils::ParsedName parsed;
  if (!tf::DeviceNameUtils::ParseFullName(device, &parsed) &&
      !tf::DeviceNameUtils::ParseLocalName(device, &parsed)) {
    return "";
  }
  return parsed.has_type ? parsed.type : "";
}

bool HasXlaOrTpuAttr(const tf::Node* n, std::string* which) {
  for (const auto& kv : n->attrs()) {
    const std::string& k = kv.first;
    if (absl::StartsWith(k, "_Xla") || absl::StartsWith(k, "_xla") ||
        absl::StartsWith(k, "_tpu") || absl::StartsWith(k, "_XLA")) {
      *which = k;
      return true;
    }
  }
  return false;
}

// Rewritten nodes' statistics output has no consumer, so they ask for the
// cheap analysis (the op counts a sample, or nothing, on calls that stay
// dense) where the target op has the `full_stats` attr.
void AskCheapAnalysis(const tf::OpDef& target, tf::NodeDef* def) {
  for (const auto& a : target.attr()) {
    if (a.name() == "full_stats") {
      tf::AddNodeAttr("full_stats", false, def);
      return;
    }
  }
}

// The start of a replacement's NodeDef: `name`, `op`, and the replaced
// node's requested device and debug info.
void StartReplacementDef(const tf::Node* n, const std::string& name,
                         const std::string& op, tf::NodeDef* def) {
  def->Clear();
  def->set_name(name);
  def->set_op(op);
  def->set_device(n->requested_device());
  *def->mutable_experimental_debug_info() = n->def().experimental_debug_info();
}

// Whether a private attr (leading '_') of the replaced node is carried over:
// all but the inferred _output_shapes, which the replacement's own shape
// function gives.
bool CarriesPrivateAttr(const std::string& attr) {
  return absl::StartsWith(attr, "_") && attr != "_output_shapes";
}

// The end of a replacement's NodeDef: the cheap analysis, the target's
// defaults, validation against its OpDef.
absl::Status FinishReplacementDef(const tf::OpDef& target, tf::NodeDef* def) {
  AskCheapAnalysis(target, def);
  tf::AddDefaultsToNodeDef(target, def);
  return tf::ValidateNodeDef(*def, target);
}

// Builds the NodeDef of the replacement: same name, device, attrs that the
// target op declares (T, transpose_*, strides, ...), and private attrs other
// than _output_shapes. With `num_bias` = 1 the replacement also takes the
// bias (after the threshold) and applies `activation` (the fused form; the
// node then takes `name`, the last absorbed node's).
absl::Status BuildTargetDef(const tf::Node* n, const RewriteEntry& e,
                            const tf::OpDef& target, tf::NodeDef* def,
                            int num_bias = 0,
                            const std::string& activation = "",
                            const std::string& name = "") {
  StartReplacementDef(n, name.empty() ? n->name() : name, e.target_op, def);
  for (int i = 0; i < e.num_data_inputs; ++i) def->add_input(absl::StrCat("in", i));
  def->add_input("threshold");
  for (int i = 0; i < num_bias; ++i) def->add_input("bias");
  std::set<std::string> declared;
  for (const auto& a : target.attr()) declared.insert(a.name());
  for (const auto& kv : n->attrs()) {
    if (declared.count(kv.first) || CarriesPrivateAttr(kv.first)) {
      (*def->mutable_attr())[kv.first] = kv.second;
    }
  }
  if (num_bias > 0) {
    tf::AddNodeAttr("num_bias", num_bias, def);
    tf::AddNodeAttr("activation", activation, def);
  }
  return FinishReplacementDef(target, def);
}

constexpr char kSddmmOp[] = "TfSparseSplit>SparseSplitSddmm";

// The SDDMM replacing dA = MatMul(dY, B, transpose_b=tb) whose result only
// feeds ReluGrad(., mask): inputs mask, x = dY, b = B, threshold;
// SparseSplitSddmm computes x * op'(b)^T, so op'(b)^T = op_tb(B), i.e.
// its transpose_b is !tb.
absl::Status BuildSddmmDef(const tf::Node* n, const tf::OpDef& target,
                           tf::NodeDef* def) {
  StartReplacementDef(n, n->name(), kSddmmOp, def);
  for (const char* in : {"mask", "x", "b", "threshold"}) def->add_input(in);
  bool tb = false;
  tf::TryGetNodeAttr(n->attrs(), "transpose_b", &tb);
  tf::DataType dtype = tf::DT_INVALID;
  TF_RETURN_IF_ERROR(tf::GetNodeAttr(n->attrs(), "T", &dtype));
  tf::AddNodeAttr("T", dtype, def);
  tf::AddNodeAttr("transpose_b", !tb, def);
  for (const auto& kv : n->attrs()) {
    if (CarriesPrivateAttr(kv.first)) (*def->mutable_attr())[kv.first] = kv.second;
  }
  return FinishReplacementDef(target, def);
}

// How a candidate is replaced.
enum class Kind {
  kReplace,  // the node alone, 1:1
  kFuse,     // the node and its bias add (+ ReLU/ReLU6): one op with epilogue
  kSddmm,    // dA = dY op(B) feeding only ReluGrad(., mask): masked SDDMM
};

const char* KindName(Kind k) {
  switch (k) {
    case Kind::kReplace: return "replace";
    case Kind::kFuse: return "fuse";
    case Kind::kSddmm: return "sddmm";
  }
  return "?";
}

// What the pass decided for one source-op node. `entry` and `target_def`
// are set when it would be rewritten (`reason` empty).
struct Candidate {
  const tf::Node* node = nullptr;
  std::string name;
  std::string op;
  const RewriteEntry* entry = nullptr;
  std::string producer;
  std::string via;     // look-through ops between producer and node
  std::string reason;  // non-empty: declined, and why
  tf::NodeDef target_def;
  Kind kind = Kind::kReplace;
  // kFuse: the absorbed nodes in order (bias add, then the activation), their
  // op types, the bias add's input holding the bias, whether the bias must
  // be reshaped to a vector first ([1, ..., 1, N] operand of an Add), and
  // the fused activation ("none", "relu", "relu6").
  std::vector<std::string> fused_names;
  std::vector<std::string> fused_ops;
  int bias_input = 1;
  bool reshape_bias = false;
  std::string activation = "none";
  // Why the node was not fused with what follows it (kReplace; "" when
  // nothing followed that could be fused).
  std::string unfused;
  // kSddmm: a ReluGrad consumer whose input 1 is the mask.
  std::string mask_consumer;
  bool rewrite() const { return reason.empty(); }
  // Name of the node that replaces the candidate (the last absorbed node's).
  std::string new_name() const {
    return fused_names.empty() ? name : fused_names.back();
  }
};

std::string FunctionName(const tf::GraphOptimizationPassOptions& o) {
  return o.function_def != nullptr ? o.function_def->signature().name() : "";
}

// Estimated FLOPs from static shapes; -1 if a dimension is unknown.
double StaticFlops(tf::ShapeRefiner* refiner, const tf::Node* n,
                   const RewriteEntry& e) {
  tf::shape_inference::InferenceContext* c = refiner->GetContext(n);
  if (c == nullptr) return -1;
  auto dim = [c](tf::shape_inference::ShapeHandle s, int i) -> int64_t {
    if (!c->RankKnown(s) || i >= c->Rank(s)) return -1;
    return c->Value(c->Dim(s, i));
  };
  if (std::string(e.source_op) == "MatMul") {
    bool ta = false, tb = false;
    tf::TryGetNodeAttr(n->attrs(), "transpose_a", &ta);
    tf::TryGetNodeAttr(n->attrs(), "transpose_b", &tb);
    int64_t m = dim(c->input(0), ta ? 1 : 0), k = dim(c->input(0), ta ? 0 : 1);
    int64_t nn = dim(c->input(1), tb ? 0 : 1);
    if (m < 0 || k < 0 || nn < 0) return -1;
    return 2.0 * m * k * nn;
  }
  if (std::string(e.source_op) == "Conv2DBackpropInput") {
    // 2 * |dY| * KH * KW * C_in, as the filter gradient.
    tf::shape_inference::ShapeHandle dy = c->input(2), f = c->input(1);
    if (!c->FullyDefined(dy) || !c->FullyDefined(f) || c->Rank(f) != 4) return -1;
    double dy_elems = 1;
    for (int i = 0; i < c->Rank(dy); ++i) dy_elems *= c->Value(c->Dim(dy, i));
    return 2.0 * dy_elems * c->Value(c->Dim(f, 0)) * c->Value(c->Dim(f, 1)) *
           c->Value(c->Dim(f, 2));
  }
  if (std::string(e.source_op) == "Conv2DBackpropFilter") {
    // 2 * |dY| * KH * KW * C_in: every output-gradient value meets a filter
    // window of the input.
    tf::shape_inference::ShapeHandle dy = c->input(2), f = c->output(0);
    if (!c->FullyDefined(dy) || !c->FullyDefined(f) || c->Rank(f) != 4) return -1;
    double dy_elems = 1;
    for (int i = 0; i < c->Rank(dy); ++i) dy_elems *= c->Value(c->Dim(dy, i));
    return 2.0 * dy_elems * c->Value(c->Dim(f, 0)) * c->Value(c->Dim(f, 1)) *
           c->Value(c->Dim(f, 2));
  }
  // Convolution-like: 2 * |output| * (filter elements / output channels).
  tf::shape_inference::ShapeHandle out = c->output(0), f = c->input(1);
  if (!c->FullyDefined(out) || !c->FullyDefined(f)) return -1;
  double out_elems = 1, f_elems = 1;
  for (int i = 0; i < c->Rank(out); ++i) out_elems *= c->Value(c->Dim(out, i));
  for (int i = 0; i < c->Rank(f) - 1; ++i) f_elems *= c->Value(c->Dim(f, i));
  return 2.0 * out_elems * f_elems;
}

// What the pass knows about the graph as a whole.
struct GraphContext {
  std::string function;      // function graph's name ("" for a plain graph)
  std::string graph_reason;  // non-empty: every candidate is declined for it
  bool has_other_device = false;  // a non-CPU device we have no kernel for
  std::string other_device;
  const tf::Device* default_function_device = nullptr;
  // Function library of the graph (options.flib_def), or null to use the
  // graph's own.
  const tf::FunctionLibraryDefinition* flib = nullptr;
};

GraphContext MakeContext(const tf::GraphOptimizationPassOptions& options) {
  GraphContext ctx;
  ctx.function = FunctionName(options);
  if (options.function_def != nullptr) {
    for (const char* a : {"_XlaMustCompile", "_XlaCompile"}) {
      auto it = options.function_def->attr().find(a);
      if (it != options.function_def->attr().end() && it->second.b()) {
        ctx.graph_reason = absl::StrCat("function is compiled by XLA (", a,
                                        "=true, e.g. jit_compile=True)");
      }
    }
  }
  if (ctx.graph_reason.empty() && absl::StartsWith(ctx.function, "__wrapped__")) {
    // A single eager op run as a function (TF's run_eager_op_as_function):
    // not a user graph; its input is an _Arg, so only producers="any" would
    // match, and then every eager tf.matmul would change op.
    ctx.graph_reason = "single eager op run as a function";
  }
  if (options.device_set != nullptr) {
    for (const tf::Device* d : options.device_set->devices()) {
      const std::string& t = d->device_type();
      if (t == "TPU" || t == "TPU_SYSTEM") ctx.graph_reason = "TPU system";
      if (t != tf::DEVICE_CPU) {
        ctx.has_other_device = true;
        ctx.other_device = t;
      }
    }
  }
  ctx.default_function_device = options.default_function_device;
  ctx.flib = options.flib_def;
  return ctx;
}

const RewriteEntry* EntryFor(const tf::Node* n) {
  for (const auto& e : RewriteTable()) {
    if (n->type_string() == e.source_op) return &e;
  }
  return nullptr;
}

// Lazily built shape refiner over `g` (static shapes for min_flops and for
// the bias operand of an Add).
tf::ShapeRefiner* RefinerFor(const tf::Graph& g,
                             std::unique_ptr<tf::ShapeRefiner>* refiner) {
  if (*refiner == nullptr) {
    *refiner = std::make_unique<tf::ShapeRefiner>(g.versions(), g.op_registry());
    std::vector<tf::Node*> order;
    tf::GetReversePostOrder(g, &order);
    for (tf::Node* m : order) (*refiner)->AddNode(m).IgnoreError();
  }
  return refiner->get();
}

// Static shape of output `port` of `node` (-1 for unknown dimensions);
// false if its rank is unknown. Shape inference first, then the node's
// `_output_shapes` attribute; a variable read (ReadVariableOp of a
// function's resource _Arg or of a VarHandleOp) takes the variable's shape
// from the handle's attributes when shape inference does not know it.
bool StaticShape(tf::ShapeRefiner* refiner, const tf::Node* node, int port,
                 std::vector<int64_t>* dims) {
  dims->clear();
  tf::shape_inference::InferenceContext* c = refiner->GetContext(node);
  if (c != nullptr && port < c->num_outputs() && c->RankKnown(c->output(port))) {
    tf::shape_inference::ShapeHandle s = c->output(port);
    for (int i = 0; i < c->Rank(s); ++i) dims->push_back(c->Value(c->Dim(s, i)));
    return true;
  }
  // A function's _Arg carries its traced shape (tf.function's arg_attr).
  const tf::AttrValue* shapes = node->attrs().Find("_output_shapes");
  if (shapes != nullptr && port < shapes->list().shape_size() &&
      !shapes->list().shape(port).unknown_rank()) {
    for (const auto& d : shapes->list().shape(port).dim()) {
      dims->push_back(d.size());
    }
    return true;
  }
  if (node->type_string() != "ReadVariableOp") return false;
  const tf::Node* handle = InputNode(node, 0, nullptr);
  if (handle == nullptr) return false;
  const tf::TensorShapeProto* proto = nullptr;
  const tf::AttrValue* v = nullptr;
  if (handle->type_string() == "VarHandleOp") {
    v = handle->attrs().Find("shape");
    if (v != nullptr) proto = &v->shape();
  } else if (handle->type_string() == "_Arg") {
    v = handle->attrs().Find("_handle_shapes");
    if (v != nullptr && v->list().shape_size() == 1) proto = &v->list().shape(0);
  }
  if (proto == nullptr || proto->unknown_rank()) return false;
  for (const auto& d : proto->dim()) dims->push_back(d.size());
  return true;
}

bool IsShapeLike(const tf::Node* n) {
  const std::string& op = n->type_string();
  return op == "Shape" || op == "Rank" || op == "Size";
}

// The data consumers of output 0 of `n` other than Shape/Rank/Size (which
// read only its shape, unchanged by a bias add or activation), or false if
// `n` has control outputs other than to the sink.
bool ValueConsumers(const tf::Node* n, std::vector<const tf::Edge*>* out) {
  out->clear();
  for (const tf::Edge* e : n->out_edges()) {
    if (e->IsControlEdge()) {
      if (!e->dst()->IsSink()) return false;
      continue;
    }
    if (IsShapeLike(e->dst())) continue;
    out->push_back(e);
  }
  return true;
}

bool SamePlacement(const tf::Node* a, const tf::Node* b) {
  return a->requested_device() == b->requested_device() &&
         a->assigned_device_name() == b->assigned_device_name();
}

bool AllowsString(const tf::OpDef& op, const char* attr, const std::string& v) {
  for (const auto& a : op.attr()) {
    if (a.name() != attr) continue;
    for (const auto& s : a.allowed_values().list().s()) {
      if (s == v) return true;
    }
  }
  return false;
}

// Fills cand's kFuse fields when `n` (MatMul/Conv2D) is followed by a bias
// add (BiasAdd NHWC, or Add/AddV2 with a [N] / [1, ..., 1, N] operand) and
// optionally Relu/Relu6, each the only consumer of the value before it (as
// Grappler's remapper requires for _FusedMatMul / _FusedConv2D). Returns
// false (and why in cand->unfused when something could have been fused)
// when nothing is fused.
bool FindEpilogue(const tf::Graph& g, const tf::Node* n,
                  const tf::OpDef& target,
                  std::unique_ptr<tf::ShapeRefiner>* refiner, Candidate* cand) {
  bool has_num_bias = false;
  for (const auto& a : target.attr()) has_num_bias |= a.name() == "num_bias";
  std::vector<const tf::Edge*> outs;
  if (!ValueConsumers(n, &outs) || outs.size() != 1) return false;
  const tf::Node* add = outs[0]->dst();
  const std::string& add_op = add->type_string();
  int bias_input = -1;
  if (add_op == "BiasAdd" && outs[0]->dst_input() == 0) {
    bias_input = 1;
  } else if ((add_op == "AddV2" || add_op == "Add") &&
             add->num_inputs() == 2) {
    bias_input = 1 - outs[0]->dst_input();
  } else {
    return false;
  }
  auto no = [cand, &add_op](const std::string& why) {
    cand->unfused = absl::StrCat(add_op, " not fused: ", why);
    return false;
  };
  if (!has_num_bias) return no(absl::StrCat(target.name(), " has no bias input"));
  std::string which;
  if (HasXlaOrTpuAttr(add, &which)) return no("XLA attribute");
  if (!SamePlacement(n, add)) return no("on another device");
  tf::DataType t_add = tf::DT_INVALID, t_n = tf::DT_INVALID;
  tf::TryGetNodeAttr(add->attrs(), "T", &t_add);
  tf::TryGetNodeAttr(n->attrs(), "T", &t_n);
  if (t_add != t_n) return no("dtype differs");
  const bool is_matmul = n->type_string() == "MatMul";
  bool reshape = false;
  if (add_op == "BiasAdd") {
    std::string fmt = "NHWC";
    tf::TryGetNodeAttr(add->attrs(), "data_format", &fmt);
    if (fmt != "NHWC") return no(absl::StrCat("data_format ", fmt));
    // BiasAdd itself checks bias [C] against the last dimension, as the
    // fused op does.
  } else {
    // Add broadcasts: only a bias of static shape [N] or [1, ..., 1, N]
    // (Keras Conv2D reshapes its bias to [1, 1, 1, N]) with N the product's
    // static number of columns / output channels is a bias add.
    tf::ShapeRefiner* r = RefinerFor(g, refiner);
    int port = 0;
    const tf::Node* bias = InputNode(add, bias_input, &port);
    std::vector<int64_t> bdims, fdims;
    if (bias != nullptr && EntryFor(bias) != nullptr) {
      return no("the other operand is a product too");
    }
    if (bias == nullptr || !StaticShape(r, bias, port, &bdims) || bdims.empty()) {
      return no("bias operand's shape is not known statically");
    }
    const tf::Node* weights = nullptr;
    int wport = 0;
    weights = InputNode(n, 1, &wport);
    if (weights == nullptr || !StaticShape(r, weights, wport, &fdims)) {
      return no("weights' shape is not known statically");
    }
    int64_t cols = -1;
    if (is_matmul && fdims.size() == 2) {
      bool tb = false;
      tf::TryGetNodeAttr(n->attrs(), "transpose_b", &tb);
      cols = fdims[tb ? 0 : 1];
    } else if (!is_matmul && fdims.size() == 4) {
      cols = fdims[3];
    }
    const size_t out_rank = is_matmul ? 2 : 4;
    if (cols < 0 || bdims.back() != cols || bdims.size() > out_rank) {
      return no("the other operand is not a bias vector of the product's "
                "width");
    }
    for (size_t i = 0; i + 1 < bdims.size(); ++i) {
      if (bdims[i] != 1) return no("the other operand is not a bias vector");
    }
    reshape = bdims.size() != 1;
  }
  cand->fused_names = {add->name()};
  cand->fused_ops = {add_op};
  cand->bias_input = bias_input;
  cand->reshape_bias = reshape;
  cand->activation = "none";
  // The activation, when it is the bias add's only value consumer.
  std::vector<const tf::Edge*> add_outs;
  if (ValueConsumers(add, &add_outs) && add_outs.size() == 1 &&
      add_outs[0]->src_output() == 0) {
    const tf::Node* act = add_outs[0]->dst();
    const std::string& act_op = act->type_string();
    const std::string act_name = act_op == "Relu" ? "relu"
                                 : act_op == "Relu6" ? "relu6" : "";
    tf::DataType t_act = tf::DT_INVALID;
    tf::TryGetNodeAttr(act->attrs(), "T", &t_act);
    if (!act_name.empty() && AllowsString(target, "activation", act_name) &&
        !HasXlaOrTpuAttr(act, &which) && SamePlacement(n, act) &&
        t_act == t_n) {
      cand->fused_names.push_back(act->name());
      cand->fused_ops.push_back(act_op);
      cand->activation = act_name;
    }
  } else if (!add_outs.empty()) {
    cand->unfused = absl::StrCat(
        "activation not fused: ", add_op, " output has ", add_outs.size(),
        " consumers or control outputs");
  }
  return true;
}

// True if every value consumer of `n`'s output is ReluGrad/Relu6Grad(this,
// F) for one tensor F (not `n` itself); sets the consumer and F's source.
// Then dA = n's product is needed only where F != 0: ReluGrad passes the
// gradient only where F > 0 (Relu6Grad where 0 < F < 6), so masking the
// product by F != 0 first changes no value of ReluGrad's output.
bool ReluGradConsumers(const tf::Node* n, const tf::Node** mask, int* mask_port,
                       std::string* consumer) {
  const tf::Node* f = nullptr;
  int f_port = -1;
  int count = 0;
  for (const tf::Edge* e : n->out_edges()) {
    if (e->IsControlEdge() || IsShapeLike(e->dst())) continue;
    const std::string& op = e->dst()->type_string();
    if ((op != "ReluGrad" && op != "Relu6Grad") || e->dst_input() != 0) {
      return false;
    }
    int port = 0;
    const tf::Node* src = InputNode(e->dst(), 1, &port);
    if (src == nullptr || src == n) return false;
    if (f != nullptr && (src != f || port != f_port)) return false;
    f = src;
    f_port = port;
    if (count++ == 0) *consumer = e->dst()->name();
  }
  if (f == nullptr) return false;
  *mask = f;
  *mask_port = f_port;
  return true;
}

// Why `def` (the replacement of `n`) cannot run where `n` would, or "".
std::string DeviceReason(const tf::Node* n, const tf::NodeDef& def,
                         const GraphContext& ctx) {
  const std::string device = n->assigned_device_name().empty()
                                 ? n->requested_device()
                                 : n->assigned_device_name();
  const std::string device_type = DeviceTypeOf(device);
  if (!device_type.empty()) {
    if (!tf::KernelDefAvailable(tf::DeviceType(device_type), def)) {
      return absl::StrCat("no ", def.op(), " kernel for device ", device);
    }
    return "";
  }
  const tf::Device* fd = ctx.default_function_device;
  if (fd != nullptr && fd->device_type() != tf::DEVICE_CPU &&
      !tf::KernelDefAvailable(tf::DeviceType(fd->device_type()), def)) {
    return absl::StrCat("function runs on ", fd->name(), " where ", def.op(),
                        " has no kernel");
  }
  if (ctx.has_other_device &&
      !tf::KernelDefAvailable(tf::DeviceType(ctx.other_device), def) &&
      tf::KernelDefAvailable(tf::DeviceType(ctx.other_device), n->def())) {
    return absl::StrCat("no device requested and the placer could put ",
                        n->type_string(), " on ", ctx.other_device, " where ",
                        def.op(), " has no kernel");
  }
  return "";
}

// Tries the SDDMM form for a MatMul computing an input gradient that only
// feeds ReluGrad(., F): true (cand filled) when it applies.
bool TrySddmm(const tf::Node* n, const GraphContext& ctx,
              const RewriteConfig& cfg, Candidate* cand) {
  if (n->type_string() != "MatMul") return false;
  const tf::OpDef* sddmm = LookUpOp(kSddmmOp);
  if (sddmm == nullptr) return false;
  bool ta = false;
  tf::TryGetNodeAttr(n->attrs(), "transpose_a", &ta);
  if (ta) return false;
  const tf::Node* mask = nullptr;
  int mask_port = 0;
  std::string consumer;
  if (!ReluGradConsumers(n, &mask, &mask_port, &consumer)) return false;
  // F is the features input of ReluGrad: in TensorFlow's gradient of Relu,
  // the ReLU's output, seen directly or through what carries it to the
  // backward pass (e.g. a while loop's TensorListPopBack). So the mask is
  // sparse when F traces to a listed producer, or when the ReluGrad op type
  // itself is listed (then the producer is recorded as that op).
  SparseTrace t;
  const tf::Node* grad_node = nullptr;
  for (const tf::Edge* e : n->out_edges()) {
    if (!e->IsControlEdge() && e->dst()->name() == consumer) grad_node = e->dst();
  }
  const std::string grad_op = grad_node != nullptr ? grad_node->type_string() : "";
  if (!TraceSparse(mask, mask_port, cfg.producers, 0, &t)) {
    if (cfg.producers.count(grad_op)) {
      t.producers = {grad_op};
      t.via = {absl::StrCat("features:", t.seen)};
    } else if (!cfg.producers.count("*")) {
      return false;
    }
  }
  tf::NodeDef def;
  if (!BuildSddmmDef(n, *sddmm, &def).ok()) return false;
  if (!DeviceReason(n, def, ctx).empty()) return false;
  cand->kind = Kind::kSddmm;
  cand->producer = t.producers.empty() ? absl::StrCat("any:", t.seen)
                                       : absl::StrJoin(t.producers, "+");
  cand->via = absl::StrJoin(t.via, ",");
  cand->mask_consumer = consumer;
  cand->target_def = std::move(def);
  return true;
}

// Why the input gradient Conv2DBackpropInput `n` cannot become
// SparseSplitConv2DBackpropInput, or "": that op takes strides 1 only, and
// explicit paddings within the dilated filter's extent (checked on the
// filter's static shape).
std::string BackpropInputReason(const tf::Graph& g, const tf::Node* n,
                                std::unique_ptr<tf::ShapeRefiner>* refiner) {
  std::vector<tf::int32> strides, dilations;
  std::vector<tf::int64> explicit_paddings;
  std::string padding;
  if (!tf::TryGetNodeAttr(n->attrs(), "strides", &strides) ||
      strides.size() != 4)
    return "no strides attribute";
  for (tf::int32 v : strides)
    if (v != 1) return "strides other than 1 (the sparse input gradient is stride 1)";
  if (!tf::TryGetNodeAttr(n->attrs(), "padding", &padding)) return "no padding";
  if (padding != "EXPLICIT") return "";
  tf::TryGetNodeAttr(n->attrs(), "dilations", &dilations);
  tf::TryGetNodeAttr(n->attrs(), "explicit_paddings", &explicit_paddings);
  if (dilations.size() != 4) dilations = {1, 1, 1, 1};
  const tf::Edge* fe = nullptr;
  if (!n->input_edge(1, &fe).ok() || fe == nullptr)
    return "filter input missing";
  std::vector<int64_t> fdims;
  if (!StaticShape(RefinerFor(g, refiner), fe->src(), fe->src_output(), &fdims) ||
      fdims.size() != 4 || fdims[0] < 1 || fdims[1] < 1)
    return "EXPLICIT padding with a filter of unknown spatial size";
  if (explicit_paddings.size() != 8) return "explicit_paddings not of 8 entries";
  const int64_t ek_h = (fdims[0] - 1) * dilations[1];
  const int64_t ek_w = (fdims[1] - 1) * dilations[2];
  if (explicit_paddings[2] > ek_h || explicit_paddings[3] > ek_h ||
      explicit_paddings[4] > ek_w || explicit_paddings[5] > ek_w)
    return "explicit paddings beyond the dilated filter";
  return "";
}

// Why the Conv2D `n` cannot become SparseSplitConv2D because it is a
// grouped convolution, or "": TF's Conv2D convolves an input of C_in
// channels with a filter of C_in / groups input channels, which the
// sparse-split op does not take (it would raise where TF computes). Judged
// on the static shapes; unknown channel counts are not declined.
std::string GroupedConvReason(const tf::Graph& g, const tf::Node* n,
                              std::unique_ptr<tf::ShapeRefiner>* refiner) {
  int xport = 0, fport = 0;
  const tf::Node* x = InputNode(n, 0, &xport);
  const tf::Node* f = InputNode(n, 1, &fport);
  if (x == nullptr || f == nullptr) return "";
  tf::ShapeRefiner* r = RefinerFor(g, refiner);
  std::vector<int64_t> xd, fd;
  if (!StaticShape(r, x, xport, &xd) || !StaticShape(r, f, fport, &fd) ||
      xd.size() != 4 || fd.size() != 4 || xd[3] < 0 || fd[2] < 0 ||
      xd[3] == fd[2]) {
    return "";
  }
  return absl::StrCat("grouped convolution (input channels ", xd[3],
                      ", filter input channels ", fd[2],
                      "): not supported by SparseSplitConv2D");
}

// The reason to leave a source-op node alone, or "" (then *cand is filled
// for the replacement). `refiner` is created on first use.
std::string Decide(const tf::Graph& g, const tf::Node* n,
                   const RewriteEntry& entry, const GraphContext& ctx,
                   const RewriteConfig& cfg,
                   std::unique_ptr<tf::ShapeRefiner>* refiner, Candidate* cand) {
  if (!ctx.graph_reason.empty()) return ctx.graph_reason;
  const tf::OpDef* target = LookUpOp(entry.target_op);
  if (target == nullptr) {
    return absl::StrCat(entry.target_op, " is not registered");
  }
  std::string which;
  if (HasXlaOrTpuAttr(n, &which)) return absl::StrCat("XLA/TPU attribute ", which);
  tf::DataType dtype = tf::DT_INVALID;
  if (!tf::TryGetNodeAttr(n->attrs(), "T", &dtype)) return "no T attribute";
  bool dtype_ok = false;
  for (const auto& a : target->attr()) {
    if (a.name() != "T") continue;
    for (int t : a.allowed_values().list().type()) dtype_ok |= t == dtype;
  }
  if (!dtype_ok) {
    return absl::StrCat("dtype ", tf::DataTypeString(dtype),
                        " not supported by ", entry.target_op);
  }
  // Attributes the target op lacks must be ones that do not change the
  // result (e.g. Conv2D's data_format must be NHWC, the target's layout).
  for (const auto& kv : n->attrs()) {
    if (absl::StartsWith(kv.first, "_")) continue;
    bool declared = false;
    for (const auto& a : target->attr()) declared |= a.name() == kv.first;
    if (declared || kv.first == "use_cudnn_on_gpu" || kv.first == "grad_a" ||
        kv.first == "grad_b" ||
        (kv.first == "data_format" && kv.second.s() == "NHWC")) {
      continue;
    }
    return absl::StrCat("attribute ", kv.first, " = ",
                        tf::SummarizeAttrValue(kv.second), " not supported by ",
                        entry.target_op);
  }
  if (n->type_string() == "Conv2DBackpropInput") {
    const std::string why = BackpropInputReason(g, n, refiner);
    if (!why.empty()) return why;
  }
  if (n->type_string() == "Conv2D") {
    const std::string why = GroupedConvReason(g, n, refiner);
    if (!why.empty()) return why;
  }
  if (!TrySddmm(n, ctx, cfg, cand)) {
    SparseTrace t;
    cand->producer = SparseProducer(n, entry.activation_input, cfg.producers, &t);
    cand->via = absl::StrJoin(t.via, ",");
    if (cand->producer.empty()) {
      cand->producer = t.seen;
      return absl::StrCat("activation input comes from ", t.seen,
                          ", not a listed sparse producer");
    }
    absl::Status st = BuildTargetDef(n, entry, *target, &cand->target_def);
    if (!st.ok()) return absl::StrCat("cannot build replacement: ", st.message());
    const std::string why = DeviceReason(n, cand->target_def, ctx);
    if (!why.empty()) return why;
  }
  if (cfg.min_flops > 0) {
    const double flops = StaticFlops(RefinerFor(g, refiner), n, entry);
    if (flops >= 0 && flops < cfg.min_flops) {
      return absl::StrCat("flops ", flops, " < min_flops ", cfg.min_flops);
    }
  }
  const bool forward = n->type_string() == "MatMul" || n->type_string() == "Conv2D";
  if (cand->kind == Kind::kReplace && forward &&
      FindEpilogue(g, n, *target, refiner, cand)) {
    tf::NodeDef fused;
    absl::Status st = BuildTargetDef(n, entry, *target, &fused, 1,
                                     cand->activation, cand->new_name());
    if (st.ok() && DeviceReason(n, fused, ctx).empty()) {
      cand->kind = Kind::kFuse;
      cand->target_def = std::move(fused);
    } else {
      cand->unfused = absl::StrCat("fused form rejected: ", st.message());
      cand->fused_names.clear();
      cand->fused_ops.clear();
      cand->activation = "none";
    }
  }
  return "";
}

// MatMul/Conv2D nodes inside the XLA-compiled functions that `n` calls (a
// call node with _XlaMustCompile, a call of a function whose definition has
// it, or an XlaLaunch node): the pass cannot act there. Appends {op, inner
// node, function}. `flib` is the function library of the graph (or null).
void XlaCalleeNodes(const tf::Node* n, const tf::FunctionLibraryDefinition* flib,
                    std::vector<std::array<std::string, 3>>* out) {
  bool must = false;
  tf::TryGetNodeAttr(n->attrs(), "_XlaMustCompile", &must);
  const std::string& type = n->type_string();
  if (type == "XlaLaunch" || type == "XlaLaunchV2" || type == "_XlaCompile") {
    must = true;
  }
  std::string fname;
  for (const char* attr : {"f", "function"}) {
    const tf::NameAttrList* f = nullptr;
    if (fname.empty() && tf::TryGetNodeAttr(n->attrs(), attr, &f) &&
        f != nullptr) {
      fname = f->name();
    }
  }
  if (fname.empty() && flib != nullptr && flib->Find(type) != nullptr) {
    fname = type;
  }
  if (fname.empty()) return;
  VLOG(2) << "tf_sparse_split rewrite: node " << n->name() << " (" << type
          << ") calls '" << fname << "', _XlaMustCompile=" << must;
  const tf::FunctionDef* fdef = flib != nullptr ? flib->Find(fname) : nullptr;
  if (fdef != nullptr) {
    for (const char* a : {"_XlaMustCompile", "_XlaCompile"}) {
      auto it = fdef->attr().find(a);
      if (it != fdef->attr().end() && it->second.b()) must = true;
    }
  }
  if (!must) return;
  if (fdef == nullptr) {
    out->push_back({"MatMul/Conv2D?", "<body not in the library>", fname});
    return;
  }
  for (const tf::NodeDef& nd : fdef->node_def()) {
    for (const auto& e : RewriteTable()) {
      if (nd.op() == e.source_op) out->push_back({nd.op(), nd.name(), fname});
    }
  }
}

// Every source-op node of `g` with the pass's decision, in graph order;
// plus records (into *xla) of MatMul/Conv2D nodes hidden in XLA callees.
std::vector<Candidate> FindCandidates(
    const tf::Graph& g, const GraphContext& ctx, const RewriteConfig& cfg,
    std::vector<std::string>* xla) {
  const tf::FunctionLibraryDefinition* flib =
      ctx.flib != nullptr ? ctx.flib : &g.flib_def();
  std::vector<Candidate> out;
  std::unique_ptr<tf::ShapeRefiner> refiner;
  for (const tf::Node* n : g.op_nodes()) {
    const RewriteEntry* entry = EntryFor(n);
    if (entry == nullptr) {
      if (xla == nullptr || !ctx.graph_reason.empty()) continue;
      std::vector<std::array<std::string, 3>> inner;
      XlaCalleeNodes(n, flib, &inner);
      for (const auto& in : inner) {
        if (!cfg.ops.count(in[0]) && in[0] != "MatMul/Conv2D?") continue;
        xla->push_back(absl::StrCat(
            "action=declined\top=", in[0], "\tname=", n->name(), "/", in[1],
            "\tfunction=", ctx.function, "\treason=inside XLA-compiled "
            "function ", in[2], " (jit_compile=True): the pass cannot act "
            "inside XLA clusters"));
      }
      continue;
    }
    if (!cfg.ops.count(entry->source_op)) continue;
    Candidate cand;
    cand.node = n;
    cand.name = n->name();
    cand.op = n->type_string();
    cand.reason = Decide(g, n, *entry, ctx, cfg, &refiner, &cand);
    if (cand.rewrite()) cand.entry = entry;
    out.push_back(std::move(cand));
  }
  return out;
}

std::string DeclineRecord(const Candidate& c, const std::string& fn) {
  return absl::StrCat("action=declined\top=", c.op, "\tname=", c.name,
                      "\tfunction=", fn, "\treason=", c.reason);
}

// Whether `g` has a while loop's frames (an Enter node: functional loops
// are lowered before the pass runs). Without one every node is in the root
// frame, where a Const needs no control input.
bool HasLoopFrames(const tf::Graph& g) {
  for (const tf::Node* n : g.op_nodes()) {
    if (n->IsEnter()) return true;
  }
  return false;
}

// Replaces the node named cand.name in `g` -- with the nodes it absorbs
// (kFuse) -- by cand.target_def (the last node's name; devices, control
// edges and consumers kept) plus a threshold Const; fills *record.
//
// anchor_consts: `g` has loop frames (HasLoopFrames), so the new Consts get
// a control edge from a node of the replaced node's frame (the activation's
// producer; the bias for its reshape). In a graph without loops they get
// none: a control out-edge on the activation's producer (a Relu) stops
// Grappler's remapper from fusing it with its own MatMul/Conv2D and bias
// add (it declines activations with control fan-outs), so a replaced layer
// would cost its predecessor a separate Relu pass.
absl::Status ReplaceNode(tf::Graph* g, const Candidate& cand, float threshold,
                         bool anchor_consts, const std::string& fn,
                         std::string* record) {
  std::unordered_map<std::string, tf::Node*> wanted;
  wanted[cand.name] = nullptr;
  for (const auto& name : cand.fused_names) wanted[name] = nullptr;
  if (!cand.mask_consumer.empty()) wanted[cand.mask_consumer] = nullptr;
  for (tf::Node* m : g->op_nodes()) {
    auto it = wanted.find(m->name());
    if (it != wanted.end()) it->second = m;
  }
  for (const auto& kv : wanted) {
    if (kv.second == nullptr) {
      return tf::errors::Internal("node ", kv.first, " missing");
    }
  }
  tf::Node* n = wanted[cand.name];
  std::vector<tf::Node*> chain{n};
  for (const auto& name : cand.fused_names) chain.push_back(wanted[name]);
  tf::Node* last = chain.back();
  auto in_chain = [&chain](const tf::Node* m) {
    return std::find(chain.begin(), chain.end(), m) != chain.end();
  };
  const RewriteEntry& e = *cand.entry;
  std::vector<std::pair<tf::Node*, int>> data_in(e.num_data_inputs);
  std::vector<tf::Node*> control_in;
  for (tf::Node* m : chain) {
    for (const tf::Edge* edge : m->in_edges()) {
      if (edge->IsControlEdge()) {
        if (!in_chain(edge->src()) &&
            std::find(control_in.begin(), control_in.end(), edge->src()) ==
                control_in.end()) {
          control_in.push_back(edge->src());
        }
      } else if (m == n && edge->dst_input() < e.num_data_inputs) {
        data_in[edge->dst_input()] = {edge->src(), edge->src_output()};
      }
    }
  }
  for (int i = 0; i < e.num_data_inputs; ++i) {
    if (data_in[i].first == nullptr) {
      return tf::errors::Internal("node ", cand.name, " lacks input ", i);
    }
  }
  // The extra data input: the bias (kFuse) or the mask (kSddmm).
  std::pair<tf::Node*, int> extra{nullptr, 0};
  const tf::Edge* extra_edge = nullptr;
  if (cand.kind == Kind::kFuse) {
    TF_RETURN_IF_ERROR(chain[1]->input_edge(cand.bias_input, &extra_edge));
  } else if (cand.kind == Kind::kSddmm) {
    TF_RETURN_IF_ERROR(wanted[cand.mask_consumer]->input_edge(1, &extra_edge));
  }
  if (extra_edge != nullptr) extra = {extra_edge->src(), extra_edge->src_output()};
  struct Out { tf::Node* dst; int src_output; int dst_input; };
  std::vector<Out> data_out;
  std::vector<tf::Node*> control_out;
  for (tf::Node* m : chain) {
    for (const tf::Edge* edge : m->out_edges()) {
      if (in_chain(edge->dst())) continue;
      if (edge->IsControlEdge()) {
        if (std::find(control_out.begin(), control_out.end(), edge->dst()) ==
            control_out.end()) {
          control_out.push_back(edge->dst());
        }
      } else {
        // Earlier nodes of a fused chain keep only shape readers, which get
        // the fused output (same shape).
        data_out.push_back({edge->dst(), m == last ? edge->src_output() : 0,
                            edge->dst_input()});
      }
    }
  }
  const std::string assigned = n->assigned_device_name();
  const std::string requested = n->requested_device();
  const std::string new_name = cand.new_name();

  tf::NodeDef cdef;
  cdef.set_name(g->NewName(absl::StrCat(new_name, "/tfss_threshold")));
  cdef.set_op("Const");
  cdef.set_device(requested);
  tf::Tensor thr(tf::DT_FLOAT, tf::TensorShape({}));
  thr.scalar<float>()() = threshold;
  tf::AddNodeAttr("dtype", tf::DT_FLOAT, &cdef);
  tf::AddNodeAttr("value", thr, &cdef);

  for (tf::Node* m : chain) g->RemoveNode(m);
  absl::Status st;
  tf::Node* nn = g->AddNode(cand.target_def, &st);
  TF_RETURN_IF_ERROR(st);
  tf::Node* c = g->AddNode(cdef, &st);
  TF_RETURN_IF_ERROR(st);
  nn->set_assigned_device_name(assigned);
  c->set_assigned_device_name(assigned);
  // Keeps the Consts in the activation's control-flow frame (only where
  // there are frames: see anchor_consts).
  tf::Node* frame_anchor = cand.kind == Kind::kSddmm
                               ? extra.first
                               : data_in[e.activation_input].first;
  if (anchor_consts) g->AddControlEdge(frame_anchor, c);
  if (cand.kind == Kind::kSddmm) {
    g->AddEdge(extra.first, extra.second, nn, 0);               // mask
    g->AddEdge(data_in[0].first, data_in[0].second, nn, 1);     // x = dY
    g->AddEdge(data_in[1].first, data_in[1].second, nn, 2);     // b
    g->AddEdge(c, 0, nn, 3);
  } else {
    for (int i = 0; i < e.num_data_inputs; ++i) {
      g->AddEdge(data_in[i].first, data_in[i].second, nn, i);
    }
    g->AddEdge(c, 0, nn, e.num_data_inputs);
    if (cand.kind == Kind::kFuse) {
      std::pair<tf::Node*, int> bias = extra;
      if (cand.reshape_bias) {
        // [1, ..., 1, N] -> [N].
        tf::DataType dt = tf::DT_INVALID;
        TF_RETURN_IF_ERROR(tf::GetNodeAttr(nn->attrs(), "T", &dt));
        tf::NodeDef sdef;
        sdef.set_name(g->NewName(absl::StrCat(new_name, "/tfss_bias_shape")));
        sdef.set_op("Const");
        sdef.set_device(requested);
        tf::Tensor shape(tf::DT_INT32, tf::TensorShape({1}));
        shape.flat<int32_t>()(0) = -1;
        tf::AddNodeAttr("dtype", tf::DT_INT32, &sdef);
        tf::AddNodeAttr("value", shape, &sdef);
        tf::Node* s = g->AddNode(sdef, &st);
        TF_RETURN_IF_ERROR(st);
        s->set_assigned_device_name(assigned);
        if (anchor_consts) g->AddControlEdge(extra.first, s);
        tf::NodeDef rdef;
        rdef.set_name(g->NewName(absl::StrCat(new_name, "/tfss_bias")));
        rdef.set_op("Reshape");
        rdef.set_device(requested);
        rdef.add_input("bias");
        rdef.add_input("shape");
        tf::AddNodeAttr("T", dt, &rdef);
        tf::AddNodeAttr("Tshape", tf::DT_INT32, &rdef);
        tf::Node* r = g->AddNode(rdef, &st);
        TF_RETURN_IF_ERROR(st);
        r->set_assigned_device_name(assigned);
        g->AddEdge(extra.first, extra.second, r, 0);
        g->AddEdge(s, 0, r, 1);
        bias = {r, 0};
      }
      g->AddEdge(bias.first, bias.second, nn, e.num_data_inputs + 1);
    }
  }
  for (tf::Node* src : control_in) g->AddControlEdge(src, nn);
  std::vector<std::string> outs, couts, cins;
  for (const Out& o : data_out) {
    g->AddEdge(nn, o.src_output, o.dst, o.dst_input);
    outs.push_back(absl::StrCat(o.dst->name(), ":", o.dst_input));
  }
  for (tf::Node* dst : control_out) {
    g->AddControlEdge(nn, dst);
    couts.push_back(dst->name());
  }
  for (tf::Node* src : control_in) cins.push_back(src->name());
  std::sort(outs.begin(), outs.end());
  std::sort(couts.begin(), couts.end());
  std::sort(cins.begin(), cins.end());
  bool ta = false, tb = false;
  tf::TryGetNodeAttr(nn->attrs(), "transpose_a", &ta);
  tf::TryGetNodeAttr(nn->attrs(), "transpose_b", &tb);
  tf::DataType dt = tf::DT_INVALID;
  tf::TryGetNodeAttr(nn->attrs(), "T", &dt);
  *record = absl::StrCat(
      "action=rewritten\top=", e.source_op, "\tnew_op=", cand.target_def.op(),
      "\tname=", cand.name, "\tfunction=", fn, "\tproducer=", cand.producer,
      "\tvia=", cand.via, "\tkind=", KindName(cand.kind),
      "\tnew_name=", new_name, "\tfused=", absl::StrJoin(cand.fused_ops, "+"),
      "\tactivation=", cand.activation, "\tunfused=", cand.unfused,
      "\tmask=", cand.kind == Kind::kSddmm ? extra.first->name() : "",
      "\tdtype=", tf::DataTypeString(dt), "\tdevice=", requested,
      "\tassigned_device=", assigned, "\ttranspose_a=", ta ? 1 : 0,
      "\ttranspose_b=", tb ? 1 : 0, "\tthreshold=", threshold,
      "\tthreshold_node=", c->name(),
      "\tthreshold_anchor=", anchor_consts ? frame_anchor->name() : "",
      "\tcontrol_in=", absl::StrJoin(cins, ","),
      "\tcontrol_out=", absl::StrJoin(couts, ","),
      "\tdata_out=", absl::StrJoin(outs, ","));
  VLOG(1) << "tf_sparse_split rewrite: " << e.source_op << " '" << cand.name
          << "' -> " << cand.target_def.op() << " (" << KindName(cand.kind)
          << ", activation from " << cand.producer << ")"
          << (fn.empty() ? "" : " in function " + fn);
  return absl::OkStatus();
}

void WarnXlaOnce(const std::vector<std::string>& xla) {
  static std::once_flag once;
  if (xla.empty()) return;
  std::call_once(once, [&] {
    LOG(WARNING) << "tf_sparse_split rewrite: MatMul/Conv2D nodes inside "
                    "XLA-compiled functions (jit_compile=True) are not "
                    "rewritten; see tf_sparse_split.rewrite.log(). First: "
                 << xla.front();
  });
}

absl::Status RunImpl(const tf::GraphOptimizationPassOptions& options,
                     const RewriteConfig& cfg) {
  tf::Graph* g = options.graph->get();
  const GraphContext ctx = MakeContext(options);
  const std::string& fn = ctx.function;
  std::vector<std::string> records;
  std::vector<Candidate> cands = FindCandidates(*g, ctx, cfg, &records);
  WarnXlaOnce(records);
  bool any = false;
  for (const Candidate& c : cands) {
    if (c.rewrite()) { any = true; continue; }
    VLOG(1) << "tf_sparse_split rewrite: leaving " << c.op << " '" << c.name
            << "'" << (fn.empty() ? "" : " in function " + fn)
            << " alone: " << c.reason;
    records.push_back(DeclineRecord(c, fn));
  }
  if (!any) {
    AppendLog(&records);
    return absl::OkStatus();
  }
  // Rewrite a copy; install it only if everything succeeded.
  auto copy = std::make_unique<tf::Graph>(g->flib_def());
  tf::CopyGraph(*g, copy.get());
  std::vector<std::string> done;
  std::map<std::string, int64_t> counted;
  const bool anchor_consts = HasLoopFrames(*copy);
  for (const Candidate& c : cands) {
    if (!c.rewrite()) continue;
    std::string record;
    TF_RETURN_IF_ERROR(ReplaceNode(copy.get(), c, cfg.threshold,
                                   anchor_consts, fn, &record));
    done.push_back(std::move(record));
    counted[c.entry->source_op] += 1;
  }
  *options.graph = std::move(copy);
  for (auto& r : done) records.push_back(std::move(r));
  AppendLog(&records);
  State& s = GlobalState();
  std::lock_guard<std::mutex> lock(s.mu);
  for (const auto& kv : counted) s.counters[kv.first] += kv.second;
  return absl::OkStatus();
}

// While the pass is off: a function graph holding MatMul/Conv2D nodes is
// being instantiated, and TensorFlow will not optimize it again. Recorded
// so that enable() can warn (and log() show) which functions keep their ops.
void RecordMissed(const tf::GraphOptimizationPassOptions& options) {
  const std::string fn = FunctionName(options);
  if (absl::StartsWith(fn, "__wrapped__")) return;  // single eager op
  std::map<std::string, int> ops;
  for (const tf::Node* n : (*options.graph)->op_nodes()) {
    if (EntryFor(n) != nullptr) ops[n->type_string()] += 1;
  }
  if (ops.empty()) return;
  std::vector<std::string> parts;
  for (const auto& kv : ops) parts.push_back(absl::StrCat(kv.first, ":", kv.second));
  std::vector<std::string> records{absl::StrCat(
      "action=missed\top=", absl::StrJoin(parts, ","), "\tname=\tfunction=",
      fn.empty() ? "<graph>" : fn,
      "\treason=instantiated while the rewrite pass was off; TensorFlow "
      "optimizes a function graph once, so it keeps its ops (re-trace it "
      "after enable())")};
  {
    State& s = GlobalState();
    std::lock_guard<std::mutex> lock(s.mu);
    s.missed.push_back(records.front());
    if (s.missed.size() > kMaxMissed) s.missed.pop_front();
  }
  AppendLog(&records);
}

}  // namespace

const std::vector<RewriteEntry>& RewriteTable() {
  static const std::vector<RewriteEntry>* table = new std::vector<RewriteEntry>{
      {"MatMul", "TfSparseSplit>SparseSplitMatMul", 0, 2},
      // Active only when the SparseSplitConv2D op is registered (checked at
      // pass time): input, filter, threshold -> output, stats.
      {"Conv2D", "TfSparseSplit>SparseSplitConv2D", 0, 2},
      // The filter gradient dW = conv-correlation of the input x with dY:
      // input, filter_sizes, out_backprop, threshold -> filter_backprop,
      // stats; x (input 0) is the sparse operand, as in the forward op.
      {"Conv2DBackpropFilter", "TfSparseSplit>SparseSplitConv2DBackpropFilter",
       0, 3},
      // The input gradient dX of a stride-1 convolution: input_sizes,
      // filter, out_backprop, threshold -> input_backprop, stats; dY (input
      // 2: a ReluGrad in training graphs) is the sparse operand. Opt-in
      // (not in the default ops).
      {"Conv2DBackpropInput", "TfSparseSplit>SparseSplitConv2DBackpropInput",
       2, 3},
  };
  return *table;
}

std::vector<std::string> ActiveSourceOps() {
  std::vector<std::string> out;
  for (const auto& e : RewriteTable()) {
    if (LookUpOp(e.target_op) != nullptr) out.push_back(e.source_op);
  }
  return out;
}

void SetConfig(const RewriteConfig& config) {
  State& s = GlobalState();
  std::lock_guard<std::mutex> lock(s.mu);
  s.config = config;
}

RewriteConfig GetConfig() {
  State& s = GlobalState();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.config;
}

std::map<std::string, int64_t> Counters() {
  State& s = GlobalState();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.counters;
}

void ResetCounters() {
  State& s = GlobalState();
  std::lock_guard<std::mutex> lock(s.mu);
  s.counters.clear();
}

std::vector<std::string> LogRecords(bool clear) {
  State& s = GlobalState();
  std::lock_guard<std::mutex> lock(s.mu);
  std::vector<std::string> out(s.log.begin(), s.log.end());
  if (clear) s.log.clear();
  return out;
}

std::vector<std::string> TakeMissed() {
  State& s = GlobalState();
  std::lock_guard<std::mutex> lock(s.mu);
  std::vector<std::string> out(s.missed.begin(), s.missed.end());
  s.missed.clear();
  return out;
}

absl::Status DryRun(const tf::GraphDef& graph_def, const RewriteConfig& cfg,
                    std::vector<std::string>* records) {
  tf::FunctionLibraryDefinition flib(tf::OpRegistry::Global(),
                                     graph_def.library());
  tf::Graph g(flib);
  tf::GraphConstructorOptions opts;
  opts.allow_internal_ops = true;
  opts.add_default_attributes = true;
  TF_RETURN_IF_ERROR(tf::ConvertGraphDefToGraph(opts, graph_def, &g));
  GraphContext ctx;  // a plain graph on this process's CPU
  std::vector<Candidate> cands = FindCandidates(g, ctx, cfg, records);
  for (const Candidate& c : cands) {
    if (!c.rewrite()) {
      records->push_back(absl::StrCat(DeclineRecord(c, ""), "\tproducer=",
                                      c.producer, "\tvia=", c.via));
      continue;
    }
    records->push_back(absl::StrCat(
        "action=would_rewrite\top=", c.op, "\tnew_op=", c.target_def.op(),
        "\tname=", c.name, "\tfunction=\tproducer=", c.producer,
        "\tvia=", c.via, "\tkind=", KindName(c.kind),
        "\tnew_name=", c.new_name(), "\tfused=", absl::StrJoin(c.fused_ops, "+"),
        "\tactivation=", c.activation, "\tunfused=", c.unfused));
  }
  return absl::OkStatus();
}

absl::Status SparseSplitRewritePass::Run(
    const tf::GraphOptimizationPassOptions& options) {
  const RewriteConfig cfg = GetConfig();
  if (options.graph == nullptr || *options.graph == nullptr) {
    return absl::OkStatus();
  }
  try {
    if (!cfg.enabled) {
      RecordMissed(options);
      return absl::OkStatus();
    }
    absl::Status st = RunImpl(options, cfg);
    if (!st.ok()) {
      LOG(WARNING) << "tf_sparse_split rewrite pass failed; graph left "
                      "unchanged: " << st;
    }
  } catch (const std::exception& e) {
    LOG(WARNING) << "tf_sparse_split rewrite pass failed; graph left "
                    "unchanged: " << e.what();
  } catch (...) {
    LOG(WARNING) << "tf_sparse_split rewrite pass failed; graph left unchanged";
  }
  return absl::OkStatus();
}

// PRE_PLACEMENT, phase 12: after LowerFunctionalOpsPass (phase 10) so the
// bodies of lowered If/While are in the graph, before placement so the
// placer sees the new ops (and picks devices that have their kernels).
REGISTER_OPTIMIZATION(::tensorflow::OptimizationPassRegistry::PRE_PLACEMENT, 12,
                      SparseSplitRewritePass);

}  // namespace rewrite
}  // namespace tf_sparse_split
