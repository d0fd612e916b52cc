// Qwen4-Exp on the CPU engine, what the conformance fixtures do not show: a model whose n-gram
// table is missing a piece or has the wrong size is refused naming the tensor, and a prompt with
// an image or video placeholder is refused by the engine with a clear message (the text model
// only), while a generated one runs as text. Uses tests/fixtures/engine/qwen4_exp_experts, its config.json edited in a copy.
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "engine/core/engine.h"
#include "engine/cpu/cpu_model.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace exl3::engine {
namespace {

namespace fs = std::filesystem;
constexpr char kFixture[] = "tests/fixtures/engine/qwen4_exp_experts";

// A copy of the fixture (weights linked) whose text_config gets `edit`.
std::string EditedCopy(const std::string& name, const std::function<void(nlohmann::json&)>& edit) {
  const fs::path dir =
      fs::temp_directory_path() / ("qwen4exp_model_test_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  for (const auto& e : fs::directory_iterator(kFixture)) {
    const std::string f = e.path().filename().string();
    if (f == "config.json") continue;
    fs::create_symlink(fs::absolute(e.path()), dir / f);
  }
  std::ifstream in(std::string(kFixture) + "/config.json");
  nlohmann::json j = nlohmann::json::parse(in);
  edit(j);
  std::ofstream(dir / "config.json") << j.dump(2);
  return dir.string();
}

TEST(Qwen4ExpModelTest, RefusesAMissingTablePieceByName) {
  const std::string dir = EditedCopy("missing", [](nlohmann::json& j) { j["text_config"]["split_ngram_parts"] = 17; });
  auto model = CpuModel::Open(dir, CpuModelOptions{});
  ASSERT_FALSE(model.ok());
  EXPECT_NE(model.status().message().find("ple_embedding.ngram_embedding.shard_16.weight is missing"),
            std::string::npos) << model.status();
}

TEST(Qwen4ExpModelTest, RefusesATableOfTheWrongSizeByName) {
  // Other hashing primes need another number of rows than the stored table holds.
  const std::string dir = EditedCopy("size", [](nlohmann::json& j) { j["text_config"]["ngram_vocab_size_base"] = 400; });
  auto model = CpuModel::Open(dir, CpuModelOptions{});
  ASSERT_FALSE(model.ok());
  EXPECT_NE(model.status().message().find("ngram_embedding.shard_0.weight"), std::string::npos) << model.status();
  EXPECT_NE(model.status().message().find("rows"), std::string::npos) << model.status();
}

TEST(Qwen4ExpModelTest, RefusesImageAndVideoPlaceholdersInPrompts) {
  const std::string dir = EditedCopy("image", [](nlohmann::json& j) {
    j["image_token_id"] = 120;  // inside the fixture's vocabulary of 128
    j["video_token_id"] = 121;
  });
  CpuModelOptions o;
  o.num_threads = 1;
  auto model = CpuModel::Open(dir, o);
  ASSERT_TRUE(model.ok()) << model.status();
  const std::vector<MediaPlaceholder>& media = (*model)->info().media_placeholders;
  ASSERT_EQ(media.size(), 2u);
  EXPECT_EQ(media[0].token_id, 120);
  EXPECT_EQ(media[0].kind, "image");
  EXPECT_EQ(media[1].token_id, 121);
  EXPECT_EQ(media[1].kind, "video");
  // Generated or drafted, a placeholder is an ordinary token: the model embeds it as text.
  ASSERT_TRUE((*model)->AllocateKvCache({4, 16, 1}).ok());
  StepBatch batch;
  SequenceChunk c;
  c.tokens = {5, 120, 121, 7};
  c.block_table = {0};
  c.wants_logits = true;
  batch.chunks.push_back(c);
  std::vector<float> logits(128);
  EXPECT_TRUE((*model)->Forward(batch, logits.data()).ok());

  EngineOptions eo;
  eo.kv_capacity = {KvCacheCapacity::Unit::kBlocks, 16};
  Engine engine(eo, std::move(*model));
  ASSERT_TRUE(engine.Start().ok());
  for (int32_t placeholder : {120, 121}) {
    GenerateParams p;
    p.prompt = {5, placeholder, 7};
    const absl::StatusOr<uint64_t> id = engine.Submit(std::move(p), [](const GenerateEvent&) {});
    ASSERT_FALSE(id.ok());
    EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(id.status().message().find(placeholder == 120 ? "image placeholder" : "video placeholder"),
              std::string::npos)
        << id.status();
    EXPECT_NE(id.status().message().find("prompt token 1"), std::string::npos) << id.status();
  }
  engine.Stop();
}

}  // namespace
}  // namespace exl3::engine
