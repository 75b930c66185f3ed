// The ParallelFor hook of cc/kernels over TensorFlow's intra-op thread pool,
// shared by every op kernel of the library.
#ifndef TF_SPARSE_SPLIT_CC_KERNELS_TF_PARALLEL_FOR_H_
#define TF_SPARSE_SPLIT_CC_KERNELS_TF_PARALLEL_FOR_H_

#include <algorithm>
#include <cstdint>
#include <functional>

#include "cc/core/sparse_matmul.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace tf_sparse_split {

// Small loops run on the calling thread; larger ones are cut into
// `blocks_per_thread` contiguous blocks per pool thread (the kernels hand
// over equal-cost units, and TF's adaptive sharding over-splits them, which
// costs balance on few cores; more than one block per thread lets a free
// thread take over the blocks of one that waits for its core).
inline ParallelFor TfParallelFor(::tensorflow::OpKernelContext* ctx,
                                 int64_t blocks_per_thread = 1) {
  auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  return [pool, blocks_per_thread](
             int64_t total, int64_t cost,
             const std::function<void(int64_t, int64_t)>& fn) {
    if (total <= 0) return;
    const int64_t threads = std::max(1, pool->NumThreads());
    // Small loops run inline: waking pool threads costs tens of
    // microseconds, more than such a loop (the cost estimates of the
    // kernels run ~4x high: 1e6 is roughly 100 us of work).
    if (threads == 1 || total == 1 || static_cast<double>(total) * cost < 1e6) {
      fn(0, total);
      return;
    }
    const int64_t blocks = std::min<int64_t>(total, threads * blocks_per_thread);
    const int64_t block = (total + blocks - 1) / blocks;
    pool->ParallelFor(
        total, ::tsl::thread::ThreadPool::SchedulingParams::Fixed(block), fn);
  };
}

}  // namespace tf_sparse_split

#endif  // TF_SPARSE_SPLIT_CC_KERNELS_TF_PARALLEL_FOR_H_
