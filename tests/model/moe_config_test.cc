// config.json parsing for every supported family, key naming, and refusals.
#include "model/config/read_moe_config.h"
#include "model/moe_config.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace exl3 {
namespace {

using nlohmann::json;

json Glm45Air() {
  return json::parse(R"({
    "architectures": ["Glm4MoeForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 46,
    "first_k_dense_replace": 1, "n_routed_experts": 128, "num_experts_per_tok": 8,
    "moe_intermediate_size": 1408, "n_shared_experts": 1, "norm_topk_prob": true,
    "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "intermediate_size": 10944,
    "quantization_config": {"quant_method": "exl3", "version": "0.0.6", "bits": 3.0, "head_bits": 6}
  })");
}

absl::StatusOr<MoeConfig> Parse(const json& j) { return ParseMoeConfig(j.dump(), "config.json"); }

TEST(MoeConfigTest, Glm) {
  absl::StatusOr<MoeConfig> c = Parse(Glm45Air());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->family, MoeFamily::kGlm);
  EXPECT_EQ(c->hidden_size, 4096);
  EXPECT_EQ(c->num_hidden_layers, 46);
  EXPECT_EQ(c->MoeLayers().size(), 45u);
  EXPECT_FALSE(c->IsMoeLayer(0));
  EXPECT_TRUE(c->IsMoeLayer(1));
  EXPECT_TRUE(c->IsMoeLayer(45));
  EXPECT_FALSE(c->IsMoeLayer(46));
  EXPECT_EQ(c->num_experts, 128);
  EXPECT_EQ(c->top_k, 8);
  EXPECT_EQ(c->moe_intermediate_size, 1408);
  EXPECT_EQ(c->shared_intermediate_size, 1408);
  EXPECT_EQ(c->scoring, ScoringFunc::kSigmoid);
  EXPECT_TRUE(c->has_correction_bias);
  EXPECT_TRUE(c->norm_topk_prob);
  EXPECT_EQ(c->quant_method, "exl3");
  EXPECT_DOUBLE_EQ(c->bits, 3.0);
  EXPECT_TRUE(RequireExl3(*c).ok());
  EXPECT_EQ(RoutedExpertPrefix(*c, 3, 17, Projection::kGate), "model.layers.3.mlp.experts.17.gate_proj");
  EXPECT_EQ(RoutedExpertPrefix(*c, 3, 17, Projection::kDown), "model.layers.3.mlp.experts.17.down_proj");
  EXPECT_EQ(SharedExpertPrefix(*c, 3, Projection::kUp), "model.layers.3.mlp.shared_experts.up_proj");
  EXPECT_EQ(RouterWeightKey(*c, 3), "model.layers.3.mlp.gate.weight");
  EXPECT_EQ(CorrectionBiasKey(*c, 3), "model.layers.3.mlp.gate.e_score_correction_bias");
  EXPECT_EQ(SharedExpertGateKey(*c, 3), "");

  json j = Glm45Air();
  j["architectures"] = {"GlmMoeDsaForCausalLM"};
  j["swiglu_limit"] = 10.0;
  j["routed_scaling_factor"] = 2.5;
  c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FLOAT_EQ(c->swiglu_limit, 10.0f);
  EXPECT_FLOAT_EQ(c->routed_scaling_factor, 2.5f);
}

// GlmMoeDsaConfig's mlp_layer_types decides each layer's MLP (as transformers builds them), over
// first_k_dense_replace; a list of the wrong length or with other entries is refused.
TEST(MoeConfigTest, GlmMoeDsaMlpLayerTypes) {
  json j = Glm45Air();
  j["architectures"] = {"GlmMoeDsaForCausalLM"};
  j["num_hidden_layers"] = 3;
  j["first_k_dense_replace"] = 1;
  j["mlp_layer_types"] = {"sparse", "dense", "sparse"};
  absl::StatusOr<MoeConfig> c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->IsMoeLayer(0));
  EXPECT_FALSE(c->IsMoeLayer(1));
  EXPECT_TRUE(c->IsMoeLayer(2));
  j["mlp_layer_types"] = {"sparse", "dense"};
  EXPECT_FALSE(Parse(j).ok());
  j["mlp_layer_types"] = {"sparse", "moe", "dense"};
  c = Parse(j);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("mlp_layer_types"), std::string::npos);
}

TEST(MoeConfigTest, DeepseekV3) {
  json j = Glm45Air();
  j["architectures"] = {"DeepseekV3ForCausalLM"};
  j["first_k_dense_replace"] = 3;
  j["num_hidden_layers"] = 61;
  j["n_routed_experts"] = 256;
  j["n_group"] = 8;
  j["topk_group"] = 4;
  j["routed_scaling_factor"] = 2.5;
  j["scoring_func"] = "sigmoid";
  j["topk_method"] = "noaux_tc";
  j["moe_layer_freq"] = 1;
  j["n_shared_experts"] = 2;
  absl::StatusOr<MoeConfig> c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->family, MoeFamily::kDeepseekV3);
  EXPECT_EQ(c->MoeLayers().size(), 58u);
  EXPECT_EQ(c->n_group, 8);
  EXPECT_EQ(c->topk_group, 4);
  EXPECT_EQ(c->shared_intermediate_size, 2 * 1408);
  j["scoring_func"] = "softmax";
  c = Parse(j);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("scoring_func"), std::string::npos);
  j["scoring_func"] = "sigmoid";
  j["topk_method"] = "greedy";
  EXPECT_FALSE(Parse(j).ok());
  j["topk_method"] = "noaux_tc";
  j["n_group"] = 7;  // 256 experts do not split into 7 groups
  EXPECT_FALSE(Parse(j).ok());
}

// An older DeepSeek-V4 config.json: num_hash_layers and route_scale at the top level.
TEST(MoeConfigTest, DeepseekV4LegacyFields) {
  json j = json::parse(R"({
    "architectures": ["DeepseekV4ForCausalLM"], "hidden_size": 5120, "num_hidden_layers": 40,
    "n_routed_experts": 384, "num_experts_per_tok": 6, "moe_intermediate_size": 2304,
    "n_shared_experts": 1, "route_scale": 1.5, "swiglu_limit": 10.0, "num_hash_layers": 3,
    "scoring_func": "sqrtsoftplus", "quantization_config": {"quant_method": "exl3", "bits": 3}
  })");
  absl::StatusOr<MoeConfig> c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->family, MoeFamily::kDeepseekV4);
  EXPECT_EQ(c->scoring, ScoringFunc::kSqrtSoftplus);
  EXPECT_FLOAT_EQ(c->routed_scaling_factor, 1.5f);
  EXPECT_EQ(c->MoeLayers().size(), 40u);
  EXPECT_TRUE(c->IsHashRoutedLayer(2));
  EXPECT_FALSE(c->IsHashRoutedLayer(3));
  EXPECT_EQ(c->LayerKind(2), MlpKind::kHashMoe);
  EXPECT_EQ(c->LayerKind(3), MlpKind::kMoe);
  EXPECT_EQ(c->shared_intermediate_size, 2304);
  EXPECT_FLOAT_EQ(c->swiglu_limit, 10.0f);
  EXPECT_FLOAT_EQ(c->shared_swiglu_limit, 10.0f);
  EXPECT_EQ(CorrectionBiasKey(*c, 2), "");
  EXPECT_EQ(CorrectionBiasKey(*c, 3), "model.layers.3.ffn.gate.bias");
  EXPECT_EQ(HashTableKey(*c, 0), "model.layers.0.ffn.gate.tid2eid");
  EXPECT_EQ(HashTableKey(*c, 3), "");
}

// The config.json transformers 5.24 writes for DeepSeek-V4 (trimmed to the fields the reader
// looks at) and the checkpoint names it saves (tests/fixtures/layouts/deepseek_v4 has all).
TEST(MoeConfigTest, DeepseekV4AsTransformers5WritesIt) {
  json j = json::parse(R"({
    "architectures": ["DeepseekV4ForCausalLM"], "hidden_size": 128, "num_hidden_layers": 4,
    "mlp_layer_types": ["hash_moe", "moe", "hash_moe", "moe"], "moe_intermediate_size": 256,
    "n_routed_experts": 8, "n_shared_experts": 1, "norm_topk_prob": false,
    "num_experts_per_tok": 2, "routed_scaling_factor": 2.0, "scoring_func": "sqrtsoftplus",
    "swiglu_limit": 0.75, "vocab_size": 96
  })");
  absl::StatusOr<MoeConfig> c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->MoeLayers(), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(c->LayerKind(0), MlpKind::kHashMoe);
  EXPECT_EQ(c->LayerKind(1), MlpKind::kMoe);
  EXPECT_EQ(c->LayerKind(2), MlpKind::kHashMoe);
  EXPECT_EQ(c->LayerKind(3), MlpKind::kMoe);
  EXPECT_TRUE(c->norm_topk_prob);  // DeepSeek-V4 always renormalises; the field is not read
  EXPECT_FLOAT_EQ(c->routed_scaling_factor, 2.0f);
  EXPECT_EQ(c->n_group, 1);
  EXPECT_FLOAT_EQ(c->swiglu_limit, 0.75f);
  EXPECT_FLOAT_EQ(c->shared_swiglu_limit, 0.75f);
  EXPECT_EQ(RoutedExpertPrefix(*c, 1, 5, Projection::kGate), "model.layers.1.ffn.experts.5.w1");
  EXPECT_EQ(RoutedExpertPrefix(*c, 1, 5, Projection::kUp), "model.layers.1.ffn.experts.5.w3");
  EXPECT_EQ(RoutedExpertPrefix(*c, 1, 5, Projection::kDown), "model.layers.1.ffn.experts.5.w2");
  EXPECT_EQ(SharedExpertPrefix(*c, 2, Projection::kGate), "model.layers.2.ffn.shared_experts.w1");
  EXPECT_EQ(SharedExpertPrefix(*c, 2, Projection::kUp), "model.layers.2.ffn.shared_experts.w3");
  EXPECT_EQ(SharedExpertPrefix(*c, 2, Projection::kDown), "model.layers.2.ffn.shared_experts.w2");
  EXPECT_EQ(RouterWeightKey(*c, 2), "model.layers.2.ffn.gate.weight");
  EXPECT_EQ(CorrectionBiasKey(*c, 1), "model.layers.1.ffn.gate.bias");
  EXPECT_EQ(CorrectionBiasKey(*c, 2), "");  // hash layers have no correction bias
  EXPECT_EQ(HashTableKey(*c, 2), "model.layers.2.ffn.gate.tid2eid");
  EXPECT_EQ(HeadWeightKey(*c), "head.weight");

  // transformers' defaults where the file names none: sqrtsoftplus, scale 1.5, limit 10, the
  // first 3 layers hash-routed.
  for (const char* f : {"mlp_layer_types", "routed_scaling_factor", "scoring_func", "swiglu_limit"}) {
    j.erase(f);
  }
  c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->scoring, ScoringFunc::kSqrtSoftplus);
  EXPECT_FLOAT_EQ(c->routed_scaling_factor, 1.5f);
  EXPECT_FLOAT_EQ(c->swiglu_limit, 10.0f);
  EXPECT_EQ(c->LayerKind(2), MlpKind::kHashMoe);
  EXPECT_EQ(c->LayerKind(3), MlpKind::kMoe);

  j["scoring_func"] = "sigmoid";
  c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->scoring, ScoringFunc::kSigmoid);
  j["scoring_func"] = "softmax";  // transformers' ACT2FN has no softmax: not a working model
  c = Parse(j);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("scoring_func"), std::string::npos);
  j["scoring_func"] = "sqrtsoftplus";

  json bad = j;
  bad["mlp_layer_types"] = {"hash_moe", "moe", "dense", "moe"};
  c = Parse(bad);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("mlp_layer_types"), std::string::npos) << c.status();
  bad["mlp_layer_types"] = {"hash_moe", "moe"};  // 2 entries for 4 layers
  EXPECT_FALSE(Parse(bad).ok());
  bad = j;
  bad["n_shared_experts"] = 2;
  c = Parse(bad);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("n_shared_experts"), std::string::npos) << c.status();
}

// GLM-MoE-DSA (GLM-5) names each layer's MLP in mlp_layer_types; it wins over
// first_k_dense_replace (from which transformers derives the list when it is absent); the
// other GLM/DeepSeek-V3 configs have no such field (transformers does not read it there).
TEST(MoeConfigTest, MlpLayerTypesAreGlmMoeDsas) {
  json j = Glm45Air();
  j["architectures"] = {"GlmMoeDsaForCausalLM"};
  j["num_hidden_layers"] = 4;
  j["first_k_dense_replace"] = 1;
  j["mlp_layer_types"] = {"dense", "sparse", "dense", "sparse"};
  absl::StatusOr<MoeConfig> c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->MoeLayers(), (std::vector<int>{1, 3}));
  EXPECT_EQ(c->LayerKind(2), MlpKind::kDense);
  EXPECT_EQ(RoutedExpertPrefix(*c, 1, 0, Projection::kGate), "model.layers.1.mlp.experts.0.gate_proj");
  EXPECT_EQ(HeadWeightKey(*c), "lm_head.weight");
  j.erase("mlp_layer_types");
  c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->MoeLayers(), (std::vector<int>{1, 2, 3}));
  j["mlp_layer_types"] = {"dense", "moe", "dense", "sparse"};
  c = Parse(j);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("mlp_layer_types"), std::string::npos) << c.status();
  // Glm4Moe has no mlp_layer_types: first_k_dense_replace decides.
  j["architectures"] = {"Glm4MoeForCausalLM"};
  c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->MoeLayers(), (std::vector<int>{1, 2, 3}));
}

TEST(MoeConfigTest, Qwen3MoeAndNext) {
  json j = json::parse(R"({
    "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 48,
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
    "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": []
  })");
  absl::StatusOr<MoeConfig> c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->family, MoeFamily::kQwen3Moe);
  EXPECT_EQ(c->scoring, ScoringFunc::kSoftmax);
  EXPECT_EQ(c->MoeLayers().size(), 48u);
  EXPECT_FALSE(c->has_shared_expert());
  EXPECT_FALSE(c->has_correction_bias);
  EXPECT_EQ(CorrectionBiasKey(*c, 0), "");
  EXPECT_FALSE(RequireExl3(*c).ok());  // no quantization_config
  j["mlp_only_layers"] = {0, 5};
  j["decoder_sparse_step"] = 2;
  c = Parse(j);
  ASSERT_TRUE(c.ok());
  EXPECT_FALSE(c->IsMoeLayer(0));
  EXPECT_TRUE(c->IsMoeLayer(1));
  EXPECT_FALSE(c->IsMoeLayer(2));
  EXPECT_FALSE(c->IsMoeLayer(5));
  EXPECT_TRUE(c->IsMoeLayer(7));

  j = json::parse(R"({
    "architectures": ["Qwen3NextForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 48,
    "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "norm_topk_prob": true, "decoder_sparse_step": 1,
    "mlp_only_layers": []
  })");
  c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->family, MoeFamily::kQwen3Next);
  EXPECT_TRUE(c->shared_expert_gated);
  EXPECT_EQ(c->shared_intermediate_size, 512);
  EXPECT_EQ(SharedExpertPrefix(*c, 4, Projection::kDown), "model.layers.4.mlp.shared_expert.down_proj");
  EXPECT_EQ(SharedExpertGateKey(*c, 4), "model.layers.4.mlp.shared_expert_gate.weight");
  j.erase("shared_expert_intermediate_size");
  c = Parse(j);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("shared_expert_intermediate_size"), std::string::npos);
}

// transformers 5.x's Qwen3MoeConfig saves the expert count as num_local_experts (its attribute_map
// sends num_experts there); the rope settings move into rope_parameters. This is the config.json
// transformers 5.24 writes for a tiny Qwen3-MoE, trimmed to the fields the reader looks at.
TEST(MoeConfigTest, Qwen3MoeAsTransformers5WritesIt) {
  json j = json::parse(R"({
    "architectures": ["Qwen3MoeForCausalLM"], "decoder_sparse_step": 1, "hidden_size": 256,
    "mlp_only_layers": [1], "moe_intermediate_size": 128, "norm_topk_prob": true,
    "num_experts_per_tok": 2, "num_hidden_layers": 3, "num_local_experts": 8,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}
  })");
  absl::StatusOr<MoeConfig> c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_experts, 8);
  EXPECT_EQ(c->MoeLayers(), (std::vector<int>{0, 2}));
  EXPECT_TRUE(c->norm_topk_prob);

  j["num_experts"] = 8;  // both names, agreeing
  c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_experts, 8);

  j["num_experts"] = 16;  // both names, disagreeing
  c = Parse(j);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("num_experts"), std::string::npos) << c.status();

  j.erase("num_experts");
  j.erase("num_local_experts");
  c = Parse(j);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("num_local_experts"), std::string::npos) << c.status();
  EXPECT_NE(c.status().message().find("num_experts"), std::string::npos) << c.status();
}

// Fields a config.json leaves out take the defaults of the family's transformers 5.x config class.
TEST(MoeConfigTest, AbsentFieldsTakeTransformersDefaults) {
  json j = json::parse(R"({
    "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 1024, "num_hidden_layers": 4,
    "first_k_dense_replace": 1, "n_routed_experts": 64, "num_experts_per_tok": 4,
    "moe_intermediate_size": 256
  })");
  absl::StatusOr<MoeConfig> c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_shared_experts, 1);
  EXPECT_EQ(c->shared_intermediate_size, 256);
  EXPECT_FLOAT_EQ(c->routed_scaling_factor, 2.5f);
  EXPECT_EQ(c->n_group, 8);
  EXPECT_EQ(c->topk_group, 4);
  EXPECT_TRUE(c->norm_topk_prob);
  j["architectures"] = {"GlmMoeDsaForCausalLM"};
  c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FLOAT_EQ(c->routed_scaling_factor, 2.5f);
  EXPECT_EQ(c->n_group, 1);
  j["architectures"] = {"Glm4MoeForCausalLM"};
  c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FLOAT_EQ(c->routed_scaling_factor, 1.0f);
  EXPECT_EQ(c->num_shared_experts, 1);

  j = json::parse(R"({
    "architectures": ["Qwen3NextForCausalLM"], "hidden_size": 1024, "num_hidden_layers": 4,
    "num_experts": 64, "num_experts_per_tok": 4, "moe_intermediate_size": 256,
    "shared_expert_intermediate_size": 256
  })");
  c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->norm_topk_prob);
  j["architectures"] = {"Qwen3MoeForCausalLM"};
  c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->norm_topk_prob);
}

TEST(MoeConfigTest, Mixtral) {
  json j = json::parse(R"({
    "architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32,
    "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 14336
  })");
  absl::StatusOr<MoeConfig> c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->family, MoeFamily::kMixtral);
  EXPECT_TRUE(c->norm_topk_prob);
  EXPECT_EQ(c->moe_intermediate_size, 14336);
  EXPECT_EQ(c->MoeLayers().size(), 32u);
  EXPECT_EQ(RoutedExpertPrefix(*c, 0, 7, Projection::kGate), "model.layers.0.block_sparse_moe.experts.7.w1");
  EXPECT_EQ(RoutedExpertPrefix(*c, 0, 7, Projection::kUp), "model.layers.0.block_sparse_moe.experts.7.w3");
  EXPECT_EQ(RoutedExpertPrefix(*c, 0, 7, Projection::kDown), "model.layers.0.block_sparse_moe.experts.7.w2");
  EXPECT_EQ(RouterWeightKey(*c, 0), "model.layers.0.block_sparse_moe.gate.weight");
  EXPECT_EQ(SharedExpertPrefix(*c, 0, Projection::kGate), "");
}

TEST(MoeConfigTest, RefusesUnknownArchitectureNamingIt) {
  json j = Glm45Air();
  j["architectures"] = {"LlamaForCausalLM"};
  absl::StatusOr<MoeConfig> c = Parse(j);
  ASSERT_FALSE(c.ok());
  const std::string msg(c.status().message());
  EXPECT_NE(msg.find("LlamaForCausalLM"), std::string::npos) << msg;
  EXPECT_NE(msg.find("Glm4MoeForCausalLM"), std::string::npos) << msg;
  EXPECT_NE(msg.find("MixtralForCausalLM"), std::string::npos) << msg;
}

TEST(MoeConfigTest, NamesMissingFields) {
  for (const char* field : {"hidden_size", "num_hidden_layers", "n_routed_experts",
                            "num_experts_per_tok", "moe_intermediate_size",
                            "first_k_dense_replace"}) {
    json j = Glm45Air();
    j.erase(field);
    absl::StatusOr<MoeConfig> c = Parse(j);
    ASSERT_FALSE(c.ok()) << field;
    EXPECT_NE(c.status().message().find(field), std::string::npos) << c.status();
  }
  json j = Glm45Air();
  j.erase("architectures");
  EXPECT_FALSE(Parse(j).ok());
  j = Glm45Air();
  j["hidden_size"] = "big";
  EXPECT_FALSE(Parse(j).ok());
  j = Glm45Air();
  j["num_experts_per_tok"] = 129;
  EXPECT_FALSE(Parse(j).ok());
  EXPECT_FALSE(ParseMoeConfig("{not json", "x").ok());
  j = Glm45Air();
  j["quantization_config"]["quant_method"] = "gptq";
  absl::StatusOr<MoeConfig> c = Parse(j);
  ASSERT_TRUE(c.ok());
  EXPECT_NE(RequireExl3(*c).message().find("gptq"), std::string::npos);
}

// quantization_config as exllamav3 1.6.5 writes it.
TEST(MoeConfigTest, Exllamav3QuantizationConfig) {
  json j = Glm45Air();
  j["quantization_config"] = json::parse(R"({"quant_method": "exl3", "version": "1.6.5",
      "bits": 2.53, "head_bits": 6, "calibration": {"rows": 250, "cols": 2048},
      "out_scales": "auto", "codebook": "mcg", "mtp_bits": 4})");
  absl::StatusOr<MoeConfig> c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->quant_version, "1.6.5");
  EXPECT_EQ(c->quant_codebook, "mcg");
  EXPECT_DOUBLE_EQ(c->bits, 2.53);
  EXPECT_DOUBLE_EQ(c->head_bits, 6);
  EXPECT_TRUE(RequireExl3(*c).ok());
  j["quantization_config"]["codebook"] = "e8p";
  c = Parse(j);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("'e8p', not mul1, mcg or 3inst"), std::string::npos)
      << c.status();
  // Older files record no codebook: it is then per tensor only.
  j["quantization_config"].erase("codebook");
  c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->quant_codebook, "");
}

}  // namespace
}  // namespace exl3
