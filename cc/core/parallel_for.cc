// SerialFor, the ParallelFor that runs on the calling thread.
#include "cc/core/parallel_for.h"

namespace tf_sparse_split {

void SerialFor(int64_t total, int64_t /*cost_per_unit*/,
               const std::function<void(int64_t, int64_t)>& fn) {
  if (total > 0) fn(0, total);
}

}  // namespace tf_sparse_split
