#include "engine/cuda/dsv4_kept_row_slots.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "engine/cpu/sequence_state.h"

namespace exl3::engine::cuda {

absl::Status Dsv4KeptRowSlots::Allocate(int num_slots, int max_kept) {
  slots_.clear();
  planned_.clear();
  max_kept_ = 0;
  if (max_kept <= 0) return absl::OkStatus();
  if (num_slots < 1)
    return absl::InvalidArgumentError(absl::StrCat(
        "DeepSeek-V4 verifies drafts per state slot: the cache needs state slots (num_sequence_slots ",
        num_slots, ")"));
  slots_.resize(num_slots);
  max_kept_ = max_kept;
  return absl::OkStatus();
}

int32_t Dsv4KeptRowSlots::FindRow(int slot, int64_t sequence_id, int count, int32_t block) const {
  if (!enabled()) return -1;
  const Slot& s = slots_[slot];
  if (s.sequence_id != sequence_id) return -1;
  for (const Kept& k : s.kept)
    if (k.count == count && k.block == block) return k.row;
  return -1;
}

absl::Status Dsv4KeptRowSlots::PlanStep(const StepTokens& tokens, int block_size, std::vector<int32_t>* facts) {
  planned_.clear();
  const std::vector<SequenceChunk>& chunks = tokens.batch->chunks;
  for (const SequenceChunk& c : chunks) {
    const int kept_states = KeptStatesOf(c) - 1;  // besides the live state in the block area
    const bool verify = kept_states > 0;
    if (!verify && !enabled()) continue;  // plain decoding: nothing kept, no slot read
    if (kept_states > max_kept_ || c.state_slot < 0 || c.state_slot >= num_slots())
      return absl::InternalError(absl::StrCat(
          "sequence ", c.sequence_id, ": a ", verify ? "verify " : "", "chunk of ", c.num_logit_rows,
          " rows in state slot ", c.state_slot, ", for a cache of ", num_slots(), " slots keeping at most ",
          max_kept_, " compressor states per verify chunk (KvCacheShape::max_logit_rows_per_chunk - 1)"));
  }
  if (!enabled()) return absl::OkStatus();
  const int B = block_size, T = tokens.num_tokens;
  int t0 = 0;
  for (size_t ci = 0; ci < chunks.size(); ++ci) {
    const SequenceChunk& c = chunks[ci];
    int t1 = t0;
    while (t1 < T && tokens.chunk_of[t1] == static_cast<int32_t>(ci)) ++t1;
    if (t1 == t0) continue;  // a chunk without tokens is not in the step's fold
    const int first = tokens.positions[t0];
    const int32_t first_row = c.state_slot * (max_kept_ + 1);
    // The state before the chunk's first position, where a verify chunk of the sequence kept it.
    const int32_t restore =
        first % B == 0 ? -1 : FindRow(c.state_slot, c.sequence_id, first, c.block_table[first / B]);
    const int rows = KeptStatesOf(c);
    const int keep_from = rows > 1 ? std::max(t0, t1 - rows) : T;
    facts->insert(facts->end(), {restore, keep_from, first_row});
    // What the fold kernel keeps: after each row but the last, unless the row ends its block; kept
    // state k in the slot's k-th row that is not the one restored from.
    Planned p;
    p.slot = c.state_slot;
    p.contents.sequence_id = c.sequence_id;
    for (int t = keep_from; t + 1 < t1; ++t) {
      const int pos = tokens.positions[t];
      if (pos % B + 1 == B) continue;
      int32_t row = first_row + (t - keep_from);
      if (restore >= 0 && row >= restore) ++row;
      p.contents.kept.push_back({pos + 1, c.block_table[pos / B], row});
    }
    planned_.push_back(std::move(p));
    t0 = t1;
  }
  return absl::OkStatus();
}

void Dsv4KeptRowSlots::CommitStep() {
  for (Planned& p : planned_) slots_[p.slot] = std::move(p.contents);
  planned_.clear();
}

}  // namespace exl3::engine::cuda
