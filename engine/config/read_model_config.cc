#include "engine/config/read_model_config.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/config/dsv4_section.h"
#include "engine/config/fields.h"
#include "engine/config/glm5next_section.h"
#include "engine/config/gqa_section.h"
#include "engine/config/latent_section.h"
#include "engine/config/qwen3next_section.h"
#include "engine/config/qwen4exp_section.h"
#include "model/config/read_moe_config.h"

namespace exl3::engine {
namespace {

using nlohmann::json;

// The section that reads each architecture's own fields.
absl::Status ReadSection(const ConfigFile& file, ModelConfig* cfg) {
  switch (file.architecture().architecture) {
    case Architecture::kGlm4Moe: return ReadGlm4MoeSection(file, cfg);
    case Architecture::kQwen3Moe: return ReadQwen3MoeSection(file, cfg);
    case Architecture::kMixtral: return ReadMixtralSection(file, cfg);
    case Architecture::kDeepseekV3: return ReadDeepseekV3Section(file, cfg);
    case Architecture::kGlmMoeDsa: return ReadGlmMoeDsaSection(file, cfg);
    case Architecture::kDeepseekV4: return ReadDeepseekV4Section(file, cfg);
    case Architecture::kQwen3Next: return ReadQwen3NextSection(file, cfg);
    case Architecture::kGlm5Next: return ReadGlm5NextSection(file, cfg);
    case Architecture::kQwen4Exp: return ReadQwen4ExpSection(file, cfg);
  }
  return absl::InternalError(absl::StrCat(file.source(), ": no configuration section for ",
                                          file.architecture().name));
}

absl::StatusOr<std::vector<int32_t>> EosIds(const json& j) {
  std::vector<int32_t> ids;
  auto it = j.find("eos_token_id");
  if (it == j.end() || it->is_null()) return ids;
  if (it->is_number_integer()) {
    ids.push_back(it->get<int32_t>());
  } else if (it->is_array()) {
    for (const json& v : *it)
      if (v.is_number_integer()) ids.push_back(v.get<int32_t>());
  }
  return ids;
}

}  // namespace

absl::StatusOr<ModelConfig> ReadModelConfig(const ConfigFile& file,
                                            std::string_view generation_config_json) {
  const std::string& source = file.source();
  const json& j = file.text();
  ModelConfig cfg;
  EXL3_ASSIGN_OR_RETURN(cfg.moe, ReadMoeConfig(file));

  cfg.hidden_size = cfg.moe.hidden_size;
  cfg.num_layers = cfg.moe.num_hidden_layers;
  cfg.layer_mixers.assign(cfg.num_layers, TokenMixer::kAttention);
  EXL3_ASSIGN_OR_RETURN(cfg.vocab_size, RequireInt(j, source, "vocab_size"));
  EXL3_ASSIGN_OR_RETURN(cfg.num_heads, RequireInt(j, source, "num_attention_heads"));
  EXL3_ASSIGN_OR_RETURN(cfg.max_position_embeddings,
                        RequireInt(j, source, "max_position_embeddings"));
  cfg.num_kv_heads = IntOr(j, "num_key_value_heads", cfg.num_heads);
  cfg.head_dim = IntOr(j, "head_dim", 0);
  if (cfg.head_dim <= 0 && cfg.num_heads > 0) cfg.head_dim = cfg.hidden_size / cfg.num_heads;
  cfg.intermediate_size = IntOr(j, "intermediate_size", 0);
  cfg.rms_norm_eps = static_cast<float>(NumberOr(j, "rms_norm_eps", 1e-6));
  cfg.tie_word_embeddings = j.value("tie_word_embeddings", false);
  if (cfg.num_heads <= 0 || cfg.num_kv_heads <= 0 || cfg.num_heads % cfg.num_kv_heads != 0)
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", cfg.num_heads, " heads cannot be grouped over ",
                                                   cfg.num_kv_heads, " KV heads"));

  EXL3_RETURN_IF_ERROR(ReadSection(file, &cfg));

  if (cfg.num_layers > 0 && cfg.intermediate_size <= 0) {
    for (int l = 0; l < cfg.num_layers; ++l)
      if (!cfg.IsMoeLayer(l)) return MissingField(source, "intermediate_size (a dense MLP layer exists)");
  }

  EXL3_ASSIGN_OR_RETURN(cfg.eos_token_ids, EosIds(j));
  if (!generation_config_json.empty()) {
    const json g = json::parse(generation_config_json, nullptr, false);
    if (g.is_object() && g.contains("eos_token_id")) {
      EXL3_ASSIGN_OR_RETURN(cfg.eos_token_ids, EosIds(g));
    }
  }
  return cfg;
}

absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view config_json, std::string_view source,
                                             std::string_view generation_config_json) {
  EXL3_ASSIGN_OR_RETURN(const ConfigFile file, ConfigFile::Parse(config_json, source));
  return ReadModelConfig(file, generation_config_json);
}

absl::StatusOr<ModelConfig> LoadModelConfig(const ConfigFile& file, const std::string& dir) {
  std::string generation;
  if (std::ifstream f(dir + "/generation_config.json"); f) {
    std::stringstream ss;
    ss << f.rdbuf();
    generation = ss.str();
  }
  return ReadModelConfig(file, generation);
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& dir) {
  EXL3_ASSIGN_OR_RETURN(const ConfigFile file, ConfigFile::Read(dir + "/config.json"));
  return LoadModelConfig(file, dir);
}

}  // namespace exl3::engine
