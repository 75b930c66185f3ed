// Standalone test + benchmark for the CUDA kernels of sparse_matmul_cuda.h.
//
// Needs only nvcc, a GPU and cuBLAS (no TensorFlow, no PyTorch). Build and run
// with run_harness.sh beside this file. Method after K.-Y. Peng, "Adaptive
// runtime exploiting sparsity in tensor of deep learning on heterogeneous
// systems", NTU 2017.
//
// Part 1 (tests): for each shape m x k x n and sparsity, fresh random inputs
// with real zeros, in float32, float64, bfloat16 (__nv_bfloat16) and float16
// (__half); every kernel is compared with a CPU float64 reference computed
// from the stored values. Structural outputs (counts, CSR, CSC, gathers,
// untouched rows) must match exactly; numeric outputs must satisfy, for
// float32 / float64, the normwise relative error
//     err = max|got - ref| / max|ref|  <= 1e-5 (float), 1e-12 (double)
// (and be exactly 0 where the reference output is all zero), and for the
// 16-bit types (stored in T, accumulated in float32, rounded once) the
// elementwise bound of tests/test_low_precision_matmul.py
//     |got - ref| <= eps_T |ref| + (eps_T + 4 K eps_f32) (|x| . |y|)
// (eps_T = 2^-7 bfloat16, 2^-10 half; K the length of each sum; |x| . |y|
// the same sum of absolute products; so an output whose reference is 0 with
// no nonzero term must be exactly 0). NaN in the activation must give NaN
// exactly where the reference does. The bias + activation epilogue must
// give the host's bits exactly, and the split (dense rows gathered with
// their live columns through cuBLAS cublasGemmEx -- CUBLAS_COMPUTE_32F for
// float32 and the 16-bit types, 64F for float64 -- scattered back, sparse
// rows through the CSR SpMM, then the epilogue) must meet the same bounds
// against the float64 act(A B + bias). One PASS/FAIL line per case; the
// exit status is nonzero if any case fails.
//
// Part 2 (benchmark): CSR SpMM, SpMM^T (CSC build included), SDDMM and the
// transposed CSR fill against the dense cuBLAS SGEMM of the same shape with
// FP32 math and with TF32 tensor cores (what tf.matmul uses for float32 on an
// H200 by default), in the same run, timed with CUDA events (warm-up, median
// of repeats); achieved bandwidth as a share of a device-to-device
// cudaMemcpy; printed as a markdown table. Then the bfloat16 CSR build, SpMM
// and SDDMM against cublasGemmEx in bfloat16 (float32 compute).
//
// Options: --tests-only, --bench-only, --quick (skip the two large shapes).
// Exit codes: 0 all passed, 1 a test failed, no test ran, or a CUDA error
// (including a GPU the runtime cannot use, e.g. a driver older than the
// runtime), 77 only when the runtime reports no CUDA device at all.

#include "../../core/cuda/epilogue_cuda.h"
#include "../../core/cuda/sparse_matmul_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#ifndef TFSS_HARNESS_NO_CUBLAS
#include <cublas_v2.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <vector>

namespace tf_sparse_split {
namespace harness {

#define HCHECK(expr)                                                             \
  do {                                                                           \
    const cudaError_t e_ = (expr);                                               \
    if (e_ != cudaSuccess) {                                                     \
      std::fprintf(stderr, "CUDA error %s (%d) at %s:%d: %s\n", cudaGetErrorName(e_), \
                   static_cast<int>(e_), __FILE__, __LINE__, #expr);            \
      std::exit(1);                                                              \
    }                                                                            \
  } while (0)

#ifndef TFSS_HARNESS_NO_CUBLAS
#define BCHECK(expr)                                                             \
  do {                                                                           \
    const cublasStatus_t s_ = (expr);                                            \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                           \
      std::fprintf(stderr, "cuBLAS error %d at %s:%d: %s\n", static_cast<int>(s_), \
                   __FILE__, __LINE__, #expr);                                   \
      std::exit(1);                                                              \
    }                                                                            \
  } while (0)
#endif

// ---------------------------------------------------------------------------
// Small utilities.

// Device buffer; size 0 gives a null pointer (the kernels must accept that).
template <typename T>
struct DevBuf {
  T* p = nullptr;
  size_t n = 0;
  DevBuf() = default;
  explicit DevBuf(size_t count) { Alloc(count); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  ~DevBuf() {
    if (p != nullptr) cudaFree(p);
  }
  void Alloc(size_t count) {
    if (p != nullptr) HCHECK(cudaFree(p));
    p = nullptr;
    n = count;
    if (count > 0) HCHECK(cudaMalloc(&p, count * sizeof(T)));
  }
  void Upload(const std::vector<T>& h) {
    Alloc(h.size());
    if (n > 0) HCHECK(cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> Download() const {
    std::vector<T> h(n);
    if (n > 0) HCHECK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

// Untyped scratch.
struct DevBytes {
  void* p = nullptr;
  size_t n = 0;
  explicit DevBytes(size_t bytes) : n(bytes) {
    if (bytes > 0) HCHECK(cudaMalloc(&p, bytes));
  }
  DevBytes(const DevBytes&) = delete;
  DevBytes& operator=(const DevBytes&) = delete;
  ~DevBytes() {
    if (p != nullptr) cudaFree(p);
  }
};

// Host-side conversions of the element types (the 16-bit ones through the
// CUDA headers' host conversions: round-to-nearest-even, exact widening).
template <typename T>
struct HostElem {  // float, double
  static double ToD(T x) { return static_cast<double>(x); }
  static T FromD(double d) { return static_cast<T>(d); }
  static bool Nonzero(T x) { return x != T(0); }
  static constexpr bool kLow = false;
  static constexpr double kEps = 0.0;  // unused: normwise tolerance
};
template <>
struct HostElem<__half> {
  static double ToD(__half x) { return static_cast<double>(__half2float(x)); }
  static __half FromD(double d) { return __float2half_rn(static_cast<float>(d)); }
  static bool Nonzero(__half x) { return (__half_as_ushort(x) & 0x7fffu) != 0u; }
  static constexpr bool kLow = true;
  static constexpr double kEps = 0.0009765625;  // 2^-10
};
template <>
struct HostElem<__nv_bfloat16> {
  static double ToD(__nv_bfloat16 x) { return static_cast<double>(__bfloat162float(x)); }
  static __nv_bfloat16 FromD(double d) { return __float2bfloat16_rn(static_cast<float>(d)); }
  static bool Nonzero(__nv_bfloat16 x) { return (__bfloat16_as_ushort(x) & 0x7fffu) != 0u; }
  static constexpr bool kLow = true;
  static constexpr double kEps = 0.0078125;  // 2^-7
};
template <typename T>
double ToD(T x) { return HostElem<T>::ToD(x); }
template <typename T>
T FromD(double d) { return HostElem<T>::FromD(d); }
template <typename T>
bool Nz(T x) { return HostElem<T>::Nonzero(x); }
template <typename T>
bool SameBits1(const T& a, const T& b) { return std::memcmp(&a, &b, sizeof(T)) == 0; }

// splitmix64: fast, reproducible, good enough for test data.
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed) {}
  uint64_t Next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double Uniform() { return (Next() >> 11) * (1.0 / 9007199254740992.0); }  // [0, 1)
  // Nonzero value in +-[0.05, 1).
  double Value() {
    const double mag = 0.05 + 0.95 * Uniform();
    return (Next() & 1) ? mag : -mag;
  }
};

// Runs fn(begin, end) over [0, total) on all host cores.
void HostParallelFor(int64_t total, const std::function<void(int64_t, int64_t)>& fn) {
  if (total <= 0) return;
  int64_t threads = std::max(1u, std::thread::hardware_concurrency());
  threads = std::min<int64_t>(threads, total);
  if (threads == 1) {
    fn(0, total);
    return;
  }
  std::vector<std::thread> pool;
  const int64_t chunk = (total + threads - 1) / threads;
  for (int64_t t = 0; t < threads; ++t) {
    const int64_t b = t * chunk, e = std::min(total, b + chunk);
    if (b < e) pool.emplace_back(fn, b, e);
  }
  for (auto& th : pool) th.join();
}

template <typename T>
const char* TypeName();
template <>
const char* TypeName<float>() { return "float32"; }
template <>
const char* TypeName<double>() { return "float64"; }
template <>
const char* TypeName<__nv_bfloat16>() { return "bfloat16"; }
template <>
const char* TypeName<__half>() { return "float16"; }

template <typename T>
double Tolerance();
template <>
double Tolerance<float>() { return 1e-5; }
template <>
double Tolerance<double>() { return 1e-12; }
// The 16-bit types use the elementwise bound (CompareNumeric); this is its
// eps_T, printed in the case line.
template <>
double Tolerance<__nv_bfloat16>() { return HostElem<__nv_bfloat16>::kEps; }
template <>
double Tolerance<__half>() { return HostElem<__half>::kEps; }

constexpr double kEpsF32 = 1.1920928955078125e-07;  // 2^-23

// A float64 reference output: values, the matching sums of absolute
// products (|x| . |y|, for the 16-bit bound) and the length K of each sum.
struct Ref {
  std::vector<double> v, mag;
  int64_t K = 0;
};

// Records check outcomes of one case.
struct CaseLog {
  bool ok = true;
  double worst_err = 0.0;
  std::string failures;
  void Fail(const std::string& what) {
    ok = false;
    failures += "    FAIL " + what + "\n";
  }
  void Expect(bool cond, const std::string& what) {
    if (!cond) Fail(what);
  }
};

// Compares a numeric output with a float64 reference: normwise relative
// error <= tol for float32/float64; for the 16-bit types elementwise
//   |got - ref| <= eps_T |ref| + (eps_T + 4 K eps_f32) mag
// (module comment). Elements where the reference is NaN must be NaN; +-Inf
// must match exactly; a finite reference needs a finite output.
template <typename T>
void CompareNumeric(const std::vector<T>& got, const Ref& ref, double tol,
                    const std::string& what, CaseLog* log) {
  if (got.size() != ref.v.size() || (HostElem<T>::kLow && ref.mag.size() != ref.v.size())) {
    log->Fail(what + ": size mismatch");
    return;
  }
  const double eps = HostElem<T>::kEps;
  const double lin = eps + 4.0 * static_cast<double>(std::max<int64_t>(ref.K, 1)) * kEpsF32;
  double max_ref = 0.0, max_diff = 0.0, worst_excess = 0.0, worst_ratio = 0.0;
  size_t special_bad = 0, bound_bad = 0;
  for (size_t i = 0; i < ref.v.size(); ++i) {
    const double r = ref.v[i], g = ToD(got[i]);
    if (std::isnan(r) || std::isinf(r)) {
      const bool same = std::isnan(r) ? std::isnan(g) : (g == r);
      if (!same) ++special_bad;
      continue;
    }
    if (!std::isfinite(g)) {
      ++special_bad;
      continue;
    }
    const double diff = std::fabs(g - r);
    max_ref = std::max(max_ref, std::fabs(r));
    max_diff = std::max(max_diff, diff);
    if (HostElem<T>::kLow) {
      const double bound = eps * std::fabs(r) + lin * ref.mag[i] + 1e-30;
      if (!(diff <= bound)) {
        ++bound_bad;
        worst_excess = std::max(worst_excess, diff - bound);
      }
      worst_ratio = std::max(worst_ratio, diff / bound);
    }
  }
  char buf[256];
  if (special_bad != 0) {
    std::snprintf(buf, sizeof(buf), "%s: %zu NaN/Inf mismatches", what.c_str(), special_bad);
    log->Fail(buf);
    return;
  }
  if (HostElem<T>::kLow) {
    // worst_err: the largest share of the bound used (<= 1 passes).
    log->worst_err = std::max(log->worst_err, worst_ratio);
    if (bound_bad != 0) {
      std::snprintf(buf, sizeof(buf), "%s: %zu elements over the bound (worst by %.3e; max "
                    "|diff| %.3e, max |ref| %.3e)", what.c_str(), bound_bad, worst_excess,
                    max_diff, max_ref);
      log->Fail(buf);
    }
    return;
  }
  if (max_ref == 0.0) {
    if (max_diff != 0.0) {
      std::snprintf(buf, sizeof(buf), "%s: reference all zero, got max|x| = %g", what.c_str(),
                    max_diff);
      log->Fail(buf);
    }
    return;
  }
  const double err = max_diff / max_ref;
  log->worst_err = std::max(log->worst_err, err);
  if (!(err <= tol)) {
    std::snprintf(buf, sizeof(buf), "%s: rel err %.3e > %.1e", what.c_str(), err, tol);
    log->Fail(buf);
  }
}

template <typename U>
bool SameBits(const std::vector<U>& a, const std::vector<U>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(U)) == 0);
}

// ---------------------------------------------------------------------------
// CPU float64 references.

template <typename T>
struct HostCsr {
  std::vector<int64_t> row_ptr;
  std::vector<int32_t> col_idx;
  std::vector<T> values;
};

// CSR of rows `rows` of the row-major [m, k] matrix a.
template <typename T>
HostCsr<T> RefCsr(const std::vector<T>& a, int64_t k, const std::vector<int64_t>& rows) {
  HostCsr<T> c;
  c.row_ptr.push_back(0);
  for (int64_t i : rows) {
    for (int64_t j = 0; j < k; ++j) {
      const T v = a[i * k + j];
      if (Nz(v)) {
        c.col_idx.push_back(static_cast<int32_t>(j));
        c.values.push_back(v);
      }
    }
    c.row_ptr.push_back(static_cast<int64_t>(c.col_idx.size()));
  }
  return c;
}

// The stored values as float64 (x != 0 on them is the kernels' zero test:
// true for NaN and Inf, false for -0).
template <typename T>
std::vector<double> Doubles(const std::vector<T>& x) {
  std::vector<double> d(x.size());
  for (size_t i = 0; i < x.size(); ++i) d[i] = ToD(x[i]);
  return d;
}

// out[r, :] = sum_j a[rows[r], j] * b[j, :], zeros of a skipped (the
// documented semantics); b is [k, n].
template <typename T>
Ref RefSpmm(const std::vector<T>& a, const std::vector<T>& b, int64_t k, int64_t n,
            const std::vector<int64_t>& rows) {
  const int64_t R = static_cast<int64_t>(rows.size());
  Ref out;
  out.K = k;
  out.v.assign(static_cast<size_t>(R * n), 0.0);
  out.mag.assign(static_cast<size_t>(R * n), 0.0);
  const std::vector<double> ad = Doubles(a), bd = Doubles(b);
  HostParallelFor(R, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      double* o = out.v.data() + r * n;
      double* g = out.mag.data() + r * n;
      const int64_t i = rows[r];
      for (int64_t j = 0; j < k; ++j) {
        const double v = ad[i * k + j];
        if (v == 0.0) continue;
        const double* br = bd.data() + j * n;
        for (int64_t c = 0; c < n; ++c) {
          const double w = br[c];
          o[c] += v * w;
          g[c] += std::fabs(v * w);
        }
      }
    }
  });
  return out;
}

// dW[k, n] = sum_{r} a[rows[r], :]^T dy[rows[r], :], zeros of a skipped.
template <typename T>
Ref RefSpmmT(const std::vector<T>& a, const std::vector<T>& dy, int64_t k, int64_t n,
             const std::vector<int64_t>& rows) {
  Ref out;
  out.K = static_cast<int64_t>(rows.size());
  out.v.assign(static_cast<size_t>(k * n), 0.0);
  out.mag.assign(static_cast<size_t>(k * n), 0.0);
  const std::vector<double> ad = Doubles(a), dyd = Doubles(dy);
  HostParallelFor(k, [&](int64_t j0, int64_t j1) {
    for (int64_t i : rows) {
      const double* dyr = dyd.data() + i * n;
      for (int64_t j = j0; j < j1; ++j) {
        const double v = ad[i * k + j];
        if (v == 0.0) continue;
        double* o = out.v.data() + j * n;
        double* g = out.mag.data() + j * n;
        for (int64_t c = 0; c < n; ++c) {
          const double w = dyr[c];
          o[c] += v * w;
          g[c] += std::fabs(v * w);
        }
      }
    }
  });
  return out;
}

// out[i, j] = mask[i, j] != 0 ? dot(x[i, :], y[j, :]) : 0.
template <typename T>
Ref RefSddmm(const std::vector<T>& mask, const std::vector<T>& x, const std::vector<T>& y,
             int64_t m, int64_t k, int64_t n) {
  Ref out;
  out.K = n;
  out.v.assign(static_cast<size_t>(m * k), 0.0);
  out.mag.assign(static_cast<size_t>(m * k), 0.0);
  const std::vector<double> xd = Doubles(x), yd = Doubles(y);
  HostParallelFor(m, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      for (int64_t j = 0; j < k; ++j) {
        if (!Nz(mask[i * k + j])) continue;
        double s = 0.0, g = 0.0;
        for (int64_t c = 0; c < n; ++c) {
          const double p = xd[i * n + c] * yd[j * n + c];
          s += p;
          g += std::fabs(p);
        }
        out.v[i * k + j] = s;
        out.mag[i * k + j] = g;
      }
    }
  });
  return out;
}

template <typename T>
std::vector<T> Transposed(const std::vector<T>& a, int64_t rows, int64_t cols) {
  std::vector<T> t(a.size());
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) t[j * rows + i] = a[i * cols + j];
  return t;
}

template <typename T>
std::vector<T> RandomSparse(Rng* rng, int64_t count, double sparsity) {
  std::vector<T> v(static_cast<size_t>(count));
  for (auto& x : v) x = FromD<T>(rng->Uniform() < sparsity ? 0.0 : rng->Value());
  return v;
}

// The error part of a case line.
template <typename T>
std::string ErrText(double worst, double tol) {
  char buf[96];
  if (HostElem<T>::kLow) {
    std::snprintf(buf, sizeof(buf), "worst |err|/bound %.2f (eps_T %.1e, bound <= 1)", worst, tol);
  } else {
    std::snprintf(buf, sizeof(buf), "max rel err %.2e (bound %.0e)", worst, tol);
  }
  return buf;
}

// ---------------------------------------------------------------------------
// One test case: every kernel at shape m x k x n and one sparsity of A.

template <typename T>
bool RunCase(int64_t m, int64_t k, int64_t n, double sparsity, bool with_nan, uint64_t seed) {
  const double tol = Tolerance<T>();
  cudaStream_t st;
  HCHECK(cudaStreamCreate(&st));
  CaseLog log;
  Rng rng(seed);
  std::vector<T> a = RandomSparse<T>(&rng, m * k, sparsity);
  if (with_nan && m * k > 0) {
    a[(m / 2) * k + k / 2] = FromD<T>(std::numeric_limits<double>::quiet_NaN());
    if (m * k > 1) a[0] = FromD<T>(std::numeric_limits<double>::infinity());
  }
  const std::vector<T> b = RandomSparse<T>(&rng, k * n, 0.0);   // weights [k, n]
  const std::vector<T> dy = RandomSparse<T>(&rng, m * n, 0.0);  // [m, n]
  const std::vector<T> at = Transposed(a, m, k);                // physical [k, m]
  const std::vector<T> bt = Transposed(b, k, n);                // physical [n, k]

  DevBuf<T> d_a, d_at, d_b, d_bt, d_dy;
  d_a.Upload(a);
  d_at.Upload(at);
  d_b.Upload(b);
  d_bt.Upload(bt);
  d_dy.Upload(dy);

  // Reference counts.
  std::vector<int64_t> ref_row(m, 0), ref_col(k, 0);
  int64_t ref_total = 0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < k; ++j)
      if (Nz(a[i * k + j])) ++ref_row[i], ++ref_col[j], ++ref_total;

  std::vector<int64_t> all_rows(m), sub_rows;
  for (int64_t i = 0; i < m; ++i) all_rows[i] = i;
  for (int64_t i = m - 1; i >= 0; --i)
    if (i % 2 == 1) sub_rows.push_back(i);  // odd rows, descending order
  const int64_t n_sub = static_cast<int64_t>(sub_rows.size());
  DevBuf<int64_t> d_sub;
  d_sub.Upload(sub_rows);

  // 1. CountNonzeros, both layouts.
  DevBuf<int64_t> d_row_nnz(m), d_col_nnz(k), d_total(1);
  for (int tr = 0; tr < 2; ++tr) {
    const bool t = tr == 1;
    HCHECK(CountNonzerosGpu<T>(t ? d_at.p : d_a.p, t ? k : m, t ? m : k, t, d_row_nnz.p,
                               d_col_nnz.p, d_total.p, st));
    HCHECK(cudaStreamSynchronize(st));
    const std::string tag = t ? " (transpose_a)" : "";
    log.Expect(d_row_nnz.Download() == ref_row, "CountNonzeros row_nnz" + tag);
    log.Expect(d_col_nnz.Download() == ref_col, "CountNonzeros col_nnz" + tag);
    log.Expect(d_total.Download()[0] == ref_total, "CountNonzeros total" + tag);
  }

  // 2. CSR build: all rows and a subset, both layouts; exact.
  auto build_csr = [&](bool t, const int64_t* rows, int64_t n_rows, DevBuf<int64_t>* ptr,
                       DevBuf<int32_t>* idx, DevBuf<T>* val) {
    size_t ws = 0;
    HCHECK(BuildCsrRowPtrWorkspaceBytes(n_rows, &ws));
    DevBytes w(ws);
    ptr->Alloc(static_cast<size_t>(n_rows + 1));
    HCHECK(BuildCsrRowPtrGpu(d_row_nnz.p, rows, n_rows, ptr->p, w.p, ws, st));
    int64_t nnz = 0;
    HCHECK(cudaMemcpyAsync(&nnz, ptr->p + n_rows, sizeof(int64_t), cudaMemcpyDeviceToHost, st));
    HCHECK(cudaStreamSynchronize(st));
    idx->Alloc(static_cast<size_t>(nnz));
    val->Alloc(static_cast<size_t>(nnz));
    HCHECK(FillCsrGpu<T>(t ? d_at.p : d_a.p, t ? k : m, t ? m : k, t, rows, n_rows, ptr->p,
                         idx->p, val->p, st));
    HCHECK(cudaStreamSynchronize(st));
    return nnz;
  };
  const HostCsr<T> ref_csr = RefCsr(a, k, all_rows);
  const HostCsr<T> ref_sub = RefCsr(a, k, sub_rows);
  DevBuf<int64_t> d_ptr, d_sptr;
  DevBuf<int32_t> d_idx, d_sidx;
  DevBuf<T> d_val, d_sval;
  int64_t nnz = 0, nnz_sub = 0;
  for (int tr = 1; tr >= 0; --tr) {  // ends with the row-major build kept
    const bool t = tr == 1;
    const std::string tag = t ? " (transpose_a)" : "";
    // Row nnz of op(a) are layout-independent; recount from this layout.
    HCHECK(CountNonzerosGpu<T>(t ? d_at.p : d_a.p, t ? k : m, t ? m : k, t, d_row_nnz.p,
                               d_col_nnz.p, nullptr, st));
    nnz = build_csr(t, nullptr, m, &d_ptr, &d_idx, &d_val);
    log.Expect(d_ptr.Download() == ref_csr.row_ptr, "CSR row_ptr" + tag);
    log.Expect(d_idx.Download() == ref_csr.col_idx, "CSR col_idx" + tag);
    log.Expect(SameBits(d_val.Download(), ref_csr.values), "CSR values" + tag);
    nnz_sub = build_csr(t, d_sub.p, n_sub, &d_sptr, &d_sidx, &d_sval);
    log.Expect(d_sptr.Download() == ref_sub.row_ptr, "CSR(subset) row_ptr" + tag);
    log.Expect(d_sidx.Download() == ref_sub.col_idx, "CSR(subset) col_idx" + tag);
    log.Expect(SameBits(d_sval.Download(), ref_sub.values), "CSR(subset) values" + tag);
  }
  GpuCsr<T> csr;
  csr.row_ptr = d_ptr.p;
  csr.col_idx = d_idx.p;
  csr.values = d_val.p;
  csr.n_rows = m;
  csr.n_cols = k;
  csr.nnz = nnz;
  GpuCsr<T> scsr = csr;
  scsr.row_ptr = d_sptr.p;
  scsr.col_idx = d_sidx.p;
  scsr.values = d_sval.p;
  scsr.n_rows = n_sub;
  scsr.nnz = nnz_sub;

  const T sentinel = FromD<T>(7.25);
  // 3. CSR SpMM: full (vector path when n allows), padded ldc (scalar path),
  //    subset with untouched rows, determinism.
  const Ref ref_c = RefSpmm(a, b, k, n, all_rows);
  {
    DevBuf<T> d_c;
    d_c.Upload(std::vector<T>(static_cast<size_t>(m * n), sentinel));
    HCHECK(CsrSpmmGpu<T>(csr, nullptr, d_b.p, n, n, d_c.p, n, st));
    HCHECK(cudaStreamSynchronize(st));
    const std::vector<T> c1 = d_c.Download();
    CompareNumeric(c1, ref_c, tol, "CsrSpmm", &log);
    HCHECK(CsrSpmmGpu<T>(csr, nullptr, d_b.p, n, n, d_c.p, n, st));
    HCHECK(cudaStreamSynchronize(st));
    log.Expect(SameBits(d_c.Download(), c1), "CsrSpmm deterministic bits");
    // A misaligned copy of b (scalar path) must give the same bits.
    DevBuf<T> d_bo(static_cast<size_t>(k * n + 1));
    if (k * n > 0) {
      HCHECK(cudaMemcpy(d_bo.p + 1, d_b.p, k * n * sizeof(T), cudaMemcpyDeviceToDevice));
    }
    HCHECK(CsrSpmmGpu<T>(csr, nullptr, d_bo.p + 1, n, n, d_c.p, n, st));
    HCHECK(cudaStreamSynchronize(st));
    log.Expect(SameBits(d_c.Download(), c1), "CsrSpmm bits independent of alignment");

    const int64_t ldc = n + 1;
    DevBuf<T> d_cp;
    d_cp.Upload(std::vector<T>(static_cast<size_t>(m * ldc), sentinel));
    HCHECK(CsrSpmmGpu<T>(csr, nullptr, d_b.p, n, n, d_cp.p, ldc, st));
    HCHECK(cudaStreamSynchronize(st));
    const std::vector<T> cp = d_cp.Download();
    std::vector<T> cp_valid(static_cast<size_t>(m * n));
    bool pad_ok = true;
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) cp_valid[i * n + j] = cp[i * ldc + j];
      pad_ok = pad_ok && SameBits1(cp[i * ldc + n], sentinel);
    }
    CompareNumeric(cp_valid, ref_c, tol, "CsrSpmm ldc=n+1", &log);
    log.Expect(pad_ok, "CsrSpmm ldc=n+1 padding untouched");

    // Padded leading dimensions that keep rows 16-byte aligned (the vector
    // path when n allows): same bits as the packed call, padding untouched.
    {
      const int64_t pad = 16 / static_cast<int64_t>(sizeof(T));
      const int64_t ldb = n + pad, ldq = n + 2 * pad;
      std::vector<T> bp(static_cast<size_t>(k * ldb), sentinel);
      for (int64_t j = 0; j < k; ++j)
        for (int64_t c = 0; c < n; ++c) bp[j * ldb + c] = b[j * n + c];
      DevBuf<T> d_bp, d_cq;
      d_bp.Upload(bp);
      d_cq.Upload(std::vector<T>(static_cast<size_t>(m * ldq), sentinel));
      HCHECK(CsrSpmmGpu<T>(csr, nullptr, d_bp.p, n, ldb, d_cq.p, ldq, st));
      HCHECK(cudaStreamSynchronize(st));
      const std::vector<T> cq = d_cq.Download();
      std::vector<T> cq_valid(static_cast<size_t>(m * n));
      bool cq_pad_ok = true;
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < n; ++j) cq_valid[i * n + j] = cq[i * ldq + j];
        for (int64_t j = n; j < ldq; ++j) {
          cq_pad_ok = cq_pad_ok && SameBits1(cq[i * ldq + j], sentinel);
        }
      }
      log.Expect(SameBits(cq_valid, c1), "CsrSpmm ldb=n+16B, ldc=n+32B: same bits as packed");
      log.Expect(cq_pad_ok, "CsrSpmm padded ldc: padding untouched");
    }

    DevBuf<T> d_cs;
    d_cs.Upload(std::vector<T>(static_cast<size_t>(m * n), sentinel));
    HCHECK(CsrSpmmGpu<T>(scsr, d_sub.p, d_b.p, n, n, d_cs.p, n, st));
    HCHECK(cudaStreamSynchronize(st));
    const std::vector<T> cs = d_cs.Download();
    std::vector<T> cs_rows(static_cast<size_t>(n_sub * n));
    Ref ref_rows;
    ref_rows.K = k;
    ref_rows.v.resize(static_cast<size_t>(n_sub * n));
    ref_rows.mag.resize(static_cast<size_t>(n_sub * n));
    std::vector<char> in_sub(static_cast<size_t>(m), 0);
    for (int64_t r = 0; r < n_sub; ++r) {
      in_sub[sub_rows[r]] = 1;
      for (int64_t j = 0; j < n; ++j) {
        cs_rows[r * n + j] = cs[sub_rows[r] * n + j];
        ref_rows.v[r * n + j] = ref_c.v[sub_rows[r] * n + j];
        ref_rows.mag[r * n + j] = ref_c.mag[sub_rows[r] * n + j];
      }
    }
    bool untouched = true;
    for (int64_t i = 0; i < m; ++i)
      if (!in_sub[i])
        for (int64_t j = 0; j < n; ++j) untouched = untouched && SameBits1(cs[i * n + j], sentinel);
    CompareNumeric(cs_rows, ref_rows, tol, "CsrSpmm(subset rows)", &log);
    log.Expect(untouched, "CsrSpmm(subset) other rows untouched");
  }

  // 4. Column compaction (exact gathers), both layouts of a and of b.
  {
    std::vector<int64_t> live;
    for (int64_t j = 0; j < k; ++j)
      if (ref_col[j] != 0) live.push_back(j);
    const int64_t L = static_cast<int64_t>(live.size());
    std::vector<T> ref_a(static_cast<size_t>(m * L)), ref_b(static_cast<size_t>(L * n));
    for (int64_t i = 0; i < m; ++i)
      for (int64_t c = 0; c < L; ++c) ref_a[i * L + c] = a[i * k + live[c]];
    for (int64_t c = 0; c < L; ++c)
      for (int64_t j = 0; j < n; ++j) ref_b[c * n + j] = b[live[c] * n + j];
    DevBuf<int64_t> d_live;
    d_live.Upload(live);
    DevBuf<T> d_ao(static_cast<size_t>(m * L)), d_bo(static_cast<size_t>(L * n));
    for (int ta = 0; ta < 2; ++ta) {
      const bool t = ta == 1;  // transpose_a and transpose_b together
      HCHECK(CompactColumnsGpu<T>(t ? d_at.p : d_a.p, t ? k : m, t ? m : k, t,
                                  t ? d_bt.p : d_b.p, t ? n : k, t ? k : n, t, d_live.p, L,
                                  d_ao.p, d_bo.p, st));
      HCHECK(cudaStreamSynchronize(st));
      const std::string tag = t ? " (transposed inputs)" : "";
      log.Expect(SameBits(d_ao.Download(), ref_a), "CompactColumns a_out" + tag);
      log.Expect(SameBits(d_bo.Download(), ref_b), "CompactColumns b_out" + tag);
    }
    // GatherSubmatrix with both index lists (subset rows x live columns).
    DevBuf<T> d_g(static_cast<size_t>(n_sub * L));
    HCHECK(GatherSubmatrixGpu<T>(d_at.p, k, m, true, d_sub.p, n_sub, d_live.p, L, d_g.p, st));
    HCHECK(cudaStreamSynchronize(st));
    std::vector<T> ref_g(static_cast<size_t>(n_sub * L));
    for (int64_t r = 0; r < n_sub; ++r)
      for (int64_t c = 0; c < L; ++c) ref_g[r * L + c] = a[sub_rows[r] * k + live[c]];
    log.Expect(SameBits(d_g.Download(), ref_g), "GatherSubmatrix rows x cols (transpose_a)");
  }

  // 5. CSR -> CSC (exact, rows ascending within a column).
  {
    std::vector<int64_t> ref_cp(static_cast<size_t>(k + 1), 0);
    std::vector<int32_t> ref_ri;
    std::vector<T> ref_cv;
    for (int64_t j = 0; j < k; ++j) {
      for (int64_t i = 0; i < m; ++i) {
        if (Nz(a[i * k + j])) {
          ref_ri.push_back(static_cast<int32_t>(i));
          ref_cv.push_back(a[i * k + j]);
        }
      }
      ref_cp[j + 1] = static_cast<int64_t>(ref_ri.size());
    }
    size_t ws = 0;
    HCHECK(CsrToCscWorkspaceBytes(m, k, nnz, &ws));
    DevBytes w(ws);
    DevBuf<int64_t> d_cp(static_cast<size_t>(k + 1));
    DevBuf<int32_t> d_ri(static_cast<size_t>(nnz));
    DevBuf<T> d_cv(static_cast<size_t>(nnz));
    HCHECK(CsrToCscGpu<T>(csr, d_cp.p, d_ri.p, d_cv.p, w.p, ws, st));
    HCHECK(cudaStreamSynchronize(st));
    log.Expect(d_cp.Download() == ref_cp, "CsrToCsc col_ptr");
    log.Expect(d_ri.Download() == ref_ri, "CsrToCsc row_idx");
    log.Expect(SameBits(d_cv.Download(), ref_cv), "CsrToCsc values");
  }

  // 6. SpMM^T: dW = A^T dY (overwrite), accumulate, subset with dy_rows map,
  //    determinism.
  {
    const Ref ref_dw = RefSpmmT(a, dy, k, n, all_rows);
    size_t ws = 0;
    HCHECK(CsrSpmmTransposeWorkspaceBytes<T>(m, k, nnz, &ws));
    DevBytes w(ws);
    DevBuf<T> d_dw;
    d_dw.Upload(std::vector<T>(static_cast<size_t>(k * n), sentinel));
    HCHECK(CsrSpmmTransposeGpu<T>(csr, nullptr, d_dy.p, n, n, d_dw.p, n, false, w.p, ws, st));
    HCHECK(cudaStreamSynchronize(st));
    const std::vector<T> dw1 = d_dw.Download();
    CompareNumeric(dw1, ref_dw, tol, "CsrSpmmTranspose", &log);
    HCHECK(CsrSpmmTransposeGpu<T>(csr, nullptr, d_dy.p, n, n, d_dw.p, n, false, w.p, ws, st));
    HCHECK(cudaStreamSynchronize(st));
    log.Expect(SameBits(d_dw.Download(), dw1), "CsrSpmmTranspose deterministic bits");

    const std::vector<T> d0 = RandomSparse<T>(&rng, k * n, 0.0);
    Ref ref_acc(ref_dw);
    for (size_t i = 0; i < ref_acc.v.size(); ++i) {
      ref_acc.v[i] += ToD(d0[i]);
      ref_acc.mag[i] += std::fabs(ToD(d0[i]));
    }
    d_dw.Upload(d0);
    HCHECK(CsrSpmmTransposeGpu<T>(csr, nullptr, d_dy.p, n, n, d_dw.p, n, true, w.p, ws, st));
    HCHECK(cudaStreamSynchronize(st));
    CompareNumeric(d_dw.Download(), ref_acc, tol, "CsrSpmmTranspose accumulate", &log);

    // Padded lddy / lddw: same bits as the packed call, padding untouched.
    {
      const int64_t pad = 16 / static_cast<int64_t>(sizeof(T));
      const int64_t lddy = n + pad, lddw = n + 3 * pad;
      std::vector<T> dyp(static_cast<size_t>(m * lddy), sentinel);
      for (int64_t i = 0; i < m; ++i)
        for (int64_t c = 0; c < n; ++c) dyp[i * lddy + c] = dy[i * n + c];
      DevBuf<T> d_dyp, d_dwp;
      d_dyp.Upload(dyp);
      d_dwp.Upload(std::vector<T>(static_cast<size_t>(k * lddw), sentinel));
      HCHECK(CsrSpmmTransposeGpu<T>(csr, nullptr, d_dyp.p, n, lddy, d_dwp.p, lddw, false, w.p,
                                    ws, st));
      HCHECK(cudaStreamSynchronize(st));
      const std::vector<T> dwp = d_dwp.Download();
      std::vector<T> dwp_valid(static_cast<size_t>(k * n));
      bool dw_pad_ok = true;
      for (int64_t j = 0; j < k; ++j) {
        for (int64_t c = 0; c < n; ++c) dwp_valid[j * n + c] = dwp[j * lddw + c];
        for (int64_t c = n; c < lddw; ++c) {
          dw_pad_ok = dw_pad_ok && SameBits1(dwp[j * lddw + c], sentinel);
        }
      }
      log.Expect(SameBits(dwp_valid, dw1), "CsrSpmmTranspose padded lddy/lddw: same bits");
      log.Expect(dw_pad_ok, "CsrSpmmTranspose padded lddw: padding untouched");
    }

    const Ref ref_sdw = RefSpmmT(a, dy, k, n, sub_rows);
    size_t ws2 = 0;
    HCHECK(CsrSpmmTransposeWorkspaceBytes<T>(n_sub, k, nnz_sub, &ws2));
    DevBytes w2(ws2);
    d_dw.Upload(std::vector<T>(static_cast<size_t>(k * n), sentinel));
    HCHECK(CsrSpmmTransposeGpu<T>(scsr, d_sub.p, d_dy.p, n, n, d_dw.p, n, false, w2.p, ws2,
                                  st));
    HCHECK(cudaStreamSynchronize(st));
    CompareNumeric(d_dw.Download(), ref_sdw, tol, "CsrSpmmTranspose(subset, dy_rows)", &log);
  }

  // 7. SDDMM: mask = A, x = dY [m, n], y = B [k, n] (the ReLU dX pattern).
  {
    const Ref ref_s = RefSddmm(a, dy, b, m, k, n);
    DevBuf<T> d_s;
    d_s.Upload(std::vector<T>(static_cast<size_t>(m * k), sentinel));
    HCHECK(SddmmGpu<T>(d_a.p, d_dy.p, d_b.p, m, k, n, d_s.p, st));
    HCHECK(cudaStreamSynchronize(st));
    const std::vector<T> s1 = d_s.Download();
    // The mask's NaN/Inf are positions, not values, for SDDMM.
    CompareNumeric(s1, ref_s, tol, "Sddmm", &log);
    HCHECK(SddmmGpu<T>(d_a.p, d_dy.p, d_b.p, m, k, n, d_s.p, st));
    HCHECK(cudaStreamSynchronize(st));
    log.Expect(SameBits(d_s.Download(), s1), "Sddmm deterministic bits");
    // Misaligned copies of x and y (scalar loads) must give the same bits.
    DevBuf<T> d_xo(static_cast<size_t>(m * n + 1)), d_yo(static_cast<size_t>(k * n + 1));
    if (m * n > 0) {
      HCHECK(cudaMemcpy(d_xo.p + 1, d_dy.p, m * n * sizeof(T), cudaMemcpyDeviceToDevice));
    }
    if (k * n > 0) {
      HCHECK(cudaMemcpy(d_yo.p + 1, d_b.p, k * n * sizeof(T), cudaMemcpyDeviceToDevice));
    }
    HCHECK(SddmmGpu<T>(d_a.p, d_xo.p + 1, d_yo.p + 1, m, k, n, d_s.p, st));
    HCHECK(cudaStreamSynchronize(st));
    log.Expect(SameBits(d_s.Download(), s1), "Sddmm bits independent of alignment");
  }

  // 8. ScatterRows / ZeroRows (exact).
  {
    const std::vector<T> src = RandomSparse<T>(&rng, n_sub * n, 0.3);
    DevBuf<T> d_src, d_c;
    d_src.Upload(src);
    std::vector<T> expect(static_cast<size_t>(m * n), sentinel);
    d_c.Upload(expect);
    HCHECK(ScatterRowsGpu<T>(d_src.p, d_sub.p, n_sub, n, d_c.p, n, st));
    HCHECK(cudaStreamSynchronize(st));
    for (int64_t r = 0; r < n_sub; ++r)
      for (int64_t j = 0; j < n; ++j) expect[sub_rows[r] * n + j] = src[r * n + j];
    log.Expect(SameBits(d_c.Download(), expect), "ScatterRows");
    HCHECK(ZeroRowsGpu<T>(d_sub.p, n_sub, n, d_c.p, n, st));
    HCHECK(cudaStreamSynchronize(st));
    for (int64_t r = 0; r < n_sub; ++r)
      for (int64_t j = 0; j < n; ++j) expect[sub_rows[r] * n + j] = FromD<T>(0.0);
    log.Expect(SameBits(d_c.Download(), expect), "ZeroRows");
  }

  HCHECK(cudaStreamDestroy(st));
  std::printf("%s %-8s m=%-5lld k=%-5lld n=%-5lld sparsity=%-4.2f%s nnz=%-8lld %s\n",
              log.ok ? "PASS" : "FAIL", TypeName<T>(), static_cast<long long>(m),
              static_cast<long long>(k), static_cast<long long>(n), sparsity,
              with_nan ? " +NaN/Inf" : "", static_cast<long long>(nnz),
              ErrText<T>(log.worst_err, tol).c_str());
  if (!log.ok) std::fputs(log.failures.c_str(), stdout);
  std::fflush(stdout);
  return log.ok;
}

// ---------------------------------------------------------------------------
// Bias + activation epilogue (BiasActivationGpu): bit-exact against the host
// doing the same arithmetic (Acc<T> add, relu/relu6, one rounding to T), on
// a padded ldc (the padding must stay untouched), with NaN, +-Inf, -0 and
// negative values in c.

template <typename T>
struct HostAcc {
  typedef float type;
};
template <>
struct HostAcc<double> {
  typedef double type;
};

template <typename T>
bool RunEpilogueCase(int64_t m, int64_t n, bool with_bias, int act, uint64_t seed) {
  typedef typename HostAcc<T>::type A;
  cudaStream_t st;
  HCHECK(cudaStreamCreate(&st));
  CaseLog log;
  Rng rng(seed);
  const int64_t ldc = n + 3;
  const T sentinel = FromD<T>(7.25);
  std::vector<T> c(static_cast<size_t>(m * ldc), sentinel), bias;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = FromD<T>(8.0 * rng.Value());  // +-8
  if (m * n > 0) c[0] = FromD<T>(std::numeric_limits<double>::quiet_NaN());
  if (m * n > 1) c[1] = FromD<T>(-std::numeric_limits<double>::infinity());
  if (m * n > 2) c[2] = FromD<T>(-0.0);
  if (m * n > 3) c[3] = FromD<T>(0.0);
  if (with_bias) {
    bias.resize(static_cast<size_t>(n));
    for (auto& x : bias) x = FromD<T>(rng.Value());
  }
  std::vector<T> expect(c);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      A v = static_cast<A>(ToD(c[i * ldc + j]));
      if (with_bias) v += static_cast<A>(ToD(bias[j]));
      if (act >= 1) v = v < A(0) ? A(0) : v;
      if (act == 2) v = v > A(6) ? A(6) : v;
      expect[i * ldc + j] = FromD<T>(static_cast<double>(v));  // exact: v is in A
    }
  }
  DevBuf<T> d_c, d_bias;
  d_c.Upload(c);
  d_bias.Upload(bias);
  HCHECK(BiasActivationGpu<T>(d_c.p, m, n, ldc, with_bias ? d_bias.p : nullptr, act, st));
  HCHECK(cudaStreamSynchronize(st));
  const std::vector<T> got = d_c.Download();
  size_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const bool both_nan = std::isnan(ToD(got[i])) && std::isnan(ToD(expect[i]));
    if (!both_nan && !SameBits1(got[i], expect[i])) ++bad;
  }
  char buf[96];
  std::snprintf(buf, sizeof(buf), "BiasActivation: %zu elements differ from the host's bits", bad);
  log.Expect(bad == 0, buf);
  log.Expect(BiasActivationGpu<T>(d_c.p, m, n, n, nullptr, 3, st) == cudaErrorInvalidValue,
             "BiasActivation rejects an unknown activation");
  HCHECK(cudaStreamDestroy(st));
  std::printf("%s %-8s epilogue m=%-5lld n=%-5lld ldc=n+3 bias=%d act=%s\n",
              log.ok ? "PASS" : "FAIL", TypeName<T>(), static_cast<long long>(m),
              static_cast<long long>(n), with_bias ? 1 : 0,
              act == 0 ? "none" : (act == 1 ? "relu" : "relu6"));
  if (!log.ok) std::fputs(log.failures.c_str(), stdout);
  std::fflush(stdout);
  return log.ok;
}

// ---------------------------------------------------------------------------
// The split of one SparseSplitMatMul call, as the GPU op runs it: counts on
// the GPU, rows of density > 1/2 dense (gathered with the live columns of
// op(a) and the matching rows of b, multiplied by cuBLAS cublasGemmEx in T
// with CUBLAS_COMPUTE_32F -- 64F for float64 --, scattered back), the other
// rows (all-zero rows among them) through the CSR SpMM, then bias + relu.
// Rows cycle through densities 1, 0, 0.05, 0.3 and 0.7, and every 5th column
// of a is all zero. Checked against the float64 reference before the
// epilogue (all-zero rows exactly 0) and after it.

#ifndef TFSS_HARNESS_NO_CUBLAS
template <typename T>
struct GemmTypes;
template <>
struct GemmTypes<float> {
  typedef float Scale;
  static constexpr cudaDataType_t kData = CUDA_R_32F;
  static constexpr cublasComputeType_t kCompute = CUBLAS_COMPUTE_32F;
};
template <>
struct GemmTypes<double> {
  typedef double Scale;
  static constexpr cudaDataType_t kData = CUDA_R_64F;
  static constexpr cublasComputeType_t kCompute = CUBLAS_COMPUTE_64F;
};
template <>
struct GemmTypes<__nv_bfloat16> {
  typedef float Scale;
  static constexpr cudaDataType_t kData = CUDA_R_16BF;
  static constexpr cublasComputeType_t kCompute = CUBLAS_COMPUTE_32F;
};
template <>
struct GemmTypes<__half> {
  typedef float Scale;
  static constexpr cudaDataType_t kData = CUDA_R_16F;
  static constexpr cublasComputeType_t kCompute = CUBLAS_COMPUTE_32F;
};

// Row-major c[rows, n] = a[rows, kk] * b[kk, n] (column-major c^T = b^T a^T).
template <typename T>
void GemmRowMajor(cublasHandle_t h, const T* a, const T* b, T* c, int64_t rows, int64_t kk,
                  int64_t n) {
  typedef GemmTypes<T> G;
  const typename G::Scale one = 1, zero = 0;
  BCHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(rows),
                      static_cast<int>(kk), &one, b, G::kData, static_cast<int>(n), a, G::kData,
                      static_cast<int>(kk), &zero, c, G::kData, static_cast<int>(n), G::kCompute,
                      CUBLAS_GEMM_DEFAULT));
}
#endif  // TFSS_HARNESS_NO_CUBLAS

template <typename T>
bool RunSplitCase(int64_t m, int64_t k, int64_t n, uint64_t seed) {
#ifdef TFSS_HARNESS_NO_CUBLAS
  (void)m, (void)k, (void)n, (void)seed;
  std::printf("SKIP %-8s split m=%lld k=%lld n=%lld (built without cuBLAS)\n", TypeName<T>(),
              static_cast<long long>(m), static_cast<long long>(k), static_cast<long long>(n));
  return true;
#else
  const double tol = Tolerance<T>();
  cudaStream_t st;
  HCHECK(cudaStreamCreate(&st));
  cublasHandle_t h;
  BCHECK(cublasCreate(&h));
  BCHECK(cublasSetStream(h, st));
  CaseLog log;
  Rng rng(seed);
  const double densities[] = {1.0, 0.0, 0.05, 0.3, 0.7};
  std::vector<T> a(static_cast<size_t>(m * k), FromD<T>(0.0));
  for (int64_t i = 0; i < m; ++i) {
    const double d = densities[i % 5];
    for (int64_t j = 0; j < k; ++j) {
      if (j % 5 == 4) continue;  // an all-zero column
      if (rng.Uniform() < d) a[i * k + j] = FromD<T>(rng.Value());
    }
  }
  const std::vector<T> b = RandomSparse<T>(&rng, k * n, 0.0);
  std::vector<T> bias(static_cast<size_t>(n));
  for (auto& x : bias) x = FromD<T>(0.25 * rng.Value());
  DevBuf<T> d_a, d_b, d_bias;
  d_a.Upload(a);
  d_b.Upload(b);
  d_bias.Upload(bias);

  // Analysis on the GPU, the split on the host (as the op does).
  DevBuf<int64_t> d_rn(static_cast<size_t>(m)), d_cn(static_cast<size_t>(k));
  HCHECK(CountNonzerosGpu<T>(d_a.p, m, k, false, d_rn.p, d_cn.p, nullptr, st));
  HCHECK(cudaStreamSynchronize(st));
  const std::vector<int64_t> row_nnz = d_rn.Download(), col_nnz = d_cn.Download();
  std::vector<int64_t> dense_rows, sparse_rows, live;
  for (int64_t i = 0; i < m; ++i) (2 * row_nnz[i] > k ? dense_rows : sparse_rows).push_back(i);
  for (int64_t j = 0; j < k; ++j)
    if (col_nnz[j] != 0) live.push_back(j);
  const int64_t rd = static_cast<int64_t>(dense_rows.size());
  const int64_t rs = static_cast<int64_t>(sparse_rows.size());
  const int64_t kc = static_cast<int64_t>(live.size());
  DevBuf<int64_t> d_dense, d_sparse, d_live;
  d_dense.Upload(dense_rows);
  d_sparse.Upload(sparse_rows);
  d_live.Upload(live);
  DevBuf<T> d_c;
  d_c.Upload(std::vector<T>(static_cast<size_t>(m * n), FromD<T>(7.25)));  // all overwritten

  // Dense part: gather + cuBLAS + scatter.
  if (rd > 0 && n > 0) {
    DevBuf<T> d_ad(static_cast<size_t>(rd * kc)), d_bc(static_cast<size_t>(kc * n)),
        d_cd(static_cast<size_t>(rd * n));
    HCHECK(GatherSubmatrixGpu<T>(d_a.p, m, k, false, d_dense.p, rd, d_live.p, kc, d_ad.p, st));
    HCHECK(GatherSubmatrixGpu<T>(d_b.p, k, n, false, d_live.p, kc, nullptr, n, d_bc.p, st));
    if (kc > 0) {
      GemmRowMajor<T>(h, d_ad.p, d_bc.p, d_cd.p, rd, kc, n);
    } else {
      HCHECK(cudaMemsetAsync(d_cd.p, 0, d_cd.n * sizeof(T), st));
    }
    HCHECK(ScatterRowsGpu<T>(d_cd.p, d_dense.p, rd, n, d_c.p, n, st));
    HCHECK(cudaStreamSynchronize(st));
  }
  // Sparse part: CSR of the sparse rows, SpMM into their output rows.
  int64_t nnz_sparse = 0;
  if (rs > 0) {
    size_t ws = 0;
    HCHECK(BuildCsrRowPtrWorkspaceBytes(rs, &ws));
    DevBytes w(ws);
    DevBuf<int64_t> d_ptr(static_cast<size_t>(rs + 1));
    HCHECK(BuildCsrRowPtrGpu(d_rn.p, d_sparse.p, rs, d_ptr.p, w.p, ws, st));
    HCHECK(cudaMemcpyAsync(&nnz_sparse, d_ptr.p + rs, sizeof(int64_t), cudaMemcpyDeviceToHost,
                           st));
    HCHECK(cudaStreamSynchronize(st));
    DevBuf<int32_t> d_idx(static_cast<size_t>(nnz_sparse));
    DevBuf<T> d_val(static_cast<size_t>(nnz_sparse));
    HCHECK(FillCsrGpu<T>(d_a.p, m, k, false, d_sparse.p, rs, d_ptr.p, d_idx.p, d_val.p, st));
    GpuCsr<T> csr;
    csr.row_ptr = d_ptr.p;
    csr.col_idx = d_idx.p;
    csr.values = d_val.p;
    csr.n_rows = rs;
    csr.n_cols = k;
    csr.nnz = nnz_sparse;
    HCHECK(CsrSpmmGpu<T>(csr, d_sparse.p, d_b.p, n, n, d_c.p, n, st));
    HCHECK(cudaStreamSynchronize(st));
  }
  std::vector<int64_t> all_rows(static_cast<size_t>(m));
  for (int64_t i = 0; i < m; ++i) all_rows[i] = i;
  const Ref ref = RefSpmm(a, b, k, n, all_rows);
  const std::vector<T> prod = d_c.Download();
  CompareNumeric(prod, ref, tol, "split product (cuBLAS dense rows + CSR SpMM rows)", &log);
  bool zero_rows_exact = true;
  for (int64_t i = 0; i < m; ++i)
    if (row_nnz[i] == 0)
      for (int64_t j = 0; j < n; ++j)
        zero_rows_exact = zero_rows_exact && ToD(prod[i * n + j]) == 0.0;
  log.Expect(zero_rows_exact, "split: all-zero rows of a give exact zeros");

  HCHECK(BiasActivationGpu<T>(d_c.p, m, n, n, d_bias.p, /*relu=*/1, st));
  HCHECK(cudaStreamSynchronize(st));
  Ref ref_out(ref);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double& v = ref_out.v[i * n + j];
      v = std::max(v + ToD(bias[j]), 0.0);
      ref_out.mag[i * n + j] += std::fabs(ToD(bias[j]));
    }
  }
  CompareNumeric(d_c.Download(), ref_out, tol, "split + bias + relu", &log);
  BCHECK(cublasDestroy(h));
  HCHECK(cudaStreamDestroy(st));
  std::printf("%s %-8s split m=%-5lld k=%-5lld n=%-5lld dense rows=%lld sparse rows=%lld live "
              "cols=%lld nnz(sparse)=%lld %s\n",
              log.ok ? "PASS" : "FAIL", TypeName<T>(), static_cast<long long>(m),
              static_cast<long long>(k), static_cast<long long>(n), static_cast<long long>(rd),
              static_cast<long long>(rs), static_cast<long long>(kc),
              static_cast<long long>(nnz_sparse), ErrText<T>(log.worst_err, tol).c_str());
  if (!log.ok) std::fputs(log.failures.c_str(), stdout);
  std::fflush(stdout);
  return log.ok;
#endif  // TFSS_HARNESS_NO_CUBLAS
}

// ---------------------------------------------------------------------------
// Benchmark.

// Median of `reps` timings of fn (each bracketed by events) after `warmup`.
float TimeMs(const std::function<void()>& fn, cudaStream_t st, int warmup = 3, int reps = 20) {
  for (int i = 0; i < warmup; ++i) fn();
  HCHECK(cudaStreamSynchronize(st));
  cudaEvent_t e0, e1;
  HCHECK(cudaEventCreate(&e0));
  HCHECK(cudaEventCreate(&e1));
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) {
    HCHECK(cudaEventRecord(e0, st));
    fn();
    HCHECK(cudaEventRecord(e1, st));
    HCHECK(cudaEventSynchronize(e1));
    float ms = 0.f;
    HCHECK(cudaEventElapsedTime(&ms, e0, e1));
    t.push_back(ms);
  }
  HCHECK(cudaEventDestroy(e0));
  HCHECK(cudaEventDestroy(e1));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Device-to-device copy bandwidth, counting read + write bytes.
double MemcpyGBs(cudaStream_t st) {
  const size_t bytes = size_t{256} << 20;
  DevBytes src(bytes), dst(bytes);
  HCHECK(cudaMemsetAsync(src.p, 1, bytes, st));
  const float ms = TimeMs(
      [&] { HCHECK(cudaMemcpyAsync(dst.p, src.p, bytes, cudaMemcpyDeviceToDevice, st)); }, st);
  return 2.0 * bytes / (ms * 1e-3) / 1e9;
}

void Bench(bool quick) {
  cudaStream_t st;
  HCHECK(cudaStreamCreate(&st));
  const double copy_gbs = MemcpyGBs(st);
#ifndef TFSS_HARNESS_NO_CUBLAS
  cublasHandle_t h;
  BCHECK(cublasCreate(&h));
  BCHECK(cublasSetStream(h, st));
#endif
  std::printf("\n## Benchmark (float32; median of 20 after 3 warm-up; CUDA events)\n\n");
  std::printf("Baselines: cuBLAS SGEMM with FP32 math (CUBLAS_DEFAULT_MATH) and with TF32 "
              "tensor cores (CUBLAS_TF32_TENSOR_OP_MATH, what tf.matmul runs for float32 on "
              "Ampere+ while TF32 is enabled, TF's default). x FP32 / x TF32 = cuBLAS ms / "
              "ours ms (> 1: ours faster). GB/s = compulsory bytes (sparse operand + dense "
              "operand read once + output written) / time; %% copy = that rate as a share of "
              "a device-to-device cudaMemcpy (%.0f GB/s, read + write bytes). SpMM^T includes "
              "the CSC build (per-call cost in a backward pass); 'prep ms' is the CSR build "
              "(count + row_ptr + fill) for SpMM, the CSC build alone for SpMM^T. The 'CSR "
              "fill, transpose_a' row times FillCsrGpu alone on a stored [k, m] (bytes: a "
              "read once + CSR written).\n\n", copy_gbs);
  std::printf("| shape m x k x n | sparsity | op | FP32 ms | TF32 ms | ours ms | x FP32 | "
              "x TF32 | prep ms | ours GB/s | %% copy |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
  struct Shape {
    int64_t m, k, n;
  };
  std::vector<Shape> shapes = {{256, 1024, 1024}, {1024, 4096, 1024}};
  if (quick) shapes = {{256, 1024, 1024}};
  const double sparsities[] = {0.0, 0.5, 0.9, 0.99, 1.0};
  for (const Shape& s : shapes) {
    const int64_t m = s.m, k = s.k, n = s.n;
    for (double sp : sparsities) {
      Rng rng(0x5eed ^ static_cast<uint64_t>(m * 131 + k * 7 + n) ^
              static_cast<uint64_t>(sp * 1000));
      DevBuf<float> d_a, d_at, d_b, d_dy, d_c(static_cast<size_t>(m * n)),
          d_dw(static_cast<size_t>(k * n)), d_s(static_cast<size_t>(m * k));
      const std::vector<float> a = RandomSparse<float>(&rng, m * k, sp);
      d_a.Upload(a);
      d_at.Upload(Transposed(a, m, k));
      d_b.Upload(RandomSparse<float>(&rng, k * n, 0.0));
      d_dy.Upload(RandomSparse<float>(&rng, m * n, 0.0));
      // CSR build with buffers sized for the worst case (no host round trip).
      DevBuf<int64_t> d_rn(static_cast<size_t>(m)), d_cn(static_cast<size_t>(k)),
          d_ptr(static_cast<size_t>(m + 1));
      DevBuf<int32_t> d_idx(static_cast<size_t>(m * k));
      DevBuf<float> d_val(static_cast<size_t>(m * k));
      size_t ws = 0;
      HCHECK(BuildCsrRowPtrWorkspaceBytes(m, &ws));
      DevBytes w(ws);
      auto build = [&] {
        HCHECK(CountNonzerosGpu<float>(d_a.p, m, k, false, d_rn.p, d_cn.p, nullptr, st));
        HCHECK(BuildCsrRowPtrGpu(d_rn.p, nullptr, m, d_ptr.p, w.p, ws, st));
        HCHECK(FillCsrGpu<float>(d_a.p, m, k, false, nullptr, m, d_ptr.p, d_idx.p, d_val.p, st));
      };
      const float build_ms = TimeMs(build, st);
      // The transposed fill alone (a stored [k, m], transpose_a = true).
      const float fill_t_ms = TimeMs([&] {
        HCHECK(FillCsrGpu<float>(d_at.p, k, m, true, nullptr, m, d_ptr.p, d_idx.p, d_val.p, st));
      }, st);
      // Leave the row-major CSR in place for the products below.
      build();
      HCHECK(cudaStreamSynchronize(st));
      int64_t nnz = 0;
      HCHECK(cudaMemcpy(&nnz, d_ptr.p + m, sizeof(int64_t), cudaMemcpyDeviceToHost));
      GpuCsr<float> csr;
      csr.row_ptr = d_ptr.p;
      csr.col_idx = d_idx.p;
      csr.values = d_val.p;
      csr.n_rows = m;
      csr.n_cols = k;
      csr.nnz = nnz;

      const float one = 1.f, zero = 0.f;
      float gemm_ms[2] = {NAN, NAN}, gemm_t_ms[2] = {NAN, NAN}, gemm_s_ms[2] = {NAN, NAN};
#ifndef TFSS_HARNESS_NO_CUBLAS
      for (int mode = 0; mode < 2; ++mode) {  // 0: FP32 math, 1: TF32 tensor ops
        BCHECK(cublasSetMathMode(h, mode == 0 ? CUBLAS_DEFAULT_MATH
                                              : CUBLAS_TF32_TENSOR_OP_MATH));
        // Row-major C[m,n] = A[m,k] B[k,n]  <=>  column-major C^T = B^T A^T.
        gemm_ms[mode] = TimeMs([&] {
          BCHECK(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, n, m, k, &one, d_b.p, n, d_a.p, k,
                             &zero, d_c.p, n));
        }, st);
        // dW[k,n] = A^T dY.
        gemm_t_ms[mode] = TimeMs([&] {
          BCHECK(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_T, n, k, m, &one, d_dy.p, n, d_a.p, k,
                             &zero, d_dw.p, n));
        }, st);
        // S[m,k] = dY[m,n] B[k,n]^T (dense equivalent of the SDDMM).
        gemm_s_ms[mode] = TimeMs([&] {
          BCHECK(cublasSgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, k, m, n, &one, d_b.p, n, d_dy.p, n,
                             &zero, d_s.p, k));
        }, st);
      }
#else
      (void)one;
      (void)zero;
#endif
      const float spmm_ms =
          TimeMs([&] { HCHECK(CsrSpmmGpu<float>(csr, nullptr, d_b.p, n, n, d_c.p, n, st)); }, st);

      size_t wst = 0;
      HCHECK(CsrSpmmTransposeWorkspaceBytes<float>(m, k, nnz, &wst));
      DevBytes wt(wst);
      const float spmmt_ms = TimeMs([&] {
        HCHECK(CsrSpmmTransposeGpu<float>(csr, nullptr, d_dy.p, n, n, d_dw.p, n, false, wt.p, wst,
                                          st));
      }, st);
      size_t wsc = 0;
      HCHECK(CsrToCscWorkspaceBytes(m, k, nnz, &wsc));
      DevBytes wc(wsc);
      DevBuf<int64_t> d_cp(static_cast<size_t>(k + 1));
      DevBuf<int32_t> d_ri(static_cast<size_t>(nnz));
      DevBuf<float> d_cv(static_cast<size_t>(nnz));
      const float csc_ms = TimeMs([&] {
        HCHECK(CsrToCscGpu<float>(csr, d_cp.p, d_ri.p, d_cv.p, wc.p, wsc, st));
      }, st);
      const float sddmm_ms =
          TimeMs([&] { HCHECK(SddmmGpu<float>(d_a.p, d_dy.p, d_b.p, m, k, n, d_s.p, st)); }, st);

      const double f = sizeof(float);
      const double csr_bytes = nnz * (4.0 + f) + (m + 1) * 8.0;
      const double spmm_bytes = csr_bytes + k * n * f + m * n * f;
      const double spmmt_bytes = csr_bytes + m * n * f + k * n * f;
      const double sddmm_bytes = m * k * f + m * n * f + k * n * f + m * k * f;
      const double fill_bytes = m * k * f + csr_bytes;
      char shape[64];
      std::snprintf(shape, sizeof(shape), "%lldx%lldx%lld", static_cast<long long>(m),
                    static_cast<long long>(k), static_cast<long long>(n));
      auto row = [&](const char* op, const float* base, float ours, float prep, double bytes) {
        const double gbs = bytes / (ours * 1e-3) / 1e9;
        std::printf("| %s | %.2f | %s | %.4f | %.4f | %.4f | %.2f | %.2f | %.4f | %.1f | %.0f%% |\n",
                    shape, sp, op, base[0], base[1], ours, base[0] / ours, base[1] / ours, prep,
                    gbs, 100.0 * gbs / copy_gbs);
      };
      row("SpMM C=A*B", gemm_ms, spmm_ms, build_ms, spmm_bytes);
      row("SpMM^T dW=A^T*dY", gemm_t_ms, spmmt_ms, csc_ms, spmmt_bytes);
      row("SDDMM (dY*B^T)[A!=0]", gemm_s_ms, sddmm_ms, 0.f, sddmm_bytes);
      std::printf("| %s | %.2f | CSR fill, transpose_a | - | - | %.4f | - | - | - | %.1f | "
                  "%.0f%% |\n", shape, sp, fill_t_ms, fill_bytes / (fill_t_ms * 1e-3) / 1e9,
                  100.0 * fill_bytes / (fill_t_ms * 1e-3) / 1e9 / copy_gbs);
      std::fflush(stdout);
    }
  }
#ifndef TFSS_HARNESS_NO_CUBLAS
  BCHECK(cublasDestroy(h));
#else
  std::printf("\n(built without cuBLAS: TFSS_HARNESS_NO_CUBLAS; the cuBLAS columns are nan)\n");
#endif
  HCHECK(cudaStreamDestroy(st));
}

// The bfloat16 (or float16) kernels of a SparseSplitMatMul forward call
// against the dense cuBLAS GEMM in the same dtype (cublasGemmEx, float32
// compute: what tf.matmul runs), same run, CUDA events: the CSR build
// (count + row_ptr + fill), the SpMM, the SDDMM (vs the dense S = dY B^T),
// and achieved bandwidth.
template <typename T>
void Bench16(bool quick) {
  cudaStream_t st;
  HCHECK(cudaStreamCreate(&st));
  const double copy_gbs = MemcpyGBs(st);
#ifndef TFSS_HARNESS_NO_CUBLAS
  cublasHandle_t h;
  BCHECK(cublasCreate(&h));
  BCHECK(cublasSetStream(h, st));
#endif
  std::printf("\n## Benchmark (%s; median of 20 after 3 warm-up; CUDA events)\n\n"
              "Baseline: cuBLAS cublasGemmEx in %s with CUBLAS_COMPUTE_32F (tensor cores; what "
              "tf.matmul runs in this dtype). x GEMM = cuBLAS ms / ours ms (> 1: ours faster); "
              "prep ms = the CSR build (count + row_ptr + fill); GB/s and %% copy as above "
              "(copy: %.0f GB/s).\n\n", TypeName<T>(), TypeName<T>(), copy_gbs);
  std::printf("| shape m x k x n | sparsity | op | %s GEMM ms | ours ms | x GEMM | prep ms | "
              "ours GB/s | %% copy |\n", TypeName<T>());
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  struct Shape {
    int64_t m, k, n;
  };
  std::vector<Shape> shapes = {{256, 1024, 1024}, {1024, 4096, 1024}};
  if (quick) shapes = {{256, 1024, 1024}};
  const double sparsities[] = {0.0, 0.5, 0.9, 0.99, 1.0};
  for (const Shape& s : shapes) {
    const int64_t m = s.m, k = s.k, n = s.n;
    for (double sp : sparsities) {
      Rng rng(0xb16 ^ static_cast<uint64_t>(m * 131 + k * 7 + n) ^
              static_cast<uint64_t>(sp * 1000));
      DevBuf<T> d_a, d_b, d_dy, d_c(static_cast<size_t>(m * n)), d_s(static_cast<size_t>(m * k));
      d_a.Upload(RandomSparse<T>(&rng, m * k, sp));
      d_b.Upload(RandomSparse<T>(&rng, k * n, 0.0));
      d_dy.Upload(RandomSparse<T>(&rng, m * n, 0.0));
      DevBuf<int64_t> d_rn(static_cast<size_t>(m)), d_cn(static_cast<size_t>(k)),
          d_ptr(static_cast<size_t>(m + 1));
      DevBuf<int32_t> d_idx(static_cast<size_t>(m * k));
      DevBuf<T> d_val(static_cast<size_t>(m * k));
      size_t ws = 0;
      HCHECK(BuildCsrRowPtrWorkspaceBytes(m, &ws));
      DevBytes w(ws);
      auto build = [&] {
        HCHECK(CountNonzerosGpu<T>(d_a.p, m, k, false, d_rn.p, d_cn.p, nullptr, st));
        HCHECK(BuildCsrRowPtrGpu(d_rn.p, nullptr, m, d_ptr.p, w.p, ws, st));
        HCHECK(FillCsrGpu<T>(d_a.p, m, k, false, nullptr, m, d_ptr.p, d_idx.p, d_val.p, st));
      };
      const float build_ms = TimeMs(build, st);
      build();
      HCHECK(cudaStreamSynchronize(st));
      int64_t nnz = 0;
      HCHECK(cudaMemcpy(&nnz, d_ptr.p + m, sizeof(int64_t), cudaMemcpyDeviceToHost));
      GpuCsr<T> csr;
      csr.row_ptr = d_ptr.p;
      csr.col_idx = d_idx.p;
      csr.values = d_val.p;
      csr.n_rows = m;
      csr.n_cols = k;
      csr.nnz = nnz;
      float gemm_ms = NAN, gemm_s_ms = NAN;
#ifndef TFSS_HARNESS_NO_CUBLAS
      gemm_ms = TimeMs([&] { GemmRowMajor<T>(h, d_a.p, d_b.p, d_c.p, m, k, n); }, st);
      // S[m, k] = dY[m, n] B[k, n]^T (column-major S^T = B dY^T).
      const float one = 1.f, zero = 0.f;
      gemm_s_ms = TimeMs([&] {
        BCHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(k),
                            static_cast<int>(m), static_cast<int>(n), &one, d_b.p,
                            GemmTypes<T>::kData, static_cast<int>(n), d_dy.p, GemmTypes<T>::kData,
                            static_cast<int>(n), &zero, d_s.p, GemmTypes<T>::kData,
                            static_cast<int>(k), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      }, st);
#endif
      const float spmm_ms =
          TimeMs([&] { HCHECK(CsrSpmmGpu<T>(csr, nullptr, d_b.p, n, n, d_c.p, n, st)); }, st);
      const float sddmm_ms =
          TimeMs([&] { HCHECK(SddmmGpu<T>(d_a.p, d_dy.p, d_b.p, m, k, n, d_s.p, st)); }, st);
      const double f = sizeof(T);
      const double csr_bytes = nnz * (4.0 + f) + (m + 1) * 8.0;
      const double spmm_bytes = csr_bytes + k * n * f + m * n * f;
      const double sddmm_bytes = 2.0 * m * k * f + m * n * f + k * n * f;
      char shape[64];
      std::snprintf(shape, sizeof(shape), "%lldx%lldx%lld", static_cast<long long>(m),
                    static_cast<long long>(k), static_cast<long long>(n));
      auto row = [&](const char* op, float base, float ours, float prep, double bytes) {
        const double gbs = bytes / (ours * 1e-3) / 1e9;
        std::printf("| %s | %.2f | %s | %.4f | %.4f | %.2f | %.4f | %.1f | %.0f%% |\n", shape, sp,
                    op, base, ours, base / ours, prep, gbs, 100.0 * gbs / copy_gbs);
      };
      row("SpMM C=A*B", gemm_ms, spmm_ms, build_ms, spmm_bytes);
      row("SDDMM (dY*B^T)[A!=0]", gemm_s_ms, sddmm_ms, 0.f, sddmm_bytes);
      std::fflush(stdout);
    }
  }
#ifndef TFSS_HARNESS_NO_CUBLAS
  BCHECK(cublasDestroy(h));
#endif
  HCHECK(cudaStreamDestroy(st));
}

int Main(int argc, char** argv) {
  bool tests = true, bench = true, quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--tests-only") {
      bench = false;
    } else if (arg == "--bench-only") {
      tests = false;
    } else if (arg == "--quick") {
      quick = true;
    } else {
      std::fprintf(stderr, "usage: %s [--tests-only|--bench-only] [--quick]\n", argv[0]);
      return 2;
    }
  }
  // Exit 77 ("no GPU") only when there is no device or no CUDA driver at all
  // (cudaDriverGetVersion reports 0). Any other failure -- e.g.
  // cudaErrorInsufficientDriver from an installed driver older than this
  // runtime -- is an error: a GPU exists but cannot run these kernels.
  int devices = 0, driver = 0, runtime = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  cudaGetLastError();
  if (e == cudaErrorNoDevice || (e == cudaSuccess && devices == 0) || driver == 0) {
    std::printf("no CUDA device (%s)\n",
                driver == 0 ? "no CUDA driver installed"
                            : (e != cudaSuccess ? cudaGetErrorName(e) : "0 devices"));
    return 77;
  }
  if (e != cudaSuccess) {
    std::printf("FAIL: the CUDA runtime cannot use the GPU: %s (%s); driver supports CUDA %d, "
                "runtime is %d\n", cudaGetErrorName(e), cudaGetErrorString(e), driver, runtime);
    return 1;
  }
  cudaDeviceProp prop;
  HCHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device 0: %s, sm_%d%d, %d SMs, %.1f GiB\n", prop.name, prop.major, prop.minor,
              prop.multiProcessorCount, prop.totalGlobalMem / 1073741824.0);

  int failed = 0, passed = 0;
  if (tests) {
    std::printf("\n## Tests: every kernel vs a CPU float64 reference; normwise relative error "
                "max|got-ref|/max|ref| <= 1e-5 (float32), <= 1e-12 (float64); bfloat16 and "
                "float16 elementwise |got-ref| <= eps_T |ref| + (eps_T + 4 K eps_f32) |x|.|y|; "
                "structural outputs exact; the epilogue bit-exact; the cuBLAS + CSR split "
                "against act(A B + bias)\n\n");
    struct Shape {
      int64_t m, k, n;
    };
    // (33, 70, 132): n % 4 == 0 and n % 128 != 0, a partial last 16-byte
    // strip; (5, 40, 36) and (7, 13, 5): the small-n kernel; (33, 70, 129):
    // scalar loads.
    std::vector<Shape> small = {{0, 0, 0}, {0, 5, 3},   {4, 0, 3},     {4, 5, 0},
                                {1, 1, 1}, {7, 13, 5},  {1000, 3, 17}, {33, 70, 129},
                                {33, 70, 132}, {5, 40, 36}};
    // float64 at n = 2 (one lane group per nonzero, P = 32) and n = 64 (the
    // 16-byte strip kernel exactly one strip wide).
    std::vector<Shape> small_double = {{37, 50, 2}, {37, 50, 64}};
    // More rows than gridDim.y allows (65,535): the grid-stride fallbacks of
    // ScatterRows/ZeroRows (one grid row per row), and with 8.5M rows those
    // of GatherSubmatrix (32 rows per grid row) and CountNonzeros (128).
    std::vector<Shape> tall = {{70000, 5, 3}, {8500000, 3, 2}};
    std::vector<Shape> large = {{256, 1024, 1024}, {1024, 4096, 1024}};
    if (quick) {
      large.clear();
      tall.resize(1);
    }
    const double sparsities[] = {0.0, 0.5, 0.9, 0.99, 1.0};
    uint64_t seed = 1;
    auto tally = [&](bool ok) { ok ? ++passed : ++failed; };
    for (const Shape& s : small) {
      for (double sp : sparsities) {
        tally(RunCase<float>(s.m, s.k, s.n, sp, false, seed++));
        tally(RunCase<double>(s.m, s.k, s.n, sp, false, seed++));
      }
    }
    for (const Shape& s : small_double)
      for (double sp : sparsities) tally(RunCase<double>(s.m, s.k, s.n, sp, false, seed++));
    for (const Shape& s : tall) tally(RunCase<float>(s.m, s.k, s.n, 0.5, false, seed++));
    tally(RunCase<float>(7, 13, 5, 0.5, true, seed++));
    tally(RunCase<double>(33, 70, 129, 0.5, true, seed++));
    for (const Shape& s : large)
      for (double sp : sparsities) tally(RunCase<float>(s.m, s.k, s.n, sp, false, seed++));

    // bfloat16 and float16: the small shapes, n at each kernel boundary of
    // the 16-bit types (n <= 128: the small-n kernel, P = 32 at n = 8 down to
    // P = 2 at n = 128; n = 136: the 16-byte strip kernel with a partial
    // strip; n = 129, 133: scalar loads), the grid-stride fallback, NaN/Inf,
    // and one large shape.
    std::vector<Shape> small16 = {{37, 50, 8}, {37, 50, 128}, {37, 50, 136}, {37, 50, 133},
                                  {64, 300, 70}, {130, 257, 64}};
    std::vector<Shape> large16 = {{256, 1024, 1024}};
    if (quick) large16.clear();
    const double sparsities16[] = {0.0, 0.5, 0.9, 1.0};
    for (const Shape& s : small) {
      for (double sp : sparsities) {
        tally(RunCase<__nv_bfloat16>(s.m, s.k, s.n, sp, false, seed++));
        tally(RunCase<__half>(s.m, s.k, s.n, sp, false, seed++));
      }
    }
    for (const Shape& s : small16) {
      for (double sp : sparsities16) {
        tally(RunCase<__nv_bfloat16>(s.m, s.k, s.n, sp, false, seed++));
        tally(RunCase<__half>(s.m, s.k, s.n, sp, false, seed++));
      }
    }
    tally(RunCase<__nv_bfloat16>(70000, 5, 3, 0.5, false, seed++));
    tally(RunCase<__half>(70000, 5, 3, 0.5, false, seed++));
    tally(RunCase<__nv_bfloat16>(7, 13, 5, 0.5, true, seed++));
    tally(RunCase<__half>(33, 70, 129, 0.5, true, seed++));
    for (const Shape& s : large16) {
      for (double sp : {0.5, 0.9}) {
        tally(RunCase<__nv_bfloat16>(s.m, s.k, s.n, sp, false, seed++));
        tally(RunCase<__half>(s.m, s.k, s.n, sp, false, seed++));
      }
    }

    // The epilogue, every dtype: sizes around the 256-thread block, with and
    // without a bias, each activation.
    const Shape epi[] = {{0, 0, 5}, {1, 0, 1}, {7, 0, 13}, {33, 0, 300}, {70000, 0, 3}};
    for (const Shape& s : epi) {
      for (int act = 0; act <= 2; ++act) {
        for (int with_bias = 0; with_bias <= 1; ++with_bias) {
          tally(RunEpilogueCase<float>(s.m, s.n, with_bias == 1, act, seed++));
          tally(RunEpilogueCase<double>(s.m, s.n, with_bias == 1, act, seed++));
          tally(RunEpilogueCase<__nv_bfloat16>(s.m, s.n, with_bias == 1, act, seed++));
          tally(RunEpilogueCase<__half>(s.m, s.n, with_bias == 1, act, seed++));
        }
      }
    }

    // The split (cuBLAS dense rows + CSR SpMM rows + epilogue), every dtype.
    std::vector<Shape> split = {{1, 1, 1}, {5, 13, 5}, {33, 70, 129}, {130, 257, 64},
                                {64, 300, 136}};
    if (!quick) split.push_back({256, 1024, 1024});
    for (const Shape& s : split) {
      tally(RunSplitCase<float>(s.m, s.k, s.n, seed++));
      tally(RunSplitCase<double>(s.m, s.k, s.n, seed++));
      tally(RunSplitCase<__nv_bfloat16>(s.m, s.k, s.n, seed++));
      tally(RunSplitCase<__half>(s.m, s.k, s.n, seed++));
    }
    std::printf("\n%d passed, %d failed\n", passed, failed);
    if (passed + failed == 0) {
      std::printf("FAIL: no test case ran\n");
      return 1;
    }
  }
  if (bench) {
    Bench(quick);
    Bench16<__nv_bfloat16>(quick);
  }
  return failed == 0 ? 0 : 1;
}

}  // namespace harness
}  // namespace tf_sparse_split

int main(int argc, char** argv) { return tf_sparse_split::harness::Main(argc, argv); }
