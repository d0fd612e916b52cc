#include "engine/core/kv_block_manager.h"

#include <algorithm>
#include <numeric>
#include <vector>

#include "gtest/gtest.h"

namespace exl3::engine {
namespace {

using V = std::vector<int32_t>;

std::vector<int32_t> Iota(int n, int32_t first) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), first);
  return v;
}

std::vector<int32_t> Table(const KvBlockManager& kv, int64_t id) {
  std::span<const int32_t> t = kv.BlockTable(id);
  return {t.begin(), t.end()};
}

// Allocates `tokens` for `id` with whatever prefix is cached and registers its full blocks.
PrefixMatch AllocateAndCache(KvBlockManager& kv, int64_t id, const std::vector<int32_t>& tokens) {
  PrefixMatch hit = kv.FindCachedPrefix(tokens);
  EXPECT_TRUE(kv.Allocate(id, static_cast<int>(tokens.size()), hit));
  kv.CacheFullBlocks(id, tokens, static_cast<int>(tokens.size()));
  return hit;
}

TEST(KvBlockManager, AllocateGrowAndFree) {
  KvBlockManager kv(10, 4);
  EXPECT_EQ(kv.NumFreeBlocks(), 10);
  EXPECT_DOUBLE_EQ(kv.Usage(), 0.0);
  ASSERT_TRUE(kv.Allocate(1, 10));
  EXPECT_EQ(kv.BlockTable(1).size(), 3u);
  EXPECT_EQ(kv.NumFreeBlocks(), 7);
  ASSERT_TRUE(kv.Allocate(1, 12));  // still three blocks
  EXPECT_EQ(kv.BlockTable(1).size(), 3u);
  ASSERT_TRUE(kv.Allocate(1, 13));
  EXPECT_EQ(kv.BlockTable(1).size(), 4u);
  EXPECT_DOUBLE_EQ(kv.Usage(), 0.4);
  ASSERT_TRUE(kv.Allocate(2, 1));
  // Tables never share a block without the prefix cache.
  std::vector<int32_t> all = Table(kv, 1);
  all.push_back(kv.BlockTable(2)[0]);
  std::sort(all.begin(), all.end());
  EXPECT_EQ(std::adjacent_find(all.begin(), all.end()), all.end());
  kv.Free(1);
  kv.Free(2);
  kv.Free(3);  // unknown: no-op
  EXPECT_EQ(kv.NumFreeBlocks(), 10);
  EXPECT_FALSE(kv.HasBlocks(1));
  EXPECT_TRUE(kv.BlockTable(1).empty());
}

TEST(KvBlockManager, CapacityIsAllOrNothing) {
  KvBlockManager kv(4, 4);
  ASSERT_TRUE(kv.Allocate(1, 12));
  EXPECT_FALSE(kv.Allocate(2, 5));  // needs two, one is free
  EXPECT_FALSE(kv.HasBlocks(2));
  EXPECT_FALSE(kv.Allocate(1, 17));  // needs two more
  EXPECT_EQ(kv.BlockTable(1).size(), 3u);
  EXPECT_EQ(kv.NumFreeBlocks(), 1);
  EXPECT_TRUE(kv.Allocate(2, 4));
  EXPECT_EQ(kv.NumFreeBlocks(), 0);
  EXPECT_DOUBLE_EQ(kv.Usage(), 1.0);
}

TEST(KvBlockManager, PrefixHitSharesFullBlocksWithRefcounts) {
  KvBlockManager kv(10, 4);
  const std::vector<int32_t> prompt = Iota(12, 100);
  AllocateAndCache(kv, 1, prompt);
  EXPECT_EQ(kv.NumCachedBlocks(), 3);

  // Same 12 tokens: the last token must run, so 2 blocks (8 tokens) hit, not 3.
  PrefixMatch hit = kv.FindCachedPrefix(prompt);
  EXPECT_EQ(hit.num_tokens, 8);
  ASSERT_TRUE(kv.Allocate(2, 12, hit));
  EXPECT_EQ(kv.BlockTable(2)[0], kv.BlockTable(1)[0]);
  EXPECT_EQ(kv.BlockTable(2)[1], kv.BlockTable(1)[1]);
  EXPECT_NE(kv.BlockTable(2)[2], kv.BlockTable(1)[2]);
  EXPECT_EQ(kv.NumFreeBlocks(), 10 - 4);

  // Freeing the first owner keeps the shared blocks held by the second.
  kv.Free(1);
  EXPECT_EQ(kv.NumFreeBlocks(), 10 - 3);
  kv.Free(2);
  EXPECT_EQ(kv.NumFreeBlocks(), 10);
  EXPECT_EQ(kv.NumCachedBlocks(), 3);  // freed cached blocks stay reusable

  // A longer prompt with the same start hits all three cached blocks.
  std::vector<int32_t> longer = prompt;
  longer.push_back(7);
  EXPECT_EQ(kv.FindCachedPrefix(longer).num_tokens, 12);
  // A prompt that differs in its second block hits only the first.
  std::vector<int32_t> forked = prompt;
  forked[5] = 0;
  EXPECT_EQ(kv.FindCachedPrefix(forked).num_tokens, 4);
  // The hash is chained: the same second block after a different first block misses.
  std::vector<int32_t> other_start = prompt;
  other_start[0] = 0;
  EXPECT_EQ(kv.FindCachedPrefix(other_start).num_tokens, 0);

  EXPECT_EQ(kv.counters().queried_tokens, 24);
  EXPECT_EQ(kv.counters().hit_tokens, 8);
}

TEST(KvBlockManager, OnlyComputedFullBlocksAreCached) {
  KvBlockManager kv(10, 4);
  const std::vector<int32_t> tokens = Iota(10, 0);
  ASSERT_TRUE(kv.Allocate(1, 10));
  kv.CacheFullBlocks(1, tokens, 7);  // one full block computed
  EXPECT_EQ(kv.NumCachedBlocks(), 1);
  kv.CacheFullBlocks(1, tokens, 10);  // two; the third is partial
  EXPECT_EQ(kv.NumCachedBlocks(), 2);
  EXPECT_EQ(kv.FindCachedPrefix(Iota(20, 0)).num_tokens, 8);
}

TEST(KvBlockManager, UncachedFreeBlocksGoFirstThenLeastRecentlyFreed) {
  KvBlockManager kv(4, 2);
  const std::vector<int32_t> a = {1, 2, 3, 4}, b = {5, 6, 7, 8};
  AllocateAndCache(kv, 1, a);
  kv.Free(1);
  // Two never-used blocks remain: b takes those and a's cached blocks survive.
  AllocateAndCache(kv, 2, b);
  EXPECT_EQ(kv.FindCachedPrefix(V{1, 2, 3, 4, 9}).num_tokens, 4);
  kv.Free(2);
  EXPECT_EQ(kv.NumCachedBlocks(), 4);
  // Four free blocks, all cached. LRU order: a's second, a's first, b's second, b's first (a
  // sequence's last block is freed first). Taking 3 blocks evicts a's both and b's second.
  ASSERT_TRUE(kv.Allocate(3, 6));
  EXPECT_EQ(kv.NumCachedBlocks(), 1);
  EXPECT_EQ(kv.FindCachedPrefix(V{1, 2, 3, 4, 9}).num_tokens, 0);
  EXPECT_EQ(kv.FindCachedPrefix(V{5, 6, 7, 8, 9}).num_tokens, 2);
}

TEST(KvBlockManager, HitOnFreeCachedBlocksCountsAgainstFreeSpace) {
  KvBlockManager kv(3, 2);
  AllocateAndCache(kv, 1, {1, 2, 3, 4});
  kv.Free(1);
  EXPECT_EQ(kv.NumFreeBlocks(), 3);  // one never used, two cached
  // 7 tokens need 4 blocks: 2 from the cache, 2 new, but only 1 is free besides the hits.
  const std::vector<int32_t> seven = {1, 2, 3, 4, 5, 6, 7};
  PrefixMatch hit = kv.FindCachedPrefix(seven);
  EXPECT_EQ(hit.num_tokens, 4);
  EXPECT_FALSE(kv.Allocate(2, 7, hit));
  EXPECT_EQ(kv.NumFreeBlocks(), 3);
  EXPECT_EQ(kv.NumCachedBlocks(), 2);
  EXPECT_TRUE(kv.Allocate(2, 6, hit));
  EXPECT_EQ(kv.NumFreeBlocks(), 0);
}

TEST(KvBlockManager, SameContentComputedTwiceKeepsOneCachedCopy) {
  KvBlockManager kv(8, 2);
  const std::vector<int32_t> p = {1, 2, 3, 4, 5};
  ASSERT_TRUE(kv.Allocate(1, 5));
  ASSERT_TRUE(kv.Allocate(2, 5));  // scheduled in the same step: no hit yet
  kv.CacheFullBlocks(1, p, 5);
  kv.CacheFullBlocks(2, p, 5);
  EXPECT_EQ(kv.NumCachedBlocks(), 2);
  kv.Free(1);
  kv.Free(2);
  EXPECT_EQ(kv.NumFreeBlocks(), 8);
  PrefixMatch hit = kv.FindCachedPrefix(p);
  EXPECT_EQ(hit.num_tokens, 4);
}

TEST(KvBlockManager, DisabledPrefixCacheNeverHits) {
  KvBlockManager kv(8, 2, /*enable_prefix_caching=*/false);
  AllocateAndCache(kv, 1, {1, 2, 3, 4, 5});
  EXPECT_EQ(kv.NumCachedBlocks(), 0);
  EXPECT_EQ(kv.FindCachedPrefix(V{1, 2, 3, 4, 5}).num_tokens, 0);
}

TEST(KvBlockManager, BlockHashIsChained) {
  const std::vector<int32_t> t = {1, 2};
  EXPECT_EQ(KvBlockManager::HashBlock(5, t), KvBlockManager::HashBlock(5, t));
  EXPECT_NE(KvBlockManager::HashBlock(5, t), KvBlockManager::HashBlock(6, t));
  EXPECT_NE(KvBlockManager::HashBlock(5, t), KvBlockManager::HashBlock(5, std::vector<int32_t>{2, 1}));
}

TEST(KvBlockManager, TruncateGivesBackBlocksPastThePositionsKept) {
  KvBlockManager kv(10, 4);
  const std::vector<int32_t> tokens = Iota(9, 100);
  ASSERT_TRUE(kv.Allocate(1, 14));  // 9 tokens + 5 drafts: 4 blocks
  kv.CacheFullBlocks(1, tokens, 9);  // blocks 0 and 1 full
  EXPECT_EQ(kv.NumFreeBlocks(), 6);
  const std::vector<int32_t> before = Table(kv, 1);
  kv.Truncate(1, 9);  // positions [0, 9): 3 blocks
  EXPECT_EQ(Table(kv, 1), std::vector<int32_t>(before.begin(), before.begin() + 3));
  EXPECT_EQ(kv.NumFreeBlocks(), 7);
  kv.Truncate(1, 1);  // registered full blocks are kept
  EXPECT_EQ(Table(kv, 1), std::vector<int32_t>(before.begin(), before.begin() + 2));
  EXPECT_EQ(kv.NumFreeBlocks(), 8);
  // The freed block is handed out again first.
  ASSERT_TRUE(kv.Allocate(2, 1));
  EXPECT_EQ(Table(kv, 2), std::vector<int32_t>{before[2]});
  kv.Truncate(3, 4);  // unknown: no-op
  kv.Free(1);
  kv.Free(2);
  EXPECT_DOUBLE_EQ(kv.Usage(), 0.0);
}

}  // namespace
}  // namespace exl3::engine
