// A small persistent thread pool for the CPU backend: ParallelFor hands out items dynamically to
// the workers and the calling thread, and returns as soon as every item is done (it never waits
// for a worker that took no item, which matters on oversubscribed machines).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
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

  // Runs fn(item, thread_index) for item in [0, n); thread_index in [0, size()). One call at a
  // time per pool (callers serialise).
  void ParallelFor(int n, const std::function<void(int, int)>& fn);

 private:
  // One ParallelFor call. Workers hold it by shared_ptr, so one that wakes late finds no item
  // left and never touches `fn` (which lives only for the call).
  struct Job {
    const std::function<void(int, int)>* fn = nullptr;
    int n = 0;
    std::atomic<int> next{0};
    std::atomic<int> done{0};
    std::mutex mu;
    std::condition_variable all_done;
  };
  void WorkerLoop(int index);
  static void RunItems(Job& job, int thread_index);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable wake_;
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::shared_ptr<Job> job_;
};

}  // namespace exl3::cpu
