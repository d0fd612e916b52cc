#include "engine/speculative/draft_length.h"

#include <algorithm>

namespace exl3::engine {

void DraftLength::Observe(int drafted, int accepted) {
  if (policy_ != DraftLengthPolicy::kAdaptive || drafted < 1 || cap_ < 1) return;
  const double fraction = static_cast<double>(std::clamp(accepted, 0, drafted)) / drafted;
  acceptance_ = (1 - kAcceptanceWeight) * acceptance_ + kAcceptanceWeight * fraction;
  if (acceptance_ < kShrinkBelow) {
    k_ = std::max(1, k_ - 1);
  } else if (acceptance_ > kGrowAbove) {
    k_ = std::min(cap_, k_ + 1);
  }
}

}  // namespace exl3::engine
