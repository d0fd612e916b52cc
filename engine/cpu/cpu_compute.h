// The CPU resources one model's forward pass uses: the EXL3 backend (its own threads, serialised
// calls) and a pool for everything else (dense products, attention). Calls are serialised by the
// engine's step loop, so the two pools are never busy at once.
#pragma once

#include <functional>
#include <memory>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/thread_pool.h"

namespace exl3::engine {

class CpuCompute {
 public:
  explicit CpuCompute(int num_threads) : exl3_(num_threads), pool_(num_threads) {}
  cpu::CpuBackend& exl3() { return exl3_; }
  int num_threads() const { return pool_.size(); }
  // fn(item) for item in [0, n), spread over the pool.
  void ParallelFor(int n, const std::function<void(int)>& fn) {
    pool_.ParallelFor(n, [&](int item, int) { fn(item); });
  }

 private:
  cpu::CpuBackend exl3_;
  cpu::ThreadPool pool_;
};

}  // namespace exl3::engine
