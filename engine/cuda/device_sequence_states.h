// The per-sequence recurrent state of a model's recurrent layers (Qwen3-Next's gated DeltaNet,
// GLM-5.3-Flash's KDA, Qwen4-Exp's PLE conv inputs) in device memory: the GPU counterpart of
// engine/cpu/sequence_state.h's SequenceStateStore, with the same slots, the same copies per slot and
// the same bookkeeping (SequenceStateSlots): a step reads each chunk's current copy and writes
// others, and only CommitStep (once the whole step has succeeded) makes the written copies the
// slot's, so a failed step leaves every state as it was. A chunk at position 0 starts from zeros
// (its current copy is cleared on the stream by BeginStep); a later chunk must continue exactly
// what its slot holds (else BeginStep refuses it).
//
//   EXL3_ASSIGN_OR_RETURN(auto states, DeviceSequenceStates::Create(floats_per_layer, 64));
//   EXL3_RETURN_IF_ERROR(states->BeginStep(batch, stream));
//   // the kernels read row ReadRow(slot), write row WriteRow(slot)
//   (engine/cuda/deltanet_kernels.h) states->CommitStep(batch);
//
// Speculative decoding (max_kept_states = 1 + K): a verify chunk keeps the state after each of its
// last NumKeptStates(slot) tokens, kept state k in row KeptRow(slot, k) (the last is WriteRow), and
// the sequence's next chunk continues the one its start position names, as on the CPU
// (engine/cpu/sequence_state.h). Without it a slot has the two copies of old; the extra copies are
// allocated only where a chunk may keep more than one state.
//
// Memory: rows of row_floats() floats (one copy of one slot: every layer's state, layer l at
// layer_offset(l)); row slot * num_copies() + copy, then two spare rows for a decode graph's
// padding rows, which read padding_read_row() (zeros, never written) and write
// padding_write_row() (never read).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/cuda/device_array.h"
#include "engine/core/model_runner.h"
#include "engine/cpu/sequence_state.h"

namespace exl3::engine::cuda {

class DeviceSequenceStates {
 public:
  // RESOURCE_EXHAUSTED when the device memory cannot be had. Every row starts zeroed.
  // `max_kept_states` >= 1: the most states one chunk keeps (KvCacheShape::max_logit_rows_per_chunk);
  // each slot has one copy more.
  static absl::StatusOr<std::unique_ptr<DeviceSequenceStates>> Create(
      std::vector<int64_t> floats_per_layer, int num_slots, int max_kept_states = 1);

  // Checks the step's chunks against their slots (SequenceStateSlots::BeginStep) and queues the
  // clearing of the fresh slots' current rows on `stream`.
  absl::Status BeginStep(const StepBatch& batch, StreamHandle stream);
  void CommitStep(const StepBatch& batch) { slots_.CommitStep(batch); }

  int num_slots() const { return slots_.num_slots(); }
  int num_copies() const { return slots_.num_copies(); }
  // The row of the slot's copy 0 (its copies are rows SlotRow .. SlotRow + num_copies() - 1).
  int32_t SlotRow(int slot) const { return slot * num_copies(); }
  int32_t ReadRow(int slot) const { return SlotRow(slot) + slots_.CurrentCopy(slot); }
  // This step's chunk in `slot` keeps NumKeptStates(slot) states (1 but for a verify chunk): kept
  // state k in KeptRow(slot, k), the state after the chunk's last token in WriteRow(slot).
  int NumKeptStates(int slot) const { return slots_.NumKeptStates(slot); }
  int32_t KeptRow(int slot, int k) const { return SlotRow(slot) + slots_.KeptCopy(slot, k); }
  int32_t WriteRow(int slot) const { return KeptRow(slot, NumKeptStates(slot) - 1); }
  int32_t padding_read_row() const { return num_slots() * num_copies(); }
  int32_t padding_write_row() const { return padding_read_row() + 1; }
  int64_t row_floats() const { return layout_.floats; }
  // Layer l's part of row 0 (RecurrentChunks::states).
  float* layer(int l) const { return data_.get() + layout_.layer_offset[l]; }

 private:
  DeviceSequenceStates(std::vector<int64_t> floats_per_layer, int num_slots, int max_kept_states);

  StateCopyLayout layout_;  // a row: one copy of a slot
  SequenceStateSlots slots_;
  DeviceArray<float> data_;
};

}  // namespace exl3::engine::cuda
