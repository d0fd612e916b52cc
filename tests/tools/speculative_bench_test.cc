// The benchmark drafter with a chosen acceptance rate (tools/exl3_bench/recorded_drafter.h) and
// the engine-level speculative benchmark around it (tools/exl3_bench/speculative_bench.h), on
// the CPU engine over a transformers fixture: at p = 1 every draft is accepted, at p = 0 none,
// and both give plain decoding's tokens (no request differs); with the adaptive draft
// length, p = 0 costs fewer draft positions than a fixed K.
#include "tools/exl3_bench/speculative_bench.h"

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "engine/cpu/cpu_model.h"
#include "gtest/gtest.h"
#include "tools/exl3_bench/recorded_drafter.h"

namespace exl3::bench {
namespace {

TEST(RecordedDrafterTest, DraftsTheRecordingRightWithProbabilityP) {
  const std::vector<int32_t> prompt = {5, 6, 7};
  std::vector<int32_t> continuation;
  for (int i = 0; i < 4000; ++i) continuation.push_back(i % 100);
  for (double p : {0.0, 0.3, 0.7, 1.0}) {
    RecordedDrafter d(p, /*seed=*/3, /*vocab_size=*/100);
    ASSERT_TRUE(d.Record(prompt, continuation).ok());
    // From output position 10: the recording's tokens from there, each right or another token.
    const std::vector<int32_t> output(continuation.begin(), continuation.begin() + 10);
    const std::vector<int32_t> drafts = d.Propose(prompt, output, 3990);
    ASSERT_EQ(drafts.size(), 3990u);
    int right = 0;
    for (size_t i = 0; i < drafts.size(); ++i) {
      ASSERT_GE(drafts[i], 0);
      ASSERT_LT(drafts[i], 100);
      right += drafts[i] == continuation[10 + i];
    }
    EXPECT_NEAR(right / 3990.0, p, 0.03) << "p " << p;
    // The same position drafts the same token whatever the step that asks.
    const std::vector<int32_t> again = d.Propose(prompt, std::vector<int32_t>(continuation.begin(), continuation.begin() + 12), 2);
    EXPECT_EQ(again, std::vector<int32_t>(drafts.begin() + 2, drafts.begin() + 4));
  }
  RecordedDrafter d(1.0, 3, 100);
  const std::vector<int32_t> two = {1, 2};
  ASSERT_TRUE(d.Record(prompt, two).ok());
  const std::vector<int32_t> none, other = {5, 6}, outside = {100};
  EXPECT_TRUE(d.Propose(prompt, two, 4).empty());    // past the recording
  EXPECT_TRUE(d.Propose(other, none, 4).empty());    // a prompt never recorded
  EXPECT_EQ(d.Propose(prompt, none, 1), std::vector<int32_t>{1});
  EXPECT_EQ(d.Record(prompt, two).code(), absl::StatusCode::kInvalidArgument);  // recorded already
  EXPECT_EQ(d.Record(outside, none).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(d.Record(none, two).code(), absl::StatusCode::kInvalidArgument);
}

std::unique_ptr<engine::ModelRunner> OpenFixture() {
  engine::CpuModelOptions mo;
  mo.num_threads = 2;
  auto model = engine::CpuModel::Open("tests/fixtures/engine/glm4_moe_all", mo);
  EXPECT_TRUE(model.ok()) << model.status();
  return model.ok() ? std::move(*model) : nullptr;
}

SpeculativeBenchOptions SmallBench() {
  SpeculativeBenchOptions o;
  o.batches = {1, 3};
  o.acceptances = {0.0, 1.0};
  o.ks = {1, 3};
  o.prompt_tokens = 12;
  o.decode_tokens = 40;  // within the fixture's context of 128 with the prompt
  o.engine.block_size = 4;
  o.engine.kv_capacity = {engine::KvCacheCapacity::Unit::kBlocks, 256};
  o.engine.scheduler.max_num_batched_tokens = 64;
  return o;
}

TEST(SpeculativeBenchTest, AcceptsAllAtOneNoneAtZeroWithPlainTokens) {
  absl::StatusOr<std::vector<SpeculativeBenchRow>> rows = RunSpeculativeBench(SmallBench(), OpenFixture);
  ASSERT_TRUE(rows.ok()) << rows.status();
  PrintSpeculativeBench(*rows, stdout);
  ASSERT_EQ(rows->size(), 2u * (1 + 2 * 2));
  for (const SpeculativeBenchRow& r : *rows) {
    EXPECT_EQ(r.requests_differing, 0) << "batch " << r.batch << " k " << r.k << " p " << r.acceptance;
    EXPECT_GT(r.decode_tokens_per_s, 0);
    if (r.k == 0) {
      EXPECT_EQ(r.draft_tokens, 0);
      EXPECT_EQ(r.verify_steps, 0);
      continue;
    }
    EXPECT_GT(r.draft_tokens, 0) << "batch " << r.batch << " k " << r.k;
    EXPECT_GT(r.verify_steps, 0);
    if (r.acceptance == 1.0) {
      EXPECT_EQ(r.accepted_tokens, r.draft_tokens) << "batch " << r.batch << " k " << r.k;
      // Each step emits k + 1 tokens (but the last, cut at max_tokens): about 40 / (k + 1) steps
      // of decoding where plain decoding takes 40.
      EXPECT_LE(r.steps, 40 / (r.k + 1) + 4) << "batch " << r.batch << " k " << r.k;
    } else {
      EXPECT_EQ(r.accepted_tokens, 0) << "batch " << r.batch << " k " << r.k;
    }
  }
}

TEST(SpeculativeBenchTest, AdaptiveDraftLengthSpendsLessOnRejectedDrafts) {
  SpeculativeBenchOptions o = SmallBench();
  o.batches = {1};
  o.ks = {4};
  o.acceptances = {0.0, 1.0};
  absl::StatusOr<std::vector<SpeculativeBenchRow>> fixed = RunSpeculativeBench(o, OpenFixture);
  o.draft_length = engine::DraftLengthPolicy::kAdaptive;
  absl::StatusOr<std::vector<SpeculativeBenchRow>> adaptive = RunSpeculativeBench(o, OpenFixture);
  ASSERT_TRUE(fixed.ok()) << fixed.status();
  ASSERT_TRUE(adaptive.ok()) << adaptive.status();
  PrintSpeculativeBench(*adaptive, stdout);
  ASSERT_EQ(fixed->size(), 3u);
  ASSERT_EQ(adaptive->size(), 3u);
  // p = 0: every verify chunk rejected; adaptive K drafts 4, 4, 4, 3, 2 and then 1 per chunk.
  const SpeculativeBenchRow& f0 = (*fixed)[1];
  const SpeculativeBenchRow& a0 = (*adaptive)[1];
  EXPECT_EQ(a0.accepted_tokens, 0);
  ASSERT_GE(a0.verify_steps, 10);
  EXPECT_LE(a0.draft_tokens, 4 + 4 + 4 + 3 + 2 + (a0.verify_steps - 5));
  EXPECT_LT(a0.draft_tokens * 2, f0.draft_tokens);
  // p = 1: K stays at 4, as fixed.
  EXPECT_EQ((*adaptive)[2].draft_tokens, (*fixed)[2].draft_tokens);
  EXPECT_EQ((*adaptive)[2].accepted_tokens, (*adaptive)[2].draft_tokens);
}

TEST(SpeculativeBenchTest, GoodputDraftLengthGivesPlainTokensAndStopsRejectedDrafts) {
  // The engine's own step times drive the choice (engine/speculative/goodput_draft_choice.h), so
  // only what holds whatever they are is checked: plain decoding's tokens, nothing accepted at
  // p = 0 and everything at p = 1, and at p = 0 fewer drafts than a fixed K = 4 (each sequence's
  // estimate falls with every rejected chunk until a draft row costs more than it yields).
  SpeculativeBenchOptions o = SmallBench();
  o.batches = {1};
  o.ks = {4};
  o.acceptances = {0.0, 1.0};
  absl::StatusOr<std::vector<SpeculativeBenchRow>> fixed = RunSpeculativeBench(o, OpenFixture);
  o.draft_length = engine::DraftLengthPolicy::kGoodput;
  absl::StatusOr<std::vector<SpeculativeBenchRow>> goodput = RunSpeculativeBench(o, OpenFixture);
  ASSERT_TRUE(fixed.ok()) << fixed.status();
  ASSERT_TRUE(goodput.ok()) << goodput.status();
  PrintSpeculativeBench(*goodput, stdout);
  ASSERT_EQ(goodput->size(), 3u);
  for (const SpeculativeBenchRow& r : *goodput) EXPECT_EQ(r.requests_differing, 0) << "p " << r.acceptance;
  EXPECT_EQ((*goodput)[1].accepted_tokens, 0);
  EXPECT_LT((*goodput)[1].draft_tokens, (*fixed)[1].draft_tokens);
  EXPECT_EQ((*goodput)[2].accepted_tokens, (*goodput)[2].draft_tokens);
}

}  // namespace
}  // namespace exl3::bench
