// The configuration sections of the latent-attention families: DeepSeek-V3 (multi-head latent
// attention, engine/cpu/attention/mla_attention.h) and GLM-5 (GlmMoeDsaForCausalLM: MLA whose queries see the
// top-k positions of a lightning indexer, engine/cpu/attention/dsa_attention.h). Each reads the MLA shape, its
// rope over the rope head (interleaved pairs) and sets the softmax scale (DeepSeek's mscale under
// a scaled rope).
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/config/model_config.h"
#include "model/config/config_file.h"

namespace exl3::engine {

absl::Status ReadDeepseekV3Section(const ConfigFile& file, ModelConfig* cfg);
absl::Status ReadGlmMoeDsaSection(const ConfigFile& file, ModelConfig* cfg);

// Indexer modes per layer as GlmMoeDsaConfig and Glm5NextTextConfig decide them: `indexer_types`
// ("full" / "shared" per layer) when given; else `index_topk_pattern` (a string of F / S, or such
// a list); else layer i is full when max(i - index_skip_topk_offset + 1, 0) is a multiple of
// index_topk_freq (defaults 2 and 1: every layer full). Which layers may be shared is the
// family's check.
absl::StatusOr<std::vector<IndexerMode>> IndexerModes(const nlohmann::json& j, int num_layers,
                                                      const std::string& source);

}  // namespace exl3::engine
