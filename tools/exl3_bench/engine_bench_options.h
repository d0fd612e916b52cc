// exl3-engine-bench's command line (tools/exl3_bench/engine_bench.cc), parsed and checked without
// a GPU so that CI tests it: the lists of contexts, batch sizes and micro-batch counts, and with
// --expert-map the map checked against the model (every routed expert of every MoE layer held by a
// worker, the shared expert's worker marked) before any GPU work starts.
//
//   absl::StatusOr<EngineBenchOptions> o = ParseEngineBenchArgs({"--model", dir, "--batch", "1,8"});
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace exl3::bench {

extern const char kEngineBenchUsage[];

struct EngineBenchOptions {
  bool help = false;
  std::string model, json;
  std::vector<int> contexts = {1024, 8192}, batches = {1, 8, 32, 64};
  bool batches_given = false;
  int steps = 16, prefill_chunk = 2048, runs = 30, max_moe_tokens = 0;
  bool graphs = true;
  bool verify_graphs = false;  // CudaModelOptions::verify_graphs
  bool attention_only = false;
  std::vector<int> attention_shape = {96, 8, 128};
  bool sampling_only = false;
  int sampling_vocab = 151552;
  // Remote experts (empty expert_map: every expert on this GPU). Each micro_batches value is one
  // run of the tables, the model opened anew (CudaModelOptions::micro_batches).
  std::string expert_map;
  std::vector<int> micro_batches = {1};
  std::string shared_expert = "local";  // local | worker:NAME | none, as exl3-router's flag
  int worker_shm_mb = 8;                // same-host workers' shared-memory channel (0: gRPC only)
  int ready_timeout_s = 120;            // for every expert to have a serving worker
  int moe_timeout_ms = 30000;           // one MoE layer through the router core
  // --speculative-acceptance: instead of the tables, speculative decoding through the Engine with
  // the recorded drafter (tools/exl3_bench/speculative_bench.h) at each acceptance p and draft cap
  // k, each --context a prompt length, each --batch a run, --steps greedy tokens per request.
  std::vector<double> speculative_acceptances;  // empty: not run
  std::vector<int> speculative_ks = {1, 2, 3, 4};  // --num-speculative-tokens
  std::string speculative_draft_length = "fixed";  // fixed | adaptive | goodput (--speculative-draft-length)
  // --constrained-tokenizer FILE: instead of the tables, decode steps through the Engine with every
  // sequence unconstrained and then constrained by a JSON schema compiled against FILE
  // (tools/exl3_bench/constraint_step_bench.h), each --context a prompt length, each --batch a run,
  // --steps full-batch decode steps per run. Empty: not run.
  std::string constrained_tokenizer;

  bool remote() const { return !expert_map.empty(); }
  bool speculative() const { return !speculative_acceptances.empty(); }
  bool constrained() const { return !constrained_tokenizer.empty(); }
};

// argv without the program name. Errors name the argument and what was wrong.
absl::StatusOr<EngineBenchOptions> ParseEngineBenchArgs(const std::vector<std::string>& args);

// With --expert-map: the map parses against the model directory's MoE layout and covers every
// routed expert; with --shared-expert worker:NAME, NAME is a worker of the map marked
// shared_expert (docs/expert-map.md). OK without a map.
absl::Status CheckBenchExpertMap(const EngineBenchOptions& options);

}  // namespace exl3::bench
