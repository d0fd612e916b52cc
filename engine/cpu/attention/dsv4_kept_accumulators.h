// DeepSeek-V4's compressors after each draft position of a verify chunk (speculative decoding),
// one compressed layer's, per state slot (SequenceChunk::state_slot): what lets a rejected draft
// be taken out of the running softmax its block area folded it into.
//
// A compressed layer's block area holds its compressors' accumulators after the block's last
// folded position (engine/config/dsv4_config.h); a running softmax cannot be unfolded exactly. So a
// verify chunk whose last R tokens want logits keeps, besides that live state, the accumulators
// after each of its rows but the last (the positions a later chunk may resume after: the last
// sampled token and each draft but the last), tagged with the sequence, the fold count they
// stand for and the cache block they belong to. The sequence's next chunk starts at the length the scheduler kept; when that lies
// before what its block has folded, the layer restores the kept accumulators for exactly that
// length and folds on from there, so the block ends as if the rejected drafts had never run.
// Positions that end a block need nothing kept: the next block starts from that block's full
// state.
//
//   store.Allocate(num_slots, /*max_kept=*/K, accumulator_floats);  // once, with speculation
//   const float* a = store.Find(slot, sequence_id, position, block);  // after position - 1, or null
//   store.Begin(slot, sequence_id);                      // a chunk folds: its kept states replace any
//   store.Keep(slot, position + 1, block, accumulators);  // after a row that may be resumed from
//
// Any chunk that folds into the layer replaces what its slot kept (a plain chunk keeps nothing),
// so a kept state never outlives a later fold of its sequence: Find never returns accumulators
// whose positions have been folded again since (with other tokens). The block tag covers a
// sequence preempted right after a verify step and resumed from another sequence's cached block:
// what its slot still kept then belongs to blocks it no longer has. A chunk that finds nothing
// for a position its block has already folded is the same step run again after a failure
// (engine/core/engine.h), and skips the positions folded by its first run as before.
//
// Without speculative decoding (max_kept 0) nothing is allocated and every call is a no-op.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "absl/status/status.h"

namespace exl3::engine {

class Dsv4KeptAccumulators {
 public:
  // `max_kept`: the most states one chunk keeps (its logit rows - 1); 0 turns keeping off.
  // RESOURCE_EXHAUSTED when the memory cannot be had (zeroed pages from the system, touched only
  // by slots that verify).
  absl::Status Allocate(int num_slots, int max_kept, int accumulator_floats);
  bool enabled() const { return max_kept_ > 0; }
  int max_kept() const { return max_kept_; }
  int num_slots() const { return static_cast<int>(slots_.size()); }

  // The accumulators after `position - 1` (fold count `position`, in cache block `block`) that
  // `sequence_id`'s last folding chunk kept in `slot`; null if none.
  const float* Find(int slot, int64_t sequence_id, int position, int32_t block) const;
  // A chunk of `sequence_id` folds: the slot forgets what it kept.
  void Begin(int slot, int64_t sequence_id);
  // Keeps `accumulators` ([accumulator_floats]) as the state after position `count - 1`, whose
  // block area is cache block `block`'s.
  void Keep(int slot, int count, int32_t block, const float* accumulators);

 private:
  struct Slot {
    int64_t sequence_id = 0;
    struct Kept {
      int count = 0;      // positions folded
      int32_t block = 0;  // the cache block they are folded in
    };
    std::vector<Kept> kept;  // in the order kept (at most max_kept)
  };
  float* Data(int slot, int k) const {
    return data_.get() + (static_cast<size_t>(slot) * max_kept_ + k) * accumulator_floats_;
  }

  std::vector<Slot> slots_;
  int max_kept_ = 0;
  int accumulator_floats_ = 0;
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> data_;
};

}  // namespace exl3::engine
