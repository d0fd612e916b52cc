// The n-gram windows of Qwen4-Exp's PLE layers on the GPU engine, built on the host (the n-gram
// rows are read there, engine/cpu/residual/ple_layer.h): each token's window is its last ngram_size tokens, the
// chunk's own and before them the sequence's carried context, its last ngram_size − 1 tokens before
// the chunk (eos before position 0). The GPU engine keeps that context here per state slot, as the
// CPU engine keeps it in the slot's state: what a step leaves becomes current only once the step
// has succeeded (Commit), so a failed step leaves every context as it was.
//
// Verify chunks (speculative decoding) keep the context after each of their last
// KeptStatesOf(chunk) tokens (engine/cpu/sequence_state.h), as the recurrent store keeps a state per
// kept length: the sequence's next chunk continues the one its start position names (the length
// the scheduler kept), as if the rejected drafts had never run.
//
//   PleWindows windows(cfg.qwen4exp->ple);
//   EXL3_RETURN_IF_ERROR(windows.Build(tokens, &w));   // w [T, ngram_size]
//   ... the step runs ...
//   windows.Commit();                                  // after it succeeded
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "engine/config/qwen4exp_config.h"
#include "engine/core/step_tokens.h"

namespace exl3::engine::cuda {

class PleWindows {
 public:
  explicit PleWindows(const PleConfig& ple) : ple_(ple) {}

  // windows [T, ngram_size] of the step's tokens, oldest first; the contexts the step's chunks leave
  // are kept until Commit (a Build drops those of a step that was not committed). A chunk that
  // resumes a sequence (start_position > 0) at a length its slot holds no context of is refused.
  absl::Status Build(const StepTokens& tokens, std::vector<int32_t>* windows);
  void Commit();

 private:
  // The contexts a slot holds for its sequence: after first_length + i of its tokens in contexts[i]
  // (one length but after a verify chunk), each its last ngram_size − 1 tokens.
  struct Held {
    int64_t sequence_id = 0;
    int first_length = 0;
    std::vector<std::vector<int32_t>> contexts;
  };

  const PleConfig ple_;
  std::vector<std::optional<Held>> held_;      // by state slot
  std::vector<std::pair<int, Held>> pending_;  // (slot, what it will hold) from the last Build
};

}  // namespace exl3::engine::cuda
