// The fixed-size state a model's recurrent layers keep per sequence (Qwen3-Next's gated DeltaNet:
// its convolution's last inputs and its recurrent matrix), beside the paged KV cache: one slot per
// running sequence, the slot the scheduler hands out at admission (SequenceChunk::state_slot,
// engine/model_runner.h).
//
//   EXL3_ASSIGN_OR_RETURN(auto store, SequenceStateStore::Create(/*floats_per_layer=*/{0, 41472, 0},
//                                                               /*num_slots=*/256));
//   EXL3_RETURN_IF_ERROR(store->BeginStep(batch));  // checks each chunk's slot; fresh ones zeroed
//   const float* in = store->Current(layer, chunk.state_slot);  // the state before this step
//   float* out = store->Next(layer, chunk.state_slot);          // the layer writes the new one
//   store->CommitStep(batch);                        // once the whole step has succeeded
//
// Each slot holds two copies of its state: a step reads the current one and writes the other, and
// only CommitStep makes the written copy current. A step that fails part way therefore leaves
// every state as it was, and its chunks can run again (the engine retries a failed step's chunks
// one by one, engine/engine.h), at no cost in copies.
//
// A chunk at position 0 starts its sequence's state from zeros (a new sequence, or a preempted one
// recomputed from its prompt). A later chunk must continue the state its slot holds: the same
// sequence, exactly its positions before the chunk. Anything else (e.g. a prefix-cache hit, which
// restores KV blocks but no recurrent state) is refused with an error naming the slot.
//
// SequenceStateSlots is that bookkeeping alone, without memory, for a store on another device.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/model_config.h"
#include "engine/model_runner.h"

namespace exl3::engine {

class SequenceStateSlots {
 public:
  explicit SequenceStateSlots(int num_slots) : slots_(num_slots) {}

  int num_slots() const { return static_cast<int>(slots_.size()); }
  // Checks the step's chunks against what their slots hold (see above). Returns the slots whose
  // state starts afresh in this step (their current copy must read as zeros); they hold nothing
  // from now until CommitStep.
  absl::StatusOr<std::vector<int>> BeginStep(const StepBatch& batch);
  // The copy (0 or 1) a step reads in `slot`; it writes the other.
  int CurrentCopy(int slot) const { return slots_[slot].current_copy; }
  // Makes each chunk's written copy current: its slot now holds its sequence up to the chunk's end.
  void CommitStep(const StepBatch& batch);

 private:
  struct Contents {
    int64_t sequence_id = 0;
    int num_tokens = 0;  // positions [0, num_tokens) are folded into the state
  };
  struct Slot {
    int current_copy = 0;
    std::optional<Contents> contents;  // unset: holds no sequence's state
  };
  std::vector<Slot> slots_;
};

// Per layer, the floats of one sequence's recurrent state (cfg.StateFloats; 0 for layers without),
// for a store of `num_slots` slots, as both engines size theirs: INVALID_ARGUMENT when the model
// has recurrent layers and the cache gives no slots.
absl::StatusOr<std::vector<int64_t>> StateFloatsPerLayer(const ModelConfig& cfg, int num_slots);

// The state on the CPU: per slot, two copies of every layer's floats (layers without state: 0).
// Allocated zeroed by the system (calloc), so slots that never run take no memory.
class SequenceStateStore {
 public:
  static constexpr int kCopies = 2;

  // RESOURCE_EXHAUSTED when the memory cannot be had.
  static absl::StatusOr<std::unique_ptr<SequenceStateStore>> Create(
      std::vector<int64_t> floats_per_layer, int num_slots);

  absl::Status BeginStep(const StepBatch& batch);
  void CommitStep(const StepBatch& batch) { slots_.CommitStep(batch); }
  int64_t floats(int layer) const { return floats_per_layer_[layer]; }
  const float* Current(int layer, int slot) const {
    return data_.get() + Offset(layer, slot, slots_.CurrentCopy(slot));
  }
  float* Next(int layer, int slot) {
    return data_.get() + Offset(layer, slot, 1 - slots_.CurrentCopy(slot));
  }

 private:
  SequenceStateStore(std::vector<int64_t> floats_per_layer, int num_slots);
  size_t CopyOffset(int slot, int copy) const {
    return (static_cast<size_t>(slot) * kCopies + copy) * floats_per_copy_;
  }
  size_t Offset(int layer, int slot, int copy) const {
    return CopyOffset(slot, copy) + layer_offset_[layer];
  }

  std::vector<int64_t> floats_per_layer_;
  std::vector<int64_t> layer_offset_;  // first float of each layer within one copy
  int64_t floats_per_copy_ = 0;
  SequenceStateSlots slots_;
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> data_;
};

}  // namespace exl3::engine
