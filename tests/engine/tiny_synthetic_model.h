// The smallest whole synthetic model the engine tests run through an Engine with a real
// tokenizer (glm4_moe, 2 layers, 4 routed experts top-2; the test tokenizer's vocabulary): the
// structured-output test (tests/engine/sampling/structured_output_test.cc) and the constraint
// step benchmark's (tests/tools/constraint_step_bench_test.cc).
#pragma once

#include <filesystem>

#include "absl/status/status.h"
#include "tools/test_model/test_model.h"

namespace exl3::engine::testing {

// Writes the model into `dir` (removed first).
inline absl::Status WriteTinySyntheticModel(const std::filesystem::path& dir) {
  TestModelSpec spec;
  spec.arch = "glm4_moe";
  spec.layers = 2;
  spec.experts = 4;
  spec.top_k = 2;
  SyntheticOptions so;
  so.whole_model = true;
  so.progress = false;
  so.threads = 2;
  std::filesystem::remove_all(dir);
  return WriteSyntheticExl3Model(spec, so, dir.string());
}

}  // namespace exl3::engine::testing
