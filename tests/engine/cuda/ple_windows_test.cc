// engine/cuda/ple_windows.h (host code of the GPU engine; runs without a GPU): the n-gram windows of
// sequences cut into chunks across steps, beside each other in a step, against windows read off each
// sequence's whole token history (eos before position 0); a step that is not committed leaves every
// context as it was; a chunk resuming a sequence whose slot holds no context is refused by name; a
// verify chunk keeps the context after each of its kept tokens, and the next chunk continues the
// one its start position names (speculative decoding's rollback).
#include <map>
#include <random>
#include <string>
#include <vector>

#include "engine/cuda/ple_windows.h"
#include "engine/core/model_runner.h"
#include "engine/core/step_tokens.h"
#include "gtest/gtest.h"

namespace exl3::engine::cuda {
namespace {

PleConfig Ple(int ngram_size) {
  PleConfig p;
  p.ngram_size = ngram_size;
  p.eos_token_id = 1;
  return p;
}

// The step's tokens as FlattenStep lays them out (the fields PleWindows reads).
StepTokens Flatten(const StepBatch& batch) {
  StepTokens t;
  t.batch = &batch;
  for (size_t c = 0; c < batch.chunks.size(); ++c)
    for (size_t j = 0; j < batch.chunks[c].tokens.size(); ++j) {
      t.token_ids.push_back(batch.chunks[c].tokens[j]);
      t.positions.push_back(batch.chunks[c].start_position + static_cast<int>(j));
      t.chunk_of.push_back(static_cast<int32_t>(c));
    }
  t.num_tokens = static_cast<int>(t.positions.size());
  return t;
}

TEST(PleWindowsTest, WindowsMatchTheSequencesHistoryAcrossChunks) {
  for (const int n : {2, 3, 5}) {
    const PleConfig ple = Ple(n);
    PleWindows windows(ple);
    std::mt19937 rng(n);
    std::map<int, std::vector<int32_t>> history;  // by sequence (= slot)
    // Chunks shorter and longer than the context, several sequences per step, a fresh sequence
    // reusing a slot, and one uncommitted step.
    const std::vector<std::vector<std::pair<int, int>>> steps = {
        {{0, 1}, {1, 2}, {2, 7}}, {{0, 1}, {1, 1}, {2, 1}}, {{0, 5}, {1, 1}, {3, 3}},
        {{0, 1}, {2, 2}, {3, 1}}, {{1, 9}, {3, 1}}, {{0, 1}, {1, 1}, {2, 1}, {3, 1}}};
    for (size_t s = 0; s < steps.size(); ++s) {
      SCOPED_TRACE(::testing::Message() << "ngram " << n << " step " << s);
      StepBatch batch;
      for (const auto& [seq, count] : steps[s]) {
        SequenceChunk c;
        c.sequence_id = seq;
        c.state_slot = seq;
        c.start_position = static_cast<int>(history[seq].size());
        for (int i = 0; i < count; ++i) c.tokens.push_back(static_cast<int32_t>(2 + rng() % 50));
        batch.chunks.push_back(c);
      }
      const StepTokens tokens = Flatten(batch);
      std::vector<int32_t> got;
      ASSERT_TRUE(windows.Build(tokens, &got).ok());
      ASSERT_EQ(got.size(), static_cast<size_t>(tokens.num_tokens) * n);
      for (int t = 0; t < tokens.num_tokens; ++t) {
        const SequenceChunk& c = batch.chunks[tokens.chunk_of[t]];
        std::vector<int32_t> seq = history[c.sequence_id];
        seq.insert(seq.end(), c.tokens.begin(), c.tokens.end());
        const int p = tokens.positions[t];
        for (int i = 0; i < n; ++i) {
          const int at = p - (n - 1 - i);
          EXPECT_EQ(got[static_cast<size_t>(t) * n + i], at < 0 ? ple.eos_token_id : seq[at])
              << "token " << t << " (position " << p << ") window " << i;
        }
      }
      if (s == 3) {
        // Not committed (the step failed): the next Build sees the contexts as they were, and the
        // same step runs again.
        std::vector<int32_t> again;
        ASSERT_TRUE(windows.Build(tokens, &again).ok());
        EXPECT_EQ(again, got);
      }
      windows.Commit();
      for (const SequenceChunk& c : batch.chunks)
        history[c.sequence_id].insert(history[c.sequence_id].end(), c.tokens.begin(), c.tokens.end());
    }
    // A new sequence in slot 2 starts fresh (eos context), whatever the slot held.
    StepBatch fresh;
    SequenceChunk c;
    c.sequence_id = 7;
    c.state_slot = 2;
    c.tokens = {40};
    fresh.chunks.push_back(c);
    std::vector<int32_t> w;
    ASSERT_TRUE(windows.Build(Flatten(fresh), &w).ok());
    for (int i = 0; i + 1 < n; ++i) EXPECT_EQ(w[i], ple.eos_token_id);
    EXPECT_EQ(w[n - 1], 40);
  }
}

TEST(PleWindowsTest, AVerifyChunkKeepsTheContextAfterEachKeptToken) {
  for (const int n : {2, 3, 5}) {
    SCOPED_TRACE(::testing::Message() << "ngram " << n);
    const PleConfig ple = Ple(n);
    PleWindows windows(ple);
    std::vector<int32_t> history = {2, 3, 4, 5, 6, 7, 8};  // the prompt
    auto chunk = [](const std::vector<int32_t>& tokens, int start, int logit_rows) {
      SequenceChunk c;
      c.sequence_id = 3;
      c.state_slot = 1;
      c.start_position = start;
      c.tokens = tokens;
      c.wants_logits = true;
      c.num_logit_rows = logit_rows;
      StepBatch batch;
      batch.chunks.push_back(c);
      return batch;
    };
    std::vector<int32_t> w;
    const StepBatch prompt = chunk(history, 0, 1);
    ASSERT_TRUE(windows.Build(Flatten(prompt), &w).ok());
    windows.Commit();
    // The last token and 4 drafts, a verify chunk of 5 rows: the slot holds lengths 8 .. 12.
    const std::vector<int32_t> verify_tokens = {9, 10, 11, 12, 13};
    const StepBatch verify = chunk(verify_tokens, 7, 5);
    ASSERT_TRUE(windows.Build(Flatten(verify), &w).ok());
    windows.Commit();
    for (int accepted = 0; accepted < 5; ++accepted) {
      // The next chunk after `accepted` drafts: its window is the kept history's, as if the rejected
      // drafts had never run (Build commits nothing, so each length is tried on the same holding).
      const int length = 7 + accepted + 1;
      std::vector<int32_t> seq(history);
      seq.insert(seq.end(), verify_tokens.begin(), verify_tokens.begin() + accepted + 1);
      seq.push_back(40 + accepted);
      const StepBatch next = chunk({40 + accepted}, length, 1);
      ASSERT_TRUE(windows.Build(Flatten(next), &w).ok()) << accepted;
      ASSERT_EQ(w.size(), static_cast<size_t>(n));
      for (int i = 0; i < n; ++i)
        EXPECT_EQ(w[i], seq[length - (n - 1 - i)]) << accepted << " accepted, window " << i;
    }
    // Lengths the slot does not hold: before the verify chunk's first kept one, after its last.
    for (int length : {7, 13}) {
      const StepBatch stray = chunk({50}, length, 1);
      const absl::Status st = windows.Build(Flatten(stray), &w);
      EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << length << ": " << st;
    }
    // After a plain chunk the slot holds one length again.
    const StepBatch plain = chunk({9, 10}, 8, 1);
    ASSERT_TRUE(windows.Build(Flatten(plain), &w).ok());
    windows.Commit();
    EXPECT_FALSE(windows.Build(Flatten(chunk({50}, 9, 1)), &w).ok());
    EXPECT_TRUE(windows.Build(Flatten(chunk({50}, 10, 1)), &w).ok());
  }
}

TEST(PleWindowsTest, ResumingWithoutAContextIsRefused) {
  PleWindows windows(Ple(3));
  StepBatch batch;
  SequenceChunk c;
  c.sequence_id = 12;
  c.state_slot = 4;
  c.start_position = 9;
  c.tokens = {5};
  batch.chunks.push_back(c);
  std::vector<int32_t> w;
  const absl::Status st = windows.Build(Flatten(batch), &w);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(std::string(st.message()).find("sequence 12"), std::string::npos) << st;
  EXPECT_NE(std::string(st.message()).find("slot 4"), std::string::npos) << st;
}

}  // namespace
}  // namespace exl3::engine::cuda
