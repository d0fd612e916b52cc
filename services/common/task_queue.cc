#include "services/common/task_queue.h"

#include <algorithm>
#include <utility>

namespace exl3::svc {

TaskQueue::TaskQueue(int threads) {
  for (int i = 0; i < std::max(1, threads); ++i) threads_.emplace_back([this] { Run(); });
}

TaskQueue::~TaskQueue() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void TaskQueue::Post(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> l(mu_);
    queue_.push_back(std::move(fn));
  }
  cv_.notify_one();
}

void TaskQueue::PostQuietly(std::function<void()> fn) {
  std::lock_guard<std::mutex> l(mu_);
  queue_.push_back(std::move(fn));
}

void TaskQueue::Wake() { cv_.notify_all(); }

void TaskQueue::Run() {
  std::unique_lock<std::mutex> l(mu_);
  while (true) {
    cv_.wait(l, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping and nothing left
    std::function<void()> fn = std::move(queue_.front());
    queue_.pop_front();
    l.unlock();
    fn();
    l.lock();
  }
}

}  // namespace exl3::svc
