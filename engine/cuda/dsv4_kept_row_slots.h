// Which device rows hold DeepSeek-V4's kept compressor states on the GPU engine (speculative
// decoding), per state slot: the host bookkeeping of the CPU engine's
// engine/cpu/attention/dsv4_kept_accumulators.h for the GPU's fold kernel (engine/cuda/dsv4_attention_kernels.h).
//
// A compressed layer's block area holds its compressors' running softmax after the block's last
// folded position, which a rejected draft cannot be taken out of. So a verify chunk keeps the
// accumulators after each of its rows but the last (those a later chunk may resume after; not
// where a row ends its cache block: the next block starts from that block's full state), in rows
// of a per-layer device store, tagged here with the sequence, the fold count they stand for and
// the cache block. The sequence's next chunk, starting at the length the scheduler kept, restores
// the kept state for exactly that length before folding on, as on the CPU. The tags are the same
// for every compressed layer of the model (the same positions, the same block tables): one
// Dsv4KeptRowSlots serves all of them; each layer's store has rows() rows of its own width.
//
// As the recurrent store (engine/cuda/device_sequence_states.h), a slot has one row more than a
// chunk keeps (max_kept + 1) and the bookkeeping is transactional: PlanStep reads what the last
// successful step left, the step's kernels write only rows other than the one they restore from,
// and only CommitStep (once the whole step has succeeded) makes the written rows the slot's. A
// failed step run again (engine/core/engine.h) therefore restores from the same intact row in
// every layer, whether that layer ran in the failed attempt or not; and where the failed attempt
// had folded positions that the run again skips (a block's fold count past them, nothing to
// restore), the rows planned for them are the same ones that attempt wrote, with the same states.
//
//   slots.Allocate(num_slots, /*max_kept=*/K);          // K = max_logit_rows_per_chunk - 1
//   EXL3_RETURN_IF_ERROR(slots.PlanStep(tokens, block_size, &facts));  // facts: kDsv4KeepingInts per chunk
//   ... the step runs (Dsv4FoldArgs::kept, chunk_keeping) ...
//   slots.CommitStep();                                 // after it succeeded
//
// Without speculative decoding (max_kept 0) nothing is planned, allocated or uploaded; a verify
// chunk is then refused by name (as the CPU engine refuses it).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "engine/core/step_tokens.h"
#include "engine/cuda/dsv4_attention_kernels.h"  // kDsv4KeepingInts

namespace exl3::engine::cuda {

class Dsv4KeptRowSlots {
 public:
  // `max_kept`: the most states one chunk keeps (its logit rows - 1); 0 turns keeping off.
  absl::Status Allocate(int num_slots, int max_kept);
  bool enabled() const { return max_kept_ > 0; }
  int max_kept() const { return max_kept_; }
  int num_slots() const { return static_cast<int>(slots_.size()); }
  // Rows of each layer's store: num_slots * (max_kept + 1).
  int rows() const { return num_slots() * (max_kept_ + 1); }

  // Checks the step's chunks (a verify chunk needs room for its states; every chunk a valid slot
  // while keeping is on) and, while keeping is on, appends kDsv4KeepingInts per chunk of `tokens`
  // to *facts (in the step's chunk order) and holds what they will keep until CommitStep. A chunk
  // restores where its first position is not a block's first and its slot kept the state for
  // exactly that length, in that cache block, for its sequence.
  absl::Status PlanStep(const StepTokens& tokens, int block_size, std::vector<int32_t>* facts);
  // The planned step succeeded: each of its chunks' slots now holds what that chunk kept (a plain
  // chunk: nothing).
  void CommitStep();

  // The row `slot`'s last committed chunk kept the state for fold count `count` in block `block`
  // of `sequence_id` in; -1 if none.
  int32_t FindRow(int slot, int64_t sequence_id, int count, int32_t block) const;

 private:
  struct Kept {
    int count = 0;      // positions folded
    int32_t block = 0;  // the cache block they are folded in
    int32_t row = 0;
  };
  struct Slot {
    int64_t sequence_id = 0;  // of the chunk that kept `kept` (none kept: matches nothing)
    std::vector<Kept> kept;
  };
  struct Planned {
    int slot = 0;
    Slot contents;
  };

  std::vector<Slot> slots_;
  std::vector<Planned> planned_;  // the last PlanStep's, until CommitStep
  int max_kept_ = 0;
};

}  // namespace exl3::engine::cuda
