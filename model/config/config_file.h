// A model's config.json parsed once: the architecture it names (model/config/architecture.h), the
// whole object, and the language model's fields (`text_config` for the architectures that nest
// them). Every reader of a model's configuration starts from one: model/config/read_moe_config.h
// (the MoE layout the router, workers, converter and tools need) and
// engine/config/read_model_config.h (what the engines run, the MoE layout included).
//
//   EXL3_ASSIGN_OR_RETURN(ConfigFile file, ConfigFile::Read("/models/glm-exl3"));
//   file.architecture().family;  file.text().value("hidden_size", 0);
//
// A process reads its model's config.json once and hands the ConfigFile on: the engines'
// configuration, the MoE layout and the model fingerprint (model/exl3_model.h, over bytes()) all
// come from the same read.
//
// Refused here, before any field is read: text that is not a JSON object, a missing
// `architectures` list, and an architecture this project does not support (named, with the list).
#pragma once

#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "model/config/architecture.h"
#include "nlohmann/json.hpp"

namespace exl3 {

class ConfigFile {
 public:
  // `source` names the file in errors.
  static absl::StatusOr<ConfigFile> Parse(std::string_view json_text, std::string_view source);
  // `path`: a config.json file, or a directory holding one.
  static absl::StatusOr<ConfigFile> Read(const std::string& path);

  const std::string& source() const { return source_; }
  // The text parsed, byte for byte as the file holds it (the model fingerprint covers it).
  const std::string& bytes() const { return bytes_; }
  const ArchitectureInfo& architecture() const { return *architecture_; }
  // The whole object (a *ForConditionalGeneration's image and video token ids live here).
  const nlohmann::json& top() const { return top_; }
  // The language model's fields: top()["text_config"] for TextModelPlace::kTextConfig files that
  // have one, else top().
  const nlohmann::json& text() const { return text_nested_ ? top_["text_config"] : top_; }
  // quantization_config: the top level's, else the text config's; null when neither has one.
  const nlohmann::json* quantization_config() const;

 private:
  ConfigFile(std::string source, std::string bytes, const ArchitectureInfo* architecture,
             nlohmann::json top, bool text_nested)
      : source_(std::move(source)), bytes_(std::move(bytes)), architecture_(architecture),
        top_(std::move(top)), text_nested_(text_nested) {}

  std::string source_;
  std::string bytes_;
  const ArchitectureInfo* architecture_;  // a row of the table, never null
  nlohmann::json top_;
  bool text_nested_;  // text() is top_["text_config"]
};

}  // namespace exl3
