// The CPU model's own consistency on a model of each family: the
// same logits whether a prompt runs at once, in chunks or token by token, whether sequences run
// alone or batched together, and bit for bit the same when a step runs as two micro-batches. (Agreement with transformers: transformers_conformance_test.cc.)
#include "engine/cpu_model.h"

#include <cmath>
#include <filesystem>
#include <random>

#include "gtest/gtest.h"
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

INSTANTIATE_TEST_SUITE_P(Families, CpuModelTest,
                         ::testing::Values("glm4_moe_all", "deepseek_v3_all", "qwen3_moe_experts",
                                           "mixtral_all"));

}  // namespace
}  // namespace exl3::engine
