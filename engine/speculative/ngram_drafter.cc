#include "engine/speculative/ngram_drafter.h"

#include <algorithm>

namespace exl3::engine {

std::vector<int32_t> NgramDrafter::Propose(std::span<const int32_t> tokens, int max_drafts) const {
  const int len = static_cast<int>(tokens.size());
  if (max_drafts <= 0) return {};
  for (int n = std::min(options_.max_n, len - 1); n >= options_.min_n; --n) {
    const std::span<const int32_t> suffix = tokens.last(n);
    // Occurrences start at s in [0, len - n - 1]: each is followed by at least one token. The
    // latest first.
    for (int s = len - n - 1; s >= 0; --s) {
      if (!std::equal(suffix.begin(), suffix.end(), tokens.begin() + s)) continue;
      const int first = s + n;
      const int count = std::min(max_drafts, len - first);
      return std::vector<int32_t>(tokens.begin() + first, tokens.begin() + first + count);
    }
  }
  return {};
}

}  // namespace exl3::engine
