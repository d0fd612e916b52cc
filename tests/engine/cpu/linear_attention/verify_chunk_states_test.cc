// The states a verify chunk keeps (engine/cpu/sequence_state.h) in each recurrent block: Qwen3-Next's
// gated DeltaNet (engine/cpu/linear_attention/gated_deltanet.h, fused projections), Qwen4-Exp's (separate
// projections) and its PLE layer (engine/cpu/residual/ple_layer.h), GLM-5.3-Flash's KDA
// (engine/cpu/linear_attention/kimi_delta_attention.h), on the *_experts fixtures' layers with random inputs and
// token ids. After a prefill of 7 tokens, a verify chunk of d + 1 = 5 tokens (the last token
// and 4 drafts) with a of them accepted (a = 0 .. 4) leaves, for the next chunk starting at
// 7 + a + 1, exactly the state that running only those a + 1 tokens one step each (plain
// decoding) leaves: equal bit for bit, the whole layer's state. The verify chunk's outputs equal
// decoding's as well, and a chunk continuing from a rolled-back state gives decoding's next output.
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/config/read_model_config.h"
#include "engine/cpu/cpu_compute.h"
#include "engine/cpu/linear_attention/gated_deltanet.h"
#include "engine/cpu/linear_attention/kimi_delta_attention.h"
#include "engine/config/model_config.h"
#include "engine/cpu/residual/ple_layer.h"
#include "engine/config/qwen4exp_config.h"
#include "engine/cpu/sequence_state.h"
#include "engine/core/step_tokens.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"
#include "tests/engine/one_chunk_step.h"
#include "tests/engine/relative_error.h"

namespace exl3::engine {
namespace {

constexpr int kPrefill = 7, kVerify = 5, kBlocks = 8, kBlockSize = 16;

// One recurrent block of one layer: x [T, width] in, out [T, width] (the PLE: h updated in place).
struct Block {
  int layer = 0;
  int width = 0;  // floats per token in and out
  std::function<absl::Status(const float* x, const StepTokens&, SequenceStateStore&, float* out, CpuCompute&)>
      forward;
};

struct Fixture {
  std::string dir;
  std::string block;  // "deltanet", "kda" or "ple"
};

class VerifyChunkStatesTest : public ::testing::TestWithParam<Fixture> {
 protected:
  void SetUp() override {
    auto cfg = LoadModelConfig(GetParam().dir);
    ASSERT_TRUE(cfg.ok()) << cfg.status();
    cfg_ = std::make_unique<ModelConfig>(*cfg);
    auto src = TensorSource::Open(GetParam().dir);
    ASSERT_TRUE(src.ok()) << src.status();
    src_ = std::move(*src);
    const std::string& kind = GetParam().block;
    if (kind == "ple") {
      block_.layer = cfg_->qwen4exp->ple.layers.at(0);
      auto ple = PleLayer::Load(*cfg_, *src_, block_.layer);
      ASSERT_TRUE(ple.ok()) << ple.status();
      std::shared_ptr<PleLayer> p = std::move(*ple);
      block_.width = cfg_->qwen4exp->hc_count * cfg_->hidden_size;
      const int width = block_.width;
      block_.forward = [p, width](const float* x, const StepTokens& t, SequenceStateStore& s, float* out,
                                  CpuCompute& c) {
        std::copy_n(x, static_cast<size_t>(t.num_tokens) * width, out);
        return p->Forward(out, t, s, c);
      };
    } else {
      while (!cfg_->IsLinearAttentionLayer(block_.layer)) ++block_.layer;
      std::shared_ptr<LinearAttention> a;
      if (kind == "kda") {
        auto k = KimiDeltaAttention::Load(*cfg_, *src_, block_.layer);
        ASSERT_TRUE(k.ok()) << k.status();
        a = std::move(*k);
      } else {
        auto g = GatedDeltaNet::Load(*cfg_, *src_, block_.layer);
        ASSERT_TRUE(g.ok()) << g.status();
        a = std::move(*g);
      }
      block_.width = cfg_->hidden_size;
      block_.forward = [a](const float* x, const StepTokens& t, SequenceStateStore& s, float* out, CpuCompute& c) {
        return a->Forward(x, t, s, out, c);
      };
    }
    std::mt19937 rng(31);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_int_distribution<int32_t> token(0, cfg_->vocab_size - 1);
    for (int i = 0; i < kPrefill + kVerify + 1; ++i) ids_.push_back(token(rng));
    x_.resize(ids_.size() * block_.width);
    for (float& v : x_) v = normal(rng);
  }

  std::unique_ptr<SequenceStateStore> Store(int max_kept_states) const {
    std::vector<int64_t> floats(cfg_->num_layers, 0);
    floats[block_.layer] = cfg_->StateFloats(block_.layer);
    auto s = SequenceStateStore::Create(floats, /*num_slots=*/1, max_kept_states);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? std::move(*s) : nullptr;
  }

  // Tokens [start, start + n) of the sequence as one chunk wanting `rows` logit rows; runs it
  // through the block and commits. Returns its outputs.
  std::vector<float> Run(SequenceStateStore& store, int start, int n, int rows) {
    const StepBatch batch = testing::OneChunkStep(ids_, start, n, kBlocks, rows);
    StepTokens tokens;
    const absl::Status flat =
        FlattenStep(batch, cfg_->vocab_size, KvCacheShape{kBlocks, kBlockSize, 1}, cfg_->max_position_embeddings, &tokens);
    EXPECT_TRUE(flat.ok()) << flat;
    const absl::Status begun = store.BeginStep(batch);
    EXPECT_TRUE(begun.ok()) << begun;
    std::vector<float> out(static_cast<size_t>(n) * block_.width);
    const absl::Status ran =
        block_.forward(&x_[static_cast<size_t>(start) * block_.width], tokens, store, out.data(), compute_);
    EXPECT_TRUE(ran.ok()) << ran;
    store.CommitStep(batch);
    return out;
  }

  // The layer's state the slot holds for a chunk starting at `length` (checked by BeginStep).
  std::vector<float> StateAt(SequenceStateStore& store, int length) {
    StepBatch batch;
    SequenceChunk c;
    c.sequence_id = 1;
    c.tokens = {ids_[length]};
    c.start_position = length;
    batch.chunks.push_back(c);
    const absl::Status begun = store.BeginStep(batch);
    EXPECT_TRUE(begun.ok()) << begun;
    const float* s = store.Current(block_.layer, 0);
    return std::vector<float>(s, s + store.floats(block_.layer));
  }

  std::unique_ptr<ModelConfig> cfg_;
  std::unique_ptr<TensorSource> src_;
  Block block_;
  std::vector<int32_t> ids_;
  std::vector<float> x_;
  CpuCompute compute_{2};
};

bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST_P(VerifyChunkStatesTest, AcceptedPrefixStateEqualsDecodingsBitForBit) {
  // Plain decoding: the prefill, then one token per step; the state after each length.
  std::unique_ptr<SequenceStateStore> plain = Store(1);
  Run(*plain, 0, kPrefill, 1);
  std::vector<std::vector<float>> decoded_states, decoded_out;
  for (int j = 0; j <= kVerify; ++j) {
    decoded_out.push_back(Run(*plain, kPrefill + j, 1, 1));
    std::unique_ptr<SequenceStateStore> probe = Store(1);  // the state after length kPrefill + j + 1
    Run(*probe, 0, kPrefill, 1);
    for (int i = 0; i <= j; ++i) Run(*probe, kPrefill + i, 1, 1);
    decoded_states.push_back(StateAt(*probe, kPrefill + j + 1));
  }
  bool any_nonzero = false;
  for (float v : decoded_states[0]) any_nonzero |= v != 0.0f;
  ASSERT_TRUE(any_nonzero) << "the block keeps no state in layer " << block_.layer;

  for (int accepted = 0; accepted < kVerify; ++accepted) {
    std::unique_ptr<SequenceStateStore> spec = Store(kVerify);
    Run(*spec, 0, kPrefill, 1);
    const std::vector<float> out = Run(*spec, kPrefill, kVerify, kVerify);
    for (int j = 0; j < kVerify; ++j) {
      const std::vector<float> row(out.begin() + static_cast<size_t>(j) * block_.width,
                                   out.begin() + static_cast<size_t>(j + 1) * block_.width);
      // The projections run over 5 rows here and 1 in decoding: the same up to fp32 rounding.
      EXPECT_LT(testing::RelativeError(row, decoded_out[j]), 1e-6) << "verify row " << j;
    }
    // The scheduler kept a + 1 of the chunk's tokens: the next chunk starts after them.
    const int length = kPrefill + accepted + 1;
    EXPECT_TRUE(BitEqual(StateAt(*spec, length), decoded_states[accepted]))
        << GetParam().block << " layer " << block_.layer << ": the state after a verify chunk with " << accepted
        << " drafts accepted differs from decoding's";
    // Resuming there: the rolled-back state goes on as decoding's (and the other lengths are gone).
    const std::vector<float> next = Run(*spec, length, 1, 1);
    EXPECT_LT(testing::RelativeError(next, decoded_out[accepted + 1]), 1e-6);
    EXPECT_TRUE(BitEqual(StateAt(*spec, length + 1), decoded_states[accepted + 1]));
  }
}

TEST_P(VerifyChunkStatesTest, AChunkResumingAtALengthTheSlotDoesNotHoldIsRefused) {
  std::unique_ptr<SequenceStateStore> spec = Store(kVerify);
  Run(*spec, 0, kPrefill, 1);
  Run(*spec, kPrefill, kVerify, kVerify);  // holds lengths kPrefill + 1 .. kPrefill + kVerify
  for (int length : {kPrefill, kPrefill + kVerify + 1}) {
    StepBatch batch;
    SequenceChunk c;
    c.sequence_id = 1;
    c.tokens = {ids_[length]};
    c.start_position = length;
    batch.chunks.push_back(c);
    const absl::Status st = spec->BeginStep(batch);
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << length << ": " << st;
  }
}

INSTANTIATE_TEST_SUITE_P(Blocks, VerifyChunkStatesTest,
                         ::testing::Values(Fixture{"tests/fixtures/engine/qwen3_next_experts", "deltanet"},
                                           Fixture{"tests/fixtures/engine/qwen4_exp_experts", "deltanet"},
                                           Fixture{"tests/fixtures/engine/qwen4_exp_experts", "ple"},
                                           Fixture{"tests/fixtures/engine/glm5_next_experts", "kda"}),
                         [](const ::testing::TestParamInfo<Fixture>& info) {
                           std::string name = info.param.dir.substr(info.param.dir.rfind('/') + 1) + "_" +
                                              info.param.block;
                           return name;
                         });

}  // namespace
}  // namespace exl3::engine
