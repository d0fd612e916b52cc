// The per-sequence recurrent state of a model's recurrent layers (Qwen3-Next's gated DeltaNet) in
// device memory: the GPU counterpart of engine/sequence_state.h's SequenceStateStore, with the
// same slots, the same two copies per slot and the same bookkeeping (SequenceStateSlots): a step
// reads each chunk's current copy and writes the other, and only CommitStep (once the whole step
// has succeeded) makes the written copies current, so a failed step leaves every state as it was.
// A chunk at position 0 starts from zeros (its current copy is cleared on the stream by
// BeginStep); a later chunk must continue exactly what its slot holds (else BeginStep refuses it).
//
//   EXL3_ASSIGN_OR_RETURN(auto states, DeviceSequenceStates::Create(floats_per_layer, 64));
//   EXL3_RETURN_IF_ERROR(states->BeginStep(batch, stream));
//   // the kernels read row ReadRow(slot), write row WriteRow(slot)
//   (engine/cuda/deltanet_kernels.h) states->CommitStep(batch);
//
// Memory: rows of row_floats() floats (one copy of one slot: every layer's state, layer l at
// layer_offset(l)); row slot * 2 + copy, then two spare rows for a decode graph's padding rows,
// which read kPaddingRead (zeros, never written) and write kPaddingWrite (never read).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/cuda/device_array.h"
#include "engine/model_runner.h"
#include "engine/sequence_state.h"

namespace exl3::engine::cuda {

class DeviceSequenceStates {
 public:
  static constexpr int kCopies = 2;

  // RESOURCE_EXHAUSTED when the device memory cannot be had. Every row starts zeroed.
  static absl::StatusOr<std::unique_ptr<DeviceSequenceStates>> Create(
      std::vector<int64_t> floats_per_layer, int num_slots);

  // Checks the step's chunks against their slots (SequenceStateSlots::BeginStep) and queues the
  // clearing of the fresh slots' current rows on `stream`.
  absl::Status BeginStep(const StepBatch& batch, StreamHandle stream);
  void CommitStep(const StepBatch& batch) { slots_.CommitStep(batch); }

  int num_slots() const { return slots_.num_slots(); }
  int32_t ReadRow(int slot) const { return slot * kCopies + slots_.CurrentCopy(slot); }
  int32_t WriteRow(int slot) const { return slot * kCopies + 1 - slots_.CurrentCopy(slot); }
  int32_t padding_read_row() const { return num_slots() * kCopies; }
  int32_t padding_write_row() const { return num_slots() * kCopies + 1; }
  int64_t row_floats() const { return row_floats_; }
  // Layer l's part of row 0 (RecurrentChunks::states).
  float* layer(int l) const { return data_.get() + layer_offset_[l]; }

 private:
  DeviceSequenceStates(std::vector<int64_t> floats_per_layer, int num_slots);

  std::vector<int64_t> layer_offset_;
  int64_t row_floats_ = 0;
  SequenceStateSlots slots_;
  DeviceArray<float> data_;
};

}  // namespace exl3::engine::cuda
