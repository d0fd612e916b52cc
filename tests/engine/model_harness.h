// Drives a ModelRunner directly (no scheduler) for the model-side tests: each sequence gets its
// own consecutive cache blocks (and state slot s), prompts run in chunks of a chosen size, then
// greedy decode.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/core/model_runner.h"

namespace exl3::engine::testing {

struct HarnessSequence {
  std::vector<int32_t> tokens;       // prompt, then generated tokens
  std::vector<int32_t> block_table;  // consecutive blocks
  int computed = 0;                  // positions whose keys/values are cached
};

// Runs every sequence's prompt (in chunks of at most `chunk` tokens, all sequences in one step
// each time) and then `steps` greedy decode steps of all sequences together. Returns, per
// sequence, the logits row after the prompt and after each decode step: [steps + 1][vocab].
inline absl::StatusOr<std::vector<std::vector<std::vector<float>>>> RunGreedy(
    ModelRunner& runner, const std::vector<std::vector<int32_t>>& prompts, int steps, int chunk,
    int block_size = 16, int blocks_per_sequence = 16) {
  const int vocab = runner.info().vocab_size;
  std::vector<HarnessSequence> seqs(prompts.size());
  for (size_t s = 0; s < prompts.size(); ++s) {
    seqs[s].tokens = prompts[s];
    for (int b = 0; b < blocks_per_sequence; ++b)
      seqs[s].block_table.push_back(static_cast<int32_t>(s * blocks_per_sequence + b));
  }
  absl::Status st = runner.AllocateKvCache({static_cast<int>(prompts.size()) * blocks_per_sequence,
                                            block_size, static_cast<int>(prompts.size())});
  if (!st.ok()) return st;
  std::vector<std::vector<std::vector<float>>> out(prompts.size());
  auto run = [&](bool decode) -> absl::Status {
    StepBatch batch;
    std::vector<size_t> owner;
    for (size_t s = 0; s < seqs.size(); ++s) {
      HarnessSequence& q = seqs[s];
      const int left = static_cast<int>(q.tokens.size()) - q.computed;
      if (left <= 0) continue;
      const int n = decode ? left : std::min(left, chunk);
      SequenceChunk c;
      c.sequence_id = static_cast<int64_t>(s);
      c.tokens.assign(q.tokens.begin() + q.computed, q.tokens.begin() + q.computed + n);
      c.start_position = q.computed;
      c.block_table = q.block_table;
      c.wants_logits = q.computed + n == static_cast<int>(q.tokens.size());
      c.state_slot = static_cast<int>(s);
      if (c.wants_logits) owner.push_back(s);
      q.computed += n;
      batch.chunks.push_back(std::move(c));
    }
    std::vector<float> logits(static_cast<size_t>(batch.NumLogitRows()) * vocab);
    absl::Status fs = runner.Forward(batch, logits.data());
    if (!fs.ok()) return fs;
    for (size_t r = 0; r < owner.size(); ++r) {
      const float* row = &logits[r * vocab];
      out[owner[r]].emplace_back(row, row + vocab);
      seqs[owner[r]].tokens.push_back(
          static_cast<int32_t>(std::max_element(row, row + vocab) - row));
    }
    return absl::OkStatus();
  };
  // Prefill until every prompt is in the cache (its first token sampled).
  while (std::any_of(seqs.begin(), seqs.end(), [&](const HarnessSequence& q) {
    return q.computed < static_cast<int>(q.tokens.size()) && out[&q - seqs.data()].empty();
  })) {
    st = run(/*decode=*/false);
    if (!st.ok()) return st;
  }
  for (int i = 0; i < steps; ++i) {
    st = run(/*decode=*/true);
    if (!st.ok()) return st;
  }
  return out;
}

// Speculative decoding's verify steps without a drafter: every sequence's prompt in one chunk,
// then `steps` steps in which each sequence runs a chunk of `n` tokens wanting all n logit rows
// (the last token and n - 1 drafts) and accepts all of them (the next chunk starts after it). The
// chunks' tokens are a fixed function of the sequence and position, the same for every runner.
// Returns, per sequence, the prompt's last row and then each verify chunk's n rows.
inline absl::StatusOr<std::vector<std::vector<std::vector<float>>>> RunVerifyChunks(
    ModelRunner& runner, const std::vector<std::vector<int32_t>>& prompts, int n, int steps,
    int block_size = 16, int blocks_per_sequence = 16) {
  const int vocab = runner.info().vocab_size;
  const int S = static_cast<int>(prompts.size());
  absl::Status st = runner.AllocateKvCache({S * blocks_per_sequence, block_size, S, n});
  if (!st.ok()) return st;
  std::vector<int> computed(S, 0);
  std::vector<std::vector<std::vector<float>>> out(S);
  for (int step = 0; step <= steps; ++step) {
    StepBatch batch;
    for (int s = 0; s < S; ++s) {
      SequenceChunk c;
      c.sequence_id = s;
      c.start_position = computed[s];
      if (step == 0) {
        c.tokens = prompts[s];
      } else {
        for (int i = 0; i < n; ++i)
          c.tokens.push_back(static_cast<int32_t>((7919 * (computed[s] + i) + 104729 * s) % vocab));
        c.num_logit_rows = n;
      }
      for (int b = 0; b < blocks_per_sequence; ++b) c.block_table.push_back(s * blocks_per_sequence + b);
      c.wants_logits = true;
      c.state_slot = s;
      computed[s] += static_cast<int>(c.tokens.size());
      batch.chunks.push_back(std::move(c));
    }
    std::vector<float> logits(static_cast<size_t>(batch.NumLogitRows()) * vocab);
    st = runner.Forward(batch, logits.data());
    if (!st.ok()) return st;
    size_t r = 0;
    for (int s = 0; s < S; ++s)
      for (int i = 0; i < batch.chunks[s].num_logit_rows; ++i, ++r)
        out[s].emplace_back(logits.begin() + r * vocab, logits.begin() + (r + 1) * vocab);
  }
  return out;
}

}  // namespace exl3::engine::testing
