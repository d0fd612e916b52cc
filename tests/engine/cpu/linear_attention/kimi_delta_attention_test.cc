// engine/cpu/linear_attention/kimi_delta_attention: a layer's prefill in chunks of several tokens (the chunked form of
// engine/cpu/linear_attention/kimi_delta_rule.h) against the same tokens fed one per step (the recurrent form), outputs
// and the state left, on the glm5_next_experts fixture's KDA layer with random inputs, chunks of
// 1, 3, 63, 64, 65 and 130 tokens, the forget gate with its lower bound and without. The GPU layer
// (engine/cuda/cuda_kimi_delta_attention.h) runs every chunk in the recurrent form, so this is the
// part of its difference to the CPU layer that is the CPU's (tests/engine/cuda/kda_test.cc bounds
// the whole at 1e-4); lines "kda-cpu ..." give the numbers.
#include "engine/config/read_model_config.h"
#include "engine/cpu/linear_attention/kimi_delta_attention.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/cpu/cpu_compute.h"
#include "engine/config/glm5next_config.h"
#include "engine/config/model_config.h"
#include "engine/cpu/sequence_state.h"
#include "engine/core/step_tokens.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"
#include "tests/engine/relative_error.h"

namespace exl3::engine {
namespace {

constexpr char kFixture[] = "tests/fixtures/engine/glm5_next_experts";
constexpr int kSlots = 6, kBlockSize = 16, kBlocksPerSequence = 16;

// A step of one chunk per (sequence, first position, tokens).
StepBatch Batch(const std::vector<std::array<int, 3>>& chunks) {
  StepBatch batch;
  for (const auto& [seq, start, n] : chunks) {
    SequenceChunk c;
    c.sequence_id = seq;
    c.tokens.assign(n, 1);
    c.start_position = start;
    for (int b = 0; b < kBlocksPerSequence; ++b) c.block_table.push_back(seq * kBlocksPerSequence + b);
    c.state_slot = seq;
    c.wants_logits = true;
    batch.chunks.push_back(std::move(c));
  }
  return batch;
}

class KdaChunkedAgainstRecurrentTest : public ::testing::TestWithParam<bool> {};

TEST_P(KdaChunkedAgainstRecurrentTest, PrefillInChunksMatchesTokenByToken) {
  const bool lower_bound = GetParam();
  auto cfg = LoadModelConfig(kFixture);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  ASSERT_NE(cfg->glm5next, nullptr);
  if (!lower_bound) {
    auto g = std::make_shared<Glm5NextConfig>(*cfg->glm5next);
    g->gate_lower_bound.reset();
    cfg->glm5next = g;
  }
  ASSERT_TRUE(cfg->IsLinearAttentionLayer(0));
  auto src = TensorSource::Open(kFixture);
  ASSERT_TRUE(src.ok()) << src.status();
  auto layer = KimiDeltaAttention::Load(*cfg, **src, 0);
  ASSERT_TRUE(layer.ok()) << layer.status();
  auto floats = StateFloatsPerLayer(*cfg, kSlots);
  ASSERT_TRUE(floats.ok()) << floats.status();
  auto chunked_states = SequenceStateStore::Create(*floats, kSlots);
  auto token_states = SequenceStateStore::Create(*floats, kSlots);
  ASSERT_TRUE(chunked_states.ok() && token_states.ok());
  CpuCompute compute(2);
  const int H = cfg->hidden_size;
  const KvCacheShape cache{kSlots * kBlocksPerSequence, kBlockSize, kSlots};
  const std::vector<int> lengths = {1, 3, 63, 64, 65, 130};

  // One step: every sequence's prefill as one chunk.
  std::vector<std::array<int, 3>> chunks;
  for (int s = 0; s < kSlots; ++s) chunks.push_back({s, 0, lengths[s]});
  const StepBatch batch = Batch(chunks);
  StepTokens tokens;
  ASSERT_TRUE(FlattenStep(batch, cfg->vocab_size, cache, cfg->max_position_embeddings, &tokens).ok());
  std::mt19937 rng(37);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(tokens.num_tokens) * H);
  for (float& v : x) v = normal(rng);
  std::vector<float> chunked(x.size());
  ASSERT_TRUE((*chunked_states)->BeginStep(batch).ok());
  ASSERT_TRUE((*layer)->Forward(x.data(), tokens, **chunked_states, chunked.data(), compute).ok());
  (*chunked_states)->CommitStep(batch);

  // The same tokens one per sequence and step.
  std::vector<int> first_row(kSlots, 0);
  for (int s = 1; s < kSlots; ++s) first_row[s] = first_row[s - 1] + lengths[s - 1];
  std::vector<float> by_token(x.size());
  for (int j = 0; j < lengths.back(); ++j) {
    std::vector<std::array<int, 3>> step;
    std::vector<float> xs;
    for (int s = 0; s < kSlots; ++s) {
      if (j >= lengths[s]) continue;
      step.push_back({s, j, 1});
      const float* row = &x[static_cast<size_t>(first_row[s] + j) * H];
      xs.insert(xs.end(), row, row + H);
    }
    const StepBatch b = Batch(step);
    StepTokens t;
    ASSERT_TRUE(FlattenStep(b, cfg->vocab_size, cache, cfg->max_position_embeddings, &t).ok());
    std::vector<float> out(xs.size());
    ASSERT_TRUE((*token_states)->BeginStep(b).ok());
    ASSERT_TRUE((*layer)->Forward(xs.data(), t, **token_states, out.data(), compute).ok());
    (*token_states)->CommitStep(b);
    for (size_t i = 0; i < step.size(); ++i) {
      const int s = step[i][0];
      std::copy_n(&out[i * H], H, &by_token[static_cast<size_t>(first_row[s] + j) * H]);
    }
  }

  const int64_t state_floats = cfg->StateFloats(0);
  for (int s = 0; s < kSlots; ++s) {
    const size_t b = static_cast<size_t>(first_row[s]) * H, e = b + static_cast<size_t>(lengths[s]) * H;
    const double out_rel = testing::RelativeError(std::vector<float>(chunked.begin() + b, chunked.begin() + e),
                                                  std::vector<float>(by_token.begin() + b, by_token.begin() + e));
    const float* cs = (*chunked_states)->Current(0, s);
    const float* ts = (*token_states)->Current(0, s);
    const double state_rel = testing::RelativeError(std::vector<float>(cs, cs + state_floats),
                                                    std::vector<float>(ts, ts + state_floats));
    std::printf("kda-cpu %s chunk %d: chunked against token by token out rel %.2e state rel %.2e\n",
                lower_bound ? "lower-bound" : "softplus", lengths[s], out_rel, state_rel);
    EXPECT_LT(out_rel, 1e-5) << "chunk " << lengths[s];
    EXPECT_LT(state_rel, 1e-5) << "chunk " << lengths[s];
  }
}

INSTANTIATE_TEST_SUITE_P(Gates, KdaChunkedAgainstRecurrentTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return std::string(info.param ? "LowerBound" : "Softplus");
                         });

}  // namespace
}  // namespace exl3::engine
