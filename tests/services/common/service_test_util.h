// Test helpers for the services: temp dirs, free ports, request builders and the CPU reference
// output of a worker request. Their model on disk: tools/test_model/expert_test_model.h
// (ServiceModelSpec, WriteExpertModel).
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "exl3serve/v1/exl3serve.pb.h"

namespace exl3::testing {

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
