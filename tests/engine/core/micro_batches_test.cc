// SplitIntoMicroBatches: contiguous chunk groups whose token ranges tile the step.
#include "engine/core/micro_batches.h"

#include <vector>

#include "gtest/gtest.h"

namespace exl3::engine {
namespace {

StepBatch StepOf(const std::vector<int>& chunk_tokens) {
  StepBatch b;
  for (size_t i = 0; i < chunk_tokens.size(); ++i) {
    SequenceChunk c;
    c.sequence_id = static_cast<int64_t>(i);
    c.tokens.assign(chunk_tokens[i], 1);
    c.wants_logits = true;
    b.chunks.push_back(c);
  }
  return b;
}

void ExpectTiles(const StepBatch& b, const std::vector<MicroBatchRange>& r) {
  int chunk = 0, token = 0;
  for (const MicroBatchRange& m : r) {
    EXPECT_EQ(m.first_chunk, chunk);
    EXPECT_EQ(m.first_token, token);
    EXPECT_GE(m.num_chunks, 1);
    int tokens = 0;
    for (int c = m.first_chunk; c < m.first_chunk + m.num_chunks; ++c)
      tokens += static_cast<int>(b.chunks[c].tokens.size());
    EXPECT_EQ(m.num_tokens, tokens);
    chunk += m.num_chunks;
    token += m.num_tokens;
  }
  EXPECT_EQ(chunk, static_cast<int>(b.chunks.size()));
  EXPECT_EQ(token, b.NumTokens());
}

TEST(MicroBatchesTest, OneMicroBatchIsTheWholeStep) {
  const StepBatch b = StepOf({1, 1, 1});
  const auto r = SplitIntoMicroBatches(b, 1);
  ASSERT_EQ(r.size(), 1u);
  ExpectTiles(b, r);
}

TEST(MicroBatchesTest, DecodeStepSplitsInHalves) {
  const StepBatch b = StepOf(std::vector<int>(64, 1));
  const auto r = SplitIntoMicroBatches(b, 2);
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].num_tokens, 32);
  EXPECT_EQ(r[1].num_tokens, 32);
  ExpectTiles(b, r);
  const StepBatch odd = StepOf(std::vector<int>(7, 1));
  const auto ro = SplitIntoMicroBatches(odd, 2);
  ASSERT_EQ(ro.size(), 2u);
  EXPECT_EQ(ro[0].num_tokens, 3);  // at most half
  ExpectTiles(odd, ro);
}

TEST(MicroBatchesTest, OneChunkStaysWholeAndALargeFirstChunkStillSplits) {
  const StepBatch one = StepOf({100});
  EXPECT_EQ(SplitIntoMicroBatches(one, 2).size(), 1u);
  // A prompt chunk larger than half the step: the first micro-batch is that chunk alone.
  const StepBatch b = StepOf({100, 1, 1});
  const auto r = SplitIntoMicroBatches(b, 2);
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].num_chunks, 1);
  EXPECT_EQ(r[0].num_tokens, 100);
  ExpectTiles(b, r);
}

TEST(MicroBatchesTest, ChunksOfAMicroBatchAreItsOwnStep) {
  const StepBatch b = StepOf({3, 1, 2, 5});
  const auto r = SplitIntoMicroBatches(b, 2);
  ASSERT_EQ(r.size(), 2u);
  ExpectTiles(b, r);
  for (const MicroBatchRange& m : r) {
    const StepBatch part = MicroBatchChunks(b, m);
    ASSERT_EQ(static_cast<int>(part.chunks.size()), m.num_chunks);
    EXPECT_EQ(part.NumTokens(), m.num_tokens);
    EXPECT_EQ(part.chunks[0].sequence_id, b.chunks[m.first_chunk].sequence_id);
  }
}

}  // namespace
}  // namespace exl3::engine
