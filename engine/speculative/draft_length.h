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
//   DraftLength d(DraftLengthPolicy::kAdaptive, /*cap=*/4);
//   int k = d.limit();                 // drafts to ask the drafter for
//   d.Observe(/*drafted=*/k, /*accepted=*/1);
#pragma once

#include "engine/speculative/speculative_options.h"

namespace exl3::engine {

class DraftLength {
 public:
  static constexpr double kAcceptanceWeight = 0.5;
  static constexpr double kShrinkBelow = 0.25;
  static constexpr double kGrowAbove = 0.6;

  DraftLength() = default;
  // cap >= 0 (0: this sequence never drafts).
  DraftLength(DraftLengthPolicy policy, int cap) : policy_(policy), cap_(cap), k_(cap) {}

  // The drafts the sequence may get in its next step: 0..cap.
  int limit() const { return k_; }
  int cap() const { return cap_; }
  // The moving average above (1 until the first verify chunk).
  double acceptance() const { return acceptance_; }
  // A verify chunk of `drafted` >= 1 drafts accepted `accepted` of them.
  void Observe(int drafted, int accepted);

 private:
  DraftLengthPolicy policy_ = DraftLengthPolicy::kFixed;
  int cap_ = 0;
  int k_ = 0;
  double acceptance_ = 1.0;
};

}  // namespace exl3::engine
