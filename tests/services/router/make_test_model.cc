// exl3-test-model: writes a small GLM-style EXL3 MoE model directory with random trellis bits
// (tools/test_model/expert_test_model.h) for the router's process-level tests and benchmarks.
//   exl3-test-model DIR [--hidden 256] [--inter 128] [--layers 3] [--experts 8] [--top-k 2]
#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "services/common/flags.h"
#include "tools/test_model/expert_test_model.h"

ABSL_FLAG(int32_t, hidden, 256, "hidden size (multiple of 128)");
ABSL_FLAG(int32_t, inter, 128, "expert intermediate size (multiple of 128)");
ABSL_FLAG(int32_t, layers, 3, "layers (the first is dense)");
ABSL_FLAG(int32_t, experts, 8, "routed experts per MoE layer");
ABSL_FLAG(int32_t, top_k, 2, "experts per token");
ABSL_FLAG(int32_t, shared, 1, "shared experts (0: none)");
ABSL_FLAG(int32_t, seed, 1, "random seed");
ABSL_FLAG(bool, weight_digests, true,
          "write weights.digest.json (model/weight_digest.h): the fingerprint covers the weights");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("exl3-test-model DIR [--hidden H --inter I --layers L --experts E --top-k K]");
  std::vector<char*> dashed = exl3::svc::DashesToUnderscores(argc, argv);
  std::vector<char*> args = absl::ParseCommandLine(static_cast<int>(dashed.size()), dashed.data());
  if (args.size() != 2) {
    std::fprintf(stderr, "exl3-test-model: give exactly one output directory\n");
    return 2;
  }
  exl3::testing::ExpertModelSpec s;
  s.hidden = absl::GetFlag(FLAGS_hidden);
  s.intermediate = absl::GetFlag(FLAGS_inter);
  s.layers = absl::GetFlag(FLAGS_layers);
  s.experts = absl::GetFlag(FLAGS_experts);
  s.top_k = absl::GetFlag(FLAGS_top_k);
  s.shared = absl::GetFlag(FLAGS_shared);
  s.seed = static_cast<uint32_t>(absl::GetFlag(FLAGS_seed));
  s.weight_digests = absl::GetFlag(FLAGS_weight_digests);
  absl::Status st = exl3::testing::WriteExpertModel(args[1], s);
  if (!st.ok()) {
    std::fprintf(stderr, "exl3-test-model: %s\n", std::string(st.message()).c_str());
    return 1;
  }
  return 0;
}
