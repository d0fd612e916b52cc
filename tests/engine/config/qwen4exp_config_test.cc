// Qwen4-Exp's config.json as transformers 5.25 writes it for Qwen4ExpForConditionalGeneration:
// the text model's fields nested in text_config, layer_types with indexed_attention, the QSA,
// hyper-connection and PLE fields (engine/config/qwen4exp_config.h).
#include "engine/config/read_model_config.h"
#include "engine/config/qwen4exp_config.h"

#include <string>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace exl3::engine {
namespace {

using nlohmann::json;

// The shape of the committed fixture (tests/fixtures/engine/qwen4_exp_*), as save_pretrained
// writes it (abridged: fields the engine does not read are left out).
json Config() {
  return json::parse(R"({
    "architectures": ["Qwen4ExpForConditionalGeneration"], "model_type": "qwen4_exp",
    "image_token_id": 120, "video_token_id": 121, "tie_word_embeddings": false,
    "text_config": {
      "model_type": "qwen4_exp_text", "vocab_size": 128, "hidden_size": 256,
      "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
      "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "hidden_act": "silu",
      "layer_types": ["linear_attention", "linear_attention", "indexed_attention"],
      "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64,
      "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
      "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
      "shared_expert_intermediate_size": 128, "norm_topk_prob": true,
      "hc_count": 4, "hc_lowrank": 128, "ple_layer_ids": [2], "ple_embed_dim": 256,
      "ple_conv_kernel_size": 4, "ngram_size": 3, "heads_per_ngram": 2,
      "ngram_vocab_size_base": 500, "make_ngram_vocab_size_divisible_by": 128, "seed": 1234,
      "split_ngram_parts": 16, "indexer_n_heads": 2, "indexer_kv_heads": 1,
      "indexer_head_dim": 64, "indexer_budget": 8, "indexer_compress_ratio": 4,
      "output_gate_type": "sigmoid", "eos_token_id": 1,
      "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                          "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                          "mrope_interleaved": true}
    },
    "vision_config": {"model_type": "qwen4_exp_vision", "depth": 1, "hidden_size": 32}
  })");
}

absl::StatusOr<ModelConfig> Parse(const json& j) { return ParseModelConfig(j.dump(), "config.json"); }

TEST(Qwen4ExpConfigTest, ReadsTheNestedTextConfig) {
  absl::StatusOr<ModelConfig> cfg = Parse(Config());
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_EQ(cfg->moe.family, MoeFamily::kQwen4Exp);
  EXPECT_EQ(TextModelPrefix(cfg->moe), "model.language_model.");
  EXPECT_EQ(cfg->attention, AttentionKind::kQsa);
  EXPECT_EQ(cfg->hidden_size, 256);
  EXPECT_EQ(cfg->num_layers, 3);
  EXPECT_EQ(cfg->vocab_size, 128);
  EXPECT_TRUE(cfg->qk_norm);
  EXPECT_TRUE(cfg->attention_output_gate);
  EXPECT_EQ(cfg->norm_weights, NormWeightConvention::kOffsetFromOne);
  EXPECT_EQ(cfg->rope.rotary_dim, 16);
  EXPECT_EQ(cfg->rope.layout, RopeLayout::kHalfSplit);
  ASSERT_EQ(cfg->layer_mixers.size(), 3u);
  EXPECT_EQ(cfg->layer_mixers[0], TokenMixer::kLinearAttention);
  EXPECT_EQ(cfg->layer_mixers[2], TokenMixer::kAttention);
  for (int l = 0; l < 3; ++l) EXPECT_TRUE(cfg->IsMoeLayer(l)) << l;
  EXPECT_TRUE(cfg->moe.shared_expert_gated);
  EXPECT_EQ(cfg->moe.shared_intermediate_size, 128);
  EXPECT_EQ(SharedExpertPrefix(cfg->moe, 1, Projection::kUp),
            "model.language_model.layers.1.mlp.shared_expert.up_proj");
  EXPECT_EQ(RoutedExpertPrefix(cfg->moe, 2, 5, Projection::kDown),
            "model.language_model.layers.2.mlp.experts.5.down_proj");
  const Qwen4ExpConfig& q = *cfg->qwen4exp;
  EXPECT_EQ(q.hc_count, 4);
  EXPECT_EQ(q.hc_lowrank, 128);
  EXPECT_EQ(q.indexer.num_heads, 2);
  EXPECT_EQ(q.indexer.head_dim, 64);
  EXPECT_EQ(q.indexer.block_topk(), 2);
  EXPECT_EQ(q.output_gate, OutputGateActivation::kSigmoid);
  EXPECT_EQ(q.ple.layers, std::vector<int>{1});
  EXPECT_EQ(q.ple.PleIndex(1), 0);
  EXPECT_EQ(q.ple.PleIndex(0), -1);
  EXPECT_EQ(q.ple.num_heads(), 4);
  EXPECT_EQ(q.ple.head_dim(), 64);
  EXPECT_EQ(q.ple.eos_token_id, 1);
  EXPECT_EQ(q.ple.split_parts, 16);
  ASSERT_EQ(cfg->media_placeholders.size(), 2u);  // refused in prompts (engine/core/engine.cc)
  EXPECT_EQ(cfg->media_placeholders[0].token_id, 120);
  EXPECT_EQ(cfg->media_placeholders[0].kind, "image");
  EXPECT_EQ(cfg->media_placeholders[1].token_id, 121);
  // KV slot: k and v of the KV head, then the raw indexer key; state: DeltaNet layers, plus
  // the PLE context and conv state on layer 1.
  EXPECT_EQ(cfg->KvWidth(2), 2 * 64 + 64);
  EXPECT_EQ(cfg->KvWidth(0), 0);
  const int64_t deltanet = cfg->linear_attention.ConvStateFloats() + cfg->linear_attention.RecurrentStateFloats();
  EXPECT_EQ(cfg->StateFloats(0), deltanet);
  EXPECT_EQ(cfg->StateFloats(1), deltanet + 2 + 9 * 4 * 256);
  EXPECT_EQ(cfg->StateFloats(2), 0);
}

TEST(Qwen4ExpConfigTest, DefaultsAreTransformers) {
  json j = Config();
  json& t = j["text_config"];
  for (const char* f : {"layer_types", "rope_parameters", "output_gate_type", "hc_count",
                        "hc_lowrank", "ple_embed_dim", "split_ngram_parts"})
    t.erase(f);
  t["num_hidden_layers"] = 4;
  t["ple_layer_ids"] = {1};
  t["head_dim"] = 64;
  absl::StatusOr<ModelConfig> cfg = Parse(j);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  // Every 4th layer indexed; partial_rotary_factor 1.0 (not Qwen3.5's 0.25); silu gate.
  EXPECT_EQ(cfg->layer_mixers[3], TokenMixer::kAttention);
  EXPECT_EQ(cfg->layer_mixers[2], TokenMixer::kLinearAttention);
  EXPECT_EQ(cfg->rope.rotary_dim, 64);
  EXPECT_EQ(cfg->qwen4exp->output_gate, OutputGateActivation::kSilu);
  EXPECT_EQ(cfg->qwen4exp->hc_count, 4);
  EXPECT_EQ(cfg->qwen4exp->hc_lowrank, 320);
  EXPECT_EQ(cfg->qwen4exp->ple.embed_dim, 256);
  EXPECT_EQ(cfg->qwen4exp->ple.split_parts, 512);
}

TEST(Qwen4ExpConfigTest, FullAttentionIsReadAsIndexed) {
  json j = Config();
  j["text_config"]["layer_types"] = {"linear_attention", "linear_attention", "full_attention"};
  absl::StatusOr<ModelConfig> cfg = Parse(j);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_EQ(cfg->layer_mixers[2], TokenMixer::kAttention);
}

// Each refusal names what is wrong.
TEST(Qwen4ExpConfigTest, RefusesByName) {
  struct Case {
    const char* what;
    std::function<void(json&)> edit;
    const char* expect;
  };
  const Case cases[] = {
      // Without text_config the file is read flat, as transformers does: the text fields are missing.
      {"no text_config", [](json& j) { j.erase("text_config"); }, "hidden_size"},
      {"unknown layer type", [](json& j) { j["text_config"]["layer_types"][2] = "sliding_attention"; },
       "sliding_attention"},
      {"missing indexer field", [](json& j) { j["text_config"].erase("indexer_budget"); }, "indexer_budget"},
      {"two indexer key heads", [](json& j) { j["text_config"]["indexer_kv_heads"] = 2; }, "indexer_kv_heads"},
      {"budget not a multiple", [](json& j) { j["text_config"]["indexer_budget"] = 10; }, "indexer_budget"},
      {"rope wider than the index head", [](json& j) { j["text_config"]["indexer_head_dim"] = 8; },
       "indexer_head_dim"},
      {"PLE on attention", [](json& j) { j["text_config"]["ple_layer_ids"] = {3}; }, "ple_layer_ids"},
      {"PLE layer out of range", [](json& j) { j["text_config"]["ple_layer_ids"] = {0}; }, "ple_layer_ids"},
      {"PLE dim not divisible", [](json& j) { j["text_config"]["ple_embed_dim"] = 250; }, "ple_embed_dim"},
      {"PLE without eos", [](json& j) { j["text_config"].erase("eos_token_id"); }, "eos_token_id"},
      {"gate activation", [](json& j) { j["text_config"]["output_gate_type"] = "gelu"; }, "output_gate_type"},
      {"one stream", [](json& j) { j["text_config"]["hc_count"] = 1; }, "hc_count"},
      {"hidden_act", [](json& j) { j["text_config"]["hidden_act"] = "gelu"; }, "hidden_act"},
  };
  for (const Case& c : cases) {
    json j = Config();
    c.edit(j);
    absl::StatusOr<ModelConfig> cfg = Parse(j);
    ASSERT_FALSE(cfg.ok()) << c.what;
    EXPECT_NE(std::string(cfg.status().message()).find(c.expect), std::string::npos)
        << c.what << ": " << cfg.status();
  }
}

}  // namespace
}  // namespace exl3::engine
