// A small persistent thread pool for the CPU backend: ParallelFor hands out items dynamically to
// the workers and the calling thread, and returns when all are done.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace exl3::cpu {

class ThreadPool {
 public:
  // num_threads counts the calling thread: 1 runs everything inline. 0: hardware threads.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs fn(item, thread_index) for item in [0, n); thread_index in [0, size()). Not reentrant.
  void ParallelFor(int n, const std::function<void(int, int)>& fn);

 private:
  void WorkerLoop(int index);
  void RunItems(int thread_index);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  uint64_t generation_ = 0;
  bool stop_ = false;
  const std::function<void(int, int)>* fn_ = nullptr;
  int n_ = 0;
  std::atomic<int> next_{0};
  int active_ = 0;  // workers still inside the current generation
};

}  // namespace exl3::cpu
