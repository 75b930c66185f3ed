// Wall-clock timing of alternative code paths inside an op kernel: the
// split runtime's calibration (split_runtime.h), the convolutions' choice
// of sparse kernel and the matmul ops' choice of how to run a product with
// a transposed operand (transposed_product.h).
#ifndef TF_SPARSE_SPLIT_CC_KERNELS_INTERLEAVED_TIMING_H_
#define TF_SPARSE_SPLIT_CC_KERNELS_INTERLEAVED_TIMING_H_

#include <algorithm>
#include <chrono>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "tensorflow/core/platform/errors.h"

namespace tf_sparse_split {

using Clock = std::chrono::steady_clock;

inline double Seconds(Clock::time_point t0, Clock::time_point t1) {
  return std::chrono::duration<double>(t1 - t0).count();
}

// Times every function of `fns` once per round, round after round, and
// keeps each one's best wall-clock seconds in best[i]. Interleaving makes a
// burst of load on the (shared) machine hit all of them alike instead of
// biasing one path. The first round holds the one-time costs (TF's oneDNN
// primitive creation for each sample shape, the first touch of fresh
// buffers), so the number of rounds is chosen from the second: three more
// rounds, two when it takes over 50 ms, one over 300 ms (the calibration
// must stay cheap). Choosing from the first round left two rounds in all
// at a 32x28x28x1 -> 16 convolution (primitive creation made the first
// round ~100 ms): the dense path was timed on its second run, 1.5-1.9x its
// steady time, while the sparse path, with nothing to create, was timed at
// 1.1x, and the family took the sparse plan, 1.3x slower.
inline absl::Status BestSecondsInterleaved(
    const std::vector<std::function<absl::Status()>>& fns,
    std::vector<double>* best) {
  best->assign(fns.size(), 1e30);
  int rounds = 2;
  for (int round = 0; round < rounds; ++round) {
    const auto r0 = Clock::now();
    for (size_t i = 0; i < fns.size(); ++i) {
      const auto t0 = Clock::now();
      TF_RETURN_IF_ERROR(fns[i]());
      (*best)[i] = std::min((*best)[i], Seconds(t0, Clock::now()));
    }
    if (round == 1) {
      const double took = Seconds(r0, Clock::now());
      rounds = took > 0.3 ? 2 : took > 0.05 ? 3 : 4;
    }
  }
  return absl::OkStatus();
}

}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_KERNELS_INTERLEAVED_TIMING_H_
