// A drafter that the program embedding the engine supplies (SpeculativeMethod::kProvided), for
// benchmarks and tests that need drafts of a known quality: with random weights the n-gram and
// MTP drafters' acceptance means nothing (tools/exl3_bench/recorded_drafter.h drafts from a
// recorded continuation, each token right with a chosen probability). Its drafts are verified
// exactly as the built-in drafters' are (engine/core/scheduler.h); no server flag selects it.
//
//   SpeculativeOptions s;
//   s.method = SpeculativeMethod::kProvided;
//   s.num_speculative_tokens = 3;
//   s.proposer = std::make_shared<MyProposer>();
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace exl3::engine {

class DraftProposer {
 public:
  virtual ~DraftProposer() = default;
  // At most max_drafts (>= 1) tokens to follow the sequence's prompt and its output so far.
  // Called on the engine's loop thread while the engine runs.
  virtual std::vector<int32_t> Propose(std::span<const int32_t> prompt, std::span<const int32_t> output,
                                       int max_drafts) const = 0;
};

}  // namespace exl3::engine
