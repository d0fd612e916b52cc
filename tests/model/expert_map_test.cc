// Expert map parsing, resolution against a model config, and coverage messages.
#include "model/config/read_moe_config.h"
#include "model/expert_map.h"

#include <cstdio>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

namespace exl3 {
namespace {

// GLM-style: 6 layers, layer 0 dense, 1..5 MoE, 16 experts.
MoeConfig TestConfig() {
  auto cfg = ParseMoeConfig(R"({
    "architectures": ["Glm4MoeForCausalLM"], "hidden_size": 256, "num_hidden_layers": 6,
    "num_experts_per_tok": 4, "n_routed_experts": 16, "moe_intermediate_size": 128,
    "n_shared_experts": 1, "first_k_dense_replace": 1, "norm_topk_prob": true,
    "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1})", "test config");
  EXPECT_TRUE(cfg.ok()) << cfg.status();
  return *cfg;
}

TEST(ExpertMapTest, IndexRanges) {
  auto r = ParseIndexRanges(" 0-3, 7,5 ,5-6", 16);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, (std::vector<int32_t>{0, 1, 2, 3, 5, 6, 7}));
  EXPECT_EQ(FormatIndexRanges(*r), "0-3,5-7");
  EXPECT_EQ(ParseIndexRanges("all", 4)->size(), 4u);
  EXPECT_FALSE(ParseIndexRanges("3-1", 16).ok());
  EXPECT_FALSE(ParseIndexRanges("0-16", 16).ok());
  EXPECT_FALSE(ParseIndexRanges("x", 16).ok());
  EXPECT_FALSE(ParseIndexRanges("", 16).ok());
  EXPECT_FALSE(ParseIndexRanges("-1", 16).ok());
}

TEST(ExpertMapTest, AllLayersPerLayerAndReplica) {
  const MoeConfig cfg = TestConfig();
  auto map = ParseExpertMap(R"(
workers:
  - name: a
    address: 127.0.0.1:50061
    experts: 0-7
  - name: b
    address: 127.0.0.1:50062
    experts:
      - layers: 1-3
        experts: "8-15"
      - layers: [4, 5]
        experts: [8, 9, 10, 11, 12, 13, 14, 15]
  - name: a2
    address: 127.0.0.1:50063
    replica_of: a
  - name: hot
    address: 127.0.0.1:50064
    experts:
      - layers: all
        experts: 8
)", "m.yaml", cfg);
  ASSERT_TRUE(map.ok()) << map.status();
  ASSERT_EQ(map->workers.size(), 4u);
  const ExpertMapWorker* a = map->Find("a");
  ASSERT_NE(a, nullptr);
  EXPECT_TRUE(a->experts[0].empty());  // dense layer
  EXPECT_EQ(a->experts[1].size(), 8u);
  EXPECT_TRUE(a->Holds(5, 7));
  EXPECT_FALSE(a->Holds(5, 8));
  EXPECT_EQ(map->Find("a2")->experts, a->experts);
  EXPECT_EQ(map->Find("a2")->replica_of, "a");
  EXPECT_TRUE(map->Find("b")->Holds(4, 15));
  EXPECT_EQ(map->Find("hot")->TotalExperts(), 5u);
  EXPECT_TRUE(CheckCoverage(*map, cfg).ok());
  // Without b, experts 9-15 lose their only worker; 8 still has "hot".
  std::vector<bool> usable = {true, false, true, true};
  absl::Status s = CheckCoverage(*map, cfg, &usable);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(std::string(s.message()).find("layers 1-5 experts 9-15"), std::string::npos) << s;
}

TEST(ExpertMapTest, CoverageGapNamed) {
  const MoeConfig cfg = TestConfig();
  auto map = ParseExpertMap(R"(
workers:
  - {name: a, address: "h:1", experts: 0-12}
  - name: b
    address: h:2
    experts:
      - {layers: 1-4, experts: 13-15}
)", "gap.yaml", cfg);
  ASSERT_TRUE(map.ok()) << map.status();
  absl::Status s = CheckCoverage(*map, cfg);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(std::string(s.message()),
            "expert map gap.yaml: no worker holds layer 5 experts 13-15");
}

void ExpectBad(const MoeConfig& cfg, const std::string& yaml, const std::string& needle) {
  auto map = ParseExpertMap(yaml, "bad.yaml", cfg);
  ASSERT_FALSE(map.ok()) << yaml;
  EXPECT_EQ(map.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(map.status().message()).find(needle), std::string::npos)
      << map.status() << " (wanted: " << needle << ")";
}

TEST(ExpertMapTest, BadMapsNamed) {
  const MoeConfig cfg = TestConfig();
  ExpectBad(cfg, "workers: [", "not valid YAML");
  ExpectBad(cfg, "wurkers: []", "\"workers\" list");
  ExpectBad(cfg, "workers: []\nextra: 1", "unknown top-level key \"extra\"");
  ExpectBad(cfg, "workers:\n  - {address: h:1, experts: 0-3}", "has no name");
  ExpectBad(cfg, "workers:\n  - {name: a, experts: 0-3}", "worker \"a\" has no address");
  ExpectBad(cfg, "workers:\n  - {name: a, address: h:1, experts: 0-3}\n  - {name: a, address: h:2, experts: 4}",
            "used twice");
  ExpectBad(cfg, "workers:\n  - {name: a, address: h:1, experts: 0-16}", "outside 0..15");
  ExpectBad(cfg, "workers:\n  - {name: a, address: h:1, experts: [{layers: 0, experts: 1}]}",
            "layer 0 is not an MoE layer");
  ExpectBad(cfg, "workers:\n  - {name: a, address: h:1, replica_of: zz}", "unknown worker \"zz\"");
  ExpectBad(cfg, "workers:\n  - {name: a, address: h:1}", "neither experts nor replica_of");
  ExpectBad(cfg, "workers:\n  - {name: a, address: h:1, experts: 1, port: 3}", "unknown worker key");
  ExpectBad(cfg, "workers: []", "empty");
}

TEST(ExpertMapTest, SharedExpertWorkersAndTheirReplicas) {
  const MoeConfig cfg = TestConfig();
  auto map = ParseExpertMap(R"(
workers:
  - {name: a, address: "h:1", experts: all, shared_expert: false}
  - {name: s, address: "h:2", shared_expert: true}
  - {name: s2, address: "h:3", replica_of: s}
  - {name: both, address: "h:4", experts: 0-3, shared_expert: true}
)", "shared.yaml", cfg);
  ASSERT_TRUE(map.ok()) << map.status();
  EXPECT_FALSE(map->Find("a")->shared_expert);
  EXPECT_TRUE(map->Find("s")->shared_expert);
  EXPECT_EQ(map->Find("s")->TotalExperts(), 0u);  // the shared expert only
  EXPECT_TRUE(map->Find("s2")->shared_expert);     // copied by replica_of
  EXPECT_TRUE(map->Find("both")->shared_expert);
  EXPECT_EQ(map->Find("both")->TotalExperts(), 20u);
  EXPECT_TRUE(CheckCoverage(*map, cfg).ok());
  ExpectBad(cfg, "workers:\n  - {name: a, address: h:1, experts: all, shared_expert: maybe}",
            "shared_expert must be true or false");
  ExpectBad(cfg, "workers:\n  - {name: a, address: h:1, shared_expert: false}",
            "neither experts nor replica_of");
}

TEST(ExpertMapTest, LoadFromFile) {
  const MoeConfig cfg = TestConfig();
  const std::string path = ::testing::TempDir() + "/expert_map_test.yaml";
  {
    std::ofstream f(path);
    f << "workers:\n  - name: only\n    address: 127.0.0.1:1\n    experts: all\n";
  }
  auto map = LoadExpertMap(path, cfg);
  ASSERT_TRUE(map.ok()) << map.status();
  EXPECT_TRUE(CheckCoverage(*map, cfg).ok());
  std::remove(path.c_str());
  EXPECT_EQ(LoadExpertMap(path, cfg).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace exl3
