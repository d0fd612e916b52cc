#include "engine/cpu/sequence_state.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace exl3::engine {

int KeptStatesOf(const SequenceChunk& c) {
  return c.wants_logits && c.logit_rows_use == LogitRowsUse::kNextTokens ? c.num_logit_rows : 1;
}

absl::StatusOr<std::vector<int>> SequenceStateSlots::BeginStep(const StepBatch& batch) {
  std::vector<int> fresh;
  std::vector<bool> seen(slots_.size(), false);
  for (const SequenceChunk& c : batch.chunks) {
    if (c.state_slot < 0 || c.state_slot >= num_slots())
      return absl::InternalError(absl::StrCat("sequence ", c.sequence_id, ": state slot ",
                                              c.state_slot, " outside [0, ", num_slots(), ")"));
    if (seen[c.state_slot])
      return absl::InternalError(absl::StrCat("state slot ", c.state_slot,
                                              " is given to two chunks of one step"));
    seen[c.state_slot] = true;
    const int kept = KeptStatesOf(c);
    if (kept < 1 || (c.wants_logits && kept > static_cast<int>(c.tokens.size())) || kept > num_copies_ - 1)
      return absl::InternalError(absl::StrCat(
          "sequence ", c.sequence_id, ": a chunk of ", c.tokens.size(), " tokens wanting ", kept,
          " logit rows, for state slots that keep at most ", num_copies_ - 1,
          " states per chunk (KvCacheShape::max_logit_rows_per_chunk)"));
    if (c.start_position == 0) {
      fresh.push_back(c.state_slot);
      continue;
    }
    const std::optional<Contents>& held = slots_[c.state_slot].contents;
    if (!held.has_value() || held->sequence_id != c.sequence_id || c.start_position < held->first_length ||
        c.start_position >= held->first_length + held->num_lengths()) {
      const std::string holds =
          !held.has_value() ? std::string("no state")
          : held->num_lengths() == 1
              ? absl::StrCat("sequence ", held->sequence_id, " up to position ", held->first_length)
              : absl::StrCat("sequence ", held->sequence_id, " up to positions ", held->first_length,
                             " to ", held->first_length + held->num_lengths() - 1);
      return absl::FailedPreconditionError(absl::StrCat(
          "sequence ", c.sequence_id, " resumes at position ", c.start_position,
          ", but its state slot ", c.state_slot, " holds ", holds,
          " (a recurrent state is rebuilt only from position 0, never from cached KV blocks)"));
    }
  }
  for (const SequenceChunk& c : batch.chunks) {
    Slot& s = slots_[c.state_slot];
    s.num_kept = KeptStatesOf(c);
    if (c.start_position == 0) {
      s.contents.reset();
      continue;
    }
    // The slot now holds only the length this chunk continues: the step writes over its other
    // copies, and a step that fails leaves this one intact for its retry.
    Contents& held = *s.contents;
    s.read_copy = held.copies[c.start_position - held.first_length];
    held = Contents{c.sequence_id, c.start_position, {s.read_copy}};
  }
  return fresh;
}

void SequenceStateSlots::CommitStep(const StepBatch& batch) {
  for (const SequenceChunk& c : batch.chunks) {
    Slot& s = slots_[c.state_slot];
    const int end = c.start_position + static_cast<int>(c.tokens.size());
    Contents held{c.sequence_id, end - s.num_kept + 1, {}};
    for (int k = 0; k < s.num_kept; ++k) held.copies.push_back(KeptCopy(c.state_slot, k));
    // The next step's BeginStep picks the copy it reads; until then the last length's stands as
    // current (what a store on another device reads between steps).
    s.read_copy = held.copies.back();
    s.contents = std::move(held);
  }
}

StateCopyLayout::StateCopyLayout(const std::vector<int64_t>& floats_per_layer) {
  for (int64_t n : floats_per_layer) {
    layer_offset.push_back(floats);
    floats += n;
  }
}

absl::Status CheckStateStoreShape(int num_slots, int max_kept_states) {
  if (num_slots < 1)
    return absl::InvalidArgumentError(absl::StrCat("a state store of ", num_slots, " slots"));
  if (max_kept_states < 1)
    return absl::InvalidArgumentError(absl::StrCat("a state store keeping ", max_kept_states,
                                                   " states per chunk"));
  return absl::OkStatus();
}

absl::Status StateStoreTooLarge(const char* store, int num_slots, int copies, int64_t copy_floats,
                                int max_kept_states) {
  return absl::ResourceExhaustedError(absl::StrCat(
      store, " (", num_slots, " slots x ", copies, " copies x ", copy_floats * 4,
      " bytes) cannot be allocated; lower --max-num-seqs",
      max_kept_states > 1 ? " or --num-speculative-tokens (each draft position keeps a copy)" : ""));
}

SequenceStateStore::SequenceStateStore(std::vector<int64_t> floats_per_layer, int num_slots,
                                       int max_kept_states)
    : floats_per_layer_(std::move(floats_per_layer)),
      layout_(floats_per_layer_),
      slots_(num_slots, max_kept_states) {}

absl::StatusOr<std::unique_ptr<SequenceStateStore>> SequenceStateStore::Create(
    std::vector<int64_t> floats_per_layer, int num_slots, int max_kept_states) {
  EXL3_RETURN_IF_ERROR(CheckStateStoreShape(num_slots, max_kept_states));
  std::unique_ptr<SequenceStateStore> s(
      new SequenceStateStore(std::move(floats_per_layer), num_slots, max_kept_states));
  const int copies = s->slots_.num_copies();
  const size_t n = static_cast<size_t>(num_slots) * copies * s->layout_.floats;
  // Zeroed pages from the system: a slot's memory is touched only once a sequence uses it.
  s->data_.reset(static_cast<float*>(std::calloc(std::max<size_t>(n, 1), sizeof(float))));
  if (s->data_ == nullptr)
    return StateStoreTooLarge("the per-sequence state store", num_slots, copies, s->layout_.floats,
                              max_kept_states);
  return s;
}

absl::Status SequenceStateStore::BeginStep(const StepBatch& batch) {
  absl::StatusOr<std::vector<int>> fresh = slots_.BeginStep(batch);
  if (!fresh.ok()) return fresh.status();
  for (int slot : *fresh) {
    float* current = data_.get() + CopyOffset(slot, slots_.CurrentCopy(slot));
    std::fill_n(current, layout_.floats, 0.0f);
  }
  return absl::OkStatus();
}

}  // namespace exl3::engine
