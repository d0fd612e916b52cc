#include "model/config/architecture.h"

#include <iterator>

namespace exl3 {
namespace {

constexpr ArchitectureInfo kArchitectures[] = {
    {Architecture::kGlm4Moe, "Glm4MoeForCausalLM", MoeFamily::kGlm, TextModelPlace::kTopLevel},
    {Architecture::kGlmMoeDsa, "GlmMoeDsaForCausalLM", MoeFamily::kGlm, TextModelPlace::kTopLevel},
    {Architecture::kGlm5Next, "Glm5NextForConditionalGeneration", MoeFamily::kGlm,
     TextModelPlace::kTextConfig},
    {Architecture::kDeepseekV3, "DeepseekV3ForCausalLM", MoeFamily::kDeepseekV3,
     TextModelPlace::kTopLevel},
    {Architecture::kDeepseekV4, "DeepseekV4ForCausalLM", MoeFamily::kDeepseekV4,
     TextModelPlace::kTopLevel},
    {Architecture::kQwen3Moe, "Qwen3MoeForCausalLM", MoeFamily::kQwen3Moe, TextModelPlace::kTopLevel},
    {Architecture::kQwen3Next, "Qwen3NextForCausalLM", MoeFamily::kQwen3Next, TextModelPlace::kTopLevel},
    {Architecture::kMixtral, "MixtralForCausalLM", MoeFamily::kMixtral, TextModelPlace::kTopLevel},
    {Architecture::kQwen4Exp, "Qwen4ExpForConditionalGeneration", MoeFamily::kQwen4Exp,
     TextModelPlace::kTextConfig},
};

// InfoOf indexes the table by the enumerator: the rows follow the enum's order.
constexpr bool RowsInEnumOrder() {
  for (int i = 0; i < static_cast<int>(std::size(kArchitectures)); ++i)
    if (static_cast<int>(kArchitectures[i].architecture) != i) return false;
  return true;
}
static_assert(RowsInEnumOrder(), "kArchitectures must list the architectures in enum order");

}  // namespace

const ArchitectureInfo* FindArchitecture(std::string_view name) {
  for (const ArchitectureInfo& a : kArchitectures)
    if (name == a.name) return &a;
  return nullptr;
}

const ArchitectureInfo& InfoOf(Architecture architecture) {
  return kArchitectures[static_cast<int>(architecture)];
}

std::vector<std::string> SupportedArchitectures() {
  std::vector<std::string> out;
  for (const ArchitectureInfo& a : kArchitectures) out.push_back(a.name);
  return out;
}

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

}  // namespace exl3
