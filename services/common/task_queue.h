// A few threads running queued tasks in order of arrival (the router's handler pool for large
// layer requests, the Generator service's writer).
//
//   svc::TaskQueue q(2);
//   q.Post([] { ... });   // runs on one of q's threads
//   q.PostQuietly(a); q.PostQuietly(b); q.Wake();   // a burst, one wake-up
//   // ~TaskQueue runs what is still queued, then joins.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace exl3::svc {

class TaskQueue {
 public:
  explicit TaskQueue(int threads);  // at least one thread
  ~TaskQueue();                     // runs what is queued, then joins
  TaskQueue(const TaskQueue&) = delete;
  TaskQueue& operator=(const TaskQueue&) = delete;

  void Post(std::function<void()> fn);
  // Queues fn without waking a thread: it runs once a thread looks at the queue (one still busy
  // with earlier tasks, or one woken by a later Post or Wake). For a producer that queues a burst
  // of tasks and then wakes the threads once, so that they do not compete with it mid-burst.
  void PostQuietly(std::function<void()> fn);
  void Wake();  // wakes the threads for what PostQuietly queued

 private:
  void Run();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;  // guarded by mu_
  bool stopping_ = false;                    // guarded by mu_
  std::vector<std::thread> threads_;
};

}  // namespace exl3::svc
