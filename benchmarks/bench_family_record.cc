// Times FamilyModel::Record of cc/core/cost_model.h alone (one thread, no
// TensorFlow): the record an all-dense SparseSplitMatMul call makes after
// its dense part (a 128 x 2048 -> 10 product, its dense time against the
// family's prediction), over 64 families as in a model. "warm": record after
// record; "cold": every 4th record after a 4 MiB sweep that evicts the
// caches, as the GEMM between two calls of a layer does. Prints the median
// and 90th percentile of the records' wall-clock times (ns).
//
//   g++ -std=c++17 -O3 -march=native -I. benchmarks/bench_family_record.cc \
//       cc/core/cost_model.cc -o /tmp/bench_family_record && \
//   /tmp/bench_family_record warm && /tmp/bench_family_record cold
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "cc/core/cost_model.h"

int main(int argc, char** argv) {
  using namespace tf_sparse_split;
  const bool cold = argc > 1 && std::strcmp(argv[1], "cold") == 0;
  SplitShape s;
  s.m = 128;
  s.k = 2048;
  s.k_live = 2048;
  s.dense_flops_per_elem = 20;
  s.sparse_flops_per_nnz = 20;
  s.weight_elems_per_col = 10;
  std::vector<FamilyModel*> families;
  for (int i = 0; i < 64; ++i) {
    auto* f = new FamilyModel;
    CostTerms t;
    t.dense_rate = 2e10;
    t.dense_fixed_s = 5e-6;
    t.sparse_rate = 1e9;
    t.sparse_fixed_s = 1e-5;
    t.convert_s_per_elem = 1e-9;
    f->SetCalibration(t);
    f->RecordCount(1e5, 1e-5);
    families.push_back(f);
  }
  std::vector<char> sweep(4 << 20, 1);
  std::mt19937 gen(1);
  std::uniform_real_distribution<double> dense_s(1.0e-4, 1.4e-4);
  std::vector<double> ns;
  volatile long sink = 0;
  for (int it = 0; it < 20000; ++it) {
    FamilyModel* f = families[it % families.size()];
    const bool timed = it >= 2000 && (!cold || it % 4 == 0);
    if (cold && it % 4 == 0) {
      long acc = 0;
      for (size_t j = 0; j < sweep.size(); j += 64) acc += sweep[j]++;
      sink = sink + acc;
    }
    const double d = dense_s(gen);
    const auto t0 = std::chrono::steady_clock::now();
    f->Record(s, 128, false, d, 0, 0, 1e-8);
    const auto t1 = std::chrono::steady_clock::now();
    if (timed) ns.push_back(std::chrono::duration<double, std::nano>(t1 - t0).count());
  }
  std::sort(ns.begin(), ns.end());
  std::printf("FamilyModel::Record, %s: median %.0f ns, p90 %.0f ns (%zu records)\n",
              cold ? "cold" : "warm", ns[ns.size() / 2], ns[ns.size() * 9 / 10],
              ns.size());
  for (FamilyModel* f : families) delete f;
  return 0;
}
