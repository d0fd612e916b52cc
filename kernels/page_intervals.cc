#include "kernels/page_intervals.h"

#include <algorithm>

namespace exl3 {

std::vector<PageInterval> MergeToPages(const std::vector<ByteRange>& ranges, uintptr_t page) {
  std::vector<PageInterval> pages;
  pages.reserve(ranges.size());
  for (const ByteRange& r : ranges) {
    if (r.data == nullptr || r.bytes == 0) continue;
    const uintptr_t b = reinterpret_cast<uintptr_t>(r.data);
    pages.emplace_back(b & ~(page - 1), (b + r.bytes + page - 1) & ~(page - 1));
  }
  std::sort(pages.begin(), pages.end());
  std::vector<PageInterval> merged;
  for (const PageInterval& iv : pages) {
    if (!merged.empty() && iv.first <= merged.back().second) {
      merged.back().second = std::max(merged.back().second, iv.second);
    } else {
      merged.push_back(iv);
    }
  }
  return merged;
}

bool IntervalsCover(const std::vector<PageInterval>& intervals, const void* data, size_t bytes) {
  if (data == nullptr || bytes == 0) return true;
  const uintptr_t b = reinterpret_cast<uintptr_t>(data);
  // The last interval starting at or before b must reach b + bytes (intervals are disjoint).
  auto it = std::upper_bound(intervals.begin(), intervals.end(), PageInterval(b, UINTPTR_MAX));
  if (it == intervals.begin()) return false;
  --it;
  return b + bytes <= it->second;
}

}  // namespace exl3
