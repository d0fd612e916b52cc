// The configuration section of Qwen4-Exp (Qwen3.8-Flash-Next, `Qwen4ExpForConditionalGeneration`,
// transformers 5.25's Qwen4ExpTextConfig; docs/engine.md, "Qwen4-Exp"): Qwen3-Next's layer types
// and DeltaNet shape (engine/config/qwen3next_section.h) with QSA attention on the
// `indexed_attention` layers, and its own fields into ModelConfig::qwen4exp
// (engine/config/qwen4exp_config.h): gated hyper-connections, the QSA indexer, the PLE n-gram layers and
// the DeltaNet output gate's activation.
//
//   config.json {"architectures": ["Qwen4ExpForConditionalGeneration"], "text_config": {...},
//                "image_token_id": ..., "vision_config": {...}}
//
// The text model's fields come from text_config; the top level gives the image / video token ids
// that the engine refuses in prompts (ModelConfig::media_placeholders). Refuses
// what transformers 5.25 refuses and what the engine does not run, naming the field.
#pragma once

#include "absl/status/status.h"
#include "engine/config/model_config.h"
#include "model/config/config_file.h"

namespace exl3::engine {

absl::Status ReadQwen4ExpSection(const ConfigFile& file, ModelConfig* cfg);

}  // namespace exl3::engine
