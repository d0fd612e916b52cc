// What constrained decoding costs per engine step (issue 30: "the constraint mask's cost per step
// ... at batch 1 and 64: <= 10 % of the inter-token latency"), through the real Engine over the
// model runner a factory opens (exl3-engine-bench --constrained-tokenizer on the GPU engine; the
// CPU engine in tests). Per batch size B, two runs of B requests at once, each a random prompt of
// prompt_tokens tokens: first unconstrained, then every request constrained by the benchmarks' JSON
// schema (tools/exl3_bench/bench_json_schema.h), compiled as the router compiles response_format
// (TokenGrammarCompiler over the tokenizer.json, the model's vocab_size and EOS ids: ids past the
// tokenizer's are never allowed). Same sampling in both (temperature 1, a seed per request,
// ignore_eos), so the difference is the constraint's: on the GPU engine its rows' logits come back
// to the host, which fills the masks on a second thread during the forward pass and samples them
// (engine/core/engine.cc RunForward), where unconstrained rows are sampled on the device.
//
// What is measured: the engine's whole step (schedule, forward with the wait for the masks,
// sampling, bookkeeping: EngineObserver::OnStep's phases summed), median over the steps in which
// exactly the run's B sequences each decode one token and no prompt is prefilled ("full-batch
// steps"); decode tokens/s is B over that step. Steps with a prompt chunk or fewer sequences are
// counted but not measured. Each request's max_tokens is `steps` plus the steps the batch's
// prefills take, so the unconstrained run has about `steps` full-batch steps. A constrained
// request ends (kStop) when its grammar completes, ignore_eos or not; random weights wander
// through the grammar, so one may end early: it is then replaced by a new constrained request (a
// fresh prompt, max_tokens the tokens its slot has left) to keep the batch full; the replacement's
// prefill step and the step before it are not full-batch steps. Reported per run: requests,
// those their grammar ended, tokens per request, full-batch and other decode steps.
//
//   ConstraintStepBenchOptions o;  o.batches = {1, 64};  o.tokenizer_json = text;
//   EXL3_ASSIGN_OR_RETURN(ConstraintStepBenchResult r, RunConstraintStepBench(o, open_runner));
//   PrintConstraintStepBench(r, stdout, json);
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/core/engine.h"

namespace exl3::bench {

struct ConstraintStepBenchOptions {
  std::vector<int> batches = {1, 64};
  int prompt_tokens = 1024;
  int steps = 32;  // full-batch decode steps wanted per run (the unconstrained run gets about this many)
  uint64_t seed = 1;
  std::string tokenizer_json;  // the text of a tokenizer.json (required)
  std::string schema;          // empty: kBenchJsonSchema
  // The engine's own settings (block size, KV capacity, token budget). max_num_seqs is raised to
  // the largest batch, the prefix cache turned off (each run's prompts are new anyway).
  engine::EngineOptions engine;
};

// One run: B requests, unconstrained or constrained.
struct ConstraintStepRun {
  bool constrained = false;
  int max_tokens = 0;          // of each of the first B requests
  int requests = 0;            // submitted, replacements included
  int ended_by_grammar = 0;    // requests whose grammar completed (kStop)
  int tokens_min = 0, tokens_max = 0;
  double tokens_mean = 0;      // tokens per request
  int64_t decode_steps = 0;    // steps with any decode token
  int64_t full_batch_steps = 0;  // of those, the measured ones: B decode tokens, no prompt chunk
  // Medians over the full-batch steps (0 when there are none); each on its own, so forward and
  // sample need not add up to step.
  double step_s = 0, forward_s = 0, sample_s = 0;
  double seconds = 0;          // the first submission to the last request's end
};

struct ConstraintStepBenchRow {
  int batch = 0;
  ConstraintStepRun plain, constrained;
  // constrained.step_s - plain.step_s over plain.step_s; unset when either run had no full-batch step.
  std::optional<double> Share() const;
};

struct ConstraintStepBenchResult {
  int prompt_tokens = 0;
  int vocab_size = 0;                 // the model's: the masks' length
  double compiler_s = 0;              // TokenGrammarCompiler::FromTokenizerJson
  double schema_compile_s = 0;        // the schema's first compile
  std::vector<ConstraintStepBenchRow> rows;
};

// Each request's max_tokens at batch B: `steps` plus the steps B prompts of `prompt_tokens` take to
// prefill in steps of `token_budget` tokens of which the decoding sequences take up to B, plus one,
// so that the first request prefilled still decodes when the last one's first token comes.
int ConstraintStepMaxTokens(int batch, int prompt_tokens, int steps, int token_budget);

// Whether `text` is a tokenizer.json the grammar compiler takes for a model of `vocab_size`
// (INVALID_ARGUMENT naming `path` otherwise): a check before a model is opened.
absl::Status CheckConstraintTokenizer(const std::string& path, const std::string& text, int vocab_size);

// `open_runner` is called once. Errors: bad options (INVALID_ARGUMENT), the tokenizer or schema
// the compiler refuses (INVALID_ARGUMENT; UNIMPLEMENTED in a build without structured output), a
// prompt plus max_tokens past the model's context, the engine's start and a request's failure.
absl::StatusOr<ConstraintStepBenchResult> RunConstraintStepBench(
    const ConstraintStepBenchOptions& options,
    const std::function<std::unique_ptr<engine::ModelRunner>()>& open_runner);

// A Markdown table (two lines per batch, then the difference), and with `json` one JSON object per
// batch ("bench":"engine_constraint_step"); `label` is added to the JSON as "experts" when set.
void PrintConstraintStepBench(const ConstraintStepBenchResult& result, FILE* out, FILE* json = nullptr,
                              const std::string& label = "");

}  // namespace exl3::bench
