#include "model/moe_config.h"

#include "absl/strings/str_cat.h"

namespace exl3 {
namespace {

// The w1/w2/w3 naming of Mixtral and DeepSeek-V4: w1 gate, w3 up, w2 down.
const char* W123(Projection p) {
  return p == Projection::kGate ? "w1" : p == Projection::kUp ? "w3" : "w2";
}

}  // namespace

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

std::vector<int> MoeConfig::MoeLayers() const {
  std::vector<int> out;
  for (int l = 0; l < num_hidden_layers; ++l) {
    if (moe_layers[l]) out.push_back(l);
  }
  return out;
}

std::string TextModelPrefix(const MoeConfig& cfg) {
  return InfoOf(cfg.arch).text_model == TextModelPlace::kTextConfig ? "model.language_model." : "model.";
}

std::string LayerPrefix(const MoeConfig& cfg, int layer) {
  return absl::StrCat(TextModelPrefix(cfg), "layers.", layer, ".");
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
