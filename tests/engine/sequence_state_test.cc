// engine/sequence_state: fresh chunks start from zeros, a committed step's copy becomes current,
// a step that is never committed leaves the state as it was, and a chunk that does not continue
// what its slot holds is refused.
#include "engine/sequence_state.h"

#include <memory>
#include <string>

#include "gtest/gtest.h"

namespace exl3::engine {
namespace {

SequenceChunk Chunk(int64_t id, int slot, int start, int num_tokens) {
  SequenceChunk c;
  c.sequence_id = id;
  c.state_slot = slot;
  c.start_position = start;
  c.tokens.assign(num_tokens, 1);
  return c;
}

StepBatch Batch(std::initializer_list<SequenceChunk> chunks) {
  StepBatch b;
  b.chunks = chunks;
  return b;
}

// Layer 1 of three holds 3 floats per sequence.
std::unique_ptr<SequenceStateStore> Store(int num_slots) {
  auto s = SequenceStateStore::Create({0, 3, 0}, num_slots);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

TEST(SequenceStateStore, FreshChunksStartFromZerosAndCommittedStatesCarryOver) {
  std::unique_ptr<SequenceStateStore> store = Store(2);
  const StepBatch first = Batch({Chunk(7, 1, 0, 4)});
  ASSERT_TRUE(store->BeginStep(first).ok());
  for (int i = 0; i < 3; ++i) EXPECT_EQ(store->Current(1, 1)[i], 0.0f);
  for (int i = 0; i < 3; ++i) store->Next(1, 1)[i] = 10.0f + i;
  store->CommitStep(first);

  const StepBatch second = Batch({Chunk(7, 1, 4, 1)});
  ASSERT_TRUE(store->BeginStep(second).ok());
  for (int i = 0; i < 3; ++i) EXPECT_EQ(store->Current(1, 1)[i], 10.0f + i);
  for (int i = 0; i < 3; ++i) store->Next(1, 1)[i] = 20.0f + i;
  store->CommitStep(second);
  ASSERT_TRUE(store->BeginStep(Batch({Chunk(7, 1, 5, 1)})).ok());
  EXPECT_EQ(store->Current(1, 1)[2], 22.0f);
}

TEST(SequenceStateStore, AStepThatIsNotCommittedLeavesTheStateAsItWas) {
  std::unique_ptr<SequenceStateStore> store = Store(1);
  const StepBatch prefill = Batch({Chunk(3, 0, 0, 5)});
  ASSERT_TRUE(store->BeginStep(prefill).ok());
  store->Next(1, 0)[0] = 1.5f;
  store->CommitStep(prefill);
  // A decode step that fails after writing its copy: never committed.
  const StepBatch decode = Batch({Chunk(3, 0, 5, 1)});
  ASSERT_TRUE(store->BeginStep(decode).ok());
  store->Next(1, 0)[0] = -99.0f;
  // The same step again sees the state of position 5 and may commit this time.
  ASSERT_TRUE(store->BeginStep(decode).ok());
  EXPECT_EQ(store->Current(1, 0)[0], 1.5f);
  store->Next(1, 0)[0] = 2.5f;
  store->CommitStep(decode);
  ASSERT_TRUE(store->BeginStep(Batch({Chunk(3, 0, 6, 1)})).ok());
  EXPECT_EQ(store->Current(1, 0)[0], 2.5f);
}

TEST(SequenceStateStore, ARestartedSequenceStartsAgainFromZeros) {
  std::unique_ptr<SequenceStateStore> store = Store(1);
  const StepBatch prefill = Batch({Chunk(3, 0, 0, 5)});
  ASSERT_TRUE(store->BeginStep(prefill).ok());
  store->Next(1, 0)[1] = 4.0f;
  store->CommitStep(prefill);
  // Preempted, then recomputed from position 0 (or another sequence given the slot).
  ASSERT_TRUE(store->BeginStep(Batch({Chunk(3, 0, 0, 8)})).ok());
  EXPECT_EQ(store->Current(1, 0)[1], 0.0f);
  // Until that step commits, the slot holds nothing a later chunk could continue.
  const absl::Status st = store->BeginStep(Batch({Chunk(3, 0, 5, 1)}));
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
}

TEST(SequenceStateStore, RefusesChunksThatDoNotContinueTheirSlot) {
  std::unique_ptr<SequenceStateStore> store = Store(2);
  const StepBatch prefill = Batch({Chunk(3, 0, 0, 5)});
  ASSERT_TRUE(store->BeginStep(prefill).ok());
  store->CommitStep(prefill);
  // Another sequence, a position the state has not reached, and one past it (a prefix-cache
  // hit: KV blocks for positions the state never saw).
  for (const StepBatch& b : {Batch({Chunk(4, 0, 5, 1)}), Batch({Chunk(3, 0, 6, 1)}),
                             Batch({Chunk(3, 0, 4, 1)}), Batch({Chunk(9, 1, 16, 3)})}) {
    const absl::Status st = store->BeginStep(b);
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    EXPECT_NE(std::string(st.message()).find("state slot"), std::string::npos) << st;
  }
  // Slots outside the store, and one slot given to two chunks.
  EXPECT_EQ(store->BeginStep(Batch({Chunk(5, 2, 0, 1)})).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(store->BeginStep(Batch({Chunk(5, -1, 0, 1)})).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(store->BeginStep(Batch({Chunk(5, 1, 0, 1), Chunk(6, 1, 0, 1)})).code(),
            absl::StatusCode::kInternal);
  // None of that disturbed sequence 3.
  EXPECT_TRUE(store->BeginStep(Batch({Chunk(3, 0, 5, 1)})).ok());
}

}  // namespace
}  // namespace exl3::engine
