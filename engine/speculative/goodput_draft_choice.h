// The goodput draft length (DraftLengthPolicy::kGoodput): how many of its drafts each decoding
// sequence verifies in the step being built, chosen to maximise the step's expected tokens per
// second (its "goodput") under the step cost learned so far (engine/speculative/step_cost_model.h).
//
// A sequence whose drafts are each right with probability q (given the ones before it were)
// yields, besides its own token, q + q^2 + ... + q^k expected tokens from k drafts: its j-th
// draft adds q^j. Every draft row adds one row to the step. So, with E0 the tokens the step
// yields without drafts and R0 its rows, giving the step D draft rows in all yields at best
// E(D) = E0 + the D largest gains q_i^j (each sequence's first, then its second, ... as its
// gains only fall) in a step of predicted time T(R0 + D) (never less than at fewer rows, whatever
// dips the learned curve has from noise). The choice takes the D in [0, max_drafts] with the
// highest E(D) / T(R0 + D) (the smallest such D on a tie or a gain within rounding): where rows
// are nearly free (a memory-bound step) drafts are taken while they add anything; where each
// row costs its share of the step (compute-bound, large batches) only drafts likely to land
// (q^j above the step's tokens per row) are. The best D over all of [0, max_drafts] rather than
// the first where the ratio stops rising, as a learned cost curve can have plateaus.
//
// Where the cost model has no estimate for the step without drafts (nothing observed near its
// rows, or nothing observed at all), the step gets no drafts besides probes: its time is then
// observed, and the next such step can be weighed. Where it has one but none for a larger row
// count, that count's time is the nearest observed point's: a row count beyond what was seen
// looks as cheap as the largest seen, so the choice drafts there, the step's time is observed,
// and the next choice knows (exploring optimistically, as each sequence's q starts at 1).
// A scheduler whose steps' times nobody reports (Scheduler::ObserveStepTime) thus never drafts
// with this policy.
//
// A candidate marked `probe` (DraftLength::probe_due: no verify chunk for
// DraftLength::kProbeInterval of its decode steps) gets one draft whatever the gains say, so
// that its q, which only verify chunks update, can rise again once its drafts start landing.
// Probes are counted in E0 and R0 before the choice; the budget (max_drafts) goes to them first,
// in candidate order.
//
//   std::vector<DraftCandidate> c = {{/*acceptance=*/0.9, /*limit=*/3, /*probe=*/false}, ...};
//   std::vector<int> counts = ChooseDraftCounts(cost, {/*base_rows=*/64, /*base_tokens=*/64,
//                                                      /*max_drafts=*/192}, c);
#pragma once

#include <span>
#include <vector>

#include "engine/speculative/step_cost_model.h"

namespace exl3::engine {

struct DraftCandidate {
  double acceptance = 1;  // q in [0, 1]: DraftLength::draft_acceptance
  int limit = 0;          // the most drafts it may get this step (the drafts it has), >= 0
  bool probe = false;     // it gets one draft (where limit >= 1) whatever the gains say
};

struct DraftStep {
  int base_rows = 0;    // the step's rows without drafts
  int base_tokens = 0;  // the tokens it yields without drafts: its chunks that sample one
  int max_drafts = 0;   // the most draft rows it may take in all (the token budget left)
};

// counts[i]: candidate i's drafts, 0..candidates[i].limit, summing to at most step.max_drafts.
std::vector<int> ChooseDraftCounts(const StepCostModel& cost, const DraftStep& step,
                                   std::span<const DraftCandidate> candidates);

}  // namespace exl3::engine
