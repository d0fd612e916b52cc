// The tests that run an attention layer over a verify chunk with rejected drafts and compare it
// with a cache that never saw them (tests/engine/cpu/attention/dsv4_verify_chunk_test.cc,
// verify_chunk_indexers_test.cc): their random inputs, and one chunk through the layer.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "engine/config/model_config.h"
#include "engine/core/step_tokens.h"
#include "engine/cpu/attention/attention.h"
#include "engine/cpu/cpu_compute.h"
#include "engine/cpu/paged_kv_cache.h"
#include "gtest/gtest.h"
#include "tests/engine/one_chunk_step.h"

namespace exl3::engine::testing {

// For n positions: token ids in [0, vocab), each position's true input and a rejected draft's
// other input ([n, hidden] each, N(0, 1)); the same numbers every run (one seeded stream, in that
// order).
struct VerifyChunkInputs {
  std::vector<int32_t> ids;
  std::vector<float> true_x, rejected_x;
};

inline VerifyChunkInputs RandomVerifyChunkInputs(int n, int hidden, int vocab) {
  VerifyChunkInputs in;
  std::mt19937 rng(31);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int32_t> token(0, vocab - 1);
  for (int i = 0; i < n; ++i) in.ids.push_back(token(rng));
  in.true_x.resize(static_cast<size_t>(n) * hidden);
  in.rejected_x.resize(in.true_x.size());
  for (float& v : in.true_x) v = normal(rng);
  for (float& v : in.rejected_x) v = normal(rng);
  return in;
}

// Positions [start, start + x.size() / hidden) of `ids` as one chunk (OneChunkStep over
// `num_blocks` blocks) with inputs x, wanting `rows` logit rows (a verify chunk: rows > 1),
// through `a`; its outputs.
inline std::vector<float> RunOneChunk(Attention& a, const ModelConfig& cfg, const std::vector<int32_t>& ids,
                                      PagedKvCache& cache, int num_blocks, int start, const std::vector<float>& x,
                                      int rows, CpuCompute& compute) {
  const int n = static_cast<int>(x.size()) / cfg.hidden_size;
  const StepBatch batch = OneChunkStep(ids, start, n, num_blocks, rows);
  StepTokens tokens;
  const absl::Status flat = FlattenStep(batch, cfg.vocab_size, cache.shape(), cfg.max_position_embeddings, &tokens);
  EXPECT_TRUE(flat.ok()) << flat;
  AttentionCarry carry;
  std::vector<float> out(x.size());
  const absl::Status ran = a.Forward(x.data(), tokens, cache, carry, out.data(), compute);
  EXPECT_TRUE(ran.ok()) << ran;
  return out;
}

}  // namespace exl3::engine::testing
