// engine/config/dsv4_config: DeepseekV4ForCausalLM's attention configuration read as transformers 5.24
// writes it (nested main / compress rope parameters, layer_types, compress_rates) and as older
// files give it (compress_ratios, qk_rope_head_dim, rope_scaling, compress_rope_theta), the cache
// slot layout per layer type, and the refusals.
#include "engine/config/read_model_config.h"
#include "engine/config/dsv4_config.h"

#include <cmath>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace exl3::engine {
namespace {

using nlohmann::json;

// The fields of a small DeepseekV4Config().to_dict() the readers look at.
json DeepseekV4() {
  return json::parse(R"({
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 96,
    "hidden_size": 128, "moe_intermediate_size": 128, "num_hidden_layers": 3,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128, "q_lora_rank": 128,
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "norm_topk_prob": true,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-06, "sliding_window": 8,
    "layer_types": ["sliding_attention", "compressed_sparse_attention",
                    "heavily_compressed_attention"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "mlp_layer_types": ["hash_moe", "moe", "moe"], "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-06, "o_groups": 2, "o_lora_rank": 128, "index_n_heads": 8,
    "index_head_dim": 64, "index_topk": 4, "partial_rotary_factor": 0.25,
    "qk_rope_head_dim": 32, "swiglu_limit": 10.0, "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_parameters": {
      "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
      "compress": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                   "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 160000.0,
                   "partial_rotary_factor": 0.25, "attention_factor": 1.0}}
  })");
}

absl::StatusOr<ModelConfig> Parse(const json& j) { return ParseModelConfig(j.dump(), "config.json"); }

TEST(Dsv4Config, ReadsWhatTransformersWrites) {
  auto cfg = Parse(DeepseekV4());
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  ASSERT_EQ(cfg->attention, AttentionKind::kDsv4);
  const Dsv4Config& v = *cfg->dsv4;
  ASSERT_EQ(v.layer_types.size(), 3u);
  EXPECT_EQ(v.layer_types[0], Dsv4LayerType::kSlidingWindow);
  EXPECT_EQ(v.layer_types[1], Dsv4LayerType::kCompressedSparse);
  EXPECT_EQ(v.layer_types[2], Dsv4LayerType::kHeavilyCompressed);
  EXPECT_EQ(v.CompressRate(0), 0);
  EXPECT_EQ(v.CompressRate(1), 4);
  EXPECT_EQ(v.CompressRate(2), 16);
  EXPECT_EQ(v.rope_dim, 32);
  EXPECT_EQ(v.main_rope.type, RopeType::kDefault);
  EXPECT_DOUBLE_EQ(v.main_rope.theta, 10000.0);
  EXPECT_EQ(v.compress_rope.type, RopeType::kYarn);
  EXPECT_DOUBLE_EQ(v.compress_rope.theta, 160000.0);
  EXPECT_DOUBLE_EQ(v.compress_rope.attention_factor, 1.0);
  EXPECT_EQ(v.hc_mult, 4);
  EXPECT_EQ(v.hc_sinkhorn_iters, 20);
  EXPECT_EQ(v.o_groups, 2);
  EXPECT_EQ(v.index_topk, 4);
  EXPECT_EQ(cfg->sliding_window, 8);
  EXPECT_FLOAT_EQ(cfg->attention_scale, 1.0f / std::sqrt(128.0f));
  EXPECT_TRUE(cfg->IsMoeLayer(0));
  // Slots: the shared kv on every layer. Block areas (blocks of 16): CSA m 4 the count, two
  // [2, 128] and two [2, 64] accumulators, 4 entries of 128 and 4 of 64; HCA one accumulator
  // [2, 128] and ceil(16 / m) entries of 128.
  for (int l = 0; l < 3; ++l) EXPECT_EQ(cfg->KvWidth(l), 128);
  EXPECT_EQ(cfg->KvBlockFloats(0, 16), 0);
  EXPECT_EQ(cfg->KvBlockFloats(1, 16), 1 + 4 * 128 + 4 * 64 + 4 * 128 + 4 * 64);
  const int hca_m = v.CompressRate(2);
  EXPECT_EQ(cfg->KvBlockFloats(2, 16), 1 + 2 * 128 + (16 + hca_m - 1) / hca_m * 128);
  EXPECT_EQ(cfg->KvFloatsPerToken(16),
            (16 * 3 * 128 + cfg->KvBlockFloats(1, 16) + cfg->KvBlockFloats(2, 16) + 15) / 16);
  const Dsv4CacheLayout csa = CacheLayoutFor(v, Dsv4LayerType::kCompressedSparse, 16);
  EXPECT_EQ(csa.entries_per_block, 4);
  EXPECT_EQ(csa.compressor.next, csa.compressor.current + 256);
  EXPECT_EQ(csa.accumulators_end, csa.compressor.entries);
  EXPECT_EQ(csa.indexer.entries, csa.block_width - 4 * 64);
  const Dsv4CacheLayout sliding = CacheLayoutFor(v, Dsv4LayerType::kSlidingWindow, 16);
  EXPECT_EQ(sliding.block_width, 0);
}

// The cache per token at DeepSeek-V4-Flash's attention shape (head_dim 512, index_head_dim 128,
// compress rates 4 / 128, rope 64), blocks of 16: the slot's kv plus the block area's share.
// Keeping every token's raw compressor projections (the earlier layout) took 6 x 512 + 5 x 128 =
// 3712 floats on a CSA layer and 4 x 512 = 2048 on an HCA layer.
TEST(Dsv4Config, CachePerTokenAtFlashShapes) {
  json j = DeepseekV4();
  j["head_dim"] = 512;
  j["index_head_dim"] = 128;
  j["compress_rates"] = {{"compressed_sparse_attention", 4}, {"heavily_compressed_attention", 128}};
  for (const char* k : {"main", "compress"}) j["rope_parameters"][k]["partial_rotary_factor"] = 0.125;
  j["partial_rotary_factor"] = 0.125;
  j["qk_rope_head_dim"] = 64;
  j["o_lora_rank"] = 512;
  auto cfg = Parse(j);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  auto per_token = [&](int layer) {
    return (16 * cfg->KvWidth(layer) + cfg->KvBlockFloats(layer, 16) + 15) / 16;
  };
  EXPECT_EQ(per_token(0), 512);  // sliding window
  EXPECT_EQ(per_token(1), 833);  // CSA: 512 + (1 + 4 x 512 + 4 x 128 + 4 x (512 + 128)) / 16, up
  EXPECT_EQ(per_token(2), 609);  // HCA: 512 + (1 + 2 x 512 + 512) / 16, rounded up
}

// An older config.json (as DeepSeek's own files): compress_ratios, qk_rope_head_dim, top-level
// yarn rope_scaling that applies to the compressed layers only.
TEST(Dsv4Config, ReadsOlderFields) {
  json j = DeepseekV4();
  for (const char* k : {"layer_types", "compress_rates", "partial_rotary_factor", "rope_parameters"})
    j.erase(k);
  j["compress_ratios"] = {0, 4, 128};
  j["rope_scaling"] = {{"type", "yarn"}, {"factor", 16.0}, {"original_max_position_embeddings", 64}};
  auto cfg = Parse(j);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  const Dsv4Config& v = *cfg->dsv4;
  EXPECT_EQ(v.layer_types[0], Dsv4LayerType::kSlidingWindow);
  EXPECT_EQ(v.layer_types[1], Dsv4LayerType::kCompressedSparse);
  EXPECT_EQ(v.layer_types[2], Dsv4LayerType::kHeavilyCompressed);
  EXPECT_EQ(v.CompressRate(1), 4);
  EXPECT_EQ(v.CompressRate(2), 128);
  EXPECT_EQ(v.rope_dim, 32);
  EXPECT_EQ(v.main_rope.type, RopeType::kDefault);
  EXPECT_EQ(v.compress_rope.type, RopeType::kYarn);
  EXPECT_DOUBLE_EQ(v.compress_rope.factor, 16.0);
  EXPECT_DOUBLE_EQ(v.compress_rope.attention_factor, 1.0);  // V4 does not scale cos/sin
  EXPECT_DOUBLE_EQ(v.compress_rope.theta, 160000.0);
  // Neither layer_types nor compress_ratios: two HCA layers, then CSA / HCA alternating.
  j.erase("compress_ratios");
  j["num_hidden_layers"] = 5;
  j["mlp_layer_types"] = {"hash_moe", "moe", "moe", "moe", "moe"};
  cfg = Parse(j);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  const std::vector<Dsv4LayerType> want = {
      Dsv4LayerType::kHeavilyCompressed, Dsv4LayerType::kHeavilyCompressed,
      Dsv4LayerType::kHeavilyCompressed, Dsv4LayerType::kCompressedSparse,
      Dsv4LayerType::kHeavilyCompressed};
  EXPECT_EQ(cfg->dsv4->layer_types, want);
}

TEST(Dsv4Config, RefusesWhatItCannotRun) {
  auto refused = [](const json& j, const std::string& needle) {
    auto cfg = Parse(j);
    ASSERT_FALSE(cfg.ok()) << needle;
    EXPECT_NE(std::string(cfg.status().message()).find(needle), std::string::npos) << cfg.status();
  };
  json j = DeepseekV4();
  j["num_key_value_heads"] = 2;
  j["num_attention_heads"] = 2;
  refused(j, "one shared key/value head");
  j = DeepseekV4();
  j["layer_types"][1] = "full_attention";
  refused(j, "layer_types");
  j = DeepseekV4();
  j["layer_types"] = {"sliding_attention"};
  refused(j, "layer_types names 1 layers of 3");
  j = DeepseekV4();
  j.erase("layer_types");
  j["compress_ratios"] = {0, 8, 128};
  refused(j, "compress_ratios");
  j = DeepseekV4();
  j.erase("index_topk");
  refused(j, "index_topk");
  j = DeepseekV4();
  j["o_groups"] = 3;
  refused(j, "o_groups");
  j = DeepseekV4();
  j["hc_mult"] = 0;
  refused(j, "hc_mult");
  j = DeepseekV4();
  j["rope_parameters"]["compress"]["partial_rotary_factor"] = 0.5;
  refused(j, "one rope dimension");
}

// The DSPARK drafter's fields (docs/dspark.md), as the deepseek_v4_release_mtp fixture gives them:
// compress_ratios one entry longer than num_hidden_layers, the dspark_* fields.
TEST(Dsv4Config, ReadsDsparkFields) {
  auto cfg = Parse(DeepseekV4());
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_EQ(cfg->dsv4->dspark.num_blocks, 0);
  EXPECT_FALSE(cfg->dsv4->dspark.enabled());
  json j = DeepseekV4();
  j["compress_ratios"] = {0, 4, 128, 0};
  j["num_nextn_predict_layers"] = 1;
  j["dspark_block_size"] = 4;
  j["dspark_noise_token_id"] = 95;
  j["dspark_markov_rank"] = 64;
  j["dspark_target_layer_ids"] = {2, 0};
  cfg = Parse(j);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  const Dsv4DsparkConfig& d = cfg->dsv4->dspark;
  EXPECT_EQ(d.num_blocks, 1);
  EXPECT_EQ(d.block_size, 4);
  EXPECT_EQ(d.noise_token_id, 95);
  EXPECT_EQ(d.markov_rank, 64);
  EXPECT_EQ(d.target_layer_ids, (std::vector<int>{0, 2}));  // ascending, as the layers run
  EXPECT_EQ(d.num_taps(), 2);
  EXPECT_TRUE(d.enabled());
  // The trunk's layer types come from layer_types, not from the longer compress_ratios.
  EXPECT_EQ(cfg->dsv4->layer_types.size(), 3u);
  // Three MTP blocks (V4-Flash's count beside num_nextn_predict_layers 1); defaults.
  j["compress_ratios"] = {0, 4, 128, 0, 0, 0};
  j.erase("dspark_markov_rank");
  j.erase("dspark_noise_token_id");
  cfg = Parse(j);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_EQ(cfg->dsv4->dspark.num_blocks, 3);
  EXPECT_EQ(cfg->dsv4->dspark.markov_rank, 256);
  EXPECT_EQ(cfg->dsv4->dspark.noise_token_id, 0);
  // No block size: the component is not a drafter.
  j.erase("dspark_block_size");
  cfg = Parse(j);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_FALSE(cfg->dsv4->dspark.enabled());
  // Older files without layer_types read the trunk's types from the head of compress_ratios.
  j = DeepseekV4();
  j.erase("layer_types");
  j["compress_ratios"] = {0, 4, 128, 0};
  j["dspark_block_size"] = 4;
  j["dspark_target_layer_ids"] = {1};
  cfg = Parse(j);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_EQ(cfg->dsv4->layer_types[2], Dsv4LayerType::kHeavilyCompressed);
  EXPECT_EQ(cfg->dsv4->dspark.num_blocks, 1);
}

TEST(Dsv4Config, RefusesBadDsparkFields) {
  auto refused = [](const json& j, const std::string& needle) {
    auto cfg = Parse(j);
    ASSERT_FALSE(cfg.ok()) << needle;
    EXPECT_NE(std::string(cfg.status().message()).find(needle), std::string::npos) << cfg.status();
  };
  json base = DeepseekV4();
  base["compress_ratios"] = {0, 4, 128, 0};
  base["dspark_block_size"] = 4;
  base["dspark_target_layer_ids"] = {0, 2};
  json j = base;
  j["compress_ratios"] = {0, 4, 128, 4};
  refused(j, "compress_ratios[3]");
  j = base;
  j["dspark_block_size"] = -1;
  refused(j, "dspark_block_size");
  j = base;
  j["dspark_block_size"] = "4";
  refused(j, "dspark_block_size");
  j = base;
  j["dspark_noise_token_id"] = 96;  // vocab_size 96
  refused(j, "dspark_noise_token_id");
  j = base;
  j["dspark_markov_rank"] = 0;
  refused(j, "dspark_markov_rank");
  j = base;
  j["dspark_target_layer_ids"] = {0, 3};
  refused(j, "dspark_target_layer_ids holds 3");
  j = base;
  j["dspark_target_layer_ids"] = {2, 2};
  refused(j, "names a layer twice");
  j = base;
  j["dspark_target_layer_ids"] = 2;
  refused(j, "dspark_target_layer_ids");
}

}  // namespace
}  // namespace exl3::engine
