#include "model/config/config_file.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace exl3 {

using nlohmann::json;

absl::StatusOr<ConfigFile> ConfigFile::Parse(std::string_view json_text, std::string_view source) {
  std::string src(source);
  json top = json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (top.is_discarded() || !top.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(src, ": not a JSON object"));
  }
  if (!top.contains("architectures") || !top["architectures"].is_array() ||
      top["architectures"].empty() || !top["architectures"][0].is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat(src, ": required field 'architectures' (a list of names) is missing"));
  }
  const std::string name = top["architectures"][0].get<std::string>();
  const ArchitectureInfo* architecture = FindArchitecture(name);
  if (architecture == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        src, ": architecture '", name, "' is not supported (supported: ",
        absl::StrJoin(SupportedArchitectures(), ", "), ")"));
  }
  const bool nested = architecture->text_model == TextModelPlace::kTextConfig &&
                      top.contains("text_config") && top["text_config"].is_object();
  return ConfigFile(std::move(src), std::string(json_text), architecture, std::move(top), nested);
}

absl::StatusOr<ConfigFile> ConfigFile::Read(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::string file = path;
  if (fs::is_directory(path, ec)) file = (fs::path(path) / "config.json").string();
  std::ifstream in(file, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", file));
  std::stringstream ss;
  ss << in.rdbuf();
  return Parse(ss.str(), file);
}

const json* ConfigFile::quantization_config() const {
  if (top_.contains("quantization_config")) return &top_["quantization_config"];
  const json& t = text();
  if (t.contains("quantization_config")) return &t["quantization_config"];
  return nullptr;
}

}  // namespace exl3
