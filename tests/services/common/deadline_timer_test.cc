#include "services/common/deadline_timer.h"

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace exl3::svc {
namespace {

using std::chrono::milliseconds;
using Clock = DeadlineTimer::Clock;

bool WaitFor(const std::atomic<int>& n, int want, milliseconds bound) {
  const auto until = Clock::now() + bound;
  while (n.load() < want && Clock::now() < until) std::this_thread::sleep_for(milliseconds(1));
  return n.load() >= want;
}

TEST(DeadlineTimer, RunsACallbackOnceItsDeadlinePasses) {
  DeadlineTimer timer;
  std::atomic<int> ran{0};
  std::atomic<int64_t> late_us{-1};
  const auto when = Clock::now() + milliseconds(30);
  timer.At(when, [&] {
    late_us = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - when).count();
    ran.fetch_add(1);
  });
  EXPECT_EQ(timer.pending(), 1u);
  ASSERT_TRUE(WaitFor(ran, 1, milliseconds(2000)));
  EXPECT_GE(late_us.load(), 0);  // never early
  EXPECT_EQ(timer.pending(), 0u);
}

TEST(DeadlineTimer, AnEarlierDeadlineWakesTheThread) {
  // The thread sleeps up to a second; an entry due before its wake-up must still run on time.
  DeadlineTimer timer;
  std::atomic<int> ran{0};
  timer.At(Clock::now() + std::chrono::seconds(30), [&] { ran.fetch_add(100); });
  std::this_thread::sleep_for(milliseconds(20));  // the thread now sleeps on the far entry
  const auto t0 = Clock::now();
  timer.At(t0 + milliseconds(10), [&] { ran.fetch_add(1); });
  ASSERT_TRUE(WaitFor(ran, 1, milliseconds(2000)));
  EXPECT_LT(Clock::now() - t0, milliseconds(500));
  EXPECT_EQ(ran.load(), 1);
}

TEST(DeadlineTimer, CancelledEntriesNeverRun) {
  DeadlineTimer timer;
  std::atomic<int> ran{0};
  std::vector<DeadlineTimer::Entry> entries;
  const auto when = Clock::now() + milliseconds(20);
  for (int i = 0; i < 100; ++i) entries.push_back(timer.At(when, [&] { ran.fetch_add(1); }));
  for (int i = 0; i < 100; i += 2) timer.Cancel(entries[i]);
  EXPECT_EQ(timer.pending(), 50u);
  ASSERT_TRUE(WaitFor(ran, 50, milliseconds(2000)));
  std::this_thread::sleep_for(milliseconds(20));
  EXPECT_EQ(ran.load(), 50);
  timer.Cancel(entries[1]);  // ran already: nothing happens
}

TEST(DeadlineTimer, EntriesNotDueAreDroppedAtDestruction) {
  std::atomic<int> ran{0};
  {
    DeadlineTimer timer;
    timer.At(Clock::now() + std::chrono::hours(1), [&] { ran.fetch_add(1); });
  }
  EXPECT_EQ(ran.load(), 0);
}

}  // namespace
}  // namespace exl3::svc
