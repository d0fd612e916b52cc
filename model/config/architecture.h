// The architectures this project reads (config.json "architectures"[0]) and what a reader must
// know of each before it reads a field: its MoE family (the routing design and the tensor naming
// of its experts) and where its language model lives (fields at the top level or in `text_config`,
// tensors under "model." or "model.language_model."). One row per architecture in
// architecture.cc; the readers' sections are chosen from it (model/config/read_moe_config.cc for
// the MoE layout, engine/config/read_model_config.cc for what the engines run).
//
//   const ArchitectureInfo* a = FindArchitecture("Qwen3NextForCausalLM");
//   a->family == MoeFamily::kQwen3Next;  a->text_model == TextModelPlace::kTopLevel;
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace exl3 {

enum class Architecture {
  kGlm4Moe,     // Glm4MoeForCausalLM (GLM-4.5 / 4.6 / 4.7)
  kGlmMoeDsa,   // GlmMoeDsaForCausalLM (GLM-5)
  kGlm5Next,    // Glm5NextForConditionalGeneration (GLM-5.3-Flash's text model)
  kDeepseekV3,  // DeepseekV3ForCausalLM
  kDeepseekV4,  // DeepseekV4ForCausalLM
  kQwen3Moe,    // Qwen3MoeForCausalLM
  kQwen3Next,   // Qwen3NextForCausalLM
  kMixtral,     // MixtralForCausalLM
  kQwen4Exp,    // Qwen4ExpForConditionalGeneration (its text model)
};

// The MoE design: how experts are routed and how their tensors are named.
enum class MoeFamily { kGlm, kDeepseekV3, kDeepseekV4, kQwen3Moe, kQwen3Next, kMixtral, kQwen4Exp };

// Where config.json keeps the language model's fields and the checkpoint its tensors.
enum class TextModelPlace {
  kTopLevel,    // fields at the top level, tensors under "model."
  kTextConfig,  // fields in `text_config` (the top level when the file has none, as transformers
                // reads a flat file), tensors under "model.language_model." (a vision tower beside)
};

struct ArchitectureInfo {
  Architecture architecture;
  const char* name;  // as config.json writes it
  MoeFamily family;
  TextModelPlace text_model;
};

// The row of `name`; null when the architecture is not supported.
const ArchitectureInfo* FindArchitecture(std::string_view name);
const ArchitectureInfo& InfoOf(Architecture architecture);
// Every supported name, in the table's order.
std::vector<std::string> SupportedArchitectures();

std::string_view MoeFamilyName(MoeFamily f);  // "glm", "deepseek_v3", ...

}  // namespace exl3
