#include "model/config/read_moe_config.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/config/deepseek_v4_moe.h"
#include "model/config/grouped_sigmoid_moe.h"
#include "model/config/json_fields.h"
#include "model/config/softmax_moe.h"

namespace exl3 {
namespace {

using nlohmann::json;

// exllamav3's quantization_config (model/moe_config.h, MoeConfig::quant_method).
absl::Status ReadQuantization(const json* q, const FieldReader& r, MoeConfig* c) {
  if (q == nullptr || !q->is_object()) return absl::OkStatus();
  if (q->contains("quant_method") && (*q)["quant_method"].is_string()) {
    c->quant_method = (*q)["quant_method"].get<std::string>();
  }
  if (q->contains("bits") && (*q)["bits"].is_number()) c->bits = (*q)["bits"].get<double>();
  if (q->contains("head_bits") && (*q)["head_bits"].is_number()) {
    c->head_bits = (*q)["head_bits"].get<double>();
  }
  if (q->contains("version") && (*q)["version"].is_string()) {
    c->quant_version = (*q)["version"].get<std::string>();
  }
  if (q->contains("codebook") && (*q)["codebook"].is_string()) {
    c->quant_codebook = (*q)["codebook"].get<std::string>();
    if (c->quant_codebook != "mul1" && c->quant_codebook != "mcg" && c->quant_codebook != "3inst") {
      return r.Bad("quantization_config.codebook",
                   absl::StrCat("is '", c->quant_codebook, "', not mul1, mcg or 3inst"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<MoeConfig> ReadMoeConfig(const ConfigFile& file) {
  MoeConfig c;
  c.architecture = file.architecture().name;
  c.arch = file.architecture().architecture;
  c.family = file.architecture().family;
  const FieldReader r(file.text(), file.source(), c.architecture);

  EXL3_RETURN_IF_ERROR(r.Int("hidden_size", &c.hidden_size));
  EXL3_RETURN_IF_ERROR(r.Int("num_hidden_layers", &c.num_hidden_layers));
  EXL3_RETURN_IF_ERROR(r.Int("num_experts_per_tok", &c.top_k));
  EXL3_RETURN_IF_ERROR(r.OptFloat("swiglu_limit", &c.swiglu_limit));
  c.moe_layers.assign(c.num_hidden_layers, false);
  c.hash_routed_layers.assign(c.num_hidden_layers, false);

  switch (c.family) {
    case MoeFamily::kGlm:
    case MoeFamily::kDeepseekV3:
      EXL3_RETURN_IF_ERROR(ReadGroupedSigmoidMoe(r, &c));
      break;
    case MoeFamily::kDeepseekV4:
      EXL3_RETURN_IF_ERROR(ReadDeepseekV4Moe(r, &c));
      break;
    case MoeFamily::kQwen3Moe:
    case MoeFamily::kQwen3Next:
      EXL3_RETURN_IF_ERROR(ReadQwenMoe(r, &c));
      break;
    case MoeFamily::kQwen4Exp:
      EXL3_RETURN_IF_ERROR(ReadQwen4ExpMoe(r, &c));
      break;
    case MoeFamily::kMixtral:
      EXL3_RETURN_IF_ERROR(ReadMixtralMoe(r, &c));
      break;
  }

  c.shared_swiglu_limit = c.swiglu_limit;

  // Consistency.
  if (c.hidden_size <= 0) return r.Bad("hidden_size", "must be positive");
  if (c.num_experts <= 0) return r.Bad("number of experts", "must be positive");
  if (c.top_k <= 0 || c.top_k > c.num_experts) {
    return r.Bad("num_experts_per_tok", absl::StrCat("is ", c.top_k, ", not in 1..", c.num_experts));
  }
  if (c.moe_intermediate_size <= 0) return r.Bad("moe_intermediate_size", "must be positive");
  if (c.n_group < 1 || c.topk_group < 1 || c.topk_group > c.n_group ||
      c.num_experts % c.n_group != 0) {
    return r.Bad("n_group/topk_group",
                 absl::StrCat("(", c.n_group, "/", c.topk_group, ") do not divide ", c.num_experts,
                              " experts into groups"));
  }
  if (c.n_group > 1 && c.num_experts / c.n_group < 2) {
    return r.Bad("n_group", "leaves fewer than 2 experts per group (groups are scored by their top 2)");
  }
  if (c.topk_group * (c.num_experts / c.n_group) < c.top_k) {
    return r.Bad("topk_group", "keeps fewer experts than num_experts_per_tok");
  }
  if (!(c.swiglu_limit >= 0.0f) || !std::isfinite(c.swiglu_limit)) {
    return r.Bad("swiglu_limit", "must be finite and >= 0");
  }
  if (!(c.routed_scaling_factor > 0.0f)) return r.Bad("routed_scaling_factor", "must be > 0");

  EXL3_RETURN_IF_ERROR(ReadQuantization(file.quantization_config(), r, &c));
  return c;
}

absl::StatusOr<MoeConfig> ParseMoeConfig(std::string_view json_text, std::string_view source) {
  EXL3_ASSIGN_OR_RETURN(const ConfigFile file, ConfigFile::Parse(json_text, source));
  return ReadMoeConfig(file);
}

absl::StatusOr<MoeConfig> LoadMoeConfig(const std::string& path) {
  EXL3_ASSIGN_OR_RETURN(const ConfigFile file, ConfigFile::Read(path));
  return ReadMoeConfig(file);
}

}  // namespace exl3
