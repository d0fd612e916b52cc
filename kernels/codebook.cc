#include "kernels/codebook.h"

#include <array>
#include <mutex>
#include <vector>

namespace exl3 {

std::string_view CodebookName(Codebook cb) {
  switch (cb) {
    case Codebook::k3Inst: return "3inst";
    case Codebook::kMcg: return "mcg";
    case Codebook::kMul1: return "mul1";
  }
  return "unknown";
}

bool ParseCodebook(std::string_view name, Codebook* out) {
  if (name == "3inst") *out = Codebook::k3Inst;
  else if (name == "mcg") *out = Codebook::kMcg;
  else if (name == "mul1") *out = Codebook::kMul1;
  else return false;
  return true;
}

const float* CodebookTable(Codebook cb) {
  static std::array<std::vector<float>, 3> tables;
  static std::array<std::once_flag, 3> once;
  const int i = static_cast<int>(cb);
  std::call_once(once[i], [&] {
    tables[i].resize(65536);
    for (uint32_t s = 0; s < 65536; ++s) tables[i][s] = HalfBitsToFloat(DecodeStateHalf(s, cb));
  });
  return tables[i].data();
}

}  // namespace exl3
