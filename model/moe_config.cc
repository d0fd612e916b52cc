#include "model/moe_config.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "nlohmann/json.hpp"

namespace exl3 {
namespace {

using nlohmann::json;

struct ArchEntry {
  const char* name;
  MoeFamily family;
};
constexpr ArchEntry kArchitectures[] = {
    {"Glm4MoeForCausalLM", MoeFamily::kGlm},
    {"GlmMoeDsaForCausalLM", MoeFamily::kGlm},
    {"Glm5NextForConditionalGeneration", MoeFamily::kGlm},
    {"DeepseekV3ForCausalLM", MoeFamily::kDeepseekV3},
    {"DeepseekV4ForCausalLM", MoeFamily::kDeepseekV4},
    {"Qwen3MoeForCausalLM", MoeFamily::kQwen3Moe},
    {"Qwen3NextForCausalLM", MoeFamily::kQwen3Next},
    {"MixtralForCausalLM", MoeFamily::kMixtral},
    {"Qwen4ExpForConditionalGeneration", MoeFamily::kQwen4Exp},
};

// Field readers that never throw: each returns an error naming the field and the file.
class Reader {
 public:
  Reader(const json& j, std::string source) : j_(j), source_(std::move(source)) {}

  absl::Status Missing(std::string_view field) const {
    return absl::InvalidArgumentError(absl::StrCat(source_, ": required field '",
                                                   std::string(field), "' is missing (",
                                                   arch_, ")"));
  }
  absl::Status Bad(std::string_view field, std::string_view why) const {
    return absl::InvalidArgumentError(absl::StrCat(source_, ": field '", std::string(field),
                                                   "' ", std::string(why)));
  }
  void set_arch(std::string a) { arch_ = std::move(a); }
  bool Has(const char* f) const { return j_.contains(f) && !j_[f].is_null(); }

  absl::Status Int(const char* f, int* out) const {
    if (!Has(f)) return Missing(f);
    return OptInt(f, out);
  }
  absl::Status OptInt(const char* f, int* out) const {
    if (!Has(f)) return absl::OkStatus();
    const json& v = j_[f];
    if (!v.is_number_integer()) return Bad(f, "is not an integer");
    const int64_t x = v.get<int64_t>();
    if (x < 0 || x > (1 << 30)) return Bad(f, absl::StrCat("has out-of-range value ", x));
    *out = static_cast<int>(x);
    return absl::OkStatus();
  }
  // A field that has two names: either may be present; both must then agree.
  absl::Status OneOfInt(const char* f, const char* alt, int* out) const {
    if (!Has(f) && !Has(alt)) {
      return absl::InvalidArgumentError(absl::StrCat(source_, ": required field '", f, "' (or '",
                                                     alt, "') is missing (", arch_, ")"));
    }
    int a = -1, b = -1;
    EXL3_RETURN_IF_ERROR(OptInt(f, &a));
    EXL3_RETURN_IF_ERROR(OptInt(alt, &b));
    if (a >= 0 && b >= 0 && a != b) {
      return Bad(f, absl::StrCat("is ", a, " but '", alt, "' is ", b));
    }
    *out = a >= 0 ? a : b;
    return absl::OkStatus();
  }
  absl::Status OptFloat(const char* f, float* out) const {
    if (!Has(f)) return absl::OkStatus();
    const json& v = j_[f];
    if (!v.is_number()) return Bad(f, "is not a number");
    *out = v.get<float>();
    return absl::OkStatus();
  }
  absl::Status OptBool(const char* f, bool* out) const {
    if (!Has(f)) return absl::OkStatus();
    const json& v = j_[f];
    if (!v.is_boolean()) return Bad(f, "is not a boolean");
    *out = v.get<bool>();
    return absl::OkStatus();
  }
  absl::Status OptString(const char* f, std::string* out) const {
    if (!Has(f)) return absl::OkStatus();
    const json& v = j_[f];
    if (!v.is_string()) return Bad(f, "is not a string");
    *out = v.get<std::string>();
    return absl::OkStatus();
  }
  absl::Status OptStringList(const char* f, std::vector<std::string>* out) const {
    if (!Has(f)) return absl::OkStatus();
    const json& v = j_[f];
    if (!v.is_array()) return Bad(f, "is not a list");
    for (const auto& e : v) {
      if (!e.is_string()) return Bad(f, "holds a non-string");
      out->push_back(e.get<std::string>());
    }
    return absl::OkStatus();
  }
  // A list of per-layer names, each `unset` or `set`, as a flag per layer (true where `set`):
  // the wrong length or another name is an error. Absent: *present is false, *flags untouched.
  absl::Status OptLayerFlags(const char* f, int num_layers, const std::string& unset, const std::string& set,
                             std::vector<bool>* flags, bool* present) const {
    std::vector<std::string> kinds;
    EXL3_RETURN_IF_ERROR(OptStringList(f, &kinds));
    *present = !kinds.empty();
    if (!*present) return absl::OkStatus();
    if (static_cast<int>(kinds.size()) != num_layers) {
      return Bad(f, absl::StrCat("has ", kinds.size(), " entries for ", num_layers, " layers"));
    }
    for (int l = 0; l < num_layers; ++l) {
      if (kinds[l] != unset && kinds[l] != set) {
        return Bad(f, absl::StrCat("entry ", l, " is '", kinds[l], "', not '", unset, "' or '", set, "'"));
      }
      (*flags)[l] = kinds[l] == set;
    }
    return absl::OkStatus();
  }
  absl::Status OptIntList(const char* f, std::vector<int>* out) const {
    if (!Has(f)) return absl::OkStatus();
    const json& v = j_[f];
    if (!v.is_array()) return Bad(f, "is not a list");
    for (const auto& e : v) {
      if (!e.is_number_integer()) return Bad(f, "holds a non-integer");
      out->push_back(e.get<int>());
    }
    return absl::OkStatus();
  }

 private:
  const json& j_;
  std::string source_;
  std::string arch_;
};

// The architectures whose config.json nests the language model's fields in `text_config` and
// whose text tensors live under "model.language_model." (a vision tower beside them).
constexpr char kGlm5Next[] = "Glm5NextForConditionalGeneration";
constexpr char kQwen4Exp[] = "Qwen4ExpForConditionalGeneration";
bool IsConditionalGeneration(std::string_view architecture) {
  return architecture == kGlm5Next || architecture == kQwen4Exp;
}

// The w1/w2/w3 naming of Mixtral and DeepSeek-V4: w1 gate, w3 up, w2 down.
const char* W123(Projection p) {
  return p == Projection::kGate ? "w1" : p == Projection::kUp ? "w3" : "w2";
}

}  // namespace

std::string_view MoeFamilyName(MoeFamily f) {
  switch (f) {
    case MoeFamily::kGlm: return "glm";
    case MoeFamily::kDeepseekV3: return "deepseek_v3";
    case MoeFamily::kDeepseekV4: return "deepseek_v4";
    case MoeFamily::kQwen3Moe: return "qwen3_moe";
    case MoeFamily::kQwen3Next: return "qwen3_next";
    case MoeFamily::kMixtral: return "mixtral";
    case MoeFamily::kQwen4Exp: return "qwen4_exp";
  }
  return "?";
}

std::string_view ScoringFuncName(ScoringFunc s) {
  switch (s) {
    case ScoringFunc::kSoftmax: return "softmax";
    case ScoringFunc::kSigmoid: return "sigmoid";
    case ScoringFunc::kSqrtSoftplus: return "sqrtsoftplus";
  }
  return "?";
}

std::string_view ProjectionName(Projection p) {
  switch (p) {
    case Projection::kGate: return "gate";
    case Projection::kUp: return "up";
    case Projection::kDown: return "down";
  }
  return "?";
}

std::string_view MlpKindName(MlpKind k) {
  switch (k) {
    case MlpKind::kDense: return "dense";
    case MlpKind::kMoe: return "moe";
    case MlpKind::kHashMoe: return "hash_moe";
  }
  return "?";
}

std::vector<std::string> SupportedArchitectures() {
  std::vector<std::string> out;
  for (const auto& a : kArchitectures) out.push_back(a.name);
  return out;
}

std::vector<int> MoeConfig::MoeLayers() const {
  std::vector<int> out;
  for (int l = 0; l < num_hidden_layers; ++l) {
    if (moe_layers[l]) out.push_back(l);
  }
  return out;
}

std::string LiftTextConfig(std::string_view json_text) {
  json j = json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || !j.contains("architectures") ||
      !j["architectures"].is_array() || j["architectures"].empty() ||
      !j["architectures"][0].is_string() ||
      !IsConditionalGeneration(j["architectures"][0].get<std::string>()) || !j.contains("text_config") ||
      !j["text_config"].is_object()) {
    return std::string(json_text);
  }
  json text = j["text_config"];
  text["architectures"] = j["architectures"];
  if (j.contains("quantization_config")) text["quantization_config"] = j["quantization_config"];
  return text.dump();
}

std::string TextModelPrefix(const MoeConfig& cfg) {
  return IsConditionalGeneration(cfg.architecture) ? "model.language_model." : "model.";
}

std::string LayerPrefix(const MoeConfig& cfg, int layer) {
  return absl::StrCat(TextModelPrefix(cfg), "layers.", layer, ".");
}

absl::StatusOr<MoeConfig> ParseMoeConfig(std::string_view json_text_as_given, std::string_view source) {
  const std::string src(source);
  const std::string json_text = LiftTextConfig(json_text_as_given);
  json j = json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(src, ": not a JSON object"));
  }
  Reader r(j, src);
  MoeConfig c;
  if (!j.contains("architectures") || !j["architectures"].is_array() ||
      j["architectures"].empty() || !j["architectures"][0].is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat(src, ": required field 'architectures' (a list of names) is missing"));
  }
  c.architecture = j["architectures"][0].get<std::string>();
  bool known = false;
  for (const auto& a : kArchitectures) {
    if (c.architecture == a.name) {
      c.family = a.family;
      known = true;
    }
  }
  if (!known) {
    return absl::InvalidArgumentError(absl::StrCat(
        src, ": architecture '", c.architecture, "' is not supported (supported: ",
        absl::StrJoin(SupportedArchitectures(), ", "), ")"));
  }
  r.set_arch(c.architecture);

  EXL3_RETURN_IF_ERROR(r.Int("hidden_size", &c.hidden_size));
  EXL3_RETURN_IF_ERROR(r.Int("num_hidden_layers", &c.num_hidden_layers));
  EXL3_RETURN_IF_ERROR(r.Int("num_experts_per_tok", &c.top_k));
  EXL3_RETURN_IF_ERROR(r.OptFloat("swiglu_limit", &c.swiglu_limit));
  c.moe_layers.assign(c.num_hidden_layers, false);

  c.hash_routed_layers.assign(c.num_hidden_layers, false);

  switch (c.family) {
    case MoeFamily::kGlm:
    case MoeFamily::kDeepseekV3: {
      // Where a field is absent, the default of the family's transformers config class:
      // n_shared_experts 1, norm_topk_prob true; routed_scaling_factor 1.0 (Glm4Moe) or 2.5
      // (GlmMoeDsa, DeepseekV3); n_group / topk_group 1 / 1, DeepSeek-V3 8 / 4.
      const bool glm4 = c.architecture == "Glm4MoeForCausalLM";
      const bool glm5_next = c.architecture == kGlm5Next;
      c.num_shared_experts = 1;
      if (glm5_next) c.swiglu_limit = 10.0f;  // Glm5NextTextConfig's default
      EXL3_RETURN_IF_ERROR(r.OptFloat("swiglu_limit", &c.swiglu_limit));
      c.routed_scaling_factor = glm4 ? 1.0f : 2.5f;
      if (c.family == MoeFamily::kDeepseekV3) {
        c.n_group = 8;
        c.topk_group = 4;
      }
      EXL3_RETURN_IF_ERROR(r.Int("n_routed_experts", &c.num_experts));
      EXL3_RETURN_IF_ERROR(r.Int("moe_intermediate_size", &c.moe_intermediate_size));
      EXL3_RETURN_IF_ERROR(r.OptInt("n_shared_experts", &c.num_shared_experts));
      c.shared_intermediate_size = c.num_shared_experts * c.moe_intermediate_size;
      // GLM-MoE-DSA (GLM-5) names each layer's MLP in mlp_layer_types ("dense" / "sparse"; its
      // transformers config derives the list from first_k_dense_replace when absent); GLM-4.x MoE
      // and DeepSeek-V3 use first_k_dense_replace (and DeepSeek-V2-era files moe_layer_freq).
      bool listed = false;
      if (c.architecture == "GlmMoeDsaForCausalLM" || glm5_next) {
        EXL3_RETURN_IF_ERROR(r.OptLayerFlags("mlp_layer_types", c.num_hidden_layers, "dense", "sparse",
                                             &c.moe_layers, &listed));
      }
      if (!listed && glm5_next) {
        // Glm5NextTextConfig: the first min(3, layers) layers dense, the rest sparse.
        for (int l = 0; l < c.num_hidden_layers; ++l) c.moe_layers[l] = l >= 3;
        listed = true;
      }
      if (!listed) {
        int first_dense = 0, freq = 1;
        EXL3_RETURN_IF_ERROR(r.Int("first_k_dense_replace", &first_dense));
        EXL3_RETURN_IF_ERROR(r.OptInt("moe_layer_freq", &freq));
        if (freq < 1) return r.Bad("moe_layer_freq", "must be at least 1");
        for (int l = 0; l < c.num_hidden_layers; ++l) {
          c.moe_layers[l] = l >= first_dense && l % freq == 0;
        }
      }
      c.norm_topk_prob = true;
      EXL3_RETURN_IF_ERROR(r.OptBool("norm_topk_prob", &c.norm_topk_prob));
      EXL3_RETURN_IF_ERROR(r.OptFloat("routed_scaling_factor", &c.routed_scaling_factor));
      EXL3_RETURN_IF_ERROR(r.OptInt("n_group", &c.n_group));
      EXL3_RETURN_IF_ERROR(r.OptInt("topk_group", &c.topk_group));
      c.has_correction_bias = true;
      c.scoring = ScoringFunc::kSigmoid;
      if (c.family == MoeFamily::kDeepseekV3) {
        std::string scoring = "sigmoid";
        EXL3_RETURN_IF_ERROR(r.OptString("scoring_func", &scoring));
        if (scoring != "sigmoid") {
          return r.Bad("scoring_func", absl::StrCat("is '", scoring, "'; ", c.architecture,
                                                    " is supported with sigmoid"));
        }
      }
      std::string topk_method = "noaux_tc";
      EXL3_RETURN_IF_ERROR(r.OptString("topk_method", &topk_method));
      if (topk_method != "noaux_tc") {
        return r.Bad("topk_method", absl::StrCat("is '", topk_method, "'; only noaux_tc is supported"));
      }
      break;
    }
    case MoeFamily::kDeepseekV4: {
      // Facts from transformers 5.24's DeepseekV4Config / modeling_deepseek_v4: every layer is
      // MoE; mlp_layer_types names each "hash_moe" or "moe" (older files: the first
      // num_hash_layers layers, 3 when neither is given); one shared expert of
      // moe_intermediate_size; no grouped routing; the chosen weights are always renormalised
      // (norm_topk_prob is not read) and scaled by routed_scaling_factor (default 1.5; older
      // files: route_scale); swiglu_limit defaults to 10.
      EXL3_RETURN_IF_ERROR(r.Int("n_routed_experts", &c.num_experts));
      EXL3_RETURN_IF_ERROR(r.Int("moe_intermediate_size", &c.moe_intermediate_size));
      int shared = 1;
      EXL3_RETURN_IF_ERROR(r.OptInt("n_shared_experts", &shared));
      if (shared != 1) {
        return r.Bad("n_shared_experts", absl::StrCat("is ", shared, "; ", c.architecture,
                                                      " has exactly one shared expert"));
      }
      c.num_shared_experts = 1;
      c.shared_intermediate_size = c.moe_intermediate_size;
      for (int l = 0; l < c.num_hidden_layers; ++l) c.moe_layers[l] = true;
      bool listed = false;
      EXL3_RETURN_IF_ERROR(r.OptLayerFlags("mlp_layer_types", c.num_hidden_layers, "moe", "hash_moe",
                                           &c.hash_routed_layers, &listed));
      if (!listed) {
        int n_hash = 3;
        EXL3_RETURN_IF_ERROR(r.OptInt("num_hash_layers", &n_hash));
        EXL3_RETURN_IF_ERROR(r.OptInt("n_hash_layers", &n_hash));
        for (int l = 0; l < c.num_hidden_layers; ++l) c.hash_routed_layers[l] = l < n_hash;
      }
      c.norm_topk_prob = true;
      c.routed_scaling_factor = 1.5f;
      EXL3_RETURN_IF_ERROR(r.OptFloat("route_scale", &c.routed_scaling_factor));
      EXL3_RETURN_IF_ERROR(r.OptFloat("routed_scaling_factor", &c.routed_scaling_factor));
      c.has_correction_bias = true;
      std::string scoring = "sqrtsoftplus";
      EXL3_RETURN_IF_ERROR(r.OptString("scoring_func", &scoring));
      if (scoring == "sqrtsoftplus") {
        c.scoring = ScoringFunc::kSqrtSoftplus;
      } else if (scoring == "sigmoid") {
        c.scoring = ScoringFunc::kSigmoid;
      } else {
        return r.Bad("scoring_func", absl::StrCat("is '", scoring, "'; ", c.architecture,
                                                  " is supported with sqrtsoftplus or sigmoid"));
      }
      c.swiglu_limit = 10.0f;
      EXL3_RETURN_IF_ERROR(r.OptFloat("swiglu_limit", &c.swiglu_limit));
      break;
    }
    case MoeFamily::kQwen3Moe:
    case MoeFamily::kQwen3Next: {
      // transformers 5.x writes Qwen3-MoE's expert count as num_local_experts (its
      // Qwen3MoeConfig maps num_experts onto it); older files and Qwen3-Next say num_experts.
      EXL3_RETURN_IF_ERROR(r.OneOfInt("num_local_experts", "num_experts", &c.num_experts));
      EXL3_RETURN_IF_ERROR(r.Int("moe_intermediate_size", &c.moe_intermediate_size));
      int step = 1;
      std::vector<int> mlp_only;
      EXL3_RETURN_IF_ERROR(r.OptInt("decoder_sparse_step", &step));
      EXL3_RETURN_IF_ERROR(r.OptIntList("mlp_only_layers", &mlp_only));
      if (step < 1) return r.Bad("decoder_sparse_step", "must be at least 1");
      for (int l = 0; l < c.num_hidden_layers; ++l) {
        bool only = false;
        for (int m : mlp_only) only |= (m == l);
        c.moe_layers[l] = !only && c.num_experts > 0 && (l + 1) % step == 0;
      }
      // transformers' defaults: Qwen3MoeConfig norm_topk_prob false, Qwen3NextConfig true.
      c.norm_topk_prob = c.family == MoeFamily::kQwen3Next;
      EXL3_RETURN_IF_ERROR(r.OptBool("norm_topk_prob", &c.norm_topk_prob));
      c.scoring = ScoringFunc::kSoftmax;
      if (c.family == MoeFamily::kQwen3Next) {
        EXL3_RETURN_IF_ERROR(r.Int("shared_expert_intermediate_size", &c.shared_intermediate_size));
        c.num_shared_experts = c.shared_intermediate_size > 0 ? 1 : 0;
        c.shared_expert_gated = c.shared_intermediate_size > 0;
      }
      break;
    }
    case MoeFamily::kQwen4Exp: {
      // transformers 5.25's Qwen4ExpTextConfig: every layer is MoE (no mlp_only_layers),
      // softmax top-k renormalised by default, one shared expert scaled by
      // sigmoid(shared_expert_gate) as Qwen3-Next's.
      EXL3_RETURN_IF_ERROR(r.Int("num_experts", &c.num_experts));
      EXL3_RETURN_IF_ERROR(r.Int("moe_intermediate_size", &c.moe_intermediate_size));
      EXL3_RETURN_IF_ERROR(r.Int("shared_expert_intermediate_size", &c.shared_intermediate_size));
      if (c.shared_intermediate_size <= 0) {
        return r.Bad("shared_expert_intermediate_size", "must be positive (Qwen4-Exp has a shared expert)");
      }
      for (int l = 0; l < c.num_hidden_layers; ++l) c.moe_layers[l] = true;
      c.norm_topk_prob = true;
      EXL3_RETURN_IF_ERROR(r.OptBool("norm_topk_prob", &c.norm_topk_prob));
      c.scoring = ScoringFunc::kSoftmax;
      c.num_shared_experts = 1;
      c.shared_expert_gated = true;
      break;
    }
    case MoeFamily::kMixtral: {
      EXL3_RETURN_IF_ERROR(r.Int("num_local_experts", &c.num_experts));
      EXL3_RETURN_IF_ERROR(r.Int("intermediate_size", &c.moe_intermediate_size));
      for (int l = 0; l < c.num_hidden_layers; ++l) c.moe_layers[l] = true;
      c.norm_topk_prob = true;  // Mixtral always renormalises its top-k
      c.scoring = ScoringFunc::kSoftmax;
      break;
    }
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

  if (j.contains("quantization_config") && j["quantization_config"].is_object()) {
    const json& q = j["quantization_config"];
    if (q.contains("quant_method") && q["quant_method"].is_string()) {
      c.quant_method = q["quant_method"].get<std::string>();
    }
    if (q.contains("bits") && q["bits"].is_number()) c.bits = q["bits"].get<double>();
    if (q.contains("head_bits") && q["head_bits"].is_number()) {
      c.head_bits = q["head_bits"].get<double>();
    }
    if (q.contains("version") && q["version"].is_string()) {
      c.quant_version = q["version"].get<std::string>();
    }
    if (q.contains("codebook") && q["codebook"].is_string()) {
      c.quant_codebook = q["codebook"].get<std::string>();
      if (c.quant_codebook != "mul1" && c.quant_codebook != "mcg" && c.quant_codebook != "3inst") {
        return r.Bad("quantization_config.codebook",
                     absl::StrCat("is '", c.quant_codebook, "', not mul1, mcg or 3inst"));
      }
    }
  }
  return c;
}

absl::StatusOr<MoeConfig> LoadMoeConfig(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::string file = path;
  if (fs::is_directory(path, ec)) file = (fs::path(path) / "config.json").string();
  std::ifstream in(file, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", file));
  std::stringstream ss;
  ss << in.rdbuf();
  return ParseMoeConfig(ss.str(), file);
}

absl::Status RequireExl3(const MoeConfig& cfg) {
  if (cfg.quant_method != "exl3") {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: quantization_config.quant_method is '",
        cfg.quant_method.empty() ? std::string("(missing)") : cfg.quant_method,
        "', expected 'exl3'"));
  }
  return absl::OkStatus();
}

std::string RoutedExpertPrefix(const MoeConfig& cfg, int layer, int expert, Projection p) {
  if (cfg.family == MoeFamily::kMixtral) {
    return absl::StrCat(LayerPrefix(cfg, layer), "block_sparse_moe.experts.", expert, ".", W123(p));
  }
  if (cfg.family == MoeFamily::kDeepseekV4) {
    return absl::StrCat(LayerPrefix(cfg, layer), "ffn.experts.", expert, ".", W123(p));
  }
  return absl::StrCat(LayerPrefix(cfg, layer), "mlp.experts.", expert, ".",
                      std::string(ProjectionName(p)), "_proj");
}

std::string SharedExpertPrefix(const MoeConfig& cfg, int layer, Projection p) {
  if (!cfg.has_shared_expert()) return "";
  if (cfg.family == MoeFamily::kDeepseekV4) {
    return absl::StrCat(LayerPrefix(cfg, layer), "ffn.shared_experts.", W123(p));
  }
  const char* sub = cfg.family == MoeFamily::kQwen3Next || cfg.family == MoeFamily::kQwen4Exp
                        ? "mlp.shared_expert."
                        : "mlp.shared_experts.";
  return absl::StrCat(LayerPrefix(cfg, layer), sub, std::string(ProjectionName(p)), "_proj");
}

std::string RouterWeightKey(const MoeConfig& cfg, int layer) {
  if (cfg.family == MoeFamily::kMixtral) {
    return absl::StrCat(LayerPrefix(cfg, layer), "block_sparse_moe.gate.weight");
  }
  if (cfg.family == MoeFamily::kDeepseekV4) return absl::StrCat(LayerPrefix(cfg, layer), "ffn.gate.weight");
  return absl::StrCat(LayerPrefix(cfg, layer), "mlp.gate.weight");
}

std::string CorrectionBiasKey(const MoeConfig& cfg, int layer) {
  if (!cfg.has_correction_bias || cfg.IsHashRoutedLayer(layer)) return "";
  if (cfg.family == MoeFamily::kDeepseekV4) return absl::StrCat(LayerPrefix(cfg, layer), "ffn.gate.bias");
  return absl::StrCat(LayerPrefix(cfg, layer), "mlp.gate.e_score_correction_bias");
}

std::string SharedExpertGateKey(const MoeConfig& cfg, int layer) {
  if (!cfg.shared_expert_gated) return "";
  return absl::StrCat(LayerPrefix(cfg, layer), "mlp.shared_expert_gate.weight");
}

std::string HashTableKey(const MoeConfig& cfg, int layer) {
  if (!cfg.IsHashRoutedLayer(layer)) return "";
  return absl::StrCat(LayerPrefix(cfg, layer), "ffn.gate.tid2eid");
}

std::string HeadWeightKey(const MoeConfig& cfg) {
  return cfg.family == MoeFamily::kDeepseekV4 ? "head.weight" : "lm_head.weight";
}

}  // namespace exl3
