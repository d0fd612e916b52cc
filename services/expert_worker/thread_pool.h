// A fixed pool of threads running ParallelFor over an index range; the calling thread takes
// part. One ParallelFor at a time (the worker has one executor thread).
#pragma once

#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace exl3::worker {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);  // total threads including the caller; >= 1
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }
  // Calls fn(i) for i in [0, n), spread over the pool; returns when all calls are done.
  void ParallelFor(int n, const std::function<void(int)>& fn);

 private:
  void Loop();
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  const std::function<void(int)>* fn_ = nullptr;
  int n_ = 0, next_ = 0, active_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

}  // namespace exl3::worker
