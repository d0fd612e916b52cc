#include "engine/core/kv_block_manager.h"

#include <algorithm>
#include <cassert>

#include "base/mix64.h"

namespace exl3::engine {
namespace {

// The parent hash of a sequence's first block.
constexpr uint64_t kRootParentHash = 0x6a09e667f3bcc909ull;

}  // namespace

KvBlockManager::KvBlockManager(int num_blocks, int block_size, bool enable_prefix_caching)
    : num_blocks_(num_blocks),
      block_size_(block_size),
      enable_prefix_caching_(enable_prefix_caching),
      blocks_(num_blocks),
      num_free_(num_blocks) {
  uncached_free_.reserve(num_blocks);
  // A stack: block 0 is handed out first.
  for (int b = num_blocks - 1; b >= 0; --b) uncached_free_.push_back(b);
}

uint64_t KvBlockManager::HashBlock(uint64_t parent_hash, std::span<const int32_t> block_tokens) {
  uint64_t h = Mix64(parent_hash + kGoldenGamma);
  for (int32_t t : block_tokens) {
    h = Mix64(h ^ (static_cast<uint64_t>(static_cast<uint32_t>(t)) + kGoldenGamma));
  }
  return h;
}

PrefixMatch KvBlockManager::FindCachedPrefix(std::span<const int32_t> tokens) const {
  PrefixMatch match;
  match.num_queried_tokens = static_cast<int>(tokens.size());
  if (!enable_prefix_caching_ || tokens.empty()) return match;
  // At least the last token must run, to give logits.
  const int max_blocks = static_cast<int>(tokens.size() - 1) / block_size_;
  uint64_t parent = kRootParentHash;
  for (int i = 0; i < max_blocks; ++i) {
    std::span<const int32_t> block_tokens = tokens.subspan(i * block_size_, block_size_);
    const uint64_t h = HashBlock(parent, block_tokens);
    auto it = cached_blocks_.find(h);
    if (it == cached_blocks_.end()) break;
    const Block& block = blocks_[it->second];
    if (block.parent_hash != parent ||
        !std::equal(block.tokens.begin(), block.tokens.end(), block_tokens.begin(),
                    block_tokens.end())) {
      break;  // a hash collision: treat as a miss
    }
    match.blocks.push_back(it->second);
    match.block_hashes.push_back(h);
    parent = h;
  }
  match.num_tokens = static_cast<int>(match.blocks.size()) * block_size_;
  return match;
}

bool KvBlockManager::Allocate(int64_t sequence_id, int num_tokens, const PrefixMatch& prefix) {
  const int needed_blocks = BlocksForTokens(num_tokens);
  auto it = sequences_.find(sequence_id);
  if (it != sequences_.end()) {
    SequenceBlocks& seq = it->second;
    const int new_blocks = needed_blocks - static_cast<int>(seq.table.size());
    if (new_blocks <= 0) return true;
    if (new_blocks > num_free_) return false;
    for (int i = 0; i < new_blocks; ++i) seq.table.push_back(TakeFreeBlock());
    return true;
  }

  // A new sequence: the cached prefix first. Hit blocks nobody uses leave the free pool too.
  int free_hits = 0;
  for (int32_t b : prefix.blocks) {
    assert(blocks_[b].cached);  // the match must come from this pass, before any other Allocate
    if (blocks_[b].ref_count == 0) ++free_hits;
  }
  const int new_blocks = std::max(0, needed_blocks - static_cast<int>(prefix.blocks.size()));
  if (new_blocks > num_free_ - free_hits) return false;

  SequenceBlocks& seq = sequences_[sequence_id];
  seq.table.reserve(needed_blocks);
  for (int32_t b : prefix.blocks) {
    Reference(b);
    seq.table.push_back(b);
  }
  seq.full_block_hashes = prefix.block_hashes;
  for (int i = 0; i < new_blocks; ++i) seq.table.push_back(TakeFreeBlock());
  counters_.queried_tokens += prefix.num_queried_tokens;
  counters_.hit_tokens += prefix.num_tokens;
  return true;
}

void KvBlockManager::CacheFullBlocks(int64_t sequence_id, std::span<const int32_t> tokens,
                                     int num_computed_tokens) {
  if (!enable_prefix_caching_) return;
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end()) return;
  SequenceBlocks& seq = it->second;
  const int full_blocks = std::min<int>(num_computed_tokens / block_size_, seq.table.size());
  for (int i = static_cast<int>(seq.full_block_hashes.size()); i < full_blocks; ++i) {
    const uint64_t parent = i == 0 ? kRootParentHash : seq.full_block_hashes[i - 1];
    std::span<const int32_t> block_tokens = tokens.subspan(i * block_size_, block_size_);
    const uint64_t h = HashBlock(parent, block_tokens);
    seq.full_block_hashes.push_back(h);
    // Another sequence computed the same block first: this copy stays private to its sequence.
    if (cached_blocks_.contains(h)) continue;
    Block& block = blocks_[seq.table[i]];
    block.cached = true;
    block.hash = h;
    block.parent_hash = parent;
    block.tokens.assign(block_tokens.begin(), block_tokens.end());
    cached_blocks_.emplace(h, seq.table[i]);
  }
}

void KvBlockManager::Free(int64_t sequence_id) {
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end()) return;
  // Last block first, so that a sequence's deepest cached blocks are evicted before its first
  // ones (which more sequences are likely to share).
  const std::vector<int32_t>& table = it->second.table;
  for (auto b = table.rbegin(); b != table.rend(); ++b) Release(*b);
  sequences_.erase(it);
}

void KvBlockManager::Truncate(int64_t sequence_id, int num_tokens) {
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end()) return;
  SequenceBlocks& seq = it->second;
  const size_t keep = std::max<size_t>(BlocksForTokens(num_tokens), seq.full_block_hashes.size());
  while (seq.table.size() > keep) {
    Release(seq.table.back());
    seq.table.pop_back();
  }
}

std::span<const int32_t> KvBlockManager::BlockTable(int64_t sequence_id) const {
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end()) return {};
  return it->second.table;
}

int32_t KvBlockManager::TakeFreeBlock() {
  assert(num_free_ > 0);
  int32_t b;
  if (!uncached_free_.empty()) {
    b = uncached_free_.back();
    uncached_free_.pop_back();
  } else {
    b = cached_free_lru_.front();
    cached_free_lru_.pop_front();
    Block& evicted = blocks_[b];
    cached_blocks_.erase(evicted.hash);
    evicted.cached = false;
    evicted.tokens.clear();
  }
  --num_free_;
  blocks_[b].ref_count = 1;
  return b;
}

void KvBlockManager::Reference(int32_t b) {
  Block& block = blocks_[b];
  if (block.ref_count++ == 0) {
    cached_free_lru_.erase(block.lru_position);
    --num_free_;
  }
}

void KvBlockManager::Release(int32_t b) {
  Block& block = blocks_[b];
  assert(block.ref_count > 0);
  if (--block.ref_count > 0) return;
  if (block.cached) {
    block.lru_position = cached_free_lru_.insert(cached_free_lru_.end(), b);
  } else {
    uncached_free_.push_back(b);
  }
  ++num_free_;
}

}  // namespace exl3::engine
