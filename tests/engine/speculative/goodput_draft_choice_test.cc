// The goodput draft choice (engine/speculative/goodput_draft_choice.h): every cap where rows are
// free, no drafts where each row costs its share of the step and drafts rarely land, the likely
// drafts first in between, the budget, probes, and what it does where the cost is unknown.
#include "engine/speculative/goodput_draft_choice.h"

#include <numeric>
#include <vector>

#include "gtest/gtest.h"

namespace exl3::engine {
namespace {

std::vector<DraftCandidate> Uniform(int n, double acceptance, int limit) {
  return std::vector<DraftCandidate>(n, DraftCandidate{.acceptance = acceptance, .limit = limit, .probe = false});
}

int Sum(const std::vector<int>& counts) { return std::accumulate(counts.begin(), counts.end(), 0); }

// Steps of `shape` and `rows` take `seconds`: two of them (the bucket's warm-up, then its
// measure: engine/speculative/step_cost_curve.h).
void Measure(StepCostModel& cost, StepShape shape, int rows, double seconds) {
  cost.Observe(shape, rows, seconds);
  cost.Observe(shape, rows, seconds);
}

// Likewise, whatever its shape (as on the CPU engine, which runs both alike).
void ObserveBoth(StepCostModel& cost, int rows, double seconds) {
  Measure(cost, StepShape::kDecodeOnly, rows, seconds);
  Measure(cost, StepShape::kMixed, rows, seconds);
}

// A batch of 64 decoding sequences, room for every draft.
constexpr DraftStep kBatch64{.base_rows = 64, .base_tokens = 64, .max_drafts = 1024};

// Memory-bound: a step of 256 rows costs what one of 64 does.
StepCostModel FlatCost() {
  StepCostModel cost;
  ObserveBoth(cost, 64, 0.010);
  ObserveBoth(cost, 256, 0.010);
  return cost;
}

// Compute-bound: the step's time in proportion to its rows.
StepCostModel LinearCost() {
  StepCostModel cost;
  ObserveBoth(cost, 64, 0.0064);
  ObserveBoth(cost, 256, 0.0256);
  return cost;
}

// T = 32 + rows / 2 (ms): a draft row costs half a plain row's share.
StepCostModel HalfRowCost() {
  StepCostModel cost;
  ObserveBoth(cost, 64, 0.064);
  ObserveBoth(cost, 256, 0.160);
  return cost;
}

TEST(GoodputDraftChoiceTest, FlatCostGivesEverySequenceItsCap) {
  const std::vector<int> counts = ChooseDraftCounts(FlatCost(), kBatch64, Uniform(64, 0.7, 3));
  EXPECT_EQ(counts, std::vector<int>(64, 3));
  // Even unlikely drafts add something where they cost nothing.
  EXPECT_EQ(ChooseDraftCounts(FlatCost(), kBatch64, Uniform(64, 0.1, 3)), std::vector<int>(64, 3));
}

TEST(GoodputDraftChoiceTest, LinearCostWithLowAcceptanceGivesNoDrafts) {
  EXPECT_EQ(ChooseDraftCounts(LinearCost(), kBatch64, Uniform(64, 0.3, 3)), std::vector<int>(64, 0));
  // Each draft row costs a plain row's time and yields less than its token: none, whatever q < 1.
  EXPECT_EQ(ChooseDraftCounts(LinearCost(), kBatch64, Uniform(64, 0.95, 3)), std::vector<int>(64, 0));
}

TEST(GoodputDraftChoiceTest, LikelyDraftsFirst) {
  // T = 32 + rows / 2 (ms): a draft row costs half a plain row's share, so drafts right with
  // probability 0.9 pay (0.9, 0.81, 0.73 tokens a row) and those right with 0.2 do not.
  const StepCostModel cost = HalfRowCost();
  std::vector<DraftCandidate> mixed;
  for (int i = 0; i < 64; ++i) mixed.push_back({.acceptance = i % 2 == 0 ? 0.9 : 0.2, .limit = 3, .probe = false});
  const std::vector<int> counts = ChooseDraftCounts(cost, kBatch64, mixed);
  for (int i = 0; i < 64; ++i) EXPECT_EQ(counts[i], i % 2 == 0 ? 3 : 0) << "sequence " << i;
  // With the budget short, the likeliest drafts take it: every first draft of 0.9 before any
  // second one, and none of 0.5's until 0.9's are used up.
  const std::vector<DraftCandidate> two = {{.acceptance = 0.5, .limit = 3, .probe = false},
                                           {.acceptance = 0.9, .limit = 3, .probe = false}};
  EXPECT_EQ(ChooseDraftCounts(FlatCost(), {.base_rows = 64, .base_tokens = 64, .max_drafts = 3}, two),
            (std::vector<int>{0, 3}));
  EXPECT_EQ(ChooseDraftCounts(FlatCost(), {.base_rows = 64, .base_tokens = 64, .max_drafts = 4}, two),
            (std::vector<int>{1, 3}));
  const std::vector<int> short_budget =
      ChooseDraftCounts(FlatCost(), {.base_rows = 64, .base_tokens = 64, .max_drafts = 10}, Uniform(64, 0.9, 3));
  EXPECT_EQ(Sum(short_budget), 10);
  for (int i = 0; i < 64; ++i) EXPECT_EQ(short_budget[i], i < 10 ? 1 : 0) << "sequence " << i;
}

TEST(GoodputDraftChoiceTest, ANoisyDipInTheCostBuysNothing) {
  // The 256-row steps happened to be measured faster than the 64-row ones: a step with more rows
  // still counts as no faster, so drafts that never land are not taken for the dip.
  StepCostModel cost;
  ObserveBoth(cost, 64, 0.0100);
  ObserveBoth(cost, 256, 0.0095);
  EXPECT_EQ(ChooseDraftCounts(cost, kBatch64, Uniform(64, 0.0, 3)), std::vector<int>(64, 0));
  EXPECT_EQ(ChooseDraftCounts(cost, kBatch64, Uniform(64, 0.5, 3)), std::vector<int>(64, 3));
}

TEST(GoodputDraftChoiceTest, LimitsAreKept) {
  std::vector<DraftCandidate> c = Uniform(4, 0.9, 3);
  c[1].limit = 0;  // no drafts proposed
  c[2].limit = 1;
  EXPECT_EQ(ChooseDraftCounts(FlatCost(), {.base_rows = 64, .base_tokens = 64, .max_drafts = 100}, c),
            (std::vector<int>{3, 0, 1, 3}));
  EXPECT_TRUE(ChooseDraftCounts(FlatCost(), kBatch64, {}).empty());
}

TEST(GoodputDraftChoiceTest, ProbesGetOneDraftWhateverTheirAcceptance) {
  std::vector<DraftCandidate> c = Uniform(64, 0.05, 3);
  c[3].probe = true;
  c[40].probe = true;
  c[41].probe = true;
  c[41].limit = 0;  // due, but nothing to verify
  std::vector<int> want(64, 0);
  want[3] = want[40] = 1;
  EXPECT_EQ(ChooseDraftCounts(HalfRowCost(), kBatch64, c), want);
  // Probes take the budget first, in order.
  want[40] = 0;
  EXPECT_EQ(ChooseDraftCounts(HalfRowCost(), {.base_rows = 64, .base_tokens = 64, .max_drafts = 1}, c), want);
}

TEST(GoodputDraftChoiceTest, NoProbesWhereEvenCertainDraftsCannotPay) {
  std::vector<DraftCandidate> c = Uniform(64, 0.05, 3);
  c[3].probe = true;
  // Each row costs its share of the step: a certain draft yields just its row's worth.
  EXPECT_EQ(ChooseDraftCounts(LinearCost(), kBatch64, c), std::vector<int>(64, 0));
  // Plain steps replayed from a graph, drafted ones eager: one sequence's three certain drafts
  // cost far more than they yield.
  StepCostModel graphs;
  Measure(graphs, StepShape::kDecodeOnly, 64, 0.006);
  Measure(graphs, StepShape::kMixed, 65, 0.010045);
  Measure(graphs, StepShape::kMixed, 256, 0.01864);
  EXPECT_EQ(ChooseDraftCounts(graphs, kBatch64, c), std::vector<int>(64, 0));
  // Unknown step times: probes as asked.
  std::vector<int> want(64, 0);
  want[3] = 1;
  EXPECT_EQ(ChooseDraftCounts(StepCostModel{}, kBatch64, c), want);
}

TEST(GoodputDraftChoiceTest, UnknownStepTimes) {
  // Nothing observed: the step runs without drafts (probes aside), to be observed.
  std::vector<DraftCandidate> c = Uniform(8, 1.0, 3);
  c[5].probe = true;
  std::vector<int> want(8, 0);
  want[5] = 1;
  EXPECT_EQ(ChooseDraftCounts(StepCostModel{}, {.base_rows = 8, .base_tokens = 8, .max_drafts = 100}, c), want);
  // Only a larger step observed: the plain step's time is unknown, likewise.
  StepCostModel prefill;
  ObserveBoth(prefill, 512, 0.05);
  EXPECT_EQ(ChooseDraftCounts(prefill, {.base_rows = 8, .base_tokens = 8, .max_drafts = 100}, c), want);
  // The plain step known, larger ones not: they count as its time, so the choice explores them.
  StepCostModel plain;
  ObserveBoth(plain, 64, 0.010);
  EXPECT_EQ(ChooseDraftCounts(plain, kBatch64, Uniform(64, 0.3, 3)), std::vector<int>(64, 3));
  // Once the drafted step is seen to cost its rows, no more.
  ObserveBoth(plain, 256, 0.040);
  EXPECT_EQ(ChooseDraftCounts(plain, kBatch64, Uniform(64, 0.3, 3)), std::vector<int>(64, 0));
}

TEST(GoodputDraftChoiceTest, MeasuredBatch64Costs) {
  // bench/results/engine-h100.md's batch-64 steps on GLM-5.3-Flash shapes: plain 9.07 ms, k = 3
  // verify 17.71 ms. A draft row costs 0.045 ms against 0.142 ms per plain row's token, so a draft
  // pays where q^j is above about 0.32: at q = 0.36 only first drafts, at 0.7 two, at 0.9 all three.
  StepCostModel cost;
  ObserveBoth(cost, 64, 0.00907);
  ObserveBoth(cost, 256, 0.01771);
  EXPECT_EQ(ChooseDraftCounts(cost, kBatch64, Uniform(64, 0.2, 3)), std::vector<int>(64, 0));
  const std::vector<int> low = ChooseDraftCounts(cost, kBatch64, Uniform(64, 0.36, 3));
  for (int n : low) EXPECT_LE(n, 1);
  const std::vector<int> mid = ChooseDraftCounts(cost, kBatch64, Uniform(64, 0.7, 3));
  for (int n : mid) EXPECT_EQ(n, 2);
  EXPECT_EQ(ChooseDraftCounts(cost, kBatch64, Uniform(64, 0.9, 3)), std::vector<int>(64, 3));
}

// Plain decode steps replayed from CUDA graphs, drafted ones eager: at 64 rows a plain step costs
// 6 ms, a mixed one 10 ms + 0.045 ms a row past 64. With the jump no draft of q = 0.7 pays (the
// best, 2 drafts each, gives 140 tokens in 15.8 ms against 64 in 6).
TEST(GoodputDraftChoiceTest, TheFirstDraftPaysForTheEagerStep) {
  StepCostModel cost;
  Measure(cost, StepShape::kDecodeOnly, 64, 0.006);
  Measure(cost, StepShape::kMixed, 65, 0.010045);
  Measure(cost, StepShape::kMixed, 256, 0.01864);
  EXPECT_EQ(ChooseDraftCounts(cost, kBatch64, Uniform(64, 0.7, 3)), std::vector<int>(64, 0));
  EXPECT_EQ(ChooseDraftCounts(cost, kBatch64, Uniform(64, 0.8, 3)), std::vector<int>(64, 0));
  // Certain drafts pay even so: 256 tokens in 18.6 ms.
  EXPECT_EQ(ChooseDraftCounts(cost, kBatch64, Uniform(64, 1.0, 3)), std::vector<int>(64, 3));
  // A step that is mixed anyway (a prompt chunk) has paid the jump, and drafts cost only their
  // rows: two each (140 tokens in 15.8 ms; the third drafts would bring it to 8.7 tokens a ms
  // from 8.9).
  EXPECT_EQ(ChooseDraftCounts(cost, {.shape = StepShape::kMixed, .base_rows = 65, .base_tokens = 64, .max_drafts = 1024},
                              Uniform(64, 0.7, 3)),
            std::vector<int>(64, 2));
  // A probe would pay the jump too, but one sequence's three certain drafts would not have paid
  // for it: no probe.
  std::vector<DraftCandidate> probed = Uniform(64, 0.7, 3);
  probed[0].probe = true;
  EXPECT_EQ(ChooseDraftCounts(cost, kBatch64, probed), std::vector<int>(64, 0));
  // One curve over rows alone averages the plain step with the eager one beside it (rows 64 and 65
  // share a bucket), and drafts look worth taking.
  StepCostModel averaged;
  ObserveBoth(averaged, 64, 0.006);
  ObserveBoth(averaged, 65, 0.010045);
  ObserveBoth(averaged, 256, 0.01864);
  EXPECT_GT(Sum(ChooseDraftCounts(averaged, kBatch64, Uniform(64, 0.7, 3))), 0);
}

// Nothing mixed observed yet: a drafted step counts as the plain step nearest it (explored once).
TEST(GoodputDraftChoiceTest, AnUnseenShapeIsExploredOnce) {
  StepCostModel cost;
  Measure(cost, StepShape::kDecodeOnly, 64, 0.006);
  EXPECT_EQ(ChooseDraftCounts(cost, kBatch64, Uniform(64, 0.3, 3)), std::vector<int>(64, 3));
  Measure(cost, StepShape::kMixed, 256, 0.024);
  EXPECT_EQ(ChooseDraftCounts(cost, kBatch64, Uniform(64, 0.3, 3)), std::vector<int>(64, 0));
}

}  // namespace
}  // namespace exl3::engine
