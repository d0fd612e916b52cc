// The CPU model's own consistency on a model of each family: the
// same logits whether a prompt runs at once, in chunks or token by token, whether sequences run
// alone or batched together, and bit for bit the same when a step runs as two micro-batches. (Agreement with transformers: transformers_conformance_test.cc.)
#include "engine/cpu_model.h"

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>

#include "gtest/gtest.h"
#include "model/safetensors.h"
#include "nlohmann/json.hpp"
#include "engine/local_moe.h"
#include "tests/engine/delayed_moe.h"
#include "tests/engine/model_harness.h"

namespace exl3::engine {
namespace {

namespace fs = std::filesystem;

double RelativeError(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

std::vector<int32_t> RandomPrompt(int n, int vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> p(n);
  for (int32_t& t : p) t = static_cast<int32_t>(rng() % vocab);
  return p;
}

class CpuModelTest : public ::testing::TestWithParam<std::string> {
 protected:
  // The transformers fixtures' models (tests/fixtures/engine/README.md).
  static std::string ModelDir(const std::string& fixture) {
    return (fs::path("tests/fixtures/engine") / fixture).string();
  }
};

TEST_P(CpuModelTest, ChunkedPrefillBatchingMicroBatchesAndDecodeAgree) {
  CpuModelOptions o;
  o.num_threads = 2;
  auto model = CpuModel::Open(ModelDir(GetParam()), o);
  ASSERT_TRUE(model.ok()) << model.status();
  const int vocab = (*model)->info().vocab_size;
  const std::vector<int32_t> a = RandomPrompt(37, vocab, 1), b = RandomPrompt(9, vocab, 2);

  auto whole = testing::RunGreedy(**model, {a}, 8, /*chunk=*/1000);
  ASSERT_TRUE(whole.ok()) << whole.status();
  auto by_token = testing::RunGreedy(**model, {a}, 8, /*chunk=*/1);
  ASSERT_TRUE(by_token.ok()) << by_token.status();
  auto batched = testing::RunGreedy(**model, {b, a}, 8, /*chunk=*/7);
  ASSERT_TRUE(batched.ok()) << batched.status();

  // The same step as two ping-pong micro-batches (in-process MoE: the same arithmetic per token).
  CpuModelOptions two = o;
  two.micro_batches = 2;
  auto split_model = CpuModel::Open(ModelDir(GetParam()), two);
  ASSERT_TRUE(split_model.ok()) << split_model.status();
  auto split = testing::RunGreedy(**split_model, {b, a}, 8, /*chunk=*/7);
  ASSERT_TRUE(split.ok()) << split.status();

  for (int i = 0; i <= 8; ++i) {
    EXPECT_EQ((*split)[1][i], (*batched)[1][i]) << "step " << i;
    EXPECT_EQ((*split)[0][i], (*batched)[0][i]) << "step " << i;
    for (float v : (*whole)[0][i]) ASSERT_TRUE(std::isfinite(v));
    EXPECT_LT(RelativeError((*by_token)[0][i], (*whole)[0][i]), 1e-5) << "step " << i;
    EXPECT_LT(RelativeError((*batched)[1][i], (*whole)[0][i]), 1e-5) << "step " << i;
  }
}

// Two micro-batches with the experts behind an executor whose answers come later on threads of
// their own (tests/engine/delayed_moe.h, as the workers'): bit for bit the steps of one, with two
// calls out at once. (The GPU model's test of the same: tests/engine/cuda/cuda_model_test.cc.)
TEST(CpuModelMicroBatches, LateAnswersGiveTheSameLogitsWithTwoCallsInFlight) {
  const std::string dir = "tests/fixtures/engine/glm4_moe_all";
  const std::vector<std::vector<int32_t>> prompts = {{3, 14, 15, 92, 65, 35, 89, 79, 32}, {38, 46, 26}, {7, 1, 8}};
  CpuCompute compute(1);
  std::vector<std::vector<std::vector<float>>> rows[2];
  for (int mb = 1; mb <= 2; ++mb) {
    auto local = LocalMoe::Open(dir, compute);
    ASSERT_TRUE(local.ok()) << local.status();
    auto delayed = std::make_unique<testing::DelayedMoe>(std::move(*local), std::chrono::microseconds(2000));
    testing::DelayedMoe* executor = delayed.get();
    CpuModelOptions o;
    o.num_threads = 1;
    o.micro_batches = mb;
    auto model = CpuModel::Open(dir, o, std::move(delayed));
    ASSERT_TRUE(model.ok()) << model.status();
    auto out = testing::RunGreedy(**model, prompts, 6, /*chunk=*/4);
    ASSERT_TRUE(out.ok()) << out.status();
    rows[mb - 1] = std::move(*out);
    EXPECT_EQ(executor->max_in_flight(), mb);
  }
  ASSERT_EQ(rows[0].size(), rows[1].size());
  for (size_t s = 0; s < prompts.size(); ++s) {
    ASSERT_EQ(rows[0][s].size(), rows[1][s].size()) << "sequence " << s;
    for (size_t r = 0; r < rows[0][s].size(); ++r) EXPECT_EQ(rows[0][s][r], rows[1][s][r]) << "sequence " << s << " step " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Families, CpuModelTest,
                         ::testing::Values("glm4_moe_all", "deepseek_v3_all", "qwen3_moe_experts",
                                           "mixtral_all", "glm_moe_dsa_all", "deepseek_v4_all",
                                           "qwen3_next_all"));

}  // namespace
}  // namespace exl3::engine

namespace exl3::engine {
namespace {

// GLM-MoE-DSA's cache: every layer holds the MLA latent and rope key (128 + 32 floats), the
// layer that runs its own indexer also its key (128); the "shared" layer does not.
TEST(CpuModelKvFootprint, CountsTheIndexerKeysOfLayersThatRunAnIndexer) {
  CpuModelOptions o;
  o.num_threads = 1;
  auto model = CpuModel::Open("tests/fixtures/engine/glm_moe_dsa_experts", o);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ((*model)->config().KvWidth(0), 128 + 32 + 128);
  EXPECT_EQ((*model)->config().KvWidth(1), 128 + 32);
  EXPECT_EQ((*model)->info().kv_bytes_per_token, static_cast<int64_t>(sizeof(float)) * (288 + 160));
}

// A tied head (no lm_head, tie_word_embeddings) is the embedding matrix: the same logits as the
// model whose lm_head holds a copy of the embeddings.
TEST(CpuModelTiedHead, EqualsAnExplicitCopyOfTheEmbeddings) {
  const fs::path fixture = "tests/fixtures/engine/glm4_moe_experts";
  auto src = TensorSource::Open(fixture.string());
  ASSERT_TRUE(src.ok()) << src.status();
  std::ifstream in(fixture / "config.json");
  nlohmann::json config = nlohmann::json::parse(in);
  const fs::path base = fs::temp_directory_path() / "exl3_engine_tied_head";
  for (bool tied : {true, false}) {
    const fs::path dir = base / (tied ? "tied" : "copy");
    fs::create_directories(dir);
    SafetensorsWriter w;
    for (const std::string& name : (*src)->Names()) {
      if (name == "lm_head.weight") continue;
      TensorView t = *(*src)->Get(name);
      w.Add(name, t.info->dtype, t.info->shape, t.data, t.size_bytes());
    }
    if (!tied) {
      TensorView e = *(*src)->Get("model.embed_tokens.weight");
      w.Add("lm_head.weight", e.info->dtype, e.info->shape, e.data, e.size_bytes());
    }
    ASSERT_TRUE(w.Write((dir / "model.safetensors").string()).ok());
    config["tie_word_embeddings"] = tied;
    std::ofstream(dir / "config.json") << config.dump();
  }
  CpuModelOptions o;
  o.num_threads = 2;
  auto tied = CpuModel::Open((base / "tied").string(), o);
  auto copy = CpuModel::Open((base / "copy").string(), o);
  ASSERT_TRUE(tied.ok()) << tied.status();
  ASSERT_TRUE(copy.ok()) << copy.status();
  const std::vector<int32_t> prompt = RandomPrompt(11, (*tied)->info().vocab_size, 3);
  auto a = testing::RunGreedy(**tied, {prompt}, 4, 100);
  auto b = testing::RunGreedy(**copy, {prompt}, 4, 100);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*a, *b);
  fs::remove_all(base);
}

}  // namespace
}  // namespace exl3::engine
