#include "model/write_weight_digests.h"

#include <filesystem>
#include <fstream>
#include <memory>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/safetensors.h"
#include "model/weight_digest.h"
#include "nlohmann/json.hpp"

namespace exl3 {

absl::Status WriteWeightDigests(const std::string& dir) {
  namespace fs = std::filesystem;
  EXL3_ASSIGN_OR_RETURN(std::unique_ptr<TensorSource> src, TensorSource::Open(dir));
  nlohmann::json tensors = nlohmann::json::object();
  for (const std::string& name : src->Names()) {
    EXL3_ASSIGN_OR_RETURN(TensorView v, src->Get(name));
    tensors[name] = DigestBytes(v.data, v.size_bytes());
  }
  const nlohmann::json j = {{"algorithm", kWeightDigestAlgorithm}, {"tensors", tensors}};
  const fs::path path = fs::path(dir) / kWeightDigestFile;
  const fs::path tmp = fs::path(dir) / (std::string(kWeightDigestFile) + ".tmp");
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << j.dump(1) << "\n";
    if (!out) return absl::InternalError(absl::StrCat("cannot write ", tmp.string()));
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot rename ", tmp.string(), ": ", ec.message()));
  return absl::OkStatus();
}

}  // namespace exl3
