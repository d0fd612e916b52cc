#include "services/common/deadline_timer.h"

#include <algorithm>

namespace exl3::svc {

DeadlineTimer::DeadlineTimer() : thread_([this] { Run(); }) {}

DeadlineTimer::~DeadlineTimer() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

DeadlineTimer::Entry DeadlineTimer::At(Clock::time_point when, std::function<void()> fn) {
  bool earliest;
  Entry e;
  {
    std::lock_guard<std::mutex> l(mu_);
    e = Entry{when, next_seq_++};
    earliest = when < wake_at_;
    entries_.emplace(e, std::move(fn));
  }
  // Only a deadline before the thread's next wake-up changes what it waits for.
  if (earliest) cv_.notify_all();
  return e;
}

void DeadlineTimer::Cancel(const Entry& e) {
  std::function<void()> fn;  // destroyed after the lock is released (declared before it)
  std::lock_guard<std::mutex> l(mu_);
  auto it = entries_.find(e);
  if (it == entries_.end()) return;
  fn = std::move(it->second);
  entries_.erase(it);
}

size_t DeadlineTimer::pending() const {
  std::lock_guard<std::mutex> l(mu_);
  return entries_.size();
}

void DeadlineTimer::Run() {
  std::unique_lock<std::mutex> l(mu_);
  while (!stopping_) {
    const Clock::time_point now = Clock::now();
    auto first = entries_.begin();
    if (first == entries_.end() || first->first.first > now) {
      // Sleep until the first deadline, or a second at most, so that At need not wake the thread
      // for a deadline after wake_at_ (one request at a time empties the map after each, and a
      // wake-up per request would cost a context switch each).
      wake_at_ = now + std::chrono::seconds(1);
      if (first != entries_.end()) wake_at_ = std::min(wake_at_, first->first.first);
      cv_.wait_until(l, wake_at_);
      continue;
    }
    std::function<void()> fn = std::move(first->second);
    entries_.erase(first);
    l.unlock();
    fn();
    fn = nullptr;  // what it captured is released outside the lock
    l.lock();
  }
}

}  // namespace exl3::svc
