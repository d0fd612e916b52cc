// Prompt logprobs (GenerateParams::prompt_logprobs) on the GPU engine (CudaModel::CheckPromptLogitRows):
// through the Engine on transformers fixtures, every prompt token but the first gets the log_softmax
// of the fixture's reference logits at the position before it, within what the GPU fixture test's
// bound on a row (5e-3 of its norm) allows a logprob (twice that), with the prompt's rows over
// several steps and beside a request without them; the continuation stays transformers' greedy one.
// GQA (GLM-4 MoE), MLA (DeepSeek-V3), DSA (GLM-MoE-DSA) and a recurrent family (Qwen3-Next).
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "engine/cuda/cuda_model.h"
#include "engine/core/engine.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"
#include "tests/engine/cuda/gpu_test_support.h"
#include "tests/engine/engine_requests.h"
#include "tests/engine/prompt_logprobs_check.h"

namespace exl3::engine::cuda {
namespace {

constexpr int kTopN = 3;
constexpr double kLogitsRelTolerance = 5e-3;  // tests/engine/cuda/cuda_model_test.cc's bound on a row

class CudaPromptLogprobsTest : public ::testing::TestWithParam<const char*> {};

TEST_P(CudaPromptLogprobsTest, EqualTheReferenceLogSoftmaxBesideOtherSequences) {
  REQUIRE_GPU();
  const std::string dir = std::string("tests/fixtures/engine/") + GetParam();
  auto ref = TensorSource::Open(dir + "/reference.safetensors");
  ASSERT_TRUE(ref.ok()) << ref.status();
  const std::vector<std::vector<int32_t>> prompts = testing::Int32Rows(**ref, "prompt.");
  const std::vector<std::vector<int32_t>> greedy = testing::Int32Rows(**ref, "greedy.");
  auto model = CudaModel::Open(dir, CudaModelOptions{});
  ASSERT_TRUE(model.ok()) << model.status();
  const int vocab = (*model)->info().vocab_size;
  EngineOptions eo;
  eo.block_size = 16;
  eo.kv_capacity = {KvCacheCapacity::Unit::kBlocks, 64};
  eo.scheduler.max_num_batched_tokens = 24;  // prompts over several steps
  eo.scheduler.max_prompt_logit_rows = 10;   // and prompt rows over more
  Engine engine(eo, std::move(*model));
  ASSERT_TRUE(engine.Start().ok());
  testing::RequestResults r;
  std::vector<uint64_t> with, without;
  for (const std::vector<int32_t>& prompt : prompts) {
    GenerateParams g = testing::Greedy32(prompt);
    g.prompt_logprobs = kTopN;
    auto id = engine.Submit(g, r.Callback());
    ASSERT_TRUE(id.ok()) << id.status();
    with.push_back(*id);
    auto plain = engine.Submit(testing::Greedy32(prompt), r.Callback());
    ASSERT_TRUE(plain.ok()) << plain.status();
    without.push_back(*plain);
  }
  r.Wait(2 * prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << GetParam() << " prompt " << i);
    ASSERT_TRUE(r.finish[with[i]].status.ok()) << r.finish[with[i]].status;
    const std::vector<float> logits = *ToFloat32(*(*ref)->Get("logits." + std::to_string(i)));
    const double worst = testing::CheckPromptLogprobs(
        prompts[i], logits, vocab, r.prompt_logprobs[with[i]], kTopN, [&](const float* row) {
          double norm = 0;
          for (int t = 0; t < vocab; ++t) norm += static_cast<double>(row[t]) * row[t];
          return 2 * kLogitsRelTolerance * std::sqrt(norm);
        });
    std::printf("%s prompt %zu (%zu tokens): worst prompt logprob abs err %.2e\n", GetParam(), i, prompts[i].size(),
                worst);
    EXPECT_EQ(r.TokenIds(with[i]), greedy[i]) << "the continuation is unchanged";
    EXPECT_EQ(r.TokenIds(without[i]), greedy[i]);
  }
  engine.Stop();
}

INSTANTIATE_TEST_SUITE_P(Families, CudaPromptLogprobsTest,
                         ::testing::Values("glm4_moe_all", "deepseek_v3_all", "glm_moe_dsa_all", "qwen3_next_all"));

}  // namespace
}  // namespace exl3::engine::cuda
