// Speculative decoding with the n-gram drafter (engine/core/scheduler.h, engine/speculative/ngram_drafter.h) over
// the real CPU model on the transformers fixtures (tests/fixtures/engine) of the families that
// verify drafts (GQA: GLM-4 MoE, Qwen3-MoE, Mixtral; MLA: DeepSeek-V3; DSA: GLM-MoE-DSA; and
// with recurrent layers, whose state rolls back to the accepted length: Qwen3-Next's gated
// DeltaNet, GLM-5.3-Flash's KDA with its k-pooled indexer, Qwen4-Exp's DeltaNet, PLE and QSA
// block indexer; DeepSeek-V4, whose compressors' running softmax restores the state kept for the
// accepted length, engine/cpu/attention/dsv4_kept_accumulators.h): at K = 1, 2 and 4 the tokens equal plain
// decoding's (transformers' greedy tokens for the fixture prompts; plain decoding's own for
// prompts built to repeat, where drafts get accepted and rejected mid-chunk, and for seeded
// sampling), batched with chunked prefill,
// through preemption, stop tokens and max_tokens inside an accepted run; cancelled and finished
// requests leave the KV cache and the state slots idle. DeepSeek-V4's MTP drafter is refused at
// start by architecture.
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "engine/cpu/cpu_model.h"
#include "engine/core/engine.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"
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

const char* const kFixtures[] = {"tests/fixtures/engine/glm4_moe_all",    "tests/fixtures/engine/qwen3_moe_all",
                                 "tests/fixtures/engine/mixtral_all",      "tests/fixtures/engine/deepseek_v3_all",
                                 "tests/fixtures/engine/glm_moe_dsa_all",  "tests/fixtures/engine/qwen3_next_all",
                                 "tests/fixtures/engine/glm5_next_all",    "tests/fixtures/engine/qwen4_exp_all",
                                 "tests/fixtures/engine/deepseek_v4_all",  "tests/fixtures/engine/deepseek_v4_release_all"};

SpeculativeOptions Ngram(int k) {
  SpeculativeOptions s;
  s.method = SpeculativeMethod::kNgram;
  s.num_speculative_tokens = k;
  // Down to single tokens: in the fixtures' 128-token vocabulary these recur by chance too, so
  // drafts are rejected as well as accepted.
  s.prompt_lookup_min = 1;
  s.prompt_lookup_max = 3;
  return s;
}

class SpeculativeDecodingTest : public testing::CpuSpeculativeFixtureTest {
 protected:
  void SetUp() override { LoadFixture(2); }  // repeating prompts of 41 and 49 tokens
};

TEST_P(SpeculativeDecodingTest, GreedyTokensEqualPlainDecodingAtK124) {
  const std::vector<GenerateParams> params = GreedyRequests();
  const RunResult plain = Run(Options({}), params);
  for (size_t i = 0; i < prompts_.size(); ++i) EXPECT_EQ(Ids(plain.tokens[i]), greedy_[i]) << "prompt " << i;
  EXPECT_EQ(plain.stats.speculative.num_drafts, 0);
  for (int k : {1, 2, 4}) {
    const RunResult spec = Run(Options(Ngram(k)), params);
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ(Ids(spec.tokens[i]), Ids(plain.tokens[i])) << "K " << k << ", request " << i;
      ASSERT_EQ(spec.tokens[i].size(), plain.tokens[i].size());
      for (size_t t = 0; t < spec.tokens[i].size(); ++t) {  // the same rows' logprobs, near enough
        ASSERT_TRUE(spec.tokens[i][t].logprob.has_value());
        EXPECT_NEAR(*spec.tokens[i][t].logprob, *plain.tokens[i][t].logprob, 1e-4)
            << "K " << k << ", request " << i << ", token " << t;
      }
      EXPECT_EQ(spec.finish[i].reason, FinishReason::kLength);
      EXPECT_EQ(spec.finish[i].usage.completion_tokens, 32);
    }
    const SpeculativeCounters& c = spec.stats.speculative;
    std::printf("%s K=%d: %lld verify chunks, %lld draft tokens, %lld accepted\n", GetParam(), k,
                static_cast<long long>(c.num_drafts), static_cast<long long>(c.num_draft_tokens),
                static_cast<long long>(c.num_accepted_tokens));
    EXPECT_GT(c.num_accepted_tokens, 0) << "K " << k;  // the repeating prompts' drafts
    EXPECT_LT(c.num_accepted_tokens, c.num_draft_tokens) << "K " << k;  // and rejected ones
    EXPECT_LE(c.num_draft_tokens, c.num_drafts * k);
    ASSERT_EQ(c.num_accepted_tokens_per_pos.size(), static_cast<size_t>(k));
    EXPECT_EQ(Sum(c.num_accepted_tokens_per_pos), c.num_accepted_tokens);
    for (int j = 1; j < k; ++j) EXPECT_LE(c.num_accepted_tokens_per_pos[j], c.num_accepted_tokens_per_pos[j - 1]);
    EXPECT_DOUBLE_EQ(spec.stats.kv_usage, 0.0);
  }
}

TEST_P(SpeculativeDecodingTest, TwoMicroBatchesGiveTheSameTokens) {
  // A step's chunks split in two micro-batches: verify chunks stay whole, their rows in order.
  const std::vector<GenerateParams> params = GreedyRequests();
  const RunResult plain = Run(Options({}), params);
  const RunResult spec = Run(Options(Ngram(2)), params, /*micro_batches=*/2);
  for (size_t i = 0; i < params.size(); ++i) EXPECT_EQ(Ids(spec.tokens[i]), Ids(plain.tokens[i])) << "request " << i;
  EXPECT_GT(spec.stats.speculative.num_accepted_tokens, 0);
}

TEST_P(SpeculativeDecodingTest, EachAcceptedDraftSavesAStep) {
  // One sequence alone: every step emits one token plus the drafts it accepted.
  const std::vector<GenerateParams> params = {Greedy32(repeating_[0])};
  const RunResult plain = Run(Options({}), params);
  for (int k : {1, 2, 4}) {
    const RunResult spec = Run(Options(Ngram(k)), params);
    EXPECT_EQ(Ids(spec.tokens[0]), Ids(plain.tokens[0]));
    EXPECT_GT(spec.stats.speculative.num_accepted_tokens, 0);
    EXPECT_EQ(plain.stats.steps - spec.stats.steps, spec.stats.speculative.num_accepted_tokens) << "K " << k;
  }
}

TEST_P(SpeculativeDecodingTest, SeededSamplingGivesPlainDecodingsTokens) {
  // Row j of a verify chunk draws with the draw index of the token it would be: each emitted
  // token is plain decoding's for the same seed (and so has its distribution).
  const std::vector<GenerateParams> params = testing::SeededSamplingRequests(repeating_, {1u, 2u, 3u, 4u});
  const RunResult plain = Run(Options({}), params);
  const RunResult spec = Run(Options(Ngram(3)), params);
  for (size_t i = 0; i < params.size(); ++i) EXPECT_EQ(Ids(spec.tokens[i]), Ids(plain.tokens[i])) << "request " << i;
  std::printf("%s sampled: %lld draft tokens, %lld accepted\n", GetParam(),
              static_cast<long long>(spec.stats.speculative.num_draft_tokens),
              static_cast<long long>(spec.stats.speculative.num_accepted_tokens));
  EXPECT_GT(spec.stats.speculative.num_accepted_tokens, 0);
}

TEST_P(SpeculativeDecodingTest, StopTokenAndMaxTokensInsideAnAcceptedRun) {
  // Plain decoding first, to pick stop points where speculation runs ahead of them.
  const RunResult plain = Run(Options({}), {Greedy32(repeating_[0])});
  const std::vector<int32_t> full = Ids(plain.tokens[0]);
  ASSERT_EQ(full.size(), 32u);
  // Stop at the first occurrence of the token at output position 20; max_tokens cut at 19.
  GenerateParams stop = Greedy32(repeating_[0]);
  stop.stop_token_ids = {full[20]};
  GenerateParams length = Greedy32(repeating_[0]);
  length.max_tokens = 19;
  GenerateParams min_tokens = stop;  // the stop token banned for 25 tokens
  min_tokens.min_tokens = 25;
  const std::vector<GenerateParams> params = {stop, length, min_tokens};
  const RunResult want = Run(Options({}), params);
  const RunResult got = Run(Options(Ngram(4)), params);
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(Ids(got.tokens[i]), Ids(want.tokens[i])) << "request " << i;
    EXPECT_EQ(got.finish[i].reason, want.finish[i].reason) << "request " << i;
    EXPECT_EQ(got.finish[i].usage.completion_tokens, want.finish[i].usage.completion_tokens);
  }
  EXPECT_EQ(want.finish[0].reason, FinishReason::kStop);
  EXPECT_EQ(Ids(got.tokens[1]).size(), 19u);
  EXPECT_DOUBLE_EQ(got.stats.kv_usage, 0.0);
}

TEST_P(SpeculativeDecodingTest, PreemptionGivesTheSameTokensAndFreesEverything) {
  // 40 blocks of 4 = 160 tokens for prompts + continuations of well over that: preemption and
  // recomputation, drafts only where blocks are left.
  const std::vector<GenerateParams> params = GreedyRequests();
  const RunResult spec = Run(Options(Ngram(4), /*kv_blocks=*/40), params);
  EXPECT_GT(spec.stats.preemptions, 0);
  EXPECT_GT(spec.stats.speculative.num_accepted_tokens, 0);
  for (size_t i = 0; i < prompts_.size(); ++i) EXPECT_EQ(Ids(spec.tokens[i]), greedy_[i]) << "prompt " << i;
  const RunResult plain = Run(Options({}), params);
  for (size_t i = 0; i < params.size(); ++i) EXPECT_EQ(Ids(spec.tokens[i]), Ids(plain.tokens[i])) << "request " << i;
  EXPECT_DOUBLE_EQ(spec.stats.kv_usage, 0.0);
}

TEST_P(SpeculativeDecodingTest, CancelledMidRequestLeavesTheCacheIdle) {
  // Two sequences at most: the recurrent families' two state slots must both come back.
  EngineOptions eo = Options(Ngram(4));
  eo.scheduler.max_num_seqs = 2;
  Engine engine(eo, OpenCpuFixtureModel(GetParam()));
  ASSERT_TRUE(engine.Start().ok());
  RequestResults r;
  GenerateParams g = Greedy32(repeating_[0]);
  g.max_tokens = 80;  // within the smallest fixture context (128)
  auto id = engine.Submit(g, r.Callback());
  ASSERT_TRUE(id.ok());
  GenerateParams other = Greedy32(repeating_[1]);  // runs on beside it, to the end
  auto other_id = engine.Submit(other, r.Callback());
  ASSERT_TRUE(other_id.ok());
  r.WaitForTokens(*id, 6);
  ASSERT_TRUE(engine.Cancel(*id).ok());
  r.Wait(2);
  EXPECT_EQ(r.finish[*id].reason, FinishReason::kAbort);
  EXPECT_LT(r.sampled[*id].size(), 80u);
  EXPECT_EQ(r.finish[*other_id].reason, FinishReason::kLength);
  EXPECT_TRUE(WaitUntilIdle(engine)) << "KV usage " << engine.Stats().kv_usage;
  // Both slots free again: two new requests run beside each other to transformers' tokens.
  RequestResults again;
  std::vector<uint64_t> ids;
  for (size_t i = 0; i < 2; ++i) {
    auto id = engine.Submit(Greedy32(prompts_[i]), again.Callback());
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  again.Wait(2);
  for (size_t i = 0; i < 2; ++i) EXPECT_EQ(again.TokenIds(ids[i]), greedy_[i]) << "prompt " << i;
  engine.Stop();
  EXPECT_DOUBLE_EQ(engine.Stats().kv_usage, 0.0);
}

TEST_P(SpeculativeDecodingTest, AdaptiveAndGoodputDraftLengthsGivePlainDecodingsTokens) {
  // Each sequence's own K (engine/speculative/draft_length.h), or each step's choice from the
  // step times the engine measures (engine/speculative/goodput_draft_choice.h), changes how many
  // drafts a step verifies, never which tokens come out: greedy (with logprobs) and seeded
  // sampling as plain decoding.
  SpeculativeOptions adaptive = Ngram(4);
  adaptive.draft_length = DraftLengthPolicy::kAdaptive;
  SpeculativeOptions goodput = Ngram(4);
  goodput.draft_length = DraftLengthPolicy::kGoodput;
  std::vector<GenerateParams> params = GreedyRequests();
  for (const GenerateParams& g : testing::SeededSamplingRequests(repeating_, {1u, 3u})) params.push_back(g);
  const RunResult plain = Run(Options({}), params);
  const RunResult fixed = Run(Options(Ngram(4)), params);
  const RunResult spec = Run(Options(adaptive), params);
  const RunResult chosen = Run(Options(goodput), params);
  for (const RunResult* run : {&spec, &chosen}) {
    const char* name = run == &spec ? "adaptive" : "goodput";
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ(Ids(run->tokens[i]), Ids(plain.tokens[i])) << name << " request " << i;
      if (params[i].sampling.logprobs.value_or(0) > 0) {
        for (size_t t = 0; t < run->tokens[i].size() && t < plain.tokens[i].size(); ++t)
          EXPECT_NEAR(*run->tokens[i][t].logprob, *plain.tokens[i][t].logprob, 1e-4) << name << " request " << i;
      }
    }
    EXPECT_EQ(Sum(run->stats.speculative.num_accepted_tokens_per_pos), run->stats.speculative.num_accepted_tokens);
    EXPECT_DOUBLE_EQ(run->stats.kv_usage, 0.0);
    EXPECT_DOUBLE_EQ(run->stats.speculative_mean_draft_length, 0.0);  // nothing running
  }
  const SpeculativeCounters& a = spec.stats.speculative;
  const SpeculativeCounters& f = fixed.stats.speculative;
  const SpeculativeCounters& g = chosen.stats.speculative;
  std::printf("%s K=4: fixed %lld draft tokens, %lld accepted; adaptive %lld draft tokens, %lld accepted; "
              "goodput (this machine's step times) %lld draft tokens, %lld accepted\n",
              GetParam(), static_cast<long long>(f.num_draft_tokens), static_cast<long long>(f.num_accepted_tokens),
              static_cast<long long>(a.num_draft_tokens), static_cast<long long>(a.num_accepted_tokens),
              static_cast<long long>(g.num_draft_tokens), static_cast<long long>(g.num_accepted_tokens));
  EXPECT_GT(a.num_accepted_tokens, 0);  // (K shrinking and staying up: tests/engine/speculative/draft_length_test.cc)
  // The engine reports its steps' times (without them the goodput policy never drafts): every
  // sequence's acceptance starts at 1, and a draft row costs less than a step's share per
  // sequence, so the first decode steps after the one observed plain do draft.
  EXPECT_GT(g.num_draft_tokens, 0);
}

TEST_P(SpeculativeDecodingTest, PerRequestDraftCapAndSwitch) {
  // GenerateParams::num_speculative_tokens: 0 turns drafting off for that request, 1 caps it;
  // every request still gives plain decoding's tokens.
  std::vector<GenerateParams> params = GreedyRequests();
  const RunResult plain = Run(Options({}), params);
  for (GenerateParams& g : params) g.num_speculative_tokens = 0;
  const RunResult off = Run(Options(Ngram(4)), params);
  for (GenerateParams& g : params) g.num_speculative_tokens = 1;
  const RunResult one = Run(Options(Ngram(4)), params);
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(Ids(off.tokens[i]), Ids(plain.tokens[i])) << "request " << i;
    EXPECT_EQ(Ids(one.tokens[i]), Ids(plain.tokens[i])) << "request " << i;
  }
  EXPECT_EQ(off.stats.speculative.num_drafts, 0);
  const SpeculativeCounters& c = one.stats.speculative;
  EXPECT_GT(c.num_accepted_tokens, 0);
  EXPECT_EQ(c.num_draft_tokens, c.num_drafts);  // one draft per verify chunk
  for (size_t j = 1; j < c.num_accepted_tokens_per_pos.size(); ++j) EXPECT_EQ(c.num_accepted_tokens_per_pos[j], 0);
  // Mixed: the repeating prompts draft, the fixture prompts do not.
  params = GreedyRequests();
  for (size_t i = 0; i < prompts_.size(); ++i) params[i].num_speculative_tokens = 0;
  const RunResult mixed = Run(Options(Ngram(4)), params);
  for (size_t i = 0; i < params.size(); ++i) EXPECT_EQ(Ids(mixed.tokens[i]), Ids(plain.tokens[i])) << "request " << i;
  EXPECT_GT(mixed.stats.speculative.num_accepted_tokens, 0);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, SpeculativeDecodingTest, ::testing::ValuesIn(kFixtures));

TEST(SpeculativeDecodingRefusalTest, RequestDraftCapOutOfRangeRefusedByName) {
  const std::vector<int32_t> prompt = {1, 2, 3};
  auto submit = [&](Engine& engine, std::optional<int> k) {
    GenerateParams g = Greedy32(prompt);
    g.max_tokens = 2;
    g.num_speculative_tokens = k;
    RequestResults r;
    absl::StatusOr<uint64_t> id = engine.Submit(g, r.Callback());
    if (id.ok()) r.Wait(1);
    return id.status();
  };
  EngineOptions eo;
  eo.kv_capacity = {KvCacheCapacity::Unit::kBlocks, 64};
  eo.scheduler.speculative = Ngram(3);
  Engine spec(eo, OpenCpuFixtureModel("tests/fixtures/engine/glm4_moe_all"));
  ASSERT_TRUE(spec.Start().ok());
  for (int k : {0, 1, 3}) EXPECT_TRUE(submit(spec, k).ok()) << k;
  EXPECT_TRUE(submit(spec, std::nullopt).ok());
  for (int k : {-1, 4}) {
    const absl::Status st = submit(spec, k);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << k;
    EXPECT_TRUE(absl::StartsWith(st.message(), "num_speculative_tokens must be in [0, 3]")) << st;
  }
  // Without speculative decoding: 0 is what the engine does anyway; anything else is refused.
  EngineOptions plain_options = eo;
  plain_options.scheduler.speculative = {};
  Engine plain(plain_options, OpenCpuFixtureModel("tests/fixtures/engine/glm4_moe_all"));
  ASSERT_TRUE(plain.Start().ok());
  EXPECT_TRUE(submit(plain, 0).ok());
  const absl::Status st = submit(plain, 2);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(st.message(), "num_speculative_tokens is 2")) << st;
  EXPECT_NE(st.message().find("without speculative decoding"), std::string_view::npos) << st;
}

TEST(SpeculativeDecodingRefusalTest, ProvidedMethodNeedsItsProposer) {
  SpeculativeOptions s;
  s.method = SpeculativeMethod::kProvided;
  s.num_speculative_tokens = 2;
  EXPECT_EQ(ValidateSpeculativeOptions(s).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(ParseSpeculativeMethod("provided").ok());  // not a server's choice
}

TEST(SpeculativeDecodingRefusalTest, DeepseekV4MtpRefusedByName) {
  // DeepSeek-V4 verifies n-gram drafts (above); its mtp method needs the DSPARK block drafter
  // (docs/dspark.md): a checkpoint without it is refused by name (deepseek_v4_all: no MTP blocks
  // in its config), one with it starts (deepseek_v4_release_mtp; its runs are in
  // mtp_speculative_decoding_test.cc).
  for (const char* fixture : {"tests/fixtures/engine/deepseek_v4_all", "tests/fixtures/engine/deepseek_v4_release_mtp"}) {
    EngineOptions eo;
    eo.kv_capacity = {KvCacheCapacity::Unit::kBlocks, 64};
    eo.scheduler.speculative.method = SpeculativeMethod::kMtp;
    eo.scheduler.speculative.num_speculative_tokens = 2;
    Engine engine(eo, OpenCpuFixtureModel(fixture));
    const absl::Status st = engine.Start();
    if (std::string_view(fixture).ends_with("_mtp")) {
      EXPECT_TRUE(st.ok()) << fixture << ": " << st;
      continue;
    }
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << fixture << ": " << st;
    EXPECT_NE(st.message().find("DeepseekV4ForCausalLM"), std::string_view::npos) << st;
    EXPECT_NE(st.message().find("mtp"), std::string_view::npos) << st;
  }
}

TEST(SpeculativeDecodingRefusalTest, BadOptionsRefusedAtStart) {
  EngineOptions eo;
  eo.kv_capacity = {KvCacheCapacity::Unit::kBlocks, 64};
  eo.scheduler.speculative = Ngram(0);
  Engine engine(eo, OpenCpuFixtureModel("tests/fixtures/engine/glm4_moe_all"));
  EXPECT_EQ(engine.Start().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace exl3::engine
