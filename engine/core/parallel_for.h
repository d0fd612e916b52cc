// A fixed set of threads that run the iterations of one loop together, the calling thread
// included; the engine uses it to sample the rows of a step in parallel.
//
//   ParallelFor pool(/*num_workers=*/4);                  // 3 threads + the caller
//   pool.Run(num_rows, [&](int worker, int i) { samplers[worker].Sample(row(i), ...); });
//
// Run returns once every iteration is done. Iterations go to workers dynamically; `worker` is in
// [0, num_workers) and no two iterations run on the same worker at once, so per-worker scratch
// (one Sampler each) needs no lock. One Run at a time.
#pragma once

#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace exl3::engine {

class ParallelFor {
 public:
  using Body = std::function<void(int worker, int i)>;

  explicit ParallelFor(int num_workers);
  ~ParallelFor();
  ParallelFor(const ParallelFor&) = delete;
  ParallelFor& operator=(const ParallelFor&) = delete;

  int num_workers() const { return static_cast<int>(threads_.size()) + 1; }
  void Run(int n, const Body& body);

 private:
  void WorkerLoop(int worker);
  // Runs iterations until none is left; returns how many it ran.
  int Drain(int worker);

  std::mutex mu_;
  std::condition_variable work_ready_;
  std::condition_variable work_done_;
  const Body* body_ = nullptr;  // of the current Run
  int n_ = 0;
  int next_ = 0;                // next iteration to hand out
  int done_ = 0;
  uint64_t generation_ = 0;     // counts Runs, so that a worker joins each Run once
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace exl3::engine
