// exl3-speculative-cpu-bench: the engine-level speculative decoding benchmark
// (tools/exl3_bench/speculative_bench.h) on the CPU engine, with the drafter of a chosen
// acceptance rate (tools/exl3_bench/recorded_drafter.h): decode tokens/s against p and k, as
// exl3-engine-bench --speculative-acceptance measures the GPU engine.
//
//   exl3-speculative-cpu-bench --model DIR [--acceptance 0,0.5,0.7,0.9,1] [--k 1,2,3,4]
//       [--batch 1,8] [--prompt_tokens 256] [--decode_tokens 64] [--draft_length fixed|adaptive|goodput]
//       [--threads 0] [--json FILE]
#include <cstdio>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "base/command_line.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "engine/cpu/cpu_model.h"
#include "tools/exl3_bench/speculative_bench.h"

ABSL_FLAG(std::string, model, "", "the model directory (required)");
ABSL_FLAG(std::string, acceptance, "0,0.5,0.7,0.9,1", "the drafter's probabilities of a right draft token");
ABSL_FLAG(std::string, k, "1,2,3,4", "draft caps (num_speculative_tokens per request)");
ABSL_FLAG(std::string, batch, "1,8", "batch sizes (requests at once)");
ABSL_FLAG(int, prompt_tokens, 256, "random prompt tokens per request");
ABSL_FLAG(int, decode_tokens, 64, "greedy tokens per request");
ABSL_FLAG(std::string, draft_length, "fixed",
          "fixed, adaptive or goodput (engine/speculative/draft_length.h, engine/speculative/goodput_draft_choice.h)");
ABSL_FLAG(int, threads, 0, "CPU threads of the model (0: every hardware thread)");
ABSL_FLAG(std::string, json, "", "append one JSON object per row to this file");

namespace {

bool Parsed(absl::string_view part, double* v) { return absl::SimpleAtod(part, v); }
bool Parsed(absl::string_view part, int* v) { return absl::SimpleAtoi(part, v); }

template <typename T>
bool ParseList(const std::string& flag, const std::string& text, std::vector<T>& out) {
  out.clear();
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    T v;
    if (!Parsed(part, &v)) {
      std::fprintf(stderr, "exl3-speculative-cpu-bench: --%s: '%s' is not a%s number\n", flag.c_str(),
                   std::string(part).c_str(), std::is_integral_v<T> ? "n integer" : "");
      return false;
    }
    out.push_back(v);
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  namespace bench = exl3::bench;
  namespace engine = exl3::engine;
  exl3::ConfigureFlagsUsage("exl3-speculative-cpu-bench",
                            "exl3-speculative-cpu-bench --model DIR [--acceptance P,...] [--k K,...] [--batch B,...]\n"
                            "CPU engine tokens/s of speculative decoding at chosen acceptance rates "
                            "(bench/results/speculative-cpu.md).",
                            "tools/speculative_cpu_bench");
  absl::ParseCommandLine(argc, argv);
  const std::string model = absl::GetFlag(FLAGS_model);
  if (model.empty()) {
    std::fprintf(stderr, "exl3-speculative-cpu-bench: --model DIR is required\n");
    return 2;
  }
  bench::SpeculativeBenchOptions o;
  if (!ParseList("acceptance", absl::GetFlag(FLAGS_acceptance), o.acceptances) ||
      !ParseList("k", absl::GetFlag(FLAGS_k), o.ks) || !ParseList("batch", absl::GetFlag(FLAGS_batch), o.batches))
    return 2;
  o.prompt_tokens = absl::GetFlag(FLAGS_prompt_tokens);
  o.decode_tokens = absl::GetFlag(FLAGS_decode_tokens);
  absl::StatusOr<engine::DraftLengthPolicy> policy = engine::ParseDraftLengthPolicy(absl::GetFlag(FLAGS_draft_length));
  if (!policy.ok()) {
    std::fprintf(stderr, "exl3-speculative-cpu-bench: %s\n", policy.status().ToString().c_str());
    return 2;
  }
  o.draft_length = *policy;
  o.engine.kv_capacity = {engine::KvCacheCapacity::Unit::kTokens, 1 << 20};
  auto open = [&]() -> std::unique_ptr<engine::ModelRunner> {
    engine::CpuModelOptions mo;
    mo.num_threads = absl::GetFlag(FLAGS_threads);
    absl::StatusOr<std::unique_ptr<engine::CpuModel>> opened = engine::CpuModel::Open(model, mo);
    if (!opened.ok()) {
      std::fprintf(stderr, "exl3-speculative-cpu-bench: %s\n", opened.status().ToString().c_str());
      return nullptr;
    }
    return std::move(*opened);
  };
  absl::StatusOr<std::vector<bench::SpeculativeBenchRow>> rows = bench::RunSpeculativeBench(o, open);
  if (!rows.ok()) {
    std::fprintf(stderr, "exl3-speculative-cpu-bench: %s\n", rows.status().ToString().c_str());
    return 1;
  }
  FILE* json = absl::GetFlag(FLAGS_json).empty() ? nullptr : std::fopen(absl::GetFlag(FLAGS_json).c_str(), "a");
  bench::PrintSpeculativeBench(*rows, stdout, json);
  if (json != nullptr) std::fclose(json);
  return 0;
}
