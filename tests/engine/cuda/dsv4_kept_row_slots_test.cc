// engine/cuda/dsv4_kept_row_slots.h (host code of the GPU engine; runs without a GPU): which rows a
// verify chunk's kept compressor states go to and which one the sequence's next chunk restores
// from, as the fold kernel reads them (kDsv4KeepingInts per chunk); nothing kept where a row ends
// its cache block; a step that is not committed leaves the slots as they were, and its run again
// plans the same rows; a kept state is found only for its sequence, length and block; a verify
// chunk without room is refused by name, and without speculation nothing is planned.
#include <string>
#include <vector>

#include "engine/core/model_runner.h"
#include "engine/core/step_tokens.h"
#include "engine/cuda/dsv4_kept_row_slots.h"
#include "gtest/gtest.h"

namespace exl3::engine::cuda {
namespace {

constexpr int kBlockSize = 8, kBlocks = 8;

struct ChunkSpec {
  int64_t sequence_id;
  int slot, start, count;
  int logit_rows = 1;
  LogitRowsUse use = LogitRowsUse::kNextTokens;
};

StepBatch Batch(const std::vector<ChunkSpec>& specs) {
  StepBatch batch;
  for (const ChunkSpec& s : specs) {
    SequenceChunk c;
    c.sequence_id = s.sequence_id;
    c.state_slot = s.slot;
    c.start_position = s.start;
    c.tokens.assign(s.count, 3);
    // Sequence s on blocks s * kBlocks .. (s + 1) * kBlocks - 1.
    for (int b = 0; b < kBlocks; ++b) c.block_table.push_back(static_cast<int32_t>(s.sequence_id * kBlocks + b));
    c.wants_logits = true;
    c.num_logit_rows = s.logit_rows;
    c.logit_rows_use = s.use;
    batch.chunks.push_back(std::move(c));
  }
  return batch;
}

// The step's facts as PlanStep gives them.
absl::Status Plan(Dsv4KeptRowSlots& slots, const StepBatch& batch, std::vector<int32_t>* facts) {
  StepTokens tokens;
  const KvCacheShape shape{4 * kBlocks, kBlockSize, 4, 5};
  const absl::Status flat = FlattenStep(batch, /*vocab_size=*/16, shape, /*max_context=*/1024, &tokens);
  EXPECT_TRUE(flat.ok()) << flat;
  facts->clear();
  return slots.PlanStep(tokens, kBlockSize, facts);
}

TEST(Dsv4KeptRowSlotsTest, VerifyChunkKeepsAndTheNextChunkRestores) {
  Dsv4KeptRowSlots slots;
  ASSERT_TRUE(slots.Allocate(/*num_slots=*/2, /*max_kept=*/4).ok());
  EXPECT_EQ(slots.rows(), 10);
  std::vector<int32_t> facts;
  // A prompt of 10 positions in slot 1: it keeps nothing, restores nothing.
  ASSERT_TRUE(Plan(slots, Batch({{2, 1, 0, 10}}), &facts).ok());
  EXPECT_EQ(facts, (std::vector<int32_t>{-1, 10, 5}));
  slots.CommitStep();
  // A verify chunk of 5 at positions 10 .. 14 (block 1 = positions 8 .. 15): the states after
  // 10 .. 13 in the slot's rows 5 .. 8.
  ASSERT_TRUE(Plan(slots, Batch({{2, 1, 10, 5, 5}}), &facts).ok());
  EXPECT_EQ(facts, (std::vector<int32_t>{-1, 0, 5}));
  EXPECT_EQ(slots.FindRow(1, 2, 12, 2 * kBlocks + 1), -1) << "nothing kept before the commit";
  slots.CommitStep();
  for (int count = 11; count <= 14; ++count) EXPECT_EQ(slots.FindRow(1, 2, count, 2 * kBlocks + 1), count - 11 + 5);
  EXPECT_EQ(slots.FindRow(1, 2, 15, 2 * kBlocks + 1), -1) << "the live state";
  EXPECT_EQ(slots.FindRow(1, 3, 12, 2 * kBlocks + 1), -1) << "another sequence";
  EXPECT_EQ(slots.FindRow(1, 2, 12, 2 * kBlocks + 2), -1) << "another block";
  EXPECT_EQ(slots.FindRow(0, 2, 12, 2 * kBlocks + 1), -1) << "another slot";

  // One draft accepted: the next verify chunk starts at 12 and restores row 6; its states after
  // 12, 13, 14 go to the slot's rows but 6, in order (5, 7, 8); 15 ends its block: not kept.
  const StepBatch resume = Batch({{2, 1, 12, 5, 5}});
  ASSERT_TRUE(Plan(slots, resume, &facts).ok());
  EXPECT_EQ(facts, (std::vector<int32_t>{6, 0, 5}));
  // The step failed: nothing committed, and its run again plans the same rows.
  std::vector<int32_t> again;
  ASSERT_TRUE(Plan(slots, resume, &again).ok());
  EXPECT_EQ(again, facts);
  slots.CommitStep();
  EXPECT_EQ(slots.FindRow(1, 2, 13, 2 * kBlocks + 1), 5);
  EXPECT_EQ(slots.FindRow(1, 2, 14, 2 * kBlocks + 1), 7);
  EXPECT_EQ(slots.FindRow(1, 2, 15, 2 * kBlocks + 1), 8);
  EXPECT_EQ(slots.FindRow(1, 2, 12, 2 * kBlocks + 1), -1) << "folded over";
  EXPECT_EQ(slots.FindRow(1, 2, 16, 2 * kBlocks + 2), -1) << "a block's end keeps nothing";

  // Beside another sequence's chunk: facts in chunk order, the first kept token counted in the
  // step. All drafts rejected: the plain chunk at 13 restores row 5 and keeps nothing.
  ASSERT_TRUE(Plan(slots, Batch({{0, 0, 0, 3}, {2, 1, 13, 1}}), &facts).ok());
  EXPECT_EQ(facts, (std::vector<int32_t>{-1, 4, 0, 5, 4, 5}));
  slots.CommitStep();
  EXPECT_EQ(slots.FindRow(1, 2, 14, 2 * kBlocks + 1), -1) << "a plain chunk's commit forgets the kept states";
}

TEST(Dsv4KeptRowSlotsTest, ChunkStartingABlockRestoresNothing) {
  Dsv4KeptRowSlots slots;
  ASSERT_TRUE(slots.Allocate(1, 2).ok());
  std::vector<int32_t> facts;
  ASSERT_TRUE(Plan(slots, Batch({{1, 0, 0, 6}}), &facts).ok());
  slots.CommitStep();
  // Verify rows at 6, 7, 8: 7 ends block 0 (not kept), 6 kept in row 0.
  ASSERT_TRUE(Plan(slots, Batch({{1, 0, 6, 3, 3}}), &facts).ok());
  EXPECT_EQ(facts, (std::vector<int32_t>{-1, 0, 0}));
  slots.CommitStep();
  EXPECT_EQ(slots.FindRow(0, 1, 7, kBlocks + 0), 0);
  EXPECT_EQ(slots.FindRow(0, 1, 8, kBlocks + 0), -1);
  // The next chunk at 8 starts block 1: it continues from block 0's full state.
  ASSERT_TRUE(Plan(slots, Batch({{1, 0, 8, 1}}), &facts).ok());
  EXPECT_EQ(facts, (std::vector<int32_t>{-1, 1, 0}));
}

TEST(Dsv4KeptRowSlotsTest, PromptPositionRowsKeepNothing) {
  Dsv4KeptRowSlots slots;
  ASSERT_TRUE(slots.Allocate(1, 2).ok());
  std::vector<int32_t> facts;
  ASSERT_TRUE(Plan(slots, Batch({{1, 0, 0, 12, 12, LogitRowsUse::kPromptPositions}}), &facts).ok());
  EXPECT_EQ(facts, (std::vector<int32_t>{-1, 12, 0}));
}

TEST(Dsv4KeptRowSlotsTest, VerifyChunkWithoutRoomRefusedByName) {
  for (const int max_kept : {0, 2}) {
    Dsv4KeptRowSlots slots;
    ASSERT_TRUE(slots.Allocate(1, max_kept).ok());
    EXPECT_EQ(slots.enabled(), max_kept > 0);
    std::vector<int32_t> facts;
    const absl::Status st = Plan(slots, Batch({{1, 0, 0, 4, 4}}), &facts);
    EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
    EXPECT_NE(std::string(st.message()).find("verify chunk"), std::string::npos) << st;
  }
  // Without speculation a plain step plans nothing (nothing uploaded, no slot read).
  Dsv4KeptRowSlots off;
  ASSERT_TRUE(off.Allocate(0, 0).ok());
  std::vector<int32_t> facts;
  ASSERT_TRUE(Plan(off, Batch({{1, 7, 0, 4}, {2, 9, 3, 1}}), &facts).ok());
  EXPECT_TRUE(facts.empty());
  // With it, a slot out of range is refused.
  Dsv4KeptRowSlots on;
  ASSERT_TRUE(on.Allocate(2, 1).ok());
  EXPECT_EQ(Plan(on, Batch({{1, 2, 0, 4}}), &facts).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(on.Allocate(0, 1).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace exl3::engine::cuda
