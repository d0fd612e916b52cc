// engine/cuda/recurrent_chunks.h's KeptStateRow (host code of the GPU engine; runs without a GPU):
// the row the kernels store a verify chunk's kept state k in is the slot's copy that
// SequenceStateSlots::KeptCopy names (engine/cpu/sequence_state.h), whichever copy the chunk reads, for
// slots of 2 to 6 copies and chunks keeping 1 to all of them.
#include <cstdint>
#include <vector>

#include "engine/cuda/recurrent_chunks.h"
#include "engine/core/model_runner.h"
#include "engine/cpu/sequence_state.h"
#include "gtest/gtest.h"

namespace exl3::engine::cuda {
namespace {

StepBatch Chunk(int slot, int start, int tokens, int logit_rows) {
  SequenceChunk c;
  c.sequence_id = 10 + slot;
  c.state_slot = slot;
  c.start_position = start;
  c.tokens.assign(tokens, 1);
  c.wants_logits = true;
  c.num_logit_rows = logit_rows;
  StepBatch batch;
  batch.chunks.push_back(c);
  return batch;
}

TEST(RecurrentChunksTest, KeptStateRowIsTheSlotsKeptCopy) {
  for (int max_kept = 1; max_kept <= 5; ++max_kept) {
    constexpr int kSlots = 3, kSlot = 2;
    SequenceStateSlots slots(kSlots, max_kept);
    const int copies = slots.num_copies(), slot_row = kSlot * copies;
    int length = 0, checked = 0;
    // A prefill, then verify chunks of every size, each resumed after every number of accepted
    // drafts in turn, so the copy read moves over the slot's copies.
    ASSERT_TRUE(slots.BeginStep(Chunk(kSlot, 0, 4, 1)).ok());
    slots.CommitStep(Chunk(kSlot, 0, 4, 1));
    length = 4;
    for (int round = 0; round < 12; ++round) {
      const int rows = 1 + round % max_kept;
      const StepBatch verify = Chunk(kSlot, length, rows, rows);
      ASSERT_TRUE(slots.BeginStep(verify).ok()) << "max kept " << max_kept << " round " << round;
      const int read_row = slot_row + slots.CurrentCopy(kSlot);
      ASSERT_EQ(slots.NumKeptStates(kSlot), rows);
      for (int k = 0; k < rows; ++k) {
        const int32_t row = KeptStateRow(slot_row, read_row, k);
        EXPECT_EQ(row, slot_row + slots.KeptCopy(kSlot, k)) << "max kept " << max_kept << " k " << k;
        EXPECT_NE(row, read_row);
        ++checked;
      }
      slots.CommitStep(verify);
      length += 1 + round % rows;  // the kept length the next chunk continues
    }
    EXPECT_GE(checked, 12);
  }
}

}  // namespace
}  // namespace exl3::engine::cuda
