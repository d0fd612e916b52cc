#include "tools/test_model/family_config.h"

#include <string>
#include <vector>

#include "model/config/read_moe_config.h"

namespace exl3 {
namespace {

using layer_kind::kCsa;
using layer_kind::kHca;
using nlohmann::json;

// GLM-5.3-Flash's vision patching, shared by vision_config and processor_config.json.
constexpr int kGlm5NextPatchSize = 14;
constexpr int kGlm5NextTemporalPatchSize = 2;
constexpr int kGlm5NextMergeSize = 2;

json Glm4MoeConfigJson(const TestModelSpec& s) {
  return {{"architectures", {"Glm4MoeForCausalLM"}}, {"model_type", "glm4_moe"},
          {"attention_bias", true}, {"attention_dropout", 0.0}, {"head_dim", s.head_dim},
          {"hidden_act", "silu"}, {"hidden_size", s.hidden}, {"initializer_range", 0.02},
          {"intermediate_size", s.dense_intermediate}, {"max_position_embeddings", s.max_position},
          {"moe_intermediate_size", s.intermediate}, {"norm_topk_prob", true},
          {"num_attention_heads", s.heads}, {"num_key_value_heads", s.kv_heads}, {"n_group", s.n_group},
          {"topk_group", s.topk_group}, {"n_routed_experts", s.experts},
          {"n_shared_experts", s.shared}, {"routed_scaling_factor", s.routed_scaling_factor},
          {"num_experts_per_tok", s.top_k}, {"first_k_dense_replace", s.dense_layers},
          {"num_hidden_layers", s.layers}, {"num_nextn_predict_layers", s.mtp ? 1 : 0},
          {"partial_rotary_factor", 0.5}, {"rms_norm_eps", 1e-5}, {"rope_theta", 1000000.0},
          {"rope_scaling", nullptr}, {"tie_word_embeddings", false}, {"use_qk_norm", false},
          {"torch_dtype", "bfloat16"}, {"vocab_size", s.vocab}};
}

json DeepseekV3ConfigJson(const TestModelSpec& s) {
  return {{"architectures", {"DeepseekV3ForCausalLM"}}, {"model_type", "deepseek_v3"},
          {"hidden_act", "silu"}, {"hidden_size", s.hidden}, {"initializer_range", 0.02},
          {"intermediate_size", s.dense_intermediate}, {"moe_intermediate_size", s.intermediate},
          {"n_routed_experts", s.experts}, {"n_shared_experts", s.shared},
          {"num_experts_per_tok", s.top_k}, {"n_group", s.n_group}, {"topk_group", s.topk_group},
          {"routed_scaling_factor", s.routed_scaling_factor}, {"scoring_func", "sigmoid"},
          {"topk_method", "noaux_tc"}, {"norm_topk_prob", true},
          {"first_k_dense_replace", s.dense_layers}, {"moe_layer_freq", 1},
          {"num_hidden_layers", s.layers}, {"num_attention_heads", s.heads},
          {"num_key_value_heads", s.kv_heads}, {"q_lora_rank", s.q_lora_rank},
          {"kv_lora_rank", s.kv_lora_rank}, {"qk_nope_head_dim", s.qk_nope_head_dim},
          {"qk_rope_head_dim", s.qk_rope_head_dim}, {"v_head_dim", s.v_head_dim},
          {"max_position_embeddings", s.max_position}, {"rms_norm_eps", 1e-6}, {"rope_theta", 10000.0},
          {"num_nextn_predict_layers", s.mtp ? 1 : 0}, {"ep_size", 1}, {"tie_word_embeddings", false},
          {"torch_dtype", "bfloat16"}, {"vocab_size", s.vocab}};
}

json GlmMoeDsaConfigJson(const TestModelSpec& s) {
  std::vector<std::string> mlp_types(s.layers, "sparse");
  for (int l = 0; l < s.dense_layers && l < s.layers; ++l) mlp_types[l] = "dense";
  return {{"architectures", {"GlmMoeDsaForCausalLM"}}, {"model_type", "glm_moe_dsa"},
          {"attention_bias", false}, {"hidden_act", "silu"}, {"hidden_size", s.hidden},
          {"initializer_range", 0.02}, {"intermediate_size", s.dense_intermediate},
          {"moe_intermediate_size", s.intermediate}, {"n_routed_experts", s.experts},
          {"n_shared_experts", s.shared}, {"num_experts_per_tok", s.top_k},
          {"n_group", s.n_group}, {"topk_group", s.topk_group},
          {"routed_scaling_factor", s.routed_scaling_factor}, {"norm_topk_prob", true},
          {"first_k_dense_replace", s.dense_layers}, {"mlp_layer_types", mlp_types},
          {"num_hidden_layers", s.layers}, {"num_attention_heads", s.heads},
          {"num_key_value_heads", s.kv_heads}, {"q_lora_rank", s.q_lora_rank},
          {"kv_lora_rank", s.kv_lora_rank}, {"qk_nope_head_dim", s.qk_nope_head_dim},
          {"qk_rope_head_dim", s.qk_rope_head_dim}, {"v_head_dim", s.v_head_dim},
          {"head_dim", s.qk_rope_head_dim}, {"index_n_heads", s.index_heads},
          {"index_head_dim", s.index_head_dim}, {"index_topk", s.index_topk},
          {"indexer_types", std::vector<std::string>(s.layers, "full")},
          {"num_nextn_predict_layers", s.mtp ? 1 : 0},
          {"max_position_embeddings", s.max_position}, {"rms_norm_eps", 1e-5},
          {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 1000000.0}}},
          {"tie_word_embeddings", false}, {"torch_dtype", "bfloat16"}, {"vocab_size", s.vocab}};
}

json DeepseekV4ConfigJson(const TestModelSpec& s) {
  // DeepseekV4Config's names (transformers 5.24); the rope part is the last qk_rope_head_dim
  // dimensions of each head (partial_rotary_factor), "main" on sliding layers, "compress" on
  // the compressed ones.
  std::vector<std::string> mlp_types(s.layers, "moe");
  for (int l = 0; l < s.hash_layers && l < s.layers; ++l) mlp_types[l] = "hash_moe";
  const double partial = static_cast<double>(s.qk_rope_head_dim) / s.head_dim;
  return {{"architectures", {"DeepseekV4ForCausalLM"}}, {"model_type", "deepseek_v4"},
          {"vocab_size", s.vocab}, {"hidden_size", s.hidden}, {"moe_intermediate_size", s.intermediate},
          {"num_hidden_layers", s.layers}, {"num_attention_heads", s.heads}, {"num_key_value_heads", 1},
          {"head_dim", s.head_dim}, {"q_lora_rank", s.q_lora_rank}, {"num_experts_per_tok", s.top_k},
          {"n_routed_experts", s.experts}, {"n_shared_experts", 1}, {"scoring_func", "sqrtsoftplus"},
          {"norm_topk_prob", true}, {"routed_scaling_factor", s.routed_scaling_factor},
          {"max_position_embeddings", s.max_position}, {"rope_theta", 10000.0},
          {"layer_types", s.layer_types},
          {"compress_rates", {{kCsa, s.csa_compress_rate}, {kHca, s.hca_compress_rate}}},
          {"compress_rope_theta", 160000.0}, {"hc_mult", s.hc_mult},
          {"hc_sinkhorn_iters", s.hc_sinkhorn_iters}, {"hc_eps", 1e-6}, {"mlp_layer_types", mlp_types},
          {"swiglu_limit", s.swiglu_limit > 0 ? s.swiglu_limit : 10.0f},
          {"sliding_window", s.sliding_window}, {"o_groups", s.o_groups}, {"o_lora_rank", s.o_lora_rank},
          {"index_n_heads", s.index_heads}, {"index_head_dim", s.index_head_dim},
          {"index_topk", s.index_topk}, {"num_nextn_predict_layers", 0}, {"hidden_act", "silu"},
          {"initializer_range", 0.02}, {"rms_norm_eps", 1e-6}, {"bos_token_id", 0}, {"eos_token_id", 1},
          {"tie_word_embeddings", false},
          {"rope_parameters",
           {{"main", {{"rope_type", "default"}, {"rope_theta", 10000.0}, {"partial_rotary_factor", partial}}},
            {"compress",
             {{"rope_type", "default"}, {"rope_theta", 160000.0}, {"partial_rotary_factor", partial}}}}},
          {"partial_rotary_factor", partial}, {"qk_rope_head_dim", s.qk_rope_head_dim},
          {"attention_bias", false}, {"mlp_bias", false}, {"attention_dropout", 0.0},
          {"torch_dtype", "bfloat16"}};
}

json Qwen3NextConfigJson(const TestModelSpec& s) {
  // Qwen3NextConfig's names (transformers 5.24); --dense-layers become mlp_only_layers.
  std::vector<int> mlp_only;
  for (int l = 0; l < s.dense_layers && l < s.layers; ++l) mlp_only.push_back(l);
  return {{"architectures", {"Qwen3NextForCausalLM"}}, {"model_type", "qwen3_next"},
          {"vocab_size", s.vocab}, {"hidden_size", s.hidden},
          {"intermediate_size", s.dense_intermediate}, {"num_hidden_layers", s.layers},
          {"num_attention_heads", s.heads}, {"num_key_value_heads", s.kv_heads}, {"head_dim", s.head_dim},
          {"hidden_act", "silu"}, {"max_position_embeddings", s.max_position},
          {"initializer_range", 0.02}, {"rms_norm_eps", 1e-6}, {"tie_word_embeddings", false},
          {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 10000.0}, {"partial_rotary_factor", 0.25}}},
          {"attention_bias", false}, {"attention_dropout", 0.0},
          {"linear_conv_kernel_dim", s.linear_conv_kernel}, {"linear_key_head_dim", s.linear_key_head_dim},
          {"linear_value_head_dim", s.linear_value_head_dim}, {"linear_num_key_heads", s.linear_key_heads},
          {"linear_num_value_heads", s.linear_value_heads}, {"decoder_sparse_step", 1},
          {"moe_intermediate_size", s.intermediate},
          {"shared_expert_intermediate_size", s.shared > 0 ? s.intermediate : 0},
          {"num_experts_per_tok", s.top_k}, {"num_experts", s.experts}, {"norm_topk_prob", true},
          {"router_aux_loss_coef", 0.001}, {"output_router_logits", false}, {"mlp_only_layers", mlp_only},
          {"layer_types", s.layer_types}, {"bos_token_id", 0}, {"eos_token_id", 1},
          {"torch_dtype", "bfloat16"}};
}

json Qwen3MoeConfigJson(const TestModelSpec& s) {
  return {{"architectures", {"Qwen3MoeForCausalLM"}}, {"model_type", "qwen3_moe"},
          {"attention_bias", false}, {"head_dim", s.head_dim}, {"hidden_act", "silu"},
          {"hidden_size", s.hidden}, {"initializer_range", 0.02},
          {"intermediate_size", s.dense_intermediate}, {"moe_intermediate_size", s.intermediate},
          {"num_experts", s.experts}, {"num_experts_per_tok", s.top_k}, {"norm_topk_prob", true},
          {"decoder_sparse_step", 1}, {"mlp_only_layers", json::array()},
          {"num_hidden_layers", s.layers}, {"num_attention_heads", s.heads},
          {"num_key_value_heads", s.kv_heads}, {"max_position_embeddings", s.max_position}, {"rms_norm_eps", 1e-6},
          {"rope_theta", 1000000.0}, {"router_aux_loss_coef", 0.001},
          {"output_router_logits", false}, {"tie_word_embeddings", false},
          {"torch_dtype", "bfloat16"}, {"vocab_size", s.vocab}};
}

json MixtralConfigJson(const TestModelSpec& s) {
  return {{"architectures", {"MixtralForCausalLM"}}, {"model_type", "mixtral"},
          {"hidden_act", "silu"}, {"hidden_size", s.hidden}, {"initializer_range", 0.02},
          {"intermediate_size", s.intermediate}, {"num_local_experts", s.experts},
          {"num_experts_per_tok", s.top_k}, {"num_hidden_layers", s.layers},
          {"num_attention_heads", s.heads}, {"num_key_value_heads", s.kv_heads},
          {"head_dim", s.head_dim}, {"max_position_embeddings", s.max_position}, {"rms_norm_eps", 1e-5},
          {"rope_theta", 1000000.0}, {"router_aux_loss_coef", 0.02}, {"sliding_window", nullptr},
          {"tie_word_embeddings", false}, {"torch_dtype", "bfloat16"}, {"vocab_size", s.vocab}};
}

// GLM-5.3-Flash's release config.json (what exllamav3's Glm5Next reads; transformers' and the
// engine's readers take either, engine/config/glm5next_section.cc): the MLA layers are
// deepseek_sparse_attention (transformers: indexed_attention) and KDA's shape is a
// linear_attn_config dict (transformers: flat linear_* fields).
void ToGlm5NextReleaseLayout(json& text) {
  for (json& t : text["layer_types"]) {
    if (t == "indexed_attention") t = "deepseek_sparse_attention";
  }
  text["linear_attn_config"] = {{"num_heads", text["linear_num_heads"]},
                                {"head_dim", text["linear_head_dim"]},
                                {"short_conv_kernel_size", text["linear_conv_kernel_dim"]},
                                {"gate_lower_bound", text["linear_lower_bound"]}};
  for (const char* flat : {"linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim", "linear_lower_bound"}) {
    text.erase(flat);
  }
}

// GLM-5.3-Flash's vision tower as Glm5NextConfig declares it (Glm5NextVisionConfig's defaults in
// transformers 5.25), projecting into the text model's hidden size (out_hidden_size: the merger's
// output, which replaces image placeholders' embeddings). Declared only: its tensors (model.visual.*)
// are not generated; the engine serves the text model, and exllamav3 requires the section but
// loads the tower only when asked for it (scripts/conformance/exllamav3_config_check.py).
json Glm5NextVisionConfigJson(const TestModelSpec& s) {
  return {{"model_type", "glm5_next_vision"}, {"depth", 24}, {"hidden_size", 1024}, {"hidden_act", "silu"},
          {"attention_bias", true}, {"attention_dropout", 0.0}, {"num_heads", 16}, {"in_channels", 3},
          {"image_size", 336}, {"patch_size", kGlm5NextPatchSize}, {"rms_norm_eps", 1e-5},
          {"spatial_merge_size", kGlm5NextMergeSize}, {"temporal_patch_size", kGlm5NextTemporalPatchSize},
          {"out_hidden_size", s.hidden}, {"intermediate_size", 4096}, {"initializer_range", 0.02},
          {"rope_parameters", {{"rope_theta", 10000.0}, {"rope_type", "axial"}}},
          {"projection_intermediate_size", 10240}, {"swiglu_limit", 10.0}, {"dtype", "bfloat16"}};
}

// GLM-5.3-Flash's config.json as transformers 5.25 writes it (Glm5NextConfig): the text model's
// fields (Glm5NextTextConfig's names) nested in text_config, the vision tower's in vision_config
// and the image / video marker tokens at the top level (Glm5NextConfig's defaults; they lie past a
// small test vocabulary, and nothing here uses them). The engine reads text_config alone
// (engine/config/glm5next_section.cc).
json Glm5NextConfigJson(const TestModelSpec& s) {
  std::vector<std::string> mlp_types(s.layers, "sparse");
  for (int l = 0; l < s.dense_layers && l < s.layers; ++l) mlp_types[l] = "dense";
  json text = {
      {"model_type", "glm5_next_text"}, {"vocab_size", s.vocab}, {"hidden_size", s.hidden},
      {"intermediate_size", s.dense_intermediate}, {"moe_intermediate_size", s.intermediate},
      {"num_hidden_layers", s.layers}, {"num_attention_heads", s.heads}, {"num_key_value_heads", s.kv_heads},
      {"n_shared_experts", s.shared}, {"n_routed_experts", s.experts},
      {"routed_scaling_factor", s.routed_scaling_factor}, {"kv_lora_rank", s.kv_lora_rank},
      {"q_lora_rank", s.q_lora_rank}, {"qk_rope_head_dim", 0}, {"v_head_dim", s.v_head_dim},
      {"qk_nope_head_dim", s.qk_nope_head_dim}, {"qk_head_dim", s.qk_nope_head_dim}, {"head_dim", 0},
      {"n_group", s.n_group}, {"topk_group", s.topk_group}, {"num_experts_per_tok", s.top_k},
      {"norm_topk_prob", true}, {"hidden_act", "silu"}, {"max_position_embeddings", s.max_position},
      {"initializer_range", 0.02}, {"rms_norm_eps", 1e-5}, {"use_cache", true}, {"pad_token_id", 0},
      {"bos_token_id", 0}, {"eos_token_id", 1}, {"tie_word_embeddings", false}, {"mlp_layer_types", mlp_types},
      {"attention_bias", false}, {"attention_dropout", 0.0}, {"index_topk", s.index_topk},
      {"index_head_dim", s.index_head_dim}, {"index_n_heads", s.index_heads}, {"index_kpool", s.index_kpool},
      {"index_kpool_always_select_tail", true}, {"layer_types", s.layer_types},
      {"indexer_types", std::vector<std::string>(s.layers, "full")},
      {"swiglu_limit", s.swiglu_limit > 0 ? s.swiglu_limit : 10.0f}, {"linear_head_dim", s.linear_head_dim},
      {"linear_num_heads", s.linear_heads}, {"linear_conv_kernel_dim", s.linear_conv_kernel},
      {"linear_lower_bound", -5.0}, {"hc_mult", s.hc_mult}, {"hc_eps", 1e-6},
      {"hc_sinkhorn_iters", s.hc_sinkhorn_iters}, {"router_aux_loss_coef", 0.001},
      {"output_router_logits", false}, {"num_nextn_predict_layers", s.mtp ? 1 : 0}, {"dtype", "bfloat16"}};
  if (s.release_layout) ToGlm5NextReleaseLayout(text);
  return {{"architectures", {"Glm5NextForConditionalGeneration"}}, {"model_type", "glm5_next"},
          {"text_config", text}, {"vision_config", Glm5NextVisionConfigJson(s)},
          {"image_token_id", 154854}, {"video_token_id", 154855}, {"image_start_token_id", 154830},
          {"image_end_token_id", 154831}, {"video_start_token_id", 154832}, {"video_end_token_id", 154833},
          {"tie_word_embeddings", false}, {"dtype", "bfloat16"}, {"transformers_version", "5.25.0"}};
}

// Qwen3.8-Flash-Next's vision tower as Qwen4ExpConfig declares it (Qwen4ExpVisionConfig's
// defaults in transformers 5.25, projecting into the text model's hidden size). Declared only: its
// tensors (model.visual.*) are not generated and no preprocessor_config.json is written, so
// exllamav3 reads the directory as a text-only checkpoint and the engine loads no tower.
json Qwen4ExpVisionConfigJson(const TestModelSpec& s) {
  return {{"model_type", "qwen4_exp_vision"}, {"depth", 27}, {"hidden_size", 1152},
          {"hidden_act", "gelu_pytorch_tanh"}, {"intermediate_size", 4304}, {"num_heads", 16},
          {"in_channels", 3}, {"patch_size", 16}, {"spatial_merge_size", 2}, {"temporal_patch_size", 2},
          {"out_hidden_size", s.hidden}, {"num_position_embeddings", 2304}, {"initializer_range", 0.02},
          {"dtype", "bfloat16"}};
}

// Qwen3.8-Flash-Next's config.json as transformers 5.25 writes it (Qwen4ExpConfig): the text
// model's fields (Qwen4ExpTextConfig's names) in text_config, the vision tower's in vision_config,
// the image / video token ids at the top. Rope as Qwen3.5's: partial_rotary_factor 0.25 with its
// mrope sections (text positions equal on the three axes: plain half-split rope), so the rotary
// dimensions fit the QSA index head. The DeltaNet's output gate is sigmoid; eos_token_id 1 ends
// the PLE n-grams. release_layout: the QSA layers named full_attention (exllamav3 reads no other
// name; transformers and the engine read both).
json Qwen4ExpConfigJson(const TestModelSpec& s) {
  std::vector<std::string> layer_types = s.layer_types;
  if (s.release_layout)
    for (std::string& t : layer_types)
      if (t == layer_kind::kIndexed) t = layer_kind::kFull;
  json text = {
      {"model_type", "qwen4_exp_text"}, {"vocab_size", s.vocab}, {"hidden_size", s.hidden},
      {"num_hidden_layers", s.layers}, {"num_attention_heads", s.heads}, {"num_key_value_heads", s.kv_heads},
      {"head_dim", s.head_dim}, {"hidden_act", "silu"}, {"max_position_embeddings", s.max_position},
      {"initializer_range", 0.02}, {"rms_norm_eps", 1e-6}, {"use_cache", true}, {"tie_word_embeddings", false},
      {"rope_parameters",
       {{"rope_type", "default"}, {"rope_theta", 10000.0}, {"partial_rotary_factor", 0.25},
        {"mrope_section", {11, 11, 10}}, {"mrope_interleaved", true}}},
      {"attention_bias", false}, {"attention_dropout", 0.0},
      {"linear_conv_kernel_dim", s.linear_conv_kernel}, {"linear_key_head_dim", s.linear_key_head_dim},
      {"linear_value_head_dim", s.linear_value_head_dim}, {"linear_num_key_heads", s.linear_key_heads},
      {"linear_num_value_heads", s.linear_value_heads}, {"moe_intermediate_size", s.intermediate},
      {"shared_expert_intermediate_size", s.intermediate}, {"num_experts_per_tok", s.top_k},
      {"num_experts", s.experts}, {"norm_topk_prob", true}, {"output_router_logits", false},
      {"router_aux_loss_coef", 0.001}, {"layer_types", layer_types}, {"pad_token_id", nullptr},
      {"bos_token_id", nullptr}, {"eos_token_id", 1}, {"hc_count", s.hc_mult}, {"hc_lowrank", s.hc_lowrank},
      {"ple_layer_ids", s.ple_layer_ids}, {"ple_embed_dim", s.ple_embed_dim},
      {"ple_conv_kernel_size", s.ple_conv_kernel}, {"ngram_size", s.ngram_size},
      {"heads_per_ngram", s.heads_per_ngram}, {"ngram_vocab_size_base", s.ngram_vocab_size_base},
      {"make_ngram_vocab_size_divisible_by", 128}, {"seed", 1234}, {"split_ngram_parts", s.split_ngram_parts},
      {"indexer_n_heads", s.index_heads}, {"indexer_kv_heads", 1}, {"indexer_head_dim", s.index_head_dim},
      {"indexer_budget", s.index_topk}, {"indexer_compress_ratio", s.index_kpool},
      {"output_gate_type", "sigmoid"}, {"dtype", "bfloat16"}};
  if (s.mtp) text["mtp_num_hidden_layers"] = 1;
  return {{"architectures", {"Qwen4ExpForConditionalGeneration"}}, {"model_type", "qwen4_exp"},
          {"text_config", text}, {"vision_config", Qwen4ExpVisionConfigJson(s)},
          {"image_token_id", 248056}, {"video_token_id", 248057}, {"vision_start_token_id", 248053},
          {"vision_end_token_id", 248054}, {"tie_word_embeddings", false}, {"dtype", "bfloat16"},
          {"transformers_version", "5.25.0"}};
}

}  // namespace

std::vector<std::pair<std::string, json>> TestModelSideFiles(const TestModelSpec& s) {
  if (!(s.arch == "glm5_next" && s.release_layout)) return {};
  // The vision preprocessor's settings (exllamav3 refuses the directory without them; the engine
  // reads only the text model): Glm5NextImageProcessor's defaults in transformers 5.25, its patch
  // and merge sizes those of vision_config.
  const json processor = {
      {"image_processor",
       {{"image_processor_type", "Glm5NextImageProcessor"}, {"patch_size", kGlm5NextPatchSize},
        {"temporal_patch_size", kGlm5NextTemporalPatchSize}, {"merge_size", kGlm5NextMergeSize},
        {"image_mean", {0.48145466, 0.4578275, 0.40821073}},
        {"image_std", {0.26862954, 0.26130258, 0.27577711}}, {"min_image_tokens", 16},
        {"max_image_tokens", 8000}}}};
  return {{"processor_config.json", processor}};
}

json TestModelConfig(const TestModelSpec& s) {
  if (s.arch == "glm5_next") return Glm5NextConfigJson(s);  // swiglu_limit always in text_config
  if (s.arch == "qwen4_exp") return Qwen4ExpConfigJson(s);
  json j;
  if (s.arch == "glm4_moe") {
    j = Glm4MoeConfigJson(s);
  } else if (s.arch == "deepseek_v3") {
    j = DeepseekV3ConfigJson(s);
  } else if (s.arch == "glm_moe_dsa") {
    j = GlmMoeDsaConfigJson(s);
  } else if (s.arch == "deepseek_v4") {
    j = DeepseekV4ConfigJson(s);
  } else if (s.arch == "qwen3_next") {
    j = Qwen3NextConfigJson(s);
  } else if (s.arch == "qwen3_moe") {
    j = Qwen3MoeConfigJson(s);
  } else {  // mixtral
    j = MixtralConfigJson(s);
  }
  if (s.swiglu_limit > 0) j["swiglu_limit"] = s.swiglu_limit;
  return j;
}

absl::StatusOr<MoeConfig> ParsedConfig(const TestModelSpec& s) {
  return ParseMoeConfig(TestModelConfig(s).dump(), "generated config.json");
}

}  // namespace exl3
