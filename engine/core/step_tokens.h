// A step's tokens laid out flat, in chunk order, with what each layer needs to know per token.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "engine/core/model_runner.h"

namespace exl3::engine {

struct StepTokens {
  const StepBatch* batch = nullptr;
  int num_tokens = 0;
  std::vector<int32_t> token_ids;      // [num_tokens]
  std::vector<int32_t> positions;      // [num_tokens]
  std::vector<int32_t> chunk_of;       // [num_tokens]: index into batch->chunks
  std::vector<int32_t> seq_len_after;  // [num_tokens]: its sequence's length after this step
  std::vector<int32_t> logit_tokens;   // tokens whose logits are wanted, in step order

  const std::vector<int32_t>& block_table(int t) const { return batch->chunks[chunk_of[t]].block_table; }
};

// Flattens `batch`, checking what the model relies on: token ids in [0, vocab), a block table
// covering every position, block ids in [0, num_blocks), positions within max_context.
absl::Status FlattenStep(const StepBatch& batch, int vocab_size, const KvCacheShape& cache,
                         int max_context, StepTokens* out);

// The step's chunks as runs of consecutive tokens (what recurrent layers walk chunk by chunk).
struct ChunkRun {
  int chunk = 0;        // index into the step's chunks
  int first_token = 0;  // in the flattened step
  int num_tokens = 0;
};
std::vector<ChunkRun> ChunkRuns(const StepTokens& tokens);

}  // namespace exl3::engine
