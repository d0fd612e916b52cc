// Speculative decoding with the checkpoint's MTP head (speculative method mtp, engine/cpu/mtp/mtp_head.h)
// over the real CPU model on the <family>_mtp fixtures (DeepSeek-V3 MLA, GLM-4 MoE GQA, GLM-5 DSA,
// GLM-5.3-Flash: KDA, k-pooled DSA and hyper-connections in the model, its MTP layer plain): at
// K = 1, 2 and 4 the tokens equal plain decoding's (transformers' greedy tokens for the fixture
// prompts; plain decoding's own for prompts built to repeat and for seeded sampling), batched
// with chunked prefill, with two micro-batches, through preemption; cancelled and finished
// requests leave the KV cache idle. The drafts come from the MTP head, so they are accepted
// where it predicts the model (the GLM fixture's head mostly does, DeepSeek's rarely).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "engine/cpu/cpu_model.h"
#include "engine/core/engine.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"
#include "tools/test_model/resolve_test_model_spec.h"
#include "tools/test_model/test_model.h"
#include "tests/engine/engine_requests.h"
#include "tests/engine/speculative_runs.h"

namespace exl3::engine {
namespace {

using testing::Greedy32;
using testing::RequestResults;
using testing::Ids;
using testing::OpenCpuFixtureModel;
using testing::Sum;
using testing::WaitUntilIdle;
using RunResult = testing::SpeculativeRun;

SpeculativeOptions Mtp(int k) {
  SpeculativeOptions s;
  s.method = SpeculativeMethod::kMtp;
  s.num_speculative_tokens = k;
  return s;
}

// A fixture with an MTP drafter of either kind (the chained heads or DeepSeek-V4's DSPARK block
// drafter), every prompt in: greedy generation with mtp at K = 1, 2 and 4 gives plain decoding's
// tokens and logprobs, and the drafts and acceptances add up.
class MtpFixtureTest : public testing::CpuSpeculativeFixtureTest {
 protected:
  // Every prompt repeats too; blocks of 4 (the shared options): the MTP's chained positions cross them often.
  void SetUp() override { LoadFixture(SIZE_MAX); }

  void ExpectGreedyTokensOfPlainDecodingAtK124() {
    const std::vector<GenerateParams> params = GreedyRequests();
    const RunResult plain = Run(Options({}), params);
    for (size_t i = 0; i < prompts_.size(); ++i) EXPECT_EQ(Ids(plain.tokens[i]), greedy_[i]) << "prompt " << i;
    for (int k : {1, 2, 4}) {
      const RunResult spec = Run(Options(Mtp(k)), params);
      for (size_t i = 0; i < params.size(); ++i) {
        EXPECT_EQ(Ids(spec.tokens[i]), Ids(plain.tokens[i])) << "K " << k << ", request " << i;
        ASSERT_EQ(spec.tokens[i].size(), plain.tokens[i].size());
        for (size_t t = 0; t < spec.tokens[i].size(); ++t) {
          ASSERT_TRUE(spec.tokens[i][t].logprob.has_value());
          EXPECT_NEAR(*spec.tokens[i][t].logprob, *plain.tokens[i][t].logprob, 1e-4)
              << "K " << k << ", request " << i << ", token " << t;
        }
        EXPECT_EQ(spec.finish[i].reason, FinishReason::kLength);
      }
      testing::ExpectMtpRunCounts(spec, plain, k, GetParam());
    }
  }
};

class MtpSpeculativeDecodingTest : public MtpFixtureTest {};

TEST_P(MtpSpeculativeDecodingTest, GreedyTokensEqualPlainDecodingAtK124) { ExpectGreedyTokensOfPlainDecodingAtK124(); }

TEST_P(MtpSpeculativeDecodingTest, DraftsAreTheHeadsPredictionsAtK1) {
  // With K = 1 every draft is the MTP head's argmax at the sequence's last kept position p
  // (predicting position p + 2), which the fixture's reference gives for the teacher-forced
  // sequence prompt + greedy: a sequence alone (drafts always fit the budget) drafts and accepts
  // exactly as simulated from it only if the MTP layer's KV of every earlier position was
  // written by the steps before (prefill chunks, accepted drafts, rejections).
  std::vector<testing::MtpDraftCounts> counts;
  ASSERT_NO_FATAL_FAILURE(testing::SimulateMtpDraftsAtK1(GetParam(), prompts_, greedy_, &counts));
  for (size_t i = 0; i < prompts_.size(); ++i) {
    const testing::MtpDraftCounts& want = counts[i];
    const RunResult spec = Run(Options(Mtp(1)), {Greedy32(prompts_[i])});
    EXPECT_EQ(Ids(spec.tokens[0]), greedy_[i]) << "prompt " << i;
    EXPECT_EQ(spec.stats.speculative.num_draft_tokens, want.drafts) << "prompt " << i;
    EXPECT_EQ(spec.stats.speculative.num_accepted_tokens, want.accepted) << "prompt " << i;
    std::printf("%s prompt %zu alone, K=1: %lld of %lld drafts accepted, as the reference's MTP logits say\n",
                GetParam(), i, static_cast<long long>(spec.stats.speculative.num_accepted_tokens),
                static_cast<long long>(spec.stats.speculative.num_draft_tokens));
  }
}

TEST_P(MtpSpeculativeDecodingTest, OneSequenceTokensPerSecond) {
  // One request alone (plain decoding's memory floor: one token a step), for the numbers.
  const std::vector<GenerateParams> params = {Greedy32(repeating_[1])};
  const RunResult plain = Run(Options({}), params);
  std::printf("%s plain: %d steps, %.1f tokens/s\n", GetParam(), static_cast<int>(plain.stats.steps),
              32 / plain.seconds);
  for (int k : {1, 2, 4}) {
    const RunResult spec = Run(Options(Mtp(k)), params);
    EXPECT_EQ(Ids(spec.tokens[0]), Ids(plain.tokens[0]));
    // Every step emits one token plus the drafts it accepted.
    EXPECT_EQ(plain.stats.steps - spec.stats.steps, spec.stats.speculative.num_accepted_tokens) << "K " << k;
    std::printf("%s mtp K=%d: %d steps, %lld of %lld drafts accepted, %.1f tokens/s\n", GetParam(), k,
                static_cast<int>(spec.stats.steps), static_cast<long long>(spec.stats.speculative.num_accepted_tokens),
                static_cast<long long>(spec.stats.speculative.num_draft_tokens), 32 / spec.seconds);
  }
}

TEST_P(MtpSpeculativeDecodingTest, TwoMicroBatchesGiveTheSameTokens) {
  const std::vector<GenerateParams> params = GreedyRequests();
  const RunResult plain = Run(Options({}), params);
  const RunResult spec = Run(Options(Mtp(2)), params, /*micro_batches=*/2);
  for (size_t i = 0; i < params.size(); ++i) EXPECT_EQ(Ids(spec.tokens[i]), Ids(plain.tokens[i])) << "request " << i;
  EXPECT_GT(spec.stats.speculative.num_accepted_tokens, 0);
}

TEST_P(MtpSpeculativeDecodingTest, SeededSamplingGivesPlainDecodingsTokens) {
  const std::vector<GenerateParams> params = testing::SeededSamplingRequests(repeating_, {1u, 2u, 3u});
  const RunResult plain = Run(Options({}), params);
  const RunResult spec = Run(Options(Mtp(3)), params);
  for (size_t i = 0; i < params.size(); ++i) EXPECT_EQ(Ids(spec.tokens[i]), Ids(plain.tokens[i])) << "request " << i;
  std::printf("%s sampled: %lld draft tokens, %lld accepted\n", GetParam(),
              static_cast<long long>(spec.stats.speculative.num_draft_tokens),
              static_cast<long long>(spec.stats.speculative.num_accepted_tokens));
  EXPECT_GT(spec.stats.speculative.num_draft_tokens, 0);
  EXPECT_DOUBLE_EQ(spec.stats.kv_usage, 0.0);
}

TEST_P(MtpSpeculativeDecodingTest, PreemptionGivesTheSameTokensAndFreesEverything) {
  // 40 blocks of 4 = 160 tokens for prompts + continuations of about 280: preemption and
  // recomputation (the MTP layer's KV rebuilt with the rest), drafts only where blocks are left.
  const std::vector<GenerateParams> params = GreedyRequests();
  const RunResult spec = Run(Options(Mtp(4), /*kv_blocks=*/40), params);
  EXPECT_GT(spec.stats.preemptions, 0);
  for (size_t i = 0; i < prompts_.size(); ++i) EXPECT_EQ(Ids(spec.tokens[i]), greedy_[i]) << "prompt " << i;
  const RunResult plain = Run(Options({}), params);
  for (size_t i = 0; i < params.size(); ++i) EXPECT_EQ(Ids(spec.tokens[i]), Ids(plain.tokens[i])) << "request " << i;
  std::printf("%s preempted %lld times: %lld of %lld drafts accepted\n", GetParam(),
              static_cast<long long>(spec.stats.preemptions),
              static_cast<long long>(spec.stats.speculative.num_accepted_tokens),
              static_cast<long long>(spec.stats.speculative.num_draft_tokens));
  EXPECT_DOUBLE_EQ(spec.stats.kv_usage, 0.0);
}

TEST_P(MtpSpeculativeDecodingTest, CancelledMidRequestLeavesTheCacheIdle) {
  Engine engine(Options(Mtp(4)), OpenCpuFixtureModel(GetParam()));
  ASSERT_TRUE(engine.Start().ok());
  RequestResults r;
  GenerateParams g = Greedy32(repeating_[0]);
  g.max_tokens = 70;  // within the fixture's context (128)
  auto id = engine.Submit(g, r.Callback());
  ASSERT_TRUE(id.ok());
  auto other_id = engine.Submit(Greedy32(repeating_[1]), r.Callback());
  ASSERT_TRUE(other_id.ok());
  r.WaitForTokens(*id, 6);
  ASSERT_TRUE(engine.Cancel(*id).ok());
  r.Wait(2);
  EXPECT_EQ(r.finish[*id].reason, FinishReason::kAbort);
  EXPECT_EQ(r.finish[*other_id].reason, FinishReason::kLength);
  EXPECT_TRUE(WaitUntilIdle(engine)) << "KV usage " << engine.Stats().kv_usage;
  engine.Stop();
}

TEST_P(MtpSpeculativeDecodingTest, AdaptiveDraftLengthAndPerRequestCapsGivePlainTokens) {
  // The MTP head chains only up to each sequence's own limit: the adaptive K, a request's cap of
  // 1, or none at all (num_speculative_tokens 0); the tokens are plain decoding's either way.
  // With the goodput draft length a step verifies 0..all of the drafts the head made for it
  // (engine/speculative/goodput_draft_choice.h): the same tokens.
  std::vector<GenerateParams> params = GreedyRequests();
  const RunResult plain = Run(Options({}), params);
  SpeculativeOptions adaptive = Mtp(4);
  adaptive.draft_length = DraftLengthPolicy::kAdaptive;
  for (size_t i = 0; i < params.size(); ++i) params[i].num_speculative_tokens = static_cast<int>(i % 3);  // 0, 1, 2
  const RunResult spec = Run(Options(adaptive), params);
  for (size_t i = 0; i < params.size(); ++i) EXPECT_EQ(Ids(spec.tokens[i]), Ids(plain.tokens[i])) << "request " << i;
  const SpeculativeCounters& c = spec.stats.speculative;
  EXPECT_GT(c.num_drafts, 0);
  EXPECT_LE(c.num_draft_tokens, 2 * c.num_drafts);  // no request's cap above 2
  EXPECT_EQ(c.num_accepted_tokens_per_pos[2] + c.num_accepted_tokens_per_pos[3], 0);
  EXPECT_DOUBLE_EQ(spec.stats.kv_usage, 0.0);

  SpeculativeOptions goodput = Mtp(4);
  goodput.draft_length = DraftLengthPolicy::kGoodput;
  const RunResult chosen = Run(Options(goodput), params);
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_EQ(Ids(chosen.tokens[i]), Ids(plain.tokens[i])) << "goodput request " << i;
  const SpeculativeCounters& g = chosen.stats.speculative;
  EXPECT_LE(g.num_draft_tokens, 2 * g.num_drafts);
  EXPECT_DOUBLE_EQ(chosen.stats.kv_usage, 0.0);
  std::printf("%s: goodput %lld draft tokens, %lld accepted\n", GetParam(), static_cast<long long>(g.num_draft_tokens),
              static_cast<long long>(g.num_accepted_tokens));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, MtpSpeculativeDecodingTest,
                         ::testing::Values("tests/fixtures/engine/deepseek_v3_mtp",
                                           "tests/fixtures/engine/glm4_moe_mtp",
                                           "tests/fixtures/engine/glm_moe_dsa_mtp",
                                           "tests/fixtures/engine/glm_moe_dsa_release_mtp",
                                           "tests/fixtures/engine/glm5_next_mtp",
                                           "tests/fixtures/engine/glm5_next_release_mtp",
                                           "tests/fixtures/engine/qwen4_exp_mtp",
                                           "tests/fixtures/engine/qwen4_exp_release_mtp"));

// DeepSeek-V4's DSPARK block drafter (engine/cpu/mtp/dspark_drafter.h, docs/dspark.md) on the
// deepseek_v4_release_mtp fixture: the trunk's taps kept by the CPU model, the main-kv rows
// written at the kept positions, one block draft per decoding span, as many drafts as the
// confidence head keeps. Greedy tokens equal plain decoding's at K = 1, 2 and 4 (also with two
// micro-batches and through preemption), and one sequence alone at K = 1 drafts and accepts
// exactly as simulated from the fixture's reference drafts and lengths (teacher-forced on
// prompt + greedy: first seed the first sampled token at p0 = the prompt's length; no draft
// where the length is 0).
class DsparkSpeculativeDecodingTest : public MtpFixtureTest {};

TEST_P(DsparkSpeculativeDecodingTest, GreedyTokensEqualPlainDecodingAtK124) {
  ExpectGreedyTokensOfPlainDecodingAtK124();
}

TEST_P(DsparkSpeculativeDecodingTest, DraftsAreTheReferencesAtK1) {
  auto ref = TensorSource::Open(std::string(GetParam()) + "/reference.safetensors");
  ASSERT_TRUE(ref.ok()) << ref.status();
  const int max_tokens = 32, B = 4;
  for (size_t i = 0; i < prompts_.size(); ++i) {
    const std::string k = std::to_string(i);
    auto drafts = (*ref)->Get("dspark_drafts." + k);
    auto lengths = (*ref)->Get("dspark_length." + k);
    ASSERT_TRUE(drafts.ok() && lengths.ok());
    std::vector<int32_t> ids = prompts_[i];
    ids.insert(ids.end(), greedy_[i].begin(), greedy_[i].end());
    const int P = static_cast<int>(prompts_[i].size());
    int64_t want_drafts = 0, want_accepted = 0;
    for (int p0 = P, out = 1; max_tokens - out - 1 > 0;) {  // after the prefill: 1 token out
      if (lengths->as<int32_t>()[p0] == 0) {  // no draft: a plain step
        ++p0;
        ++out;
        continue;
      }
      ++want_drafts;
      const bool hit = drafts->as<int32_t>()[static_cast<size_t>(p0) * B] == ids[p0 + 1];
      want_accepted += hit;
      p0 += hit ? 2 : 1;
      out += hit ? 2 : 1;
    }
    const RunResult spec = Run(Options(Mtp(1)), {Greedy32(prompts_[i])});
    EXPECT_EQ(Ids(spec.tokens[0]), greedy_[i]) << "prompt " << i;
    EXPECT_EQ(spec.stats.speculative.num_draft_tokens, want_drafts) << "prompt " << i;
    EXPECT_EQ(spec.stats.speculative.num_accepted_tokens, want_accepted) << "prompt " << i;
    std::printf("%s prompt %zu alone, K=1: %lld of %lld drafts accepted (reference: %lld of %lld)\n", GetParam(), i,
                static_cast<long long>(spec.stats.speculative.num_accepted_tokens),
                static_cast<long long>(spec.stats.speculative.num_draft_tokens),
                static_cast<long long>(want_accepted), static_cast<long long>(want_drafts));
  }
}

TEST_P(DsparkSpeculativeDecodingTest, TwoMicroBatchesAndPreemptionGiveTheSameTokens) {
  const std::vector<GenerateParams> params = GreedyRequests();
  const RunResult plain = Run(Options({}), params);
  const RunResult two = Run(Options(Mtp(2)), params, /*micro_batches=*/2);
  for (size_t i = 0; i < params.size(); ++i) EXPECT_EQ(Ids(two.tokens[i]), Ids(plain.tokens[i])) << "request " << i;
  const RunResult preempted = Run(Options(Mtp(4), /*kv_blocks=*/40), params);
  EXPECT_GT(preempted.stats.preemptions, 0);
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_EQ(Ids(preempted.tokens[i]), Ids(plain.tokens[i])) << "request " << i;
  EXPECT_DOUBLE_EQ(preempted.stats.kv_usage, 0.0);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, DsparkSpeculativeDecodingTest,
                         ::testing::Values("tests/fixtures/engine/deepseek_v4_release_mtp"));

// The test-model writer's MTP layer (TestModelSpec::mtp, exl3-tool make-test-model --mtp) in a
// synthetic whole EXL3 model (random trellis bits: the head's drafts are mostly rejected):
// loaded, its KV layer counted, and decoding with it gives plain decoding's tokens.
class SyntheticMtpTest : public ::testing::TestWithParam<std::string> {};

TEST_P(SyntheticMtpTest, DraftsAndDecodesAsPlainDecoding) {
  TestModelSpec spec;
  spec.arch = GetParam();
  spec.layers = 2;
  spec.hidden = 256;
  spec.experts = 4;
  spec.top_k = 2;
  spec.heads = 4;
  spec.q_lora_rank = 128;
  spec.kv_lora_rank = 64;
  spec.qk_rope_head_dim = 64;
  spec.qk_nope_head_dim = 64;
  spec.v_head_dim = 64;
  spec.index_heads = 2;
  spec.index_head_dim = 128;
  spec.index_topk = 3;
  spec.vocab = 256;
  spec.mtp = true;
  if (spec.arch == "glm5_next") {  // NoPE MLA; the indexer picks whole pools of 4 (a KDA and an indexed layer)
    spec.qk_rope_head_dim = 0;
    spec.index_topk = 4;
  }
  SyntheticOptions so;
  so.whole_model = true;
  so.bits = 3;
  so.progress = false;
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("exl3_synthetic_mtp_" + spec.arch);
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(WriteSyntheticExl3Model(spec, so, dir.string()).ok());
  auto src = TensorSource::Open(dir.string());
  ASSERT_TRUE(src.ok()) << src.status();
  const std::string p = spec.arch == "glm5_next" ? "model.language_model.layers.2." : "model.layers.2.";
  EXPECT_TRUE((*src)->Has(p + "eh_proj.trellis"));
  EXPECT_TRUE((*src)->Has(p + "mlp.experts.3.down_proj.trellis"));
  EXPECT_TRUE((*src)->Has(p + "shared_head.norm.weight"));
  EXPECT_FALSE((*src)->Has(p + "hc_attn_fn"));  // GLM-5.3-Flash's MTP layer: no hyper-connections
  std::vector<GenerateParams> params;
  for (int i = 0; i < 3; ++i) {
    std::vector<int32_t> prompt;
    for (int t = 0; t < 9 + 5 * i; ++t) prompt.push_back((37 * t + 11 * i + 5) % spec.vocab);
    GenerateParams g = Greedy32(prompt);
    g.max_tokens = 12;
    params.push_back(g);
  }
  auto run = [&](const SpeculativeOptions& speculative, EngineStats* stats) {
    EngineOptions eo;
    eo.block_size = 4;
    eo.kv_capacity = {KvCacheCapacity::Unit::kBlocks, 64};
    eo.scheduler.max_num_batched_tokens = 16;
    eo.scheduler.speculative = speculative;
    Engine engine(eo, OpenCpuFixtureModel(dir.string()));
    const absl::Status started = engine.Start();
    EXPECT_TRUE(started.ok()) << started;
    std::vector<FinishInfo> finish;
    auto tokens = testing::RunAllAtOnce(engine, params, &finish);
    engine.Stop();
    *stats = engine.Stats();
    return tokens;
  };
  EngineStats plain_stats, mtp_stats;
  const auto plain = run({}, &plain_stats);
  const auto mtp = run(Mtp(2), &mtp_stats);
  for (size_t i = 0; i < params.size(); ++i) EXPECT_EQ(Ids(mtp[i]), Ids(plain[i])) << "request " << i;
  EXPECT_GT(mtp_stats.speculative.num_draft_tokens, 0);
  EXPECT_DOUBLE_EQ(mtp_stats.kv_usage, 0.0);
  std::printf("synthetic %s with --mtp: %lld of %lld drafts accepted\n", spec.arch.c_str(),
              static_cast<long long>(mtp_stats.speculative.num_accepted_tokens),
              static_cast<long long>(mtp_stats.speculative.num_draft_tokens));
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Families, SyntheticMtpTest,
                         ::testing::Values("glm4_moe", "deepseek_v3", "glm_moe_dsa", "glm5_next"));

TEST(SyntheticMtpTest, TheMtpFlagBelongsToItsFamilies) {
  TestModelSpec spec;
  spec.arch = "qwen3_moe";
  spec.mtp = true;
  const absl::StatusOr<TestModelSpec> resolved = ResolveTestModelSpec(spec);
  EXPECT_EQ(resolved.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace exl3::engine
