// engine/config/glm5next_config: Glm5NextForConditionalGeneration's config.json as transformers 5.25
// writes it (text_config nested beside vision_config; the flat form transformers also reads),
// Glm5NextTextConfig's defaults, the indexer schedule's forms, and the refusals by name.
#include "engine/config/read_model_config.h"
#include "engine/config/glm5next_config.h"

#include <cmath>
#include <string>

#include "gtest/gtest.h"
#include "model/config/read_moe_config.h"
#include "model/moe_config.h"
#include "nlohmann/json.hpp"

namespace exl3::engine {
namespace {

using nlohmann::json;

// The text part of a small Glm5NextConfig(...).to_dict(), as transformers 5.25 writes it.
json TextConfig() {
  return json::parse(R"({
    "attention_bias": false, "attention_dropout": 0.0, "bos_token_id": null, "eos_token_id": null,
    "hc_eps": 1e-06, "hc_mult": 4, "hc_sinkhorn_iters": 20, "head_dim": 0, "hidden_act": "silu",
    "hidden_size": 256, "index_head_dim": 64, "index_kpool": 4,
    "index_kpool_always_select_tail": true, "index_n_heads": 4, "index_topk": 8,
    "indexer_types": ["full", "full", "shared", "shared"], "initializer_range": 0.02,
    "intermediate_size": 128, "kv_lora_rank": 128,
    "layer_types": ["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
    "linear_conv_kernel_dim": 4, "linear_head_dim": 64, "linear_lower_bound": -5.0,
    "linear_num_heads": 2, "max_position_embeddings": 128,
    "mlp_layer_types": ["dense", "sparse", "sparse", "dense"], "model_type": "glm5_next_text",
    "moe_intermediate_size": 128, "n_group": 1, "n_routed_experts": 8, "n_shared_experts": 1,
    "norm_topk_prob": true, "num_attention_heads": 2, "num_experts_per_tok": 2,
    "num_hidden_layers": 4, "num_key_value_heads": 2, "output_router_logits": false,
    "pad_token_id": 0, "q_lora_rank": 128, "qk_head_dim": 64, "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 0, "rms_norm_eps": 1e-05, "routed_scaling_factor": 2.5,
    "router_aux_loss_coef": 0.001, "swiglu_limit": 10.0, "tie_word_embeddings": false,
    "topk_group": 1, "use_cache": true, "v_head_dim": 64, "vocab_size": 128
  })");
}

json Nested(const json& text) {
  json j = {{"architectures", {"Glm5NextForConditionalGeneration"}},
            {"model_type", "glm5_next"},
            {"image_token_id", 154854},
            {"tie_word_embeddings", false},
            {"text_config", text},
            {"vision_config", {{"depth", 1}, {"hidden_size", 64}, {"model_type", "glm5_next_vision"}}}};
  return j;
}

json Flat(json text) {
  text["architectures"] = {"Glm5NextForConditionalGeneration"};
  text["model_type"] = "glm5_next";
  return text;
}

absl::StatusOr<ModelConfig> Parse(const json& j) { return ParseModelConfig(j.dump(), "config.json"); }

void ExpectSmallModel(const ModelConfig& c) {
  EXPECT_EQ(c.architecture(), "Glm5NextForConditionalGeneration");
  EXPECT_EQ(c.attention, AttentionKind::kPooledDsa);
  EXPECT_EQ(c.hidden_size, 256);
  EXPECT_EQ(c.num_layers, 4);
  EXPECT_EQ(c.vocab_size, 128);
  EXPECT_FLOAT_EQ(c.rms_norm_eps, 1e-5f);
  EXPECT_FLOAT_EQ(c.latent_norm_eps, 1e-5f);
  EXPECT_FLOAT_EQ(c.dense_swiglu_limit, 10.0f);
  EXPECT_FLOAT_EQ(c.moe.swiglu_limit, 10.0f);
  EXPECT_FLOAT_EQ(c.moe.shared_swiglu_limit, 10.0f);
  EXPECT_FLOAT_EQ(c.moe.routed_scaling_factor, 2.5f);
  EXPECT_EQ(c.moe.scoring, ScoringFunc::kSigmoid);
  EXPECT_TRUE(c.moe.has_correction_bias);
  EXPECT_EQ(c.moe.shared_intermediate_size, 128);
  // Layer schedule.
  EXPECT_TRUE(c.IsLinearAttentionLayer(0));
  EXPECT_FALSE(c.IsLinearAttentionLayer(1));
  EXPECT_FALSE(c.IsLinearAttentionLayer(2));
  EXPECT_TRUE(c.IsLinearAttentionLayer(3));
  EXPECT_FALSE(c.IsMoeLayer(0));
  EXPECT_TRUE(c.IsMoeLayer(1));
  EXPECT_TRUE(c.IsMoeLayer(2));
  EXPECT_FALSE(c.IsMoeLayer(3));
  EXPECT_TRUE(c.HasOwnIndexer(1));
  EXPECT_FALSE(c.HasOwnIndexer(2));
  EXPECT_FALSE(c.HasOwnIndexer(0));  // a KDA layer, whatever indexer_types says
  // NoPE MLA.
  EXPECT_EQ(c.q_lora_rank, 128);
  EXPECT_EQ(c.kv_lora_rank, 128);
  EXPECT_EQ(c.qk_nope_head_dim, 64);
  EXPECT_EQ(c.qk_rope_head_dim, 0);
  EXPECT_EQ(c.v_head_dim, 64);
  EXPECT_EQ(c.rope.rotary_dim, 0);
  EXPECT_FLOAT_EQ(c.attention_scale, 1.0f / 8.0f);
  EXPECT_EQ(c.indexer.num_heads, 4);
  EXPECT_EQ(c.indexer.head_dim, 64);
  EXPECT_EQ(c.indexer.topk, 8);
  ASSERT_NE(c.glm5next, nullptr);
  EXPECT_EQ(c.glm5next->index_kpool, 4);
  ASSERT_TRUE(c.glm5next->gate_lower_bound.has_value());
  EXPECT_FLOAT_EQ(*c.glm5next->gate_lower_bound, -5.0f);
  EXPECT_EQ(c.glm5next->hc_mult, 4);
  EXPECT_EQ(c.glm5next->hc_sinkhorn_iters, 20);
  EXPECT_FLOAT_EQ(c.glm5next->hc_eps, 1e-6f);
  // KDA: 2 heads of 64 for q, k and v; 4 conv taps.
  EXPECT_EQ(c.linear_attention.num_key_heads, 2);
  EXPECT_EQ(c.linear_attention.num_value_heads, 2);
  EXPECT_EQ(c.linear_attention.key_head_dim, 64);
  EXPECT_EQ(c.linear_attention.value_head_dim, 64);
  EXPECT_EQ(c.linear_attention.conv_channels(), 3 * 128);
  // Cache: KDA layers none; the full indexed layer its latent, indexer key and gate score; the
  // shared one its latent. State: conv inputs and S per KDA layer.
  EXPECT_EQ(c.KvWidth(0), 0);
  EXPECT_EQ(c.KvWidth(1), 128 + 2 * 64);
  EXPECT_EQ(c.KvWidth(2), 128);
  EXPECT_TRUE(c.HasRecurrentLayers());
  EXPECT_EQ(c.StateFloats(0), 3 * 384 + 2 * 64 * 64);
  EXPECT_EQ(c.StateFloats(1), 0);
  EXPECT_EQ(c.StateFloatsPerSequence(), 2 * (3 * 384 + 2 * 64 * 64));
}

TEST(Glm5NextConfig, ReadsTheNestedTextConfig) {
  auto cfg = Parse(Nested(TextConfig()));
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  ExpectSmallModel(*cfg);
}

// The image / video placeholders come from the top level, defaults included; those outside the
// vocabulary (the tiny model's 128) are left out, as they can never reach the model.
TEST(Glm5NextConfig, MediaPlaceholdersInsideTheVocabulary) {
  json text = TextConfig();
  text["vocab_size"] = 154880;
  auto cfg = Parse(Nested(text));
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  ASSERT_EQ(cfg->media_placeholders.size(), 2u);
  EXPECT_EQ(cfg->media_placeholders[0].token_id, 154854);
  EXPECT_EQ(cfg->media_placeholders[1].token_id, 154855);  // video_token_id's default
  EXPECT_EQ(cfg->media_placeholders[1].kind, "video");
  auto small = Parse(Nested(TextConfig()));
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_TRUE(small->media_placeholders.empty());
  json bad = Nested(TextConfig());
  bad["video_token_id"] = "x";
  EXPECT_FALSE(Parse(bad).ok());
}

TEST(Glm5NextConfig, ReadsTheFlatFormAlike) {
  auto cfg = Parse(Flat(TextConfig()));
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  ExpectSmallModel(*cfg);
}

TEST(Glm5NextConfig, TensorsLiveUnderTheLanguageModel) {
  auto moe = ParseMoeConfig(Nested(TextConfig()).dump(), "config.json");
  ASSERT_TRUE(moe.ok()) << moe.status();
  EXPECT_EQ(TextModelPrefix(*moe), "model.language_model.");
  EXPECT_EQ(RoutedExpertPrefix(*moe, 1, 3, Projection::kUp), "model.language_model.layers.1.mlp.experts.3.up_proj");
  EXPECT_EQ(SharedExpertPrefix(*moe, 2, Projection::kDown),
            "model.language_model.layers.2.mlp.shared_experts.down_proj");
  EXPECT_EQ(RouterWeightKey(*moe, 1), "model.language_model.layers.1.mlp.gate.weight");
  EXPECT_EQ(CorrectionBiasKey(*moe, 1), "model.language_model.layers.1.mlp.gate.e_score_correction_bias");
  EXPECT_EQ(HeadWeightKey(*moe), "lm_head.weight");
  // The other families keep "model.".
  json dsa = Flat(TextConfig());
  dsa["architectures"] = {"GlmMoeDsaForCausalLM"};
  auto other = ParseMoeConfig(dsa.dump(), "config.json");
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(TextModelPrefix(*other), "model.");
}

TEST(Glm5NextConfig, QuantizationConfigAtTheTopLevelIsRead) {
  json j = Nested(TextConfig());
  j["quantization_config"] = {{"quant_method", "exl3"}, {"bits", 4}};
  auto moe = ParseMoeConfig(j.dump(), "config.json");
  ASSERT_TRUE(moe.ok()) << moe.status();
  EXPECT_EQ(moe->quant_method, "exl3");
}

TEST(Glm5NextConfig, DefaultsOfGlm5NextTextConfig) {
  json t = TextConfig();
  for (const char* f : {"layer_types", "mlp_layer_types", "indexer_types", "linear_lower_bound",
                        "rms_norm_eps", "swiglu_limit", "hc_mult", "hc_sinkhorn_iters", "hc_eps",
                        "index_kpool"})
    t.erase(f);
  t["num_hidden_layers"] = 8;
  t["index_topk"] = 32;
  auto cfg = Parse(Nested(t));
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  for (int l = 0; l < 8; ++l) {
    EXPECT_EQ(cfg->IsLinearAttentionLayer(l), l % 4 != 3) << l;
    EXPECT_EQ(cfg->IsMoeLayer(l), l >= 3) << l;
    EXPECT_EQ(cfg->indexer.layer_modes[l], IndexerMode::kFull) << l;
  }
  EXPECT_FLOAT_EQ(cfg->rms_norm_eps, 1e-5f);
  EXPECT_FLOAT_EQ(cfg->moe.swiglu_limit, 10.0f);
  EXPECT_FLOAT_EQ(*cfg->glm5next->gate_lower_bound, -5.0f);
  EXPECT_EQ(cfg->glm5next->index_kpool, 16);
  EXPECT_EQ(cfg->glm5next->hc_mult, 4);
}

TEST(Glm5NextConfig, FullAttentionReadsAsIndexed) {
  json t = TextConfig();
  t["layer_types"] = {"linear_attention", "full_attention", "indexed_attention", "linear_attention"};
  auto cfg = Parse(Nested(t));
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_FALSE(cfg->IsLinearAttentionLayer(1));
}

TEST(Glm5NextConfig, DeepseekSparseAttentionReadsAsIndexed) {
  // The name exllamav3 reads and writes (tests/fixtures/exllamav3/glm5_next_b4).
  json t = TextConfig();
  t["layer_types"] = {"linear_attention", "deepseek_sparse_attention", "deepseek_sparse_attention",
                      "linear_attention"};
  auto cfg = Parse(Nested(t));
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_TRUE(cfg->IsLinearAttentionLayer(0));
  EXPECT_FALSE(cfg->IsLinearAttentionLayer(1));
  EXPECT_FALSE(cfg->IsLinearAttentionLayer(2));
}

TEST(Glm5NextConfig, IndexerScheduleFromThePatternString) {
  json t = TextConfig();
  t.erase("indexer_types");
  t["index_topk_pattern"] = "FFSF";
  auto cfg = Parse(Nested(t));
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_TRUE(cfg->HasOwnIndexer(1));
  EXPECT_FALSE(cfg->HasOwnIndexer(2));
  t["index_topk_pattern"] = {"F", "F", "S", "F"};
  cfg = Parse(Nested(t));
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_FALSE(cfg->HasOwnIndexer(2));
}

TEST(Glm5NextConfig, LinearAttnConfigDictAndNoLowerBound) {
  json t = TextConfig();
  t["linear_attn_config"] = {{"head_dim", 32}, {"num_heads", 4}, {"short_conv_kernel_size", 3}};
  auto cfg = Parse(Nested(t));
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_EQ(cfg->linear_attention.num_key_heads, 4);
  EXPECT_EQ(cfg->linear_attention.key_head_dim, 32);
  EXPECT_EQ(cfg->linear_attention.conv_kernel, 3);
  json u = TextConfig();
  u["linear_lower_bound"] = nullptr;
  cfg = Parse(Nested(u));
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_FALSE(cfg->glm5next->gate_lower_bound.has_value());
  // safe_gate (default true) puts the bound back.
  u["linear_attn_config"] = {{"gate_lower_bound", nullptr}};
  cfg = Parse(Nested(u));
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_FLOAT_EQ(*cfg->glm5next->gate_lower_bound, -5.0f);
}

void ExpectRefused(const json& t, const std::string& words) {
  auto cfg = Parse(Nested(t));
  ASSERT_FALSE(cfg.ok());
  EXPECT_NE(std::string(cfg.status().message()).find(words), std::string::npos) << cfg.status();
}

TEST(Glm5NextConfig, RefusesWhatTransformersRefusesByName) {
  json t = TextConfig();
  t["qk_rope_head_dim"] = 32;
  ExpectRefused(t, "NoPE");
  t = TextConfig();
  t["index_topk"] = 10;
  ExpectRefused(t, "multiple of index_kpool");
  t = TextConfig();
  t["num_key_value_heads"] = 1;
  ExpectRefused(t, "num_key_value_heads");
  t = TextConfig();
  t["q_lora_rank"] = nullptr;
  ExpectRefused(t, "q_lora_rank");
  // A shared layer after a KDA layer: transformers has no selection to hand it.
  t = TextConfig();
  t["indexer_types"] = {"full", "shared", "full", "full"};
  ExpectRefused(t, "indexed layer 1 is shared");
  t = TextConfig();
  t["layer_types"] = {"linear_attention", "indexed_attention", "indexed_attention", "indexed_attention"};
  t["indexer_types"] = {"full", "full", "shared", "shared"};
  ExpectRefused(t, "indexed layer 3 is shared");
}

TEST(Glm5NextConfig, RefusesWhatTheEngineDoesNotRun) {
  json t = TextConfig();
  t["index_kpool_always_select_tail"] = false;
  ExpectRefused(t, "index_kpool_always_select_tail");
  t = TextConfig();
  t["hidden_act"] = "gelu";
  ExpectRefused(t, "hidden_act");
  t = TextConfig();
  t["layer_types"] = {"linear_attention", "mamba", "indexed_attention", "linear_attention"};
  ExpectRefused(t, "layer_types");
}

}  // namespace
}  // namespace exl3::engine
