// engine/config/model_config: GlmMoeDsaForCausalLM read as transformers 5.x writes it (MLA shape,
// the lightning indexer, indexer_types and the older index_topk_freq schedule, the cache's
// per-layer widths), and its refusals.
#include "engine/config/model_config.h"
#include "engine/config/read_model_config.h"

#include <cmath>
#include <string>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace exl3::engine {
namespace {

using nlohmann::json;

// A small GlmMoeDsaConfig().to_dict() (field names and layout as transformers 5.24 writes them).
json GlmMoeDsa() {
  return json::parse(R"({
    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "vocab_size": 128,
    "hidden_size": 256, "intermediate_size": 128, "moe_intermediate_size": 128,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
    "n_shared_experts": 1, "n_routed_experts": 8, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 128, "q_lora_rank": 128, "qk_rope_head_dim": 32, "v_head_dim": 96,
    "qk_nope_head_dim": 64, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2,
    "norm_topk_prob": true, "max_position_embeddings": 128, "rms_norm_eps": 1e-05,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "mlp_layer_types": ["dense", "sparse", "sparse"], "index_topk": 8, "index_head_dim": 128,
    "index_n_heads": 4, "head_dim": 32, "first_k_dense_replace": 1,
    "indexer_types": ["full", "shared", "full"], "qk_head_dim": 96
  })");
}

absl::StatusOr<ModelConfig> Parse(const json& j) { return ParseModelConfig(j.dump(), "config.json"); }

TEST(ModelConfigGlmMoeDsa, ReadsTheIndexerAndTheLatentShape) {
  auto cfg = Parse(GlmMoeDsa());
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_EQ(cfg->attention, AttentionKind::kDsa);
  EXPECT_TRUE(cfg->IsLatentAttention());
  EXPECT_EQ(cfg->q_lora_rank, 128);
  EXPECT_EQ(cfg->kv_lora_rank, 128);
  EXPECT_EQ(cfg->qk_nope_head_dim, 64);
  EXPECT_EQ(cfg->qk_rope_head_dim, 32);
  EXPECT_EQ(cfg->v_head_dim, 96);
  EXPECT_EQ(cfg->indexer.num_heads, 4);
  EXPECT_EQ(cfg->indexer.head_dim, 128);
  EXPECT_EQ(cfg->indexer.topk, 8);
  ASSERT_EQ(cfg->indexer.layer_modes.size(), 3u);
  EXPECT_TRUE(cfg->HasOwnIndexer(0));
  EXPECT_FALSE(cfg->HasOwnIndexer(1));
  EXPECT_TRUE(cfg->HasOwnIndexer(2));
  // The rope covers the whole rope head, interleaved; the softmax scale is qk_head_dim^-0.5.
  EXPECT_EQ(cfg->rope.rotary_dim, 32);
  EXPECT_EQ(cfg->rope.layout, RopeLayout::kInterleaved);
  EXPECT_FLOAT_EQ(cfg->attention_scale, 1.0f / std::sqrt(96.0f));
  // mlp_layer_types decides the MLPs.
  EXPECT_FALSE(cfg->IsMoeLayer(0));
  EXPECT_TRUE(cfg->IsMoeLayer(1));
  // The cache: latent + rope key everywhere, the indexer key on layers with their own indexer.
  EXPECT_EQ(cfg->KvWidth(0), 128 + 32 + 128);
  EXPECT_EQ(cfg->KvWidth(1), 128 + 32);
  EXPECT_EQ(cfg->KvFloatsPerToken(), 2 * (128 + 32 + 128) + (128 + 32));
}

TEST(ModelConfigGlmMoeDsa, PartialRotaryFactorAndRopeInterleaveDoNotApply) {
  json j = GlmMoeDsa();
  j["rope_parameters"]["partial_rotary_factor"] = 0.5;
  j["rope_interleave"] = false;
  auto cfg = Parse(j);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_EQ(cfg->rope.rotary_dim, 32);
  EXPECT_EQ(cfg->rope.layout, RopeLayout::kInterleaved);
}

TEST(ModelConfigGlmMoeDsa, IndexerScheduleFromPatternOrFrequency) {
  json j = GlmMoeDsa();
  j.erase("indexer_types");
  j["index_topk_pattern"] = "FSS";
  auto cfg = Parse(j);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_TRUE(cfg->HasOwnIndexer(0));
  EXPECT_FALSE(cfg->HasOwnIndexer(1));
  EXPECT_FALSE(cfg->HasOwnIndexer(2));

  // transformers: layer i is full when max(i - offset + 1, 0) % freq == 0.
  j.erase("index_topk_pattern");
  j["num_hidden_layers"] = 5;
  j["mlp_layer_types"] = {"dense", "sparse", "sparse", "sparse", "sparse"};
  j["index_topk_freq"] = 2;
  j["index_skip_topk_offset"] = 1;
  cfg = Parse(j);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  for (int l = 0; l < 5; ++l) EXPECT_EQ(cfg->HasOwnIndexer(l), l % 2 == 0) << "layer " << l;

  // Neither: every layer full (freq 1).
  j.erase("index_topk_freq");
  j.erase("index_skip_topk_offset");
  cfg = Parse(j);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  for (int l = 0; l < 5; ++l) EXPECT_TRUE(cfg->HasOwnIndexer(l)) << "layer " << l;
}

TEST(ModelConfigGlmMoeDsa, RefusesBadIndexerSettings) {
  auto refused = [](const json& j, const std::string& needle) {
    auto cfg = Parse(j);
    ASSERT_FALSE(cfg.ok());
    EXPECT_NE(std::string(cfg.status().message()).find(needle), std::string::npos) << cfg.status();
  };
  json j = GlmMoeDsa();
  j["indexer_types"] = {"shared", "full", "full"};
  refused(j, "layer 0");
  j = GlmMoeDsa();
  j["indexer_types"] = {"full", "sometimes", "full"};
  refused(j, "indexer_types");
  j = GlmMoeDsa();
  j["indexer_types"] = {"full"};
  refused(j, "indexer_types");
  j = GlmMoeDsa();
  j["index_head_dim"] = 16;  // smaller than the rope part
  refused(j, "index_head_dim");
  j = GlmMoeDsa();
  j["q_lora_rank"] = 0;
  refused(j, "q_lora_rank");
  j = GlmMoeDsa();
  j["index_topk"] = 0;
  refused(j, "top-k");
}

}  // namespace
}  // namespace exl3::engine
