// Speculative decoding's draft length per sequence (engine/speculative/draft_length.h): the adaptive rule
// and the goodput policy's per-sequence estimate and probes alone, then through the scheduler over the real CPU model on a transformers fixture with the
// n-gram drafter: a sequence whose drafts keep being rejected falls to one draft per step, while
// one on a prompt built to repeat keeps its whole cap.
#include "engine/speculative/draft_length.h"

#include <cstdio>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/cpu/cpu_model.h"
#include "engine/core/scheduler.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"
#include "tests/engine/engine_requests.h"
#include "tests/engine/speculative_runs.h"

namespace exl3::engine {
namespace {

TEST(DraftLengthTest, FixedKeepsItsCap) {
  DraftLength d(DraftLengthPolicy::kFixed, 4);
  for (int i = 0; i < 10; ++i) d.Observe(4, 0);
  EXPECT_EQ(d.limit(), 4);
  EXPECT_EQ(DraftLength(DraftLengthPolicy::kFixed, 0).limit(), 0);
  EXPECT_EQ(DraftLength().limit(), 0);  // no speculative decoding
}

TEST(DraftLengthTest, AdaptiveShrinksOnRejectionsAndGrowsBack) {
  DraftLength d(DraftLengthPolicy::kAdaptive, 4);
  EXPECT_EQ(d.limit(), 4);
  // Acceptance 1 -> 0.5 -> 0.25 (not below 0.25) -> 0.125: the first shrink on the third.
  const int want[] = {4, 4, 3, 2, 1, 1, 1};
  for (int w : want) {
    d.Observe(d.limit(), 0);
    EXPECT_EQ(d.limit(), w) << "acceptance " << d.acceptance();
  }
  // Drafts landing again: above 0.6 after two full acceptances, one more each chunk, to the cap.
  d.Observe(1, 1);  // 0.5+
  EXPECT_EQ(d.limit(), 1);
  d.Observe(1, 1);
  EXPECT_EQ(d.limit(), 2);
  for (int i = 0; i < 5; ++i) d.Observe(d.limit(), d.limit());
  EXPECT_EQ(d.limit(), 4);
}

TEST(DraftLengthTest, AdaptiveNeverLeavesOneToCap) {
  DraftLength d(DraftLengthPolicy::kAdaptive, 2);
  for (int i = 0; i < 20; ++i) {
    d.Observe(d.limit(), i % 3 == 0 ? d.limit() : 0);
    EXPECT_GE(d.limit(), 1);
    EXPECT_LE(d.limit(), 2);
  }
  DraftLength off(DraftLengthPolicy::kAdaptive, 0);  // the request turned drafting off
  off.Observe(1, 1);
  EXPECT_EQ(off.limit(), 0);
}

TEST(DraftLengthTest, PolicyNames) {
  EXPECT_EQ(*ParseDraftLengthPolicy("fixed"), DraftLengthPolicy::kFixed);
  EXPECT_EQ(*ParseDraftLengthPolicy("adaptive"), DraftLengthPolicy::kAdaptive);
  EXPECT_EQ(*ParseDraftLengthPolicy("goodput"), DraftLengthPolicy::kGoodput);
  const absl::StatusOr<DraftLengthPolicy> bad = ParseDraftLengthPolicy("auto");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("fixed, adaptive, goodput"), std::string_view::npos) << bad.status();
  EXPECT_STREQ(DraftLengthPolicyName(DraftLengthPolicy::kAdaptive), "adaptive");
  EXPECT_STREQ(DraftLengthPolicyName(DraftLengthPolicy::kGoodput), "goodput");
}

TEST(DraftLengthTest, GoodputKeepsItsCapAndEstimatesEachDraftsChance) {
  DraftLength d(DraftLengthPolicy::kGoodput, 3);
  EXPECT_EQ(d.limit(), 3);
  EXPECT_DOUBLE_EQ(d.draft_acceptance(), 1.0);
  const double w = DraftLength::kDraftAcceptanceWeight;
  // 3 drafts, none accepted: one tested (the first), none right.
  d.Observe(3, 0);
  EXPECT_DOUBLE_EQ(d.draft_acceptance(), (1 - w) / 1.0);
  EXPECT_EQ(d.limit(), 3);  // the choice decides each step's count
  // 3 drafts, all accepted: three tested, three right.
  d.Observe(3, 3);
  EXPECT_DOUBLE_EQ(d.draft_acceptance(), ((1 - w) * (1 - w) + w * 3) / ((1 - w) + w * 3));
  // 3 drafts, the first accepted: two tested (the second was wrong), one right.
  DraftLength e(DraftLengthPolicy::kGoodput, 3);
  e.Observe(3, 1);
  EXPECT_DOUBLE_EQ(e.draft_acceptance(), ((1 - w) + w * 1) / ((1 - w) + w * 2));

  // Each draft right with probability 0.7: the estimate near 0.7, where the accepted fraction
  // (the adaptive policy's average) is near (0.7 + 0.49 + 0.343) / 3 = 0.51.
  std::mt19937 rng(7);
  std::bernoulli_distribution right(0.7);
  DraftLength g(DraftLengthPolicy::kGoodput, 3);
  DraftLength adaptive(DraftLengthPolicy::kAdaptive, 3);
  double estimate = 0, fraction = 0;
  constexpr int kChunks = 20000;
  for (int i = 0; i < kChunks; ++i) {
    int a = 0;
    while (a < 3 && right(rng)) ++a;
    g.Observe(3, a);
    adaptive.Observe(3, a);
    estimate += g.draft_acceptance();
    fraction += adaptive.acceptance();
  }
  EXPECT_NEAR(estimate / kChunks, 0.7, 0.03);
  EXPECT_NEAR(fraction / kChunks, 0.51, 0.03);
}

TEST(DraftLengthTest, GoodputProbesAfterStepsWithoutDrafts) {
  DraftLength d(DraftLengthPolicy::kGoodput, 2);
  for (int i = 0; i < DraftLength::kProbeInterval; ++i) {
    EXPECT_FALSE(d.probe_due()) << i;
    d.ObserveStepWithoutDrafts();
  }
  EXPECT_TRUE(d.probe_due());
  d.ObserveStepWithoutDrafts();
  EXPECT_TRUE(d.probe_due());  // until a verify chunk
  d.Observe(1, 0);
  EXPECT_FALSE(d.probe_due());
  // Only the goodput policy probes, and only a sequence that drafts.
  for (DraftLength other : {DraftLength(DraftLengthPolicy::kFixed, 2), DraftLength(DraftLengthPolicy::kAdaptive, 2),
                            DraftLength(DraftLengthPolicy::kGoodput, 0)}) {
    for (int i = 0; i < 2 * DraftLength::kProbeInterval; ++i) other.ObserveStepWithoutDrafts();
    EXPECT_FALSE(other.probe_due());
  }
}

// A probe the choice does not follow up doubles the interval to the next, up to
// kMaxProbeInterval; drafts the choice gives of its own accord bring it back to kProbeInterval.
TEST(DraftLengthTest, GoodputProbeIntervalBacksOff) {
  DraftLength d(DraftLengthPolicy::kGoodput, 3);
  auto turned_off_until_probe_due = [&d] {
    int steps = 0;
    while (!d.probe_due()) {
      d.set_chosen(0);
      d.ObserveStepWithoutDrafts();
      ++steps;
    }
    return steps;
  };
  std::vector<int> intervals;
  for (int probe = 0; probe < 5; ++probe) {
    intervals.push_back(turned_off_until_probe_due());
    d.set_chosen(1);  // the probe
    d.Observe(1, 0);
  }
  EXPECT_EQ(intervals, (std::vector<int>{16, 32, 64, 128, 128}));
  d.set_chosen(2);  // the choice's own drafts
  d.Observe(2, 2);
  EXPECT_EQ(d.probe_interval(), DraftLength::kProbeInterval);
  EXPECT_EQ(turned_off_until_probe_due(), DraftLength::kProbeInterval);
  d.set_chosen(1);  // the probe
  d.Observe(1, 1);
  EXPECT_EQ(d.probe_interval(), 2 * DraftLength::kProbeInterval);
  // One draft while no probe is due is the choice's own.
  d.set_chosen(1);
  d.Observe(1, 1);
  EXPECT_EQ(d.probe_interval(), DraftLength::kProbeInterval);
}

// What one sequence's verify chunks drafted, step by step, and its limit after each.
struct DraftTrace {
  std::vector<int> drafts;    // per step in which it got drafts
  std::vector<int> accepted;  // of those, accepted
  std::vector<int> limits;    // Scheduler::DraftLimit after each such step (-1: it finished)
  std::vector<int32_t> tokens;
};

// Runs every request at once through a Scheduler over the CPU model.
std::vector<DraftTrace> RunScheduler(const std::string& dir, const SpeculativeOptions& spec,
                                     const std::vector<SequenceRequest>& requests) {
  std::unique_ptr<CpuModel> model = testing::OpenCpuFixtureModel(dir);
  if (model == nullptr) return {};
  const ModelInfo info = model->info();
  SchedulerOptions so;
  so.max_num_batched_tokens = 64;
  so.speculative = spec;
  const KvCacheShape shape{256, 4, so.max_num_seqs, 1 + spec.num_speculative_tokens};
  EXPECT_TRUE(model->AllocateKvCache(shape).ok());
  Scheduler sched(so, info, shape);
  std::vector<DraftTrace> traces(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) sched.Add(static_cast<int64_t>(i), requests[i]);
  for (int step = 0; step < 400 && !sched.Empty(); ++step) {
    const ScheduledStep s = sched.Schedule();
    std::vector<float> logits(static_cast<size_t>(s.batch.NumLogitRows()) * info.vocab_size);
    const absl::Status st = model->Forward(s.batch, logits.data());
    EXPECT_TRUE(st.ok()) << st;
    if (!st.ok()) break;
    std::map<int64_t, int> drafted, emitted;
    for (const SequenceChunk& c : s.batch.chunks)
      if (c.wants_logits && c.num_logit_rows > 1) drafted[c.sequence_id] = c.num_logit_rows - 1;
    for (const SequenceUpdate& u : sched.CompleteStep(s, logits)) {
      traces[u.sequence_id].tokens.push_back(u.token.token);
      ++emitted[u.sequence_id];
    }
    for (const auto& [id, d] : drafted) {
      traces[id].drafts.push_back(d);
      traces[id].accepted.push_back(emitted[id] - 1);  // the tokens beyond the first
      traces[id].limits.push_back(sched.DraftLimit(id).value_or(-1));
    }
  }
  EXPECT_TRUE(sched.Empty());
  return traces;
}

SequenceRequest Greedy(const std::vector<int32_t>& prompt) {
  SequenceRequest r;
  r.prompt = prompt;
  r.max_tokens = 32;
  r.ignore_eos = true;
  return r;
}

class AdaptiveDraftLengthTest : public testing::CpuSpeculativeFixtureTest {
 protected:
  void SetUp() override { LoadFixture(1); }
};

TEST_P(AdaptiveDraftLengthTest, ShrinksWhereDraftsFailAndStaysUpWhereTheyLand) {
  SpeculativeOptions spec;
  spec.method = SpeculativeMethod::kNgram;
  spec.num_speculative_tokens = 4;
  spec.prompt_lookup_min = 1;  // a draft wherever the last token occurred before
  spec.prompt_lookup_max = 3;
  spec.draft_length = DraftLengthPolicy::kAdaptive;
  // The fixtures' tiny models repeat themselves, so most n-gram drafts land. Drafts that fail:
  // a fixture prompt under a repetition penalty of 2, which keeps the model off the tokens it has
  // seen, which are what the n-gram drafter proposes (on these three fixtures the drafts it
  // then gets are nearly all rejected). Beside it, drafts that land: the prompt built to repeat.
  SequenceRequest fresh = Greedy(prompts_[0]);
  fresh.max_tokens = 100;
  fresh.sampling.repetition_penalty = 2;
  const std::vector<SequenceRequest> requests = {fresh, Greedy(repeating_[0])};
  const std::vector<DraftTrace> adaptive = RunScheduler(GetParam(), spec, requests);
  ASSERT_EQ(adaptive.size(), 2u);
  spec.draft_length = DraftLengthPolicy::kFixed;
  const std::vector<DraftTrace> fixed = RunScheduler(GetParam(), spec, requests);
  const std::vector<DraftTrace> plain = RunScheduler(GetParam(), SpeculativeOptions{}, requests);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(adaptive[i].tokens, plain[i].tokens) << "request " << i;
    EXPECT_EQ(fixed[i].tokens, plain[i].tokens) << "request " << i;
    std::printf("%s %s: drafts(accepted)/limit after", GetParam(), i == 0 ? "penalised" : "repeating");
    for (size_t k = 0; k < adaptive[i].drafts.size(); ++k)
      std::printf(" %d(%d)/%d", adaptive[i].drafts[k], adaptive[i].accepted[k], adaptive[i].limits[k]);
    std::printf("\n");
  }
  // The penalised sequence: its drafts rejected, K below 4 after its last verify chunk.
  const DraftTrace& bad = adaptive[0];
  ASSERT_GE(bad.drafts.size(), 3u);
  int drafted = 0, accepted = 0;
  for (size_t k = 0; k < bad.drafts.size(); ++k) {
    drafted += bad.drafts[k];
    accepted += bad.accepted[k];
  }
  EXPECT_LT(accepted * 4, drafted);
  EXPECT_LT(bad.limits.back(), 4);
  EXPECT_GE(bad.limits.back(), 1);
  // The repeating one: K stays at 4 throughout, as at a fixed K.
  const DraftTrace& good = adaptive[1];
  ASSERT_FALSE(good.drafts.empty());
  for (size_t k = 0; k < good.limits.size(); ++k) {
    if (good.limits[k] >= 0) {
      EXPECT_EQ(good.limits[k], 4) << "verify chunk " << k;
    }
  }
  EXPECT_EQ(good.drafts, fixed[1].drafts);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, AdaptiveDraftLengthTest,
                         ::testing::Values("tests/fixtures/engine/glm4_moe_all", "tests/fixtures/engine/qwen3_moe_all",
                                           "tests/fixtures/engine/qwen3_next_all"));

// The MTP head's chained positions under goodput: one more draft than the last choice gave (the cap
// before any), so a sequence turned off drafts one (its probe's) and a landing one grows a step at a
// time; the other policies chain their limit.
TEST(DraftLengthTest, GoodputChainsOneDraftMoreThanItsLastChoice) {
  DraftLength d(DraftLengthPolicy::kGoodput, 3);
  EXPECT_EQ(d.chained_draft_limit(), 3);
  d.set_chosen(0);
  EXPECT_EQ(d.chained_draft_limit(), 1);
  d.set_chosen(1);
  EXPECT_EQ(d.chained_draft_limit(), 2);
  d.set_chosen(3);
  EXPECT_EQ(d.chained_draft_limit(), 3);
  DraftLength fixed(DraftLengthPolicy::kFixed, 3);
  fixed.set_chosen(0);
  EXPECT_EQ(fixed.chained_draft_limit(), 3);
  DraftLength adaptive(DraftLengthPolicy::kAdaptive, 4);
  adaptive.Observe(4, 0);
  EXPECT_EQ(adaptive.chained_draft_limit(), adaptive.limit());
}

}  // namespace
}  // namespace exl3::engine
