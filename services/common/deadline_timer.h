// Runs callbacks at deadlines on one thread of its own. Most entries are cancelled before they
// are due (a request that completes in time), so the thread wakes only for deadlines that really
// pass, and at most once a second otherwise.
//
//   svc::DeadlineTimer timer;
//   svc::DeadlineTimer::Entry e = timer.At(deadline, [] { ... expired ... });
//   timer.Cancel(e);   // completed in time: the callback will not run
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

namespace exl3::svc {

class DeadlineTimer {
 public:
  using Clock = std::chrono::steady_clock;
  // Identifies one scheduled callback: its deadline and a sequence number (deadlines may repeat).
  using Entry = std::pair<Clock::time_point, uint64_t>;

  DeadlineTimer();
  ~DeadlineTimer();  // entries not yet due never run
  DeadlineTimer(const DeadlineTimer&) = delete;
  DeadlineTimer& operator=(const DeadlineTimer&) = delete;

  // Runs `fn` on the timer's thread once `when` has passed.
  Entry At(Clock::time_point when, std::function<void()> fn);
  // Drops the entry unless it has run (or is running) already.
  void Cancel(const Entry& e);
  // Entries scheduled and neither run nor cancelled (for tests).
  size_t pending() const;

 private:
  void Run();

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<Entry, std::function<void()>> entries_;  // guarded by mu_
  uint64_t next_seq_ = 0;                           // guarded by mu_
  // When the thread wakes next (guarded by mu_; max until it first sleeps).
  Clock::time_point wake_at_ = Clock::time_point::max();
  bool stopping_ = false;  // guarded by mu_
  std::thread thread_;     // last: started once the members above exist
};

}  // namespace exl3::svc
