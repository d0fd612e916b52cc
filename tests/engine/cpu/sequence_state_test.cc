// engine/cpu/sequence_state: fresh chunks start from zeros, a committed step's copy becomes current,
// a step that is never committed leaves the state as it was, and a chunk that does not continue
// what its slot holds is refused. Verify chunks: the states kept after each logit row's token, the
// next chunk's start picking one, without copies, a failed step's retry, and chunks wanting more
// rows than the store keeps states for refused.
#include "engine/cpu/sequence_state.h"

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

SequenceChunk VerifyChunk(int64_t id, int slot, int start, int num_tokens) {
  SequenceChunk c = Chunk(id, slot, start, num_tokens);
  c.wants_logits = true;
  c.num_logit_rows = num_tokens;
  return c;
}

// Writes `value + k` into the whole of kept state k (layer 1) of slot 0.
void WriteKeptStates(SequenceStateStore& store, float value) {
  for (int k = 0; k < store.NumKeptStates(0); ++k)
    for (int i = 0; i < 3; ++i) store.KeptState(1, 0, k)[i] = value + k;
}

TEST(SequenceStateStore, AVerifyChunkKeepsTheStateAfterEachRowAndTheNextStartPicksOne) {
  for (int accepted = 0; accepted < 4; ++accepted) {
    auto made = SequenceStateStore::Create({0, 3, 0}, /*num_slots=*/1, /*max_kept_states=*/4);
    ASSERT_TRUE(made.ok()) << made.status();
    SequenceStateStore& store = **made;
    const StepBatch prefill = Batch({Chunk(3, 0, 0, 5)});
    ASSERT_TRUE(store.BeginStep(prefill).ok());
    EXPECT_EQ(store.NumKeptStates(0), 1);
    WriteKeptStates(store, 100.0f);
    store.CommitStep(prefill);
    // The last token and 3 drafts: positions 5..8, states after 6, 7, 8 and 9 tokens.
    const StepBatch verify = Batch({VerifyChunk(3, 0, 5, 4)});
    ASSERT_TRUE(store.BeginStep(verify).ok());
    EXPECT_EQ(store.Current(1, 0)[0], 100.0f);
    ASSERT_EQ(store.NumKeptStates(0), 4);
    EXPECT_EQ(store.Next(1, 0), store.KeptState(1, 0, 3));
    for (int k = 0; k < 4; ++k) EXPECT_NE(store.KeptState(1, 0, k), store.Current(1, 0));
    WriteKeptStates(store, 200.0f);
    store.CommitStep(verify);
    // `accepted` drafts kept: the next chunk starts at 6 + accepted and reads that state, in place.
    const StepBatch next = Batch({Chunk(3, 0, 6 + accepted, 1)});
    ASSERT_TRUE(store.BeginStep(next).ok()) << accepted;
    EXPECT_EQ(store.Current(1, 0)[2], 200.0f + accepted);
    EXPECT_EQ(store.NumKeptStates(0), 1);
    WriteKeptStates(store, 300.0f);
    // That step fails: its retry still reads the same state; the other lengths are gone.
    ASSERT_TRUE(store.BeginStep(next).ok());
    EXPECT_EQ(store.Current(1, 0)[2], 200.0f + accepted);
    for (int other = 6; other < 10; ++other) {
      if (other == 6 + accepted) continue;
      EXPECT_EQ(store.BeginStep(Batch({Chunk(3, 0, other, 1)})).code(), absl::StatusCode::kFailedPrecondition);
    }
    ASSERT_TRUE(store.BeginStep(next).ok());
    WriteKeptStates(store, 400.0f);
    store.CommitStep(next);
    ASSERT_TRUE(store.BeginStep(Batch({Chunk(3, 0, 7 + accepted, 1)})).ok());
    EXPECT_EQ(store.Current(1, 0)[0], 400.0f);
  }
}

TEST(SequenceStateStore, AVerifyChunkAfterARollbackWritesOnlyCopiesItDoesNotRead) {
  auto made = SequenceStateStore::Create({0, 3, 0}, 1, 3);
  ASSERT_TRUE(made.ok());
  SequenceStateStore& store = **made;
  const StepBatch prefill = Batch({Chunk(3, 0, 0, 5)});
  ASSERT_TRUE(store.BeginStep(prefill).ok());
  store.CommitStep(prefill);
  // Verify chunks back to back, each keeping only its first row's state (nothing accepted).
  int start = 5;
  for (int round = 0; round < 8; ++round) {
    const StepBatch verify = Batch({VerifyChunk(3, 0, start, 3)});
    ASSERT_TRUE(store.BeginStep(verify).ok()) << round;
    const float before = store.Current(1, 0)[0];
    if (round > 0) {
      EXPECT_EQ(before, 10.0f * round) << round;
    }
    for (int k = 0; k < 3; ++k) EXPECT_NE(store.KeptState(1, 0, k), store.Current(1, 0));
    WriteKeptStates(store, 10.0f * (round + 1));
    EXPECT_EQ(store.Current(1, 0)[0], before);
    store.CommitStep(verify);
    start += 1;
  }
}

TEST(SequenceStateStore, ChunksWantingMoreRowsThanTheStoreKeepsAreRefused) {
  std::unique_ptr<SequenceStateStore> plain = Store(1);  // no speculation: one state per chunk
  const absl::Status st = plain->BeginStep(Batch({VerifyChunk(3, 0, 0, 2)}));
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
  EXPECT_NE(std::string(st.message()).find("max_logit_rows_per_chunk"), std::string::npos) << st;
  EXPECT_EQ(SequenceStateStore::Create({0, 3, 0}, 1, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace exl3::engine
