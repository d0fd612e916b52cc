#include "services/expert_worker/thread_pool.h"

namespace exl3::worker {

ThreadPool::ThreadPool(int threads) {
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { Loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::ParallelFor(int n, const std::function<void(int)>& fn) {
  if (n <= 0) return;
  if (workers_.empty() || n == 1) {
    for (int i = 0; i < n; ++i) fn(i);
    return;
  }
  std::unique_lock<std::mutex> l(mu_);
  fn_ = &fn;
  n_ = n;
  next_ = 0;
  active_ = 0;
  ++generation_;
  work_cv_.notify_all();
  while (next_ < n_) {
    const int i = next_++;
    ++active_;
    l.unlock();
    fn(i);
    l.lock();
    --active_;
  }
  done_cv_.wait(l, [&] { return active_ == 0; });
  fn_ = nullptr;
}

void ThreadPool::Loop() {
  uint64_t seen = 0;
  std::unique_lock<std::mutex> l(mu_);
  while (true) {
    work_cv_.wait(l, [&] { return stop_ || (generation_ != seen && fn_ != nullptr && next_ < n_); });
    if (stop_) return;
    seen = generation_;
    while (fn_ != nullptr && next_ < n_) {
      const int i = next_++;
      ++active_;
      const auto* fn = fn_;
      l.unlock();
      (*fn)(i);
      l.lock();
      if (--active_ == 0 && next_ >= n_) done_cv_.notify_all();
    }
  }
}

}  // namespace exl3::worker
