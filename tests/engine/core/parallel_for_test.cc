#include "engine/core/parallel_for.h"

#include <atomic>
#include <vector>

#include "gtest/gtest.h"

namespace exl3::engine {
namespace {

TEST(ParallelFor, RunsEveryIterationOnceOnAWorkerOfItsOwn) {
  for (int workers : {1, 2, 4}) {
    ParallelFor pool(workers);
    EXPECT_EQ(pool.num_workers(), workers);
    for (int run = 0; run < 200; ++run) {
      const int n = run % 37;
      std::vector<std::atomic<int>> hits(n);
      std::vector<std::atomic<int>> busy(workers);
      std::atomic<bool> overlap{false}, bad_worker{false};
      pool.Run(n, [&](int worker, int i) {
        if (worker < 0 || worker >= workers) {
          bad_worker = true;
          return;
        }
        if (busy[worker]++ != 0) overlap = true;
        ++hits[i];
        --busy[worker];
      });
      for (int i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << workers << " " << run << " " << i;
      EXPECT_FALSE(overlap.load());
      EXPECT_FALSE(bad_worker.load());
    }
  }
}

}  // namespace
}  // namespace exl3::engine
