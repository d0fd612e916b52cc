#include "engine/speculative/draft_length.h"

#include <algorithm>

namespace exl3::engine {

void DraftLength::Observe(int drafted, int accepted) {
  if (drafted < 1 || cap_ < 1) return;
  accepted = std::clamp(accepted, 0, drafted);
  if (policy_ == DraftLengthPolicy::kGoodput) {
    const int tested = accepted < drafted ? accepted + 1 : drafted;
    accepted_average_ = (1 - kDraftAcceptanceWeight) * accepted_average_ + kDraftAcceptanceWeight * accepted;
    tested_average_ = (1 - kDraftAcceptanceWeight) * tested_average_ + kDraftAcceptanceWeight * tested;
    steps_without_drafts_ = 0;
    return;
  }
  if (policy_ != DraftLengthPolicy::kAdaptive) return;
  const double fraction = static_cast<double>(accepted) / drafted;
  acceptance_ = (1 - kAcceptanceWeight) * acceptance_ + kAcceptanceWeight * fraction;
  if (acceptance_ < kShrinkBelow) {
    k_ = std::max(1, k_ - 1);
  } else if (acceptance_ > kGrowAbove) {
    k_ = std::min(cap_, k_ + 1);
  }
}

void DraftLength::set_chosen(int drafts) {
  if (drafts >= 1) {
    // One draft while a probe is due is the probe; anything else the choice gave of its own accord.
    const bool probe = drafts == 1 && probe_due();
    probe_interval_ = probe ? std::min(2 * probe_interval_, kMaxProbeInterval) : kProbeInterval;
  }
  chosen_ = drafts;
  chain_limit_ = drafts < cap_ ? drafts + 1 : cap_;
}

}  // namespace exl3::engine
