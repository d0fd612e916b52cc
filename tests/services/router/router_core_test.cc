// RouterCore's expert-map reloads (services/router/router_core.h) with real worker connections
// to addresses where nothing listens: each reload retires the old pool, which is freed (with the
// connections only it held) once nothing uses it, instead of living until shutdown. No worker
// processes: the connections just keep retrying.
#include "services/router/router_core.h"

#include <chrono>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "gtest/gtest.h"
#include "prometheus/registry.h"
#include "tests/services/common/service_test_util.h"
#include "tools/test_model/expert_test_model.h"

namespace exl3::router {
namespace {

void WriteMap(const std::string& path, const std::string& second_worker) {
  // Nothing listens on port 1 of loopback.
  std::ofstream f(path);
  f << "workers:\n"
       "  - name: a\n    address: 127.0.0.1:1\n    experts: 0-3\n"
       "  - name: "
    << second_worker << "\n    address: 127.0.0.1:1\n    experts: 4-7\n";
}

bool WaitFor(const std::function<bool()>& cond, std::chrono::milliseconds bound) {
  const auto until = std::chrono::steady_clock::now() + bound;
  while (!cond()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

TEST(RouterCoreReload, RetiredPoolsAreFreedOnceUnused) {
  testing::TempDir dir;
  ASSERT_TRUE(testing::WriteExpertModel(dir.path(), testing::ServiceModelSpec()).ok());
  const std::string map = dir.path() + "/map.yaml";
  WriteMap(map, "b");
  RouterCoreOptions o;
  o.model_dir = dir.path();
  o.expert_map_path = map;
  o.worker_liveness_ms = 0;
  prometheus::Registry registry;
  auto core = RouterCore::Create(o, registry);
  ASSERT_TRUE(core.ok()) << core.status();
  EXPECT_FALSE((*core)->Ready());  // nobody serves

  std::weak_ptr<WorkerPool> first = (*core)->service().pool();
  // Unchanged map: every connection is taken over; the old pool goes at once.
  ASSERT_TRUE((*core)->ReloadMap().ok());
  EXPECT_TRUE(WaitFor([&] { return (*core)->retired_pools() == 0; }, std::chrono::seconds(5)));
  EXPECT_TRUE(first.expired());

  // A pool still in use (as by a request that started on it) stays until it is released.
  std::shared_ptr<WorkerPool> in_use = (*core)->service().pool();
  WriteMap(map, "c");  // b leaves the map, c joins
  ASSERT_TRUE((*core)->ReloadMap().ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ((*core)->retired_pools(), 1);
  EXPECT_EQ(in_use->conn(1).name(), "b");
  EXPECT_FALSE(in_use->link(1).up());
  std::weak_ptr<WorkerPool> second = in_use;
  in_use.reset();
  EXPECT_TRUE(WaitFor([&] { return (*core)->retired_pools() == 0; }, std::chrono::seconds(5)));
  EXPECT_TRUE(second.expired());

  // Many reloads do not accumulate pools.
  for (int i = 0; i < 20; ++i) {
    WriteMap(map, i % 2 ? "b" : "c");
    ASSERT_TRUE((*core)->ReloadMap().ok());
  }
  EXPECT_TRUE(WaitFor([&] { return (*core)->retired_pools() == 0; }, std::chrono::seconds(10)));
  EXPECT_EQ((*core)->service().pool()->num_workers(), 2);
  (*core)->Stop();
}

}  // namespace
}  // namespace exl3::router
