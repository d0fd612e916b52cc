// The fixed-size state a model's recurrent layers keep per sequence (Qwen3-Next's gated DeltaNet:
// its convolution's last inputs and its recurrent matrix), beside the paged KV cache: one slot per
// running sequence, the slot the scheduler hands out at admission (SequenceChunk::state_slot,
// engine/core/model_runner.h).
//
//   EXL3_ASSIGN_OR_RETURN(auto store, SequenceStateStore::Create(/*floats_per_layer=*/{0, 41472, 0},
//                                                               /*num_slots=*/256));
//   EXL3_RETURN_IF_ERROR(store->BeginStep(batch));  // checks each chunk's slot; fresh ones zeroed
//   const float* in = store->Current(layer, chunk.state_slot);  // the state before this step
//   float* out = store->Next(layer, chunk.state_slot);          // the layer writes the new one
//   store->CommitStep(batch);                        // once the whole step has succeeded
//
// Each slot holds several copies of its state: a step reads one (the current copy) and writes
// others, and only CommitStep makes the written copies the slot's. A step that fails part way
// therefore leaves every state as it was, and its chunks can run again (the engine retries a
// failed step's chunks one by one, engine/core/engine.h), at no cost in copies.
//
// Verify chunks (speculative decoding): a chunk whose last R tokens want logits
// (SequenceChunk::num_logit_rows = R, the last sampled token and R - 1 drafts) keeps R states,
// those after each of those tokens (KeptState k: after the chunk's token n - R + k; the last is
// Next), in R copies other than the one it reads. After the commit the slot holds the sequence at
// each of the R lengths, and the next chunk's start_position picks the one it continues: the
// length the scheduler kept once it knew how many drafts were accepted, exactly as if the rejected
// tokens had never run. So a slot has 1 + max_kept_states copies (max_kept_states: the most rows a
// chunk asks for, KvCacheShape::max_logit_rows_per_chunk); a plain chunk keeps 1 state and copies
// nothing, as without speculation.
//
// A chunk at position 0 starts its sequence's state from zeros (a new sequence, or a preempted one
// recomputed from its prompt). A later chunk must continue a state its slot holds: the same
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
#include "engine/core/model_runner.h"

namespace exl3::engine {

// The states a chunk keeps: a verify chunk (logit rows for next tokens) the state after each of its
// num_logit_rows last tokens; any other chunk only the state after its last.
int KeptStatesOf(const SequenceChunk& chunk);

class SequenceStateSlots {
 public:
  // `max_kept_states` >= 1: the most states one chunk keeps (its logit rows); each slot has one
  // copy more than that.
  explicit SequenceStateSlots(int num_slots, int max_kept_states = 1)
      : slots_(num_slots), num_copies_(max_kept_states + 1) {}

  int num_slots() const { return static_cast<int>(slots_.size()); }
  int num_copies() const { return num_copies_; }
  // Checks the step's chunks against what their slots hold (see above) and picks the copy each
  // reads. Returns the slots whose state starts afresh in this step (their current copy must read
  // as zeros); they hold nothing from now until CommitStep.
  absl::StatusOr<std::vector<int>> BeginStep(const StepBatch& batch);
  // The copy (in [0, num_copies)) a step reads in `slot`.
  int CurrentCopy(int slot) const { return slots_[slot].read_copy; }
  // How many states the slot's chunk keeps this step (1 but for a verify chunk), and the copy
  // kept state k goes to: the copies other than the current one, in order.
  int NumKeptStates(int slot) const { return slots_[slot].num_kept; }
  int KeptCopy(int slot, int k) const { return k < slots_[slot].read_copy ? k : k + 1; }
  // The copy holding the state after the chunk's last token.
  int NextCopy(int slot) const { return KeptCopy(slot, NumKeptStates(slot) - 1); }
  // Makes each chunk's kept copies the slot's: it now holds its sequence at each kept length.
  void CommitStep(const StepBatch& batch);

 private:
  // The lengths a slot holds its sequence at: first_length + i in copies[i] (one length but
  // after a verify chunk).
  struct Contents {
    int64_t sequence_id = 0;
    int first_length = 0;     // positions [0, first_length) are folded into copies[0]
    std::vector<int> copies;  // in [0, num_copies)
    int num_lengths() const { return static_cast<int>(copies.size()); }
  };
  struct Slot {
    int read_copy = 0;  // the copy the step reads
    int num_kept = 1;   // the states the step's chunk keeps
    std::optional<Contents> contents;  // unset: holds no sequence's state
  };
  std::vector<Slot> slots_;
  int num_copies_;
};

// One copy of a slot as both state stores (this one and engine/cuda/device_sequence_states.h) lay
// it out: every layer's state one after the other.
struct StateCopyLayout {
  explicit StateCopyLayout(const std::vector<int64_t>& floats_per_layer);
  std::vector<int64_t> layer_offset;  // first float of each layer within the copy
  int64_t floats = 0;                 // the copy's floats
};
// The stores' shape: INVALID_ARGUMENT below one slot or one kept state.
absl::Status CheckStateStoreShape(int num_slots, int max_kept_states);
// The RESOURCE_EXHAUSTED of a store that cannot be had (`store`: what it is, e.g. "the per-sequence
// state store on the GPU"), naming the flags that make it smaller.
absl::Status StateStoreTooLarge(const char* store, int num_slots, int copies, int64_t copy_floats,
                                int max_kept_states);

// The state on the CPU: per slot, 1 + max_kept_states copies of every layer's floats (layers
// without state: 0). Allocated zeroed by the system (calloc), so slots and copies that never run
// take no memory.
class SequenceStateStore {
 public:
  // Copies per slot without speculative decoding (ModelInfo::state_bytes_per_sequence counts these).
  static constexpr int kCopies = 2;

  // RESOURCE_EXHAUSTED when the memory cannot be had.
  static absl::StatusOr<std::unique_ptr<SequenceStateStore>> Create(
      std::vector<int64_t> floats_per_layer, int num_slots, int max_kept_states = 1);

  absl::Status BeginStep(const StepBatch& batch);
  void CommitStep(const StepBatch& batch) { slots_.CommitStep(batch); }
  int64_t floats(int layer) const { return floats_per_layer_[layer]; }
  const float* Current(int layer, int slot) const {
    return data_.get() + Offset(layer, slot, slots_.CurrentCopy(slot));
  }
  // The state after the chunk's last token.
  float* Next(int layer, int slot) {
    return data_.get() + Offset(layer, slot, slots_.NextCopy(slot));
  }
  // A verify chunk of n tokens keeps NumKeptStates(slot) = R states: KeptState(layer, slot, k) is
  // the one after its token n - R + k (k = R - 1: Next). Layers write every kept state.
  int NumKeptStates(int slot) const { return slots_.NumKeptStates(slot); }
  float* KeptState(int layer, int slot, int k) {
    return data_.get() + Offset(layer, slot, slots_.KeptCopy(slot, k));
  }

 private:
  SequenceStateStore(std::vector<int64_t> floats_per_layer, int num_slots, int max_kept_states);
  size_t CopyOffset(int slot, int copy) const {
    return (static_cast<size_t>(slot) * slots_.num_copies() + copy) * layout_.floats;
  }
  size_t Offset(int layer, int slot, int copy) const {
    return CopyOffset(slot, copy) + layout_.layer_offset[layer];
  }

  std::vector<int64_t> floats_per_layer_;
  StateCopyLayout layout_;
  SequenceStateSlots slots_;
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> data_;
};

}  // namespace exl3::engine
