#include "engine/speculative/goodput_draft_choice.h"

#include <algorithm>
#include <cmath>

namespace exl3::engine {
namespace {

// A longer prefix of drafts must raise the goodput by more than this share: where drafts add
// exactly their rows' worth (q = 1 on a cost in proportion to rows) the ratios differ only by
// rounding, which should not decide.
constexpr double kMinRelativeGain = 1e-9;

// One more draft of a candidate and what it adds to the step's expected tokens.
struct Gain {
  double tokens;
  int candidate;
};

// The choice with every candidate marked probe given its one draft first.
std::vector<int> ChooseWithProbes(const StepCostModel& cost, const DraftStep& step,
                                  std::span<const DraftCandidate> candidates) {
  std::vector<int> counts(candidates.size(), 0);
  int budget = std::max(step.max_drafts, 0);
  double tokens = step.base_tokens;
  int rows = step.base_rows;
  for (size_t i = 0; i < candidates.size() && budget > 0; ++i) {
    if (!candidates[i].probe || candidates[i].limit < 1) continue;
    counts[i] = 1;
    tokens += std::clamp(candidates[i].acceptance, 0.0, 1.0);
    ++rows;
    --budget;
  }
  // Probes or not, a step with a draft is a mixed one.
  const StepShape base_shape = rows > step.base_rows ? StepShape::kMixed : step.shape;
  // A step whose own time is unknown runs as it is, to be observed.
  if (!cost.Seconds(base_shape, rows).has_value()) return counts;
  // Every further draft's gain, largest first; on equal gains the earlier candidate, and within a
  // candidate its earlier draft (stable_sort keeps their order).
  std::vector<Gain> gains;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const double q = std::clamp(candidates[i].acceptance, 0.0, 1.0);
    for (int j = counts[i] + 1; j <= candidates[i].limit; ++j)
      gains.push_back({std::pow(q, j), static_cast<int>(i)});
  }
  std::stable_sort(gains.begin(), gains.end(), [](const Gain& a, const Gain& b) { return a.tokens > b.tokens; });
  const int most = std::min(static_cast<int>(gains.size()), budget);
  int best = 0;
  // A step with more rows takes no less time: the learned curve can dip where its points are
  // noisy, and drafts must not look worth taking for the dip alone.
  double seconds = *cost.Seconds(base_shape, rows);
  double best_goodput = tokens / seconds;
  double sum = tokens;
  for (int d = 1; d <= most; ++d) {
    sum += gains[d - 1].tokens;
    seconds = std::max(seconds, *cost.Guess(StepShape::kMixed, rows + d));
    const double goodput = sum / seconds;
    if (goodput > best_goodput * (1 + kMinRelativeGain)) {
      best = d;
      best_goodput = goodput;
    }
  }
  for (int d = 0; d < best; ++d) ++counts[gains[d].candidate];
  return counts;
}

// Whether the choice would give candidate i a draft were its drafts certain (q = 1), the others
// as they are and nobody probed.
bool ProbeCouldPay(const StepCostModel& cost, const DraftStep& step, std::span<const DraftCandidate> candidates,
                   size_t i) {
  std::vector<DraftCandidate> trial(candidates.begin(), candidates.end());
  for (DraftCandidate& c : trial) c.probe = false;
  trial[i].acceptance = 1;
  return ChooseWithProbes(cost, step, trial)[i] > 0;
}

}  // namespace

std::vector<int> ChooseDraftCounts(const StepCostModel& cost, const DraftStep& step,
                                   std::span<const DraftCandidate> candidates) {
  std::vector<DraftCandidate> c(candidates.begin(), candidates.end());
  if (cost.Seconds(step.shape, step.base_rows).has_value()) {
    for (size_t i = 0; i < c.size(); ++i)
      if (c[i].probe && !ProbeCouldPay(cost, step, candidates, i)) c[i].probe = false;
  }
  return ChooseWithProbes(cost, step, c);
}

}  // namespace exl3::engine
