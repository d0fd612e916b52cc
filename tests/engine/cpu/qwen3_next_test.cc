// Qwen3NextForCausalLM in the CPU engine: its config.json as transformers 5.x writes it
// (layer_types, the DeltaNet shape, the per-layer cache and state footprint), the transformers
// fixtures (tests/fixtures/engine/qwen3_next_*) with every prompt batched together, and the
// engine's handling of the per-sequence recurrent state: batching and preemption give
// transformers' tokens, prefix caching is off, and a failed step's chunks run again from the
// state before it.
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>

#include "engine/config/read_model_config.h"
#include "engine/cpu/cpu_model.h"
#include "engine/core/engine.h"
#include "engine/cpu/local_moe.h"
#include "engine/config/model_config.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"
#include "nlohmann/json.hpp"
#include "tests/engine/engine_requests.h"
#include "tests/engine/model_harness.h"
#include "tests/engine/relative_error.h"
#include "tests/engine/transformers_engine_test.h"

namespace exl3::engine {
namespace {

using nlohmann::json;
using testing::Greedy32;
using testing::Int32Rows;

// A small Qwen3NextConfig().to_dict() (field names as transformers 5.24 writes them).
json Qwen3Next() {
  return json::parse(R"({
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 128,
    "hidden_size": 256, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "hidden_act": "silu",
    "max_position_embeddings": 256, "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default",
                        "partial_rotary_factor": 0.25},
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 32,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "decoder_sparse_step": 1,
    "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128,
    "num_experts_per_tok": 2, "num_experts": 8, "norm_topk_prob": true, "mlp_only_layers": [],
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
  })");
}

absl::StatusOr<ModelConfig> Parse(const json& j) { return ParseModelConfig(j.dump(), "config.json"); }

TEST(Qwen3NextConfig, ReadsLayerTypesTheDeltaNetShapeAndTheGatedAttention) {
  auto cfg = Parse(Qwen3Next());
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_EQ(cfg->layer_mixers,
            (std::vector<TokenMixer>{TokenMixer::kLinearAttention, TokenMixer::kLinearAttention,
                                     TokenMixer::kLinearAttention, TokenMixer::kAttention}));
  EXPECT_EQ(cfg->attention, AttentionKind::kGqa);
  EXPECT_TRUE(cfg->attention_output_gate);
  EXPECT_TRUE(cfg->qk_norm);
  EXPECT_EQ(cfg->norm_weights, NormWeightConvention::kOffsetFromOne);
  EXPECT_EQ(cfg->rope.rotary_dim, 16);
  const LinearAttentionConfig& la = cfg->linear_attention;
  EXPECT_EQ(la.key_dim(), 128);
  EXPECT_EQ(la.value_dim(), 128);
  EXPECT_EQ(la.conv_channels(), 384);
  // Linear-attention layers have no KV cache; their state: 3 conv inputs of 384 channels and a
  // 64 x 32 matrix per value head.
  EXPECT_EQ(cfg->KvWidth(0), 0);
  EXPECT_EQ(cfg->KvWidth(3), 2 * 1 * 64);
  EXPECT_EQ(cfg->KvFloatsPerToken(), 128);
  EXPECT_EQ(cfg->StateFloats(0), 3 * 384 + 4 * 64 * 32);
  EXPECT_EQ(cfg->StateFloats(3), 0);
  EXPECT_TRUE(cfg->HasRecurrentLayers());
  const ModelInfo info = ModelInfoFor(*cfg, "/models/q", "");
  EXPECT_EQ(info.state_bytes_per_sequence, 2 * 3 * (3 * 384 + 4 * 64 * 32) * 4);  // two copies
}

TEST(Qwen3NextConfig, DefaultsAsQwen3NextConfigHasThem) {
  json j = Qwen3Next();
  for (const char* k : {"layer_types", "linear_num_key_heads", "linear_num_value_heads",
                        "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim"})
    j.erase(k);
  j["rope_parameters"].erase("partial_rotary_factor");
  j["num_hidden_layers"] = 8;
  auto cfg = Parse(j);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  // Every 4th layer full attention (full_attention_interval 4).
  for (int l = 0; l < 8; ++l) EXPECT_EQ(cfg->IsLinearAttentionLayer(l), l % 4 != 3) << l;
  EXPECT_EQ(cfg->linear_attention.num_key_heads, 16);
  EXPECT_EQ(cfg->linear_attention.num_value_heads, 32);
  EXPECT_EQ(cfg->linear_attention.key_head_dim, 128);
  EXPECT_EQ(cfg->linear_attention.value_head_dim, 128);
  EXPECT_EQ(cfg->linear_attention.conv_kernel, 4);
  EXPECT_EQ(cfg->rope.rotary_dim, 16);  // partial_rotary_factor 0.25 of head_dim 64
  j["full_attention_interval"] = 2;
  cfg = Parse(j);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  for (int l = 0; l < 8; ++l) EXPECT_EQ(cfg->IsLinearAttentionLayer(l), l % 2 == 0) << l;
}

TEST(Qwen3NextConfig, RefusesBadLayerTypesAndShapes) {
  auto refused = [](json j, const std::string& words) {
    auto cfg = Parse(j);
    ASSERT_FALSE(cfg.ok());
    EXPECT_NE(std::string(cfg.status().message()).find(words), std::string::npos) << cfg.status();
  };
  json j = Qwen3Next();
  j["layer_types"][1] = "sliding_attention";
  refused(j, "sliding_attention");
  j = Qwen3Next();
  j["layer_types"].erase(0);
  refused(j, "layer_types must list the 4 layers");
  j = Qwen3Next();
  j["linear_num_value_heads"] = 3;
  refused(j, "value heads a multiple of key heads");
  j = Qwen3Next();
  j["hidden_act"] = "gelu";
  refused(j, "hidden_act");
  j["hidden_act"] = 7;
  refused(j, "hidden_act '7'");
  j = Qwen3Next();
  j["linear_key_head_dim"] = 1 << 22;
  refused(j, "not a real shape");
}

// ---------------------------------------------------------------------------------------------
// The transformers fixtures.

using testing::RelativeError;

std::string FixtureDir(const std::string& name) { return "tests/fixtures/engine/" + name; }

class Qwen3NextFixtureTest : public ::testing::TestWithParam<const char*> {};

// All four prompts in the same steps: prefill chunks of 7 beside other sequences' decode tokens
// (the shorter prompts start decoding while the longer ones still prefill), then decode together;
// each sequence's first 32 tokens and their logits against transformers'.
TEST_P(Qwen3NextFixtureTest, BatchedSequencesGiveTransformersTokensAndLogits) {
  const std::string dir = FixtureDir(GetParam());
  auto ref = TensorSource::Open(dir + "/reference.safetensors");
  ASSERT_TRUE(ref.ok()) << ref.status();
  const auto prompts = Int32Rows(**ref, "prompt."), greedy = Int32Rows(**ref, "greedy.");
  ASSERT_EQ(prompts.size(), 4u);
  CpuModelOptions o;
  o.num_threads = 2;
  auto model = CpuModel::Open(dir, o);
  ASSERT_TRUE(model.ok()) << model.status();
  const int vocab = (*model)->info().vocab_size;
  const int steps = static_cast<int>(greedy[0].size());
  auto rows = testing::RunGreedy(**model, prompts, steps - 1, /*chunk=*/7);
  ASSERT_TRUE(rows.ok()) << rows.status();
  for (size_t i = 0; i < prompts.size(); ++i) {
    const std::vector<float> logits = *ToFloat32(*(*ref)->Get("logits." + std::to_string(i)));
    // The shorter prompts decode on while the longer ones prefill: their first rows are compared.
    ASSERT_GE((*rows)[i].size(), greedy[i].size());
    double worst = 0;
    for (int j = 0; j < steps; ++j) {
      const std::vector<float>& got = (*rows)[i][j];
      const int token = static_cast<int>(std::max_element(got.begin(), got.end()) - got.begin());
      EXPECT_EQ(token, greedy[i][j]) << "prompt " << i << " step " << j;
      worst = std::max(worst, RelativeError(got.data(), &logits[(prompts[i].size() - 1 + j) * vocab], vocab));
    }
    EXPECT_LT(worst, 1e-3) << "prompt " << i;
    std::printf("%s batched prompt %zu (%zu tokens): %d greedy tokens equal, worst logits rel err %.2e\n",
                GetParam(), i, prompts[i].size(), steps, worst);
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Qwen3NextFixtureTest,
                         ::testing::Values("qwen3_next_experts", "qwen3_next_all"));

// ---------------------------------------------------------------------------------------------
// The engine over the recurrent state.

constexpr char kFixture[] = "tests/fixtures/engine/qwen3_next_all";

class Qwen3NextEngineTest : public testing::TransformersEngineTest {
 protected:
  Qwen3NextEngineTest() : TransformersEngineTest(kFixture) {}
};

TEST_F(Qwen3NextEngineTest, BatchedPromptsGiveTransformersTokens) { ExpectBatchedPromptsGiveTransformersTokens(); }

TEST_F(Qwen3NextEngineTest, PreemptedSequencesRebuildTheirStateAndGiveTheSameTokens) {
  // Recomputed from position 0, their recurrent state with them.
  ExpectPreemptedSequencesGiveTransformersTokens();
}

TEST_F(Qwen3NextEngineTest, AFailedStepRunsAgainFromTheStateBeforeIt) {
  // The first full step (24 tokens: prompt chunks beside the decode tokens of sequences already
  // running) fails in layer 0's MoE, after layer 0's DeltaNet has written the new states; the
  // engine runs each chunk again alone, which must start from the states before the failed step.
  ExpectAFailedStepRunsAgainFromTheStateBeforeIt();
}

TEST_F(Qwen3NextEngineTest, PrefixCachingIsOffForRecurrentLayers) { ExpectPrefixCachingOff(); }

}  // namespace
}  // namespace exl3::engine
