// A step of one sequence's chunk, for the tests that drive a layer directly
// (tests/engine/cpu/linear_attention/verify_chunk_states_test.cc, verify_chunk_indexers_test.cc).
#pragma once

#include <cstdint>
#include <vector>

#include "engine/core/model_runner.h"

namespace exl3::engine::testing {

// Tokens [start, start + n) of `ids` as sequence 1's chunk over blocks 0 .. num_blocks - 1 (state
// slot 0), wanting the logit rows of its last `rows` tokens.
inline StepBatch OneChunkStep(const std::vector<int32_t>& ids, int start, int n, int num_blocks, int rows) {
  SequenceChunk c;
  c.sequence_id = 1;
  c.tokens.assign(ids.begin() + start, ids.begin() + start + n);
  c.start_position = start;
  for (int b = 0; b < num_blocks; ++b) c.block_table.push_back(b);
  c.wants_logits = true;
  c.num_logit_rows = rows;
  StepBatch batch;
  batch.chunks.push_back(std::move(c));
  return batch;
}

}  // namespace exl3::engine::testing
