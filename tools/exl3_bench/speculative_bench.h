// The engine-level speculative decoding benchmark (issue 31's "tokens/s against acceptance
// rate" and "the verify step's cost against k"): one Engine (the scheduler, verify chunks,
// rollback and sampling as in serving) over the model runner a factory opens, with the
// recorded drafter (tools/exl3_bench/recorded_drafter.h) as SpeculativeMethod::kProvided. Per
// batch size B: B random prompts of prompt_tokens tokens, each decoding decode_tokens greedy
// tokens, all at once; first plain (each request's num_speculative_tokens = 0), which records
// the continuations, then for each acceptance p and each draft cap k the same requests with
// num_speculative_tokens = k. Reported per run: decode tokens/s (tokens after each request's
// first, over the time from the first first-token to the last token), the mean step and verify
// step time, drafts and accepted drafts, and how many requests' tokens differ from the plain
// run's (speculation must not change greedy output: the CPU engine's test expects none; on the
// GPU a verify chunk runs other kernels than a decode step, so a near-tie of random weights could
// flip, which the row shows rather than ending the benchmark). The prefix cache is off: each run
// prefills its prompts anew, as the plain run did.
//
//   SpeculativeBenchOptions o;  o.batches = {1, 8};  o.acceptances = {0, 0.7, 1};  o.ks = {1, 3};
//   EXL3_ASSIGN_OR_RETURN(std::vector<SpeculativeBenchRow> rows, RunSpeculativeBench(o, open_runner));
//   PrintSpeculativeBench(rows, stdout);
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/core/engine.h"

namespace exl3::bench {

struct SpeculativeBenchOptions {
  std::vector<int> batches = {1, 8, 32};
  std::vector<double> acceptances = {0.0, 0.5, 0.7, 0.9, 1.0};  // each in [0, 1]
  std::vector<int> ks = {1, 2, 3, 4};                            // draft caps, >= 1
  int prompt_tokens = 256;
  int decode_tokens = 64;
  uint64_t seed = 1;
  engine::DraftLengthPolicy draft_length = engine::DraftLengthPolicy::kFixed;
  // The engine's own settings (block size, KV capacity, token budget); its speculative options
  // are set here. max_num_seqs is raised to the largest batch.
  engine::EngineOptions engine;
};

struct SpeculativeBenchRow {
  int batch = 0;
  int k = 0;                // 0: the plain run
  double acceptance = 0;    // the drafter's p (plain run: 0)
  double decode_tokens_per_s = 0;  // while every request decodes (no prompt prefilled meanwhile)
  double seconds = 0;       // first submission to the last request's end
  int64_t steps = 0;
  int64_t verify_steps = 0;    // steps with at least one verify chunk
  double mean_step_s = 0;      // forward + sampling, over the steps that decode and prefill nothing
  double mean_verify_step_s = 0;
  // What the measured steps give if every draft is accepted with probability p (the recorded
  // drafter's acceptance falls below p once a request leaves the recorded tokens): plain, batch /
  // mean step; fixed k, batch x (1 - p^(k+1)) / (1 - p) / mean verify step. 0 where not modelled
  // (adaptive draft length, no verify step).
  double modeled_tokens_per_s = 0;
  int64_t draft_tokens = 0, accepted_tokens = 0;
  int requests_differing = 0;  // requests whose tokens differ from the plain run's
  // Over the requests that differ: the plain run's top-2 logprob gap at the first token that
  // differs, the largest (a near-tie goes either way between a verify row's prefill kernels and a
  // decode row's kernels; a wide gap is a wrong token). -1 when none differ.
  double widest_gap_at_difference = -1;
};

// `open_runner` is called once. Errors: bad options (INVALID_ARGUMENT), the engine's start and a
// request's failure.
absl::StatusOr<std::vector<SpeculativeBenchRow>> RunSpeculativeBench(
    const SpeculativeBenchOptions& options, const std::function<std::unique_ptr<engine::ModelRunner>()>& open_runner);

// A Markdown table of the rows, and with `json` one JSON object per row ("bench":"engine_speculative").
void PrintSpeculativeBench(const std::vector<SpeculativeBenchRow>& rows, FILE* out, FILE* json = nullptr);

}  // namespace exl3::bench
