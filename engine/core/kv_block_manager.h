// Paged KV cache bookkeeping: which cache blocks each sequence owns, and a prefix cache of full
// blocks shared between sequences. No tensors here: the model runner holds the storage
// (engine/core/model_runner.h), this class only hands out block ids.
//
//   KvBlockManager kv(/*num_blocks=*/1024, /*block_size=*/16);
//   PrefixMatch hit = kv.FindCachedPrefix(tokens);                 // full blocks already computed
//   if (!kv.Allocate(id, hit.num_tokens + chunk, hit)) { /* no room: preempt someone */ }
//   ... the step runs positions [hit.num_tokens, hit.num_tokens + chunk) ...
//   kv.CacheFullBlocks(id, tokens, hit.num_tokens + chunk);        // after the step wrote them
//   kv.Allocate(id, num_tokens + 1);                               // grow by one decode token
//   kv.Truncate(id, num_tokens);                                   // give back rejected drafts' blocks
//   kv.Free(id);                                                   // finished or preempted
//
// Capacity is a fixed number of blocks of block_size tokens, decided once. Block b of a sequence's
// table holds its positions [b * block_size, (b + 1) * block_size).
//
// Prefix caching: a FULL block is named by a hash chained over (its parent block's hash, its own
// token ids), so equal hashes mean equal whole prefixes (the 64-bit hash is backed by a comparison
// of the block's own tokens and parent hash on every hit). A full block whose keys and values were
// written (CacheFullBlocks, called after the step that wrote it) is registered under its hash and
// may then be shared by any sequence with the same prefix (reference counted). Full blocks are
// never written again, so sharing needs no copy-on-write. A cached block whose last user freed it
// stays in the cache, reusable, until its storage is needed: free blocks that hold no cached
// content are handed out first, then cached ones, least recently freed first.
//
// A hit never covers a prompt's last token: the model must run at least one token to produce
// logits, so at most tokens.size() - 1 tokens, rounded down to a block, come from the cache.
#pragma once

#include <cstdint>
#include <list>
#include <span>
#include <unordered_map>
#include <vector>

namespace exl3::engine {

// Full blocks of a token sequence found in the prefix cache (FindCachedPrefix), to be passed to
// Allocate in the same scheduling pass.
struct PrefixMatch {
  std::vector<int32_t> blocks;         // cache blocks of positions [0, num_tokens)
  std::vector<uint64_t> block_hashes;  // their chained hashes
  int num_tokens = 0;                  // blocks.size() * block_size
  int num_queried_tokens = 0;          // tokens of the sequence looked up (for the hit rate)
};

struct PrefixCacheCounters {
  int64_t queried_tokens = 0;  // prompt tokens looked up when a sequence got its first blocks
  int64_t hit_tokens = 0;      // of those, the tokens served from the cache
};

class KvBlockManager {
 public:
  KvBlockManager(int num_blocks, int block_size, bool enable_prefix_caching = true);
  KvBlockManager(const KvBlockManager&) = delete;
  KvBlockManager& operator=(const KvBlockManager&) = delete;

  int num_blocks() const { return num_blocks_; }
  int block_size() const { return block_size_; }
  int BlocksForTokens(int num_tokens) const { return (num_tokens + block_size_ - 1) / block_size_; }

  // The longest run of cached full blocks that starts `tokens`, capped below the last token.
  // Changes nothing (a later Allocate takes the blocks).
  PrefixMatch FindCachedPrefix(std::span<const int32_t> tokens) const;

  // Makes the block table of `sequence_id` cover positions [0, num_tokens), adding blocks as
  // needed. A sequence without blocks starts its table with `prefix` (FindCachedPrefix of the same
  // pass, or empty). Returns false, changing nothing, when the free blocks do not suffice.
  bool Allocate(int64_t sequence_id, int num_tokens, const PrefixMatch& prefix = {});

  // Registers the sequence's full blocks within tokens[0, num_computed_tokens) in the prefix
  // cache; call once the step that wrote them has run. `tokens` is the sequence's whole history.
  void CacheFullBlocks(int64_t sequence_id, std::span<const int32_t> tokens,
                       int num_computed_tokens);

  // Releases every block of the sequence (cached ones stay reusable). No-op when it has none.
  void Free(int64_t sequence_id);
  // Releases the sequence's blocks past those covering positions [0, num_tokens) (speculative
  // decoding's rejected drafts). Blocks registered by CacheFullBlocks are kept. No-op when it
  // has none.
  void Truncate(int64_t sequence_id, int num_tokens);

  bool HasBlocks(int64_t sequence_id) const { return sequences_.contains(sequence_id); }
  // Empty when the sequence has no blocks.
  std::span<const int32_t> BlockTable(int64_t sequence_id) const;

  // Blocks that can be handed out now: never used, freed, or cached with no user.
  int NumFreeBlocks() const { return num_free_; }
  // Fraction of blocks held by at least one sequence.
  double Usage() const { return 1.0 - static_cast<double>(num_free_) / num_blocks_; }
  const PrefixCacheCounters& counters() const { return counters_; }
  // Number of blocks registered in the prefix cache (used or not).
  int NumCachedBlocks() const { return static_cast<int>(cached_blocks_.size()); }

  // The chained hash of one full block (exposed for tests).
  static uint64_t HashBlock(uint64_t parent_hash, std::span<const int32_t> block_tokens);

 private:
  struct Block {
    int ref_count = 0;
    bool cached = false;  // registered under `hash` in cached_blocks_
    uint64_t hash = 0;
    uint64_t parent_hash = 0;
    std::vector<int32_t> tokens;  // the block's token ids, while cached
    std::list<int32_t>::iterator lru_position;  // valid while cached and ref_count == 0
  };
  struct SequenceBlocks {
    std::vector<int32_t> table;
    std::vector<uint64_t> full_block_hashes;  // of table[0, full_block_hashes.size())
  };

  // Takes one free block for new content, evicting the least recently freed cached one when no
  // uncached block is free.
  int32_t TakeFreeBlock();
  // Adds a user to a block (taking it off the free lists when it had none).
  void Reference(int32_t block);
  void Release(int32_t block);

  const int num_blocks_;
  const int block_size_;
  const bool enable_prefix_caching_;
  std::vector<Block> blocks_;
  std::vector<int32_t> uncached_free_;    // free blocks without cached content (a stack)
  std::list<int32_t> cached_free_lru_;    // free cached blocks, least recently freed first
  int num_free_ = 0;                      // uncached_free_.size() + cached_free_lru_.size()
  std::unordered_map<uint64_t, int32_t> cached_blocks_;  // chained hash -> block
  std::unordered_map<int64_t, SequenceBlocks> sequences_;
  PrefixCacheCounters counters_;
};

}  // namespace exl3::engine
