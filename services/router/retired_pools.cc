#include "services/router/retired_pools.h"

#include <utility>

#include "base/logging.h"

namespace exl3::router {

RetiredPools::RetiredPools(std::chrono::milliseconds check_every)
    : check_every_(check_every), thread_([this] { Run(); }) {}

RetiredPools::~RetiredPools() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void RetiredPools::Retire(std::shared_ptr<WorkerSet> set) {
  {
    std::lock_guard<std::mutex> l(mu_);
    sets_.push_back(std::move(set));
  }
  cv_.notify_all();
}

int RetiredPools::size() const {
  std::lock_guard<std::mutex> l(mu_);
  return static_cast<int>(sets_.size()) + freeing_;
}

void RetiredPools::StopAll() const {
  std::lock_guard<std::mutex> l(mu_);
  for (const auto& s : sets_) s->StopAll();
}

std::vector<std::shared_ptr<WorkerSet>> RetiredPools::TakeUnusedLocked() {
  // Nobody can copy a retired set any more, so a use count of 1 (this list) stays 1.
  std::vector<std::shared_ptr<WorkerSet>> unused;
  for (auto it = sets_.begin(); it != sets_.end();) {
    if (it->use_count() == 1) {
      unused.push_back(std::move(*it));
      it = sets_.erase(it);
    } else {
      ++it;
    }
  }
  return unused;
}

void RetiredPools::Run() {
  std::unique_lock<std::mutex> l(mu_);
  while (!stopping_) {
    if (sets_.empty()) {
      cv_.wait(l, [&] { return stopping_ || !sets_.empty(); });
      continue;
    }
    std::vector<std::shared_ptr<WorkerSet>> unused = TakeUnusedLocked();
    if (!unused.empty()) {
      const int left = static_cast<int>(sets_.size());
      freeing_ = static_cast<int>(unused.size());
      l.unlock();
      for (const auto& s : unused) {
        exl3::LogInfo("retired worker pool of %d workers freed (its requests have ended); %d "
                     "retired pools still in use", s->num_workers(), left);
      }
      unused.clear();  // destroys them here, off every link's thread
      l.lock();
      freeing_ = 0;
      continue;
    }
    cv_.wait_for(l, check_every_, [&] { return stopping_; });
  }
}

}  // namespace exl3::router
