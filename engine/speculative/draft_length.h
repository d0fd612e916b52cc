// Speculative decoding's draft length per sequence: how many drafts a decoding sequence may get
// in its next step. Its cap is the server's num_speculative_tokens, or less where the request
// asks (GenerateParams::num_speculative_tokens; 0: no drafts at all). With
// DraftLengthPolicy::kFixed it gets its cap every step (as vLLM and SGLang draft by default).
//
// With kAdaptive each sequence keeps its own K in 1..cap from how its own drafts fared, so a
// sequence whose drafts keep failing stops paying for verify positions (each costs a row of
// compute in the step, and at large batches compute is what the step lacks), while one whose
// drafts land keeps all of them. The rule, after each verify chunk of d >= 1 drafts of which a
// were accepted:
//
//   acceptance = (1 - kAcceptanceWeight) * acceptance + kAcceptanceWeight * a / d
//   acceptance <  kShrinkBelow: K = max(1, K - 1)
//   acceptance >  kGrowAbove:   K = min(cap, K + 1)
//
// acceptance (an exponential moving average of the accepted fraction) starts at 1, so a new
// sequence drafts its whole cap. With each draft right with probability q, independently, and a
// cap of 4 (simulated, 20000 verify chunks): q = 0.9 keeps K at 4 in 97 % of the steps; q = 0.7
// in 59 % (3 in 22 %); q = 0.5 spreads over 1..4 (mean 2.1); q = 0.3 sits at 1 in 73 %; drafts
// always rejected reach K = 1 after 5 verify chunks and stay there (one draft, never none, so a
// sequence whose drafts start landing again grows back). Steps in which a sequence gets no
// drafts (no n-gram match, no budget left) change nothing.
//
// With kGoodput the scheduler chooses each step's drafts for all decoding sequences at once
// (engine/speculative/goodput_draft_choice.h), 0..cap each; limit() is the cap, and this class
// keeps what that choice needs of the sequence:
//   - draft_acceptance(): the chance that a draft is right given that the drafts before it were,
//     estimated as accepted / tested, both exponential moving averages over verify chunks (weight
//     kDraftAcceptanceWeight), where a chunk of d drafts with a accepted tested a + 1 drafts
//     (a < d: the first wrong one; those after it tell nothing) or d (a = d). Both start at 1, so
//     the estimate starts at 1 (every sequence drafts until its drafts are seen to fail). Not the
//     accepted fraction a / d, which is lower than this chance for d > 1 (with each draft right
//     with probability 0.7, 3 drafts accept 0.51 of them on average).
//   - probe_due(): its probe interval's decode steps in a row without a verify chunk (the choice
//     gave it none, or it had no drafts), after which the scheduler's next probe step gives it
//     one draft: only verify chunks update its estimate, so a sequence the choice turned off
//     would otherwise never come back. The interval starts at kProbeInterval and doubles, up to
//     kMaxProbeInterval, with each probe (one draft while due) the choice did not follow up; it
//     is kProbeInterval again once the choice gives it drafts of its own accord. A batch whose
//     drafts do not pay (where a drafted step costs the most, as on a GPU replaying plain steps
//     from CUDA graphs) thus spends ever fewer steps on probes.
//
//   DraftLength d(DraftLengthPolicy::kAdaptive, /*cap=*/4);
//   int k = d.limit();                 // drafts to ask the drafter for
//   d.Observe(/*drafted=*/k, /*accepted=*/1);
//   d.ObserveStepWithoutDrafts();      // kGoodput: a decode step that verified none
#pragma once

#include "engine/speculative/speculative_options.h"

namespace exl3::engine {

class DraftLength {
 public:
  static constexpr double kAcceptanceWeight = 0.5;
  static constexpr double kShrinkBelow = 0.25;
  static constexpr double kGrowAbove = 0.6;
  // kGoodput: the estimate's weight per verify chunk (lower than kAcceptanceWeight: the choice
  // weighs small differences of it against the step's cost).
  static constexpr double kDraftAcceptanceWeight = 0.25;
  // kGoodput: decode steps without a verify chunk before a probe is due, at first and at most
  // (above). The scheduler probes every kProbeInterval-th step, all due sequences together.
  static constexpr int kProbeInterval = 16;
  static constexpr int kMaxProbeInterval = 128;

  DraftLength() = default;
  // cap >= 0 (0: this sequence never drafts).
  DraftLength(DraftLengthPolicy policy, int cap) : policy_(policy), cap_(cap), k_(cap), chain_limit_(cap) {}

  // The drafts the sequence may get in its next step: 0..cap (kGoodput: its cap; the scheduler's
  // choice gives it 0..limit).
  int limit() const { return k_; }
  int cap() const { return cap_; }
  // The moving average above (1 until the first verify chunk).
  double acceptance() const { return acceptance_; }
  // kGoodput's estimate above (1 until the first verify chunk).
  double draft_acceptance() const { return accepted_average_ / tested_average_; }
  // A verify chunk of `drafted` >= 1 drafts accepted `accepted` of them.
  void Observe(int drafted, int accepted);

  // kGoodput: a decode step that verified no drafts; and whether the next step must give one.
  void ObserveStepWithoutDrafts() { ++steps_without_drafts_; }
  bool probe_due() const {
    return policy_ == DraftLengthPolicy::kGoodput && cap_ >= 1 && steps_without_drafts_ >= probe_interval_;
  }
  int probe_interval() const { return probe_interval_; }
  // kGoodput: the drafts the choice gave it at its last decode step (what the engine's mean draft
  // length gauge shows), and setting it.
  int chosen() const { return chosen_; }
  void set_chosen(int drafts);
  // The drafts a drafter that pays for each one (the MTP head: every draft after the first is a
  // chained position of its layer) should make for the next step: limit(), but with kGoodput one
  // more than the last choice gave (at most the cap; the cap before any choice), since the next
  // choice rarely takes more: a sequence the choice turned off costs no chained positions, and
  // one whose drafts start landing grows by one draft a step.
  int chained_draft_limit() const { return policy_ == DraftLengthPolicy::kGoodput ? chain_limit_ : k_; }

 private:
  DraftLengthPolicy policy_ = DraftLengthPolicy::kFixed;
  int cap_ = 0;
  int k_ = 0;
  double acceptance_ = 1.0;
  double accepted_average_ = 1.0;  // draft_acceptance's averages
  double tested_average_ = 1.0;
  int steps_without_drafts_ = 0;
  int probe_interval_ = kProbeInterval;
  int chosen_ = 0;
  int chain_limit_ = 0;  // chained_draft_limit() under kGoodput
};

}  // namespace exl3::engine
