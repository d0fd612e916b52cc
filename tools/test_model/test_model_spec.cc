#include "tools/test_model/test_model_spec.h"

namespace exl3 {

bool IsSigmoidFamily(const std::string& arch) {
  return arch == "glm4_moe" || arch == "deepseek_v3" || arch == "glm_moe_dsa" || arch == "glm5_next";
}

bool IsLatentAttention(const std::string& arch) {
  return arch == "deepseek_v3" || arch == "glm_moe_dsa" || arch == "glm5_next";
}

}  // namespace exl3
