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

// Op types through which "sparse" passes unchanged (zeros stay zeros), with
// the data input that carries the value.
bool IsLookThrough(const tf::Node* n) {
  static const std::set<std::string>* ops = new std::set<std::string>{
      "Identity", "Snapshot", "StopGradient", "PreventGradient", "Enter",
      "Exit", "Switch", "RefSwitch", "Reshape", "Cast", "Transpose",
      "EnsureShape", "CheckNumerics", "ExpandDims", "Squeeze", "IdentityN"};
  return ops->count(n->type_string()) > 0;
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

// Finds the producer of the activation (through look-through ops). Returns
// the name under which it counts as sparse ("Relu", "Dropout", "any:<op>")
// or "" with *seen set to what was found.
std::string SparseProducer(const tf::Node* n, int input,
                           const std::set<std::string>& producers,
                           std::string* seen) {
  int port = 0;
  const tf::Node* src = InputNode(n, input, &port);
  for (int depth = 0; src != nullptr && depth < 16; ++depth) {
    const std::string& op = src->type_string();
    if (producers.count(op)) return op;
    if (producers.count("Dropout") && IsDropout(src)) return "Dropout";
    if (!IsLookThrough(src)) break;
    int next = op == "IdentityN" ? port : 0;
    src = InputNode(src, next, &port);
  }
  *seen = src == nullptr ? "<none>" : src->type_string();
  if (producers.count("*")) return absl::StrCat("any:", *seen);
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

// Builds the NodeDef of the replacement: same name, device, attrs that the
// target op declares (T, transpose_*, strides, ...), and private attrs other
// than _output_shapes.
absl::Status BuildTargetDef(const tf::Node* n, const RewriteEntry& e,
                            const tf::OpDef& target, tf::NodeDef* def) {
  def->set_name(n->name());
  def->set_op(e.target_op);
  def->set_device(n->requested_device());
  *def->mutable_experimental_debug_info() = n->def().experimental_debug_info();
  for (int i = 0; i < e.num_data_inputs; ++i) def->add_input(absl::StrCat("in", i));
  def->add_input("threshold");
  std::set<std::string> declared;
  for (const auto& a : target.attr()) declared.insert(a.name());
  for (const auto& kv : n->attrs()) {
    if (declared.count(kv.first) ||
        (absl::StartsWith(kv.first, "_") && kv.first != "_output_shapes")) {
      (*def->mutable_attr())[kv.first] = kv.second;
    }
  }
  tf::AddDefaultsToNodeDef(target, def);
  return tf::ValidateNodeDef(*def, target);
}

// What the pass decided for one source-op node. `entry` and `target_def`
// are set when it would be rewritten (`reason` empty).
struct Candidate {
  const tf::Node* node = nullptr;
  std::string name;
  std::string op;
  const RewriteEntry* entry = nullptr;
  std::string producer;
  std::string reason;  // non-empty: declined, and why
  tf::NodeDef target_def;
  bool rewrite() const { return reason.empty(); }
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

// The reason to leave a source-op node alone, or "" (then *cand is filled
// for the replacement). `refiner` is created on first use (min_flops).
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
  std::string seen;
  cand->producer = SparseProducer(n, entry.activation_input, cfg.producers, &seen);
  if (cand->producer.empty()) {
    cand->producer = seen;
    return absl::StrCat("activation input comes from ", seen,
                        ", not a listed sparse producer");
  }
  absl::Status st = BuildTargetDef(n, entry, *target, &cand->target_def);
  if (!st.ok()) return absl::StrCat("cannot build replacement: ", st.message());
  const std::string device = n->assigned_device_name().empty()
                                 ? n->requested_device()
                                 : n->assigned_device_name();
  const std::string device_type = DeviceTypeOf(device);
  if (!device_type.empty()) {
    if (!tf::KernelDefAvailable(tf::DeviceType(device_type), cand->target_def)) {
      return absl::StrCat("no ", entry.target_op, " kernel for device ", device);
    }
  } else {
    const tf::Device* fd = ctx.default_function_device;
    if (fd != nullptr && fd->device_type() != tf::DEVICE_CPU &&
        !tf::KernelDefAvailable(tf::DeviceType(fd->device_type()),
                                cand->target_def)) {
      return absl::StrCat("function runs on ", fd->name(), " where ",
                          entry.target_op, " has no kernel");
    }
    if (ctx.has_other_device &&
        !tf::KernelDefAvailable(tf::DeviceType(ctx.other_device),
                                cand->target_def) &&
        tf::KernelDefAvailable(tf::DeviceType(ctx.other_device), n->def())) {
      return absl::StrCat("no device requested and the placer could put ",
                          n->type_string(), " on ", ctx.other_device, " where ",
                          entry.target_op, " has no kernel");
    }
  }
  if (cfg.min_flops > 0) {
    if (*refiner == nullptr) {
      *refiner = std::make_unique<tf::ShapeRefiner>(g.versions(), g.op_registry());
      std::vector<tf::Node*> order;
      tf::GetReversePostOrder(g, &order);
      for (tf::Node* m : order) (*refiner)->AddNode(m).IgnoreError();
    }
    const double flops = StaticFlops(refiner->get(), n, entry);
    if (flops >= 0 && flops < cfg.min_flops) {
      return absl::StrCat("flops ", flops, " < min_flops ", cfg.min_flops);
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

// Replaces the node named cand.name in `g` by cand.target_def (same name,
// devices, control edges, consumers) plus a threshold Const; fills *record.
absl::Status ReplaceNode(tf::Graph* g, const Candidate& cand, float threshold,
                         const std::string& fn, std::string* record) {
  tf::Node* n = nullptr;
  for (tf::Node* m : g->op_nodes()) {
    if (m->name() == cand.name) { n = m; break; }
  }
  if (n == nullptr) return tf::errors::Internal("node ", cand.name, " missing");
  const RewriteEntry& e = *cand.entry;
  std::vector<std::pair<tf::Node*, int>> data_in(e.num_data_inputs);
  std::vector<tf::Node*> control_in;
  for (const tf::Edge* edge : n->in_edges()) {
    if (edge->IsControlEdge()) {
      control_in.push_back(edge->src());
    } else if (edge->dst_input() < e.num_data_inputs) {
      data_in[edge->dst_input()] = {edge->src(), edge->src_output()};
    }
  }
  for (int i = 0; i < e.num_data_inputs; ++i) {
    if (data_in[i].first == nullptr) {
      return tf::errors::Internal("node ", cand.name, " lacks input ", i);
    }
  }
  struct Out { tf::Node* dst; int src_output; int dst_input; };
  std::vector<Out> data_out;
  std::vector<tf::Node*> control_out;
  for (const tf::Edge* edge : n->out_edges()) {
    if (edge->IsControlEdge()) {
      control_out.push_back(edge->dst());
    } else {
      data_out.push_back({edge->dst(), edge->src_output(), edge->dst_input()});
    }
  }
  const std::string assigned = n->assigned_device_name();
  const std::string requested = n->requested_device();

  tf::NodeDef cdef;
  cdef.set_name(g->NewName(absl::StrCat(cand.name, "/tfss_threshold")));
  cdef.set_op("Const");
  cdef.set_device(requested);
  tf::Tensor thr(tf::DT_FLOAT, tf::TensorShape({}));
  thr.scalar<float>()() = threshold;
  tf::AddNodeAttr("dtype", tf::DT_FLOAT, &cdef);
  tf::AddNodeAttr("value", thr, &cdef);

  g->RemoveNode(n);
  absl::Status st;
  tf::Node* nn = g->AddNode(cand.target_def, &st);
  TF_RETURN_IF_ERROR(st);
  tf::Node* c = g->AddNode(cdef, &st);
  TF_RETURN_IF_ERROR(st);
  nn->set_assigned_device_name(assigned);
  c->set_assigned_device_name(assigned);
  for (int i = 0; i < e.num_data_inputs; ++i) {
    g->AddEdge(data_in[i].first, data_in[i].second, nn, i);
  }
  g->AddEdge(c, 0, nn, e.num_data_inputs);
  // Keeps the Const in the activation's control-flow frame.
  g->AddControlEdge(data_in[e.activation_input].first, c);
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
      "action=rewritten\top=", e.source_op, "\tnew_op=", e.target_op,
      "\tname=", cand.name, "\tfunction=", fn, "\tproducer=", cand.producer,
      "\tdtype=", tf::DataTypeString(dt), "\tdevice=", requested,
      "\tassigned_device=", assigned, "\ttranspose_a=", ta ? 1 : 0,
      "\ttranspose_b=", tb ? 1 : 0, "\tthreshold=", threshold,
      "\tthreshold_node=", c->name(), "\tcontrol_in=", absl::StrJoin(cins, ","),
      "\tcontrol_out=", absl::StrJoin(couts, ","),
      "\tdata_out=", absl::StrJoin(outs, ","));
  VLOG(1) << "tf_sparse_split rewrite: " << e.source_op << " '" << cand.name
          << "' -> " << e.target_op << " (activation from " << cand.producer
          << ")" << (fn.empty() ? "" : " in function " + fn);
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
  for (const Candidate& c : cands) {
    if (!c.rewrite()) continue;
    std::string record;
    TF_RETURN_IF_ERROR(ReplaceNode(copy.get(), c, cfg.threshold, fn, &record));
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
                                      c.producer));
      continue;
    }
    records->push_back(absl::StrCat(
        "action=would_rewrite\top=", c.op, "\tnew_op=", c.entry->target_op,
        "\tname=", c.name, "\tfunction=\tproducer=", c.producer));
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
