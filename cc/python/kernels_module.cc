// pybind11 module tf_sparse_split._kernels: numpy access to the framework-free
// kernels of cc/kernels (tests and benchmarks without TensorFlow overhead).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <map>
#include <thread>
#include <vector>

#include "cc/core/direct_conv2d.h"
#include "cc/core/low_precision.h"
#include "cc/core/sparse_conv2d.h"
#include "cc/core/sparse_matmul.h"
#include "cc/core/stats.h"

namespace py = pybind11;

namespace tf_sparse_split {
namespace {

// A ParallelFor over `threads` std::threads (<= 1: the calling thread).
ParallelFor ThreadFor(int threads) {
  return [threads](int64_t total, int64_t,
                   const std::function<void(int64_t, int64_t)>& fn) {
    if (total <= 0) return;
    const int64_t t = std::max<int64_t>(1, std::min<int64_t>(threads, total));
    if (t == 1) {
      fn(0, total);
      return;
    }
    const int64_t chunk = (total + t - 1) / t;
    std::vector<std::thread> pool;
    for (int64_t i = 1; i < t; ++i) {
      const int64_t b = i * chunk, e = std::min(total, b + chunk);
      if (b < e) pool.emplace_back(fn, b, e);
    }
    fn(0, std::min(total, chunk));
    for (auto& th : pool) th.join();
  };
}

int DefaultThreads() {
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

template <typename T>
using Arr = py::array_t<T, py::array::c_style | py::array::forcecast>;

template <typename T>
void Require2d(const Arr<T>& x, const char* name) {
  if (x.ndim() != 2)
    throw py::value_error(std::string(name) + " must be 2-D, got " +
                          std::to_string(x.ndim()) + "-D");
}

template <typename T>
py::tuple RowColNnz(const Arr<T>& a, bool transpose, int threads) {
  Require2d(a, "a");
  const int64_t pr = a.shape(0), pc = a.shape(1);
  const int64_t m = transpose ? pc : pr, k = transpose ? pr : pc;
  py::array_t<int64_t> row({m}), col({k});
  int64_t nnz;
  {
    py::gil_scoped_release release;
    nnz = CountNonzeros<T>(a.data(), pr, pc, transpose, row.mutable_data(),
                           col.mutable_data(), ThreadFor(threads));
  }
  return py::make_tuple(row, col, nnz);
}

// CountNonzerosStrided: counts of every stride-th physical row of a.
template <typename T>
py::tuple RowColNnzStrided(const Arr<T>& a, int64_t stride, bool transpose,
                           int threads) {
  Require2d(a, "a");
  if (stride < 1) throw py::value_error("stride must be >= 1");
  const int64_t pr = a.shape(0), pc = a.shape(1);
  const int64_t sampled = (pr + stride - 1) / stride;
  py::array_t<int64_t> row({transpose ? pc : sampled}),
      col({transpose ? sampled : pc});
  int64_t nnz;
  {
    py::gil_scoped_release release;
    nnz = CountNonzerosStrided<T>(a.data(), pr, pc, stride, transpose,
                                  row.mutable_data(), col.mutable_data(),
                                  ThreadFor(threads));
  }
  return py::make_tuple(row, col, nnz);
}

template <typename T>
py::tuple CsrOf(const Arr<T>& a, bool transpose, int threads) {
  Require2d(a, "a");
  const int64_t pr = a.shape(0), pc = a.shape(1);
  const int64_t m = transpose ? pc : pr, k = transpose ? pr : pc;
  if (k >= (int64_t{1} << 31)) throw py::value_error("k must be < 2^31");
  std::vector<int64_t> row(m), col(k), rows(m);
  for (int64_t i = 0; i < m; ++i) rows[i] = i;
  Csr<T> csr;
  {
    py::gil_scoped_release release;
    auto pfor = ThreadFor(threads);
    CountNonzeros<T>(a.data(), pr, pc, transpose, row.data(), col.data(), pfor);
    BuildCsr<T>(a.data(), pr, pc, transpose, rows.data(), m, row.data(),
                col.data(), &csr, pfor);
  }
  py::array_t<int64_t> indptr(csr.row_ptr.size());
  std::copy(csr.row_ptr.begin(), csr.row_ptr.end(), indptr.mutable_data());
  py::array_t<int32_t> indices(csr.col_idx.size());
  std::copy(csr.col_idx.begin(), csr.col_idx.end(), indices.mutable_data());
  py::array_t<T> data(csr.values.size());
  std::copy(csr.values.begin(), csr.values.end(), data.mutable_data());
  return py::make_tuple(indptr, indices, data, py::make_tuple(m, k));
}

template <typename T>
py::array_t<T> Spmm(const Arr<int64_t>& indptr, const Arr<int32_t>& indices,
                    const Arr<T>& data, const Arr<T>& b, int threads) {
  Require2d(b, "b");
  const int64_t m = indptr.size() - 1, k = b.shape(0), n = b.shape(1);
  if (m < 0) throw py::value_error("indptr must have at least one entry");
  if (indices.size() != data.size())
    throw py::value_error("indices and data differ in length");
  const int64_t* ip = indptr.data();
  if (ip[0] != 0 || ip[m] != data.size())
    throw py::value_error("indptr must start at 0 and end at nnz");
  for (int64_t i = 0; i < m; ++i)
    if (ip[i + 1] < ip[i]) throw py::value_error("indptr must be non-decreasing");
  for (int64_t p = 0; p < indices.size(); ++p)
    if (indices.data()[p] < 0 || indices.data()[p] >= k)
      throw py::value_error("column index out of range [0, b.shape[0])");
  Csr<T> csr;
  csr.row_ptr.assign(ip, ip + m + 1);
  csr.col_idx.assign(indices.data(), indices.data() + indices.size());
  csr.values.assign(data.data(), data.data() + data.size());
  // The SpMM assumes ascending column indices within a row.
  for (int64_t i = 0; i < m; ++i)
    for (int64_t p = ip[i] + 1; p < ip[i + 1]; ++p)
      if (csr.col_idx[p] <= csr.col_idx[p - 1])
        throw py::value_error("column indices must be strictly ascending per row");
  std::vector<int64_t> rows(m);
  for (int64_t i = 0; i < m; ++i) rows[i] = i;
  py::array_t<T> out({m, n});
  {
    py::gil_scoped_release release;
    CsrSpmm<T>(csr, rows.data(), m, b.data(), k, n, n, out.mutable_data(), n,
               ThreadFor(threads));
  }
  return out;
}

template <typename T>
py::array_t<T> SddmmPy(const Arr<T>& mask, const Arr<T>& x, const Arr<T>& y,
                       int threads) {
  Require2d(mask, "mask");
  Require2d(x, "x");
  Require2d(y, "y");
  const int64_t m = mask.shape(0), k = mask.shape(1), n = x.shape(1);
  if (x.shape(0) != m || y.shape(0) != k || y.shape(1) != n)
    throw py::value_error("shapes must be mask [m,k], x [m,n], y [k,n]");
  py::array_t<T> out({m, k});
  {
    py::gil_scoped_release release;
    Sddmm<T>(mask.data(), x.data(), y.data(), m, k, n, out.mutable_data(),
             ThreadFor(threads));
  }
  return out;
}

// A CSR matrix built in C++ and kept there (no copy to numpy), for timing
// the build and the SpMM separately.
template <typename T>
struct CsrMatrix {
  Csr<T> csr;
  int64_t m = 0, k = 0;
};

// Counts the nonzeros of op(a) and builds its CSR into *out, reusing the
// capacity of out's arrays (an op that keeps its CSR buffers across calls
// pays no allocation or page faults).
template <typename T>
void BuildInto(const Arr<T>& a, bool transpose, int threads, CsrMatrix<T>* out) {
  Require2d(a, "a");
  const int64_t pr = a.shape(0), pc = a.shape(1);
  const int64_t m = transpose ? pc : pr, k = transpose ? pr : pc;
  if (k >= (int64_t{1} << 31)) throw py::value_error("k must be < 2^31");
  py::gil_scoped_release release;
  out->m = m;
  out->k = k;
  std::vector<int64_t> row(m), col(k), rows(m);
  for (int64_t i = 0; i < m; ++i) rows[i] = i;
  auto pfor = ThreadFor(threads);
  CountNonzeros<T>(a.data(), pr, pc, transpose, row.data(), col.data(), pfor);
  BuildCsr<T>(a.data(), pr, pc, transpose, rows.data(), m, row.data(),
              col.data(), &out->csr, pfor);
}

template <typename T>
CsrMatrix<T> MakeCsrMatrix(const Arr<T>& a, bool transpose, int threads) {
  CsrMatrix<T> out;
  BuildInto<T>(a, transpose, threads, &out);
  return out;
}

template <typename T>
py::array_t<T> CsrMatrixSpmm(const CsrMatrix<T>& h, const Arr<T>& b,
                             int threads) {
  Require2d(b, "b");
  if (b.shape(0) != h.k)
    throw py::value_error("b must have " + std::to_string(h.k) +
                          " rows (the CSR matrix is " + std::to_string(h.m) +
                          " x " + std::to_string(h.k) + "), got " +
                          std::to_string(b.shape(0)));
  const int64_t n = b.shape(1);
  py::array_t<T> out({h.m, n});
  std::vector<int64_t> rows(h.m);
  for (int64_t i = 0; i < h.m; ++i) rows[i] = i;
  {
    py::gil_scoped_release release;
    CsrSpmm<T>(h.csr, rows.data(), h.m, b.data(), h.k, n, n,
               out.mutable_data(), n, ThreadFor(threads));
  }
  return out;
}

// Copies src with `threads` threads (the bandwidth baseline of the
// conversion benchmarks).
template <typename T>
py::array_t<T> ParallelCopy(const Arr<T>& src, int threads) {
  py::array_t<T> dst(std::vector<py::ssize_t>(src.shape(), src.shape() + src.ndim()));
  const int64_t total = src.size();
  const T* s = src.data();
  T* d = dst.mutable_data();
  {
    py::gil_scoped_release release;
    const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(64, total >> 12));
    const int64_t per = (total + blocks - 1) / blocks;
    ThreadFor(threads)(blocks, per, [&](int64_t b0, int64_t b1) {
      const int64_t lo = std::min(total, b0 * per), hi = std::min(total, b1 * per);
      if (hi > lo) std::memcpy(d + lo, s + lo, (hi - lo) * sizeof(T));
    });
  }
  return dst;
}

template <typename T>
void Bind(py::module_& mod, const char* suffix) {
  const std::string cls = std::string("CsrMatrix") + suffix;
  py::class_<CsrMatrix<T>>(mod, cls.c_str(),
                           "A CSR matrix held in C++ (see csr_matrix).")
      .def_property_readonly("shape", [](const CsrMatrix<T>& h) {
        return py::make_tuple(h.m, h.k);
      })
      .def_property_readonly("nnz", [](const CsrMatrix<T>& h) {
        return h.csr.row_ptr.empty() ? 0 : h.csr.row_ptr.back();
      })
      .def("rebuild",
           [](CsrMatrix<T>& h, const Arr<T>& a, bool transpose, int threads) {
             BuildInto<T>(a, transpose, threads, &h);
           },
           py::arg("a"), py::arg("transpose") = false,
           py::arg("threads") = DefaultThreads(),
           "Recounts and rebuilds this matrix from a (as csr_matrix does),\n"
           "reusing its arrays' memory. Raises ValueError if a is not 2-D.")
      .def("spmm", &CsrMatrixSpmm<T>, py::arg("b"),
           py::arg("threads") = DefaultThreads(),
           "Dense [m, n] product of this [m, k] CSR matrix and b [k, n].\n"
           "Raises ValueError if b is not 2-D with k rows.");
  mod.def("csr_matrix", &MakeCsrMatrix<T>, py::arg("a"),
          py::arg("transpose") = false, py::arg("threads") = DefaultThreads(),
          "Counts the nonzeros of op(a) (a, or a.T if transpose) and builds its\n"
          "CSR, kept in C++: returns a CsrMatrix with .shape (m, k), .nnz and\n"
          ".spmm(b). Raises ValueError if a is not 2-D.");
  mod.def("parallel_copy", &ParallelCopy<T>, py::arg("src"),
          py::arg("threads") = DefaultThreads(),
          "A copy of src made by `threads` threads (memcpy bandwidth baseline).");
  mod.def("row_col_nnz", &RowColNnz<T>, py::arg("a"), py::arg("transpose") = false,
          py::arg("threads") = DefaultThreads(),
          "Per-row and per-column nonzero counts of op(a) and the total nnz.\n"
          "Returns (row_nnz int64[m], col_nnz int64[k], nnz).");
  mod.def("row_col_nnz_strided", &RowColNnzStrided<T>, py::arg("a"),
          py::arg("stride"), py::arg("transpose") = false,
          py::arg("threads") = DefaultThreads(),
          "Counts of the sample that a call of the ops takes when it samples:\n"
          "the physical rows 0, stride, 2*stride, ... of a, as if they were the\n"
          "whole matrix (op(a) = a.T if transpose). Returns (row_nnz, col_nnz,\n"
          "nnz). Raises ValueError if a is not 2-D or stride < 1.");
  mod.def("csr_from_dense", &CsrOf<T>, py::arg("a"), py::arg("transpose") = false,
          py::arg("threads") = DefaultThreads(),
          "CSR of op(a): (indptr int64[m+1], indices int32[nnz], data[nnz], (m, k)).");
  mod.def("csr_spmm", &Spmm<T>, py::arg("indptr"), py::arg("indices"),
          py::arg("data"), py::arg("b"), py::arg("threads") = DefaultThreads(),
          "CSR SpMM: returns the dense [m, n] product of the CSR [m, k] and b [k, n].");
  mod.def("sddmm", &SddmmPy<T>, py::arg("mask"), py::arg("x"), py::arg("y"),
          py::arg("threads") = DefaultThreads(),
          "SDDMM: out[i,j] = mask[i,j] != 0 ? dot(x[i], y[j]) : 0 for mask [m,k], "
          "x [m,n], y [k,n].");
}

}  // namespace
}  // namespace tf_sparse_split

// ===========================================================================
// Cost model (cc/core/cost_model.h): the one definition of the split
// decision, for deterministic tests with recorded timings and for the Python
// callback. Kept as a separate block (own anonymous namespace, own Bind
// function called last) so that other additions to this module merge
// cleanly.
// ===========================================================================
#include "cc/core/conv_cost.h"
#include "cc/core/cost_model.h"

namespace tf_sparse_split {
namespace {

template <typename V>
V Get(const py::dict& d, const char* key, V fallback) {
  return d.contains(key) ? d[key].cast<V>() : fallback;
}

void RequireKeys(const py::dict& d, std::initializer_list<const char*> keys,
                 const char* what) {
  for (auto item : d) {
    const std::string k = py::str(item.first);
    bool ok = false;
    for (const char* allowed : keys) ok = ok || k == allowed;
    if (!ok) throw py::value_error(std::string("unknown ") + what + " key '" + k + "'");
  }
}

SplitShape ShapeOf(const py::dict& d) {
  RequireKeys(d, {"m", "k", "k_live", "dense_flops_per_elem",
                  "sparse_flops_per_nnz", "row_copy_elems",
                  "weight_elems_per_col", "weight_run_elems", "can_compact",
                  "dense_allowed"},
              "shape");
  SplitShape s;
  s.m = Get<int64_t>(d, "m", 0);
  s.k = Get<int64_t>(d, "k", 0);
  s.k_live = Get<int64_t>(d, "k_live", s.k);
  s.dense_flops_per_elem = Get<double>(d, "dense_flops_per_elem", 0.0);
  s.sparse_flops_per_nnz = Get<double>(d, "sparse_flops_per_nnz", 0.0);
  s.row_copy_elems = Get<double>(d, "row_copy_elems", 0.0);
  s.weight_elems_per_col = Get<double>(d, "weight_elems_per_col", 0.0);
  s.weight_run_elems = Get<double>(d, "weight_run_elems", 0.0);
  s.can_compact = Get<bool>(d, "can_compact", true);
  s.dense_allowed = Get<bool>(d, "dense_allowed", true);
  if (s.m < 0 || s.k < 0 || s.k_live < 0 || s.k_live > s.k)
    throw py::value_error("shape needs m, k >= 0 and 0 <= k_live <= k, got m=" +
                          std::to_string(s.m) + ", k=" + std::to_string(s.k) +
                          ", k_live=" + std::to_string(s.k_live));
  return s;
}

py::dict RetimeDictOf(const RetimePolicy& p) {
  py::dict d;
  d["max_ratio"] = p.max_ratio;
  d["first_period"] = p.first_period;
  d["max_period"] = p.max_period;
  d["confirm_runs"] = p.confirm_runs;
  d["hold_runs"] = p.hold_runs;
  return d;
}

py::dict DictOf(const SplitShape& s) {
  py::dict d;
  d["m"] = s.m;
  d["k"] = s.k;
  d["k_live"] = s.k_live;
  d["dense_flops_per_elem"] = s.dense_flops_per_elem;
  d["sparse_flops_per_nnz"] = s.sparse_flops_per_nnz;
  d["row_copy_elems"] = s.row_copy_elems;
  d["weight_elems_per_col"] = s.weight_elems_per_col;
  d["weight_run_elems"] = s.weight_run_elems;
  d["can_compact"] = s.can_compact;
  d["dense_allowed"] = s.dense_allowed;
  return d;
}

CostTerms TermsOf(const py::dict& d) {
  RequireKeys(d, {"dense_fixed_s", "dense_rate", "sparse_fixed_s",
                  "convert_s_per_elem", "sparse_rate", "copy_s_per_elem",
                  "row_copy_s_per_elem", "heterogeneous", "compact_scale"},
              "terms");
  CostTerms t;
  t.dense_fixed_s = Get<double>(d, "dense_fixed_s", 0.0);
  t.dense_rate = Get<double>(d, "dense_rate", 0.0);
  t.sparse_fixed_s = Get<double>(d, "sparse_fixed_s", 0.0);
  t.convert_s_per_elem = Get<double>(d, "convert_s_per_elem", 0.0);
  t.sparse_rate = Get<double>(d, "sparse_rate", 0.0);
  t.copy_s_per_elem = Get<double>(d, "copy_s_per_elem", 0.0);
  t.row_copy_s_per_elem = Get<double>(d, "row_copy_s_per_elem", 0.0);
  t.heterogeneous = Get<bool>(d, "heterogeneous", false);
  t.compact_scale = Get<double>(d, "compact_scale", 1.0);  // 0: unscaled
  if (!(t.compact_scale >= 0.0) || !std::isfinite(t.compact_scale))
    throw py::value_error("compact_scale must be finite and >= 0");
  for (double v : {t.dense_fixed_s, t.dense_rate, t.sparse_fixed_s,
                   t.convert_s_per_elem, t.sparse_rate, t.copy_s_per_elem,
                   t.row_copy_s_per_elem})
    if (!(v >= 0.0) || !std::isfinite(v))
      throw py::value_error("cost terms must be finite and >= 0");
  return t;
}

py::dict DictOf(const CostTerms& t) {
  py::dict d;
  d["dense_fixed_s"] = t.dense_fixed_s;
  d["dense_rate"] = t.dense_rate;
  d["sparse_fixed_s"] = t.sparse_fixed_s;
  d["convert_s_per_elem"] = t.convert_s_per_elem;
  d["sparse_rate"] = t.sparse_rate;
  d["copy_s_per_elem"] = t.copy_s_per_elem;
  d["row_copy_s_per_elem"] = t.row_copy_s_per_elem;
  d["heterogeneous"] = t.heterogeneous;
  d["compact_scale"] = t.compact_scale;
  return d;
}

DecisionPolicy PolicyOf(const py::object& o) {
  DecisionPolicy p;
  if (o.is_none()) return p;
  const py::dict d = o.cast<py::dict>();
  RequireKeys(d, {"enter_margin", "stay_margin", "switch_margin", "tie_margin",
                  "min_gain_s", "min_gain_fraction", "min_gain_floor_s",
                  "analysis_s", "all_sparse_analysis_s", "calibration",
                  "calibration_max_loss"},
              "policy");
  p.enter_margin = Get<double>(d, "enter_margin", p.enter_margin);
  p.stay_margin = Get<double>(d, "stay_margin", p.stay_margin);
  p.switch_margin = Get<double>(d, "switch_margin", p.switch_margin);
  p.tie_margin = Get<double>(d, "tie_margin", p.tie_margin);
  p.min_gain_s = Get<double>(d, "min_gain_s", p.min_gain_s);
  p.min_gain_fraction =
      Get<double>(d, "min_gain_fraction", p.min_gain_fraction);
  p.min_gain_floor_s = Get<double>(d, "min_gain_floor_s", p.min_gain_floor_s);
  p.analysis_s = Get<double>(d, "analysis_s", p.analysis_s);
  if (!(p.analysis_s >= 0.0) || !std::isfinite(p.analysis_s))
    throw py::value_error("policy analysis_s must be finite and >= 0");
  p.all_sparse_analysis_s =
      Get<double>(d, "all_sparse_analysis_s", p.all_sparse_analysis_s);
  if (!std::isfinite(p.all_sparse_analysis_s))
    throw py::value_error(
        "policy all_sparse_analysis_s must be finite (negative: analysis_s)");
  // The family's calibration terms (a terms dict; None or absent: unknown).
  if (d.contains("calibration") && !d["calibration"].is_none())
    p.calibration = TermsOf(d["calibration"].cast<py::dict>());
  p.calibration_max_loss =
      Get<double>(d, "calibration_max_loss", p.calibration_max_loss);
  if (!(p.calibration_max_loss >= 0.0) ||
      !std::isfinite(p.calibration_max_loss))
    throw py::value_error(
        "policy calibration_max_loss must be finite and >= 0");
  return p;
}

RetimePolicy RetimePolicyOf(const py::object& o) {
  RetimePolicy p;
  if (o.is_none()) return p;
  const py::dict d = o.cast<py::dict>();
  RequireKeys(d, {"max_ratio", "first_period", "max_period", "confirm_runs",
                  "hold_runs"},
              "retime_policy");
  p.max_ratio = Get<double>(d, "max_ratio", p.max_ratio);
  p.first_period = Get<int64_t>(d, "first_period", p.first_period);
  p.max_period = Get<int64_t>(d, "max_period", p.max_period);
  p.confirm_runs = Get<int64_t>(d, "confirm_runs", p.confirm_runs);
  p.hold_runs = Get<int64_t>(d, "hold_runs", p.hold_runs);
  if (!(p.max_ratio >= 0.0) || !std::isfinite(p.max_ratio))
    throw py::value_error("retime_policy max_ratio must be finite and >= 0");
  if (p.max_period < 1)
    throw py::value_error("retime_policy max_period must be >= 1");
  return p;
}

const char* KindName(PlanKind k) {
  switch (k) {
    case PlanKind::kAllDense: return "all_dense";
    case PlanKind::kSplit: return "split";
    case PlanKind::kAllSparse: return "all_sparse";
  }
  return "?";
}

py::dict DictOf(const Plan& p) {
  py::dict d;
  d["kind"] = KindName(p.kind);
  d["bucket"] = p.bucket;
  d["threshold"] = p.threshold;
  d["compact"] = p.compact;
  d["predicted_s"] = p.predicted_s;
  d["all_dense_s"] = p.all_dense_s;
  d["best_sparse_s"] = p.best_sparse_s;
  return d;
}

Plan PlanOf(const py::dict& d) {
  Plan p;
  const std::string kind = Get<std::string>(d, "kind", "all_dense");
  if (kind == "all_dense") p.kind = PlanKind::kAllDense;
  else if (kind == "split") p.kind = PlanKind::kSplit;
  else if (kind == "all_sparse") p.kind = PlanKind::kAllSparse;
  else throw py::value_error("plan kind must be all_dense, split or all_sparse, got '" + kind + "'");
  p.bucket = Get<int>(d, "bucket", -1);
  p.threshold = Get<double>(d, "threshold", 0.0);
  p.compact = Get<bool>(d, "compact", false);
  p.predicted_s = Get<double>(d, "predicted_s", 0.0);
  return p;
}

// A profile from a (rows, nnz) pair of [B+1] arrays.
DensityProfile ProfileOf(const py::tuple& t) {
  if (t.size() != 2) throw py::value_error("profile must be (rows, nnz)");
  const auto rows = t[0].cast<Arr<double>>();
  const auto nnz = t[1].cast<Arr<double>>();
  if (rows.ndim() != 1 || rows.size() != nnz.size() || rows.size() < 2)
    throw py::value_error("profile rows and nnz must be 1-D of equal length >= 2");
  DensityProfile p;
  p.rows.assign(rows.data(), rows.data() + rows.size());
  p.nnz.assign(nnz.data(), nnz.data() + nnz.size());
  for (size_t j = 0; j < p.rows.size(); ++j)
    if (!(p.rows[j] >= 0.0) || !(p.nnz[j] >= 0.0))
      throw py::value_error("profile counts must be >= 0");
  return p;
}

py::tuple TupleOf(const DensityProfile& p) {
  py::array_t<double> rows(p.rows.size()), nnz(p.nnz.size());
  std::copy(p.rows.begin(), p.rows.end(), rows.mutable_data());
  std::copy(p.nnz.begin(), p.nnz.end(), nnz.mutable_data());
  return py::make_tuple(rows, nnz);
}

void BindCostModel(py::module_& mod) {
  mod.def("matmul_split_shape",
          [](int64_t m, int64_t k, int64_t k_live, int64_t n, bool weight_rows) {
            if (k_live < 0 || k_live > k) throw py::value_error("need 0 <= k_live <= k");
            return DictOf(MatMulSplitShape(m, k, k_live, n, weight_rows));
          },
          py::arg("m"), py::arg("k"), py::arg("k_live"), py::arg("n"),
          py::arg("weight_rows") = false,
          "The cost model's shape dict of a product op(a) [m, k] * op(b) [k, n] "
          "with k_live live columns (what SparseSplitMatMul uses; weight_rows: "
          "compaction copies whole rows of op(b), b not transposed).");
  mod.def("sddmm_split_shape",
          [](int64_t m, int64_t k, int64_t k_live, int64_t n) {
            if (k_live < 0 || k_live > k) throw py::value_error("need 0 <= k_live <= k");
            return DictOf(SddmmSplitShape(m, k, k_live, n));
          },
          py::arg("m"), py::arg("k"), py::arg("k_live"), py::arg("n"),
          "The cost model's shape dict of an SDDMM: mask [m, k] (k_live live "
          "columns), x [m, n], op(b) [k, n] (what SparseSplitSddmm uses).");
  mod.def("profile_from_row_nnz",
          [](const Arr<int64_t>& row_nnz, int64_t k, int buckets) {
            if (buckets < 1) throw py::value_error("buckets must be >= 1");
            for (int64_t i = 0; i < row_nnz.size(); ++i)
              if (row_nnz.data()[i] < 0 || row_nnz.data()[i] > k)
                throw py::value_error("row_nnz must be in [0, k]");
            return TupleOf(ProfileFromRowNnz(row_nnz.data(), row_nnz.size(), k, buckets));
          },
          py::arg("row_nnz"), py::arg("k"), py::arg("buckets") = 32,
          "Exact density profile (rows[B+1], nnz[B+1]) of rows with these nonzero "
          "counts: bucket 0 = empty rows, bucket j = density in ((j-1)/B, j/B].");
  mod.def("profile_from_histogram",
          [](const Arr<double>& hist, int64_t k, double total_nnz) {
            if (hist.ndim() != 1 || hist.size() < 1)
              throw py::value_error("histogram must be a nonempty 1-D array");
            return TupleOf(ProfileFromHistogram(hist.data(), hist.size(), k, total_nnz));
          },
          py::arg("histogram"), py::arg("k"), py::arg("total_nnz") = -1.0,
          "Approximate profile from the statistics' row-density histogram; nnz "
          "at bin centers, scaled to total_nnz when it is >= 0.");
  mod.def("predict_plan_seconds",
          [](const py::dict& shape, const py::tuple& profile, const py::dict& terms,
             int bucket, bool compact) {
            return PredictPlanSeconds(ShapeOf(shape), ProfileOf(profile),
                                      TermsOf(terms), bucket, compact);
          },
          py::arg("shape"), py::arg("profile"), py::arg("terms"), py::arg("bucket"),
          py::arg("compact") = false,
          "Predicted seconds of candidate `bucket` (-1 = all-dense).");
  mod.def("decide_split",
          [](const py::dict& shape, const py::tuple& profile, const py::dict& terms,
             const py::object& previous, const py::object& policy) {
            Plan prev;
            const bool has_prev = !previous.is_none();
            if (has_prev) prev = PlanOf(previous.cast<py::dict>());
            return DictOf(DecideSplit(ShapeOf(shape), ProfileOf(profile),
                                      TermsOf(terms), PolicyOf(policy),
                                      has_prev ? &prev : nullptr));
          },
          py::arg("shape"), py::arg("profile"), py::arg("terms"),
          py::arg("previous") = py::none(), py::arg("policy") = py::none(),
          "The split decision of the ops: plan dict (kind, bucket, threshold, "
          "compact, predicted_s, all_dense_s, best_sparse_s).");
  mod.def("fit_calibration",
          [](const py::dict& shape, const py::dict& t) {
            RequireKeys(t, {"rows_full", "rows_part", "dense_full_s", "dense_part_s",
                            "nnz_full", "nnz_thin", "nnz_part", "sparse_full_s",
                            "sparse_thin_s", "sparse_part_s", "copy_elems", "copy_s",
                             "row_copy_elems", "row_copy_s"},
                        "calibration");
            CalibrationTimings c;
            c.rows_full = Get<double>(t, "rows_full", 0);
            c.rows_part = Get<double>(t, "rows_part", 0);
            c.dense_full_s = Get<double>(t, "dense_full_s", 0);
            c.dense_part_s = Get<double>(t, "dense_part_s", 0);
            c.nnz_full = Get<double>(t, "nnz_full", 0);
            c.nnz_thin = Get<double>(t, "nnz_thin", 0);
            c.nnz_part = Get<double>(t, "nnz_part", 0);
            c.sparse_full_s = Get<double>(t, "sparse_full_s", 0);
            c.sparse_thin_s = Get<double>(t, "sparse_thin_s", 0);
            c.sparse_part_s = Get<double>(t, "sparse_part_s", 0);
            c.copy_elems = Get<double>(t, "copy_elems", 0);
            c.copy_s = Get<double>(t, "copy_s", 0);
            c.row_copy_elems = Get<double>(t, "row_copy_elems", 0);
            c.row_copy_s = Get<double>(t, "row_copy_s", 0);
            return DictOf(FitCalibration(ShapeOf(shape), c));
          },
          py::arg("shape"), py::arg("timings"),
          "Cost terms fitted to one calibration's timings (what an op does on its "
          "first automatic call).");
  mod.def("calibration_copy_rows",
          [](int64_t k, int64_t rows_full) {
            if (k < 1 || rows_full < 0)
              throw py::value_error("calibration_copy_rows: need k >= 1 and "
                                    "rows_full >= 0");
            return CalibrationCopyRows(k, rows_full);
          },
          py::arg("k"), py::arg("rows_full"),
          "Rows of k values the calibration's copy timing gathers every other "
          "column of (at least rows_full, and at least 2^16 values).");
  mod.attr("CALIBRATION_COPY_ELEMS") = kCalibrationCopyElems;
  mod.def("cost_problem_from_stats",
          [](const Arr<double>& stats) {
            if (stats.ndim() != 1 || stats.size() != kNumStats)
              throw py::value_error("expected a statistics vector of " +
                                    std::to_string(kNumStats) + " values, got " +
                                    std::to_string(stats.size()));
            SplitShape s;
            CostTerms t;
            const bool calibrated = ReadCostStats(stats.data(), &s, &t);
            py::dict d;
            d["shape"] = DictOf(s);
            d["terms"] = DictOf(t);
            d["calibrated"] = calibrated;
            return d;
          },
          py::arg("stats"),
          "The cost problem one statistics vector (or a mean of several) "
          "describes, as the op's cost model saw it (cc/core/cost_model.h "
          "ReadCostStats): {'shape': shape dict, 'terms': its problem "
          "family's terms after the call (rates 0: unknown), 'calibrated': "
          "bool}. The terms are the op library's; this module's own "
          "SplitFamilyModel objects are separate.");
  mod.attr("DECISION_BUCKETS") = 32;
  py::class_<FamilyModel>(mod, "SplitFamilyModel",
                          "Measured terms of one problem family: calibrated base "
                          "terms scaled by the median measured/predicted ratio of "
                          "the last calls.")
      .def(py::init<>())
      .def_property_readonly("calibrated", &FamilyModel::calibrated)
      .def("set_calibration",
           [](FamilyModel& f, const py::dict& t) { f.SetCalibration(TermsOf(t)); },
           py::arg("terms"))
      .def("terms", [](const FamilyModel& f) { return DictOf(f.Terms()); })
      .def("base_terms",
           [](const FamilyModel& f) { return DictOf(f.BaseTerms()); },
           "The calibration's terms, unscaled by the measured ratios.")
      .def("record",
           [](FamilyModel& f, const py::dict& shape, double rows_dense, bool compact,
              double dense_s, double rows_sparse, double nnz_sparse, double sparse_s,
              bool dense_one_time, bool sparse_one_time) {
             return f.Record(ShapeOf(shape), rows_dense, compact, dense_s,
                             rows_sparse, nnz_sparse, sparse_s, dense_one_time,
                             sparse_one_time);
           },
           py::arg("shape"), py::arg("rows_dense"), py::arg("compact"),
           py::arg("dense_s"), py::arg("rows_sparse"), py::arg("nnz_sparse"),
           py::arg("sparse_s"), py::arg("dense_one_time") = false,
           py::arg("sparse_one_time") = false,
           "Records one call's part times (seconds) against the base "
           "prediction; returns whether the dense time entered the ratios "
           "(not when dense_one_time: the time holds a one-time cost, see "
           "FamilyModel::Record; sparse_one_time keeps the sparse time out "
           "likewise).");
  py::class_<PlanMemory>(mod, "SplitPlanMemory",
                         "The last plan of one op instance (hysteresis).")
      .def(py::init<>())
      .def("decide",
           [](PlanMemory& m, const py::dict& shape, const py::tuple& profile,
              const py::dict& terms, const py::object& policy) {
             return DictOf(m.Decide(ShapeOf(shape), ProfileOf(profile),
                                    TermsOf(terms), PolicyOf(policy)));
           },
           py::arg("shape"), py::arg("profile"), py::arg("terms"),
           py::arg("policy") = py::none());
}

// The convolution's view of the cost model (cc/core/conv_cost.h): its
// SplitShape and its family key, for tests on recorded timings.
void BindConvCost(py::module_& mod) {
  auto geometry = [](int64_t n, int64_t h, int64_t w, int64_t c_in, int64_t kh,
                     int64_t kw, int64_t c_out, int64_t out_h, int64_t out_w) {
    for (int64_t v : {n, h, w, c_in, kh, kw, c_out, out_h, out_w})
      if (v < 0) throw py::value_error("convolution sizes must be >= 0");
    Conv2DGeometry g;
    g.n = n, g.h = h, g.w = w, g.c_in = c_in, g.kh = kh, g.kw = kw;
    g.c_out = c_out, g.out_h = out_h, g.out_w = out_w;
    return g;
  };
  mod.attr("conv_dense_one_time_calls") = kConvDenseOneTimeCalls;
  mod.attr("conv_sparse_one_time_calls") = kConvSparseOneTimeCalls;
  mod.attr("conv_hold_runs") = kConvHoldRuns;
  mod.attr("conv_zero_free_density") = kConvZeroFreeDensity;
  mod.attr("conv_zero_free_min_speedup") = kConvZeroFreeMinSpeedup;
  mod.def("conv_sparse_rows_allowed",
          [](const py::dict& shape, const py::tuple& profile,
             const py::dict& base_terms, const py::dict& terms,
             double density) {
            return ConvSparseRowsAllowed(ShapeOf(shape), ProfileOf(profile),
                                         TermsOf(base_terms), TermsOf(terms),
                                         density);
          },
          py::arg("shape"), py::arg("profile"), py::arg("base_terms"),
          py::arg("terms"), py::arg("density"),
          "The convolutions' zero-free rule (cc/core/conv_cost.h "
          "ConvSparseRowsAllowed): whether a call of this shape, profile and "
          "density (nnz / (m k)) may run images sparse, given its family's "
          "calibration terms and current (ratio-scaled) terms.");
  mod.attr("conv_split_min_speedup") = kConvSplitMinSpeedup;
  mod.attr("near_break_even_sample_run") = kNearBreakEvenSampleRun;
  mod.def("conv_split_agreed",
          [](const py::dict& shape, const py::tuple& profile,
             const py::dict& base_terms, const py::dict& terms, int bucket,
             bool compact, double split_extra_s) {
            return ConvSplitAgreed(ShapeOf(shape), ProfileOf(profile),
                                   TermsOf(base_terms), TermsOf(terms), bucket,
                                   compact, split_extra_s);
          },
          py::arg("shape"), py::arg("profile"), py::arg("base_terms"),
          py::arg("terms"), py::arg("bucket"), py::arg("compact") = false,
          py::arg("split_extra_s") = 0.0,
          "The convolutions' agreement rule (cc/core/conv_cost.h "
          "ConvSplitAgreed): whether the family's calibration terms and its "
          "current (ratio-scaled) terms both predict plan candidate `bucket` "
          "(threshold bucket / buckets; -1: all-dense, always true) at least "
          "conv_split_min_speedup times faster than the all-dense plan on "
          "this profile, the plan's seconds plus split_extra_s (its full "
          "count where all-dense calls count cheaply).");
  mod.def("conv_split_shape",
          [geometry](int64_t n, int64_t h, int64_t w, int64_t c_in,
                     int64_t c_live, int64_t kh, int64_t kw, int64_t c_out,
                     int64_t out_h, int64_t out_w) {
            if (c_live < 0 || c_live > c_in)
              throw py::value_error("need 0 <= c_live <= c_in");
            return DictOf(ConvSplitShape(
                geometry(n, h, w, c_in, kh, kw, c_out, out_h, out_w), c_live,
                true));
          },
          py::arg("n"), py::arg("h"), py::arg("w"), py::arg("c_in"),
          py::arg("c_live"), py::arg("kh"), py::arg("kw"), py::arg("c_out"),
          py::arg("out_h"), py::arg("out_w"),
          "The cost model's shape dict of SparseSplitConv2D on input [n, h, w, "
          "c_in] (c_live live channels), filter [kh, kw, c_in, c_out], output "
          "[n, out_h, out_w, c_out]: rows = images.");
  mod.def("conv_batch_bucket", &ConvBatchBucket, py::arg("n"),
          "Batch bucket of a convolution family: the smallest power of two "
          ">= n (families at different buckets never share terms).");
  mod.def("conv_family_key",
          [geometry](int64_t op, int64_t dtype, int64_t n, int64_t h, int64_t w,
                     int64_t c_in, int64_t kh, int64_t kw, int64_t c_out,
                     int64_t out_h, int64_t out_w) {
            py::list key;
            for (int64_t v : ConvFamilyKey(op, dtype,
                                           geometry(n, h, w, c_in, kh, kw,
                                                    c_out, out_h, out_w)))
              key.append(v);
            return key;
          },
          py::arg("op"), py::arg("dtype"), py::arg("n"), py::arg("h"),
          py::arg("w"), py::arg("c_in"), py::arg("kh"), py::arg("kw"),
          py::arg("c_out"), py::arg("out_h"), py::arg("out_w"),
          "The family key (list of ints) the SparseSplitConv2D kernels use for "
          "this call (strides, dilations 1, no padding): calls with equal keys "
          "share cost terms.");
}

// ---- How much of the analysis a call pays (ChooseAnalysis & co.) ---------

AnalysisPolicy AnalysisPolicyOf(const py::object& o) {
  AnalysisPolicy p;
  if (o.is_none()) return p;
  const py::dict d = o.cast<py::dict>();
  RequireKeys(d, {"min_period", "max_period", "full_budget", "sample_budget",
                  "min_sample_rows", "near_margin", "max_sample_period",
                  "sample_all_sparse", "escalate_budget"},
              "analysis policy");
  p.sample_all_sparse =
      Get<bool>(d, "sample_all_sparse", p.sample_all_sparse);
  p.min_period = Get<int>(d, "min_period", p.min_period);
  p.max_period = Get<int>(d, "max_period", p.max_period);
  p.full_budget = Get<double>(d, "full_budget", p.full_budget);
  p.sample_budget = Get<double>(d, "sample_budget", p.sample_budget);
  p.min_sample_rows = Get<int64_t>(d, "min_sample_rows", p.min_sample_rows);
  p.near_margin = Get<double>(d, "near_margin", p.near_margin);
  p.escalate_budget = Get<double>(d, "escalate_budget", p.escalate_budget);
  p.max_sample_period =
      Get<int>(d, "max_sample_period", p.max_sample_period);
  return p;
}

AnalysisHistory HistoryOf(const py::dict& d) {
  RequireKeys(d, {"seen_full", "calls_since_full", "zero_row_frac",
                  "dead_col_frac", "samples_dense", "calls_since_sample"},
              "history");
  AnalysisHistory h;
  h.seen_full = Get<bool>(d, "seen_full", false);
  h.calls_since_full = Get<int64_t>(d, "calls_since_full", 0);
  h.zero_row_frac = Get<double>(d, "zero_row_frac", 0.0);
  h.dead_col_frac = Get<double>(d, "dead_col_frac", 0.0);
  h.samples_dense = Get<int64_t>(d, "samples_dense", 0);
  h.calls_since_sample = Get<int64_t>(d, "calls_since_sample", 0);
  h.near_break_even = Get<bool>(d, "near_break_even", false);
  return h;
}

py::dict DictOf(const AnalysisHistory& h) {
  py::dict d;
  d["seen_full"] = h.seen_full;
  d["calls_since_full"] = h.calls_since_full;
  d["zero_row_frac"] = h.zero_row_frac;
  d["dead_col_frac"] = h.dead_col_frac;
  d["samples_dense"] = h.samples_dense;
  d["calls_since_sample"] = h.calls_since_sample;
  d["near_break_even"] = h.near_break_even;
  return d;
}

const char* ModeName(AnalysisMode m) {
  switch (m) {
    case AnalysisMode::kFull: return "full";
    case AnalysisMode::kSample: return "sample";
    case AnalysisMode::kSkip: return "skip";
    case AnalysisMode::kSampleSparse: return "sample_sparse";
  }
  return "?";
}

void BindAnalysis(py::module_& mod) {
  mod.def("max_saving_seconds",
          [](const py::dict& shape, const py::dict& terms, double zero_row_frac,
             double dead_col_frac) {
            return MaxSavingSeconds(ShapeOf(shape), TermsOf(terms),
                                    zero_row_frac, dead_col_frac);
          },
          py::arg("shape"), py::arg("terms"), py::arg("zero_row_frac") = 0.0,
          py::arg("dead_col_frac") = 0.0,
          "Upper bound of the seconds any plan but plain all-dense can save "
          "(inf when the terms are unknown).");
  mod.def("recalibration_due",
          [](double calibrated_density, double density, int64_t calls_since,
             int recalibrations) {
            return RecalibrationDue(calibrated_density, density, calls_since,
                                    recalibrations);
          },
          py::arg("calibrated_density"), py::arg("density"),
          py::arg("calls_since"), py::arg("recalibrations"),
          "Whether a calibrated family times its paths again (the default "
          "RecalibrationPolicy of cost_model.h): the density (nnz / (m k)) "
          "moved 2x either way and by >= 0.05 since its last calibration, "
          ">= 32 automatic calls ago, fewer than 8 recalibrations so far.");
  mod.def("recalibration_calls",
          [](const py::iterable& calls) {
            // One family's automatic calls in order, as (op instance id,
            // density); the first calibrates the family (SplitCall::Decide).
            FamilyCalibrationRecord family;
            std::map<int64_t, OpCalibrationRecord> ops;
            py::list out;
            int64_t i = 0;
            for (const py::handle& item : calls) {
              const py::tuple pair = py::reinterpret_borrow<py::object>(item)
                                         .cast<py::tuple>();
              if (pair.size() != 2)
                throw py::value_error(
                    "recalibration_calls: each call is (op id, density)");
              OpCalibrationRecord* op = &ops[pair[0].cast<int64_t>()];
              const double density = pair[1].cast<double>();
              if (i == 0) {
                NoteCalibration(&family, op, density);
              } else if (CountCallRecalibrationDue(&family, op, density)) {
                out.append(i);
              }
              ++i;
            }
            return out;
          },
          py::arg("calls"),
          "Indices of the calls that recalibrate, for one family's automatic "
          "calls given in order as (op instance id, density nnz / (m k)) "
          "pairs, the first of which calibrates the family: the per-op "
          "recalibration records of cost_model.h with the default "
          "RecalibrationPolicy.");
  mod.def("full_count_period",
          [](double count_s, double dense_s, const py::object& ap) {
            return FullCountPeriod(count_s, dense_s, AnalysisPolicyOf(ap));
          },
          py::arg("count_s"), py::arg("dense_s"),
          py::arg("analysis_policy") = py::none(),
          "Calls between full counts for a full count of count_s seconds and a "
          "predicted dense call of dense_s seconds.");
  mod.def("sample_may_count_fully",
          [](double count_s, double dense_s, const py::dict& history,
             bool change_pending, const py::object& ap) {
            return SampleMayCountFully(count_s, dense_s, HistoryOf(history),
                                       change_pending, AnalysisPolicyOf(ap));
          },
          py::arg("count_s"), py::arg("dense_s"), py::arg("history"),
          py::arg("change_pending") = false,
          py::arg("analysis_policy") = py::none(),
          "Whether a sample that did not say all-dense may lead to a full "
          "count (cc/core/cost_model.h, SampleMayCountFully).");
  mod.def("choose_analysis",
          [](const py::dict& shape, const py::dict& terms, const py::dict& history,
             const py::object& previous, double count_s_per_elem, bool full_stats,
             const py::object& policy, const py::object& ap) {
            Plan prev;
            const bool has_prev = !previous.is_none();
            if (has_prev) prev = PlanOf(previous.cast<py::dict>());
            return std::string(ModeName(ChooseAnalysis(
                ShapeOf(shape), TermsOf(terms), PolicyOf(policy),
                AnalysisPolicyOf(ap), HistoryOf(history),
                has_prev ? &prev : nullptr, count_s_per_elem, full_stats)));
          },
          py::arg("shape"), py::arg("terms"), py::arg("history"),
          py::arg("previous") = py::none(), py::arg("count_s_per_elem") = 0.0,
          py::arg("full_stats") = false, py::arg("policy") = py::none(),
          py::arg("analysis_policy") = py::none(),
          "How much an automatic call counts: 'full', 'sample', 'skip' or "
          "'sample_sparse' (cc/core/cost_model.h, ChooseAnalysis).");
  mod.def("sample_stride",
          [](int64_t phys_rows, int64_t phys_cols, double dense_s,
             double count_s_per_elem, const py::object& ap) {
            return SampleStride(phys_rows, phys_cols, dense_s, count_s_per_elem,
                                AnalysisPolicyOf(ap));
          },
          py::arg("phys_rows"), py::arg("phys_cols"), py::arg("dense_s"),
          py::arg("count_s_per_elem"), py::arg("analysis_policy") = py::none(),
          "Stride over the physical rows of a sampled call (1: count all).");
  mod.def("estimate_profile",
          [](const Arr<int64_t>& row_nnz, int64_t k_counted, int64_t rows_total,
             int64_t k_total, int buckets) {
            if (buckets < 1) throw py::value_error("buckets must be >= 1");
            if (k_counted < 1 || k_total < k_counted || rows_total < row_nnz.size())
              throw py::value_error(
                  "need 1 <= k_counted <= k_total and rows_total >= len(row_nnz)");
            for (int64_t i = 0; i < row_nnz.size(); ++i)
              if (row_nnz.data()[i] < 0 || row_nnz.data()[i] > k_counted)
                throw py::value_error("row_nnz must be in [0, k_counted]");
            return TupleOf(EstimateProfile(row_nnz.data(), row_nnz.size(),
                                           k_counted, rows_total, k_total, buckets));
          },
          py::arg("row_nnz"), py::arg("k_counted"), py::arg("rows_total"),
          py::arg("k_total"), py::arg("buckets") = 32,
          "Profile of rows_total rows of k_total values estimated from a "
          "sample's counts (row_nnz over k_counted values each).");
  mod.def("sample_says_dense",
          [](const py::dict& shape, const py::tuple& profile, const py::dict& terms,
             const py::object& policy, const py::object& ap) {
            return SampleSaysDense(ShapeOf(shape), ProfileOf(profile),
                                   TermsOf(terms), PolicyOf(policy),
                                   AnalysisPolicyOf(ap));
          },
          py::arg("shape"), py::arg("profile"), py::arg("terms"),
          py::arg("policy") = py::none(), py::arg("analysis_policy") = py::none(),
          "Whether a sampled estimate lets the call run all-dense with no full "
          "count (False: near the break-even, count everything).");
  mod.def("m_bucket", &MBucket, py::arg("m"),
          "Bucket of m (rows of the activation) in the family keys.");
  mod.def("n_bucket", &NBucket, py::arg("n"),
          "Bucket of n (columns of op(b)) in the family keys.");
  mod.def("matmul_family_key",
          [](int64_t family_op, int64_t dtype, int64_t m, int64_t k, int64_t n,
             bool transpose_b) {
            py::list key;
            for (int64_t v : MatMulFamilyKey(family_op, dtype, m, k, n, transpose_b))
              key.append(v);
            return key;
          },
          py::arg("family_op"), py::arg("dtype"), py::arg("m"), py::arg("k"),
          py::arg("n"), py::arg("transpose_b") = false,
          "Family key of a SparseSplitMatMul / SparseSplitSddmm CPU call.");
  mod.def("sampled_all_sparse_count_share",
          [](int64_t sample_stride, const py::object& ap) {
            return SampledAllSparseCountShare(AnalysisPolicyOf(ap),
                                              sample_stride);
          },
          py::arg("sample_stride"), py::arg("analysis_policy") = py::none(),
          "The share of a full count an all-sparse plan deciding on samples "
          "of every sample_stride-th value pays per call "
          "(DecisionPolicy.all_sparse_analysis_s = share * full count "
          "seconds).");
  mod.def("analysis_policy_defaults", [] {
    const AnalysisPolicy p;
    py::dict d;
    d["min_period"] = p.min_period;
    d["max_period"] = p.max_period;
    d["full_budget"] = p.full_budget;
    d["sample_budget"] = p.sample_budget;
    d["min_sample_rows"] = p.min_sample_rows;
    d["near_margin"] = p.near_margin;
    d["escalate_budget"] = p.escalate_budget;
    d["max_sample_period"] = p.max_sample_period;
    d["sample_all_sparse"] = p.sample_all_sparse;
    return d;
  }, "The AnalysisPolicy the ops use.");
  auto fam = py::reinterpret_borrow<py::object>(mod.attr("SplitFamilyModel"));
  fam.attr("record_count") = py::cpp_function(
      [](FamilyModel& f, double elems, double seconds) {
        f.RecordCount(elems, seconds);
      },
      py::is_method(fam), py::arg("elems"), py::arg("seconds"),
      "Records one full count of elems values that took seconds.");
  fam.attr("count_seconds_per_elem") = py::cpp_function(
      [](const FamilyModel& f) { return f.CountSecondsPerElem(); },
      py::is_method(fam), "Median seconds per counted value (0: none).");
  auto mem = py::reinterpret_borrow<py::object>(mod.attr("SplitPlanMemory"));
  mem.attr("choose_analysis") = py::cpp_function(
      [](PlanMemory& m, const py::dict& shape, const py::dict& terms,
         double count_s_per_elem, bool full_stats, const py::object& policy,
         const py::object& ap) {
        return std::string(ModeName(m.ChooseAnalysis(
            ShapeOf(shape), TermsOf(terms), PolicyOf(policy),
            AnalysisPolicyOf(ap), count_s_per_elem, full_stats)));
      },
      py::is_method(mem), py::arg("shape"), py::arg("terms"),
      py::arg("count_s_per_elem"), py::arg("full_stats") = false,
      py::arg("policy") = py::none(), py::arg("analysis_policy") = py::none());
  mem.attr("change_pending") = py::cpp_function(
      [](PlanMemory& m) { return m.change_pending(); }, py::is_method(mem),
      "Whether the last full count's decision wanted the other side and was "
      "held or confirming (PlanMemory::change_pending).");
  mem.attr("record_analysis") = py::cpp_function(
      [](PlanMemory& m, bool full, double zero_row_frac, double dead_col_frac,
         int64_t continue_backoff_from) {
        m.RecordAnalysis(full, zero_row_frac, dead_col_frac,
                         continue_backoff_from);
      },
      py::is_method(mem), py::arg("full"), py::arg("zero_row_frac") = 0.0,
      py::arg("dead_col_frac") = 0.0, py::arg("continue_backoff_from") = -1,
      "Records one automatic call's analysis (PlanMemory::RecordAnalysis); "
      "continue_backoff_from >= 0: a full count the sample back-off led to "
      "that ran all-dense continues the back-off from that many samples.");
  mem.attr("choose_analysis_and_backoff") = py::cpp_function(
      [](PlanMemory& m, const py::dict& shape, const py::dict& terms,
         double count_s_per_elem, bool full_stats, const py::object& policy,
         const py::object& ap) {
        int64_t before = 0;
        const AnalysisMode mode = m.ChooseAnalysis(
            ShapeOf(shape), TermsOf(terms), PolicyOf(policy),
            AnalysisPolicyOf(ap), count_s_per_elem, full_stats, &before);
        return py::make_tuple(std::string(ModeName(mode)), before);
      },
      py::is_method(mem), py::arg("shape"), py::arg("terms"),
      py::arg("count_s_per_elem"), py::arg("full_stats") = false,
      py::arg("policy") = py::none(), py::arg("analysis_policy") = py::none(),
      "choose_analysis and the history's samples_dense before the call, "
      "from one lock (what SplitCall::ChooseAnalysis reads): (mode, "
      "samples_dense_before).");
  mem.attr("note_all_dense_without_count") = py::cpp_function(
      [](PlanMemory& m, bool sampled, bool near_break_even) {
        m.NoteAllDenseWithoutCount(sampled, near_break_even);
      },
      py::is_method(mem), py::arg("sampled") = false,
      py::arg("near_break_even") = false,
      "What an automatic call that runs all-dense on an accepted sample or "
      "no count notes (PlanMemory::NoteAllDenseWithoutCount): the all-dense "
      "plan, the analysis history, and the call in the re-time schedule; "
      "near_break_even: a sample the op's own rules kept all-dense (a "
      "back-off period of at most 2^kNearBreakEvenSampleRun calls).");
  mem.attr("decide_and_retime") = py::cpp_function(
      [](PlanMemory& m, const py::dict& shape, const py::tuple& profile,
         const py::dict& terms, const py::object& policy,
         const py::object& retime_policy) {
        bool retimed = false;
        Plan decided;
        const Plan run = m.DecideAndRetime(
            ShapeOf(shape), ProfileOf(profile), TermsOf(terms),
            PolicyOf(policy), RetimePolicyOf(retime_policy), &retimed,
            &decided);
        py::dict d;
        d["plan"] = DictOf(run);
        d["decided"] = DictOf(decided);
        d["retimed"] = retimed;
        return d;
      },
      py::is_method(mem), py::arg("shape"), py::arg("profile"),
      py::arg("terms"), py::arg("policy") = py::none(),
      py::arg("retime_policy") = py::none(),
      "The ops' decision with re-timing (PlanMemory::DecideAndRetime): "
      "{'plan': the plan to run now, 'decided': the decided plan (remembered), "
      "'retimed': whether 'plan' is the other side's re-timed plan}.");
  mem.attr("retime_state") = py::cpp_function(
      [](PlanMemory& m) {
        const RetimeState st = m.retime_state();
        py::dict d;
        d["side"] = st.side;
        d["calls_on_side"] = st.calls_on_side;
        d["next_retime"] = st.next_retime;
        d["period"] = st.period;
        d["retimes"] = st.retimes;
        d["other_runs"] = st.other_runs;
        d["confirmations"] = st.confirmations;
        d["side_runs"] = st.side_runs;
        d["holds"] = st.holds;
        return d;
      },
      py::is_method(mem),
      "This op instance's re-time schedule: side (0 all-dense, 1 sparse rows, "
      "-1 none), calls_on_side, next_retime, period, retimes, other_runs "
      "(calls that ran the other side since the side began), confirmations "
      "(runs that confirmed a change of side, RetimePolicy::confirm_runs), "
      "side_runs (calls that ran the side's plan since it began, its "
      "confirming runs included), holds (changes of side held, "
      "RetimePolicy::hold_runs).");
  mem.attr("note_dense_shape") = py::cpp_function(
      [](PlanMemory& m, int64_t rows, int64_t kc, bool compact,
         int64_t one_time_calls) {
        return m.NoteDenseShape(rows, kc, compact, one_time_calls);
      },
      py::is_method(mem), py::arg("m"), py::arg("kc"), py::arg("compact"),
      py::arg("one_time_calls") = 1,
      "Whether this is one of the op's first one_time_calls all-dense calls "
      "at (m, kc, compact), counting it (what the ops pass record() as "
      "dense_one_time; the convolutions pass conv_dense_one_time_calls, a "
      "re-timed call 1).");
  mem.attr("note_sparse_shape") = py::cpp_function(
      [](PlanMemory& m, int64_t rows, int64_t one_time_calls) {
        return m.NoteSparseShape(rows, one_time_calls);
      },
      py::is_method(mem), py::arg("m"), py::arg("one_time_calls"),
      "Whether this is one of the op's first one_time_calls calls with "
      "sparse rows at m rows, counting it (what the ops pass record() as "
      "sparse_one_time; the convolutions pass conv_sparse_one_time_calls, "
      "the matmul ops 0: never).");
  mod.def("retime_policy_defaults", [] { return RetimeDictOf(RetimePolicy()); },
          "The RetimePolicy the matmul ops use (the default).");
  mod.def("conv_retime_policy", [] { return RetimeDictOf(ConvRetimePolicy()); },
          "The RetimePolicy the convolution ops use (ConvRetimePolicy, "
     "conv_cost.h: the default with hold_runs = conv_hold_runs).");
  mod.def("other_side_plan",
          [](const py::dict& shape, const py::tuple& profile, const py::dict& terms,
             const py::dict& decided, const py::object& policy) -> py::object {
            Plan other;
            if (!OtherSidePlan(ShapeOf(shape), ProfileOf(profile), TermsOf(terms),
                               PolicyOf(policy), PlanOf(decided), &other))
              return py::none();
            return DictOf(other);
          },
          py::arg("shape"), py::arg("profile"), py::arg("terms"),
          py::arg("decided"), py::arg("policy") = py::none(),
          "The plan a re-time of `decided` runs (OtherSidePlan): all-dense "
          "for a plan with sparse rows, every row sparse for all-dense; or None.");
  mem.attr("note_sampled_full_stayed_dense") = py::cpp_function(
      [](PlanMemory& m, int64_t samples_dense) {
        m.NoteSampledFullStayedDense(samples_dense);
      },
      py::is_method(mem), py::arg("samples_dense"),
      "After a full count a sample asked for decided all-dense: one more "
      "all-dense sample for the back-off, from samples_dense "
      "(PlanMemory::NoteSampledFullStayedDense).");
  mem.attr("note_dense_call_without_decision") = py::cpp_function(
      [](PlanMemory& m) { m.NoteDenseCallWithoutDecision(); },
      py::is_method(mem),
      "An all-dense call without a decision counts in the re-time schedule "
      "(PlanMemory::NoteDenseCallWithoutDecision).");
  mem.attr("retime_falls_due") = py::cpp_function(
      [](PlanMemory& m) { return m.RetimeFallsDue(); }, py::is_method(mem),
      "Whether the next all-dense decision is due to re-time "
      "(PlanMemory::RetimeFallsDue).");
  mem.attr("remember_all_dense") = py::cpp_function(
      [](PlanMemory& m, int64_t continue_backoff_from) {
        m.RememberAllDense(continue_backoff_from);
      },
      py::is_method(mem), py::arg("continue_backoff_from") = -1);
  mem.attr("history") = py::cpp_function(
      [](PlanMemory& m) { return DictOf(m.history()); }, py::is_method(mem));
}


// ---- Convolution kernels (cc/core/direct_conv2d.h, sparse_conv2d.h) -------
// NHWC input x [N, H, W, C_in], HWIO filter [KH, KW, C_in, C_out]; padding
// "SAME", "VALID" or explicit (top, bottom, left, right).

// A sequence of ints as a vector (ValueError naming `what` otherwise).
std::vector<int64_t> IntsOf(const py::object& o, const char* what) {
  std::vector<int64_t> v;
  try {
    for (const py::handle& e : py::reinterpret_borrow<py::sequence>(o))
      v.push_back(e.cast<int64_t>());
  } catch (const py::cast_error&) {
    throw py::value_error(std::string(what) + " must be a sequence of ints");
  }
  return v;
}

Conv2DGeometry ConvGeometryOf(const std::vector<int64_t>& xs, int64_t kh,
                              int64_t kw, int64_t c_out,
                              const py::object& strides_o,
                              const py::object& dilations_o,
                              const py::object& padding) {
  const std::vector<int64_t> strides = IntsOf(strides_o, "strides");
  const std::vector<int64_t> dilations = IntsOf(dilations_o, "dilations");
  if (xs.size() != 4)
    throw py::value_error("x must be 4-D [N, H, W, C_in] (NHWC), got " +
                          std::to_string(xs.size()) + "-D");
  if (strides.size() != 2 || dilations.size() != 2 || strides[0] < 1 ||
      strides[1] < 1 || dilations[0] < 1 || dilations[1] < 1)
    throw py::value_error("strides and dilations must be two ints >= 1 (H, W)");
  if (kh < 1 || kw < 1 || c_out < 0)
    throw py::value_error("filter sizes must be positive");
  Conv2DGeometry g;
  g.n = xs[0];
  g.h = xs[1];
  g.w = xs[2];
  g.c_in = xs[3];
  g.kh = kh;
  g.kw = kw;
  g.c_out = c_out;
  g.stride_h = strides[0];
  g.stride_w = strides[1];
  g.dil_h = dilations[0];
  g.dil_w = dilations[1];
  int code = 0;
  std::vector<int64_t> pads(4, 0);
  if (py::isinstance<py::str>(padding)) {
    const std::string p = padding.cast<std::string>();
    if (p == "SAME") code = 1;
    else if (p == "VALID") code = 0;
    else throw py::value_error("padding must be 'SAME', 'VALID' or 4 ints");
  } else {
    pads = IntsOf(padding, "padding");
    if (pads.size() != 4 ||
        *std::min_element(pads.begin(), pads.end()) < 0)
      throw py::value_error("explicit padding must be 4 ints >= 0 "
                            "(top, bottom, left, right)");
    code = 2;
  }
  const char* err = nullptr;
  if (!ConvOutputSize(g.h, g.kh, g.stride_h, g.dil_h, code, pads[0], pads[1],
                      &g.out_h, &g.pad_top, &err) ||
      !ConvOutputSize(g.w, g.kw, g.stride_w, g.dil_w, code, pads[2], pads[3],
                      &g.out_w, &g.pad_left, &err))
    throw py::value_error(err);
  return g;
}

template <typename T>
std::vector<int64_t> ShapeOf(const Arr<T>& a) {
  return std::vector<int64_t>(a.shape(), a.shape() + a.ndim());
}

template <typename T>
Conv2DGeometry ForwardGeometry(const Arr<T>& x, const Arr<T>& f,
                               const py::object& strides,
                               const py::object& dilations,
                               const py::object& padding) {
  if (f.ndim() != 4)
    throw py::value_error("filter must be 4-D [KH, KW, C_in, C_out] (HWIO)");
  const Conv2DGeometry g = ConvGeometryOf(ShapeOf(x), f.shape(0), f.shape(1),
                                          f.shape(3), strides, dilations,
                                          padding);
  if (f.shape(2) != g.c_in)
    throw py::value_error("filter C_in " + std::to_string(f.shape(2)) +
                          " != input C_in " + std::to_string(g.c_in));
  return g;
}

template <typename T>
py::array_t<T> DirectConvPy(const Arr<T>& x, const Arr<T>& f,
                            const py::object& strides,
                            const py::object& dilations,
                            const py::object& padding, bool pixel_csr,
                            int threads) {
  const Conv2DGeometry g = ForwardGeometry(x, f, strides, dilations, padding);
  py::array_t<T> y({g.n, g.out_h, g.out_w, g.c_out});
  {
    py::gil_scoped_release release;
    auto pfor = ThreadFor(threads);
    std::vector<int64_t> imgs(g.n);
    for (int64_t i = 0; i < g.n; ++i) imgs[i] = i;
    if (!pixel_csr) {
      DirectConv2DForward<T>(x.data(), g, f.data(), nullptr, g.n,
                             y.mutable_data(), pfor);
    } else {
      std::vector<int64_t> image_nnz(g.n), chan_nnz(g.c_in);
      CountConvNonzeros<T>(x.data(), g, image_nnz.data(), chan_nnz.data(), pfor);
      PixelCsr<T> csr;
      BuildPixelCsr<T>(x.data(), g, imgs.data(), g.n, image_nnz.data(), &csr,
                       pfor);
      SparseConv2DForward<T>(csr, g, imgs.data(), g.n, f.data(),
                             y.mutable_data(), pfor);
    }
  }
  return y;
}

template <typename T>
py::array_t<T> DirectFilterGradPy(const Arr<T>& x, const Arr<T>& dy,
                                  int64_t kh, int64_t kw,
                                  const py::object& strides,
                                  const py::object& dilations,
                                  const py::object& padding, bool pixel_csr,
                                  int threads) {
  if (dy.ndim() != 4) throw py::value_error("dy must be 4-D [N, OH, OW, C_out]");
  const Conv2DGeometry g = ConvGeometryOf(ShapeOf(x), kh, kw, dy.shape(3),
                                          strides, dilations, padding);
  if (dy.shape(0) != g.n || dy.shape(1) != g.out_h || dy.shape(2) != g.out_w)
    throw py::value_error("dy shape does not match the convolution's output [" +
                          std::to_string(g.n) + ", " + std::to_string(g.out_h) +
                          ", " + std::to_string(g.out_w) + ", C_out]");
  py::array_t<T> df({g.kh, g.kw, g.c_in, g.c_out});
  std::fill(df.mutable_data(), df.mutable_data() + df.size(), T(0));
  {
    py::gil_scoped_release release;
    auto pfor = ThreadFor(threads);
    if (!pixel_csr) {
      DirectConv2DBackpropFilter<T>(x.data(), g, dy.data(), nullptr, g.n,
                                    df.mutable_data(), pfor);
    } else {
      std::vector<int64_t> imgs(g.n), image_nnz(g.n), chan_nnz(g.c_in);
      for (int64_t i = 0; i < g.n; ++i) imgs[i] = i;
      CountConvNonzeros<T>(x.data(), g, image_nnz.data(), chan_nnz.data(), pfor);
      if (FilterGradBlocks(g, g.n) >= 2) {
        PixelCsr<T> csr;
        BuildPixelCsr<T>(x.data(), g, imgs.data(), g.n, image_nnz.data(), &csr,
                         pfor);
        SparseConv2DBackpropFilterPixels<T>(csr, g, imgs.data(), g.n, dy.data(),
                                            df.mutable_data(), pfor);
      } else {
        ChannelCsr<T> csc;
        BuildChannelCsr<T>(x.data(), g, imgs.data(), g.n, &csc, pfor);
        SparseConv2DBackpropFilter<T>(csc, g, imgs.data(), dy.data(),
                                      df.mutable_data(), pfor);
      }
    }
  }
  return df;
}

template <typename T>
void BindConv(py::module_& mod) {
  mod.def("direct_conv2d", &DirectConvPy<T>, py::arg("x"), py::arg("filter"),
          py::arg("strides") = py::make_tuple(1, 1),
          py::arg("dilations") = py::make_tuple(1, 1),
          py::arg("padding") = py::str("SAME"), py::arg("pixel_csr") = false,
          py::arg("threads") = DefaultThreads(),
          "conv2d(x, filter) (NHWC x [N, H, W, C_in], HWIO filter [KH, KW, C_in,\n"
          "C_out] -> [N, OH, OW, C_out]) by the zero-skipping direct kernel\n"
          "(SparseTrain, Gong et al. 2019, arXiv 1911.10175), or with\n"
          "pixel_csr=True by the pixel-CSR kernel (count + CSR build + gather\n"
          "conv). strides/dilations: (H, W); padding 'SAME', 'VALID' or\n"
          "(top, bottom, left, right). Raises ValueError on bad shapes.");
  mod.def("direct_conv2d_backprop_filter", &DirectFilterGradPy<T>, py::arg("x"),
          py::arg("dy"), py::arg("kh"), py::arg("kw"),
          py::arg("strides") = py::make_tuple(1, 1),
          py::arg("dilations") = py::make_tuple(1, 1),
          py::arg("padding") = py::str("SAME"), py::arg("pixel_csr") = false,
          py::arg("threads") = DefaultThreads(),
          "Filter gradient [KH, KW, C_in, C_out] of conv2d for input x [N, H,\n"
          "W, C_in] and output gradient dy [N, OH, OW, C_out], skipping zeros\n"
          "of x: the direct kernel, or the pixel-CSR one with pixel_csr=True.\n"
          "Raises ValueError on bad shapes.");
}
}  // namespace

// ------------------------------------------- bfloat16 / float16 kernels --
// The 16-bit kernels on uint16 bit patterns (numpy has no bfloat16): the
// same CSR build, SpMM and SDDMM the ops run, with the instruction-set path
// chosen from CPUID or forced (isa: -1 auto, 0 scalar, 1 AVX2, 2 AVX-512),
// so tests can compare the paths' bits.
namespace lowp_py {

using U16 = py::array_t<uint16_t, py::array::c_style | py::array::forcecast>;

struct IsaScope {
  explicit IsaScope(int isa) { ForceLowPrecisionIsa(isa); }
  ~IsaScope() { ForceLowPrecisionIsa(-1); }
};

// Forces the bfloat16 CsrSpmm kernel for one call (ForceBf16SpmmKernel).
struct Bf16KernelScope {
  explicit Bf16KernelScope(int kernel) { ForceBf16SpmmKernel(kernel); }
  ~Bf16KernelScope() { ForceBf16SpmmKernel(-1); }
};

template <typename S>
py::array_t<uint16_t> SpmmT(const U16& a, const U16& b, bool ta, int isa,
                            int threads, int path) {
  if (a.ndim() != 2 || b.ndim() != 2)
    throw py::value_error("a and b must be 2-D");
  const int64_t pr = a.shape(0), pc = a.shape(1);
  const int64_t m = ta ? pc : pr, k = ta ? pr : pc, n = b.shape(1);
  if (b.shape(0) != k) throw py::value_error("inner dimensions differ");
  py::array_t<uint16_t> out({m, n});
  {
    py::gil_scoped_release release;
    IsaScope scope(isa);
    Bf16KernelScope kernel_scope(path);
    const ParallelFor pfor = ThreadFor(threads);
    const S* ap = reinterpret_cast<const S*>(a.data());
    std::vector<int64_t> rn(m), cn(k), rows(m);
    for (int64_t i = 0; i < m; ++i) rows[i] = i;
    CountNonzeros<S>(ap, pr, pc, ta, rn.data(), cn.data(), pfor);
    Csr<S> csr;
    BuildCsr<S>(ap, pr, pc, ta, rows.data(), m, rn.data(), cn.data(), &csr,
                pfor);
    S* c = reinterpret_cast<S*>(out.mutable_data());
    if (k == 0) {
      std::memset(c, 0, sizeof(S) * m * n);
    } else {
      CsrSpmm<S>(csr, rows.data(), m, reinterpret_cast<const S*>(b.data()), k,
                 n, n, c, n, pfor);
    }
  }
  return out;
}

template <typename S>
py::array_t<uint16_t> SddmmT(const U16& mask, const U16& x, const U16& y,
                             int isa, int threads) {
  if (mask.ndim() != 2 || x.ndim() != 2 || y.ndim() != 2)
    throw py::value_error("mask, x and y must be 2-D");
  const int64_t m = mask.shape(0), k = mask.shape(1), n = x.shape(1);
  if (x.shape(0) != m || y.shape(0) != k || y.shape(1) != n)
    throw py::value_error("shapes must be mask [m,k], x [m,n], y [k,n]");
  py::array_t<uint16_t> out({m, k});
  {
    py::gil_scoped_release release;
    IsaScope scope(isa);
    Sddmm<S>(reinterpret_cast<const S*>(mask.data()),
             reinterpret_cast<const S*>(x.data()),
             reinterpret_cast<const S*>(y.data()), m, k, n,
             reinterpret_cast<S*>(out.mutable_data()), ThreadFor(threads));
  }
  return out;
}

bool IsBf16(const std::string& dtype) {
  if (dtype == "bfloat16") return true;
  if (dtype == "float16") return false;
  throw py::value_error("dtype must be 'bfloat16' or 'float16', got '" + dtype +
                        "'");
}

void Bind(py::module_& mod) {
  mod.def(
      "lowp_spmm",
      [](const U16& a, const U16& b, const std::string& dtype, bool transpose_a,
         int isa, int threads, int path) {
        if (path < -1 || path > 3)
          throw py::value_error("path must be -1 (automatic), 0 (packed), "
                                "1 (direct), 2 (dot) or 3 (dot packed)");
        if (path >= 2 && !Cpu().avx512bf16)
          throw py::value_error("paths 2 and 3 (the dot kernels) need "
                                "AVX512_BF16, which this CPU lacks");
        if (path >= 2 && isa < 0 && !Bf16DotAvailable())
          throw py::value_error("paths 2 and 3 (the dot kernels) are not "
                                "compiled in this build");
        return IsBf16(dtype)
                   ? SpmmT<bf16>(a, b, transpose_a, isa, threads, path)
                   : SpmmT<f16>(a, b, transpose_a, isa, threads, path);
      },
      py::arg("a"), py::arg("b"), py::arg("dtype"),
      py::arg("transpose_a") = false, py::arg("isa") = -1,
      py::arg("threads") = 0, py::arg("path") = -1,
      "op(a) @ b in bfloat16/float16 given as uint16 bit patterns (a [m,k], "
      "or [k,m] with transpose_a; b [k,n]): CountNonzeros + BuildCsr + "
      "CsrSpmm, float32 accumulation, one rounding. isa: -1 CPUID, 0 scalar, "
      "1 AVX2, 2 AVX-512 (clamped to what the CPU has). path (bfloat16 "
      "only; float16 always packs): -1 the kernel ChooseBf16SpmmKernel "
      "picks, 0 the packed kernel, 1 the direct kernel, 2 the dot kernel, "
      "3 the dot kernel with B copied to L1 per block (vdpbf16ps; "
      "ValueError where the CPU lacks AVX512_BF16; with isa forced below "
      "AVX-512 they run that copy's direct kernel).");
  mod.def("bf16_dot_available", &Bf16DotAvailable,
          "Whether the bfloat16 dot kernels (AVX512_BF16 vdpbf16ps) can run "
          "here: CPUID has AVX512_BF16, the AVX-512 copy is active and the "
          "compiler knew the instruction.");
  mod.def(
      "bf16_spmm_kernel",
      [](int64_t n_rows, int64_t k, int64_t n, int64_t nnz,
         py::object dot, py::object dot_rate_ratio) {
        if (n_rows < 0 || k < 0 || n < 0 || nnz < 0)
          throw py::value_error("sizes and nnz must be >= 0");
        if (dot.is_none() && !dot_rate_ratio.is_none())
          throw py::value_error("dot_rate_ratio needs dot=True or False");
        double ratio = 0.0;
        if (!dot_rate_ratio.is_none()) {
          ratio = dot_rate_ratio.cast<double>();
          if (!(ratio >= 0.0))
            throw py::value_error("dot_rate_ratio must be >= 0");
        } else if (!dot.is_none() && dot.cast<bool>()) {
          ratio = Bf16DotRateRatio();
        }
        const Bf16SpmmKernel kernel =
            dot.is_none()
                ? ChooseBf16SpmmKernel(n_rows, k, n, nnz)
                : Bf16SpmmKernelRule(n_rows, k, n, nnz, dot.cast<bool>(),
                                     ratio);
        switch (kernel) {
          case Bf16SpmmKernel::kDirect:
            return std::string("direct");
          case Bf16SpmmKernel::kDot:
            return std::string("dot");
          case Bf16SpmmKernel::kDotPacked:
            return std::string("dot_packed");
          default:
            return std::string("packed");
        }
      },
      py::arg("n_rows"), py::arg("k"), py::arg("n"), py::arg("nnz"),
      py::arg("dot") = py::none(), py::arg("dot_rate_ratio") = py::none(),
      "The bfloat16 CsrSpmm kernel ('packed', 'direct', 'dot' or "
      "'dot_packed') a call of "
      "n_rows CSR rows (nnz nonzeros) times a k x n matrix takes: on this "
      "CPU (dot=None: ChooseBf16SpmmKernel), or by the rule for a CPU with "
      "(dot=True) or without (dot=False) the dot kernel "
      "(Bf16SpmmKernelRule), whose vdpbf16ps runs dot_rate_ratio times the "
      "float32 FMA's products per second (None: this CPU's "
      "bf16_dot_rate_ratio()). ValueError on negative sizes or ratio, or a "
      "ratio without dot.");
  mod.def("bf16_dot_rate_ratio", &Bf16DotRateRatio,
          "Products per second of vdpbf16ps over those of a float32 FMA "
          "(512-bit) on this CPU, measured once per process (~0.1 ms): about "
          "2 on Zen 4, ~0.5 expected on Sapphire Rapids; 0.0 where the dot kernels "
          "cannot run (bf16_dot_available() false).");
  mod.def(
      "lowp_sddmm",
      [](const U16& mask, const U16& x, const U16& y, const std::string& dtype,
         int isa, int threads) {
        return IsBf16(dtype) ? SddmmT<bf16>(mask, x, y, isa, threads)
                             : SddmmT<f16>(mask, x, y, isa, threads);
      },
      py::arg("mask"), py::arg("x"), py::arg("y"), py::arg("dtype"),
      py::arg("isa") = -1, py::arg("threads") = 0,
      "mask != 0 ? x @ y^T : 0 in bfloat16/float16 (uint16 bit patterns; "
      "mask [m,k], x [m,n], y [k,n]); isa as for lowp_spmm.");
  mod.def(
      "lowp_round",
      [](const py::array_t<float, py::array::c_style | py::array::forcecast>& x,
         const std::string& dtype) {
        py::array_t<uint16_t> out(x.request().shape);
        if (IsBf16(dtype)) {
          NarrowFromFloat(x.data(), reinterpret_cast<bf16*>(out.mutable_data()),
                          x.size());
        } else {
          NarrowFromFloat(x.data(), reinterpret_cast<f16*>(out.mutable_data()),
                          x.size());
        }
        return out;
      },
      py::arg("x"), py::arg("dtype"),
      "float32 -> bfloat16/float16 bit patterns, round-to-nearest-even.");
  mod.def(
      "low_precision_isa",
      [] {
        py::dict d;
        d["best"] = KernelIsaName(BestKernelIsa());
        d["active"] = KernelIsaName(LowPrecisionIsa());
        d["best_level"] = static_cast<int>(BestKernelIsa());
        d["bf16_conversion"] = ConversionPath(true);
        d["f16_conversion"] = ConversionPath(false);
        const CpuFeatures& c = Cpu();
        d["avx2"] = c.avx2;
        d["fma"] = c.fma;
        d["f16c"] = c.f16c;
        d["avx512f"] = c.avx512f;
        d["avx512bw"] = c.avx512bw;
        d["avx512bf16"] = c.avx512bf16;
        d["avx512fp16"] = c.avx512fp16;
        d["amx_bf16"] = c.amx_bf16;
        d["bf16_spmm_dot"] = Bf16DotAvailable();
        return d;
      },
      "The instruction-set path of the bfloat16/float16 sparse kernels on "
      "this CPU (best, active), the bulk conversions' paths and the CPUID "
      "features they are chosen from.");
}

}  // namespace lowp_py

}  // namespace tf_sparse_split

PYBIND11_MODULE(_kernels, mod) {
  mod.doc() =
      "numpy access to tf_sparse_split's framework-free CPU kernels "
      "(float64 overloads first, then float32).";
  tf_sparse_split::Bind<double>(mod, "F64");
  tf_sparse_split::Bind<float>(mod, "F32");
  tf_sparse_split::BindConv<double>(mod);
  tf_sparse_split::BindConv<float>(mod);
  mod.def(
      "filter_grad_blocks",
      [](int64_t n, int64_t kh, int64_t kw, int64_t c_in, int64_t c_out,
         int64_t h, int64_t w) {
        // The input sizes here; ConvGeometryOf checks the filter's.
        if (n < 0 || h < 0 || w < 0 || c_in < 0)
          throw py::value_error("input sizes must be >= 0");
        const auto ones = py::make_tuple(1, 1);
        return tf_sparse_split::FilterGradBlocks(
            tf_sparse_split::ConvGeometryOf({n, h, w, c_in}, kh, kw, c_out,
                                            ones, ones, py::str("SAME")),
            n);
      },
      py::arg("n"), py::arg("kh"), py::arg("kw"), py::arg("c_in"),
      py::arg("c_out"), py::arg("h"), py::arg("w"),
      "Number of image blocks (private df copies) the filter-gradient "
      "kernels sum n images in: blocks of ceil(n / blocks) images, none "
      "empty. Raises ValueError on negative sizes or a filter size below "
      "1.");
  mod.def("direct_conv2d_uses_avx512", &tf_sparse_split::DirectConv2DUsesAvx512,
          "Whether the direct convolution kernels were built with AVX-512.");
  mod.def(
      "conv_sparse_kernel_choice",
      [](double values, double nnz, py::tuple direct_timings,
         py::tuple csr_timings, double calib_values) {
        // timings: (nnz_full, t_full, nnz_thin, t_thin) on calib_values values
        auto fit = [&](py::tuple t) {
          if (t.size() != 4)
            throw py::value_error("timings must be (nnz_full, t_full, "
                                  "nnz_thin, t_thin)");
          return tf_sparse_split::FitSparseKernel(
              calib_values, t[0].cast<double>(), t[1].cast<double>(),
              t[2].cast<double>(), t[3].cast<double>());
        };
        const auto d = fit(direct_timings), c = fit(csr_timings);
        py::dict out;
        out["direct"] = tf_sparse_split::DirectPredictedFaster(d, c, values, nnz);
        out["direct_s"] = d.Seconds(values, nnz);
        out["csr_s"] = c.Seconds(values, nnz);
        out["direct_per_value"] = d.per_value;
        out["direct_per_nnz"] = d.per_nnz;
        out["csr_per_value"] = c.per_value;
        out["csr_per_nnz"] = c.per_nnz;
        return out;
      },
      py::arg("values"), py::arg("nnz"), py::arg("direct_timings"),
      py::arg("csr_timings"), py::arg("calib_values"),
      "The convolution ops' choice of sparse kernel from recorded timings:\n"
      "each kernel's (nnz_full, t_full seconds, nnz_thin, t_thin seconds) on\n"
      "calib_values input values, fitted as seconds = a*values + b*nnz, then\n"
      "evaluated for a call of `values` values with `nnz` nonzeros. Returns\n"
      "a dict: direct (bool: the direct kernel is taken), direct_s, csr_s\n"
      "(predicted seconds) and the fitted per_value/per_nnz terms.");
  mod.attr("DENSITY_BINS") = tf_sparse_split::kDensityBins;

  // ---- Statistics layout ------------------------------------------------
  // cc/core/stats.h is the one source of the layout of the ops' statistics
  // vector; tf_sparse_split/tuning/stats.py mirrors it and a test checks the
  // two agree through this function.
  mod.def(
      "stats_layout",
      [] {
        namespace t = tf_sparse_split;
        py::dict d;
        d["kStatRowsDense"] = static_cast<int>(t::kStatRowsDense);
        d["kStatRowsSparse"] = static_cast<int>(t::kStatRowsSparse);
        d["kStatNnz"] = static_cast<int>(t::kStatNnz);
        d["kStatZeroColsSkipped"] = static_cast<int>(t::kStatZeroColsSkipped);
        d["kStatTimeDense"] = static_cast<int>(t::kStatTimeDense);
        d["kStatTimeSparse"] = static_cast<int>(t::kStatTimeSparse);
        d["kStatTimeAnalyze"] = static_cast<int>(t::kStatTimeAnalyze);
        d["kStatThreshold"] = static_cast<int>(t::kStatThreshold);
        d["kStatM"] = static_cast<int>(t::kStatM);
        d["kStatK"] = static_cast<int>(t::kStatK);
        d["kStatN"] = static_cast<int>(t::kStatN);
        d["kStatNnzSparse"] = static_cast<int>(t::kStatNnzSparse);
        d["kStatHistogram"] = static_cast<int>(t::kStatHistogram);
        d["kStatHeterogeneous"] = static_cast<int>(t::kStatHeterogeneous);
        d["kNumStats"] = static_cast<int>(t::kNumStats);
        d["kDensityBins"] = t::kDensityBins;
        d["kHeteroOff"] = t::kHeteroOff;
        d["kHeteroRan"] = t::kHeteroRan;
        d["kHeteroCpuFallback"] = t::kHeteroCpuFallback;
        d["kStatAnalysis"] = static_cast<int>(t::kStatAnalysis);
        d["kAnalysisFull"] = t::kAnalysisFull;
        d["kAnalysisSampled"] = t::kAnalysisSampled;
        d["kAnalysisSkipped"] = t::kAnalysisSkipped;
        d["kStatKLive"] = static_cast<int>(t::kStatKLive);
        d["kStatDenseFlopsPerElem"] = static_cast<int>(t::kStatDenseFlopsPerElem);
        d["kStatSparseFlopsPerNnz"] = static_cast<int>(t::kStatSparseFlopsPerNnz);
        d["kStatRowCopyElems"] = static_cast<int>(t::kStatRowCopyElems);
        d["kStatWeightElemsPerCol"] = static_cast<int>(t::kStatWeightElemsPerCol);
        d["kStatCanCompact"] = static_cast<int>(t::kStatCanCompact);
        d["kStatDenseAllowed"] = static_cast<int>(t::kStatDenseAllowed);
        d["kStatTermDenseFixed"] = static_cast<int>(t::kStatTermDenseFixed);
        d["kStatTermDenseRate"] = static_cast<int>(t::kStatTermDenseRate);
        d["kStatTermSparseFixed"] = static_cast<int>(t::kStatTermSparseFixed);
        d["kStatTermConvert"] = static_cast<int>(t::kStatTermConvert);
        d["kStatTermSparseRate"] = static_cast<int>(t::kStatTermSparseRate);
        d["kStatTermCopy"] = static_cast<int>(t::kStatTermCopy);
        d["kStatCalibrated"] = static_cast<int>(t::kStatCalibrated);
        d["kStatCostFirst"] = t::kStatCostFirst;
        d["kStatCostLast"] = t::kStatCostLast;
        return d;
      },
      "Layout of the ops' statistics vector, from cc/core/stats.h: a dict of "
      "the StatIndex names (kStat*) to their indices (kStatHistogram is the "
      "first of kDensityBins histogram entries), kNumStats, kDensityBins and "
      "the kHetero* values of the kStatHeterogeneous entry.");

  tf_sparse_split::BindCostModel(mod);  // cost model block above
  tf_sparse_split::BindConvCost(mod);   // convolution's shape and family key
  tf_sparse_split::BindAnalysis(mod);   // analysis choice, after it
  tf_sparse_split::lowp_py::Bind(mod);  // bfloat16 / float16 kernels
}
