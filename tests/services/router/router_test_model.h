// The whole model the router's Generation tests serve on the CPU engine.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "tools/test_model/test_model.h"

namespace exl3::testing {

// A whole glm4_moe model: 2 layers (the first dense), hidden 256, 4 experts top-2, one shared
// expert, 4 heads, vocabulary 256, EXL3 at K=3.
inline absl::Status WriteRouterTestModel(const std::string& dir) {
  TestModelSpec spec;
  spec.arch = "glm4_moe";
  spec.layers = 2;
  spec.hidden = 256;
  spec.experts = 4;
  spec.top_k = 2;
  spec.heads = 4;
  spec.vocab = 256;
  SyntheticOptions so;
  so.whole_model = true;
  so.bits = 3;
  so.progress = false;
  return WriteSyntheticExl3Model(spec, so, dir);
}

}  // namespace exl3::testing
