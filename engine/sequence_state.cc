#include "engine/sequence_state.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace exl3::engine {

absl::StatusOr<std::vector<int64_t>> StateFloatsPerLayer(const ModelConfig& cfg, int num_slots) {
  if (num_slots <= 0)
    return absl::InvalidArgumentError(absl::StrCat(
        cfg.architecture(), " keeps a recurrent state per sequence: the cache needs state "
                            "slots (num_sequence_slots ", num_slots, ")"));
  std::vector<int64_t> floats(cfg.num_layers);
  for (int l = 0; l < cfg.num_layers; ++l) floats[l] = cfg.StateFloats(l);
  return floats;
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
    if (c.start_position == 0) {
      fresh.push_back(c.state_slot);
      continue;
    }
    const std::optional<Contents>& held = slots_[c.state_slot].contents;
    if (!held.has_value() || held->sequence_id != c.sequence_id ||
        held->num_tokens != c.start_position) {
      const std::string holds =
          held.has_value() ? absl::StrCat("sequence ", held->sequence_id, " up to position ",
                                          held->num_tokens)
                           : std::string("no state");
      return absl::FailedPreconditionError(absl::StrCat(
          "sequence ", c.sequence_id, " resumes at position ", c.start_position,
          ", but its state slot ", c.state_slot, " holds ", holds,
          " (a recurrent state is rebuilt only from position 0, never from cached KV blocks)"));
    }
  }
  for (int slot : fresh) slots_[slot].contents.reset();
  return fresh;
}

void SequenceStateSlots::CommitStep(const StepBatch& batch) {
  for (const SequenceChunk& c : batch.chunks) {
    Slot& s = slots_[c.state_slot];
    s.current_copy = 1 - s.current_copy;
    s.contents = Contents{c.sequence_id, c.start_position + static_cast<int>(c.tokens.size())};
  }
}

SequenceStateStore::SequenceStateStore(std::vector<int64_t> floats_per_layer, int num_slots)
    : floats_per_layer_(std::move(floats_per_layer)), slots_(num_slots) {
  for (int64_t n : floats_per_layer_) {
    layer_offset_.push_back(floats_per_copy_);
    floats_per_copy_ += n;
  }
}

absl::StatusOr<std::unique_ptr<SequenceStateStore>> SequenceStateStore::Create(
    std::vector<int64_t> floats_per_layer, int num_slots) {
  if (num_slots < 1)
    return absl::InvalidArgumentError(absl::StrCat("a state store of ", num_slots, " slots"));
  std::unique_ptr<SequenceStateStore> s(new SequenceStateStore(std::move(floats_per_layer), num_slots));
  const size_t n = static_cast<size_t>(num_slots) * kCopies * s->floats_per_copy_;
  // Zeroed pages from the system: a slot's memory is touched only once a sequence uses it.
  s->data_.reset(static_cast<float*>(std::calloc(std::max<size_t>(n, 1), sizeof(float))));
  if (s->data_ == nullptr)
    return absl::ResourceExhaustedError(absl::StrCat(
        "the per-sequence state store (", num_slots, " slots x ", kCopies, " copies x ",
        s->floats_per_copy_ * 4, " bytes) cannot be allocated; lower --max-num-seqs"));
  return s;
}

absl::Status SequenceStateStore::BeginStep(const StepBatch& batch) {
  absl::StatusOr<std::vector<int>> fresh = slots_.BeginStep(batch);
  if (!fresh.ok()) return fresh.status();
  for (int slot : *fresh) {
    float* current = data_.get() + CopyOffset(slot, slots_.CurrentCopy(slot));
    std::fill_n(current, floats_per_copy_, 0.0f);
  }
  return absl::OkStatus();
}

}  // namespace exl3::engine
