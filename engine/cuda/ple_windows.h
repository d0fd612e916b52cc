// The n-gram windows of Qwen4-Exp's PLE layers on the GPU engine, built on the host (the n-gram
// rows are read there, engine/ple_layer.h): each token's window is its last ngram_size tokens, the
// chunk's own and before them the sequence's carried context, its last ngram_size − 1 tokens before
// the chunk (eos before position 0). The GPU engine keeps that context here per state slot, as the
// CPU engine keeps it in the slot's state: what a step leaves becomes current only once the step
// has succeeded (Commit), so a failed step leaves every context as it was.
//
//   PleWindows windows(cfg.qwen4exp->ple);
//   EXL3_RETURN_IF_ERROR(windows.Build(tokens, &w));   // w [T, ngram_size]
//   ... the step runs ...
//   windows.Commit();                                  // after it succeeded
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "engine/qwen4exp_config.h"
#include "engine/step_tokens.h"

namespace exl3::engine::cuda {

class PleWindows {
 public:
  explicit PleWindows(const PleConfig& ple) : ple_(ple) {}

  // windows [T, ngram_size] of the step's tokens, oldest first; the contexts the step's chunks leave
  // are kept until Commit (a Build drops those of a step that was not committed). A chunk that
  // resumes a sequence (start_position > 0) in a slot holding no context is refused.
  absl::Status Build(const StepTokens& tokens, std::vector<int32_t>* windows);
  void Commit();

 private:
  const PleConfig ple_;
  std::vector<std::vector<int32_t>> context_;  // by state slot: its last ngram_size − 1 tokens
  std::vector<std::pair<int, std::vector<int32_t>>> pending_;  // (slot, context) of the last Build
};

}  // namespace exl3::engine::cuda
