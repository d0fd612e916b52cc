// Worker sets (services/router/worker_set.h) replaced by an expert-map reload. Layer calls that
// started on an old set keep it until they end (their sub-requests' callbacks included); each
// retired set is freed, on this class's own thread, once nothing but this list holds it, so a
// router reloaded many times holds only the sets still in use. Freeing stops the set's links that
// no newer set took over (their threads are joined there, never on a link's own thread).
//
//   retired.Retire(std::move(old_pool));   // after SetPool(new_pool) and old->StopUnshared(*new)
#pragma once

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "services/router/worker_set.h"

namespace exl3::router {

class RetiredPools {
 public:
  // `check_every`: how often the sets are looked at while any is retired.
  explicit RetiredPools(std::chrono::milliseconds check_every = std::chrono::milliseconds(50));
  ~RetiredPools();  // frees what is left
  RetiredPools(const RetiredPools&) = delete;
  RetiredPools& operator=(const RetiredPools&) = delete;

  // `set` must no longer be reachable for new calls (no other holder may copy it from now on).
  void Retire(std::shared_ptr<WorkerSet> set);
  // Sets retired and not yet freed (those being freed included).
  int size() const;
  // Stops every link of the sets still held (the router is stopping).
  void StopAll() const;

 private:
  void Run();
  // Takes the sets that nothing else holds out of sets_ (under mu_).
  std::vector<std::shared_ptr<WorkerSet>> TakeUnusedLocked();

  const std::chrono::milliseconds check_every_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::shared_ptr<WorkerSet>> sets_;  // guarded by mu_
  int freeing_ = 0;                               // guarded by mu_: taken out, being destroyed
  bool stopping_ = false;                         // guarded by mu_
  std::thread thread_;                            // last: started once the members above exist
};

}  // namespace exl3::router
