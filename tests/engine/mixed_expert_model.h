// A small synthetic glm4_moe model (3 layers, 8 routed experts top-4, hidden 256) whose routed
// experts cycle K 2/3/4 and codebooks MCG/3INST (SyntheticOptions' per-expert cycles): the CPU
// model's test (tests/engine/cpu/synthetic_model_test.cc) and the GPU model's against it
// (tests/engine/cuda/cuda_model_test.cc) use the same one.
#pragma once

#include <filesystem>
#include <string>

#include "absl/status/status.h"
#include "tools/test_model/test_model.h"

namespace exl3::engine::testing {

inline TestModelSpec MixedExpertModelSpec() {
  TestModelSpec spec;
  spec.arch = "glm4_moe";
  spec.layers = 3;
  spec.hidden = 256;
  spec.experts = 8;
  spec.top_k = 4;
  spec.heads = 4;
  spec.vocab = 256;
  return spec;
}

// Writes the model into `dir` (removed first).
inline absl::Status WriteMixedExpertModel(const std::filesystem::path& dir) {
  SyntheticOptions so;
  so.whole_model = true;
  so.bits = 4;
  so.expert_bits_cycle = {2, 3, 4};
  so.expert_codebook_cycle = {Codebook::kMcg, Codebook::k3Inst};
  so.progress = false;
  std::filesystem::remove_all(dir);
  return WriteSyntheticExl3Model(MixedExpertModelSpec(), so, dir.string());
}

}  // namespace exl3::engine::testing
