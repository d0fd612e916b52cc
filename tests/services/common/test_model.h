// Test helpers for the services: a small random EXL3 MoE model on disk (GLM-style config.json,
// random trellis bits, mixed bit widths and codebooks), temp dirs, free ports, request builders
// and the CPU reference output of a worker request.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "exl3serve/v1/exl3serve.pb.h"

namespace exl3::testing {

struct TestModelSpec {
  int hidden = 256;
  int intermediate = 128;
  int layers = 3;           // layer 0 is dense (first_k_dense_replace = 1)
  int experts = 8;
  int top_k = 4;
  uint32_t seed = 1234;
  std::vector<int> skip_experts;  // expert ids whose tensors are left out of every layer
};

// Writes config.json + model.safetensors into `dir` (created if needed).
absl::Status WriteTestModel(const std::string& dir, const TestModelSpec& spec);

// A fresh directory under $TMPDIR (or /tmp), removed with everything in it on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A TCP port on 127.0.0.1 that was free a moment ago.
int FreePort();

// Random hidden states [T, H] in roughly N(0, 1).
std::vector<float> RandomHidden(std::mt19937& rng, int T, int H);

// Routing for T tokens with S slots drawn from `experts` (distinct per token, padded with -1 at
// random places when fewer than S are used); weights positive in (0.05, 1).
void RandomRouting(std::mt19937& rng, int T, int S, const std::vector<int>& experts, int max_used,
                   std::vector<int32_t>* ids, std::vector<float>* weights);

// An ExpertRequest with fp32 hidden states.
::exl3serve::v1::ExpertRequest MakeRequest(uint64_t id, int layer, const std::vector<float>& x,
                                           int T, int H, int S, const std::vector<int32_t>& ids,
                                           const std::vector<float>& weights);

// The response output as fp32 (any wire dtype).
std::vector<float> OutputAsFloat(const ::exl3serve::v1::ExpertResponse& r);

}  // namespace exl3::testing
