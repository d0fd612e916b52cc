// The engine (scheduler, paged KV blocks, prefix cache, sampler) over the real CPU model on a
// transformers fixture (tests/fixtures/engine): a batch of prompts of different lengths gives the
// same tokens as each prompt alone and as transformers; a KV cache small enough to force
// preemption gives the same tokens; a prefix-cache hit gives the same tokens and reports them.
// On GLM-4 MoE (KV per token) and DeepSeek-V4 (sliding window and compressor state in the same
// paged slots).
#include <memory>
#include <string>

#include "engine/cpu/cpu_model.h"
#include "engine/core/engine.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"
#include "tests/engine/engine_requests.h"

namespace exl3::engine {
namespace {

using testing::Greedy32;
using testing::Int32Rows;
using testing::RequestResults;

const char* const kFixtures[] = {"tests/fixtures/engine/glm4_moe_all",
                                 "tests/fixtures/engine/deepseek_v4_all"};

std::unique_ptr<CpuModel> OpenFixtureModel(const std::string& dir) {
  CpuModelOptions mo;
  mo.num_threads = 2;
  auto model = CpuModel::Open(dir, mo);
  EXPECT_TRUE(model.ok()) << model.status();
  return model.ok() ? std::move(*model) : nullptr;
}

class EngineCpuModelTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    auto ref = TensorSource::Open(std::string(GetParam()) + "/reference.safetensors");
    ASSERT_TRUE(ref.ok()) << ref.status();
    prompts_ = Int32Rows(**ref, "prompt.");
    greedy_ = Int32Rows(**ref, "greedy.");
  }
  // Runs every prompt at once through an engine with `kv_blocks` blocks of 4 tokens; returns
  // each request's tokens in prompt order.
  std::vector<std::vector<int32_t>> RunAll(int kv_blocks, int64_t* preemptions,
                                           const std::vector<std::vector<int32_t>>& prompts) {
    EngineStats stats;
    std::vector<std::vector<int32_t>> out;
    for (const std::vector<SampledToken>& sampled :
         testing::RunPromptsChunked(OpenFixtureModel(GetParam()), kv_blocks, prompts, /*logprobs=*/0, &stats)) {
      out.emplace_back();
      for (const SampledToken& t : sampled) out.back().push_back(t.token);
    }
    *preemptions = stats.preemptions;
    return out;
  }
  std::vector<std::vector<int32_t>> prompts_, greedy_;
};

TEST_P(EngineCpuModelTest, BatchedPromptsGiveTransformersTokens) {
  int64_t preemptions = 0;
  const auto got = RunAll(/*kv_blocks=*/256, &preemptions, prompts_);
  for (size_t i = 0; i < prompts_.size(); ++i) EXPECT_EQ(got[i], greedy_[i]) << "prompt " << i;
  EXPECT_EQ(preemptions, 0);
}

TEST_P(EngineCpuModelTest, PreemptedSequencesGiveTheSameTokens) {
  // 40 blocks of 4 = 160 tokens for prompts + continuations of 215 tokens: sequences are preempted
  // and recomputed.
  int64_t preemptions = 0;
  const auto got = RunAll(/*kv_blocks=*/40, &preemptions, prompts_);
  EXPECT_GT(preemptions, 0);
  for (size_t i = 0; i < prompts_.size(); ++i) EXPECT_EQ(got[i], greedy_[i]) << "prompt " << i;
}

TEST_P(EngineCpuModelTest, PrefixCacheHitGivesTheSameTokens) {
  EngineOptions eo;
  eo.block_size = 4;
  eo.kv_capacity = {KvCacheCapacity::Unit::kBlocks, 256};
  Engine engine(eo, OpenFixtureModel(GetParam()));
  ASSERT_TRUE(engine.Start().ok());
  RequestResults r;
  const auto [first, second] = testing::SubmitTwiceInTurn(engine, Greedy32(prompts_[3]), r);  // 40 tokens
  EXPECT_EQ(r.TokenIds(first), greedy_[3]);
  EXPECT_EQ(r.TokenIds(second), greedy_[3]);
  EXPECT_EQ(r.finish[first].usage.cached_tokens, 0);
  EXPECT_EQ(r.finish[second].usage.cached_tokens, 36);  // 9 full blocks; the last token runs
}

INSTANTIATE_TEST_SUITE_P(Fixtures, EngineCpuModelTest, ::testing::ValuesIn(kFixtures));

}  // namespace
}  // namespace exl3::engine
