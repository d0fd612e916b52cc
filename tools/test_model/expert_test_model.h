// The tests' small EXL3 expert models: only the MoE layers' tensors (routed experts, shared
// experts, router, correction bias, Qwen3-Next's shared-expert gate), random trellis bits and
// signs, in two shards (layer L in shard L % 2) with model.safetensors.index.json, and a short
// config.json of the family's MoE fields (GlmConfig by default). Routed experts mix K and
// codebooks: gate K 2..4 by expert (MCG), up K 3 (3INST), down K 2 (MUL1); shared experts K 4 MCG.
// The model, engine and services tests load them (the exl3-test-model binary writes one for the
// router's process tests); the family models of exl3-tool make-test-model are test_model.h's.
//
// Their values come from one std::mt19937 stream through the tensors in order
// (generated_tensor.h's InOrderTensorValues), so a spec and seed give the bytes they always have.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "nlohmann/json.hpp"
#include "tools/test_model/exl3_linear_tensors.h"

namespace exl3::testing {

struct ExpertModelSpec {
  int hidden = 256;
  int intermediate = 128;  // routed (and shared) expert's intermediate size
  int layers = 3;
  int first_dense = 1;
  int experts = 8;
  int top_k = 2;
  int shared = 1;  // n_shared_experts
  float scale = 2.5f;
  float swiglu_limit = 0.0f;
  bool packed_signs = false;  // su/sv instead of suh/svh
  uint32_t seed = 1;
  std::vector<int> skip_experts;  // routed experts whose tensors are left out of every layer
  // Tensor names for which `skip` returns true are left out (their values still drawn);
  // `shape_override` may change the trellis shape of one layer (return true after editing
  // `shape`).
  std::function<bool(const std::string&)> skip;
  TrellisShapeOverride shape_override;
  // Also write weights.digest.json (model/weight_digest.h), as exl3-tool quantize does.
  bool weight_digests = false;
};

// config.json of the families' layouts (Qwen3-Next: shared expert with gate; Mixtral:
// block_sparse_moe keys, no shared expert; GLM: sigmoid routing, dense first layers).
nlohmann::json Qwen3NextConfig(const ExpertModelSpec& s);
nlohmann::json MixtralConfig(const ExpertModelSpec& s);
nlohmann::json GlmConfig(const ExpertModelSpec& s);

// The services tests' model: GLM-style, layer 0 dense, top-4 of 8 experts, no shared expert,
// unscaled routing.
ExpertModelSpec ServiceModelSpec();

// Writes config.json (`config`, default GlmConfig(spec)) and the two shards into `dir`. hidden
// and intermediate must be multiples of 16 (the trellis tile).
absl::Status WriteExpertModel(const std::string& dir, const ExpertModelSpec& spec,
                              const nlohmann::json* config = nullptr);

}  // namespace exl3::testing
