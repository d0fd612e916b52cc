// exl3-router's start (services/router/main.cc) reads the model's config.json once and hands that
// read to the router core (RouterCore::Create) and to the engine (Generation::Start). Each test
// reads the file, then overwrites it with text no reader accepts: the start succeeds only if
// nothing reads the file again, and what it serves is what the handed read says.
#include "services/router/generation.h"

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "engine/cpu/cpu_model.h"
#include "gtest/gtest.h"
#include "model/config/config_file.h"
#include "model/exl3_model.h"
#include "prometheus/registry.h"
#include "services/router/router_core.h"
#include "tests/engine/engine_requests.h"
#include "tests/services/common/service_test_util.h"
#include "tests/services/router/router_test_model.h"

namespace exl3::router {
namespace {

// Reads DIR/config.json, then leaves text in its place that no config reader accepts.
ConfigFile ReadThenSpoilConfig(const std::string& dir) {
  absl::StatusOr<ConfigFile> config = ConfigFile::Read(dir + "/config.json");
  EXPECT_TRUE(config.ok()) << config.status();
  std::ofstream(dir + "/config.json", std::ios::trunc) << "not json: config.json was read a second time";
  EXPECT_FALSE(ConfigFile::Read(dir + "/config.json").ok());
  return *std::move(config);
}

GenerationOptions SmallEngine(const std::string& dir) {
  GenerationOptions o;
  o.model_dir = dir;
  o.threads = 2;
  o.engine.kv_capacity = {engine::KvCacheCapacity::Unit::kTokens, 256};
  return o;
}

// The experts on workers (none listens): the core opens the router weights and the shared expert,
// the engine the rest of the model, both from the one read.
TEST(GenerationStart, RouterCoreAndEngineStartFromOneReadOfConfigJson) {
  testing::TempDir dir;
  ASSERT_TRUE(testing::WriteRouterTestModel(dir.path()).ok());
  const std::string map = dir.path() + "/map.yaml";
  std::ofstream(map) << "workers:\n"
                        "  - name: a\n    address: 127.0.0.1:1\n    experts: 0-3\n";
  absl::StatusOr<std::unique_ptr<Exl3Model>> read = Exl3Model::Open(dir.path());
  ASSERT_TRUE(read.ok()) << read.status();
  const std::string fingerprint = (*read)->fingerprint();
  const ConfigFile config = ReadThenSpoilConfig(dir.path());

  prometheus::Registry registry;
  RouterCoreOptions co;
  co.model_dir = dir.path();
  co.expert_map_path = map;
  co.worker_liveness_ms = 0;
  // The core that reads config.json itself now fails: the file is spoiled.
  EXPECT_FALSE(RouterCore::Create(co, registry).ok());
  absl::StatusOr<std::unique_ptr<RouterCore>> core = RouterCore::Create(co, config, registry);
  ASSERT_TRUE(core.ok()) << core.status();
  EXPECT_EQ((*core)->model().fingerprint(), fingerprint);
  EXPECT_EQ((*core)->model().config().num_experts, 4);

  absl::StatusOr<std::unique_ptr<Generation>> gen =
      Generation::Start(SmallEngine(dir.path()), config, &(*core)->service(), registry);
  ASSERT_TRUE(gen.ok()) << gen.status();
  EXPECT_EQ((*gen)->engine().model_info().architecture, "Glm4MoeForCausalLM");
  EXPECT_EQ((*gen)->engine().model_info().vocab_size, 256);
  (*gen)->Stop();
  (*core)->Stop();
}

// The experts held here: the engine started from the handed read answers as one opened from the
// file before it was spoiled.
TEST(GenerationStart, ExpertsHeldHereAnswerAsFromTheFile) {
  testing::TempDir dir;
  ASSERT_TRUE(testing::WriteRouterTestModel(dir.path()).ok());
  const GenerationOptions o = SmallEngine(dir.path());
  const std::vector<engine::GenerateParams> requests = {
      engine::testing::Greedy32({1, 2, 3, 4, 5}), engine::testing::Greedy32({200, 17, 9})};

  std::vector<std::vector<engine::SampledToken>> expected;
  {
    engine::CpuModelOptions mo;
    mo.num_threads = o.threads;
    absl::StatusOr<std::unique_ptr<engine::CpuModel>> model = engine::CpuModel::Open(dir.path(), mo);
    ASSERT_TRUE(model.ok()) << model.status();
    engine::Engine reference(o.engine, *std::move(model));
    ASSERT_TRUE(reference.Start().ok());
    expected = engine::testing::RunAllAtOnce(reference, requests);
    reference.Stop();
  }
  const ConfigFile config = ReadThenSpoilConfig(dir.path());

  prometheus::Registry registry;
  absl::StatusOr<std::unique_ptr<Generation>> gen = Generation::Start(o, config, nullptr, registry);
  ASSERT_TRUE(gen.ok()) << gen.status();
  const std::vector<std::vector<engine::SampledToken>> got =
      engine::testing::RunAllAtOnce((*gen)->engine(), requests);
  ASSERT_EQ(got.size(), expected.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i].size(), expected[i].size());
    for (size_t t = 0; t < got[i].size(); ++t) EXPECT_EQ(got[i][t].token, expected[i][t].token) << i << " " << t;
  }
  (*gen)->Stop();
}

}  // namespace
}  // namespace exl3::router
