// Page intervals: the page-aligned union of many host byte ranges, the unit in which host memory
// is pinned or registered for a device (kernels/cuda HostRegistration). Plain host code, so it is
// tested without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace exl3 {

using PageInterval = std::pair<uintptr_t, uintptr_t>;  // [begin, end), page-aligned

struct ByteRange {
  const void* data = nullptr;
  size_t bytes = 0;
};

// The page-aligned union of `ranges` (empty or null ranges skipped), sorted and disjoint;
// overlapping or touching intervals are merged. `page` must be a power of two.
std::vector<PageInterval> MergeToPages(const std::vector<ByteRange>& ranges, uintptr_t page);

// Whether [data, data + bytes) lies inside one interval of `intervals` (MergeToPages's output).
// An empty range is always covered.
bool IntervalsCover(const std::vector<PageInterval>& intervals, const void* data, size_t bytes);

}  // namespace exl3
