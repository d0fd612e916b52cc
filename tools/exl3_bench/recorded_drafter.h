// A benchmark drafter with a chosen acceptance rate (issue 31's "tokens/s against acceptance
// rate"): with random weights neither the n-gram nor the MTP drafter's acceptance means anything,
// so this one drafts from the continuation a first greedy run of the same prompt produced, each
// draft token that continuation's token with probability p and otherwise a different token.
// Under greedy decoding the verify step then accepts a draft exactly when it is the recorded
// token (the target emits the recorded continuation again), so a draft position is accepted with
// probability p, while the scheduler, the verify chunks and the rollback run as in serving
// (SpeculativeMethod::kProvided, engine/speculative/draft_proposer.h). Test and benchmark support only.
//
//   auto drafter = std::make_shared<RecordedDrafter>(/*acceptance=*/0.7, /*seed=*/1, vocab);
//   EXL3_RETURN_IF_ERROR(drafter->Record(prompt, first_run_tokens));
//   options.scheduler.speculative.method = SpeculativeMethod::kProvided;
//   options.scheduler.speculative.proposer = drafter;
//
// Whether the draft for output position i is right is a function of (seed, prompt, i) alone
// (the engine's counter-based mixing, base/mix64.h), so a run is reproducible and a position
// redrafted (after a preemption) gets the same draft. A wrong draft is the recorded token plus
// 1..vocab-1 (mod vocab). Past the recorded continuation, and for a prompt never recorded, no
// drafts. set_acceptance may change p between runs while no request runs.
#pragma once

#include <atomic>
#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "engine/speculative/draft_proposer.h"

namespace exl3::bench {

class RecordedDrafter final : public engine::DraftProposer {
 public:
  // 0 <= acceptance <= 1; vocab_size >= 2.
  RecordedDrafter(double acceptance, uint64_t seed, int vocab_size);

  // The continuation of `prompt` to draft from. INVALID_ARGUMENT for an empty prompt, a token
  // outside the vocabulary, or a prompt recorded already.
  absl::Status Record(std::span<const int32_t> prompt, std::span<const int32_t> continuation);
  void set_acceptance(double acceptance) { acceptance_.store(acceptance); }
  double acceptance() const { return acceptance_.load(); }

  std::vector<int32_t> Propose(std::span<const int32_t> prompt, std::span<const int32_t> output,
                               int max_drafts) const override;

 private:
  struct Recording {
    std::vector<int32_t> prompt;
    std::vector<int32_t> continuation;
  };
  static uint64_t PromptHash(std::span<const int32_t> prompt);
  const Recording* Find(std::span<const int32_t> prompt, uint64_t hash) const;

  std::atomic<double> acceptance_;
  const uint64_t seed_;
  const int vocab_size_;
  std::unordered_multimap<uint64_t, Recording> recordings_;  // by PromptHash
};

}  // namespace exl3::bench
