#include "kernels/page_intervals.h"

#include <gtest/gtest.h>

namespace exl3 {
namespace {

const void* At(uintptr_t a) { return reinterpret_cast<const void*>(a); }

TEST(PageIntervals, AlignsMergesAndSkipsEmptyRanges) {
  constexpr uintptr_t kPage = 4096;
  const std::vector<ByteRange> ranges = {
      {At(0x10010), 8},                 // inside page 0x10000
      {At(0x30000), 0x1000},            // exactly one page, out of order
      {At(0x10ff0), 0x20},              // crosses into page 0x11000: merged with the first
      {nullptr, 100},                   // skipped
      {At(0x50000), 0},                 // skipped
      {At(0x12000), 1},                 // touches the merged interval's end: merged
      {At(0x30800), 0x1000},            // overlaps the page at 0x30000, ends in 0x31000
  };
  const std::vector<PageInterval> got = MergeToPages(ranges, kPage);
  const std::vector<PageInterval> want = {{0x10000, 0x13000}, {0x30000, 0x32000}};
  EXPECT_EQ(got, want);
}

TEST(PageIntervals, CoverIsExactAtTheEdges) {
  const std::vector<PageInterval> iv = {{0x10000, 0x13000}, {0x30000, 0x32000}};
  EXPECT_TRUE(IntervalsCover(iv, At(0x10000), 0x3000));
  EXPECT_TRUE(IntervalsCover(iv, At(0x12fff), 1));
  EXPECT_FALSE(IntervalsCover(iv, At(0x12fff), 2));   // runs past the end
  EXPECT_FALSE(IntervalsCover(iv, At(0xffff), 1));    // before the first
  EXPECT_FALSE(IntervalsCover(iv, At(0x13000), 1));   // in the gap
  EXPECT_FALSE(IntervalsCover(iv, At(0x12000), 0x1f000));  // spans the gap into the next
  EXPECT_TRUE(IntervalsCover(iv, At(0x31fff), 1));
  EXPECT_FALSE(IntervalsCover(iv, At(0x32000), 1));   // after the last
  EXPECT_TRUE(IntervalsCover(iv, nullptr, 0));        // nothing to cover
  EXPECT_FALSE(IntervalsCover({}, At(0x10000), 1));
}

TEST(PageIntervals, EveryRangeIsCoveredByItsMerge) {
  // Many random ranges: each must be covered by the union, and the union must be disjoint.
  uint64_t s = 88172645463325252ull;
  auto next = [&s] { s ^= s << 13; s ^= s >> 7; s ^= s << 17; return s; };
  std::vector<ByteRange> ranges;
  for (int i = 0; i < 2000; ++i) {
    ranges.push_back({At(0x100000 + next() % 0x400000), 1 + next() % 20000});
  }
  const std::vector<PageInterval> iv = MergeToPages(ranges, 65536);
  for (size_t i = 1; i < iv.size(); ++i) EXPECT_LT(iv[i - 1].second, iv[i].first);
  for (const PageInterval& p : iv) {
    EXPECT_EQ(p.first % 65536, 0u);
    EXPECT_EQ(p.second % 65536, 0u);
  }
  for (const ByteRange& r : ranges) EXPECT_TRUE(IntervalsCover(iv, r.data, r.bytes));
}

}  // namespace
}  // namespace exl3
