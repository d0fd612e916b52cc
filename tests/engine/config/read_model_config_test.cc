// engine/config/read_model_config: every fixture's config.json (tests/fixtures/engine/*, the
// release layouts included) goes through the one reader: parsed once (model/config/config_file.h),
// its MoE layout and the engine's configuration read from that parse, each family by its section;
// an architecture outside model/config/architecture.h's table is refused by name.
#include "engine/config/read_model_config.h"

#include <algorithm>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "model/config/architecture.h"
#include "model/config/config_file.h"
#include "model/config/read_moe_config.h"
#include "nlohmann/json.hpp"

namespace exl3::engine {
namespace {

namespace fs = std::filesystem;
constexpr char kFixtures[] = "tests/fixtures/engine";  // tests run in the source directory

std::vector<std::string> FixturesWithConfig() {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(kFixtures, ec))
    if (e.is_directory() && fs::exists(e.path() / "config.json")) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

class ConfigFixture : public ::testing::TestWithParam<std::string> {
 protected:
  std::string Dir() const { return std::string(kFixtures) + "/" + GetParam(); }
};

TEST_P(ConfigFixture, ReadsThroughTheOneReader) {
  absl::StatusOr<ConfigFile> file = ConfigFile::Read(Dir());
  ASSERT_TRUE(file.ok()) << file.status();
  // The architecture the file names, found in the table.
  const std::string named = file->top()["architectures"][0].get<std::string>();
  EXPECT_EQ(file->architecture().name, named);
  // The language model's fields: text_config for the architectures that nest them.
  const bool nested = file->architecture().text_model == TextModelPlace::kTextConfig;
  EXPECT_EQ(&file->text() != &file->top(), nested && file->top().contains("text_config"));
  EXPECT_TRUE(file->text().contains("hidden_size"));

  absl::StatusOr<ModelConfig> cfg = ReadModelConfig(*file);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_EQ(cfg->architecture(), named);
  EXPECT_EQ(cfg->moe.arch, file->architecture().architecture);
  EXPECT_EQ(cfg->moe.family, file->architecture().family);
  EXPECT_GT(cfg->num_layers, 0);
  EXPECT_GT(cfg->vocab_size, 0);
  EXPECT_GT(cfg->attention_scale, 0.0f);

  // The MoE layout the router and workers read is the one inside the engine's configuration.
  absl::StatusOr<MoeConfig> moe = ReadMoeConfig(*file);
  ASSERT_TRUE(moe.ok()) << moe.status();
  EXPECT_EQ(moe->architecture, cfg->moe.architecture);
  EXPECT_EQ(moe->moe_layers, cfg->moe.moe_layers);
  EXPECT_EQ(moe->hash_routed_layers, cfg->moe.hash_routed_layers);
  EXPECT_EQ(moe->num_experts, cfg->moe.num_experts);
  EXPECT_EQ(moe->top_k, cfg->moe.top_k);
  EXPECT_EQ(moe->shared_intermediate_size, cfg->moe.shared_intermediate_size);

  // The directory readers give the same.
  absl::StatusOr<ModelConfig> loaded = LoadModelConfig(Dir());
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->attention, cfg->attention);
  EXPECT_EQ(loaded->layer_mixers, cfg->layer_mixers);
  EXPECT_EQ(loaded->rope.rotary_dim, cfg->rope.rotary_dim);
  absl::StatusOr<MoeConfig> loaded_moe = LoadMoeConfig(Dir());
  ASSERT_TRUE(loaded_moe.ok()) << loaded_moe.status();
  EXPECT_EQ(loaded_moe->moe_layers, moe->moe_layers);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ConfigFixture, ::testing::ValuesIn(FixturesWithConfig()),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

TEST(ReadModelConfig, EveryArchitectureHasAFixture) {
  std::set<std::string> seen;
  for (const std::string& name : FixturesWithConfig()) {
    absl::StatusOr<ConfigFile> file = ConfigFile::Read(std::string(kFixtures) + "/" + name);
    ASSERT_TRUE(file.ok()) << name << ": " << file.status();
    seen.insert(file->architecture().name);
  }
  for (const std::string& a : SupportedArchitectures()) EXPECT_EQ(seen.count(a), 1u) << a;
}

TEST(ReadModelConfig, RefusesAnUnknownArchitectureByName) {
  const std::string text =
      nlohmann::json{{"architectures", {"LlamaForCausalLM"}}, {"hidden_size", 64}}.dump();
  for (const absl::Status& st : {ParseModelConfig(text, "config.json").status(),
                                 ParseMoeConfig(text, "config.json").status(),
                                 ConfigFile::Parse(text, "config.json").status()}) {
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("architecture 'LlamaForCausalLM' is not supported"), std::string::npos)
        << st;
    for (const std::string& a : SupportedArchitectures())
      EXPECT_NE(st.message().find(a), std::string::npos) << a << " missing from: " << st;
  }
}

TEST(ReadModelConfig, RefusesAFileWithoutArchitectures) {
  absl::Status st = ParseModelConfig(R"({"hidden_size": 64})", "config.json").status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("'architectures'"), std::string::npos) << st;
  st = ParseModelConfig("[1, 2]", "config.json").status();
  EXPECT_NE(st.message().find("not a JSON object"), std::string::npos) << st;
}

}  // namespace
}  // namespace exl3::engine
