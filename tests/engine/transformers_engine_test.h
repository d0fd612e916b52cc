// The engine tests over a family's transformers fixture (tests/fixtures/engine/<family>_all):
// the fixture's reference (prompts, transformers' greedy tokens and, from its logits, their
// log-probabilities), the CPU model of the fixture, every prompt at once through an engine, the
// check that a request's tokens and logprobs are transformers', and the engine's cases for a
// family that keeps state per sequence (batching, preemption, a failed step run again, prefix
// caching off), which tests/engine/cpu/qwen3_next_test.cc and glm5next_model_test.cc run.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/core/engine.h"
#include "engine/cpu/cpu_model.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"
#include "tests/engine/engine_requests.h"
#include "tests/engine/failing_once_moe.h"

namespace exl3::engine::testing {

class TransformersEngineTest : public ::testing::Test {
 protected:
  // `dir`: the fixture directory (its reference.safetensors: prompt.i, greedy.i, logits.i).
  explicit TransformersEngineTest(std::string dir) : dir_(std::move(dir)) {}

  void SetUp() override {
    auto ref = TensorSource::Open(dir_ + "/reference.safetensors");
    ASSERT_TRUE(ref.ok()) << ref.status();
    prompts_ = Int32Rows(**ref, "prompt.");
    greedy_ = Int32Rows(**ref, "greedy.");
    // transformers' log-probabilities at each greedy step.
    const int vocab = 128;  // the fixtures' vocabulary
    for (size_t i = 0; i < prompts_.size(); ++i) {
      const std::vector<float> logits = *ToFloat32(*(*ref)->Get("logits." + std::to_string(i)));
      std::vector<std::vector<double>>& steps = want_logprobs_.emplace_back();
      for (size_t j = 0; j < greedy_[i].size(); ++j) {
        steps.push_back(LogSoftmax(&logits[(prompts_[i].size() - 1 + j) * vocab], vocab));
      }
    }
  }

  // A request's tokens are transformers' greedy ones, with transformers' logprobs for each and
  // for the top 5 beside it: a wrong state moves the logits long before it changes a greedy
  // token of these models.
  void ExpectTransformers(size_t prompt, const std::vector<SampledToken>& got) {
    std::vector<int32_t> tokens;
    for (const SampledToken& t : got) tokens.push_back(t.token);
    EXPECT_EQ(tokens, greedy_[prompt]) << "prompt " << prompt;
    ASSERT_EQ(got.size(), want_logprobs_[prompt].size());
    for (size_t j = 0; j < got.size(); ++j) {
      const std::vector<double>& want = want_logprobs_[prompt][j];
      EXPECT_NEAR(*got[j].logprob, want[got[j].token], 2e-4) << "prompt " << prompt << " token " << j;
      EXPECT_EQ(got[j].top_logprobs.size(), 5u);
      for (const TokenLogprob& top : got[j].top_logprobs)
        EXPECT_NEAR(top.logprob, want[top.token], 2e-4)
            << "prompt " << prompt << " token " << j << " top " << top.token;
    }
  }

  // The fixture's CPU model on 2 threads; `moe` null: its experts in process.
  std::unique_ptr<CpuModel> Model(std::unique_ptr<MoeExecutor> moe = nullptr) {
    CpuModelOptions mo;
    mo.num_threads = 2;
    auto model = CpuModel::Open(dir_, mo, std::move(moe));
    EXPECT_TRUE(model.ok()) << model.status();
    return model.ok() ? std::move(*model) : nullptr;
  }

  // Every prompt at once (32 greedy tokens with the top 5 logprobs of each) through an engine
  // with `kv_blocks` blocks of 4 tokens and chunked prefill; each request's tokens in prompt order.
  std::vector<std::vector<SampledToken>> RunAll(int kv_blocks, std::unique_ptr<CpuModel> model,
                                                EngineStats* stats) {
    return RunPromptsChunked(std::move(model), kv_blocks, prompts_, /*logprobs=*/5, stats);
  }

  // Every prompt batched (prefill chunks beside other sequences' decode tokens): transformers'
  // tokens, no preemption.
  void ExpectBatchedPromptsGiveTransformersTokens() {
    EngineStats stats;
    const auto got = RunAll(/*kv_blocks=*/256, Model(), &stats);
    for (size_t i = 0; i < prompts_.size(); ++i) ExpectTransformers(i, got[i]);
    EXPECT_EQ(stats.preemptions, 0);
  }

  // 40 blocks of 4 = 160 tokens for prompts + continuations of 215: sequences are preempted and
  // recomputed from position 0, their state with them, and give transformers' tokens.
  void ExpectPreemptedSequencesGiveTransformersTokens() {
    EngineStats stats;
    const auto got = RunAll(/*kv_blocks=*/40, Model(), &stats);
    EXPECT_GT(stats.preemptions, 0);
    for (size_t i = 0; i < prompts_.size(); ++i) ExpectTransformers(i, got[i]);
  }

  // The first full step (24 tokens) fails in the MoE (FailingOnceMoe) after a recurrent layer
  // wrote the new states; the engine runs each chunk again alone, from the states before it.
  void ExpectAFailedStepRunsAgainFromTheStateBeforeIt() {
    EngineStats stats;
    const auto got = RunAll(/*kv_blocks=*/256, Model(std::make_unique<FailingOnceMoe>(dir_, 24)), &stats);
    EXPECT_EQ(stats.failed_steps, 1);
    for (size_t i = 0; i < prompts_.size(); ++i) ExpectTransformers(i, got[i]);
  }

  // Prefix caching, asked for, does not apply: the same prompt twice (prompt 3, 40 tokens) gives
  // transformers' tokens both times with nothing read from the cache.
  void ExpectPrefixCachingOff() {
    EngineOptions eo;
    eo.block_size = 4;
    eo.kv_capacity = {KvCacheCapacity::Unit::kBlocks, 256};
    ASSERT_TRUE(eo.scheduler.enable_prefix_caching);  // asked for, but cannot apply
    Engine engine(eo, Model());
    ASSERT_TRUE(engine.Start().ok());
    EXPECT_FALSE(PrefixCachingUsable(engine.model_info()));
    RequestResults r;
    const auto [first, second] = SubmitTwiceInTurn(engine, Greedy32(prompts_[3], 5), r);
    ExpectTransformers(3, r.sampled[first]);
    ExpectTransformers(3, r.sampled[second]);
    EXPECT_EQ(r.finish[second].usage.cached_tokens, 0);
    EXPECT_EQ(engine.Stats().prefix_cache_hit_tokens, 0);
  }

  const std::string dir_;
  std::vector<std::vector<int32_t>> prompts_, greedy_;
  std::vector<std::vector<std::vector<double>>> want_logprobs_;  // [prompt][step][vocab]
};

}  // namespace exl3::engine::testing
