#include "engine/cuda/recurrent_layer_states.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/cpu/sequence_state.h"

namespace exl3::engine::cuda {

absl::Status RecurrentLayerStates::Allocate(const ModelConfig& cfg, int num_slots, int max_kept_states) {
  states_.reset();
  EXL3_ASSIGN_OR_RETURN(std::vector<int64_t> floats, StateFloatsPerLayer(cfg, num_slots));
  EXL3_ASSIGN_OR_RETURN(states_, DeviceSequenceStates::Create(std::move(floats), num_slots, max_kept_states));
  return absl::OkStatus();
}

int64_t RecurrentLayerStates::StateOffset(const ModelConfig& cfg, int layer) {
  int64_t offset = 0;
  for (int l = 0; l < layer; ++l) offset += cfg.StateFloats(l);
  return offset;
}

absl::Status RecurrentLayerStates::BeginStep(const StepBatch& batch, StreamHandle stream) {
  if (states_ == nullptr)
    return absl::FailedPreconditionError("recurrent layers: a step before the state store is allocated");
  return states_->BeginStep(batch, stream);
}

void RecurrentLayerStates::CommitStep(const StepBatch& batch) { states_->CommitStep(batch); }

absl::Status RecurrentLayerStates::Pack(const StepTokens& tokens, int rows, std::vector<int32_t>* facts) {
  if (states_ == nullptr)
    return absl::FailedPreconditionError("recurrent layers: a step before the state store is allocated");
  if (rows < tokens.num_tokens)
    return absl::InvalidArgumentError(absl::StrCat("recurrent layers: a step of ", tokens.num_tokens,
                                                   " tokens packed in ", rows, " rows"));
  std::vector<int32_t> chunk_of(rows), table;
  chunk_first_.clear();
  max_kept_states_ = 1;
  for (int t = 0; t < rows; ++t) {
    const bool real = t < tokens.num_tokens;
    if (!real || t == 0 || tokens.chunk_of[t] != tokens.chunk_of[t - 1]) {
      int32_t read = states_->padding_read_row(), write = states_->padding_write_row(), kept = 1,
              slot_row = states_->padding_read_row();
      if (real) {
        const int slot = tokens.batch->chunks[tokens.chunk_of[t]].state_slot;
        read = states_->ReadRow(slot);
        write = states_->WriteRow(slot);
        kept = states_->NumKeptStates(slot);
        slot_row = states_->SlotRow(slot);
        max_kept_states_ = std::max(max_kept_states_, static_cast<int>(kept));
      }
      chunk_first_.push_back(t);
      table.insert(table.end(), {t, 0, read, write, kept, slot_row});
    }
    table[table.size() - kRecurrentChunkInts + 1] += 1;
    chunk_of[t] = static_cast<int32_t>(chunk_first_.size()) - 1;
  }
  facts_at_ = facts->size();
  facts->insert(facts->end(), chunk_of.begin(), chunk_of.end());
  facts->insert(facts->end(), table.begin(), table.end());
  return absl::OkStatus();
}

void RecurrentLayerStates::Bind(int rows, const int32_t* device_facts) {
  chunk_of_ = device_facts + facts_at_;
  table_ = chunk_of_ + rows;
}

RecurrentStep RecurrentLayerStates::StepFor(int first, int n) const {
  RecurrentStep step;
  step.chunks.chunk_of = chunk_of_;
  step.chunks.table = table_;
  step.chunks.row_floats = states_->row_floats();
  step.chunks.max_kept_states = max_kept_states_;
  step.store = states_->layer(0);
  const auto begin = std::lower_bound(chunk_first_.begin(), chunk_first_.end(), first);
  const auto end = std::lower_bound(chunk_first_.begin(), chunk_first_.end(), first + n);
  step.first_chunk = static_cast<int>(begin - chunk_first_.begin());
  step.num_chunks = static_cast<int>(end - begin);
  return step;
}

}  // namespace exl3::engine::cuda
