#include "services/common/task_queue.h"

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <thread>

#include "gtest/gtest.h"

namespace exl3::svc {
namespace {

TEST(TaskQueue, RunsEveryTaskBeforeItIsDestroyed) {
  std::atomic<int> ran{0};
  {
    TaskQueue q(2);
    for (int i = 0; i < 1000; ++i) q.Post([&] { ran.fetch_add(1); });
  }
  EXPECT_EQ(ran.load(), 1000);
}

TEST(TaskQueue, RunsTasksOnItsOwnThreads) {
  std::mutex mu;
  std::set<std::thread::id> threads;
  {
    TaskQueue q(3);
    for (int i = 0; i < 30; ++i) {
      q.Post([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        std::lock_guard<std::mutex> l(mu);
        threads.insert(std::this_thread::get_id());
      });
    }
  }
  EXPECT_EQ(threads.count(std::this_thread::get_id()), 0u);
  EXPECT_GE(threads.size(), 1u);
  EXPECT_LE(threads.size(), 3u);
}

TEST(TaskQueue, ZeroThreadsMeansOne) {
  std::atomic<bool> ran{false};
  {
    TaskQueue q(0);
    q.Post([&] { ran = true; });
  }
  EXPECT_TRUE(ran.load());
}

}  // namespace
}  // namespace exl3::svc
