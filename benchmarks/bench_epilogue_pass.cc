// Times the epilogue pass of cc/core/epilogue.h alone (one thread, no
// TensorFlow): c = act(c + bias) over an [m, n] float32 output, the work
// SparseSplitMatMul adds after its product. Compare with the product's time
// (2*m*k*n flop at ~210 GFLOP/s on 2 cores) and with what TF's fused
// MatMul + BiasAdd + Relu saves over MatMul + a separate pass.
//
//   g++ -std=c++17 -O3 -march=native -I. benchmarks/bench_epilogue_pass.cc \
//       -o /tmp/bench_epilogue_pass && /tmp/bench_epilogue_pass
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <random>
#include <vector>

#include "cc/core/epilogue.h"

int main() {
  using tf_sparse_split::Activation;
  const tf_sparse_split::ParallelFor serial =
      [](int64_t total, int64_t, const std::function<void(int64_t, int64_t)>& fn) {
        fn(0, total);
      };
  const int64_t shapes[][2] = {{128, 2048}, {128, 10}, {1024, 1024}};
  std::printf("| m x n | none+bias (us) | relu+bias (us) | relu6+bias (us) | GB/s (relu) |\n|---|---|---|---|---|\n");
  for (const auto& s : shapes) {
    const int64_t m = s[0], n = s[1];
    std::vector<float> c(m * n), bias(n);
    std::mt19937 gen(1);
    std::normal_distribution<float> d;
    for (auto& v : c) v = d(gen);
    for (auto& v : bias) v = d(gen);
    double best[3];
    const Activation acts[3] = {Activation::kNone, Activation::kRelu, Activation::kRelu6};
    for (int a = 0; a < 3; ++a) {
      best[a] = 1e30;
      for (int rep = 0; rep < 200; ++rep) {
        const auto t0 = std::chrono::steady_clock::now();
        tf_sparse_split::BiasActivationRows<float>(c.data(), n, nullptr, m, n, bias.data(),
                                                   acts[a], serial);
        const auto t1 = std::chrono::steady_clock::now();
        best[a] = std::min(best[a], std::chrono::duration<double>(t1 - t0).count());
      }
    }
    std::printf("| %ldx%ld | %.2f | %.2f | %.2f | %.1f |\n", (long)m, (long)n, best[0] * 1e6,
                best[1] * 1e6, best[2] * 1e6, 2.0 * m * n * sizeof(float) / best[1] / 1e9);
  }
  return 0;
}
