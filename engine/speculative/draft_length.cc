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

}  // namespace exl3::engine
