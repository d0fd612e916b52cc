#include "engine/core/parallel_for.h"

namespace exl3::engine {

ParallelFor::ParallelFor(int num_workers) {
  for (int w = 1; w < num_workers; ++w) threads_.emplace_back([this, w] { WorkerLoop(w); });
}

ParallelFor::~ParallelFor() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  work_ready_.notify_all();
  for (std::thread& t : threads_) t.join();
}

int ParallelFor::Drain(int worker) {
  int ran = 0;
  std::unique_lock<std::mutex> lock(mu_);
  while (next_ < n_) {
    const int i = next_++;
    const Body* body = body_;
    lock.unlock();
    (*body)(worker, i);
    ++ran;
    lock.lock();
    if (++done_ == n_) work_done_.notify_all();
  }
  return ran;
}

void ParallelFor::Run(int n, const Body& body) {
  if (n <= 0) return;
  if (threads_.empty() || n == 1) {
    for (int i = 0; i < n; ++i) body(0, i);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    body_ = &body;
    n_ = n;
    next_ = 0;
    done_ = 0;
    ++generation_;
  }
  work_ready_.notify_all();
  Drain(0);
  std::unique_lock<std::mutex> lock(mu_);
  work_done_.wait(lock, [&] { return done_ == n_; });
  body_ = nullptr;
  n_ = 0;
}

void ParallelFor::WorkerLoop(int worker) {
  uint64_t seen = 0;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_ready_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
    }
    Drain(worker);
  }
}

}  // namespace exl3::engine
