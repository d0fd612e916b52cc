// Speculative decoding on the GPU engine (CudaModel::CheckDraftVerification): n-gram drafts
// verified in chunks of K + 1 rows, through the Engine, on the transformers fixtures of every
// family the GPU engine verifies: attention without per-sequence state (GQA: GLM-4 MoE, Qwen3-MoE,
// Mixtral; MLA: DeepSeek-V3; DSA: GLM-MoE-DSA) and the recurrent families, whose device state store
// keeps a verify chunk's state after each of its positions (Qwen3-Next's gated DeltaNet,
// GLM-5.3-Flash's KDA with its k-pooled indexer and hyper-connections, Qwen4-Exp's DeltaNet, QSA and
// PLE windows), and DeepSeek-V4, whose compressors keep their accumulators after each verify row
// per state slot (engine/cuda/dsv4_kept_row_slots.h). At K = 1, 2 and 4: the fixture prompts give transformers' greedy tokens (their
// top-2 margins are wide: tests/fixtures/engine/README.md); prompts built to repeat, where drafts
// are accepted and rejected mid-chunk, give plain GPU decoding's tokens up to the first near-tie (a
// verify row runs the prefill attention kernel where plain decoding runs the decode kernel, and
// its linear layers over more rows: a top-1 / top-2 logprob gap under 5e-3 may go either way), and
// the KV cache is idle after.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/cuda/cuda_model.h"
#include "engine/core/engine.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"
#include "tests/engine/cuda/gpu_test_support.h"
#include "tests/engine/cuda/open_gpu_model.h"
#include "tests/engine/engine_requests.h"
#include "tests/engine/speculative_runs.h"

namespace exl3::engine::cuda {
namespace {

using testing::Greedy32;
using testing::Int32Rows;

// A fresh engine over the GPU model with cache blocks of `block_size`; n-gram drafts at K = k (0: none).
testing::SpeculativeRun RunAll(const std::string& dir, int block_size, int k, const std::vector<GenerateParams>& params) {
  SpeculativeOptions ngram;
  if (k > 0) {
    ngram.method = SpeculativeMethod::kNgram;
    ngram.num_speculative_tokens = k;
    ngram.prompt_lookup_min = 1;
    ngram.prompt_lookup_max = 3;
  }
  return testing::RunOnce(testing::SpeculativeEngineOptions(ngram, /*kv_blocks=*/64, block_size),
                          OpenGpuModel(dir), params);
}

class CudaSpeculativeDecodingTest : public ::testing::TestWithParam<const char*> {};

TEST_P(CudaSpeculativeDecodingTest, GreedyTokensEqualPlainDecodingAtK124) {
  REQUIRE_GPU();
  const std::string dir = std::string("tests/fixtures/engine/") + GetParam();
  auto ref = TensorSource::Open(dir + "/reference.safetensors");
  ASSERT_TRUE(ref.ok()) << ref.status();
  const std::vector<std::vector<int32_t>> prompts = Int32Rows(**ref, "prompt."), greedy = Int32Rows(**ref, "greedy.");
  std::vector<GenerateParams> params;
  for (const auto& p : prompts) params.push_back(Greedy32(p, /*logprobs=*/2));
  for (size_t i = 0; i < 2; ++i) params.push_back(Greedy32(testing::Repeating(prompts[i], greedy[i]), /*logprobs=*/2));
  // DeepSeek-V4 at blocks of 8: its HCA windows of 16 then span two blocks, and verify chunks
  // cross block ends (where the next block starts from the full one) more often.
  const int block_size = std::string(GetParam()).rfind("deepseek_v4", 0) == 0 ? 8 : 16;
  const testing::SpeculativeRun plain = RunAll(dir, block_size, 0, params);
  for (int k : {1, 2, 4}) {
    const testing::SpeculativeRun spec = RunAll(dir, block_size, k, params);
    ASSERT_EQ(spec.tokens.size(), params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      const bool fixture_prompt = i < prompts.size();
      ASSERT_NO_FATAL_FAILURE(testing::ExpectTokensOfPlainDecoding(
          spec.tokens[i], plain.tokens[i], fixture_prompt ? &greedy[i] : nullptr,
          absl::StrCat(GetParam(), " K ", k, fixture_prompt ? ", prompt " : ", repeating prompt ", i)));
    }
    const SpeculativeCounters& c = spec.stats.speculative;
    std::printf("%s GPU K=%d: %lld verify chunks, %lld draft tokens, %lld accepted\n", GetParam(), k,
                static_cast<long long>(c.num_drafts), static_cast<long long>(c.num_draft_tokens),
                static_cast<long long>(c.num_accepted_tokens));
    EXPECT_GT(c.num_accepted_tokens, 0) << "K " << k;
    EXPECT_LT(c.num_accepted_tokens, c.num_draft_tokens) << "K " << k;
    EXPECT_DOUBLE_EQ(spec.stats.kv_usage, 0.0);
  }
}

INSTANTIATE_TEST_SUITE_P(StatelessAttention, CudaSpeculativeDecodingTest,
                         ::testing::Values("glm4_moe_all", "qwen3_moe_all", "mixtral_all", "deepseek_v3_all",
                                           "glm_moe_dsa_all"));

// The recurrent families: their states per verify position (engine/cuda/device_sequence_states.h).
INSTANTIATE_TEST_SUITE_P(RecurrentFamilies, CudaSpeculativeDecodingTest,
                         ::testing::Values("qwen3_next_all", "glm5_next_all"));

// DeepSeek-V4: the compressors' kept accumulators, restored after rejected drafts (blocks of 8:
// CSA windows of 4 close inside verify chunks and at block ends, HCA windows of 16 across blocks).
INSTANTIATE_TEST_SUITE_P(DeepSeekV4, CudaSpeculativeDecodingTest,
                         ::testing::Values("deepseek_v4_all", "deepseek_v4_experts"));

// Qwen4-Exp: its DeltaNet states, QSA and PLE windows per verify position.
INSTANTIATE_TEST_SUITE_P(Qwen4Exp, CudaSpeculativeDecodingTest, ::testing::Values("qwen4_exp_all"));

TEST(CudaSpeculativeDecodingTest, RecurrentFamiliesAndDeepSeekV4AreAccepted) {
  REQUIRE_GPU();
  for (const char* name : {"qwen3_next_all", "glm5_next_all", "qwen4_exp_all", "deepseek_v4_all"}) {
    std::unique_ptr<CudaModel> model = OpenGpuModel(std::string("tests/fixtures/engine/") + name);
    ASSERT_NE(model, nullptr) << name;
    EXPECT_TRUE(model->CheckDraftVerification().ok()) << name << ": " << model->CheckDraftVerification();
  }
}

}  // namespace
}  // namespace exl3::engine::cuda
