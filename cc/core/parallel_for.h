// The thread-pool hook of the framework-free kernels: the caller supplies its
// pool (TF's intra-op pool in the ops, a std::thread pool in the pybind11
// module, or SerialFor).
#ifndef TF_SPARSE_SPLIT_CC_CORE_PARALLEL_FOR_H_
#define TF_SPARSE_SPLIT_CC_CORE_PARALLEL_FOR_H_

#include <cstdint>
#include <functional>

namespace tf_sparse_split {

// Runs fn(begin, end) over disjoint sub-ranges that together cover
// [0, total), possibly concurrently; returns when all have finished.
// cost_per_unit is a rough cost of one unit in cycles (used to size shards).
using ParallelFor = std::function<void(
    int64_t total, int64_t cost_per_unit,
    const std::function<void(int64_t, int64_t)>& fn)>;

// A ParallelFor that runs everything on the calling thread.
void SerialFor(int64_t total, int64_t cost_per_unit,
               const std::function<void(int64_t, int64_t)>& fn);

}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_CORE_PARALLEL_FOR_H_
